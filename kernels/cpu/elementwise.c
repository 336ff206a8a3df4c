/*
 * elementwise.c — binary ops with broadcasting, unary ops and their
 * derivatives, axpy. f32 and f64.
 *
 * Binary ops walk rows (all dims but the last) and run a flat inner loop
 * over the last dim; the engine passes stride 0 for broadcast dims, so a
 * bias add or a scalar multiply take the same path with no copies. The
 * packed same-shape case is one flat loop the compiler vectorizes.
 */
#include <math.h>

#include "cpu.h"

#define TT_PAR_MIN 32768

#define TT_BIN_CASES(T)                                                                    \
  switch (op) {                                                                            \
    case TT_ADD: for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as] + b[i * bs]; break;  \
    case TT_SUB: for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as] - b[i * bs]; break;  \
    case TT_MUL: for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as] * b[i * bs]; break;  \
    case TT_DIV: for (int64_t i = 0; i < n; i++) o[i * os] = a[i * as] / b[i * bs]; break;  \
    case TT_MAXIMUM:                                                                       \
      for (int64_t i = 0; i < n; i++) { T x = a[i * as], y = b[i * bs]; o[i * os] = x > y || x != x ? x : y; } \
      break;                                                                               \
    case TT_MINIMUM:                                                                       \
      for (int64_t i = 0; i < n; i++) { T x = a[i * as], y = b[i * bs]; o[i * os] = x < y || x != x ? x : y; } \
      break;                                                                               \
  }

/* Specialized on unit strides so the common cases vectorize: the strides
 * shadow the arguments as compile-time constants inside each branch. */
#define TT_BIN_ROW(T, NAME)                                                                             \
  static void NAME(int op, int64_t n, const T *a, int64_t as_, const T *b, int64_t bs_, T *o, int64_t os_) { \
    if (as_ == 1 && bs_ == 1 && os_ == 1) {                                                             \
      const int64_t as = 1, bs = 1, os = 1;                                                             \
      TT_BIN_CASES(T)                                                                                   \
    } else if (as_ == 1 && bs_ == 0 && os_ == 1) {                                                      \
      const int64_t as = 1, bs = 0, os = 1;                                                             \
      TT_BIN_CASES(T)                                                                                   \
    } else {                                                                                            \
      const int64_t as = as_, bs = bs_, os = os_;                                                       \
      TT_BIN_CASES(T)                                                                                   \
    }                                                                                                   \
  }

TT_BIN_ROW(float, tt_bin_row_f32)
TT_BIN_ROW(double, tt_bin_row_f64)

tt_status tt_cpu_binary(int op, int dtype, int ndim, const int64_t *shape, const void *a, const int64_t *a_strides,
                        const void *b, const int64_t *b_strides, void *out, const int64_t *out_strides) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  int64_t one = 1, zero = 0;
  if (ndim == 0) { shape = &one; a_strides = b_strides = out_strides = &zero; ndim = 1; }
  int64_t n = shape[ndim - 1], rows = 1;
  for (int i = 0; i < ndim - 1; i++) rows *= shape[i];
  if (n == 0 || rows == 0) return TT_OK;
  int64_t as = a_strides[ndim - 1], bs = b_strides[ndim - 1], os = out_strides[ndim - 1];
  /* A packed row-major result with packed operands is one long row. */
  int packed = 1;
  for (int d = ndim - 1, s = 1; d >= 0; s *= (int)shape[d], d--)
    if (shape[d] != 1 && (a_strides[d] != s || b_strides[d] != s || out_strides[d] != s)) packed = 0;
  if (packed) { n *= rows; rows = 1; as = bs = os = 1; }
  int64_t total = rows * n;
  if (rows == 1) { /* split one long row into chunks for the threads */
    int64_t chunk = 16384, nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (total > TT_PAR_MIN)
    for (int64_t c = 0; c < nchunks; c++) {
      int64_t s = c * chunk, len = n - s < chunk ? n - s : chunk;
      if (dtype == TT_F32)
        tt_bin_row_f32(op, len, (const float *)a + s * as, as, (const float *)b + s * bs, bs, (float *)out + s * os, os);
      else
        tt_bin_row_f64(op, len, (const double *)a + s * as, as, (const double *)b + s * bs, bs, (double *)out + s * os, os);
    }
    return TT_OK;
  }
