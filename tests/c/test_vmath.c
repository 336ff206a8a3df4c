/*
 * test_vmath.c — kernels/cpu/vmath.h's tt_expf, the exp of SwiGLU,
 * cross-entropy and softmax: its error against exp() in double over a
 * sweep of f32 inputs, the special values, and the same bits from a
 * vectorized loop as from scalar calls (the kernels call it in loops the
 * compiler vectorizes; the GPU kernels copy its operations).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu/vmath.h"
#include "tt_test.h"

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint32_t to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* The distance from r to the exact value e, in units of the spacing of
 * floats at e (2^-149 among the subnormals). */
static double ulp_error(float r, double e) {
  int ex;
  frexp(e, &ex); /* e = m * 2^ex, m in [0.5, 1) */
  double ulp = ldexp(1.0, (ex - 24 < -149 ? -149 : ex - 24));
  return fabs((double)r - e) / ulp;
}

/* Scalar calls, kept out of the vectorizer so the two loops below differ. */
__attribute__((noinline, optimize("no-tree-vectorize"))) static void exp_scalar(const float *x, float *y, int n) {
  for (int i = 0; i < n; i++) y[i] = tt_expf(x[i]);
}
__attribute__((noinline)) static void exp_vector(const float *x, float *y, int n) {
#pragma omp simd
  for (int i = 0; i < n; i++) y[i] = tt_expf(x[i]);
}

int main(void) {
  /* Every 61st float from -110 to 90 (about 35 million inputs: bit
   * patterns of both signs, walked from 0 outwards). Measured: 1.003 ulp at
   * worst (Cephes' polynomial); a wrong coefficient or reduction constant
   * costs thousands. */
  double worst = 0, worst_sub = 0;
  float at = 0, at_sub = 0;
  const uint32_t hi_pos = to_bits(90.0f), hi_neg = to_bits(-110.0f) & 0x7fffffffu;
  for (int sign = 0; sign < 2; sign++) {
    const uint32_t hi = sign ? hi_neg : hi_pos;
    for (uint32_t u = 0; u <= hi; u += 61) {
      const float x = from_bits(u | (sign ? 0x80000000u : 0));
      const double e = exp((double)x);
      const float r = tt_expf(x);
      /* past FLT_MAX: inf exactly where the exact value rounds to it */
      const double err = isinf(r) || isinf((float)e) ? (isinf(r) && isinf((float)e) ? 0 : INFINITY) : ulp_error(r, e);
      if (e < 0x1p-126) {
        if (err > worst_sub) worst_sub = err, at_sub = x;
      } else if (err > worst) {
        worst = err, at = x;
      }
    }
  }
  printf("normal results: worst %.3f ulp at x = %.9g; subnormal results: worst %.3f ulp at x = %.9g\n", worst,
         (double)at, worst_sub, (double)at_sub);
  CHECK(worst <= 1.05, "tt_expf: %.3f ulp from exp() at x = %.9g (at most 1.05 expected)", worst, (double)at);
  CHECK(worst_sub <= 1.0, "tt_expf: %.3f subnormal ulp at x = %.9g (at most 1 expected)", worst_sub, (double)at_sub);

  /* Special values and the edges of the clamped range. */
  CHECK(isnan(tt_expf(NAN)), "exp(NaN) is not NaN");
  CHECK(isnan(tt_expf(-NAN)), "exp(-NaN) is not NaN");
  CHECK(tt_expf(INFINITY) == INFINITY, "exp(inf) = %g, expected inf", (double)tt_expf(INFINITY));
  CHECK(tt_expf(-INFINITY) == 0.0f, "exp(-inf) = %g, expected 0", (double)tt_expf(-INFINITY));
  CHECK(tt_expf(0.0f) == 1.0f && tt_expf(-0.0f) == 1.0f, "exp(0) is not exactly 1");
  CHECK(tt_expf(89.0f) == INFINITY && tt_expf(1e30f) == INFINITY, "exp of a large x does not overflow to inf");
  CHECK(isfinite(tt_expf(88.7f)), "exp(88.7) = %g, expected finite (FLT_MAX is e^88.72)", (double)tt_expf(88.7f));
  CHECK(tt_expf(-104.0f) == 0.0f && tt_expf(-1e30f) == 0.0f, "exp of a very negative x is not 0");
  CHECK(tt_expf(-103.0f) > 0.0f, "exp(-103) = 0, expected the subnormal %g", exp(-103.0));

  /* A loop the compiler vectorizes gives the bits of scalar calls, specials
   * included, at every position of a vector (odd length: a scalar tail). */
  enum { N = 1021 };
  static float x[N], ys[N], yv[N];
  const float special[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 89.0f, 88.7f, -104.0f, -103.0f, 1e-40f, -87.5f};
  const int ns = (int)(sizeof special / sizeof special[0]);
  uint64_t s = 12345;
  for (int i = 0; i < N; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = i % 7 == 3 ? special[(i / 7) % ns] : (float)((double)(s >> 11) * 0x1p-53 * 220.0 - 115.0);
  }
  exp_scalar(x, ys, N);
  exp_vector(x, yv, N);
  int differ = 0;
  for (int i = 0; i < N; i++) differ += memcmp(&ys[i], &yv[i], sizeof(float)) != 0;
  CHECK(differ == 0, "%d of %d elements differ between the vector loop and scalar calls", differ, N);
  return tt_test_summary("test_vmath");
}
