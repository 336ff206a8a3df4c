/*
 * loss.cu — fused cross-entropy over rows of logits; probabilities are never
 * stored (as llm.c's fused classifier).
 *
 * Forward: one pass per row with an online log-sum-exp — each lane keeps a
 * running max m and sum s = sum exp(x - m) (s in double, as the CPU's sum),
 * rescaling s when m grows, over its 16-byte chunks of the row, so a 128k
 * vocabulary row is read once; the lanes' (m, s) pairs meet in a fixed tree.
 * A warp per row up to 1024 logits, a block per row above. exp is the CPU's
 * tt_expf (f32 and 16-bit logits) or exp (f64); lse = m + log(s) in double,
 * loss = lse - x[target] in double, each rounded once.
 *
 * Backward: dlogits = dloss * (exp(x - lse) - onehot(target)) in one pass,
 * the CPU's f32 arithmetic (bit-identical for f32); ignored rows (target ==
 * ignore_index, or outside [0, V)) get zeros. dlogits may be logits itself.
 *
 * A target outside [0, V) that is not ignore_index is recorded as an index
 * fault of the device (kernel_util.cuh) by both passes: the engine does not
 * read device targets before the kernels run.
 *
 * Edge cases follow the CPU: NaN logits give NaN lse, as do +inf logits and
 * rows that are all -inf.
 *
 * bf16 logits of more than 1024 columns, whole 16-byte chunks a row, take
 * the lean kernels (lean.cuh): per element one widening, a max, a subtract,
 * a multiply and one ex2.approx, a lane's terms added in f32 per four chunks and those sums
 * in double, where the default kernels run the ported exp and a double add
 * per element (compute-bound at a 128k vocabulary); the backward the same
 * exp2 and hardware bf16 rounding. TITAN_CUDA_CE_PLAN=exact turns them off.
 */
#include "kernel_util.cuh"
#include "lean.cuh"

__device__ __forceinline__ float tt_ce_exp(float a) { return tt_d_expf(a); }
__device__ __forceinline__ double tt_ce_exp(double a) { return exp(a); }

/* A lane's running (max, sum of exp(x - max)). m is never NaN: a NaN logit
 * fails x > m and lands in s. */
template <typename C> struct tt_lse {
  C m;
  double s;
};

template <typename C> __device__ __forceinline__ tt_lse<C> tt_shfl_xor(tt_lse<C> a, int o) {
  a.m = tt_shfl_xor(a.m, o);
  a.s = tt_shfl_xor(a.s, o);
  return a;
}
template <typename C> __device__ __forceinline__ tt_lse<C> tt_shfl0(tt_lse<C> a) {
  a.m = tt_shfl0(a.m);
  a.s = tt_shfl0(a.s);
  return a;
}

/* A part that saw nothing (or only -inf) has s == 0 and adds nothing; NaN in
 * s survives the rescale (NaN * 0 is NaN). Symmetric in its arguments. */
struct tt_lse_op {
  template <typename C> __device__ __forceinline__ tt_lse<C> operator()(tt_lse<C> a, tt_lse<C> b) const {
    tt_lse<C> r;
    r.m = a.m > b.m ? a.m : b.m;
    double sa = a.s == 0.0 ? 0.0 : a.s * (double)tt_ce_exp(tt_sub(a.m, r.m));
    double sb = b.s == 0.0 ? 0.0 : b.s * (double)tt_ce_exp(tt_sub(b.m, r.m));
    r.s = sa + sb;
    return r;
  }
};

/* One logit into the running pair. When x becomes the max, it contributes
 * exp(x - x) = 1 (NaN for x = +inf, as the CPU's exp(inf - inf)). */
template <typename C> __device__ __forceinline__ void tt_lse_push(tt_lse<C> &p, C x) {
  if (x > p.m) {
    p.s = p.s * (double)tt_ce_exp(tt_sub(p.m, x)) + (double)((C)1 + tt_sub(x, x));
    p.m = x;
  } else if (x != -INFINITY) {
    p.s += (double)tt_ce_exp(tt_sub(x, p.m));
  }
}

static __device__ __forceinline__ bool tt_ce_ignored(int64_t t, int64_t V, int64_t ignore_index) {
  return t == ignore_index || t < 0 || t >= V;
}

/* Row r's target t is ignored; a fault unless ignore_index asked for it. */
static __device__ __forceinline__ void tt_ce_fault(tt_index_fault *fault, int op, int64_t t, int64_t r, int64_t V,
                                                   int64_t ignore_index) {
  if (t != ignore_index) tt_d_index_fault(fault, op, t, r, V);
}

