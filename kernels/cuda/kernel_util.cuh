/*
 * kernel_util.cuh — what the fused CUDA kernels share: per-dtype load/store
 * traits, 16-byte chunk loads, unfused arithmetic, deterministic group
 * reductions and the CPU backend's exp functions ported bit for bit.
 *
 * Chunks. A row of n elements is cut into chunks of V = 16 / sizeof(elem)
 * elements counted from the row's first element; lane l of a group of G
 * threads takes chunks l, l + G, ... and walks each chunk in index order.
 * A chunk is read with one 128-bit load when the row starts 16-byte aligned
 * (then every full chunk is aligned) and element by element otherwise, so
 * the same lane sums the same elements in the same order either way: a
 * reduction's bits never depend on where the tensor happens to sit.
 *
 * Arithmetic. nvcc contracts a*b+c into an FMA by default while the CPU
 * reference is built with -ffp-contract=off; the tt_mul/tt_add/... helpers
 * (the _rn intrinsics, which are never contracted) keep the CPU's rounding
 * where a kernel promises to match it operation by operation. An FMA is
 * written as fmaf()/fma() where the CPU writes one.
 *
 * Reductions. Warp butterflies and a fixed sequential pass over the warp
 * partials: the order is a function of the group size alone, never of
 * timing, and no kernel of this backend uses a floating-point atomic.
 */
#ifndef TT_KERNELS_CUDA_KERNEL_UTIL_CUH
#define TT_KERNELS_CUDA_KERNEL_UTIL_CUH

#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "cuda_common.h"
#include "dtype.cuh"

/* ---- dtype traits: storage S, compute C (f32 for every 16-bit float) ---- */

template <int DT> struct tt_ft;
template <> struct tt_ft<TT_F32> {
  typedef float S;
  typedef float C;
  static __device__ __forceinline__ float ld(float v) { return v; }
  static __device__ __forceinline__ float st(float v) { return v; }
};
template <> struct tt_ft<TT_F64> {
  typedef double S;
  typedef double C;
  static __device__ __forceinline__ double ld(double v) { return v; }
  static __device__ __forceinline__ double st(double v) { return v; }
};
template <> struct tt_ft<TT_BF16> {
  typedef uint16_t S;
  typedef float C;
  static __device__ __forceinline__ float ld(uint16_t v) { return tt_d_bf16_to_f32(v); }
  static __device__ __forceinline__ uint16_t st(float v) { return tt_d_f32_to_bf16(v); }
};
template <> struct tt_ft<TT_F16> {
  typedef uint16_t S;
  typedef float C;
  static __device__ __forceinline__ float ld(uint16_t v) { return tt_d_f16_to_f32(v); }
  static __device__ __forceinline__ uint16_t st(float v) { return tt_d_f32_to_f16(v); }
};

/* Calls FN<DT>(args...) for the float dtypes; falls through otherwise. */
#define TT_FLOAT_DISPATCH(dtype, FN, ...)                              \
  switch (dtype) {                                                     \
    case TT_F32: return FN<TT_F32>(__VA_ARGS__);                       \
    case TT_F64: return FN<TT_F64>(__VA_ARGS__);                       \
    case TT_BF16: return FN<TT_BF16>(__VA_ARGS__);                     \
    case TT_F16: return FN<TT_F16>(__VA_ARGS__);                       \
    default: break;                                                    \
  }

static inline size_t tt_cuda_float_size(int dtype) {
  return dtype == TT_F64 ? 8 : dtype == TT_F32 ? 4 : 2;
}

/* ---- 16-byte chunks ----------------------------------------------------- */

template <typename S> struct alignas(16) tt_pack {
  S v[16 / sizeof(S)];
};

__host__ __device__ __forceinline__ bool tt_al16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Elements [e, e + cnt) of p (cnt <= V) unconverted: one 16-byte register
 * pack, zeros past cnt. A kernel that keeps a row in registers between two
 * passes keeps these and converts twice (tt_unpack): for 16-bit types that
 * is half the registers of the converted values. */
template <int DT>
__device__ __forceinline__ tt_pack<typename tt_ft<DT>::S> tt_ld_raw(const typename tt_ft<DT>::S *p, int64_t e,
                                                                    int64_t cnt, bool vec) {
  typedef typename tt_ft<DT>::S S;
  constexpr int V = 16 / sizeof(S);
  tt_pack<S> pk;
  TT_EMU_CHUNK(cnt == V, vec);
  if (vec && cnt == V) {
    pk = *reinterpret_cast<const tt_pack<S> *>(p + e);
  } else {
#pragma unroll
    for (int k = 0; k < V; k++) pk.v[k] = k < cnt ? p[e + k] : (S)0;
  }
  return pk;
}

