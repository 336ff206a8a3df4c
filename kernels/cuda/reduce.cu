/*
 * reduce.cu — reductions over the middle dim of a contiguous [outer, n,
 * inner] (sum, mean, max with the first max's index, L2 norm), sum_to,
 * softmax / log-softmax and their backward, and the sum of squares behind
 * the global gradient norm. f32, f64, bf16 and f16 in; sums in double (as
 * the CPU does for f32), results in the input's dtype.
 *
 * Determinism: every sum has one order that depends on the shape alone.
 * Rows (inner == 1) are summed by a warp (short rows) or a block in the
 * chunk order of kernel_util.cuh; columns (inner > 1) by one thread each,
 * sequentially. When there are too few outputs to fill the GPU, the reduced
 * dim is cut into S segments (S a function of the shape), each segment
 * leaves a partial in the device's fixed workspace, and a second kernel
 * folds the partials in segment order. No atomics anywhere. The orders are
 * not the CPU's (its 16 lanes and 8192-element blocks), so sums agree with
 * the reference to double rounding, not bit for bit; max, its index and the
 * NaN rules (first NaN wins; first of equal maxima) are exact.
 */
#include <string.h>

#include "kernel_util.cuh"

/* ---- shared pieces -------------------------------------------------------- */

/* A max candidate: its value (every input dtype is exact in double) and the
 * index it came from; TT_NO_INDEX marks "nothing seen yet". */
struct tt_argmax {
  double v;
  long long i;
};
#define TT_NO_INDEX 0x7fffffffffffffffLL

__device__ __forceinline__ tt_argmax tt_shfl_xor(tt_argmax a, int o) {
  a.v = tt_shfl_xor(a.v, o);
  a.i = tt_shfl_xor(a.i, o);
  return a;
}
__device__ __forceinline__ tt_argmax tt_shfl0(tt_argmax a) {
  a.v = tt_shfl0(a.v);
  a.i = tt_shfl0(a.i);
  return a;
}

/* The CPU's rule inside one ordered scan: NaN propagates (the first wins),
 * and only a strictly larger value replaces the best (the first of equal
 * maxima stays). */
__device__ __forceinline__ bool tt_max_takes(double v, double best) { return v > best || (v != v && best == best); }

/* Two scans over interleaved subsets: a NaN beats a number, a larger value
 * beats a smaller one, and ties (equal values, -0 == +0, or two NaNs) go to
 * the smaller index. Symmetric, so every lane of a butterfly agrees. */
struct tt_argmax_op {
  __device__ __forceinline__ tt_argmax operator()(tt_argmax a, tt_argmax b) const {
    bool an = a.v != a.v, bn = b.v != b.v;
    if (an != bn) return an ? a : b;
    if (!an && a.v != b.v) return a.v > b.v ? a : b;
    return a.i <= b.i ? a : b;
  }
};

__device__ __forceinline__ double tt_reduce_finish(int op, double s, int64_t n) {
  if (op == TT_RMEAN) return s / (double)n; /* n == 0 gives NaN, as torch.mean does */
  if (op == TT_RNORM2) return sqrt(s);
  return s;
}

/* ---- reduce: rows (inner == 1) --------------------------------------------- */

/* Task t = (row r, segment seg) of S, segment [seg * L, min(n, seg * L + L))
 * with L a multiple of 8 (so a segment's chunks stay 16-byte aligned). With
 * S == 1 the group writes the result, otherwise a partial at pv/pi[t]. */
