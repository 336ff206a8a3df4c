/*
 * norm.cu — RMSNorm over the last dim, forward and backward.
 *
 * y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); add_rmsnorm forms the
 * residual sum h = x + res in the first pass and normalizes it (the add
 * kernel's rounding, so the pair is bit-identical to running them apart);
 * the backward may accumulate dx onto a waiting gradient. One warp per row up
 * to 1024 elements; above, a block (or a group of 64 or 128 lanes: tt_norm_plan);
 * rows are read in 16-byte chunks (kernel_util.cuh). A row of up to G * V *
 * KMAX elements (8192 bf16 or f32 ones per block) is read from HBM once:
 * each thread issues the loads of all its chunks before it adds anything
 * (many 16-byte loads in flight, which is what keeps HBM busy) and keeps
 * them in registers for the second pass; a longer row is read twice, the
 * second time from L1/L2. TITAN_CUDA_NORM_PIPE asks for a pipelined plan
 * for bf16 rows (blocks looping over rows, the next one loaded ahead): an
 * experiment for the GPU benchmark, below.
 * Either way the sums run in the same order, so the bits are the same. As
 * on the CPU the sum of squares and the backward's row dot product
 * accumulate in double, and every other step is the CPU's
 * (kernels/cpu/norm.c) in the compute type with unfused products: f32 and
 * f64 outputs match the reference up to the order of the double sums. rstd
 * is f32 for f32/bf16/f16 input and f64 for f64.
 *
 * dw: each column summed over all rows, deterministically without atomics:
 * the rows are cut into fixed chunks, each chunk's sum lands in the device
 * workspace, and a second kernel adds the partials in chunk order in double
 * and accumulates into dw (dw = dw + total, rounded once). Rows kept in
 * registers get their chunk sums from the dx kernel itself (a slot of
 * 16..~128 rows per row group, summed in the compute type, the slot count a
 * whole number of waves: tt_rmsnorm_dxdw_go); longer rows take a kernel of
 * their own, a thread per (chunk, column) summing in double, which reads x
 * and dy once more (R chunks, a function of the shape).
 */
#include <stdlib.h>
#include <string.h>

#include "kernel_util.cuh"

/* K, the chunks of V elements each thread keeps in registers, is a template
 * parameter chosen per launch: the smallest of 1, 2, 4 (8 for f32) that
 * holds the row, 0 for a row too long to keep (streamed twice). With K
 * fixed the register arrays are exactly as large as the row needs, so a
 * 4096-wide bf16 row costs 2 chunks' registers, not the 4 of the longest
 * row, and more blocks fit on an SM. f64 has a single K (no one trains in
 * f64; it only checks the arithmetic). The row is held unconverted
 * (tt_ld_raw: half the registers for 16-bit types) and converted in each
 * pass. */
template <int DT> __host__ __device__ constexpr int tt_norm_kmax() { return DT == TT_F64 ? 4 : 32 / (16 / (int)sizeof(typename tt_ft<DT>::S)); }
template <int DT> constexpr int tt_norm_kfit(int k) {
  return DT == TT_F64 || k > tt_norm_kmax<DT>() ? tt_norm_kmax<DT>() : k;
}

/* The K a row of `dim` elements gets from a group of G lanes; 0: streamed. */
template <int DT> static int tt_norm_chunks(int64_t dim, int G) {
  const int64_t per = (int64_t)G * (16 / (int64_t)sizeof(typename tt_ft<DT>::S));
  for (int k = 1; k <= tt_norm_kmax<DT>(); k *= 2)
    if (dim <= per * k) return tt_norm_kfit<DT>(k);
  return 0;
}

/* f(std::integral_constant<int, K>()) for the runtime k of tt_norm_chunks. */
template <int DT, typename F> static auto tt_norm_with_k(int k, F &&f) {
  switch (k) {
    case 1: return f(std::integral_constant<int, tt_norm_kfit<DT>(1)>());
    case 2: return f(std::integral_constant<int, tt_norm_kfit<DT>(2)>());
    case 4: return f(std::integral_constant<int, tt_norm_kfit<DT>(4)>());
    case 8: return f(std::integral_constant<int, tt_norm_kfit<DT>(8)>());
    default: return f(std::integral_constant<int, 0>());
  }
}

/* How a row is cut: G lanes per row and the K chunks each lane keeps. A
 * warp up to 1024 elements; above, a block of 256 lanes, except that the
 * forward gives a row that would leave each of a block's lanes a single
 * chunk (bf16/f16 rows of 1025-2048: Llama 3 1B's 2048) to the narrowest
 * group of 64 or 128 lanes that keeps it in the most chunks a lane holds
 * (tt_norm_kmax). Measured on an H200 (bench/RESULTS.md, 2026-12-04,
 * third session), lanes per row against GB/s: bf16 2048 forward 64 lanes
 * 2271, 256 lanes 2089; but bf16 4096 forward 128 lanes 2297, 256 lanes
 * 2381, f32 4096 3999 against 4026, and every backward slower on the
 * narrower groups (bf16 4096: 1387 against 1733; f32 4096: 2879 against
 * 3154). So more bytes per lane in flight is not what these kernels lack.
 * G = 64 or 128 comes only with K = kmax (the one instantiation they
 * have), and never for f64. */
struct tt_norm_plan {
  int G, K;
  int pipe; /* the pipelined plan: 0 no, 1 with double statistics, 2 with f32 ones */
};

/* TITAN_CUDA_NORM_GROUP=32|64|128|256 forces the lanes per row (the GPU
 * benchmark times the choices side by side; docs/cuda.md). Read at each
 * launch (a lookup, next to a launch's microseconds), so a test can go
 * through every choice in one process. 0: not set; -1: not one of those. */
static int tt_norm_group_setting(void) {
  const char *e = getenv("TITAN_CUDA_NORM_GROUP");
  if (!e || !*e) return 0;
  char *end;
  const long v = strtol(e, &end, 10);
  return *end == 0 && (v == 32 || v == 64 || v == 128 || v == 256) ? (int)v : -1;
}

