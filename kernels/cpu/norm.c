/*
 * norm.c — RMSNorm over the last dim, forward and backward (CPU).
 *
 * y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); add_rmsnorm first
 * forms the residual sum h = x + res in the same pass (one read of h saved
 * per norm of a transformer block). The sum of squares
 * and the backward's row dot product are accumulated in double even for f32
 * input: it costs one conversion per element and keeps the statistic exact
 * enough at any width. Each body is written once as a macro and stamped out
 * for float and double.
 */
#include <math.h>

#include "cpu.h"

/* Below this many elements a parallel region costs more than it saves. */
#define NORM_PAR_MIN 32768
/* Columns per dw task: 128 double accumulators (1 KiB) stay in L1 while a
 * thread streams every row of its column block. */
#define NORM_DW_BLOCK 128

#define DEF_RMSNORM(T, SFX)                                                                                           \
  static void rmsnorm_##SFX(int64_t rows, int64_t dim, double eps, const T *restrict x, const T *restrict w,          \
                            T *restrict y, T *restrict rstd) {                                                        \
    int par = rows > 1 && rows * dim >= NORM_PAR_MIN;                                                                 \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t r = 0; r < rows; r++) {                        \
      const T *xr = x + r * dim;                                                                                      \
      T *yr = y + r * dim;                                                                                            \
      double ss = 0;                                                                                                  \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t j = 0; j < dim; j++) ss += (double)xr[j] * xr[j];            \
      T rs = (T)(1.0 / sqrt(ss / (double)dim + eps));                                                                 \
      rstd[r] = rs;                                                                                                   \
      for (int64_t j = 0; j < dim; j++) yr[j] = xr[j] * rs * w[j];                                                    \
    }                                                                                                                 \
  }                                                                                                                   \
                                                                                                                      \
  /* h = x + res, then the same as rmsnorm_##SFX on h: bit-identical to the add and the norm run apart. */           \
  static void add_rmsnorm_##SFX(int64_t rows, int64_t dim, double eps, const T *restrict x, const T *restrict res,    \
                                const T *restrict w, T *restrict h, T *restrict y, T *restrict rstd) {                \
    int par = rows > 1 && rows * dim >= NORM_PAR_MIN;                                                                 \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t r = 0; r < rows; r++) {                        \
      const T *xr = x + r * dim, *rr = res + r * dim;                                                                 \
      T *hr = h + r * dim, *yr = y + r * dim;                                                                         \
      double ss = 0;                                                                                                  \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t j = 0; j < dim; j++) {                                       \
        T v = xr[j] + rr[j];                                                                                          \
        hr[j] = v;                                                                                                    \
        ss += (double)v * v;                                                                                          \
      }                                                                                                               \
      T rs = (T)(1.0 / sqrt(ss / (double)dim + eps));                                                                 \
      rstd[r] = rs;                                                                                                   \
      for (int64_t j = 0; j < dim; j++) yr[j] = hr[j] * rs * w[j];                                                    \
    }                                                                                                                 \
  }                                                                                                                   \
                                                                                                                      \
  /* dx = rstd * (w*dy - x * rstd^2 * sum(dy*w*x) / dim); dw += sum over rows of dy * x * rstd.                       \
   * dx is parallel over rows; dw over column blocks, each column summed over all rows in row order                   \
   * (in double), so dw is bit-identical whatever the thread count and needs no scratch memory. */                    \
  static void rmsnorm_backward_##SFX(int64_t rows, int64_t dim, const T *restrict x, const T *restrict w,             \
                                     const T *restrict rstd, const T *restrict dy, T *restrict dx,                    \
                                     T *restrict dw, int acc) {                                                       \
    int64_t nblocks = (dim + NORM_DW_BLOCK - 1) / NORM_DW_BLOCK;                                                      \
    int par = (rows > 1 || nblocks > 1) && rows * dim >= NORM_PAR_MIN;                                                \
    _Pragma("omp parallel if (par)") {                                                                                \
      _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) {                                        \
        const T *xr = x + r * dim, *dyr = dy + r * dim;                                                               \
        T *dxr = dx + r * dim;                                                                                        \
        double dot = 0;                                                                                               \
        _Pragma("omp simd reduction(+ : dot)") for (int64_t j = 0; j < dim; j++) dot +=                               \
            (double)dyr[j] * w[j] * xr[j];                                                                            \
        double rs = (double)rstd[r];                                                                                  \
        T a = (T)rs, c = (T)(rs * rs * rs * dot / (double)dim);                                                       \
        if (acc)                                                                                                      \
          for (int64_t j = 0; j < dim; j++) dxr[j] = dxr[j] + (a * w[j] * dyr[j] - xr[j] * c);                        \
        else                                                                                                          \
          for (int64_t j = 0; j < dim; j++) dxr[j] = a * w[j] * dyr[j] - xr[j] * c;                                   \
      }                                                                                                               \
      if (dw) {                                                                                                       \
        _Pragma("omp for schedule(static)") for (int64_t b = 0; b < nblocks; b++) {                                   \
          int64_t j0 = b * NORM_DW_BLOCK;                                                                             \
          int64_t n = dim - j0 < NORM_DW_BLOCK ? dim - j0 : NORM_DW_BLOCK;                                            \
          double acc[NORM_DW_BLOCK];                                                                                  \
          for (int64_t j = 0; j < n; j++) acc[j] = 0;                                                                 \
          for (int64_t r = 0; r < rows; r++) {                                                                        \
            const T *xr = x + r * dim + j0, *dyr = dy + r * dim + j0;                                                 \
            double rs = (double)rstd[r];                                                                              \
            for (int64_t j = 0; j < n; j++) acc[j] += (double)dyr[j] * xr[j] * rs;                                    \
          }                                                                                                           \
          for (int64_t j = 0; j < n; j++) dw[j0 + j] = (T)((double)dw[j0 + j] + acc[j]);                              \
        }                                                                                                             \
      }                                                                                                               \
    }                                                                                                                 \
  }

DEF_RMSNORM(float, f32)
DEF_RMSNORM(double, f64)

tt_status tt_cpu_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *w, void *y,
                         void *rstd) {
  switch (dtype) {
  case TT_F32: rmsnorm_f32(rows, dim, eps, x, w, y, rstd); return TT_OK;
  case TT_F64: rmsnorm_f64(rows, dim, eps, x, w, y, rstd); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}

tt_status tt_cpu_add_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                             const void *w, void *h, void *y, void *rstd) {
  switch (dtype) {
  case TT_F32: add_rmsnorm_f32(rows, dim, eps, x, res, w, h, y, rstd); return TT_OK;
  case TT_F64: add_rmsnorm_f64(rows, dim, eps, x, res, w, h, y, rstd); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}

tt_status tt_cpu_rmsnorm_backward(int dtype, int64_t rows, int64_t dim, const void *x, const void *w,
                                  const void *rstd, const void *dy, void *dx, void *dw, int dx_accumulate) {
  switch (dtype) {
  case TT_F32: rmsnorm_backward_f32(rows, dim, x, w, rstd, dy, dx, dw, dx_accumulate); return TT_OK;
  case TT_F64: rmsnorm_backward_f64(rows, dim, x, w, rstd, dy, dx, dw, dx_accumulate); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}