template <int DT, int G>
__global__ void tt_reduce_rows(int op, int64_t rows, int64_t n, int64_t S, int64_t L,
                               const typename tt_ft<DT>::S *__restrict__ x, typename tt_ft<DT>::S *__restrict__ y,
                               int64_t *__restrict__ idx, double *__restrict__ pv, long long *__restrict__ pi) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm_sum[TT_WARPS];
  __shared__ tt_argmax sm_max[TT_WARPS];
  const int lane = threadIdx.x % G;
  const int64_t ntask = rows * S;
  for (int64_t t = (int64_t)blockIdx.x * PER + threadIdx.x / G; t < ntask; t += (int64_t)gridDim.x * PER) {
    int64_t r = t / S, seg = t % S;
    int64_t lo = seg * L, hi = lo + L < n ? lo + L : n;
    const typename tt_ft<DT>::S *row = x + r * n;
    bool vec = tt_al16(row);
    if (op == TT_RMAX) {
      tt_argmax b = {-INFINITY, TT_NO_INDEX};
      for (int64_t e = lo + (int64_t)lane * V; e < hi; e += (int64_t)G * V) {
        int64_t cnt = hi - e < V ? hi - e : V;
        C c[V];
        tt_ld_chunk<DT>(row, e, cnt, vec, c);
#pragma unroll
        for (int k = 0; k < V; k++)
          if (k < cnt && tt_max_takes((double)c[k], b.v)) {
            b.v = (double)c[k];
            b.i = e + k;
          }
      }
      b = tt_group_reduce<G>(b, tt_argmax_op(), sm_max);
      if (b.i == TT_NO_INDEX) b.i = lo; /* all -inf (or empty): the first index, as the CPU */
      if (lane == 0) {
        if (S == 1) {
          y[r] = tt_ft<DT>::st((C)b.v);
          if (idx) idx[r] = b.i;
        } else {
          pv[t] = b.v;
          pi[t] = b.i;
        }
      }
    } else {
      const bool sq = op == TT_RNORM2;
      double acc = 0.0;
      for (int64_t e = lo + (int64_t)lane * V; e < hi; e += (int64_t)G * V) {
        int64_t cnt = hi - e < V ? hi - e : V;
        C c[V];
        tt_ld_chunk<DT>(row, e, cnt, vec, c);
#pragma unroll
        for (int k = 0; k < V; k++) {
          double v = (double)c[k];
          if (k < cnt) acc = tt_add(acc, sq ? tt_mul(v, v) : v);
        }
      }
      acc = tt_group_reduce<G>(acc, tt_sum_op(), sm_sum);
      if (lane == 0) {
        if (S == 1) y[r] = tt_ft<DT>::st((C)tt_reduce_finish(op, acc, n));
        else pv[t] = acc;
      }
    }
  }
}

/* ---- reduce: columns (inner > 1) -------------------------------------------- */

/* Thread u = ((o * S + seg) * inner + c) walks x[o, lo:hi, c] in order:
 * adjacent threads read adjacent columns (coalesced). */
template <int DT>
__global__ void tt_reduce_cols(int op, int64_t outer, int64_t n, int64_t inner, int64_t S, int64_t L,
                               const typename tt_ft<DT>::S *__restrict__ x, typename tt_ft<DT>::S *__restrict__ y,
                               int64_t *__restrict__ idx, double *__restrict__ pv, long long *__restrict__ pi) {
  typedef typename tt_ft<DT>::C C;
  const int64_t total = outer * S * inner;
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (int64_t)gridDim.x * blockDim.x) {
    int64_t c = u % inner, q = u / inner, seg = q % S, o = q / S;
    int64_t lo = seg * L, hi = lo + L < n ? lo + L : n;
    const typename tt_ft<DT>::S *col = x + o * n * inner + c;
    if (op == TT_RMAX) {
      double b = -INFINITY;
      long long a = lo;
      for (int64_t j = lo; j < hi; j++) {
        double v = (double)tt_ft<DT>::ld(col[j * inner]);
        if (tt_max_takes(v, b)) {
          b = v;
          a = j;
        }
      }
      if (S == 1) {
        y[o * inner + c] = tt_ft<DT>::st((C)b);
        if (idx) idx[o * inner + c] = a;
      } else {
        pv[u] = b;
        pi[u] = a;
      }
    } else {
      const bool sq = op == TT_RNORM2;
      double acc = 0.0;
      for (int64_t j = lo; j < hi; j++) {
        double v = (double)tt_ft<DT>::ld(col[j * inner]);
        acc = tt_add(acc, sq ? tt_mul(v, v) : v);
      }
      if (S == 1) y[o * inner + c] = tt_ft<DT>::st((C)tt_reduce_finish(op, acc, n));
      else pv[u] = acc;
    }
  }
}

/* Folds the S partials of each output in segment order (the CPU's combine). */
template <int DT>
__global__ void tt_reduce_combine(int op, int64_t outer, int64_t n, int64_t inner, int64_t S,
                                  const double *__restrict__ pv, const long long *__restrict__ pi,
                                  typename tt_ft<DT>::S *__restrict__ y, int64_t *__restrict__ idx) {
  typedef typename tt_ft<DT>::C C;
  const int64_t nout = outer * inner;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < nout; k += (int64_t)gridDim.x * blockDim.x) {
    int64_t o = k / inner, c = k % inner;
    const int64_t first = o * S * inner + c;
    if (op == TT_RMAX) {
      double b = -INFINITY;
      long long a = 0;
      for (int64_t s = 0; s < S; s++)
        if (tt_max_takes(pv[first + s * inner], b)) {
          b = pv[first + s * inner];
          a = pi[first + s * inner];
        }
      y[k] = tt_ft<DT>::st((C)b);
      if (idx) idx[k] = a;
    } else {
      double acc = 0.0;
      for (int64_t s = 0; s < S; s++) acc = tt_add(acc, pv[first + s * inner]);
      y[k] = tt_ft<DT>::st((C)tt_reduce_finish(op, acc, n));
    }
  }
}