template <int DT, int G>
__global__ void tt_ce_forward(int64_t N, int64_t V, const typename tt_ft<DT>::S *__restrict__ logits,
                              const int64_t *__restrict__ targets, int64_t ignore_index,
                              typename tt_ft<DT>::S *__restrict__ losses, typename tt_ft<DT>::C *__restrict__ lse,
                              tt_index_fault *fault) {
  typedef typename tt_ft<DT>::C C;
  constexpr int VW = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ tt_lse<C> sm[TT_WARPS];
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * PER + threadIdx.x / G; r < N; r += (int64_t)gridDim.x * PER) {
    const typename tt_ft<DT>::S *x = logits + r * V;
    const bool vec = tt_al16(x);
    tt_lse<C> p;
    p.m = -INFINITY;
    p.s = 0.0;
    for (int64_t e = (int64_t)lane * VW; e < V; e += (int64_t)G * VW) {
      int64_t cnt = V - e < VW ? V - e : VW;
      C c[VW];
      tt_ld_chunk<DT>(x, e, cnt, vec, c);
#pragma unroll
      for (int k = 0; k < VW; k++)
        if (k < cnt) tt_lse_push(p, c[k]);
    }
    p = tt_group_reduce<G>(p, tt_lse_op(), sm);
    if (lane == 0) {
      /* An all -inf row: the CPU's exp(-inf - -inf) makes it NaN. */
      double l = p.m == -INFINITY ? (double)NAN : (double)p.m + log(p.s);
      lse[r] = (C)l;
      int64_t t = targets[r];
      if (tt_ce_ignored(t, V, ignore_index)) {
        losses[r] = tt_ft<DT>::st((C)0);
        tt_ce_fault(fault, TT_FAULT_CROSS_ENTROPY, t, r, V, ignore_index);
      } else {
        losses[r] = tt_ft<DT>::st((C)(l - (double)tt_ft<DT>::ld(x[t])));
      }
    }
  }
}

template <int DT, int G>
__global__ void tt_ce_backward(int64_t N, int64_t V, const typename tt_ft<DT>::S *logits,
                               const int64_t *__restrict__ targets, const typename tt_ft<DT>::C *__restrict__ lse,
                               const typename tt_ft<DT>::S *__restrict__ dlosses, int64_t ignore_index,
                               typename tt_ft<DT>::S *dlogits, tt_index_fault *fault) {
  typedef typename tt_ft<DT>::C C;
  constexpr int VW = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * PER + threadIdx.x / G; r < N; r += (int64_t)gridDim.x * PER) {
    const typename tt_ft<DT>::S *x = logits + r * V;
    typename tt_ft<DT>::S *dx = dlogits + r * V;
    const bool vec = tt_al16(x) && tt_al16(dx);
    const int64_t t = targets[r];
    const bool ign = tt_ce_ignored(t, V, ignore_index);
    if (ign && lane == 0) tt_ce_fault(fault, TT_FAULT_CROSS_ENTROPY_BACKWARD, t, r, V, ignore_index);
    const C g = ign ? (C)0 : tt_ft<DT>::ld(dlosses[r]), l = ign ? (C)0 : lse[r];
    for (int64_t e = (int64_t)lane * VW; e < V; e += (int64_t)G * VW) {
      int64_t cnt = V - e < VW ? V - e : VW;
      C c[VW];
      if (ign) {
#pragma unroll
        for (int k = 0; k < VW; k++) c[k] = (C)0;
      } else {
        tt_ld_chunk<DT>(x, e, cnt, vec, c);
#pragma unroll
        for (int k = 0; k < VW; k++) {
          c[k] = tt_mul(g, tt_ce_exp(tt_sub(c[k], l)));
          if (e + k == t) c[k] = tt_sub(c[k], g);
        }
      }
      tt_st_chunk<DT>(dx, e, cnt, vec, c);
    }
  }
}

/* ---- the lean kernels: bf16, a block per row of nc whole chunks ---------- */

#define TT_CE_LEAN_U 4          /* chunks a lane loads before it adds them */
#define TT_BF16X2_NEG_INF 0xff80ff80u /* what a chunk past the row's end holds */