/* The dtype the pipelined plan has: bf16 (f16 would spill a few bytes). */
template <int DT> __host__ __device__ constexpr bool tt_norm_pipe_dtype() { return DT == TT_BF16; }

/* TITAN_CUDA_NORM_PIPE=1|f32 asks for the pipelined plan (below) where it
 * applies: bf16 rows kept in registers. Read at each launch, as the
 * group. 0: not set; -1: not one of those. */
static int tt_norm_pipe_setting(void) {
  const char *e = getenv("TITAN_CUDA_NORM_PIPE");
  if (!e || !*e || !strcmp(e, "0")) return 0;
  return !strcmp(e, "1") ? 1 : !strcmp(e, "f32") ? 2 : -1;
}

template <int DT>
static tt_status tt_norm_plan_for(int64_t dim, bool backward, const char *op, tt_norm_plan *p) {
  const int set = tt_norm_group_setting(), pipe = tt_norm_pipe_setting();
  if (set < 0)
    return tt_error_set(TT_ERR_INVALID, "cuda %s: TITAN_CUDA_NORM_GROUP=%s: expected 32, 64, 128 or 256 lanes per row",
                        op, getenv("TITAN_CUDA_NORM_GROUP"));
  if (pipe < 0)
    return tt_error_set(TT_ERR_INVALID, "cuda %s: TITAN_CUDA_NORM_PIPE=%s: expected 0, 1 or f32", op,
                        getenv("TITAN_CUDA_NORM_PIPE"));
  int G = dim <= 1024 ? 32 : TT_CUDA_THREADS;
  if (!backward && dim > 1024 && tt_norm_chunks<DT>(dim, TT_CUDA_THREADS) == 1)
    for (int g = 64; g < TT_CUDA_THREADS; g *= 2)
      if (tt_norm_chunks<DT>(dim, g) == tt_norm_kmax<DT>()) {
        G = g;
        break;
      }
  if (set > 0) G = set;
  int K = tt_norm_chunks<DT>(dim, G);
  if ((G == 64 || G == 128) && (DT == TT_F64 || K != tt_norm_kmax<DT>())) { /* not instantiated: a block */
    G = TT_CUDA_THREADS;
    K = tt_norm_chunks<DT>(dim, G);
  }
  p->G = G;
  p->K = K;
  p->pipe = 0;
  if (pipe && tt_norm_pipe_dtype<DT>()) {
    /* The pipelined kernels take rows of 1 or 2 chunks a lane (more would
     * spill: three copies of the row in registers), on a warp or a block. */
    if (!set) {
      p->G = dim <= 1024 ? 32 : TT_CUDA_THREADS;
      p->K = tt_norm_chunks<DT>(dim, p->G);
    }
    if ((p->G == 32 || p->G == TT_CUDA_THREADS) && (p->K == 1 || p->K == 2)) p->pipe = pipe;
  }
  return TT_OK;
}

/* f(G, K) as integral constants for a plan: the one place the launchers
 * turn it into template arguments. */
template <int DT, typename F> static auto tt_norm_with_plan(tt_norm_plan p, F &&f) {
  typedef std::integral_constant<int, tt_norm_kmax<DT>()> KM;
  if constexpr (DT != TT_F64) {
    if (p.G == 64) return f(std::integral_constant<int, 64>(), KM());
    if (p.G == 128) return f(std::integral_constant<int, 128>(), KM());
  }
  if (p.G == 32) return tt_norm_with_k<DT>(p.K, [&](auto kc) { return f(std::integral_constant<int, 32>(), kc); });
  return tt_norm_with_k<DT>(p.K, [&](auto kc) { return f(std::integral_constant<int, TT_CUDA_THREADS>(), kc); });
}

/* Chunk q of this lane starts at element (lane + q G) V, as the loops'
 * e = lane V, lane V + G V, ...; cnt 0 past the row (nothing is loaded). */
template <int V> __device__ __forceinline__ int64_t tt_norm_e(int lane, int q, int G) {
  return ((int64_t)lane + (int64_t)q * G) * V;
}
template <int V> __device__ __forceinline__ int64_t tt_norm_cnt(int lane, int q, int G, int64_t dim) {
  const int64_t e = tt_norm_e<V>(lane, q, G);
  return e >= dim ? 0 : (dim - e < V ? dim - e : V);
}

/* Group row `want`, valid below `end` (the rows, or the end of a dw slot):
 * *r is the row and *n its elements, dim; past the end *r is the last row
 * (an address inside the tensor; nothing is read or written there) and *n
 * 0. A group wider than a warp shares the block's barriers
 * (tt_group_reduce), so the kernels' loops give every group of a block the
 * same turns and a group with no row left takes them with n == 0. */
__device__ __forceinline__ void tt_norm_row(int64_t want, int64_t end, int64_t rows, int64_t dim, int64_t *r,
                                            int64_t *n) {
  const bool live = want < end;
  *r = live ? want : rows - 1;
  *n = live ? dim : 0;
}

/* RES: h = x + res first (rounded to the storage type, as the add kernel
 * would store it), written out, and normalized in place of x; the second
 * pass reads back the h this thread wrote (K == 0) or keeps it (K > 0). */
/* Three blocks an SM: ptxas fits every instantiation in 85 registers
 * without spilling (checked with -Xptxas -v for sm_90a), where left alone
 * it takes up to 106 for a 4-chunk bf16 row and the SM holds two. */
