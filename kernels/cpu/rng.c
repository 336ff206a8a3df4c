/*
 * rng.c — counter-based random numbers (Philox4x32-10, Salmon et al. 2011).
 *
 * Element i draws from counter c = offset + i under key = seed, so a value
 * depends only on (seed, position): the same on any thread count, on the GPU
 * (kernels/cuda uses the same function), and whatever shard of a tensor is
 * being initialized (a shard passes its global offset).
 *
 * From the four 32-bit words of one draw: uniform uses w0 (f32) or w0,w1
 * (f64); normal uses Box-Muller on (w0, w1) -> cos branch; trunc-normal
 * inverts the normal CDF between the truncation points (PyTorch's method).
 */
#include <math.h>

#include "cpu.h"
#include "dtype_conv.h"

static inline void tt_philox(uint64_t seed, uint64_t ctr, uint32_t out[4]) {
  uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint32_t)p1;
    c3 = (uint32_t)p0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* uniform in (0, 1): never exactly 0 (log in Box-Muller) nor 1. */
static inline double tt_u01(uint32_t a, uint32_t b) {
  uint64_t bits = ((uint64_t)a << 21) ^ (uint64_t)(b >> 11); /* 53 bits */
  bits &= (((uint64_t)1) << 53) - 1;
  return ((double)bits + 0.5) / 9007199254740992.0;
}

/* Inverse error function: Giles' double-precision approximation ("Approximating
 * the erfinv function", 2010), relative error under 1e-15. Two Newton steps
 * on erf(y) - x used to follow; they moved the double in its last ulps only
 * (no float32 draw changed in 2e7 samples) and cost three quarters of the
 * draw: a model's initialization on the CPU was mostly these steps. */
static double tt_erfinv(double x) {
  if (x <= -1) return -INFINITY;
  if (x >= 1) return INFINITY;
  double w = -log((1.0 - x) * (1.0 + x)), p;
  if (w < 6.25) {
    w -= 3.125;
    p = -3.6444120640178196996e-21;
    p = -1.685059138182016589e-19 + p * w;
    p = 1.2858480715256400167e-18 + p * w;
    p = 1.115787767802518096e-17 + p * w;
    p = -1.333171662854620906e-16 + p * w;
    p = 2.0972767875968561637e-17 + p * w;
    p = 6.6376381343583238325e-15 + p * w;
    p = -4.0545662729752068639e-14 + p * w;
    p = -8.1519341976054721522e-14 + p * w;
    p = 2.6335093153082322977e-12 + p * w;
    p = -1.2975133253453532498e-11 + p * w;
    p = -5.4154120542946279317e-11 + p * w;
    p = 1.051212273321532285e-09 + p * w;
    p = -4.1126339803469836976e-09 + p * w;
    p = -2.9070369957882005086e-08 + p * w;
    p = 4.2347877827932403518e-07 + p * w;
    p = -1.3654692000834678645e-06 + p * w;
    p = -1.3882523362786468719e-05 + p * w;
    p = 0.0001867342080340571352 + p * w;
    p = -0.00074070253416626697512 + p * w;
    p = -0.0060336708714301490533 + p * w;
    p = 0.24015818242558961693 + p * w;
    p = 1.6536545626831027356 + p * w;
  } else if (w < 16.0) {
    w = sqrt(w) - 3.25;
    p = 2.2137376921775787049e-09;
    p = 9.0756561938885390979e-08 + p * w;
    p = -2.7517406297064545428e-07 + p * w;
    p = 1.8239629214389227755e-08 + p * w;
    p = 1.5027403968909827627e-06 + p * w;
    p = -4.013867526981545969e-06 + p * w;
    p = 2.9234449089955446044e-06 + p * w;
    p = 1.2475304481671778723e-05 + p * w;
    p = -4.7318229009055733981e-05 + p * w;
    p = 6.8284851459573175448e-05 + p * w;
    p = 2.4031110387097893999e-05 + p * w;
    p = -0.0003550375203628474796 + p * w;
    p = 0.00095328937973738049703 + p * w;
    p = -0.0016882755560235047313 + p * w;
    p = 0.0024914420961078508066 + p * w;
    p = -0.0037512085075692412107 + p * w;
    p = 0.005370914553590063617 + p * w;
    p = 1.0052589676941592334 + p * w;
    p = 3.0838856104922207635 + p * w;
  } else {
    w = sqrt(w) - 5.0;
    p = -2.7109920616438573243e-11;
    p = -2.5556418169965252055e-10 + p * w;
    p = 1.5076572693500548083e-09 + p * w;
    p = -3.7894654401267369937e-09 + p * w;
    p = 7.6157012080783393804e-09 + p * w;
    p = -1.4960026627149240478e-08 + p * w;
    p = 2.9147953450901080826e-08 + p * w;
    p = -6.7711997758452339498e-08 + p * w;
    p = 2.2900482228026654717e-07 + p * w;
    p = -9.9298272942317002539e-07 + p * w;
    p = 4.5260625972231537039e-06 + p * w;
    p = -1.9681778105531670567e-05 + p * w;
    p = 7.5995277030017761139e-05 + p * w;
    p = -0.00021503011930044477347 + p * w;
    p = -0.00013871931833623122026 + p * w;
    p = 1.0103004648645343977 + p * w;
    p = 4.8499064014085844221 + p * w;
  }
  return p * x;
}