static int64_t tt_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t tt_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Segments of a reduced dim of length n for `nout` outputs: a function of
 * the shape alone (never of the device), so the bits are too. */
static void tt_reduce_plan(int64_t nout, int64_t n, int64_t inner, int64_t *S_out, int64_t *L_out) {
  int64_t S = 1;
  if (n > 0) {
    if (inner == 1) {
      if (n >= 65536 && nout < 256) S = tt_min64(tt_cdiv(n, 32768), tt_cdiv(512, nout));
    } else if (n >= 512 && nout < 32768) {
      S = tt_min64(tt_cdiv(65536, nout), tt_cdiv(n, 128));
    }
    int64_t cap = (int64_t)(TT_CUDA_WORKSPACE / 16) / nout; /* a double and an index per partial */
    if (S > cap) S = cap;
    if (S < 2) S = 1;
  }
  int64_t L = n > 0 ? (tt_cdiv(n, S) + 7) / 8 * 8 : 0;
  if (S > 1) S = tt_cdiv(n, L); /* no empty segment */
  *S_out = S;
  *L_out = L;
}

template <int DT>
static tt_status tt_reduce_launch(int op, int64_t outer, int64_t n, int64_t inner, const void *xv, void *yv,
                                  int64_t *idx) {
  typedef typename tt_ft<DT>::S S_t;
  const S_t *x = (const S_t *)xv;
  S_t *y = (S_t *)yv;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  int64_t nout = outer * inner, S, L;
  tt_reduce_plan(nout, n, inner, &S, &L);
  std::unique_lock<std::mutex> hold;
  double *pv = NULL;
  long long *pi = NULL;
  if (S > 1) {
    void *ws;
    if ((st = tt_cuda_workspace(device, &ws, &hold)) != TT_OK) return st;
    pv = (double *)ws;
    pi = (long long *)(pv + nout * S);
  }
  if (inner == 1) {
    if (n <= 1024) {
      tt_reduce_rows<DT, 32><<<tt_cuda_group_blocks(outer * S, 32), TT_CUDA_THREADS, 0, s>>>(op, outer, n, S, L, x, y,
                                                                                            idx, pv, pi);
    } else {
      tt_reduce_rows<DT, TT_CUDA_THREADS><<<tt_cuda_group_blocks(outer * S, TT_CUDA_THREADS), TT_CUDA_THREADS, 0, s>>>(
          op, outer, n, S, L, x, y, idx, pv, pi);
    }
    TT_CUDA_CHECK_LAUNCH("tt_reduce_rows");
  } else {
    tt_reduce_cols<DT><<<tt_cuda_blocks(nout * S), TT_CUDA_THREADS, 0, s>>>(op, outer, n, inner, S, L, x, y, idx, pv,
                                                                            pi);
    TT_CUDA_CHECK_LAUNCH("tt_reduce_cols");
  }
  if (S > 1) {
    tt_reduce_combine<DT><<<tt_cuda_blocks(nout), TT_CUDA_THREADS, 0, s>>>(op, outer, n, inner, S, pv, pi, y, idx);
    TT_CUDA_CHECK_LAUNCH("tt_reduce_combine");
  }
  return TT_OK;
}

static int tt_reduce_dtype_ok(int dtype) {
  return dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16;
}

