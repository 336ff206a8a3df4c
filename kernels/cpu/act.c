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

#define ACT_PAR_MIN 65536

/* exp for f32: Cody-Waite reduction x = n ln2 + r, the Cephes degree-7
 * polynomial for e^r, and 2^n applied as two exponent-bit factors so that
 * subnormal results and overflow to inf come out right. Within ~1 ulp
 * (checked against exp() over every float in [-110, 90]). Branch-free, so
 * loops calling it vectorize (same function as in loss.c). */
static inline float act_expf(float x) {
  /* Below -104 the result rounds to 0, above 89 to inf; NaN is parked at
   * -104 so the int conversion stays defined, and passed through at the end. */
  float xc = x > -104.0f ? x : -104.0f;
  xc = xc < 89.0f ? xc : 89.0f;
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
  float r = fmaf(n, -0.693359375f, xc);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p * r, r, r) + 1.0f;
  int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1; /* each half keeps 2^k normal */
  union { uint32_t u; float f; } s1, s2;
  s1.u = (uint32_t)(n1 + 127) << 23;
  s2.u = (uint32_t)(n2 + 127) << 23;
  return x == x ? p * s1.f * s2.f : x;
}

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

DEF_SWIGLU(float, f32, act_expf)
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