/* trunc-normal's standard deviation and the CDF at its truncation points:
 * the same for every element, so taken once a call (two erf an element
 * were most of a model's initialization). */
typedef struct {
  double std, lo, hi;
} tt_trunc_bounds;

static tt_trunc_bounds tt_trunc_bounds_of(int kind, double p0, double p1, double p2, double p3) {
  tt_trunc_bounds b = {0, 0, 0};
  if (kind != 2) return b;
  b.std = p1 > 0 ? p1 : 1e-300;
  b.lo = 0.5 * (1 + erf((p2 - p0) / b.std / 1.4142135623730951));
  b.hi = 0.5 * (1 + erf((p3 - p0) / b.std / 1.4142135623730951));
  return b;
}

static inline double tt_draw(int kind, uint64_t seed, uint64_t ctr, double p0, double p1, double p2, double p3,
                             tt_trunc_bounds tb) {
  uint32_t w[4];
  tt_philox(seed, ctr, w);
  switch (kind) {
    case 0: return p0 + (p1 - p0) * tt_u01(w[0], w[1]);
    case 1: {
      double u1 = tt_u01(w[0], w[1]), u2 = tt_u01(w[2], w[3]);
      return p0 + p1 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    }
    default: {
      /* Inverse CDF between the standardized truncation points. */
      double u = tb.lo + (tb.hi - tb.lo) * tt_u01(w[0], w[1]);
      double x = p0 + tb.std * 1.4142135623730951 * tt_erfinv(2 * u - 1);
      return x < p2 ? p2 : (x > p3 ? p3 : x);
    }
  }
}

tt_status tt_cpu_rng(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                     double p3, void *dst) {
  const tt_trunc_bounds tb = tt_trunc_bounds_of(kind, p0, p1, p2, p3);
  switch (dtype) {
    case TT_F32: {
      float *y = dst;
#pragma omp parallel for schedule(static) if (n > 16384)
      for (int64_t i = 0; i < n; i++) y[i] = (float)tt_draw(kind, seed, offset + (uint64_t)i, p0, p1, p2, p3, tb);
      return TT_OK;
    }
    case TT_F64: {
      double *y = dst;
#pragma omp parallel for schedule(static) if (n > 16384)
      for (int64_t i = 0; i < n; i++) y[i] = tt_draw(kind, seed, offset + (uint64_t)i, p0, p1, p2, p3, tb);
      return TT_OK;
    }
    case TT_BF16: {
      uint16_t *y = dst;
#pragma omp parallel for schedule(static) if (n > 16384)
      for (int64_t i = 0; i < n; i++)
        y[i] = tt_f32_to_bf16((float)tt_draw(kind, seed, offset + (uint64_t)i, p0, p1, p2, p3, tb));
      return TT_OK;
    }
    case TT_F16: {
      uint16_t *y = dst;
#pragma omp parallel for schedule(static) if (n > 16384)
      for (int64_t i = 0; i < n; i++)
        y[i] = tt_f32_to_f16((float)tt_draw(kind, seed, offset + (uint64_t)i, p0, p1, p2, p3, tb));
      return TT_OK;
    }
    default: return TT_ERR_DTYPE;
  }
}
