/*
 * elementwise.cu — binary ops with broadcasting, unary ops and their
 * derivatives, axpy. f32, f64, bf16 and f16 (16-bit floats compute in f32
 * and round once per result).
 *
 * Binary ops first simplify the index space as copy.cu does (size-1 dims
 * dropped, dims contiguous in all three tensors merged): a packed same-shape
 * op becomes one flat run processed in 16-byte chunks, anything else (a
 * bias add, a scalar operand, a transposed view) runs a strided kernel with
 * 32-bit index math whenever the element count allows. The formulas are the
 * CPU's (kernels/cpu/elementwise.c), written with unfused products so f32
 * and f64 results round exactly as the reference's do, up to the last-ulp
 * differences between CUDA's and libm's transcendental functions.
 */
#include <string.h>

#include "kernel_util.cuh"

#define TT_BIN_MAX_DIMS 8

/* ---- binary ------------------------------------------------------------- */

template <typename C> __device__ __forceinline__ C tt_bin_apply(int op, C x, C y) {
  switch (op) {
    case TT_ADD: return tt_add(x, y);
    case TT_SUB: return tt_sub(x, y);
    case TT_MUL: return tt_mul(x, y);
    case TT_DIV: return tt_div(x, y);
    case TT_MAXIMUM: return x > y || x != x ? x : y;
    default: return x < y || x != x ? x : y; /* TT_MINIMUM */
  }
}

struct tt_bin_layout {
  int ndim;
  int64_t shape[TT_BIN_MAX_DIMS];
  int64_t a[TT_BIN_MAX_DIMS], b[TT_BIN_MAX_DIMS], o[TT_BIN_MAX_DIMS];
};
TT_EMU_NO_PTRS(tt_bin_layout)

/* In both binary kernels a, b and out may alias (in-place ops; so no
 * __restrict__): each element is read before it is written, by one thread. */
template <int DT>
__global__ void tt_binary_flat(int op, int64_t n, bool vec, const typename tt_ft<DT>::S *a,
                               const typename tt_ft<DT>::S *b, typename tt_ft<DT>::S *out) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C x[V], y[V];
    tt_ld_chunk<DT>(a, e, cnt, vec, x);
    tt_ld_chunk<DT>(b, e, cnt, vec, y);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] = tt_bin_apply<C>(op, x[k], y[k]);
    tt_st_chunk<DT>(out, e, cnt, vec, x);
  }
}

template <int DT, typename Idx>
__global__ void tt_binary_strided(int op, tt_bin_layout l, Idx n, const typename tt_ft<DT>::S *a,
                                  const typename tt_ft<DT>::S *b, typename tt_ft<DT>::S *out) {
  typedef typename tt_ft<DT>::C C;
  for (Idx i = (Idx)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (Idx)gridDim.x * blockDim.x) {
    int64_t ao = 0, bo = 0, oo = 0;
    Idx rem = i;
#pragma unroll
    for (int k = TT_BIN_MAX_DIMS - 1; k >= 1; --k) {
      if (k < l.ndim) {
        Idx len = (Idx)l.shape[k];
        Idx q = rem / len, r = rem - q * len;
        ao += (int64_t)r * l.a[k];
        bo += (int64_t)r * l.b[k];
        oo += (int64_t)r * l.o[k];
        rem = q;
      }
    }
    ao += (int64_t)rem * l.a[0];
    bo += (int64_t)rem * l.b[0];
    oo += (int64_t)rem * l.o[0];
    out[oo] = tt_ft<DT>::st(tt_bin_apply<C>(op, tt_ft<DT>::ld(a[ao]), tt_ft<DT>::ld(b[bo])));
  }
}

template <int DT>
static tt_status tt_binary_launch(int op, const tt_bin_layout &l, int64_t n, const void *a, const void *b, void *out) {
  typedef typename tt_ft<DT>::S S;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  int flat = l.ndim == 0 || (l.ndim == 1 && l.a[0] == 1 && l.b[0] == 1 && l.o[0] == 1);
  if (flat) {
    constexpr int V = 16 / sizeof(S);
    bool vec = tt_al16(a) && tt_al16(b) && tt_al16(out);
    tt_binary_flat<DT><<<tt_cuda_blocks((n + V - 1) / V), TT_CUDA_THREADS, 0, s>>>(op, n, vec, (const S *)a,
                                                                                   (const S *)b, (S *)out);
    TT_CUDA_CHECK_LAUNCH("tt_binary_flat");
    return TT_OK;
  }
  if (n <= INT32_MAX)
    tt_binary_strided<DT, uint32_t><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(op, l, (uint32_t)n, (const S *)a,
                                                                                  (const S *)b, (S *)out);
  else
    tt_binary_strided<DT, int64_t><<<tt_cuda_blocks(n), TT_CUDA_THREADS, 0, s>>>(op, l, n, (const S *)a,
                                                                                 (const S *)b, (S *)out);
  TT_CUDA_CHECK_LAUNCH("tt_binary_strided");
  return TT_OK;
}

