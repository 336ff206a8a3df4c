/*
 * norm.cu — RMSNorm over the last dim, forward and backward.
 *
 * y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); add_rmsnorm forms the
 * residual sum h = x + res in the first pass and normalizes it (the add
 * kernel's rounding, so the pair is bit-identical to running them apart);
 * the backward may accumulate dx onto a waiting gradient. One warp per row up
 * to 1024 elements, one block per row above; rows are read in 16-byte
 * chunks (kernel_util.cuh). A row of up to G * V * KMAX elements (4096 bf16
 * or f32 ones per block) is read from HBM once: each thread issues the
 * loads of all its chunks before it adds anything (many 16-byte loads in
 * flight, which is what keeps HBM busy) and keeps them in registers for
 * the second pass; a longer row is read twice, the second time from L1/L2.
 * Either way the sums run in the same order, so the bits are the same. As
 * on the CPU the sum of squares and
 * the backward's row dot product accumulate in double, and every other
 * step is the CPU's (kernels/cpu/norm.c) in the compute type with unfused
 * products: f32 and f64 outputs match the reference up to the order of the
 * double sums. rstd is f32 for f32/bf16/f16 input and f64 for f64.
 *
 * dw: each column summed over all rows, deterministically without atomics:
 * the rows are cut into R fixed chunks (R a function of the shape), each
 * chunk's sum lands in the device workspace, and a second kernel adds the R
 * partials in chunk order in double and accumulates into dw (dw = dw +
 * total, rounded once). Rows kept in registers get their chunk sums from
 * the dx kernel itself (a chunk of L >= 16 rows per row group, summed in the
 * compute type); longer rows take a kernel of their own, a thread per
 * (chunk, column) summing in double, which reads x and dy once more.
 */
#include "kernel_util.cuh"

/* Chunks of V elements a thread keeps in registers: 32 values (64 for f64
 * would cost too many registers). */
template <int DT> __host__ __device__ constexpr int tt_norm_kmax() { return DT == TT_F64 ? 4 : 32 / (16 / (int)sizeof(typename tt_ft<DT>::S)); }

/* Chunk q of this lane starts at element (lane + q G) V, as the loops'
 * e = lane V, lane V + G V, ...; cnt 0 past the row (nothing is loaded). */
template <int V> __device__ __forceinline__ int64_t tt_norm_e(int lane, int q, int G) {
  return ((int64_t)lane + (int64_t)q * G) * V;
}
template <int V> __device__ __forceinline__ int64_t tt_norm_cnt(int lane, int q, int G, int64_t dim) {
  const int64_t e = tt_norm_e<V>(lane, q, G);
  return e >= dim ? 0 : (dim - e < V ? dim - e : V);
}

/* RES: h = x + res first (rounded to the storage type, as the add kernel
 * would store it), written out, and normalized in place of x; the second
 * pass reads back the h this thread wrote. */
