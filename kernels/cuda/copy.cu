/*
 * copy.cu — strided copy with dtype conversion, and fill.
 *
 * The host side first simplifies the index space (drops size-1 dims, merges
 * dims that are contiguous in both tensors), so most copies end up as one
 * contiguous run: a cudaMemcpyAsync when the dtypes agree, a flat cast
 * kernel otherwise. What stays strided runs a kernel that maps each linear
 * index to two offsets, with 32-bit division whenever the index fits.
 */
#include <math.h>
#include <string.h>

#include "../dtype_conv.h"
#include "cuda_common.h"
#include "dtype.cuh"

#define TT_COPY_MAX_DIMS 8

/* Passed by value: lands in the kernel's constant parameter bank. */
struct tt_copy_layout {
  int ndim;
  int64_t shape[TT_COPY_MAX_DIMS];
  int64_t src[TT_COPY_MAX_DIMS];
  int64_t dst[TT_COPY_MAX_DIMS];
};
TT_EMU_NO_PTRS(tt_copy_layout)

/* Offsets of linear index i (row-major over shape) in src and dst. The
 * unrolled loop keeps the parameter indices static (no local memory). */
template <typename Idx>
__host__ __device__ __forceinline__ void tt_copy_offsets(const tt_copy_layout &l, Idx i, int64_t *so, int64_t *dof) {
  int64_t s = 0, d = 0;
#ifdef __CUDA_ARCH__ /* host code (tests) compiles it too */
#pragma unroll
#endif
  for (int k = TT_COPY_MAX_DIMS - 1; k >= 1; --k) {
    if (k < l.ndim) {
      Idx len = (Idx)l.shape[k];
      Idx q = i / len, r = i - q * len;
      s += (int64_t)r * l.src[k];
      d += (int64_t)r * l.dst[k];
      i = q;
    }
  }
  *so = s + (int64_t)i * l.src[0];
  *dof = d + (int64_t)i * l.dst[0];
}

/* Same dtype: a bit copy by element size. */
template <typename T, typename Idx>
__global__ void tt_copy_same_strided(tt_copy_layout l, Idx n, const T *__restrict__ src, T *__restrict__ dst) {
  for (Idx i = (Idx)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (Idx)gridDim.x * blockDim.x) {
    int64_t so, dof;
    tt_copy_offsets<Idx>(l, i, &so, &dof);
    dst[dof] = src[so];
  }
}

template <typename Idx>
__global__ void tt_copy_cast_strided(tt_copy_layout l, Idx n, int sdt, const void *__restrict__ src, int ddt,
                                     void *__restrict__ dst) {
  for (Idx i = (Idx)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (Idx)gridDim.x * blockDim.x) {
    int64_t so, dof;
    tt_copy_offsets<Idx>(l, i, &so, &dof);
    tt_d_convert(sdt, src, so, ddt, dst, dof);
  }
}

__global__ void tt_copy_cast_contig(int64_t n, int sdt, const void *__restrict__ src, int ddt, void *__restrict__ dst) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    tt_d_convert(sdt, src, i, ddt, dst, i);
}

static size_t tt_copy_esize(int dtype) {
  switch (dtype) {
    case TT_F64: case TT_I64: return 8;
    case TT_F32: case TT_I32: return 4;
    case TT_BF16: case TT_F16: return 2;
    case TT_U8: case TT_BOOL: case TT_F8E4M3: case TT_F8E5M2: return 1;
    default: return 0;
  }
}

template <typename Idx>
static void tt_copy_launch_same(size_t es, const tt_copy_layout &l, Idx n, const void *src, void *dst,
                                cudaStream_t s) {
  unsigned int g = tt_cuda_blocks((int64_t)n);
  switch (es) {
    case 1: tt_copy_same_strided<uint8_t, Idx><<<g, TT_CUDA_THREADS, 0, s>>>(l, n, (const uint8_t *)src, (uint8_t *)dst); break;
    case 2: tt_copy_same_strided<uint16_t, Idx><<<g, TT_CUDA_THREADS, 0, s>>>(l, n, (const uint16_t *)src, (uint16_t *)dst); break;
    case 4: tt_copy_same_strided<uint32_t, Idx><<<g, TT_CUDA_THREADS, 0, s>>>(l, n, (const uint32_t *)src, (uint32_t *)dst); break;
    default: tt_copy_same_strided<uint64_t, Idx><<<g, TT_CUDA_THREADS, 0, s>>>(l, n, (const uint64_t *)src, (uint64_t *)dst); break;
  }
}

/* Drops size-1 dims, then folds an outer dim into the next inner one when
 * both tensors step over the pair as one run. Returns the element count. */
static int64_t tt_copy_simplify(int ndim, const int64_t *shape, const int64_t *src_strides,
                                const int64_t *dst_strides, tt_copy_layout *l) {
  memset(l, 0, sizeof *l);
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    n *= shape[d];
    if (shape[d] == 1) continue;
    int j = l->ndim;
    if (j > 0 && l->src[j - 1] == src_strides[d] * shape[d] && l->dst[j - 1] == dst_strides[d] * shape[d]) {
      l->shape[j - 1] *= shape[d];
      l->src[j - 1] = src_strides[d];
      l->dst[j - 1] = dst_strides[d];
      continue;
    }
    l->shape[j] = shape[d];
    l->src[j] = src_strides[d];
    l->dst[j] = dst_strides[d];
    l->ndim++;
  }
  return n;
}

