/*
 * vmath.h — a vectorizable f32 exp shared by the CPU kernels.
 *
 * glibc only vectorizes expf under -ffast-math, which we do not use (it
 * would change results elsewhere), so the kernels that exponentiate whole
 * rows (SwiGLU, cross-entropy, softmax) call this branch-free version
 * instead. Its selects vectorize only under -fno-trapping-math (set for the
 * whole build in CMakeLists.txt) or with AVX-512's masked operations.
 */
#ifndef TT_KERNELS_CPU_VMATH_H
#define TT_KERNELS_CPU_VMATH_H

#include <math.h>
#include <stdint.h>

/* exp for f32: Cody-Waite reduction x = n ln2 + r, the Cephes degree-7
 * polynomial for e^r, and 2^n applied as two exponent-bit factors so that
 * subnormal results and overflow to inf come out right. Within ~1 ulp
 * (checked against exp() over every float in [-110, 90]). Branch-free, so
 * loops calling it vectorize. kernels/cuda/kernel_util.cuh's tt_d_expf is
 * the same operations, so CPU and GPU agree to the bit. */
static inline float tt_expf(float x) {
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

#endif