template <int DT, int G, bool RES>
__global__ void tt_rmsnorm_kernel(int64_t rows, int64_t dim, double eps, const typename tt_ft<DT>::S *__restrict__ x,
                                  const typename tt_ft<DT>::S *__restrict__ res, const typename tt_ft<DT>::S *__restrict__ w,
                                  typename tt_ft<DT>::S *__restrict__ h, typename tt_ft<DT>::S *__restrict__ y,
                                  typename tt_ft<DT>::C *__restrict__ rstd) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm[TT_WARPS];
  const int lane = threadIdx.x % G;
  constexpr int KMAX = tt_norm_kmax<DT>();
  const bool cached = dim <= (int64_t)G * V * KMAX;
  for (int64_t r = (int64_t)blockIdx.x * PER + threadIdx.x / G; r < rows; r += (int64_t)gridDim.x * PER) {
    const typename tt_ft<DT>::S *xr = x + r * dim;
    typename tt_ft<DT>::S *yr = y + r * dim;
    const typename tt_ft<DT>::S *rr = RES ? res + r * dim : NULL;
    typename tt_ft<DT>::S *hr = RES ? h + r * dim : NULL;
    const bool vec = tt_al16(xr) && tt_al16(yr) && tt_al16(w) && (!RES || (tt_al16(rr) && tt_al16(hr)));
    if (cached) {
      C c[KMAX][V];
      int64_t cnt[KMAX];
#pragma unroll
      for (int q = 0; q < KMAX; q++) {
        cnt[q] = tt_norm_cnt<V>(lane, q, G, dim);
        tt_ld_chunk<DT>(xr, tt_norm_e<V>(lane, q, G), cnt[q], vec, c[q]);
      }
      if (RES) {
#pragma unroll
        for (int q = 0; q < KMAX; q++) {
          C rv[V];
          tt_ld_chunk<DT>(rr, tt_norm_e<V>(lane, q, G), cnt[q], vec, rv);
#pragma unroll
          for (int k = 0; k < V; k++) c[q][k] = tt_ft<DT>::ld(tt_ft<DT>::st(tt_add(c[q][k], rv[k])));
          if (cnt[q] > 0) tt_st_chunk<DT>(hr, tt_norm_e<V>(lane, q, G), cnt[q], vec, c[q]);
        }
      }
      double ss = 0.0;
#pragma unroll
      for (int q = 0; q < KMAX; q++)
#pragma unroll
        for (int k = 0; k < V; k++)
          if (k < cnt[q]) ss = tt_add(ss, tt_mul((double)c[q][k], (double)c[q][k]));
      ss = tt_group_reduce<G>(ss, tt_sum_op(), sm);
      const C rs = (C)(1.0 / sqrt(ss / (double)dim + eps));
      if (lane == 0) rstd[r] = rs;
#pragma unroll
      for (int q = 0; q < KMAX; q++) {
        if (cnt[q] <= 0) continue;
        C wv[V];
        tt_ld_chunk<DT>(w, tt_norm_e<V>(lane, q, G), cnt[q], vec, wv);
#pragma unroll
        for (int k = 0; k < V; k++) c[q][k] = tt_mul(tt_mul(c[q][k], rs), wv[k]);
        tt_st_chunk<DT>(yr, tt_norm_e<V>(lane, q, G), cnt[q], vec, c[q]);
      }
      continue;
    }
    double ss = 0.0;
    for (int64_t e = (int64_t)lane * V; e < dim; e += (int64_t)G * V) {
      int64_t cnt = dim - e < V ? dim - e : V;
      C c[V];
      tt_ld_chunk<DT>(xr, e, cnt, vec, c);
      if (RES) {
        C rv[V];
        tt_ld_chunk<DT>(rr, e, cnt, vec, rv);
#pragma unroll
        for (int k = 0; k < V; k++) c[k] = tt_ft<DT>::ld(tt_ft<DT>::st(tt_add(c[k], rv[k])));
        tt_st_chunk<DT>(hr, e, cnt, vec, c);
      }
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) ss = tt_add(ss, tt_mul((double)c[k], (double)c[k]));
    }
    ss = tt_group_reduce<G>(ss, tt_sum_op(), sm);
    const C rs = (C)(1.0 / sqrt(ss / (double)dim + eps));
    if (lane == 0) rstd[r] = rs;
    for (int64_t e = (int64_t)lane * V; e < dim; e += (int64_t)G * V) {
      int64_t cnt = dim - e < V ? dim - e : V;
      C c[V], wv[V];
      tt_ld_chunk<DT>(RES ? hr : xr, e, cnt, vec, c);
      tt_ld_chunk<DT>(w, e, cnt, vec, wv);
#pragma unroll
      for (int k = 0; k < V; k++) c[k] = tt_mul(tt_mul(c[k], rs), wv[k]);
      tt_st_chunk<DT>(yr, e, cnt, vec, c);
    }
  }
}

/* dx = rstd * w * dy - x * (rstd^3 * sum(dy * w * x) / dim).
 * DW (rows kept in registers only): group `slot` takes the rows
 * [slot L, slot L + L) in order and also sums dy * x * rstd over them for
 * its columns, in the compute type (at most L terms), into part[slot dim +
 * column] as a double; tt_rmsnorm_dw_final adds the slots in order. So dw
 * costs no second read of x and dy. */
template <int DT, int G, bool DW>
__global__ void tt_rmsnorm_dx_kernel(int64_t rows, int64_t dim, const typename tt_ft<DT>::S *__restrict__ x,
                                     const typename tt_ft<DT>::S *__restrict__ w,
                                     const typename tt_ft<DT>::C *__restrict__ rstd,
                                     const typename tt_ft<DT>::S *__restrict__ dy, typename tt_ft<DT>::S *__restrict__ dx,
                                     bool acc, int64_t L, int64_t nslot, double *__restrict__ part) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm[TT_WARPS];
  const int lane = threadIdx.x % G;
  constexpr int KMAX = tt_norm_kmax<DT>();
  const bool cached = dim <= (int64_t)G * V * KMAX;
  const int64_t group = (int64_t)blockIdx.x * PER + threadIdx.x / G;
  int64_t r_first = group, r_end = rows, r_step = (int64_t)gridDim.x * PER;
  if (DW) {
    r_first = group * L;
    r_end = r_first + L < rows ? r_first + L : rows;
    r_step = 1;
  }
  C dwacc[DW ? KMAX : 1][V];