extern "C" tt_status tt_cuda_binary(int op, int dtype, int ndim, const int64_t *shape, const void *a,
                                    const int64_t *a_strides, const void *b, const int64_t *b_strides, void *out,
                                    const int64_t *out_strides) {
  if (op < TT_ADD || op > TT_MINIMUM) return tt_error_set(TT_ERR_INVALID, "cuda binary: unknown op %d", op);
  if (ndim < 0 || ndim > TT_BIN_MAX_DIMS)
    return tt_error_set(TT_ERR_INVALID, "cuda binary: %d dims (at most %d)", ndim, TT_BIN_MAX_DIMS);
  /* Drop size-1 dims; fold a dim into the previous kept one when all three
   * tensors step over the pair as one run (broadcast dims included). */
  tt_bin_layout l;
  memset(&l, 0, sizeof l);
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    n *= shape[d];
    if (shape[d] == 1) continue;
    int j = l.ndim;
    if (j > 0 && l.a[j - 1] == a_strides[d] * shape[d] && l.b[j - 1] == b_strides[d] * shape[d] &&
        l.o[j - 1] == out_strides[d] * shape[d]) {
      l.shape[j - 1] *= shape[d];
      l.a[j - 1] = a_strides[d];
      l.b[j - 1] = b_strides[d];
      l.o[j - 1] = out_strides[d];
      continue;
    }
    l.shape[j] = shape[d];
    l.a[j] = a_strides[d];
    l.b[j] = b_strides[d];
    l.o[j] = out_strides[d];
    l.ndim++;
  }
  if (n <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_binary_launch, op, l, n, a, b, out)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda binary: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

/* ---- unary ---------------------------------------------------------------- */

#define TT_SQRT1_2 0.70710678118654752440
#define TT_INV_SQRT_2PI 0.39894228040143267794

__device__ __forceinline__ float tt_erf_lib(float x) { return erff(x); }
__device__ __forceinline__ double tt_erf_lib(double x) { return erf(x); }
__device__ __forceinline__ float tt_tanh_lib(float x) { return tanhf(x); }
__device__ __forceinline__ double tt_tanh_lib(double x) { return tanh(x); }
__device__ __forceinline__ float tt_fabs_lib(float x) { return fabsf(x); }
__device__ __forceinline__ double tt_fabs_lib(double x) { return fabs(x); }
__device__ __forceinline__ float tt_pow_lib(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double tt_pow_lib(double x, double y) { return pow(x, y); }

template <typename C> __device__ __forceinline__ C tt_unary_apply(int op, C x, C alpha) {
  const C one = (C)1;
  switch (op) {
    case TT_NEG: return -x;
    case TT_EXP: return tt_exp_lib(x);
    case TT_LOG: return tt_log_lib(x);
    case TT_SQRT: return tt_sqrt(x);
    case TT_RSQRT: return tt_div(one, tt_sqrt(x));
    case TT_SILU: return tt_div(x, tt_add(one, tt_exp_lib(-x)));
    case TT_GELU: return tt_mul(tt_mul((C)0.5, x), tt_add(one, tt_erf_lib(tt_mul(x, (C)TT_SQRT1_2))));
    case TT_RELU: return x > 0 ? x : (C)0;
    case TT_SCALE: return tt_mul(alpha, x);
    case TT_ADD_SCALAR: return tt_add(x, alpha);
    case TT_SQUARE: return tt_mul(x, x);
    case TT_ABS: return tt_fabs_lib(x);
    case TT_TANH: return tt_tanh_lib(x);
    case TT_SIGMOID: return tt_div(one, tt_add(one, tt_exp_lib(-x)));
    case TT_POW_SCALAR: return tt_pow_lib(x, alpha);
    default: return tt_div(one, x); /* TT_RECIPROCAL */
  }
}

/* dx = dy * f'(x), the CPU's formulas. */
template <typename C> __device__ __forceinline__ C tt_unary_grad(int op, C v, C g, C alpha) {
  const C one = (C)1;
  switch (op) {
    case TT_NEG: return -g;
    case TT_EXP: return tt_mul(g, tt_exp_lib(v));
    case TT_LOG: return tt_div(g, v);
    case TT_SQRT: return tt_div(tt_mul(g, (C)0.5), tt_sqrt(v));
    case TT_RSQRT: return tt_div(tt_mul(g, (C)-0.5), tt_mul(v, tt_sqrt(v)));
    case TT_SILU: {
      C s = tt_div(one, tt_add(one, tt_exp_lib(-v)));
      return tt_mul(tt_mul(g, s), tt_add(one, tt_mul(v, tt_sub(one, s))));
    }
    case TT_GELU: {
      C cdf = tt_mul((C)0.5, tt_add(one, tt_erf_lib(tt_mul(v, (C)TT_SQRT1_2))));
      C pdf = tt_exp_lib(tt_mul(tt_mul((C)-0.5, v), v));
      return tt_mul(g, tt_add(cdf, tt_mul(tt_mul(v, (C)TT_INV_SQRT_2PI), pdf)));
    }
    case TT_RELU: return v > 0 ? g : (C)0;
    case TT_SCALE: return tt_mul(alpha, g);
    case TT_ADD_SCALAR: return g;
    case TT_SQUARE: return tt_mul(tt_mul((C)2, v), g);
    case TT_ABS: return v > 0 ? g : (v < 0 ? -g : (C)0);
    case TT_TANH: {
      C t = tt_tanh_lib(v);
      return tt_mul(g, tt_sub(one, tt_mul(t, t)));
    }
    case TT_SIGMOID: {
      C s = tt_div(one, tt_add(one, tt_exp_lib(-v)));
      return tt_mul(tt_mul(g, s), tt_sub(one, s));
    }
    case TT_POW_SCALAR: return tt_mul(tt_mul(g, alpha), tt_pow_lib(v, tt_sub(alpha, one)));
    default: return tt_div(-g, tt_mul(v, v)); /* TT_RECIPROCAL */
  }
}

/* x == y allowed: a chunk is read before it is written, by one thread. */
template <int DT>
__global__ void tt_unary_kernel(int op, int64_t n, bool vec, typename tt_ft<DT>::C alpha,
                                const typename tt_ft<DT>::S *x, typename tt_ft<DT>::S *y) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C v[V];
    tt_ld_chunk<DT>(x, e, cnt, vec, v);
#pragma unroll
    for (int k = 0; k < V; k++) v[k] = tt_unary_apply<C>(op, v[k], alpha);
    tt_st_chunk<DT>(y, e, cnt, vec, v);
  }
}

