/*
 * float8.c — the tensorwise dynamic cast of float8 training (torchao's
 * Float8Linear "tensorwise" recipe; lua/parallel/float8.lua): one scale for
 * the whole tensor, from its largest magnitude, so that it fills the fp8
 * format's range.
 *
 *   amax = max |x|;  s = fmax / max(amax, 1e-12)  (f32);
 *   y = fp8(clamp(x * s, -fmax, fmax));  scale_inv = 1 / s  (f32)
 *
 * fmax is 448 for e4m3 (activations and weights) and 57344 for e5m2
 * (gradients). The arithmetic is f32 as torchao's (x * s rounded to f32,
 * then to fp8 to nearest even), so the CUDA kernels give the same bits.
 * A NaN in x makes amax, and so every output, NaN. The GEMM on fp8
 * operands has no CPU kernel: the engine widens them to f32 (ops_float8.c).
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"
#include "dtype_conv.h"

static inline float ld(int dt, const void *x, int64_t i) {
  switch (dt) {
    case TT_F32: return ((const float *)x)[i];
    case TT_BF16: return tt_bf16_to_f32(((const uint16_t *)x)[i]);
    default: return tt_f16_to_f32(((const uint16_t *)x)[i]);
  }
}

/* max |x|, NaN when x holds one */
static float amax_of(int dtype, int64_t n, const void *x) {
  float amax = 0.0f;
  int nan = 0;
#pragma omp parallel for reduction(max : amax) reduction(| : nan) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(ld(dtype, x, i));
    if (a > amax) amax = a;
    nan |= a != a;
  }
  return nan ? NAN : amax;
}

tt_status tt_cpu_float8_amax(int dtype, int64_t n, const void *x, float *out) {
  if (dtype != TT_F32 && dtype != TT_BF16 && dtype != TT_F16) return TT_ERR_DTYPE;
  *out = amax_of(dtype, n, x);
  return TT_OK;
}

tt_status tt_cpu_to_float8(int dtype, int64_t n, const void *x, int fp8_dtype, void *y, float *scale_inv,
                           const float *amax_in) {
  if (dtype != TT_F32 && dtype != TT_BF16 && dtype != TT_F16) return TT_ERR_DTYPE;
  if (fp8_dtype != TT_F8E4M3 && fp8_dtype != TT_F8E5M2) return TT_ERR_DTYPE;
  const int e4m3 = fp8_dtype == TT_F8E4M3;
  const float fmax = e4m3 ? 448.0f : 57344.0f;
  const float amax = amax_in ? *amax_in : amax_of(dtype, n, x);
  const int nan = amax != amax;
  const float s = fmax / fmaxf(amax, 1e-12f) * (nan ? NAN : 1.0f);
  uint8_t *out = (uint8_t *)y;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float v = ld(dtype, x, i) * s;
    v = v > fmax ? fmax : v < -fmax ? -fmax : v;
    out[i] = tt_f32_to_f8(v, e4m3);
  }
  *scale_inv = 1.0f / s;
  return TT_OK;
}