extern "C" tt_status tt_cuda_copy(int ndim, const int64_t *shape, int src_dtype, const void *src,
                                  const int64_t *src_strides, int dst_dtype, void *dst, const int64_t *dst_strides) {
  size_t ses = tt_copy_esize(src_dtype), des = tt_copy_esize(dst_dtype);
  if (!ses || !des) return tt_error_set(TT_ERR_DTYPE, "cuda copy: dtype %d -> %d not supported", src_dtype, dst_dtype);
  if (ndim < 0 || ndim > TT_COPY_MAX_DIMS)
    return tt_error_set(TT_ERR_INVALID, "cuda copy: %d dims (at most %d)", ndim, TT_COPY_MAX_DIMS);

  tt_copy_layout l;
  int64_t n = tt_copy_simplify(ndim, shape, src_strides, dst_strides, &l);
  if (n == 0) return TT_OK;
  int contig = l.ndim == 0 || (l.ndim == 1 && l.src[0] == 1 && l.dst[0] == 1);

  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;

  if (src_dtype == dst_dtype && contig) {
    TT_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * ses, cudaMemcpyDeviceToDevice, s));
    return TT_OK;
  }
  if (contig) {
    tt_copy_cast_contig<<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(n, src_dtype, src, dst_dtype, dst);
    TT_CUDA_CHECK_LAUNCH("tt_copy_cast_contig");
    return TT_OK;
  }
  int small = n <= INT32_MAX;
  if (src_dtype == dst_dtype) {
    if (small) tt_copy_launch_same<uint32_t>(ses, l, (uint32_t)n, src, dst, s);
    else tt_copy_launch_same<int64_t>(ses, l, n, src, dst, s);
    TT_CUDA_CHECK_LAUNCH("tt_copy_same_strided");
    return TT_OK;
  }
  if (small)
    tt_copy_cast_strided<uint32_t><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(l, (uint32_t)n, src_dtype, src,
                                                                                   dst_dtype, dst);
  else
    tt_copy_cast_strided<int64_t><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(l, n, src_dtype, src, dst_dtype, dst);
  TT_CUDA_CHECK_LAUNCH("tt_copy_cast_strided");
  return TT_OK;
}

/* ---- fill ---------------------------------------------------------------- */

template <typename T>
__global__ void tt_fill_kernel(int64_t n, T v, T *__restrict__ dst) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = v;
}

/* The element's bytes, converted on the host exactly as the CPU backend
 * converts: float->int truncates toward zero (NaN gives 0, out of range
 * saturates), bool is "!= 0". */
static int64_t tt_fill_to_int(double v) {
  if (isnan(v)) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

static void tt_fill_bits(int dtype, double v, unsigned char out[8]) {
  switch (dtype) {
    case TT_F32: { float f = (float)v; memcpy(out, &f, 4); break; }
    case TT_F64: memcpy(out, &v, 8); break;
    case TT_BF16: { uint16_t h = tt_f32_to_bf16((float)v); memcpy(out, &h, 2); break; }
    case TT_F16: { uint16_t h = tt_f32_to_f16((float)v); memcpy(out, &h, 2); break; }
    case TT_F8E4M3: out[0] = tt_f32_to_f8((float)v, 1); break;
    case TT_F8E5M2: out[0] = tt_f32_to_f8((float)v, 0); break;
    case TT_I32: { int32_t x = (int32_t)tt_fill_to_int(v); memcpy(out, &x, 4); break; }
    case TT_I64: { int64_t x = tt_fill_to_int(v); memcpy(out, &x, 8); break; }
    case TT_U8: out[0] = (uint8_t)tt_fill_to_int(v); break;
    default: out[0] = v != 0.0; break;
  }
}

extern "C" tt_status tt_cuda_fill(int dtype, int64_t n, double value, void *dst) {
  size_t es = tt_copy_esize(dtype);
  if (!es) return tt_error_set(TT_ERR_DTYPE, "cuda fill: dtype %d not supported", dtype);
  if (n <= 0) return TT_OK;
  unsigned char bits[8] = {0};
  tt_fill_bits(dtype, value, bits);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;

  int uniform = 1; /* every byte alike (zero, most often): a memset does it */
  for (size_t i = 1; i < es; i++) uniform &= bits[i] == bits[0];
  if (uniform) {
    TT_CUDA_CHECK(cudaMemsetAsync(dst, bits[0], (size_t)n * es, s));
    return TT_OK;
  }
  unsigned int g = tt_cuda_blocks(n);
  if (es == 2) {
    uint16_t v;
    memcpy(&v, bits, 2);
    tt_fill_kernel<uint16_t><<<g, TT_CUDA_THREADS, 0, s>>>(n, v, (uint16_t *)dst);
  } else if (es == 4) {
    uint32_t v;
    memcpy(&v, bits, 4);
    tt_fill_kernel<uint32_t><<<g, TT_CUDA_THREADS, 0, s>>>(n, v, (uint32_t *)dst);
  } else {
    uint64_t v;
    memcpy(&v, bits, 8);
    tt_fill_kernel<uint64_t><<<g, TT_CUDA_THREADS, 0, s>>>(n, v, (uint64_t *)dst);
  }
  TT_CUDA_CHECK_LAUNCH("tt_fill_kernel");
  return TT_OK;
}
