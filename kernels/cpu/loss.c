/*
 * loss.c — fused cross-entropy over rows of logits (CPU).
 *
 * Forward reads each row twice (max, then sum of exp(x - max)) and keeps
 * only lse; backward recomputes softmax from lse in one pass while writing
 * dlogits, so probabilities are never stored (as llm.c's fused classifier).
 * A vocab row of 128k f32 logits is 512 KiB, so the second pass hits L2.
 * The sum of exponentials is accumulated in double even for f32 logits.
 * Rows are independent, so the result does not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "cpu.h"
#include "vmath.h"

#define LOSS_PAR_MIN 32768


/* A target outside [0, V) cannot reach here (ops.c validates), but reading
 * logits[t] for one would be out of bounds: such rows count as ignored. */
static inline int loss_ignored(int64_t t, int64_t V, int64_t ignore_index) {
  return t == ignore_index || t < 0 || t >= V;
}

/* The two loops that call exp, per dtype: f32 vectorizes through tt_expf
 * (omp simd lets the sum be split into vector lanes, a fixed order for a
 * given build); f64 exists for gradient checks and calls libm serially. */
static inline double sum_exp_f32(const float *x, int64_t V, float m) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < V; j++) s += (double)tt_expf(x[j] - m);
  return s;
}
static inline double sum_exp_f64(const double *x, int64_t V, double m) {
  double s = 0;
  for (int64_t j = 0; j < V; j++) s += exp(x[j] - m);
  return s;
}
/* dx = g * exp(x - l); dx may be x itself (each element is read, then written). */
static inline void scaled_exp_f32(const float *x, int64_t V, float l, float g, float *dx) {
#pragma omp simd
  for (int64_t j = 0; j < V; j++) dx[j] = g * tt_expf(x[j] - l);
}
static inline void scaled_exp_f64(const double *x, int64_t V, double l, double g, double *dx) {
  for (int64_t j = 0; j < V; j++) dx[j] = g * exp(x[j] - l);
}

#define DEF_CROSS_ENTROPY(T, SFX)                                                                                     \
  /* Max in 16 fixed lanes: exact, so any order gives the same value, and the lane form vectorizes in compilers       \
   * that will not reorder a select-based reduction (NaN is skipped here and surfaces through the exp sum). */        \
  static inline T row_max_##SFX(const T *x, int64_t V) {                                                              \
    T lane[16];                                                                                                       \
    for (int k = 0; k < 16; k++) lane[k] = x[0];                                                                      \
    int64_t j = 0;                                                                                                    \
    for (; j + 16 <= V; j += 16)                                                                                      \
      _Pragma("omp simd") for (int k = 0; k < 16; k++) lane[k] = x[j + k] > lane[k] ? x[j + k] : lane[k];             \
    for (; j < V; j++) lane[0] = x[j] > lane[0] ? x[j] : lane[0];                                                     \
    T m = lane[0];                                                                                                    \
    for (int k = 1; k < 16; k++) m = lane[k] > m ? lane[k] : m;                                                       \
    return m;                                                                                                         \
  }                                                                                                                   \
  static void cross_entropy_##SFX(int64_t N, int64_t V, const T *restrict logits, const int64_t *targets,             \
                                  int64_t ignore_index, T *restrict losses, T *restrict lse) {                        \
    int par = N > 1 && N * V >= LOSS_PAR_MIN;                                                                         \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < N; i++) {                           \
      const T *x = logits + i * V;                                                                                    \
      T m = row_max_##SFX(x, V);                                                                                      \
      double s = sum_exp_##SFX(x, V, m);                                                                              \
      double l = (double)m + log(s);                                                                                  \
      lse[i] = (T)l;                                                                                                  \
      int64_t t = targets[i];                                                                                         \
      losses[i] = loss_ignored(t, V, ignore_index) ? (T)0 : (T)(l - (double)x[t]);                                    \
    }                                                                                                                 \
  }                                                                                                                   \
  /* dlogits = dloss * (exp(x - lse) - onehot(t)); ignored rows are zero. dlogits may be logits itself (the           \
   * gradient overwrites the logits, saving an N x V buffer): element j is read before it is written. */              \
  static void cross_entropy_backward_##SFX(int64_t N, int64_t V, const T *logits, const int64_t *targets,             \
                                           const T *restrict lse, const T *restrict dlosses, int64_t ignore_index,    \
                                           T *dlogits) {                                                              \
    int par = N > 1 && N * V >= LOSS_PAR_MIN;                                                                         \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i = 0; i < N; i++) {                           \
      const T *x = logits + i * V;                                                                                    \
      T *dx = dlogits + i * V;                                                                                        \
      int64_t t = targets[i];                                                                                         \
      if (loss_ignored(t, V, ignore_index)) {                                                                         \
        for (int64_t j = 0; j < V; j++) dx[j] = 0;                                                                    \
        continue;                                                                                                     \
      }                                                                                                               \
      T g = dlosses[i], l = lse[i];                                                                                   \
      scaled_exp_##SFX(x, V, l, g, dx);                                                                               \
      dx[t] -= g;                                                                                                     \
    }                                                                                                                 \
  }

DEF_CROSS_ENTROPY(float, f32)
DEF_CROSS_ENTROPY(double, f64)

tt_status tt_cpu_cross_entropy(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                               int64_t ignore_index, void *losses, void *lse) {
  switch (dtype) {
  case TT_F32: cross_entropy_f32(N, V, logits, targets, ignore_index, losses, lse); return TT_OK;
  case TT_F64: cross_entropy_f64(N, V, logits, targets, ignore_index, losses, lse); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}

tt_status tt_cpu_cross_entropy_backward(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                                        const void *lse, const void *dlosses, int64_t ignore_index, void *dlogits) {
  switch (dtype) {
  case TT_F32:
    cross_entropy_backward_f32(N, V, logits, targets, lse, dlosses, ignore_index, dlogits);
    return TT_OK;
  case TT_F64:
    cross_entropy_backward_f64(N, V, logits, targets, lse, dlosses, ignore_index, dlogits);
    return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}
