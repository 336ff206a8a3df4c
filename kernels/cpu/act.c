/*
 * act.c — SwiGLU activation, y = silu(a) * b, forward and backward (CPU).
 *
 * sigmoid(a) is evaluated from e = exp(-|a|) in (0, 1], which never
 * overflows: sigmoid = 1/(1+e) for a >= 0 and e/(1+e) otherwise. The f32
 * path uses an inline exp that the compiler vectorizes (glibc's expf is a
 * scalar call unless -ffast-math); f64 exists for gradient checks and calls
 * libm.
 */
#include <math.h>
#include <stdint.h>

#include "cpu.h"
#include "vmath.h"

#define ACT_PAR_MIN 65536


/* Threads take whole blocks of ACT_BLOCK elements (a multiple of the vector
 * width), so an element lands in the same place of a vector loop (body or
 * tail) whatever the thread count: a compiler that contracts a*b+c into an
 * fma differently in the two cannot make results depend on the threads. */
#define ACT_BLOCK 4096

#define DEF_SWIGLU(T, SFX, EXP)                                                                                       \
  static inline T sigmoid_##SFX(T a) {                                                                                \
    T e = EXP(a < 0 ? a : -a);                                                                                        \
    T s = (T)1 / ((T)1 + e);                                                                                          \
    return a >= 0 ? s : e * s;                                                                                        \
  }                                                                                                                   \
  /* y may alias a or b (in place): element i reads before it writes. */                                              \
  static void swiglu_##SFX(int64_t n, const T *a, const T *b, T *y) {                                                 \
    int par = n >= ACT_PAR_MIN;                                                                                       \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i0 = 0; i0 < n; i0 += ACT_BLOCK) {             \
      int64_t i1 = n - i0 < ACT_BLOCK ? n : i0 + ACT_BLOCK;                                                           \
      _Pragma("omp simd") for (int64_t i = i0; i < i1; i++) {                                                         \
        T ai = a[i];                                                                                                  \
        y[i] = ai * sigmoid_##SFX(ai) * b[i];                                                                         \
      }                                                                                                               \
    }                                                                                                                 \
  }                                                                                                                   \
  /* d silu(a)/da = sig * (1 + a * (1 - sig)). */                                                                     \
  static void swiglu_backward_##SFX(int64_t n, const T *a, const T *b, const T *dy, T *da, T *db) {                   \
    int par = n >= ACT_PAR_MIN;                                                                                       \
    _Pragma("omp parallel for schedule(static) if (par)") for (int64_t i0 = 0; i0 < n; i0 += ACT_BLOCK) {             \
      int64_t i1 = n - i0 < ACT_BLOCK ? n : i0 + ACT_BLOCK;                                                           \
      _Pragma("omp simd") for (int64_t i = i0; i < i1; i++) {                                                         \
        T ai = a[i], bi = b[i], g = dy[i];                                                                            \
        T sg = sigmoid_##SFX(ai);                                                                                     \
        da[i] = g * bi * sg * ((T)1 + ai * ((T)1 - sg));                                                              \
        db[i] = g * ai * sg;                                                                                          \
      }                                                                                                               \
    }                                                                                                                 \
  }

DEF_SWIGLU(float, f32, tt_expf)
DEF_SWIGLU(double, f64, exp)

tt_status tt_cpu_swiglu(int dtype, int64_t n, const void *a, const void *b, void *y) {
  switch (dtype) {
  case TT_F32: swiglu_f32(n, a, b, y); return TT_OK;
  case TT_F64: swiglu_f64(n, a, b, y); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}

tt_status tt_cpu_swiglu_backward(int dtype, int64_t n, const void *a, const void *b, const void *dy, void *da,
                                 void *db) {
  switch (dtype) {
  case TT_F32: swiglu_backward_f32(n, a, b, dy, da, db); return TT_OK;
  case TT_F64: swiglu_backward_f64(n, a, b, dy, da, db); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}
