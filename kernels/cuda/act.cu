/*
 * act.cu — SwiGLU, y = silu(a) * b, forward and backward, in 16-byte chunks.
 *
 * The CPU's arithmetic (kernels/cpu/act.c): sigmoid from e = exp(-|a|),
 * which never overflows, with vmath.h's tt_expf for f32 (and the 16-bit
 * floats, computed in f32 and rounded once) ported operation for operation
 * and unfused products elsewhere, so f32 results are bit-identical to the
 * reference; f64 uses CUDA's exp (last-ulp differences from libm).
 *
 * bf16 tensors of whole 16-byte chunks at 16-byte addresses take the lean
 * kernels (lean.cuh): the same formulas in f32 with the hardware's exp2,
 * reciprocal and bf16x2 rounding. The default kernels spend about 45
 * instructions an element (the ported exp, an IEEE division, integer
 * rounding), as long as the memory traffic itself at 1B's 8192 x 8192
 * activations; the lean ones about a dozen. TITAN_CUDA_SWIGLU_PLAN=exact
 * turns them off.
 */
#include "kernel_util.cuh"
#include "lean.cuh"

__device__ __forceinline__ float tt_act_exp(float a) { return tt_d_expf(a); }
__device__ __forceinline__ double tt_act_exp(double a) { return exp(a); }

template <typename C> __device__ __forceinline__ C tt_sigmoid(C a) {
  C e = tt_act_exp(a < 0 ? a : -a);
  C s = tt_div((C)1, tt_add((C)1, e));
  return a >= 0 ? s : tt_mul(e, s);
}

/* y may alias a or b: a chunk is read before it is written, by one thread. */
template <int DT>
__global__ void tt_swiglu_kernel(int64_t n, bool vec, const typename tt_ft<DT>::S *a, const typename tt_ft<DT>::S *b,
                                 typename tt_ft<DT>::S *y) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C av[V], bv[V];
    tt_ld_chunk<DT>(a, e, cnt, vec, av);
    tt_ld_chunk<DT>(b, e, cnt, vec, bv);
#pragma unroll
    for (int k = 0; k < V; k++) av[k] = tt_mul(tt_mul(av[k], tt_sigmoid(av[k])), bv[k]);
    tt_st_chunk<DT>(y, e, cnt, vec, av);
  }
}

/* da = dy * b * sig * (1 + a * (1 - sig)), db = dy * a * sig. */
template <int DT>
__global__ void tt_swiglu_backward_kernel(int64_t n, bool vec, const typename tt_ft<DT>::S *a,
                                          const typename tt_ft<DT>::S *b, const typename tt_ft<DT>::S *dy,
                                          typename tt_ft<DT>::S *da, typename tt_ft<DT>::S *db) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C av[V], bv[V], gv[V];
    tt_ld_chunk<DT>(a, e, cnt, vec, av);
    tt_ld_chunk<DT>(b, e, cnt, vec, bv);
    tt_ld_chunk<DT>(dy, e, cnt, vec, gv);
#pragma unroll
    for (int k = 0; k < V; k++) {
      C ai = av[k], bi = bv[k], g = gv[k], sg = tt_sigmoid(ai);
      av[k] = tt_mul(tt_mul(tt_mul(g, bi), sg), tt_add((C)1, tt_mul(ai, tt_sub((C)1, sg))));
      bv[k] = tt_mul(tt_mul(g, ai), sg);
    }
    tt_st_chunk<DT>(da, e, cnt, vec, av);
    tt_st_chunk<DT>(db, e, cnt, vec, bv);
  }
}

/* The lean kernels: nch whole chunks of 8 bf16 (y may alias a or b, as
 * above). */
__global__ void tt_swiglu_lean_kernel(int64_t nch, const uint4 *a, const uint4 *b, uint4 *y) {
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    TT_EMU_CHUNK(true, true);
    const uint4 av = a[c];
    TT_EMU_CHUNK(true, true);
    const uint4 bv = b[c];
    const uint32_t *pa = &av.x, *pb = &bv.x;
    uint4 o;
    uint32_t *po = &o.x;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const float a0 = tt_bf16_lo(pa[j]), a1 = tt_bf16_hi(pa[j]);
      po[j] = tt_bf16x2_rn(a0 * tt_lean_sigmoid(a0) * tt_bf16_lo(pb[j]), a1 * tt_lean_sigmoid(a1) * tt_bf16_hi(pb[j]));
    }
    TT_EMU_CHUNK(true, true);
    y[c] = o;
  }
}

__device__ __forceinline__ void tt_swiglu_lean_grad(float a, float b, float g, float *da, float *db) {
  const float sg = tt_lean_sigmoid(a);
  *da = g * b * sg * (1.0f + a * (1.0f - sg));
  *db = g * a * sg;
}