static tt_status tt_reduce_any(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                               int64_t *idx) {
  TT_FLOAT_DISPATCH(dtype, tt_reduce_launch, op, outer, n, inner, x, y, idx)
  return tt_error_set(TT_ERR_DTYPE, "cuda reduce: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

extern "C" tt_status tt_cuda_reduce(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x,
                                    void *y, int64_t *idx) {
  if (!tt_reduce_dtype_ok(dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda reduce: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  if (op != TT_RSUM && op != TT_RMEAN && op != TT_RMAX && op != TT_RNORM2)
    return tt_error_set(TT_ERR_INVALID, "cuda reduce: unknown op %d", op);
  if (outer <= 0 || inner <= 0) return TT_OK;
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "cuda reduce: negative length %lld", (long long)n);
  return tt_reduce_any(op, dtype, outer, n, inner, x, y, idx);
}

/* ---- sum_to ------------------------------------------------------------------ */

#define TT_SUMTO_MAX_DIMS 16
#define TT_SUMTO_MAX_GROUPS 8 /* kept and reduced groups alternate: 16 dims give 8 of each */

struct tt_sumto_layout {
  int nk, nr;
  int64_t ksize[TT_SUMTO_MAX_GROUPS], kstride[TT_SUMTO_MAX_GROUPS];
  int64_t rsize[TT_SUMTO_MAX_GROUPS], rstride[TT_SUMTO_MAX_GROUPS];
  int64_t nko, nred;
};
TT_EMU_NO_PTRS(tt_sumto_layout)

/* Two or more reduced groups: one thread per output, summing its reduced
 * multi-index in row-major order (an odometer, no divisions in the loop). */
template <int DT>
__global__ void tt_sum_to_general(tt_sumto_layout l, const typename tt_ft<DT>::S *__restrict__ x,
                                  typename tt_ft<DT>::S *__restrict__ out) {
  typedef typename tt_ft<DT>::C C;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < l.nko; k += (int64_t)gridDim.x * blockDim.x) {
    int64_t base = 0, rem = k;
    for (int d = l.nk - 1; d >= 0; d--) {
      base += (rem % l.ksize[d]) * l.kstride[d];
      rem /= l.ksize[d];
    }
    int64_t cnt[TT_SUMTO_MAX_GROUPS];
    for (int d = 0; d < l.nr; d++) cnt[d] = 0;
    int64_t off = 0;
    double acc = 0.0;
    for (int64_t r = 0; r < l.nred; r++) {
      acc = tt_add(acc, (double)tt_ft<DT>::ld(x[base + off]));
      for (int d = l.nr - 1; d >= 0; d--) {
        off += l.rstride[d];
        if (++cnt[d] < l.rsize[d]) break;
        off -= l.rstride[d] * l.rsize[d];
        cnt[d] = 0;
      }
    }
    out[k] = tt_ft<DT>::st((C)acc);
  }
}

template <int DT> static tt_status tt_sum_to_general_launch(const tt_sumto_layout &l, const void *x, void *out) {
  typedef typename tt_ft<DT>::S S_t;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_sum_to_general<DT><<<tt_cuda_blocks(l.nko), TT_CUDA_THREADS, 0, s>>>(l, (const S_t *)x, (S_t *)out);
  TT_CUDA_CHECK_LAUNCH("tt_sum_to_general");
  return TT_OK;
}

extern "C" tt_status tt_cuda_sum_to(int dtype, int ndim, const int64_t *shape, const void *x,
                                    const int64_t *out_shape, void *out) {
  if (!tt_reduce_dtype_ok(dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda sum_to: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  if (ndim < 0 || ndim > TT_SUMTO_MAX_DIMS)
    return tt_error_set(TT_ERR_INVALID, "cuda sum_to: %d dims (at most %d)", ndim, TT_SUMTO_MAX_DIMS);
  /* Collapse as the CPU does: drop size-1 dims, merge neighbours of one kind. */
  int64_t gsize[TT_SUMTO_MAX_DIMS];
  int gred[TT_SUMTO_MAX_DIMS];
  int ng = 0;
  int64_t nout = 1, total = 1;
  for (int d = 0; d < ndim; d++) {
    int64_t sz = shape[d];
    total *= sz;
    if (out_shape[d] != 1) nout *= out_shape[d];
    if (sz == 1) continue;
    int red = out_shape[d] == 1;
    if (ng > 0 && gred[ng - 1] == red) {
      gsize[ng - 1] *= sz;
    } else {
      gsize[ng] = sz;
      gred[ng++] = red;
    }
  }
  if (nout == 0) return TT_OK;
  size_t esz = tt_cuda_float_size(dtype);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  if (total == 0) { /* sums over an empty dim */
    TT_CUDA_CHECK(cudaMemsetAsync(out, 0, (size_t)nout * esz, s));
    return TT_OK;
  }
  int nred_groups = 0, rg = -1;
  for (int g = 0; g < ng; g++)
    if (gred[g]) {
      nred_groups++;
      rg = g;
    }
  if (nred_groups == 0) { /* nothing to sum: the same elements */
    TT_CUDA_CHECK(cudaMemcpyAsync(out, x, (size_t)total * esz, cudaMemcpyDeviceToDevice, s));
    return TT_OK;
  }
  if (nred_groups == 1) { /* [outer, n, inner]: exactly a reduction */
    int64_t outer = 1, inner = 1;
    for (int g = 0; g < rg; g++) outer *= gsize[g];
    for (int g = rg + 1; g < ng; g++) inner *= gsize[g];
    return tt_reduce_any(TT_RSUM, dtype, outer, gsize[rg], inner, x, out, NULL);
  }
  tt_sumto_layout l;
  memset(&l, 0, sizeof l);
  l.nko = 1;
  l.nred = 1;
  int64_t stride = 1;
  for (int g = ng - 1; g >= 0; g--) { /* groups are contiguous in x: strides from the sizes */
    stride *= gsize[g];
  }
  for (int g = 0; g < ng; g++) {
    stride /= gsize[g];
    if (gred[g]) {
      l.rsize[l.nr] = gsize[g];
      l.rstride[l.nr++] = stride;
      l.nred *= gsize[g];
    } else {
      l.ksize[l.nk] = gsize[g];
      l.kstride[l.nk++] = stride;
      l.nko *= gsize[g];
    }
  }
  TT_FLOAT_DISPATCH(dtype, tt_sum_to_general_launch, l, x, out)
  return tt_error_set(TT_ERR_DTYPE, "cuda sum_to: dtype %d not supported", dtype);
}

/* ---- softmax ------------------------------------------------------------------- */

/* exp in the row's compute precision: the CPU's tt_expf for f32 (and the
 * 16-bit floats, computed in f32), libm's exp for f64. */
__device__ __forceinline__ float tt_sm_exp(float a) { return tt_d_expf(a); }
__device__ __forceinline__ double tt_sm_exp(double a) { return exp(a); }

/* y = exp(x - max) / sum, or x - max - log(sum); sum in double. y == x is
 * allowed: a lane reads and writes only its own chunks. */
template <int DT, int G>
__global__ void tt_softmax_kernel(int64_t rows, int64_t n, int lg, const typename tt_ft<DT>::S *x,
                                  typename tt_ft<DT>::S *y) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ C sm_c[TT_WARPS];
  __shared__ double sm_d[TT_WARPS];
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * PER + threadIdx.x / G; r < rows; r += (int64_t)gridDim.x * PER) {
    const typename tt_ft<DT>::S *xr = x + r * n;
    typename tt_ft<DT>::S *yr = y + r * n;
    bool vec = tt_al16(xr) && tt_al16(yr);
    C m = -INFINITY; /* NaN is skipped here and reaches every output through the sum */
    for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
      int64_t cnt = n - e < V ? n - e : V;
      C c[V];
      tt_ld_chunk<DT>(xr, e, cnt, vec, c);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) m = c[k] > m ? c[k] : m;
    }
    m = tt_group_reduce<G>(m, tt_max_op(), sm_c);
    double acc = 0.0;
    for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
      int64_t cnt = n - e < V ? n - e : V;
      C c[V];
      tt_ld_chunk<DT>(xr, e, cnt, vec, c);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) acc = tt_add(acc, (double)tt_sm_exp(tt_sub(c[k], m)));
    }
    acc = tt_group_reduce<G>(acc, tt_sum_op(), sm_d);
    if (DT == TT_F64) {
      double lse = log(acc), inv = 1.0 / acc;
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
        int64_t cnt = n - e < V ? n - e : V;
        C c[V];
        tt_ld_chunk<DT>(xr, e, cnt, vec, c);
#pragma unroll
        for (int k = 0; k < V; k++)
          c[k] = lg ? (C)tt_sub(tt_sub((double)c[k], (double)m), lse) : (C)tt_mul((double)tt_sm_exp(tt_sub(c[k], m)), inv);
        tt_st_chunk<DT>(yr, e, cnt, vec, c);
      }
    } else {
      double sub = (double)m + log(acc), inv = 1.0 / acc;
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
        int64_t cnt = n - e < V ? n - e : V;
        C c[V];
        tt_ld_chunk<DT>(xr, e, cnt, vec, c);
#pragma unroll
        for (int k = 0; k < V; k++)
          c[k] = lg ? (C)tt_sub((double)c[k], sub) : (C)tt_mul((double)tt_sm_exp(tt_sub(c[k], m)), inv);
        tt_st_chunk<DT>(yr, e, cnt, vec, c);
      }
    }
  }
}

/* softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy).
 * In double, as the CPU. dx may alias dy. */
template <int DT, int G>
__global__ void tt_softmax_backward_kernel(int64_t rows, int64_t n, int lg, const typename tt_ft<DT>::S *y,
                                           const typename tt_ft<DT>::S *dy, typename tt_ft<DT>::S *dx) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm_d[TT_WARPS];
  const int lane = threadIdx.x % G;
  for (int64_t r = (int64_t)blockIdx.x * PER + threadIdx.x / G; r < rows; r += (int64_t)gridDim.x * PER) {
    const typename tt_ft<DT>::S *yr = y + r * n, *gr = dy + r * n;
    typename tt_ft<DT>::S *dr = dx + r * n;
    bool vec = tt_al16(yr) && tt_al16(gr) && tt_al16(dr);
    double acc = 0.0;
    for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
      int64_t cnt = n - e < V ? n - e : V;
      C yv[V], gv[V];
      tt_ld_chunk<DT>(yr, e, cnt, vec, yv);
      tt_ld_chunk<DT>(gr, e, cnt, vec, gv);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) acc = tt_add(acc, lg ? (double)gv[k] : tt_mul((double)gv[k], (double)yv[k]));
    }
    double sum = tt_group_reduce<G>(acc, tt_sum_op(), sm_d);
    for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
      int64_t cnt = n - e < V ? n - e : V;
      C yv[V], gv[V];
      tt_ld_chunk<DT>(yr, e, cnt, vec, yv);
      tt_ld_chunk<DT>(gr, e, cnt, vec, gv);