#pragma unroll
  for (int q = 0; q < (DW ? KMAX : 1); q++)
#pragma unroll
    for (int k = 0; k < V; k++) dwacc[q][k] = (C)0;
  for (int64_t r = r_first; r < r_end; r += r_step) {
    const typename tt_ft<DT>::S *xr = x + r * dim, *gr = dy + r * dim;
    typename tt_ft<DT>::S *dr = dx + r * dim;
    const bool vec = tt_al16(xr) && tt_al16(gr) && tt_al16(dr) && tt_al16(w);
    if (cached) {
      C xv[KMAX][V], gv[KMAX][V];
      int64_t cnt[KMAX];
#pragma unroll
      for (int q = 0; q < KMAX; q++) {
        cnt[q] = tt_norm_cnt<V>(lane, q, G, dim);
        tt_ld_chunk<DT>(xr, tt_norm_e<V>(lane, q, G), cnt[q], vec, xv[q]);
        tt_ld_chunk<DT>(gr, tt_norm_e<V>(lane, q, G), cnt[q], vec, gv[q]);
      }
      const C rs_c = rstd[r];
      double dot = 0.0;
#pragma unroll
      for (int q = 0; q < KMAX; q++) {
        if (cnt[q] <= 0) continue;
        C wv[V];
        tt_ld_chunk<DT>(w, tt_norm_e<V>(lane, q, G), cnt[q], vec, wv);
#pragma unroll
        for (int k = 0; k < V; k++) {
          if (k < cnt[q]) dot = tt_add(dot, tt_mul(tt_mul((double)gv[q][k], (double)wv[k]), (double)xv[q][k]));
          if (DW) dwacc[q][k] = tt_add(dwacc[q][k], tt_mul(tt_mul(gv[q][k], xv[q][k]), rs_c));
        }
      }
      dot = tt_group_reduce<G>(dot, tt_sum_op(), sm);
      const double rs = (double)rs_c;
      const C a = (C)rs, cc = (C)(rs * rs * rs * dot / (double)dim);
#pragma unroll
      for (int q = 0; q < KMAX; q++) {
        if (cnt[q] <= 0) continue;
        const int64_t e = tt_norm_e<V>(lane, q, G);
        C wv[V];
        tt_ld_chunk<DT>(w, e, cnt[q], vec, wv);
#pragma unroll
        for (int k = 0; k < V; k++) xv[q][k] = tt_sub(tt_mul(tt_mul(a, wv[k]), gv[q][k]), tt_mul(xv[q][k], cc));
        if (acc) {
          C old[V];
          tt_ld_chunk<DT>(dr, e, cnt[q], vec, old);
#pragma unroll
          for (int k = 0; k < V; k++) xv[q][k] = tt_add(old[k], xv[q][k]);
        }
        tt_st_chunk<DT>(dr, e, cnt[q], vec, xv[q]);
      }
      continue;
    }
    double dot = 0.0;
    for (int64_t e = (int64_t)lane * V; e < dim; e += (int64_t)G * V) {
      int64_t cnt = dim - e < V ? dim - e : V;
      C xv[V], gv[V], wv[V];
      tt_ld_chunk<DT>(xr, e, cnt, vec, xv);
      tt_ld_chunk<DT>(gr, e, cnt, vec, gv);
      tt_ld_chunk<DT>(w, e, cnt, vec, wv);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) dot = tt_add(dot, tt_mul(tt_mul((double)gv[k], (double)wv[k]), (double)xv[k]));
    }
    dot = tt_group_reduce<G>(dot, tt_sum_op(), sm);
    const double rs = (double)rstd[r];
    const C a = (C)rs, cc = (C)(rs * rs * rs * dot / (double)dim);
    for (int64_t e = (int64_t)lane * V; e < dim; e += (int64_t)G * V) {
      int64_t cnt = dim - e < V ? dim - e : V;
      C xv[V], gv[V], wv[V];
      tt_ld_chunk<DT>(xr, e, cnt, vec, xv);
      tt_ld_chunk<DT>(gr, e, cnt, vec, gv);
      tt_ld_chunk<DT>(w, e, cnt, vec, wv);
#pragma unroll
      for (int k = 0; k < V; k++) xv[k] = tt_sub(tt_mul(tt_mul(a, wv[k]), gv[k]), tt_mul(xv[k], cc));
      if (acc) { /* onto the gradient already waiting for x, rounded once */
        C old[V];
        tt_ld_chunk<DT>(dr, e, cnt, vec, old);
#pragma unroll
        for (int k = 0; k < V; k++) xv[k] = tt_add(old[k], xv[k]);
      }
      tt_st_chunk<DT>(dr, e, cnt, vec, xv);
    }
  }
  if (DW && group < nslot) {
#pragma unroll
    for (int q = 0; q < (DW ? KMAX : 1); q++) {
      const int64_t e = tt_norm_e<V>(lane, q, G), cnt = tt_norm_cnt<V>(lane, q, G, dim);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) part[group * dim + e + k] = (double)dwacc[q][k];
    }
  }
}