template <int DT>
__global__ void tt_unary_backward_kernel(int op, int64_t n, bool vec, typename tt_ft<DT>::C alpha,
                                         const typename tt_ft<DT>::S *x, const typename tt_ft<DT>::S *dy,
                                         typename tt_ft<DT>::S *dx) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C v[V], g[V];
    tt_ld_chunk<DT>(x, e, cnt, vec, v);
    tt_ld_chunk<DT>(dy, e, cnt, vec, g);
#pragma unroll
    for (int k = 0; k < V; k++) v[k] = tt_unary_grad<C>(op, v[k], g[k], alpha);
    tt_st_chunk<DT>(dx, e, cnt, vec, v);
  }
}

/* y += alpha * x, the product rounded before the sum (as the CPU). */
template <int DT>
__global__ void tt_axpy_kernel(int64_t n, bool vec, typename tt_ft<DT>::C alpha, const typename tt_ft<DT>::S *x,
                               typename tt_ft<DT>::S *y) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  int64_t nch = (n + V - 1) / V;
  for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < nch; c += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C a[V], b[V];
    tt_ld_chunk<DT>(x, e, cnt, vec, a);
    tt_ld_chunk<DT>(y, e, cnt, vec, b);
#pragma unroll
    for (int k = 0; k < V; k++) b[k] = tt_add(b[k], tt_mul(alpha, a[k]));
    tt_st_chunk<DT>(y, e, cnt, vec, b);
  }
}

/* kind 0 unary, 1 unary_backward, 2 axpy. */
template <int DT>
static tt_status tt_flat_launch(int kind, int op, int64_t n, double alpha, const void *x, const void *dy, void *out) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(S);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  unsigned int g = tt_cuda_blocks((n + V - 1) / V);
  bool vec = tt_al16(x) && tt_al16(out) && (!dy || tt_al16(dy));
  if (kind == 0) {
    tt_unary_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(op, n, vec, (C)alpha, (const S *)x, (S *)out);
    TT_CUDA_CHECK_LAUNCH("tt_unary_kernel");
  } else if (kind == 1) {
    tt_unary_backward_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(op, n, vec, (C)alpha, (const S *)x, (const S *)dy,
                                                               (S *)out);
    TT_CUDA_CHECK_LAUNCH("tt_unary_backward_kernel");
  } else {
    tt_axpy_kernel<DT><<<g, TT_CUDA_THREADS, 0, s>>>(n, vec, (C)alpha, (const S *)x, (S *)out);
    TT_CUDA_CHECK_LAUNCH("tt_axpy_kernel");
  }
  return TT_OK;
}

static tt_status tt_flat(const char *name, int kind, int op, int dtype, int64_t n, double alpha, const void *x,
                         const void *dy, void *out) {
  if (n <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_flat_launch, kind, op, n, alpha, x, dy, out)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda %s: dtype %d not supported (f32, f64, bf16, f16)", name, dtype);
}

