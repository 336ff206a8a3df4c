/*
 * act.cu — SwiGLU, y = silu(a) * b, forward and backward, in 16-byte chunks.
 *
 * The CPU's arithmetic (kernels/cpu/act.c): sigmoid from e = exp(-|a|),
 * which never overflows, with vmath.h's tt_expf for f32 (and the 16-bit
 * floats, computed in f32 and rounded once) ported operation for operation
 * and unfused products elsewhere, so f32 results are bit-identical to the
 * reference; f64 uses CUDA's exp (last-ulp differences from libm).
 */
#include "kernel_util.cuh"

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

template <int DT>
static tt_status tt_swiglu_launch(int64_t n, const void *a, const void *b, const void *dy, void *y, void *db) {
  typedef typename tt_ft<DT>::S S;
  constexpr int V = 16 / sizeof(S);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
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