/* Thread (chunk k, column j) sums dy * x * rstd over rows [k * L, min(rows,
 * k * L + L)) in row order. R == 1: accumulates straight into dw. */
template <int DT>
__global__ void tt_rmsnorm_dw_partial(int64_t rows, int64_t dim, int64_t R, int64_t L,
                                      const typename tt_ft<DT>::S *__restrict__ x,
                                      const typename tt_ft<DT>::C *__restrict__ rstd,
                                      const typename tt_ft<DT>::S *__restrict__ dy, double *__restrict__ part,
                                      typename tt_ft<DT>::S *__restrict__ dw) {
  typedef typename tt_ft<DT>::C C;
  const int64_t total = R * dim;
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = u % dim, k = u / dim;
    int64_t r0 = k * L, r1 = r0 + L < rows ? r0 + L : rows;
    double acc = 0.0;
    for (int64_t r = r0; r < r1; r++) {
      double g = (double)tt_ft<DT>::ld(dy[r * dim + j]), xv = (double)tt_ft<DT>::ld(x[r * dim + j]);
      acc = tt_add(acc, tt_mul(tt_mul(g, xv), (double)rstd[r]));
    }
    if (R == 1) dw[j] = tt_ft<DT>::st((C)tt_add((double)tt_ft<DT>::ld(dw[j]), acc));
    else part[u] = acc;
  }
}

template <int DT>
__global__ void tt_rmsnorm_dw_final(int64_t dim, int64_t R, const double *__restrict__ part,
                                    typename tt_ft<DT>::S *__restrict__ dw) {
  typedef typename tt_ft<DT>::C C;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < dim; j += (int64_t)gridDim.x * blockDim.x) {
    double acc = 0.0;
    for (int64_t k = 0; k < R; k++) acc = tt_add(acc, part[k * dim + j]);
    dw[j] = tt_ft<DT>::st((C)tt_add((double)tt_ft<DT>::ld(dw[j]), acc));
  }
}

template <int DT, bool RES>
static void tt_rmsnorm_go(cudaStream_t s, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                          const void *w, void *h, void *y, void *rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  if (dim <= 1024)
    tt_rmsnorm_kernel<DT, 32, RES><<<tt_cuda_group_blocks(rows, 32), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const S *)x, (const S *)res, (const S *)w, (S *)h, (S *)y, (C *)rstd);
  else
    tt_rmsnorm_kernel<DT, TT_CUDA_THREADS, RES><<<tt_cuda_group_blocks(rows, TT_CUDA_THREADS), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const S *)x, (const S *)res, (const S *)w, (S *)h, (S *)y, (C *)rstd);
}

/* res == NULL: plain RMSNorm; else h = x + res is formed and normalized. */
template <int DT>
static tt_status tt_rmsnorm_launch(int64_t rows, int64_t dim, double eps, const void *x, const void *res, const void *w,
                                   void *h, void *y, void *rstd) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  if (res) tt_rmsnorm_go<DT, true>(s, rows, dim, eps, x, res, w, h, y, rstd);
  else tt_rmsnorm_go<DT, false>(s, rows, dim, eps, x, NULL, w, NULL, y, rstd);
  TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_kernel");
  return TT_OK;
}