extern "C" tt_status tt_cuda_unary(int op, int dtype, int64_t n, double alpha, const void *x, void *y) {
  if (op < TT_NEG || op > TT_RECIPROCAL) return tt_error_set(TT_ERR_INVALID, "cuda unary: unknown op %d", op);
  return tt_flat("unary", 0, op, dtype, n, alpha, x, NULL, y);
}

extern "C" tt_status tt_cuda_unary_backward(int op, int dtype, int64_t n, double alpha, const void *x, const void *y,
                                            const void *dy, void *dx) {
  (void)y; /* every derivative here is cheap to recompute from x */
  if (op < TT_NEG || op > TT_RECIPROCAL)
    return tt_error_set(TT_ERR_INVALID, "cuda unary_backward: unknown op %d", op);
  return tt_flat("unary_backward", 1, op, dtype, n, alpha, x, dy, dx);
}

extern "C" tt_status tt_cuda_axpy(int dtype, int64_t n, double alpha, const void *x, void *y) {
  return tt_flat("axpy", 2, 0, dtype, n, alpha, x, NULL, y);
}

/* ---- foreach: scale or fill many tensors per launch ------------------------ */

/* As tt_adam_mt_args (optim.cu): tensor i owns blocks [first_block[i],
 * first_block[i + 1]); the per-element arithmetic is the unary kernel's
 * TT_SCALE (alpha in the compute type), so the bits are the same. */
struct tt_foreach_args {
  int count;
  unsigned int first_block[TT_FOREACH_MAX + 1];
  void *x[TT_FOREACH_MAX];
  int64_t n[TT_FOREACH_MAX];
};
#if TITAN_CUEMU
static void tt_emu_ptrs(const tt_foreach_args &a, tt_emu_ptr_visit &visit) {
  for (int i = 0; i < a.count && i < TT_FOREACH_MAX; i++) visit("x[i]", i, a.x[i]);
}
#endif

template <int DT>
__global__ void tt_foreach_scale_kernel(typename tt_ft<DT>::C alpha, int set, const __grid_constant__ tt_foreach_args a) {
  typedef typename tt_ft<DT>::C C;
  typedef typename tt_ft<DT>::S S;
  constexpr int V = 16 / sizeof(S);
  int i = 0;
  while (i + 1 < a.count && a.first_block[i + 1] <= blockIdx.x) i++;
  S *x = (S *)a.x[i];
  const int64_t n = a.n[i], nch = (n + V - 1) / V;
  const int64_t stride = (int64_t)(a.first_block[i + 1] - a.first_block[i]) * blockDim.x;
  const bool vec = tt_al16(x);
  for (int64_t c = (int64_t)(blockIdx.x - a.first_block[i]) * blockDim.x + threadIdx.x; c < nch; c += stride) {
    int64_t e = c * V, cnt = n - e < V ? n - e : V;
    C v[V];
    if (set) {
#pragma unroll
      for (int k = 0; k < V; k++) v[k] = alpha;
    } else {
      tt_ld_chunk<DT>(x, e, cnt, vec, v);
#pragma unroll
      for (int k = 0; k < V; k++) v[k] = tt_unary_apply<C>(TT_SCALE, v[k], alpha);
    }
    tt_st_chunk<DT>(x, e, cnt, vec, v);
  }
}

template <int DT>
static tt_status tt_foreach_launch(int k, void *const *xs, const int64_t *ns, double alpha, int set) {
  typedef typename tt_ft<DT>::C C;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  tt_foreach_args a;
  memset(&a, 0, sizeof a);
  unsigned int grid = 0;
  for (int i = 0; i < k; i++) {
    if (ns[i] <= 0) continue;
    a.x[a.count] = xs[i];
    a.n[a.count] = ns[i];
    a.first_block[a.count++] = grid;
    grid += tt_cuda_blocks((ns[i] + V - 1) / V);
  }
  if (a.count == 0) return TT_OK;
  a.first_block[a.count] = grid;
  tt_foreach_scale_kernel<DT><<<grid, TT_CUDA_THREADS, 0, s>>>((C)alpha, set, a);
  TT_CUDA_CHECK_LAUNCH("tt_foreach_scale_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_foreach_scale(int dtype, int k, void *const *xs, const int64_t *ns, double alpha,
                                           int set) {
  if (k < 0 || k > TT_FOREACH_MAX)
    return tt_error_set(TT_ERR_INVALID, "cuda foreach_scale: %d tensors (at most %d per call)", k, TT_FOREACH_MAX);
  TT_FLOAT_DISPATCH(dtype, tt_foreach_launch, k, xs, ns, alpha, set)
  return tt_error_set(TT_ERR_DTYPE, "cuda foreach_scale: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}