template <int DT>
__device__ __forceinline__ void tt_unpack(const tt_pack<typename tt_ft<DT>::S> &pk, typename tt_ft<DT>::C *out) {
#pragma unroll
  for (int k = 0; k < (int)(16 / sizeof(typename tt_ft<DT>::S)); k++) out[k] = tt_ft<DT>::ld(pk.v[k]);
}

/* The chunk converted; lanes past cnt get 0. */
template <int DT>
__device__ __forceinline__ void tt_ld_chunk(const typename tt_ft<DT>::S *p, int64_t e, int64_t cnt, bool vec,
                                            typename tt_ft<DT>::C *out) {
  tt_unpack<DT>(tt_ld_raw<DT>(p, e, cnt, vec), out);
}

/* A pack stored back: elements [e, e + cnt) only. */
template <int DT>
__device__ __forceinline__ void tt_st_raw(typename tt_ft<DT>::S *p, int64_t e, int64_t cnt, bool vec,
                                          const tt_pack<typename tt_ft<DT>::S> &pk) {
  TT_EMU_CHUNK(cnt == (int64_t)(16 / sizeof(typename tt_ft<DT>::S)), vec);
  if (vec && cnt == (int64_t)(16 / sizeof(typename tt_ft<DT>::S))) {
    *reinterpret_cast<tt_pack<typename tt_ft<DT>::S> *>(p + e) = pk;
  } else {
#pragma unroll
    for (int k = 0; k < (int)(16 / sizeof(typename tt_ft<DT>::S)); k++)
      if (k < cnt) p[e + k] = pk.v[k];
  }
}

/* Values converted to the storage type and stored: elements [e, e + cnt). */
template <int DT>
__device__ __forceinline__ void tt_st_chunk(typename tt_ft<DT>::S *p, int64_t e, int64_t cnt, bool vec,
                                            const typename tt_ft<DT>::C *in) {
  tt_pack<typename tt_ft<DT>::S> pk;
#pragma unroll
  for (int k = 0; k < (int)(16 / sizeof(typename tt_ft<DT>::S)); k++) pk.v[k] = tt_ft<DT>::st(in[k]);
  tt_st_raw<DT>(p, e, cnt, vec, pk);
}

/* ---- arithmetic the compiler may not contract --------------------------- */