template <int DT, int G, int K, bool RES>
__global__ void __launch_bounds__(TT_CUDA_THREADS, 3)
    tt_rmsnorm_kernel(int64_t rows, int64_t dim, double eps, const typename tt_ft<DT>::S *__restrict__ x,
                      const typename tt_ft<DT>::S *__restrict__ res, const typename tt_ft<DT>::S *__restrict__ w,
                      typename tt_ft<DT>::S *__restrict__ h, typename tt_ft<DT>::S *__restrict__ y,
                      typename tt_ft<DT>::C *__restrict__ rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm[TT_WARPS];
  const int lane = threadIdx.x % G;
  /* Row r of turn rb; n, its elements, is 0 for a group past the last row,
   * which still takes the turn (tt_norm_row). */
  for (int64_t rb = blockIdx.x; rb * PER < rows; rb += gridDim.x) {
    int64_t r, n;
    tt_norm_row(rb * PER + threadIdx.x / G, rows, rows, dim, &r, &n);
    const S *xr = x + r * dim;
    S *yr = y + r * dim;
    const S *rr = RES ? res + r * dim : NULL;
    S *hr = RES ? h + r * dim : NULL;
    const bool vec = tt_al16(xr) && tt_al16(yr) && tt_al16(w) && (!RES || (tt_al16(rr) && tt_al16(hr)));
    if constexpr (K > 0) {
      tt_pack<S> raw[K];
      int64_t cnt[K];
#pragma unroll
      for (int q = 0; q < K; q++) {
        cnt[q] = tt_norm_cnt<V>(lane, q, G, n);
        raw[q] = tt_ld_raw<DT>(xr, tt_norm_e<V>(lane, q, G), cnt[q], vec);
      }
      if (RES) {
#pragma unroll
        for (int q = 0; q < K; q++) {
          C c[V], rv[V];
          tt_unpack<DT>(raw[q], c);
          tt_ld_chunk<DT>(rr, tt_norm_e<V>(lane, q, G), cnt[q], vec, rv);
#pragma unroll
          for (int k = 0; k < V; k++) raw[q].v[k] = tt_ft<DT>::st(tt_add(c[k], rv[k]));
          if (cnt[q] > 0) tt_st_raw<DT>(hr, tt_norm_e<V>(lane, q, G), cnt[q], vec, raw[q]);
        }
      }
      double ss = 0.0;
#pragma unroll
      for (int q = 0; q < K; q++) {
        C c[V];
        tt_unpack<DT>(raw[q], c);
#pragma unroll
        for (int k = 0; k < V; k++)
          if (k < cnt[q]) ss = tt_add(ss, tt_mul((double)c[k], (double)c[k]));
      }
      ss = tt_group_reduce<G>(ss, tt_sum_op(), sm);
      const C rs = (C)(1.0 / sqrt(ss / (double)dim + eps));
      if (lane == 0 && n > 0) rstd[r] = rs;
#pragma unroll
      for (int q = 0; q < K; q++) {
        if (cnt[q] <= 0) continue;
        C c[V], wv[V];
        tt_unpack<DT>(raw[q], c);
        tt_ld_chunk<DT>(w, tt_norm_e<V>(lane, q, G), cnt[q], vec, wv);
#pragma unroll
        for (int k = 0; k < V; k++) c[k] = tt_mul(tt_mul(c[k], rs), wv[k]);
        tt_st_chunk<DT>(yr, tt_norm_e<V>(lane, q, G), cnt[q], vec, c);
      }
    } else {
      double ss = 0.0;
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
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
      if (lane == 0 && n > 0) rstd[r] = rs;
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
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
}

/* ---- the pipelined plan (TITAN_CUDA_NORM_PIPE; bf16 rows in registers) ----
 *
 * An experiment for the bf16 kernels, which run at 2.4 (forward) and 1.7
 * (backward) TB/s where f32 reaches 4.0 and 3.2 (docs/cuda.md, "RMSNorm:
 * the pipelined plan"). The default kernels give each row a block that
 * loads it, reduces, computes and stores, and exits: a block has loads in
 * flight only at its start. Here the grid is one wave of blocks, each
 * looping over rows, and each lane issues the loads of its group's next row
 * before it works on the current one (so HBM is read while the block
 * reduces and stores); the weight row is loaded once per block and kept in
 * registers; the row's 1/sqrt is computed once a row (tt_group_sum_then),
 * not once a thread; the sum of squares is one fused multiply-add an element (the
 * product of two bf16 values is exact in f32 and double, so the fma rounds
 * exactly as the separate multiply and add: the same bits).
 *
 * A, the statistics' type: double gives the default kernels' bits (tested
 * bit for bit on cuemu); float (TITAN_CUDA_NORM_PIPE=f32) sums the squares
 * and the backward's dot in f32 as PyTorch does, fewer registers and no
 * FP64 work, within the CPU reference's bf16 tolerance but not its bits. */

template <typename A> __device__ __forceinline__ A tt_norm_rstd(A ss, int64_t dim, double eps);
template <> __device__ __forceinline__ double tt_norm_rstd<double>(double ss, int64_t dim, double eps) {
  return 1.0 / sqrt(ss / (double)dim + eps); /* as the default kernels */
}
template <> __device__ __forceinline__ float tt_norm_rstd<float>(float ss, int64_t dim, double eps) {
  return tt_div(1.0f, tt_sqrt(tt_add(tt_div(ss, (float)dim), (float)eps)));
}

/* tt_group_reduce's sum of v over the group, then f(sum): on a warp every
 * lane computes it; on a wider group the group's first warp alone does
 * (reading the warps' partial sums in tt_group_reduce's order: the same
 * bits) and hands it to the others through out (a slot per group). So the
 * double division and square root after the sum run once a row, not once a
 * thread. Two barriers, as tt_group_reduce: smem is read only before the
 * second, out only after it, so the next call's writes (after every thread
 * has left this call) need no barrier of their own; smem must not be shared
 * with another reduction of the kernel. */
template <int G, typename T, typename R, typename F>
__device__ __forceinline__ R tt_group_sum_then(T v, T *smem, R *out, F f) {
  v = tt_group_reduce<32>(v, tt_sum_op(), smem);
  if constexpr (G == 32) {
    return f(v);
  } else {
    constexpr int W = G / 32;
    const int w = threadIdx.x >> 5, w0 = w & ~(W - 1);
    if ((threadIdx.x & 31) == 0) smem[w] = v;
    __syncthreads();
    if (w == w0) {
      T r = smem[w0];
#pragma unroll
      for (int i = 1; i < W; i++) r = tt_sum_op()(r, smem[w0 + i]);
      const R y = f(r);
      if ((threadIdx.x & 31) == 0) out[w0 / W] = y;
    }
    __syncthreads();
    return out[w0 / W];
  }
}

/* A lane's chunk counts of a whole row (full) and its chunks of the weight
 * row (wr), loaded once for every row the block takes. */
template <int DT, int G, int K>
__device__ __forceinline__ void tt_norm_pipe_w(const typename tt_ft<DT>::S *w, int64_t dim, int lane, bool vec,
                                               int *full, tt_pack<typename tt_ft<DT>::S> *wr) {
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
#pragma unroll
  for (int q = 0; q < K; q++) {
    full[q] = (int)tt_norm_cnt<V>(lane, q, G, dim);
    wr[q] = tt_ld_raw<DT>(w, tt_norm_e<V>(lane, q, G), full[q], vec);
  }
}

/* Blocks an SM holds: 3 where ptxas fits that without spilling (-Xptxas -v,
 * sm_90a: 51-78 registers), 2 for the residual form of 2-chunk rows (which
 * spills 16-56 bytes at 3: four copies of the row chunk are live). */
template <int K, bool RES> constexpr int tt_norm_pipe_min_blocks() { return RES && K == 2 ? 2 : 3; }

template <int DT, int G, int K, bool RES, typename A>
__global__ void __launch_bounds__(TT_CUDA_THREADS, tt_norm_pipe_min_blocks<K, RES>())
    tt_rmsnorm_pipe_kernel(int64_t rows, int64_t dim, double eps, const typename tt_ft<DT>::S *__restrict__ x,
                           const typename tt_ft<DT>::S *__restrict__ res, const typename tt_ft<DT>::S *__restrict__ w,
                           typename tt_ft<DT>::S *__restrict__ h, typename tt_ft<DT>::S *__restrict__ y,
                           typename tt_ft<DT>::C *__restrict__ rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  static_assert(tt_norm_pipe_dtype<DT>() && K > 0 && K <= 2, "the pipelined plan: bf16 rows of 1-2 chunks a lane");
  constexpr int V = 16 / sizeof(S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ A sm[TT_WARPS];
  __shared__ C rsm[PER]; /* each group's rstd (tt_group_sum_then) */
  const int lane = threadIdx.x % G;
  /* Every row starts as aligned as the first when a row is a whole number
   * of 16-byte chunks; otherwise all go element by element (same values). */
  const bool vec = (dim * (int64_t)sizeof(S)) % 16 == 0 && tt_al16(x) && tt_al16(y) && tt_al16(w) &&
                   (!RES || (tt_al16(res) && tt_al16(h)));
  int full[K];
  tt_pack<S> wr[K];
  tt_norm_pipe_w<DT, G, K>(w, dim, lane, vec, full, wr);
  /* Turn rb's row of this group from p; nothing is read for a group past
   * the last row (its chunks count 0). */
  auto fetch = [&](int64_t rb, const S *p, tt_pack<S> *out) {
    int64_t r, n;
    tt_norm_row(rb * PER + threadIdx.x / G, rows, rows, dim, &r, &n);
#pragma unroll
    for (int q = 0; q < K; q++) out[q] = tt_ld_raw<DT>(p + r * dim, tt_norm_e<V>(lane, q, G), n > 0 ? full[q] : 0, vec);
  };
  tt_pack<S> xa[K], ra[RES ? K : 1];
  fetch(blockIdx.x, x, xa);
  if (RES) fetch(blockIdx.x, res, ra);
  for (int64_t rb = blockIdx.x; rb * PER < rows; rb += gridDim.x) {
    int64_t r, n;
    tt_norm_row(rb * PER + threadIdx.x / G, rows, rows, dim, &r, &n);
    tt_pack<S> xb[K];
    if (RES) {
      /* h first, so that ra is free for the next row's residual */
#pragma unroll
      for (int q = 0; q < K; q++) {
        C c[V], rv[V];
        tt_unpack<DT>(xa[q], c);
        tt_unpack<DT>(ra[q], rv);
#pragma unroll
        for (int k = 0; k < V; k++) xa[q].v[k] = tt_ft<DT>::st(tt_add(c[k], rv[k]));
        if (n > 0 && full[q] > 0) tt_st_raw<DT>(h + r * dim, tt_norm_e<V>(lane, q, G), full[q], vec, xa[q]);
      }
      fetch(rb + gridDim.x, res, ra);
    }
    fetch(rb + gridDim.x, x, xb); /* the next turn's row, in flight while this one is worked on */
    A ss = 0;
#pragma unroll
    for (int q = 0; q < K; q++) {
      C c[V];
      tt_unpack<DT>(xa[q], c); /* zeros past the row: they add nothing */
#pragma unroll
      for (int k = 0; k < V; k++) ss = tt_fma((A)c[k], (A)c[k], ss);
    }
    const C rs = tt_group_sum_then<G>(ss, sm, rsm, [&](A t) { return (C)tt_norm_rstd<A>(t, dim, eps); });
    if (lane == 0 && n > 0) rstd[r] = rs;
#pragma unroll
    for (int q = 0; q < K; q++) {
      if (n <= 0 || full[q] <= 0) continue;
      C c[V], wv[V];
      tt_unpack<DT>(xa[q], c);
      tt_unpack<DT>(wr[q], wv);
#pragma unroll
      for (int k = 0; k < V; k++) c[k] = tt_mul(tt_mul(c[k], rs), wv[k]);
      tt_st_chunk<DT>(y + r * dim, tt_norm_e<V>(lane, q, G), full[q], vec, c);
    }
#pragma unroll
    for (int q = 0; q < K; q++) xa[q] = xb[q];
  }
}

/* Chunk e of x, dy and w, converted (the streamed backward's two passes). */
template <int DT>
__device__ __forceinline__ void tt_norm_ld_xgw(const typename tt_ft<DT>::S *xr, const typename tt_ft<DT>::S *gr,
                                               const typename tt_ft<DT>::S *w, int64_t e, int64_t cnt, bool vec,
                                               typename tt_ft<DT>::C *xv, typename tt_ft<DT>::C *gv,
                                               typename tt_ft<DT>::C *wv) {
  tt_ld_chunk<DT>(xr, e, cnt, vec, xv);
  tt_ld_chunk<DT>(gr, e, cnt, vec, gv);
  tt_ld_chunk<DT>(w, e, cnt, vec, wv);
}

/* dx of one chunk, a w dy - x cc, added to the gradient already waiting
 * for x when acc (rounded once), and stored; xv is overwritten. */
template <int DT>
__device__ __forceinline__ void tt_norm_dx_chunk(typename tt_ft<DT>::S *dr, int64_t e, int64_t cnt, bool vec, bool acc,
                                                 typename tt_ft<DT>::C a, typename tt_ft<DT>::C cc,
                                                 typename tt_ft<DT>::C *xv, const typename tt_ft<DT>::C *gv,
                                                 const typename tt_ft<DT>::C *wv) {
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(typename tt_ft<DT>::S);
#pragma unroll
  for (int k = 0; k < V; k++) xv[k] = tt_sub(tt_mul(tt_mul(a, wv[k]), gv[k]), tt_mul(xv[k], cc));
  if (acc) {
    C old[V];
    tt_ld_chunk<DT>(dr, e, cnt, vec, old);
#pragma unroll
    for (int k = 0; k < V; k++) xv[k] = tt_add(old[k], xv[k]);
  }
  tt_st_chunk<DT>(dr, e, cnt, vec, xv);
}

/* dx = rstd * w * dy - x * (rstd^3 * sum(dy * w * x) / dim).
 * DW (rows kept in registers only, K > 0): group `slot` takes the rows
 * [slot L, slot L + L) in order and also sums dy * x * rstd over them for
 * its columns, in the compute type (at most L terms), into part[slot dim +
 * column] as a double; tt_rmsnorm_dw_final adds the slots in order. So dw
 * costs no second read of x and dy. */
/* Blocks per SM the dx-and-dw kernel is compiled for: 3 where ptxas fits
 * that without spilling (bf16 rows of up to 2 chunks a thread, f32 of up to
 * 4), which its default register use misses by a few registers and so
 * halves to 2; 2 for the most chunks a lane keeps (rows of 4097-8192 on a
 * block, or a narrower group when TITAN_CUDA_NORM_GROUP asks: 112-117
 * registers, where left alone it takes up to 140 and the SM holds one
 * block; 3 would spill 200 bytes). Checked with -Xptxas -v for sm_90a. */
template <int DT, int K> constexpr int tt_norm_dw_min_blocks() {
  return (DT == TT_BF16 && K <= 2) || (DT == TT_F32 && K <= 4) ? 3 : DT != TT_F64 && K == tt_norm_kmax<DT>() ? 2 : 1;
}

template <int DT, int G, int K, bool DW>
__global__ void __launch_bounds__(TT_CUDA_THREADS, DW ? tt_norm_dw_min_blocks<DT, K>() : 1)
    tt_rmsnorm_dx_kernel(int64_t rows, int64_t dim, const typename tt_ft<DT>::S *__restrict__ x,
                         const typename tt_ft<DT>::S *__restrict__ w, const typename tt_ft<DT>::C *__restrict__ rstd,
                         const typename tt_ft<DT>::S *__restrict__ dy, typename tt_ft<DT>::S *__restrict__ dx, bool acc,
                         int64_t L, int64_t nslot, double *__restrict__ part) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  constexpr int V = 16 / sizeof(S);
  constexpr int PER = TT_CUDA_THREADS / G;
  constexpr int KD = DW && K > 0 ? K : 1; /* dw accumulator chunks */
  __shared__ double sm[TT_WARPS];
  /* The dw sums live in shared memory, not registers: each thread owns its
   * own [q][k][threadIdx.x] cells (no sharing, so no barrier; consecutive
   * threads, consecutive banks). In registers they cost as much as the row
   * itself and would halve the blocks an SM holds. */
  __shared__ C dwacc[KD][V][DW ? TT_CUDA_THREADS : 1];
  const int lane = threadIdx.x % G;
  const int64_t group = (int64_t)blockIdx.x * PER + threadIdx.x / G;
  /* Without dw, turn t is the block's rows rb PER .. (grid stride); with
   * dw, row t of the group's slot [group L, group L + L). Either way every
   * group of the block takes the same turns (tt_norm_row). */
  const int64_t slot_end = DW ? (group * L + L < rows ? group * L + L : rows) : rows;
  const int tdw = DW ? threadIdx.x : 0;
  if (DW) {
#pragma unroll
    for (int q = 0; q < KD; q++)
#pragma unroll
      for (int k = 0; k < V; k++) dwacc[q][k][tdw] = (C)0;
  }
  for (int64_t t = 0;; t++) {
    const int64_t rb = (int64_t)blockIdx.x + t * gridDim.x;
    if (DW ? t >= L : rb * PER >= rows) break;
    int64_t r, n;
    tt_norm_row(DW ? group * L + t : rb * PER + threadIdx.x / G, slot_end, rows, dim, &r, &n);
    const S *xr = x + r * dim, *gr = dy + r * dim;
    S *dr = dx + r * dim;
    const bool vec = tt_al16(xr) && tt_al16(gr) && tt_al16(dr) && tt_al16(w);
    if constexpr (K > 0) {
      tt_pack<S> xraw[K], graw[K];
      int64_t cnt[K];
#pragma unroll
      for (int q = 0; q < K; q++) {
        cnt[q] = tt_norm_cnt<V>(lane, q, G, n);
        xraw[q] = tt_ld_raw<DT>(xr, tt_norm_e<V>(lane, q, G), cnt[q], vec);
        graw[q] = tt_ld_raw<DT>(gr, tt_norm_e<V>(lane, q, G), cnt[q], vec);
      }
      const C rs_c = n > 0 ? rstd[r] : (C)0;
      double dot = 0.0;
#pragma unroll
      for (int q = 0; q < K; q++) {
        if (cnt[q] <= 0) continue;
        C xv[V], gv[V], wv[V];
        tt_unpack<DT>(xraw[q], xv);
        tt_unpack<DT>(graw[q], gv);
        tt_ld_chunk<DT>(w, tt_norm_e<V>(lane, q, G), cnt[q], vec, wv);
#pragma unroll
        for (int k = 0; k < V; k++) {
          if (k < cnt[q]) dot = tt_add(dot, tt_mul(tt_mul((double)gv[k], (double)wv[k]), (double)xv[k]));
          if (DW && n > 0) dwacc[q % KD][k][tdw] = tt_add(dwacc[q % KD][k][tdw], tt_mul(tt_mul(gv[k], xv[k]), rs_c));
        }
      }
      dot = tt_group_reduce<G>(dot, tt_sum_op(), sm);
      const double rs = (double)rs_c;
      const C a = (C)rs, cc = (C)(rs * rs * rs * dot / (double)dim);
#pragma unroll
      for (int q = 0; q < K; q++) {
        if (cnt[q] <= 0) continue;
        const int64_t e = tt_norm_e<V>(lane, q, G);
        C xv[V], gv[V], wv[V];
        tt_unpack<DT>(xraw[q], xv);
        tt_unpack<DT>(graw[q], gv);
        tt_ld_chunk<DT>(w, e, cnt[q], vec, wv);
        tt_norm_dx_chunk<DT>(dr, e, cnt[q], vec, acc, a, cc, xv, gv, wv);
      }
    } else {
      double dot = 0.0;
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
        int64_t cnt = dim - e < V ? dim - e : V;
        C xv[V], gv[V], wv[V];
        tt_norm_ld_xgw<DT>(xr, gr, w, e, cnt, vec, xv, gv, wv);
#pragma unroll
        for (int k = 0; k < V; k++)
          if (k < cnt) dot = tt_add(dot, tt_mul(tt_mul((double)gv[k], (double)wv[k]), (double)xv[k]));
      }
      dot = tt_group_reduce<G>(dot, tt_sum_op(), sm);
      const double rs = n > 0 ? (double)rstd[r] : 0.0;
      const C a = (C)rs, cc = (C)(rs * rs * rs * dot / (double)dim);
      for (int64_t e = (int64_t)lane * V; e < n; e += (int64_t)G * V) {
        int64_t cnt = dim - e < V ? dim - e : V;
        C xv[V], gv[V], wv[V];
        tt_norm_ld_xgw<DT>(xr, gr, w, e, cnt, vec, xv, gv, wv);
        tt_norm_dx_chunk<DT>(dr, e, cnt, vec, acc, a, cc, xv, gv, wv);
      }
    }
  }
  if (DW && K > 0 && group < nslot) {
#pragma unroll
    for (int q = 0; q < KD; q++) {
      const int64_t e = tt_norm_e<V>(lane, q, G), cnt = tt_norm_cnt<V>(lane, q, G, dim);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) part[group * dim + e + k] = (double)dwacc[q][k][tdw];
    }
  }
}