__global__ void tt_ce_forward_lean(int64_t N, int64_t nc, const uint4 *__restrict__ logits,
                                   const int64_t *__restrict__ targets, int64_t ignore_index,
                                   uint16_t *__restrict__ losses, float *__restrict__ lse, tt_index_fault *fault) {
  __shared__ tt_lse<float> sm[TT_WARPS];
  const int64_t V = nc * 8;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const uint4 *x = logits + r * nc;
    tt_lse<float> p;
    p.m = -INFINITY;
    p.s = 0.0;
    for (int64_t c0 = threadIdx.x; c0 < nc; c0 += (int64_t)TT_CE_LEAN_U * TT_CUDA_THREADS) {
      uint4 v[TT_CE_LEAN_U];
#pragma unroll
      for (int u = 0; u < TT_CE_LEAN_U; u++) {
        const int64_t c = c0 + (int64_t)u * TT_CUDA_THREADS;
        TT_EMU_CHUNK(c < nc, true);
        v[u] = c < nc ? x[c] : make_uint4(TT_BF16X2_NEG_INF, TT_BF16X2_NEG_INF, TT_BF16X2_NEG_INF, TT_BF16X2_NEG_INF);
      }
      /* the new max (a NaN fails every comparison and is left to the sum) */
      float cm = p.m;
#pragma unroll
      for (int u = 0; u < TT_CE_LEAN_U; u++) {
        const uint32_t *pv = &v[u].x;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const float lo = tt_bf16_lo(pv[j]), hi = tt_bf16_hi(pv[j]);
          cm = lo > cm ? lo : cm;
          cm = hi > cm ? hi : cm;
        }
      }
      if (cm > p.m) {
        p.s = p.s == 0.0 ? 0.0 : p.s * (double)tt_lean_exp2((p.m - cm) * TT_LOG2E);
        p.m = cm;
      }
      /* m = -inf: all the lane has seen is -inf or NaN; exp2(x - 0) gives
       * those 0 and NaN, where x - m would make a -inf NaN. x - m first
       * (exact for nearby bf16 values, never overflowing: m is the max),
       * then the scale, rather than one fma whose m log2 e could overflow. */
      const float mu = p.m == -INFINITY ? 0.0f : p.m;
      float cs = 0.0f;
#pragma unroll
      for (int u = 0; u < TT_CE_LEAN_U; u++) {
        const uint32_t *pv = &v[u].x;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          cs += tt_lean_exp2(__fmul_rn(tt_bf16_lo(pv[j]) - mu, TT_LOG2E));
          cs += tt_lean_exp2(__fmul_rn(tt_bf16_hi(pv[j]) - mu, TT_LOG2E));
        }
      }
      p.s += (double)cs;
    }
    p = tt_group_reduce<TT_CUDA_THREADS>(p, tt_lse_op(), sm);
    if (threadIdx.x == 0) {
      /* An all -inf row: the CPU's exp(-inf - -inf) makes it NaN. */
      const double l = p.m == -INFINITY ? (double)NAN : (double)p.m + log(p.s);
      lse[r] = (float)l;
      const int64_t t = targets[r];
      if (tt_ce_ignored(t, V, ignore_index)) {
        losses[r] = tt_d_f32_to_bf16(0.0f);
        tt_ce_fault(fault, TT_FAULT_CROSS_ENTROPY, t, r, V, ignore_index);
      } else {
        const float xt = tt_d_bf16_to_f32(((const uint16_t *)logits)[r * V + t]);
        losses[r] = tt_d_f32_to_bf16((float)(l - (double)xt));
      }
    }
  }
}

/* dlogits = dloss * 2^((x - lse) log2 e), less dloss at the target. dlogits
 * may be logits itself. */
__global__ void tt_ce_backward_lean(int64_t N, int64_t nc, const uint4 *logits, const int64_t *__restrict__ targets,
                                    const float *__restrict__ lse, const uint16_t *__restrict__ dlosses,
                                    int64_t ignore_index, uint4 *dlogits, tt_index_fault *fault) {
  const int64_t V = nc * 8;
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const uint4 *x = logits + r * nc;
    uint4 *dx = dlogits + r * nc;
    const int64_t t = targets[r];
    const bool ign = tt_ce_ignored(t, V, ignore_index);
    if (ign && threadIdx.x == 0) tt_ce_fault(fault, TT_FAULT_CROSS_ENTROPY_BACKWARD, t, r, V, ignore_index);
    const float g = ign ? 0.0f : tt_d_bf16_to_f32(dlosses[r]);
    const float l = ign ? 0.0f : lse[r];
#pragma unroll 2
    for (int64_t c = threadIdx.x; c < nc; c += TT_CUDA_THREADS) {
      uint4 o;
      uint32_t *po = &o.x;
      if (ign) {
        o = make_uint4(0, 0, 0, 0);
      } else {
        TT_EMU_CHUNK(true, true);
        const uint4 v = x[c];
        const uint32_t *pv = &v.x;
        float d[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
          d[2 * j] = g * tt_lean_exp2(__fmul_rn(tt_bf16_lo(pv[j]) - l, TT_LOG2E));
          d[2 * j + 1] = g * tt_lean_exp2(__fmul_rn(tt_bf16_hi(pv[j]) - l, TT_LOG2E));
        }
        if (t >= c * 8 && t < c * 8 + 8) d[t - c * 8] -= g;
#pragma unroll
        for (int j = 0; j < 4; j++) po[j] = tt_bf16x2_rn(d[2 * j], d[2 * j + 1]);
      }
      TT_EMU_CHUNK(true, true);
      dx[c] = o;
    }
  }
}