#pragma unroll
      for (int k = 0; k < V; k++) {
        double g = (double)gv[k], yy = (double)yv[k];
        gv[k] = lg ? (C)tt_sub(g, tt_mul((double)tt_sm_exp(yv[k]), sum)) : (C)tt_mul(yy, tt_sub(g, sum));
      }
      tt_st_chunk<DT>(dr, e, cnt, vec, gv);
    }
  }
}

/* kind 0 softmax, 1 backward. Short rows go to a warp each. */
template <int DT>
static tt_status tt_softmax_launch(int kind, int64_t rows, int64_t n, int lg, const void *a, const void *b, void *out) {
  typedef typename tt_ft<DT>::S S_t;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  if (kind == 0) {
    if (n <= 1024)
      tt_softmax_kernel<DT, 32><<<tt_cuda_group_blocks(rows, 32), TT_CUDA_THREADS, 0, s>>>(rows, n, lg, (const S_t *)a,
                                                                                          (S_t *)out);
    else
      tt_softmax_kernel<DT, TT_CUDA_THREADS><<<tt_cuda_group_blocks(rows, TT_CUDA_THREADS), TT_CUDA_THREADS, 0, s>>>(
          rows, n, lg, (const S_t *)a, (S_t *)out);
    TT_CUDA_CHECK_LAUNCH("tt_softmax_kernel");
  } else {
    if (n <= 1024)
      tt_softmax_backward_kernel<DT, 32><<<tt_cuda_group_blocks(rows, 32), TT_CUDA_THREADS, 0, s>>>(
          rows, n, lg, (const S_t *)a, (const S_t *)b, (S_t *)out);
    else {
      const unsigned int blocks = tt_cuda_group_blocks(rows, TT_CUDA_THREADS);
      tt_softmax_backward_kernel<DT, TT_CUDA_THREADS><<<blocks, TT_CUDA_THREADS, 0, s>>>(rows, n, lg, (const S_t *)a,
                                                                                       (const S_t *)b, (S_t *)out);
    }
    TT_CUDA_CHECK_LAUNCH("tt_softmax_backward_kernel");
  }
  return TT_OK;
}