/* The pipelined backward (TITAN_CUDA_NORM_PIPE; with dw, 16-bit rows kept
 * in registers): tt_rmsnorm_dx_kernel's slots of L rows, with the next
 * row's x, dy and rstd loaded before the current row is worked on, and the
 * weight row kept in registers. The dot's products are exact (bf16
 * factors), so with A = double the fma gives the default kernel's bits. */
/* 3 blocks an SM for 1-chunk rows (80 registers), 2 for 2-chunk ones, which
 * spill 100-140 bytes at 3 (x, dy, their next row and w). */
template <int DT, int G, int K, typename A>
__global__ void __launch_bounds__(TT_CUDA_THREADS, K == 1 ? 3 : 2)
    tt_rmsnorm_dxdw_pipe_kernel(int64_t rows, int64_t dim, const typename tt_ft<DT>::S *__restrict__ x,
                                const typename tt_ft<DT>::S *__restrict__ w,
                                const typename tt_ft<DT>::C *__restrict__ rstd,
                                const typename tt_ft<DT>::S *__restrict__ dy, typename tt_ft<DT>::S *__restrict__ dx,
                                bool acc, int64_t L, int64_t nslot, double *__restrict__ part) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  static_assert(tt_norm_pipe_dtype<DT>() && K > 0 && K <= 2, "the pipelined plan: bf16 rows of 1-2 chunks a lane");
  constexpr int V = 16 / sizeof(S);
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ A sm[TT_WARPS];
  __shared__ C ccm[PER]; /* each group's cc (tt_group_sum_then) */
  __shared__ C dwacc[K][V][TT_CUDA_THREADS]; /* as tt_rmsnorm_dx_kernel's */
  /* as in the forward: rows of whole 16-byte chunks, all aligned alike */
  const bool vec = (dim * (int64_t)sizeof(S)) % 16 == 0 && tt_al16(x) && tt_al16(dy) && tt_al16(dx) && tt_al16(w);
  const int lane = threadIdx.x % G;
  const int64_t group = (int64_t)blockIdx.x * PER + threadIdx.x / G;
  const int64_t slot_end = group * L + L < rows ? group * L + L : rows;
  const int tdw = threadIdx.x;
  int full[K];
  tt_pack<S> wr[K];
  tt_norm_pipe_w<DT, G, K>(w, dim, lane, vec, full, wr);