__global__ void tt_swiglu_backward_lean_kernel(int64_t nch, const uint4 *a, const uint4 *b, const uint4 *dy,
                                               uint4 *da, uint4 *db) {
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    TT_EMU_CHUNK(true, true);
    const uint4 av = a[c];
    TT_EMU_CHUNK(true, true);
    const uint4 bv = b[c];
    TT_EMU_CHUNK(true, true);
    const uint4 gv = dy[c];
    const uint32_t *pa = &av.x, *pb = &bv.x, *pg = &gv.x;
    uint4 oa, ob;
    uint32_t *pda = &oa.x, *pdb = &ob.x;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float a0, a1, b0, b1;
      tt_swiglu_lean_grad(tt_bf16_lo(pa[j]), tt_bf16_lo(pb[j]), tt_bf16_lo(pg[j]), &a0, &b0);
      tt_swiglu_lean_grad(tt_bf16_hi(pa[j]), tt_bf16_hi(pb[j]), tt_bf16_hi(pg[j]), &a1, &b1);
      pda[j] = tt_bf16x2_rn(a0, a1);
      pdb[j] = tt_bf16x2_rn(b0, b1);
    }
    TT_EMU_CHUNK(true, true);
    da[c] = oa;
    TT_EMU_CHUNK(true, true);
    db[c] = ob;
  }
}

/* The lean kernels over the whole chunks; a ragged tail (n % 8) goes to the
 * default kernel. Returns false when the lean kernels do not apply. */
static bool tt_swiglu_lean_go(cudaStream_t s, int64_t n, const void *a, const void *b, const void *dy, void *y,
                              void *db) {
  if (!(tt_al16(a) && tt_al16(b) && tt_al16(y) && (!dy || (tt_al16(dy) && tt_al16(db))))) return false;
  typedef tt_ft<TT_BF16>::S S;
  const int64_t nch = n / 8, done = nch * 8;
  if (nch > 0) {
    const unsigned int g = tt_cuda_blocks(nch);
    if (!dy)
      tt_swiglu_lean_kernel<<<g, TT_CUDA_THREADS, 0, s>>>(nch, (const uint4 *)a, (const uint4 *)b, (uint4 *)y);
    else
      tt_swiglu_backward_lean_kernel<<<g, TT_CUDA_THREADS, 0, s>>>(nch, (const uint4 *)a, (const uint4 *)b,
                                                                   (const uint4 *)dy, (uint4 *)y, (uint4 *)db);
  }
  if (done < n) {
    const int64_t r = n - done;
    if (!dy)
      tt_swiglu_kernel<TT_BF16><<<1, TT_CUDA_THREADS, 0, s>>>(r, true, (const S *)a + done, (const S *)b + done,
                                                              (S *)y + done);
    else
      tt_swiglu_backward_kernel<TT_BF16><<<1, TT_CUDA_THREADS, 0, s>>>(r, true, (const S *)a + done,
                                                                       (const S *)b + done, (const S *)dy + done,
                                                                       (S *)y + done, (S *)db + done);
  }
  return true;
}

template <int DT>
static tt_status tt_swiglu_launch(int64_t n, const void *a, const void *b, const void *dy, void *y, void *db) {
  typedef typename tt_ft<DT>::S S;
  constexpr int V = 16 / sizeof(S);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  bool lean; /* read for every dtype, so a misspelt setting never goes unnoticed */
  if ((st = tt_lean_plan("TITAN_CUDA_SWIGLU_PLAN", dy ? "swiglu_backward" : "swiglu", &lean)) != TT_OK) return st;
  if constexpr (DT == TT_BF16) {
    if (lean && tt_swiglu_lean_go(s, n, a, b, dy, y, db)) {
      TT_CUDA_CHECK_LAUNCH("tt_swiglu_lean_kernel (or its backward)");
      return TT_OK;
    }
  }
  unsigned int g = tt_cuda_blocks((n + V - 1) / V);
  if (!dy) {
    bool vec = tt_al16(a) && tt_al16(b) && tt_al16(y);
    tt_swiglu_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(n, vec, (const S *)a, (const S *)b, (S *)y);
    TT_CUDA_CHECK_LAUNCH("tt_swiglu_kernel");
  } else {
    bool vec = tt_al16(a) && tt_al16(b) && tt_al16(dy) && tt_al16(y) && tt_al16(db);
    tt_swiglu_backward_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(n, vec, (const S *)a, (const S *)b, (const S *)dy,
                                                                (S *)y, (S *)db);
    TT_CUDA_CHECK_LAUNCH("tt_swiglu_backward_kernel");
  }
  return TT_OK;
}

extern "C" tt_status tt_cuda_swiglu(int dtype, int64_t n, const void *a, const void *b, void *y) {
  if (n <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_swiglu_launch, n, a, b, NULL, y, NULL)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda swiglu: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

extern "C" tt_status tt_cuda_swiglu_backward(int dtype, int64_t n, const void *a, const void *b, const void *dy,
                                             void *da, void *db) {
  if (n <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_swiglu_launch, n, a, b, dy, da, db)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda swiglu_backward: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}