#pragma omp parallel for schedule(static) if (total > TT_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    int64_t ao = 0, bo = 0, oo = 0, rem = r;
    for (int d = ndim - 2; d >= 0; d--) {
      int64_t i = rem % shape[d];
      rem /= shape[d];
      ao += i * a_strides[d];
      bo += i * b_strides[d];
      oo += i * out_strides[d];
    }
    if (dtype == TT_F32)
      tt_bin_row_f32(op, n, (const float *)a + ao, as, (const float *)b + bo, bs, (float *)out + oo, os);
    else
      tt_bin_row_f64(op, n, (const double *)a + ao, as, (const double *)b + bo, bs, (double *)out + oo, os);
  }
  return TT_OK;
}

/* ---- unary --------------------------------------------------------------- */

#define TT_SQRT1_2 0.70710678118654752440
#define TT_INV_SQRT_2PI 0.39894228040143267794

#define TT_UNARY_BODY(T, EXP, LOG, SQRT, ERF, TANH, POW, FABS)                              \
  switch (op) {                                                                             \
    case TT_NEG: for (int64_t i = 0; i < n; i++) y[i] = -x[i]; break;                        \
    case TT_EXP: for (int64_t i = 0; i < n; i++) y[i] = EXP(x[i]); break;                    \
    case TT_LOG: for (int64_t i = 0; i < n; i++) y[i] = LOG(x[i]); break;                    \
    case TT_SQRT: for (int64_t i = 0; i < n; i++) y[i] = SQRT(x[i]); break;                  \
    case TT_RSQRT: for (int64_t i = 0; i < n; i++) y[i] = (T)1 / SQRT(x[i]); break;          \
    case TT_SILU: for (int64_t i = 0; i < n; i++) y[i] = x[i] / ((T)1 + EXP(-x[i])); break;  \
    case TT_GELU:                                                                           \
      for (int64_t i = 0; i < n; i++) y[i] = (T)0.5 * x[i] * ((T)1 + ERF(x[i] * (T)TT_SQRT1_2)); \
      break;                                                                                \
    case TT_RELU: for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] : (T)0; break;      \
    case TT_SCALE: for (int64_t i = 0; i < n; i++) y[i] = (T)alpha * x[i]; break;            \
    case TT_ADD_SCALAR: for (int64_t i = 0; i < n; i++) y[i] = x[i] + (T)alpha; break;       \
    case TT_SQUARE: for (int64_t i = 0; i < n; i++) y[i] = x[i] * x[i]; break;               \
    case TT_ABS: for (int64_t i = 0; i < n; i++) y[i] = FABS(x[i]); break;                   \
    case TT_TANH: for (int64_t i = 0; i < n; i++) y[i] = TANH(x[i]); break;                  \
    case TT_SIGMOID: for (int64_t i = 0; i < n; i++) y[i] = (T)1 / ((T)1 + EXP(-x[i])); break; \
    case TT_POW_SCALAR: for (int64_t i = 0; i < n; i++) y[i] = POW(x[i], (T)alpha); break;   \
    case TT_RECIPROCAL: for (int64_t i = 0; i < n; i++) y[i] = (T)1 / x[i]; break;           \
    default: return TT_ERR_INVALID;                                                         \
  }

static tt_status tt_unary_f32(int op, int64_t n, double alpha, const float *x, float *y) {
  TT_UNARY_BODY(float, expf, logf, sqrtf, erff, tanhf, powf, fabsf)
  return TT_OK;
}
static tt_status tt_unary_f64(int op, int64_t n, double alpha, const double *x, double *y) {
  TT_UNARY_BODY(double, exp, log, sqrt, erf, tanh, pow, fabs)
  return TT_OK;
}

tt_status tt_cpu_unary(int op, int dtype, int64_t n, double alpha, const void *x, void *y) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  int64_t chunk = 16384, nchunks = (n + chunk - 1) / chunk;
  tt_status st = TT_OK;
#pragma omp parallel for schedule(static) if (n > TT_PAR_MIN)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t s = c * chunk, len = n - s < chunk ? n - s : chunk;
    tt_status r = dtype == TT_F32 ? tt_unary_f32(op, len, alpha, (const float *)x + s, (float *)y + s)
                                  : tt_unary_f64(op, len, alpha, (const double *)x + s, (double *)y + s);
    if (r != TT_OK) st = r; /* only TT_ERR_INVALID, same for every chunk */
  }
  return st;
}