#pragma unroll
  for (int q = 0; q < K; q++)
#pragma unroll
    for (int k = 0; k < V; k++) dwacc[q][k][tdw] = (C)0;
  /* Row t of the slot into xp, gp and *rp; nothing is read past the slot. */
  auto fetch = [&](int64_t t, tt_pack<S> *xp, tt_pack<S> *gp, C *rp) {
    int64_t r, n;
    tt_norm_row(group * L + t, slot_end, rows, dim, &r, &n);
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int cnt = n > 0 ? full[q] : 0;
      xp[q] = tt_ld_raw<DT>(x + r * dim, tt_norm_e<V>(lane, q, G), cnt, vec);
      gp[q] = tt_ld_raw<DT>(dy + r * dim, tt_norm_e<V>(lane, q, G), cnt, vec);
    }
    *rp = n > 0 ? rstd[r] : (C)0;
  };
  tt_pack<S> xa[K], ga[K];
  C rs_c;
  fetch(0, xa, ga, &rs_c);
  for (int64_t t = 0; t < L; t++) {
    tt_pack<S> xb[K], gb[K];
    C rs_next;
    fetch(t + 1, xb, gb, &rs_next); /* in flight while this row is worked on */
    int64_t r, n;
    tt_norm_row(group * L + t, slot_end, rows, dim, &r, &n);
    S *dr = dx + r * dim;
    A dot = 0;
#pragma unroll
    for (int q = 0; q < K; q++) {
      if (n <= 0) continue;
      C xv[V], gv[V], wv[V];
      tt_unpack<DT>(xa[q], xv);
      tt_unpack<DT>(ga[q], gv);
      tt_unpack<DT>(wr[q], wv);
#pragma unroll
      for (int k = 0; k < V; k++) {
        dot = tt_fma(tt_mul((A)gv[k], (A)wv[k]), (A)xv[k], dot); /* zeros past the row add nothing */
        dwacc[q][k][tdw] = tt_add(dwacc[q][k][tdw], tt_mul(tt_mul(gv[k], xv[k]), rs_c));
      }
    }
    const C a = rs_c, cc = tt_group_sum_then<G>(dot, sm, ccm, [&](A d) -> C {
      if constexpr (sizeof(A) == sizeof(double)) {
        const double rs = (double)rs_c;
        return (C)(rs * rs * rs * d / (double)dim); /* as the default kernel */
      } else {
        return tt_div(tt_mul(tt_mul(tt_mul(rs_c, rs_c), rs_c), d), (float)dim);
      }
    });
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int cnt = n > 0 ? full[q] : 0;
      if (cnt <= 0) continue;
      C xv[V], gv[V], wv[V];
      tt_unpack<DT>(xa[q], xv);
      tt_unpack<DT>(ga[q], gv);
      tt_unpack<DT>(wr[q], wv);
      tt_norm_dx_chunk<DT>(dr, tt_norm_e<V>(lane, q, G), cnt, vec, acc, a, cc, xv, gv, wv);
    }