template <int DT>
static tt_status tt_ce_launch(int backward, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                              int64_t ignore_index, const void *lse_in, const void *dlosses, void *out0, void *out1) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_index_fault *f = tt_cuda_fault(device);
  bool lean; /* read for every dtype, so a misspelt setting never goes unnoticed */
  st = tt_lean_plan("TITAN_CUDA_CE_PLAN", backward ? "cross_entropy_backward" : "cross_entropy", &lean);
  if (st != TT_OK) return st;
  if constexpr (DT == TT_BF16) {
    if (lean && V > 1024 && V % 8 == 0 && tt_al16(logits) && (!backward || tt_al16(out0))) {
      const unsigned int g = (unsigned int)(N < 65536 ? N : 65536);
      if (!backward)
        tt_ce_forward_lean<<<g, TT_CUDA_THREADS, 0, s>>>(N, V / 8, (const uint4 *)logits, targets, ignore_index,
                                                          (uint16_t *)out0, (float *)out1, f);
      else
        tt_ce_backward_lean<<<g, TT_CUDA_THREADS, 0, s>>>(N, V / 8, (const uint4 *)logits, targets,
                                                           (const float *)lse_in, (const uint16_t *)dlosses,
                                                           ignore_index, (uint4 *)out0, f);
      TT_CUDA_CHECK_LAUNCH("tt_ce_forward_lean (or its backward)");
      return TT_OK;
    }
  }
  const bool small = V <= 1024;
  const int G = small ? 32 : TT_CUDA_THREADS;
  unsigned int g = tt_cuda_group_blocks(N, G);
  if (!backward) {
    if (small)
      tt_ce_forward<DT, 32><<<g, TT_CUDA_THREADS, 0, s>>>(N, V, (const S *)logits, targets, ignore_index, (S *)out0,
                                                          (C *)out1, f);
    else
      tt_ce_forward<DT, TT_CUDA_THREADS><<<g, TT_CUDA_THREADS, 0, s>>>(N, V, (const S *)logits, targets, ignore_index,
                                                                       (S *)out0, (C *)out1, f);
    TT_CUDA_CHECK_LAUNCH("tt_ce_forward");
  } else {
    if (small)
      tt_ce_backward<DT, 32><<<g, TT_CUDA_THREADS, 0, s>>>(N, V, (const S *)logits, targets, (const C *)lse_in,
                                                           (const S *)dlosses, ignore_index, (S *)out0, f);
    else
      tt_ce_backward<DT, TT_CUDA_THREADS><<<g, TT_CUDA_THREADS, 0, s>>>(
          N, V, (const S *)logits, targets, (const C *)lse_in, (const S *)dlosses, ignore_index, (S *)out0, f);
    TT_CUDA_CHECK_LAUNCH("tt_ce_backward");
  }
  return TT_OK;
}

extern "C" tt_status tt_cuda_cross_entropy(int dtype, int64_t N, int64_t V, const void *logits,
                                           const int64_t *targets, int64_t ignore_index, void *losses, void *lse) {
  if (N <= 0 || V <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_ce_launch, 0, N, V, logits, targets, ignore_index, NULL, NULL, losses, lse)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda cross_entropy: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

extern "C" tt_status tt_cuda_cross_entropy_backward(int dtype, int64_t N, int64_t V, const void *logits,
                                                    const int64_t *targets, const void *lse, const void *dlosses,
                                                    int64_t ignore_index, void *dlogits) {
  if (N <= 0 || V <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_ce_launch, 1, N, V, logits, targets, ignore_index, lse, dlosses, dlogits, NULL)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda cross_entropy_backward: dtype %d not supported (f32, f64, bf16, f16)",
                      dtype);
}

/* ---- count of the targets that are not ignored ---------------------------- */

/* An integer sum is the same in any order, so the blocks may meet in an
 * atomic add without costing determinism. */
__global__ void tt_ce_count_kernel(int64_t N, const int64_t *__restrict__ targets, int64_t ignore_index,
                                   unsigned long long *count) {
  unsigned long long c = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (int64_t)gridDim.x * blockDim.x)
    c += targets[i] != ignore_index;
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0 && c) atomicAdd(count, c);
}

extern "C" tt_status tt_cuda_count_valid(int64_t N, const int64_t *targets, int64_t ignore_index, int64_t *count) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof *count, s));
  if (N <= 0) return TT_OK;
  tt_ce_count_kernel<<<tt_cuda_blocks(N), TT_CUDA_THREADS, 0, s>>>(N, targets, ignore_index,
                                                                   (unsigned long long *)count);
  TT_CUDA_CHECK_LAUNCH("tt_ce_count_kernel");
  return TT_OK;
}
