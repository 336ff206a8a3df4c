/*
 * rng.cu — generated tensors: arange and counter-based random numbers.
 *
 * The random numbers are kernels/cpu/rng.c's, on the device: Philox4x32-10
 * with counter offset + i under key seed, the same 53-bit uniforms, the same
 * Box-Muller and inverse-CDF transforms, all in double and cast at the end.
 * Every step the CPU rounds separately is rounded separately here (no FMA
 * contraction), so the only differences left are libm's and CUDA's last-ulp
 * differences in log/cos/erf/exp in double, which the final cast to f32 or
 * a 16-bit float absorbs except in the rarest ties.
 */
#include "kernel_util.cuh"

/* ---- arange ---------------------------------------------------------------- */

/* start + i * step in double, then the CPU's conversion to the dtype. */
__global__ void tt_arange_kernel(int dtype, int64_t n, double start, double step, void *dst) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    tt_d_store_float<double>(dtype, dst, i, __dadd_rn(start, __dmul_rn((double)i, step)));
}

extern "C" tt_status tt_cuda_arange(int dtype, int64_t n, double start, double step, void *dst) {
  if (dtype < 0 || dtype >= TT_NUM_DTYPES)
    return tt_error_set(TT_ERR_DTYPE, "cuda arange: dtype %d not supported", dtype);
  if (n <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_arange_kernel<<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(dtype, n, start, step, dst);
  TT_CUDA_CHECK_LAUNCH("tt_arange_kernel");
  return TT_OK;
}

/* ---- Philox4x32-10 and the transforms ----------------------------------------- */

__device__ __forceinline__ void tt_d_philox(uint64_t seed, uint64_t ctr, uint32_t out[4]) {
  uint32_t c0 = (uint32_t)ctr, c1 = (uint32_t)(ctr >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
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
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/* uniform in (0, 1), never 0 nor 1. */
__device__ __forceinline__ double tt_d_u01(uint32_t a, uint32_t b) {
  uint64_t bits = ((uint64_t)a << 21) ^ (uint64_t)(b >> 11);
  bits &= (((uint64_t)1) << 53) - 1;
  return __ddiv_rn(__dadd_rn((double)bits, 0.5), 9007199254740992.0);
}

/* One Horner step p * w + c, rounded twice as the CPU does. */
__device__ __forceinline__ double tt_d_horner(double p, double w, double c) { return __dadd_rn(c, __dmul_rn(p, w)); }

/* Giles' erfinv, no Newton steps (rng.c's tt_erfinv). */
__device__ double tt_d_erfinv(double x) {
  if (x <= -1) return -INFINITY;
  if (x >= 1) return INFINITY;
  double w = -log(__dmul_rn(__dsub_rn(1.0, x), __dadd_rn(1.0, x))), p;
  if (w < 6.25) {
    w = __dsub_rn(w, 3.125);
    p = -3.6444120640178196996e-21;
    p = tt_d_horner(p, w, -1.685059138182016589e-19);
    p = tt_d_horner(p, w, 1.2858480715256400167e-18);
    p = tt_d_horner(p, w, 1.115787767802518096e-17);
    p = tt_d_horner(p, w, -1.333171662854620906e-16);
    p = tt_d_horner(p, w, 2.0972767875968561637e-17);
    p = tt_d_horner(p, w, 6.6376381343583238325e-15);
    p = tt_d_horner(p, w, -4.0545662729752068639e-14);
    p = tt_d_horner(p, w, -8.1519341976054721522e-14);
    p = tt_d_horner(p, w, 2.6335093153082322977e-12);
    p = tt_d_horner(p, w, -1.2975133253453532498e-11);
    p = tt_d_horner(p, w, -5.4154120542946279317e-11);
    p = tt_d_horner(p, w, 1.051212273321532285e-09);
    p = tt_d_horner(p, w, -4.1126339803469836976e-09);
    p = tt_d_horner(p, w, -2.9070369957882005086e-08);
    p = tt_d_horner(p, w, 4.2347877827932403518e-07);
    p = tt_d_horner(p, w, -1.3654692000834678645e-06);
    p = tt_d_horner(p, w, -1.3882523362786468719e-05);
    p = tt_d_horner(p, w, 0.0001867342080340571352);
    p = tt_d_horner(p, w, -0.00074070253416626697512);
    p = tt_d_horner(p, w, -0.0060336708714301490533);
    p = tt_d_horner(p, w, 0.24015818242558961693);
    p = tt_d_horner(p, w, 1.6536545626831027356);
  } else if (w < 16.0) {
    w = __dsub_rn(sqrt(w), 3.25);
    p = 2.2137376921775787049e-09;
    p = tt_d_horner(p, w, 9.0756561938885390979e-08);
    p = tt_d_horner(p, w, -2.7517406297064545428e-07);
    p = tt_d_horner(p, w, 1.8239629214389227755e-08);
    p = tt_d_horner(p, w, 1.5027403968909827627e-06);
    p = tt_d_horner(p, w, -4.013867526981545969e-06);
    p = tt_d_horner(p, w, 2.9234449089955446044e-06);
    p = tt_d_horner(p, w, 1.2475304481671778723e-05);
    p = tt_d_horner(p, w, -4.7318229009055733981e-05);
    p = tt_d_horner(p, w, 6.8284851459573175448e-05);
    p = tt_d_horner(p, w, 2.4031110387097893999e-05);
    p = tt_d_horner(p, w, -0.0003550375203628474796);
    p = tt_d_horner(p, w, 0.00095328937973738049703);
    p = tt_d_horner(p, w, -0.0016882755560235047313);
    p = tt_d_horner(p, w, 0.0024914420961078508066);
    p = tt_d_horner(p, w, -0.0037512085075692412107);
    p = tt_d_horner(p, w, 0.005370914553590063617);
    p = tt_d_horner(p, w, 1.0052589676941592334);
    p = tt_d_horner(p, w, 3.0838856104922207635);
  } else {
    w = __dsub_rn(sqrt(w), 5.0);
    p = -2.7109920616438573243e-11;
    p = tt_d_horner(p, w, -2.5556418169965252055e-10);
    p = tt_d_horner(p, w, 1.5076572693500548083e-09);
    p = tt_d_horner(p, w, -3.7894654401267369937e-09);
    p = tt_d_horner(p, w, 7.6157012080783393804e-09);
    p = tt_d_horner(p, w, -1.4960026627149240478e-08);
    p = tt_d_horner(p, w, 2.9147953450901080826e-08);
    p = tt_d_horner(p, w, -6.7711997758452339498e-08);
    p = tt_d_horner(p, w, 2.2900482228026654717e-07);
    p = tt_d_horner(p, w, -9.9298272942317002539e-07);
    p = tt_d_horner(p, w, 4.5260625972231537039e-06);
    p = tt_d_horner(p, w, -1.9681778105531670567e-05);
    p = tt_d_horner(p, w, 7.5995277030017761139e-05);
    p = tt_d_horner(p, w, -0.00021503011930044477347);
    p = tt_d_horner(p, w, -0.00013871931833623122026);
    p = tt_d_horner(p, w, 1.0103004648645343977);
    p = tt_d_horner(p, w, 4.8499064014085844221);
  }
  return __dmul_rn(p, x);
}

__device__ __forceinline__ double tt_d_draw(int kind, uint64_t seed, uint64_t ctr, double p0, double p1, double p2,
                                            double p3) {
  uint32_t w[4];
  tt_d_philox(seed, ctr, w);
  switch (kind) {
    case 0: return __dadd_rn(p0, __dmul_rn(__dsub_rn(p1, p0), tt_d_u01(w[0], w[1])));
    case 1: {
      double u1 = tt_d_u01(w[0], w[1]), u2 = tt_d_u01(w[2], w[3]);
      double r = __dmul_rn(__dmul_rn(p1, sqrt(__dmul_rn(-2.0, log(u1)))), cos(__dmul_rn(6.283185307179586, u2)));
      return __dadd_rn(p0, r);
    }
    default: {
      double sd = p1 > 0 ? p1 : 1e-300;
      double lo = __dmul_rn(0.5, __dadd_rn(1.0, erf(__ddiv_rn(__ddiv_rn(__dsub_rn(p2, p0), sd), 1.4142135623730951))));
      double hi = __dmul_rn(0.5, __dadd_rn(1.0, erf(__ddiv_rn(__ddiv_rn(__dsub_rn(p3, p0), sd), 1.4142135623730951))));
      double u = __dadd_rn(lo, __dmul_rn(__dsub_rn(hi, lo), tt_d_u01(w[0], w[1])));
      double e = tt_d_erfinv(__dsub_rn(__dmul_rn(2.0, u), 1.0));
      double x = __dadd_rn(p0, __dmul_rn(__dmul_rn(sd, 1.4142135623730951), e));
      return x < p2 ? p2 : (x > p3 ? p3 : x);
    }
  }
}

template <int DT>
__global__ void tt_rng_kernel(int kind, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                              double p3, typename tt_ft<DT>::S *dst) {
  typedef typename tt_ft<DT>::C C;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = tt_ft<DT>::st((C)tt_d_draw(kind, seed, offset + (uint64_t)i, p0, p1, p2, p3));
}

template <int DT>
static tt_status tt_rng_launch(int kind, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                               double p3, void *dst) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_rng_kernel<DT><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(kind, n, seed, offset, p0, p1, p2, p3,
                                                                  (typename tt_ft<DT>::S *)dst);
  TT_CUDA_CHECK_LAUNCH("tt_rng_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_rng(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1,
                                 double p2, double p3, void *dst) {
  if (kind < 0 || kind > 2) return tt_error_set(TT_ERR_INVALID, "cuda rng: kind %d (expected 0, 1 or 2)", kind);
  if (n <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_rng_launch, kind, n, seed, offset, p0, p1, p2, p3, dst)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda rng: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}