#pragma unroll
    for (int q = 0; q < K; q++) {
      xa[q] = xb[q];
      ga[q] = gb[q];
    }
    rs_c = rs_next;
  }
  if (group < nslot) {
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int64_t e = tt_norm_e<V>(lane, q, G), cnt = tt_norm_cnt<V>(lane, q, G, dim);
#pragma unroll
      for (int k = 0; k < V; k++)
        if (k < cnt) part[group * dim + e + k] = (double)dwacc[q][k][tdw];
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

template <int DT, int G, int K, bool RES>
static void tt_rmsnorm_go(cudaStream_t s, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                          const void *w, void *h, void *y, void *rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  tt_rmsnorm_kernel<DT, G, K, RES><<<tt_cuda_group_blocks(rows, G), TT_CUDA_THREADS, 0, s>>>(
      rows, dim, eps, (const S *)x, (const S *)res, (const S *)w, (S *)h, (S *)y, (C *)rstd);
}

/* The pipelined forward: one wave of blocks (as many as the device holds
 * at once, fewer for fewer rows), each looping over rows. */
template <int DT, int G, int K, typename A>
static void tt_rmsnorm_pipe_go(int device, cudaStream_t s, int64_t rows, int64_t dim, double eps, const void *x,
                               const void *res, const void *w, void *h, void *y, void *rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  static std::atomic<int> resident[2][TT_CUDA_MAX_DEVICES];
  const bool add = res != NULL;
  const void *kernel = add ? (const void *)tt_rmsnorm_pipe_kernel<DT, G, K, true, A>
                           : (const void *)tt_rmsnorm_pipe_kernel<DT, G, K, false, A>;
  int64_t blocks = tt_cuda_resident_blocks(kernel, device, resident[add]);
  if (blocks > (int64_t)tt_cuda_group_blocks(rows, G)) blocks = tt_cuda_group_blocks(rows, G);
  if (add)
    tt_rmsnorm_pipe_kernel<DT, G, K, true, A><<<(unsigned int)blocks, TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const S *)x, (const S *)res, (const S *)w, (S *)h, (S *)y, (C *)rstd);
  else
    tt_rmsnorm_pipe_kernel<DT, G, K, false, A><<<(unsigned int)blocks, TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const S *)x, NULL, (const S *)w, NULL, (S *)y, (C *)rstd);
}