template <int DT>
static tt_status tt_rmsnorm_backward_launch(int64_t rows, int64_t dim, const void *x, const void *w, const void *rstd,
                                            const void *dy, void *dx, void *dw, int acc) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  const int G = dim <= 1024 ? 32 : TT_CUDA_THREADS;
  const bool cached = dim <= (int64_t)G * (16 / (int64_t)sizeof(S)) * tt_norm_kmax<DT>();
  const int64_t slot_cap = (int64_t)(TT_CUDA_WORKSPACE / sizeof(double)) / dim;
  if (dw && cached && slot_cap >= 1) {
    /* dw from the same pass: slots of L >= 16 rows (a function of the shape
     * only), as many as the workspace holds. */
    int64_t L = (rows + slot_cap - 1) / slot_cap;
    if (L < 16) L = 16;
    const int64_t nslot = (rows + L - 1) / L, per = TT_CUDA_THREADS / G;
    std::unique_lock<std::mutex> hold;
    void *ws;
    if ((st = tt_cuda_workspace(device, &ws, &hold)) != TT_OK) return st;
    const unsigned int blocks = (unsigned int)((nslot + per - 1) / per);
    if (G == 32)
      tt_rmsnorm_dx_kernel<DT, 32, true><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    else
      tt_rmsnorm_dx_kernel<DT, TT_CUDA_THREADS, true><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dx_kernel (with dw)");
    tt_rmsnorm_dw_final<DT><<<tt_cuda_blocks(dim), TT_CUDA_THREADS, 0, s>>>(dim, nslot, (const double *)ws, (S *)dw);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dw_final");
    return TT_OK;
  }
  if (G == 32)
    tt_rmsnorm_dx_kernel<DT, 32, false><<<tt_cuda_group_blocks(rows, 32), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, 0, 0, NULL);
  else
    tt_rmsnorm_dx_kernel<DT, TT_CUDA_THREADS, false><<<tt_cuda_group_blocks(rows, TT_CUDA_THREADS), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, 0, 0, NULL);
  TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dx_kernel");
  if (!dw) return TT_OK;
  /* R row chunks: about 256k (chunk, column) threads, chunks of at least 32
   * rows, partials within the workspace. A function of (rows, dim) only. */
  int64_t R = (262144 + dim - 1) / dim, by_rows = (rows + 31) / 32, cap = (int64_t)(TT_CUDA_WORKSPACE / 8) / dim;
  if (R > by_rows) R = by_rows;
  if (R > 1024) R = 1024;
  if (R > cap) R = cap;
  if (R < 1) R = 1;
  int64_t L = (rows + R - 1) / R;
  R = (rows + L - 1) / L; /* no empty chunk */
  std::unique_lock<std::mutex> hold;
  double *part = NULL;
  if (R > 1) {
    void *ws;
    if ((st = tt_cuda_workspace(device, &ws, &hold)) != TT_OK) return st;
    part = (double *)ws;
  }
  tt_rmsnorm_dw_partial<DT><<<tt_cuda_blocks(R * dim), TT_CUDA_THREADS, 0, s>>>(
      rows, dim, R, L, (const S *)x, (const C *)rstd, (const S *)dy, part, (S *)dw);
  TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dw_partial");
  if (R > 1) {
    tt_rmsnorm_dw_final<DT><<<tt_cuda_blocks(dim), TT_CUDA_THREADS, 0, s>>>(dim, R, part, (S *)dw);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dw_final");
  }
  return TT_OK;
}

extern "C" tt_status tt_cuda_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *w,
                                     void *y, void *rstd) {
  if (rows <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_rmsnorm_launch, rows, dim, eps, x, (const void *)NULL, w, (void *)NULL, y, rstd)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda rmsnorm: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

extern "C" tt_status tt_cuda_add_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x,
                                         const void *res, const void *w, void *h, void *y, void *rstd) {
  if (rows <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_rmsnorm_launch, rows, dim, eps, x, res, w, h, y, rstd)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda add_rmsnorm: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}

extern "C" tt_status tt_cuda_rmsnorm_backward(int dtype, int64_t rows, int64_t dim, const void *x, const void *w,
                                              const void *rstd, const void *dy, void *dx, void *dw, int dx_accumulate) {
  if (rows <= 0 || dim <= 0) {
    if (dtype == TT_F32 || dtype == TT_F64 || dtype == TT_BF16 || dtype == TT_F16) return TT_OK;
  } else {
    TT_FLOAT_DISPATCH(dtype, tt_rmsnorm_backward_launch, rows, dim, x, w, rstd, dy, dx, dw, dx_accumulate)
  }
  return tt_error_set(TT_ERR_DTYPE, "cuda rmsnorm_backward: dtype %d not supported (f32, f64, bf16, f16)", dtype);
}
