/*
 * rope.cu — rotary position embeddings: the cos/sin table and the rotation,
 * in the TorchTitan / Meta Llama convention of kernels/cpu/rope.c (adjacent
 * pairs (2i, 2i+1) of the head dim, freq_i = theta^(-2i/D), Llama 3.1
 * frequency scaling).
 *
 * The table is computed in double and rounded once, as on the CPU (the
 * engine builds tables on the CPU; this entry exists so a device can too).
 * The rotation runs one block per token (B * T blocks, grid-stride), 16-byte
 * chunks of a token's H * D elements when D allows, and is the CPU's
 * arithmetic with unfused products: f32 is bit-identical to the reference.
 * The table is f64 for f64 x and f32 for f32, bf16 and f16 x (RoPE is
 * computed in f32 for the 16-bit dtypes, rounded once per output).
 *
 * bf16 x with a head dim that is a multiple of 8, at 16-byte addresses,
 * takes the lean kernel (lean.cuh): a chunk's 4 cosines and 4 sines in two
 * 16-byte loads rather than eight, the head offset in 32-bit arithmetic
 * rather than a 64-bit remainder per chunk, contracted products and
 * hardware bf16 rounding. TITAN_CUDA_ROPE_PLAN=exact turns it off.
 */
#include "kernel_util.cuh"
#include "lean.cuh"

/* ---- table ------------------------------------------------------------------ */

__device__ double tt_rope_scaled_freq(double freq, double scale_factor, double low_freq_factor,
                                      double high_freq_factor, double original_max_seq) {
  double wavelen = __ddiv_rn(2.0 * 3.14159265358979323846, freq);
  double low_freq_wavelen = original_max_seq / low_freq_factor;
  double high_freq_wavelen = original_max_seq / high_freq_factor;
  if (wavelen < high_freq_wavelen) return freq;
  if (wavelen > low_freq_wavelen) return freq / scale_factor;
  if (high_freq_factor == low_freq_factor) return freq;
  double smooth = __ddiv_rn(__dsub_rn(original_max_seq / wavelen, low_freq_factor),
                            __dsub_rn(high_freq_factor, low_freq_factor));
  return __dadd_rn(__ddiv_rn(__dmul_rn(__dsub_rn(1.0, smooth), freq), scale_factor), __dmul_rn(smooth, freq));
}

template <typename T>
__global__ void tt_rope_table_kernel(int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                                     double low_freq_factor, double high_freq_factor, double original_max_seq,
                                     T *__restrict__ cs, T *__restrict__ sn) {
  const int64_t half = head_dim / 2, total = max_seq * half;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t p = e / half, i = e - p * half;
    double f = 1.0 / pow(theta, (double)(2 * i) / (double)head_dim);
    if (scale_factor > 1.0) f = tt_rope_scaled_freq(f, scale_factor, low_freq_factor, high_freq_factor, original_max_seq);
    double angle = __dmul_rn((double)p, f);
    cs[e] = (T)cos(angle);
    sn[e] = (T)sin(angle);
  }
}

extern "C" tt_status tt_cuda_rope_table(int dtype, int64_t head_dim, int64_t max_seq, double theta,
                                        double scale_factor, double low_freq_factor, double high_freq_factor,
                                        int64_t original_max_seq, void *cos, void *sin) {
  if (head_dim % 2) return tt_error_set(TT_ERR_SHAPE, "cuda rope_table: head_dim %lld is odd", (long long)head_dim);
  if (dtype != TT_F32 && dtype != TT_F64)
    return tt_error_set(TT_ERR_DTYPE, "cuda rope_table: dtype %d not supported (f32, f64)", dtype);
  int64_t total = max_seq * (head_dim / 2);
  if (total <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  if (dtype == TT_F32)
    tt_rope_table_kernel<float><<<tt_cuda_blocks(total), TT_CUDA_THREADS, 0, s>>>(
        head_dim, max_seq, theta, scale_factor, low_freq_factor, high_freq_factor, (double)original_max_seq,
        (float *)cos, (float *)sin);
  else
    tt_rope_table_kernel<double><<<tt_cuda_blocks(total), TT_CUDA_THREADS, 0, s>>>(
        head_dim, max_seq, theta, scale_factor, low_freq_factor, high_freq_factor, (double)original_max_seq,
        (double *)cos, (double *)sin);
  TT_CUDA_CHECK_LAUNCH("tt_rope_table_kernel");
  return TT_OK;
}

/* ---- rotation ------------------------------------------------------------------- */

/* Token bt of B * T: its H * D elements from x + bt * H * D, rotated by the
 * angles of position pos_offset + bt % T (sine negated for the inverse,
 * which is also the gradient). y == x allowed: a thread reads a chunk
 * before it writes it. Units are 16-byte chunks when D is a multiple of
 * the chunk width (a chunk then never straddles two heads), pairs otherwise. */
template <int DT>
__global__ void tt_rope_kernel(int64_t BT, int64_t T, int64_t H, int64_t D, const typename tt_ft<DT>::S *x,
                               const typename tt_ft<DT>::C *__restrict__ cs, const typename tt_ft<DT>::C *__restrict__ sn,
                               int64_t pos_offset, typename tt_ft<DT>::C sg, bool vec, typename tt_ft<DT>::S *y) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  const int64_t half = D / 2, row = H * D;
  const int unit = vec ? V : 2;
  const int64_t nunits = row / unit;
  for (int64_t bt = blockIdx.x; bt < BT; bt += gridDim.x) {
    const int64_t pos = pos_offset + bt % T;
    const C *c = cs + pos * half, *s = sn + pos * half;
    const typename tt_ft<DT>::S *xr = x + bt * row;
    typename tt_ft<DT>::S *yr = y + bt * row;
    for (int64_t u = threadIdx.x; u < nunits; u += blockDim.x) {
      int64_t e = u * unit, i0 = (e % D) / 2;
      C v[V];
      tt_ld_chunk<DT>(xr, e, unit, vec, v);
#pragma unroll
      for (int p = 0; p < V / 2; p++) {
        if (2 * p >= unit) break;
        C a = v[2 * p], b = v[2 * p + 1], ci = c[i0 + p], si = tt_mul(sg, s[i0 + p]);
        v[2 * p] = tt_sub(tt_mul(a, ci), tt_mul(b, si));
        v[2 * p + 1] = tt_add(tt_mul(a, si), tt_mul(b, ci));
      }
      tt_st_chunk<DT>(yr, e, unit, vec, v);
    }
  }
}