/* res == NULL: plain RMSNorm; else h = x + res is formed and normalized.
 * The row cut as tt_norm_plan_for says. */
template <int DT>
static tt_status tt_rmsnorm_launch(int64_t rows, int64_t dim, double eps, const void *x, const void *res, const void *w,
                                   void *h, void *y, void *rstd) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  tt_norm_plan p;
  if (st == TT_OK) st = tt_norm_plan_for<DT>(dim, false, res ? "add_rmsnorm" : "rmsnorm", &p);
  if (st != TT_OK) return st;
  tt_norm_with_plan<DT>(p, [&](auto gc, auto kc) {
    constexpr int G = decltype(gc)::value, K = decltype(kc)::value;
    if constexpr (tt_norm_pipe_dtype<DT>() && (K == 1 || K == 2)) {
      if (p.pipe) {
        if (p.pipe == 2) tt_rmsnorm_pipe_go<DT, G, K, float>(device, s, rows, dim, eps, x, res, w, h, y, rstd);
        else tt_rmsnorm_pipe_go<DT, G, K, double>(device, s, rows, dim, eps, x, res, w, h, y, rstd);
        return;
      }
    }
    if (res) tt_rmsnorm_go<DT, G, K, true>(s, rows, dim, eps, x, res, w, h, y, rstd);
    else tt_rmsnorm_go<DT, G, K, false>(s, rows, dim, eps, x, NULL, w, NULL, y, rstd);
  });
  TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_kernel");
  return TT_OK;
}