extern "C" tt_status tt_cuda_softmax(int dtype, int64_t rows, int64_t n, int log, const void *x, void *y) {
  if (!tt_reduce_dtype_ok(dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda softmax: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  if (rows <= 0 || n <= 0) return TT_OK;
  TT_FLOAT_DISPATCH(dtype, tt_softmax_launch, 0, rows, n, log, x, NULL, y)
  return TT_ERR_DTYPE;
}

extern "C" tt_status tt_cuda_softmax_backward(int dtype, int64_t rows, int64_t n, int log, const void *y,
                                              const void *dy, void *dx) {
  if (!tt_reduce_dtype_ok(dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda softmax_backward: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  if (rows <= 0 || n <= 0) return TT_OK;
  TT_FLOAT_DISPATCH(dtype, tt_softmax_launch, 1, rows, n, log, y, dy, dx)
  return TT_ERR_DTYPE;
}

/* ---- sumsq ------------------------------------------------------------------------ */

#define TT_SUMSQ_MAX_SEGS 1024

/* Up to TT_FOREACH_MAX tensors of one dtype per launch pair. Tensor i is
 * cut into nseg_i = first_seg[i + 1] - first_seg[i] segments of L[i]
 * elements (at most TT_SUMSQ_MAX_SEGS, a function of its size only), one
 * block per segment; its partials land at part[first_seg[i] ...]. */
struct tt_sumsq_args {
  int count;
  unsigned int first_seg[TT_FOREACH_MAX + 1];
  const void *x[TT_FOREACH_MAX];
  int64_t n[TT_FOREACH_MAX], L[TT_FOREACH_MAX];
};
#if TITAN_CUEMU
static void tt_emu_ptrs(const tt_sumsq_args &a, tt_emu_ptr_visit &visit) {
  for (int i = 0; i < a.count && i < TT_FOREACH_MAX; i++) visit("x[i]", i, a.x[i]);
}
#endif

/* Block b sums the squares of its segment [lo, hi) in double, in a fixed
 * order (threads take V-element chunks, then the block's group reduce). */
template <int DT>
__global__ void tt_sumsq_partial(const __grid_constant__ tt_sumsq_args a, double *__restrict__ part) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  __shared__ double sm[TT_WARPS];
  int i = 0;
  while (i + 1 < a.count && a.first_seg[i + 1] <= blockIdx.x) i++;
  const typename tt_ft<DT>::S *x = (const typename tt_ft<DT>::S *)a.x[i];
  const bool vec = tt_al16(x);
  const int64_t n = a.n[i], b = blockIdx.x - a.first_seg[i];
  const int64_t lo = b * a.L[i], hi = lo + a.L[i] < n ? lo + a.L[i] : n;
  double acc = 0.0;
  for (int64_t e = lo + (int64_t)threadIdx.x * V; e < hi; e += (int64_t)TT_CUDA_THREADS * V) {
    int64_t cnt = hi - e < V ? hi - e : V;
    C c[V];
    tt_ld_chunk<DT>(x, e, cnt, vec, c);
#pragma unroll
    for (int k = 0; k < V; k++)
      if (k < cnt) acc = tt_add(acc, tt_mul((double)c[k], (double)c[k]));
  }
  acc = tt_group_reduce<TT_CUDA_THREADS>(acc, tt_sum_op(), sm);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

/* Block i folds tensor i's partials (lane l takes l, l + 256, ... in
 * order) into slots[i]; no partials (an empty tensor): +0.0. */
__global__ void tt_sumsq_final(const __grid_constant__ tt_sumsq_args a, const double *part, double *slots) {
  __shared__ double sm[TT_WARPS];
  const int i = blockIdx.x;
  const int64_t nseg = a.first_seg[i + 1] - a.first_seg[i];
  const double *p = part + a.first_seg[i];
  double acc = 0.0;
  for (int64_t j = threadIdx.x; j < nseg; j += TT_CUDA_THREADS) acc = tt_add(acc, p[j]);
  acc = tt_group_reduce<TT_CUDA_THREADS>(acc, tt_sum_op(), sm);
  if (threadIdx.x == 0) slots[i] = acc;
}

template <int DT>
static tt_status tt_sumsq_run(cudaStream_t s, const tt_sumsq_args &a, double *part, double *slots) {
  if (a.first_seg[a.count] > 0) {
    tt_sumsq_partial<DT><<<a.first_seg[a.count], TT_CUDA_THREADS, 0, s>>>(a, part);
    TT_CUDA_CHECK_LAUNCH("tt_sumsq_partial");
  }
  tt_sumsq_final<<<(unsigned int)a.count, TT_CUDA_THREADS, 0, s>>>(a, part, slots);
  TT_CUDA_CHECK_LAUNCH("tt_sumsq_final");
  return TT_OK;
}

/* Appends a tensor of n elements to a: its segments (a function of n
 * only, so its partial sums and their order are too) start at *segs. */
static void tt_sumsq_plan(int64_t n, tt_sumsq_args *a, unsigned int *segs, const void *x) {
  int64_t nseg = 0, L = 0;
  if (n > 0) {
    nseg = tt_cdiv(n, 16384);
    if (nseg > TT_SUMSQ_MAX_SEGS) nseg = TT_SUMSQ_MAX_SEGS;
    L = (tt_cdiv(n, nseg) + 7) / 8 * 8;
    nseg = tt_cdiv(n, L);
  }
  a->x[a->count] = x;
  a->n[a->count] = n > 0 ? n : 0;
  a->L[a->count] = L;
  a->first_seg[a->count++] = *segs;
  *segs += (unsigned int)nseg;
}

/* slots[i] = the sum of squares of tensor i < k: runs of consecutive
 * tensors of one dtype (up to TT_FOREACH_MAX) take two launches each, their
 * partials in part (TT_FOREACH_MAX * TT_SUMSQ_MAX_SEGS doubles). */
static tt_status tt_sumsq_slots(cudaStream_t s, int k, const int *dtypes, const int64_t *ns, const void *const *xs,
                                double *part, double *slots) {
  for (int i = 0; i < k;) {
    const int dt = dtypes[i];
    tt_sumsq_args a;
    memset(&a, 0, sizeof a);
    unsigned int segs = 0;
    const int first = i;
    while (i < k && a.count < TT_FOREACH_MAX && dtypes[i] == dt) {
      tt_sumsq_plan(ns[i], &a, &segs, xs[i]);
      i++;
    }
    a.first_seg[a.count] = segs;
    tt_status st;
    switch (dt) {
      case TT_F32: st = tt_sumsq_run<TT_F32>(s, a, part, slots + first); break;
      case TT_F64: st = tt_sumsq_run<TT_F64>(s, a, part, slots + first); break;
      case TT_BF16: st = tt_sumsq_run<TT_BF16>(s, a, part, slots + first); break;
      default: st = tt_sumsq_run<TT_F16>(s, a, part, slots + first); break;
    }
    if (st != TT_OK) return st;
  }
  return TT_OK;
}

/* The sums of squares of k tensors with one read-back for all: every
 * result lands in its own workspace slot after the partials' area, then
 * the slots come to the host together. */
extern "C" tt_status tt_cuda_sumsq_many(int k, const int *dtypes, const int64_t *ns, const void *const *xs,
                                        double *out) {
  for (int i = 0; i < k; i++)
    if (!tt_reduce_dtype_ok(dtypes[i]))
      return tt_error_set(TT_ERR_DTYPE, "cuda sumsq: dtype %d not supported (f32, f64, bf16, f16)", dtypes[i]);
  if (k <= 0) return TT_OK;
  const int64_t part_len = (int64_t)TT_FOREACH_MAX * TT_SUMSQ_MAX_SEGS;
  const int64_t max_slots = (int64_t)(TT_CUDA_WORKSPACE / sizeof(double)) - part_len;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  std::unique_lock<std::mutex> hold;
  void *ws;
  if ((st = tt_cuda_workspace(device, &ws, &hold)) != TT_OK) return st;
  double *part = (double *)ws, *slots = part + part_len;
  for (int done = 0; done < k;) {
    int batch = (int)(k - done < max_slots ? k - done : max_slots);
    if ((st = tt_sumsq_slots(s, batch, dtypes + done, ns + done, xs + done, part, slots)) != TT_OK) return st;
    TT_CUDA_CHECK(cudaMemcpyAsync(out + done, slots, (size_t)batch * sizeof(double), cudaMemcpyDeviceToHost, s));
    TT_CUDA_CHECK(cudaStreamSynchronize(s));
    done += batch;
  }
  return TT_OK;
}

/* One thread adds the slots in tensor order, as tt_op_global_norm adds the
 * read-back sums on the host, and derives the clip coefficient as the
 * trainer does (max_norm / (norm + 1e-6) when norm > max_norm > 0). */
__global__ void tt_global_norm_fold(int k, const double *slots, double max_norm, double *out, int count) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0.0;
  for (int i = 0; i < k; i++) total = __dadd_rn(total, slots[i]);
  const double norm = __dsqrt_rn(total);
  out[0] = norm;
  out[1] = max_norm > 0 && norm > max_norm ? __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6)) : 1.0;
  if (count && !isfinite(norm)) out[2] = __dadd_rn(out[2], 1.0); /* the steps the update kernels skip */
}

/* sumsq_many's launches with the slots left in the workspace, then the
 * fold: nothing waits, so a CUDA graph can capture it. */
extern "C" tt_status tt_cuda_global_norm_dev(int k, const int *dtypes, const int64_t *ns, const void *const *xs,
                                             double max_norm, double *out, int count_nonfinite) {
  for (int i = 0; i < k; i++)
    if (!tt_reduce_dtype_ok(dtypes[i]))
      return tt_error_set(TT_ERR_DTYPE, "cuda global_norm: dtype %d not supported (f32, f64, bf16, f16)", dtypes[i]);
  if (k <= 0) return TT_OK;
  const int64_t part_len = (int64_t)TT_FOREACH_MAX * TT_SUMSQ_MAX_SEGS;
  const int64_t max_slots = (int64_t)(TT_CUDA_WORKSPACE / sizeof(double)) - part_len;
  if (k > max_slots)
    return tt_error_set(TT_ERR_INVALID, "cuda global_norm: %d tensors (at most %lld on the device)", k,
                        (long long)max_slots);
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  std::unique_lock<std::mutex> hold;
  void *ws;
  if ((st = tt_cuda_workspace(device, &ws, &hold)) != TT_OK) return st;
  double *part = (double *)ws, *slots = part + part_len;
  if ((st = tt_sumsq_slots(s, k, dtypes, ns, xs, part, slots)) != TT_OK) return st;
  tt_global_norm_fold<<<1, 32, 0, s>>>(k, slots, max_norm, out, count_nonfinite);
  TT_CUDA_CHECK_LAUNCH("tt_global_norm_fold");
  return TT_OK;
}

extern "C" tt_status tt_cuda_sumsq(int dtype, int64_t n, const void *x, double *out) {
  return tt_cuda_sumsq_many(1, &dtype, &n, &x, out);
}
