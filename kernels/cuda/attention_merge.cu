/*
 * attention_merge.cu — ring attention's merge (context parallelism,
 * lua/parallel/cp.lua): a block of attention over some of the keys folded
 * into the running result, as kernels/cpu/attention.c's
 * tt_cpu_attention_merge. The accumulator is f32 (f64 for f64) whatever the
 * block's dtype, so a bf16 ring rounds once, at the end, not per block.
 *
 * One block of threads per (batch, query row): its H * D elements first,
 * each thread reading its head's two log-sum-exps, then (after every thread
 * has read them) the H new ones. Memory-bound and small next to the
 * attention it follows (T x D against T x S x D).
 */
#include "kernel_util.cuh"

template <int DT>
__global__ void tt_attention_merge_kernel(int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                                          typename tt_ft<DT>::C *__restrict__ acc,
                                          typename tt_ft<DT>::C *__restrict__ acc_lse,
                                          const typename tt_ft<DT>::S *__restrict__ out,
                                          const typename tt_ft<DT>::C *__restrict__ lse) {
  typedef typename tt_ft<DT>::C C;
  const C ninf = -(C)INFINITY;
  for (int64_t bi = blockIdx.x; bi < B * Tb; bi += gridDim.x) {
    const int64_t b = bi / Tb, i = bi - b * Tb, t = t0 + i;
    for (int64_t e = threadIdx.x; e < H * D; e += blockDim.x) {
      const int64_t h = e / D;
      const C la = acc_lse[(b * H + h) * T + t], lb = lse[(b * H + h) * Tb + i];
      if (lb == ninf) continue;
      const int64_t a = (b * T + t) * H * D + e;
      const C o = tt_ft<DT>::ld(out[(b * Tb + i) * H * D + e]);
      if (la == ninf) {
        acc[a] = o;
        continue;
      }
      const C m = la > lb ? la : lb, nl = m + log1p(exp(-fabs(la - lb)));
      acc[a] = exp(la - nl) * acc[a] + exp(lb - nl) * o;
    }
    __syncthreads(); /* every thread of the row has read the old values */
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      const C la = acc_lse[(b * H + h) * T + t], lb = lse[(b * H + h) * Tb + i];
      if (lb == ninf) continue;
      acc_lse[(b * H + h) * T + t] = la == ninf ? lb : (la > lb ? la : lb) + log1p(exp(-fabs(la - lb)));
    }
    __syncthreads(); /* before the next row's threads read */
  }
}

template <int DT>
static tt_status tt_attention_merge_launch(int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                                           void *acc, void *acc_lse, const void *out, const void *lse) {
  typedef typename tt_ft<DT>::C C;
  if (B * Tb <= 0 || H * D <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  const int64_t rows = B * Tb;
  const unsigned int grid = (unsigned int)(rows < 65536 ? rows : 65536);
  tt_attention_merge_kernel<DT><<<grid, TT_CUDA_THREADS, 0, s>>>(B, T, H, D, t0, Tb, (C *)acc, (C *)acc_lse,
                                                                 (const typename tt_ft<DT>::S *)out,
                                                                 (const C *)lse);
  TT_CUDA_CHECK_LAUNCH("tt_attention_merge_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_attention_merge(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0,
                                             int64_t Tb, void *acc, void *acc_lse, const void *out,
                                             const void *lse) {
  TT_FLOAT_DISPATCH(dtype, tt_attention_merge_launch, B, T, H, D, t0, Tb, acc, acc_lse, out, lse);
  return TT_ERR_DTYPE;
}