/* Without dw: a grid-stride loop over the rows. */
template <int DT, int G, int K>
static void tt_rmsnorm_dx_go(cudaStream_t s, int64_t rows, int64_t dim, const void *x, const void *w, const void *rstd,
                             const void *dy, void *dx, int acc) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  tt_rmsnorm_dx_kernel<DT, G, K, false><<<tt_cuda_group_blocks(rows, G), TT_CUDA_THREADS, 0, s>>>(
      rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, 0, 0, NULL);
}

/* With dw from the same pass (K > 0): one group per slot of L consecutive
 * rows, no grid-stride loop, so each slot's block runs L rows back to back
 * and the launch takes as long as its longest wave. The slots are a whole
 * number of waves of the blocks the device holds at once (L at most about
 * 128 rows, at least 16; as many slots as the workspace holds): 512 slots
 * on an SM count that holds 396 would leave a second, mostly idle wave
 * taking as long as the first. So the dw bits are a function of the shape
 * and of the device and build (same machine, same bits). */
template <int DT, int G, int K, int PIPE>
static tt_status tt_rmsnorm_dxdw_go(int device, cudaStream_t s, int64_t rows, int64_t dim, const void *x,
                                    const void *w, const void *rstd, const void *dy, void *dx, void *dw, int acc) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  if constexpr (K == 0) {
    return tt_error_set(TT_ERR_INTERNAL, "cuda rmsnorm_backward: dw in the dx pass needs the row in registers");
  } else {
    /* PIPE: the pipelined kernel, 1 with double statistics, 2 with f32 ones
     * (launched by name below: cuemu names a launch after its expression). */
    const void *kernel;
    if constexpr (PIPE == 1) kernel = (const void *)tt_rmsnorm_dxdw_pipe_kernel<DT, G, K, double>;
    else if constexpr (PIPE == 2) kernel = (const void *)tt_rmsnorm_dxdw_pipe_kernel<DT, G, K, float>;
    else kernel = (const void *)tt_rmsnorm_dx_kernel<DT, G, K, true>;
    static std::atomic<int> resident[TT_CUDA_MAX_DEVICES];
    const int64_t per = TT_CUDA_THREADS / G;
    const int64_t groups = per * tt_cuda_resident_blocks(kernel, device, resident);
    const int64_t cap = (int64_t)(TT_CUDA_WORKSPACE / sizeof(double)) / dim;
    int64_t waves = (rows + groups * 128 - 1) / (groups * 128);
    if (waves > cap / groups) waves = cap / groups;
    int64_t target = waves >= 1 ? waves * groups : cap;
    int64_t L = (rows + target - 1) / target;
    if (L < 16) L = 16;
    const int64_t nslot = (rows + L - 1) / L;
    std::unique_lock<std::mutex> hold;
    void *ws;
    tt_status st = tt_cuda_workspace(device, &ws, &hold);
    if (st != TT_OK) return st;
    const unsigned int blocks = (unsigned int)((nslot + per - 1) / per);
    if constexpr (PIPE == 1)
      tt_rmsnorm_dxdw_pipe_kernel<DT, G, K, double><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    else if constexpr (PIPE == 2)
      tt_rmsnorm_dxdw_pipe_kernel<DT, G, K, float><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    else
      tt_rmsnorm_dx_kernel<DT, G, K, true><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dx_kernel (with dw)");
    tt_rmsnorm_dw_final<DT><<<tt_cuda_blocks(dim), TT_CUDA_THREADS, 0, s>>>(dim, nslot, (const double *)ws, (S *)dw);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dw_final");
    return TT_OK;
  }
}

template <int DT>
static tt_status tt_rmsnorm_backward_launch(int64_t rows, int64_t dim, const void *x, const void *w, const void *rstd,
                                            const void *dy, void *dx, void *dw, int acc) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  tt_norm_plan p;
  if (st == TT_OK) st = tt_norm_plan_for<DT>(dim, true, "rmsnorm_backward", &p);
  if (st != TT_OK) return st;
  if (dw && p.K > 0 && (int64_t)(TT_CUDA_WORKSPACE / sizeof(double)) / dim >= 1)
    return tt_norm_with_plan<DT>(p, [&](auto gc, auto kc) {
      constexpr int G = decltype(gc)::value, K = decltype(kc)::value;
      if constexpr (tt_norm_pipe_dtype<DT>() && (K == 1 || K == 2)) {
        if (p.pipe == 1) return tt_rmsnorm_dxdw_go<DT, G, K, 1>(device, s, rows, dim, x, w, rstd, dy, dx, dw, acc);
        if (p.pipe == 2) return tt_rmsnorm_dxdw_go<DT, G, K, 2>(device, s, rows, dim, x, w, rstd, dy, dx, dw, acc);
      }
      return tt_rmsnorm_dxdw_go<DT, G, K, 0>(device, s, rows, dim, x, w, rstd, dy, dx, dw, acc);
    });
  tt_norm_with_plan<DT>(p, [&](auto gc, auto kc) {
    tt_rmsnorm_dx_go<DT, decltype(gc)::value, decltype(kc)::value>(s, rows, dim, x, w, rstd, dy, dx, acc);
  });
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
