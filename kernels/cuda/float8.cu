/*
 * float8.cu — the tensorwise dynamic cast of float8 training, as
 * kernels/cpu/float8.c (which says what it computes; the arithmetic here is
 * the same f32, so the bits are the CPU's):
 *
 *   1. the largest magnitude: each block reduces its grid-stride share and
 *      folds it into the scale slot with an atomic max on the float's bits
 *      (non-negative floats order as their bit patterns, and a NaN's bits
 *      exceed infinity's, so a NaN wins): the result is the same whatever
 *      the order, so it is deterministic;
 *   2. the cast, every thread reading amax from the slot and deriving s;
 *   3. one thread replaces amax by 1 / s.
 *
 * Three launches on the compute stream and no host wait: the scale stays
 * on the device for the fp8 GEMM (cuBLASLt reads it through its scale
 * pointers).
 */
#include "kernel_util.cuh"

/* max that keeps a NaN (tt_max_op's inputs are NaN-free) */
struct tt_f8_max_op {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return a != a ? a : (b != b ? b : (a > b ? a : b));
  }
};

template <int DT>
__global__ void tt_f8_amax_kernel(int64_t n, const typename tt_ft<DT>::S *__restrict__ x, unsigned *amax_bits) {
  __shared__ float smem[TT_WARPS];
  float m = 0.0f;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float a = fabsf((float)tt_ft<DT>::ld(x[i]));
    m = a != a ? a : (a > m ? a : m); /* a NaN stays */
  }
  m = tt_group_reduce<TT_CUDA_THREADS>(m, tt_f8_max_op(), smem);
  if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
}

__device__ __forceinline__ float tt_f8_scale(float amax, float fmax) {
  return amax != amax ? amax : fmax / fmaxf(amax, 1e-12f);
}

template <int DT>
__global__ void tt_f8_cast_kernel(int64_t n, const typename tt_ft<DT>::S *__restrict__ x, int e4m3, float fmax,
                                  const float *__restrict__ amax, uint8_t *__restrict__ y) {
  const float s = tt_f8_scale(*amax, fmax);
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float v = __fmul_rn((float)tt_ft<DT>::ld(x[i]), s);
    v = v > fmax ? fmax : (v < -fmax ? -fmax : v);
    y[i] = tt_d_f32_to_f8(v, e4m3);
  }
}

__global__ void tt_f8_finish_kernel(float fmax, float *slot) { *slot = __fdiv_rn(1.0f, tt_f8_scale(*slot, fmax)); }

/* *out = max |x| (0 for n = 0), on the stream s */
template <int DT>
static tt_status tt_f8_amax_launch(cudaStream_t s, int64_t n, const void *x, float *out) {
  TT_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(float), s));
  if (n <= 0) return TT_OK;
  const unsigned int blocks = tt_cuda_blocks(n) < 1024 ? tt_cuda_blocks(n) : 1024;
  tt_f8_amax_kernel<DT><<<blocks, TT_CUDA_THREADS, 0, s>>>(n, (const typename tt_ft<DT>::S *)x, (unsigned *)out);
  TT_CUDA_CHECK_LAUNCH("tt_f8_amax_kernel");
  return TT_OK;
}

template <int DT>
static tt_status tt_float8_amax_run(int64_t n, const void *x, float *out) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  return st != TT_OK ? st : tt_f8_amax_launch<DT>(s, n, x, out);
}

template <int DT>
static tt_status tt_to_float8_launch(int64_t n, const void *x, int fp8_dtype, void *y, float *scale_inv,
                                     const float *amax_in) {
  typedef typename tt_ft<DT>::S S;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  const int e4m3 = fp8_dtype == TT_F8E4M3;
  const float fmax = e4m3 ? 448.0f : 57344.0f;
  if (amax_in) TT_CUDA_CHECK(cudaMemcpyAsync(scale_inv, amax_in, sizeof(float), cudaMemcpyDeviceToDevice, s));
  else if ((st = tt_f8_amax_launch<DT>(s, n, x, scale_inv)) != TT_OK) return st;
  if (n > 0) {
    tt_f8_cast_kernel<DT><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(n, (const S *)x, e4m3, fmax, scale_inv,
                                                                        (uint8_t *)y);
    TT_CUDA_CHECK_LAUNCH("tt_f8_cast_kernel");
  }
  tt_f8_finish_kernel<<<1, 1, 0, s>>>(fmax, scale_inv);
  TT_CUDA_CHECK_LAUNCH("tt_f8_finish_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_to_float8(int dtype, int64_t n, const void *x, int fp8_dtype, void *y,
                                       float *scale_inv, const float *amax_in) {
  if (fp8_dtype != TT_F8E4M3 && fp8_dtype != TT_F8E5M2) return TT_ERR_DTYPE;
  switch (dtype) {
    case TT_F32: return tt_to_float8_launch<TT_F32>(n, x, fp8_dtype, y, scale_inv, amax_in);
    case TT_BF16: return tt_to_float8_launch<TT_BF16>(n, x, fp8_dtype, y, scale_inv, amax_in);
    case TT_F16: return tt_to_float8_launch<TT_F16>(n, x, fp8_dtype, y, scale_inv, amax_in);
    default: return TT_ERR_DTYPE;
  }
}

extern "C" tt_status tt_cuda_float8_amax(int dtype, int64_t n, const void *x, float *out) {
  switch (dtype) {
    case TT_F32: return tt_float8_amax_run<TT_F32>(n, x, out);
    case TT_BF16: return tt_float8_amax_run<TT_BF16>(n, x, out);
    case TT_F16: return tt_float8_amax_run<TT_F16>(n, x, out);
    default: return TT_ERR_DTYPE;
  }
}