#define TT_UNARY_BWD_BODY(T, EXP, SQRT, ERF, TANH, POW)                                          \
  for (int64_t i = 0; i < n; i++) {                                                              \
    T v = x[i], g = dy[i], d;                                                                    \
    switch (op) {                                                                                \
      case TT_NEG: d = -g; break;                                                                \
      case TT_EXP: d = g * EXP(v); break;                                                        \
      case TT_LOG: d = g / v; break;                                                             \
      case TT_SQRT: d = g * (T)0.5 / SQRT(v); break;                                             \
      case TT_RSQRT: d = g * (T)-0.5 / (v * SQRT(v)); break;                                     \
      case TT_SILU: { T s = (T)1 / ((T)1 + EXP(-v)); d = g * s * ((T)1 + v * ((T)1 - s)); break; } \
      case TT_GELU: {                                                                            \
        T cdf = (T)0.5 * ((T)1 + ERF(v * (T)TT_SQRT1_2));                                        \
        d = g * (cdf + v * (T)TT_INV_SQRT_2PI * EXP((T)-0.5 * v * v));                           \
        break;                                                                                   \
      }                                                                                          \
      case TT_RELU: d = v > 0 ? g : (T)0; break;                                                 \
      case TT_SCALE: d = (T)alpha * g; break;                                                    \
      case TT_ADD_SCALAR: d = g; break;                                                          \
      case TT_SQUARE: d = (T)2 * v * g; break;                                                   \
      case TT_ABS: d = v > 0 ? g : (v < 0 ? -g : (T)0); break;                                   \
      case TT_TANH: { T t = TANH(v); d = g * ((T)1 - t * t); break; }                            \
      case TT_SIGMOID: { T s = (T)1 / ((T)1 + EXP(-v)); d = g * s * ((T)1 - s); break; }         \
      case TT_POW_SCALAR: d = g * (T)alpha * POW(v, (T)alpha - (T)1); break;                     \
      case TT_RECIPROCAL: d = -g / (v * v); break;                                               \
      default: d = 0;                                                                            \
    }                                                                                            \
    dx[i] = d;                                                                                   \
  }

static void tt_unary_bwd_f32(int op, int64_t n, double alpha, const float *x, const float *dy, float *dx) {
  TT_UNARY_BWD_BODY(float, expf, sqrtf, erff, tanhf, powf)
}
static void tt_unary_bwd_f64(int op, int64_t n, double alpha, const double *x, const double *dy, double *dx) {
  TT_UNARY_BWD_BODY(double, exp, sqrt, erf, tanh, pow)
}

tt_status tt_cpu_unary_backward(int op, int dtype, int64_t n, double alpha, const void *x, const void *y,
                                const void *dy, void *dx) {
  (void)y; /* every derivative here is cheap to recompute from x */
  if (op < TT_NEG || op > TT_RECIPROCAL) return TT_ERR_INVALID;
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  int64_t chunk = 16384, nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (n > TT_PAR_MIN)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t s = c * chunk, len = n - s < chunk ? n - s : chunk;
    if (dtype == TT_F32)
      tt_unary_bwd_f32(op, len, alpha, (const float *)x + s, (const float *)dy + s, (float *)dx + s);
    else
      tt_unary_bwd_f64(op, len, alpha, (const double *)x + s, (const double *)dy + s, (double *)dx + s);
  }
  return TT_OK;
}

tt_status tt_cpu_axpy(int dtype, int64_t n, double alpha, const void *x, void *y) {
  if (dtype == TT_F32) {
    const float *a = x;
    float *b = y, al = (float)alpha;
#pragma omp parallel for simd schedule(static) if (n > TT_PAR_MIN)
    for (int64_t i = 0; i < n; i++) b[i] += al * a[i];
  } else if (dtype == TT_F64) {
    const double *a = x;
    double *b = y;
#pragma omp parallel for simd schedule(static) if (n > TT_PAR_MIN)
    for (int64_t i = 0; i < n; i++) b[i] += alpha * a[i];
  } else {
    return TT_ERR_DTYPE;
  }
  return TT_OK;
}