/* The lean kernel: a token's H * D bf16 as H * D / 8 chunks; chunk u holds
 * the pairs 4 (u % (D / 8)) .. + 3 of its head, whose angles are the
 * float4 at that index of the position's table row (D / 2 floats). */
__global__ void tt_rope_lean_kernel(int64_t BT, int64_t T, int H, int D, const uint4 *x, const float4 *__restrict__ cs,
                                    const float4 *__restrict__ sn, int64_t pos_offset, float sg, uint4 *y) {
  const int cpr = D / 8, nunits = H * cpr;
  for (int64_t bt = blockIdx.x; bt < BT; bt += gridDim.x) {
    const int64_t pos = pos_offset + bt % T;
    const float4 *c = cs + pos * cpr, *s = sn + pos * cpr;
    const uint4 *xr = x + bt * nunits;
    uint4 *yr = y + bt * nunits;
    for (int u = threadIdx.x; u < nunits; u += blockDim.x) {
      const int i4 = u % cpr;
      TT_EMU_CHUNK(true, true);
      const uint4 v = xr[u];
      const float4 cc = c[i4], s4 = s[i4];
      const float cv[4] = { cc.x, cc.y, cc.z, cc.w }, sv[4] = { sg * s4.x, sg * s4.y, sg * s4.z, sg * s4.w };
      const uint32_t *pv = &v.x;
      uint4 o;
      uint32_t *po = &o.x;
#pragma unroll
      for (int p = 0; p < 4; p++) {
        const float a = tt_bf16_lo(pv[p]), b = tt_bf16_hi(pv[p]);
        po[p] = tt_bf16x2_rn(a * cv[p] - b * sv[p], a * sv[p] + b * cv[p]);
      }
      TT_EMU_CHUNK(true, true);
      yr[u] = o;
    }
  }
}

template <int DT>
static tt_status tt_rope_launch(int64_t B, int64_t T, int64_t H, int64_t D, const void *x, const void *cos,
                                const void *sin, int64_t pos_offset, int inverse, void *y) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(S);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  int64_t BT = B * T;
  bool vec = D % V == 0 && tt_al16(x) && tt_al16(y);
  unsigned int g = (unsigned int)(BT < 65536 ? BT : 65536);
  bool lean; /* read for every dtype, so a misspelt setting never goes unnoticed */
  if ((st = tt_lean_plan("TITAN_CUDA_ROPE_PLAN", "rope", &lean)) != TT_OK) return st;
  if (DT == TT_BF16 && lean && D % 8 == 0 && H * D <= INT32_MAX && tt_al16(x) && tt_al16(y) && tt_al16(cos) &&
      tt_al16(sin)) {
    tt_rope_lean_kernel<<<g, TT_CUDA_THREADS, 0, s>>>(BT, T, (int)H, (int)D, (const uint4 *)x, (const float4 *)cos,
                                                      (const float4 *)sin, pos_offset, inverse ? -1.0f : 1.0f,
                                                      (uint4 *)y);
    TT_CUDA_CHECK_LAUNCH("tt_rope_lean_kernel");
    return TT_OK;
  }
  tt_rope_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(BT, T, H, D, (const S *)x, (const C *)cos, (const C *)sin,
                                                  pos_offset, inverse ? (C)-1 : (C)1, vec, (S *)y);
  TT_CUDA_CHECK_LAUNCH("tt_rope_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_rope(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, const void *x,
                                  const void *cos, const void *sin, int64_t pos_offset, int inverse, void *y) {
  if (D % 2) return tt_error_set(TT_ERR_SHAPE, "cuda rope: head_dim %lld is odd", (long long)D);
  if (B <= 0 || T <= 0 || H <= 0 || D <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_rope_launch, B, T, H, D, x, cos, sin, pos_offset, inverse, y)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda rope: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}