__device__ __forceinline__ float tt_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double tt_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float tt_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double tt_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float tt_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double tt_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float tt_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double tt_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float tt_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double tt_sqrt(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float tt_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double tt_fma(double a, double b, double c) { return fma(a, b, c); }

__device__ __forceinline__ float tt_exp_lib(float a) { return expf(a); }
__device__ __forceinline__ double tt_exp_lib(double a) { return exp(a); }
__device__ __forceinline__ float tt_log_lib(float a) { return logf(a); }
__device__ __forceinline__ double tt_log_lib(double a) { return log(a); }

/* kernels/cpu/vmath.h's tt_expf, operation for operation. */
__device__ __forceinline__ float tt_d_expf(float x) {
  float xc = x > -104.0f ? x : -104.0f;
  xc = xc < 89.0f ? xc : 89.0f;
  float n = __fsub_rn(__fadd_rn(__fmul_rn(xc, 1.44269504088896341f), 12582912.0f), 12582912.0f);
  float r = fmaf(n, -0.693359375f, xc);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = __fadd_rn(fmaf(__fmul_rn(p, r), r, r), 1.0f);
  int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
  float s1 = __uint_as_float((uint32_t)(n1 + 127) << 23), s2 = __uint_as_float((uint32_t)(n2 + 127) << 23);
  return x == x ? __fmul_rn(__fmul_rn(p, s1), s2) : x;
}

/* ---- groups: G lanes (a warp or the whole block) per task ---------------- */

/* Every group-reduced kernel runs TT_CUDA_THREADS threads per block. */
#define TT_WARPS (TT_CUDA_THREADS / 32)

__device__ __forceinline__ float tt_shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ double tt_shfl_xor(double v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ long long tt_shfl_xor(long long v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ float tt_shfl0(float v) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ __forceinline__ double tt_shfl0(double v) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ __forceinline__ long long tt_shfl0(long long v) { return __shfl_sync(0xffffffffu, v, 0); }

struct tt_sum_op {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct tt_max_op { /* NaN-free inputs (callers skip NaN) */
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

/* A group-wide reduction of a scalar with a fixed tree; every lane gets
 * lane 0's result (so all lanes agree bit for bit). G is 32 (a warp, no
 * barrier) or a power of two up to the block: groups of G consecutive
 * threads, each summing its own warps in order. For G > 32 the whole block
 * must call it, every group the same number of times (it synchronizes the
 * block); smem holds TT_WARPS. */
template <int G, typename T, typename Op>
__device__ __forceinline__ T tt_group_reduce(T v, Op op, T *smem) {
  static_assert(G >= 32 && G <= TT_CUDA_THREADS && (G & (G - 1)) == 0, "G: a power of two, a warp up to the block");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, tt_shfl_xor(v, o));
  v = tt_shfl0(v);
  if (G == 32) return v;
  int w = threadIdx.x >> 5;
  __syncthreads(); /* smem may still be read by the previous call */
  if ((threadIdx.x & 31) == 0) smem[w] = v;
  __syncthreads();
  constexpr int W = G / 32;
  const int w0 = w & ~(W - 1);
  T r = smem[w0];
#pragma unroll
  for (int i = 1; i < W; i++) r = op(r, smem[w0 + i]);
  return r;
}

/* Blocks for `tasks` groups of G lanes, TT_CUDA_THREADS per block. */
static inline unsigned int tt_cuda_group_blocks(int64_t tasks, int G) {
  int64_t per = TT_CUDA_THREADS / G;
  int64_t b = (tasks + per - 1) / per;
  return (unsigned int)(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

/* Blocks of `kernel` (TT_CUDA_THREADS threads, static shared memory only)
 * that the device's SMs hold at once: a launch of that many runs as one
 * wave. The caller caches it per (kernel, device) in `cache` (0: not yet
 * asked); 1 when the runtime cannot say, which only costs speed. */
static inline int64_t tt_cuda_resident_blocks(const void *kernel, int device, std::atomic<int> *cache) {
  int n = cache[device].load(std::memory_order_relaxed);
  if (n > 0) return n;
  int per_sm = 0, sms = 0;
  /* Neither query touches a stream; the first may come during a graph
   * capture, whose thread-local mode must not see them as unsafe. */
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TT_CUDA_THREADS, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = sms = 1;
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  n = per_sm * sms > 0 ? per_sm * sms : 1;
  cache[device].store(n, std::memory_order_relaxed);
  return n;
}

/* ---- index faults ------------------------------------------------------------ */

/* An index outside [0, bound) at flat `position`: the first one since the
 * host last checked claims the device's record and later ones leave it as
 * is. Among the bad indices of one kernel, which thread wins depends on
 * timing, so with several the reported one need not be the lowest position
 * (the CPU's up-front check reports the lowest).
 * The plain read first keeps a flood of bad indices from queueing on the
 * atomic. The host reads the record only after the kernel finished. */
static __device__ __forceinline__ void tt_d_index_fault(tt_index_fault *f, int op, int64_t index, int64_t position,
                                                        int64_t bound) {
  if (*(volatile int32_t *)&f->op != TT_FAULT_NONE) return;
  if (atomicCAS((int *)&f->op, (int)TT_FAULT_NONE, op) == (int)TT_FAULT_NONE) {
    f->index = index;
    f->position = position;
    f->bound = bound;
  }
}

/* ---- row movers shared by index.cu and embed.cu ---------------------------- */

/* out[o, j, :] = src[o, idx[j], :] for elements of esz bytes; an index
 * outside [0, n_src) gives a zero row and a fault of `op` (TT_FAULT_*). */
tt_status tt_cuda_select_rows(int op, int esz, int64_t outer, int64_t n_src, int64_t inner, const void *src,
                              int64_t n_idx, const int64_t *idx, void *out);
/* dst[o, idx[j], :] += src[o, j, :] (scatter 0) or dst[o, idx[o, j, i], i] +=
 * src[o, j, i] (scatter 1), deterministic; an index outside [0, n_dst) adds
 * nothing and records a fault of `op`; `name` is the op for messages. */
tt_status tt_cuda_add_rows(int op, const char *name, int scatter, int dtype, int64_t outer, int64_t n_dst,
                           int64_t inner, void *dst, int64_t n_idx, const int64_t *idx, const void *src);

#endif
