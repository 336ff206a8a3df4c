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
 * second time from L1/L2. As on the CPU the sum of squares and the
 * backward's row dot product accumulate in double, and every other step is
 * the CPU's (kernels/cpu/norm.c) in the compute type with unfused products:
 * f32 and f64 outputs match the reference up to the order of the double
 * sums. rstd is f32 for f32/bf16/f16 input and f64 for f64.
 *
 * bf16 rows of whole 16-byte chunks (dim % 8 == 0, up to 8192) take the
 * lean kernels instead (below: the same cut, f32 sums within a lane, hardware
 * rounding), which an H200 runs 1.6-1.8x as fast (bench/RESULTS.md);
 * TITAN_CUDA_NORM_PLAN=exact gives them the kernels above.
 *
 * dw: each column summed over all rows, deterministically without atomics:
 * the rows are cut into fixed chunks, each chunk's sum lands in the device
 * workspace, and a second kernel adds the partials in double in a fixed
 * order (16 interleaved runs, then their sums in turn: tt_rmsnorm_dw_final)
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
#include "lean.cuh"

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
  bool lean; /* the lean kernels (bf16 rows of whole 16-byte chunks on a warp or a block) */
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

/* TITAN_CUDA_NORM_PLAN=exact turns the lean kernels off: bf16 rows then
 * take the kernels with double statistics (the CPU's bits up to the order of
 * the double sums), which the GPU benchmark times next to the lean ones.
 * Read at each launch, as the group. 0: lean (unset, empty or "lean"); 1:
 * exact; -1: anything else. */
static int tt_norm_plan_setting(void) { return tt_lean_setting("TITAN_CUDA_NORM_PLAN"); }

template <int DT>
static tt_status tt_norm_plan_for(int64_t dim, bool backward, const char *op, tt_norm_plan *p) {
  const int set = tt_norm_group_setting(), exact = tt_norm_plan_setting();
  if (set < 0)
    return tt_error_set(TT_ERR_INVALID, "cuda %s: TITAN_CUDA_NORM_GROUP=%s: expected 32, 64, 128 or 256 lanes per row",
                        op, getenv("TITAN_CUDA_NORM_GROUP"));
  if (exact < 0)
    return tt_error_set(TT_ERR_INVALID, "cuda %s: TITAN_CUDA_NORM_PLAN=%s: expected lean or exact", op,
                        getenv("TITAN_CUDA_NORM_PLAN"));
  if (DT == TT_BF16 && !exact && !set && dim % 8 == 0) {
    /* the lean kernels: a warp up to 1024 elements, a block up to 8192 */
    p->G = dim <= 1024 ? 32 : TT_CUDA_THREADS;
    p->K = tt_norm_chunks<DT>(dim, p->G);
    p->lean = p->K > 0;
    if (p->lean) return TT_OK;
  }
  p->lean = false;
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

/* ---- the lean kernels: bf16 rows of whole 16-byte chunks --------------
 *
 * Why (bench/RESULTS.md, 2026-12-04, fifth session): bf16 and f32 rows of
 * 4096 took about the same time per row in the kernels above (144 and 123
 * rows a microsecond on an H200) while f32 moves twice the bytes, and
 * neither more lanes per row nor blocks looping over rows with the next one
 * in flight (a pipelined plan, timed and removed) moved the bf16 figure:
 * the time went to the work per element, not to the loads. Per element
 * those kernels do a conversion to double, a double multiply and add, 64-bit
 * range checks on each element of a chunk, and the bf16 rounding in seven
 * integer instructions (which retire at half the float rate). These do: one
 * integer op to widen bf16 (once a pass), one fma for the square (two
 * multiplies and an fma for the backward's dot), two multiplies, and half a
 * hardware conversion (cvt.rn.bf16x2.f32: the same round-to-nearest-even;
 * NaN takes tt_d_f32_to_bf16's encoding); range checks per 16-byte chunk;
 * the row's 1/sqrt (rstd^3 dot / dim backward) once a row
 * (tt_group_sum_then). Forward 2.35 -> 3.7-4.0 TB/s at 4096, 2.24 -> 3.15
 * at 2048; add_rmsnorm 3.0 -> 4.1; backward 1.7 -> 3.13 and 2.70.
 *
 * Statistics: each lane sums its squares (its dy w x) in f32, the lanes'
 * sums are added in double. The squares of bf16 values, dy w and (dy w) x
 * are exact in f32 (8-bit significands: at most 24 bits), so only a lane's
 * sum of at most 32 terms rounds: within the reference's bf16 tolerance
 * and DESIGN.md's "norms' statistics in fp32", not the kernels above' bits.
 * h (add_rmsnorm) is the add's bits either way. */

/* tt_bf16x2_rn, tt_bf16_lo, tt_bf16_hi: lean.cuh. */
template <int G, int K> constexpr int tt_norm_lean_fwd_blocks() { return G == 32 && K == 4 ? 5 : 6; }

template <int G, int K, bool RES>
__global__ void __launch_bounds__(TT_CUDA_THREADS, tt_norm_lean_fwd_blocks<G, K>())
    tt_rmsnorm_lean_kernel(int64_t rows, int64_t dim, double eps, const uint4 *__restrict__ x,
                           const uint4 *__restrict__ res, const uint4 *__restrict__ w, uint4 *__restrict__ h,
                           uint4 *__restrict__ y, float *__restrict__ rstd) {
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm[TT_WARPS];
  __shared__ float rsm[PER];
  const int lane = threadIdx.x % G;
  const int nc = (int)(dim / 8); /* 16-byte chunks a row */
  for (int64_t rb = blockIdx.x; rb * PER < rows; rb += gridDim.x) {
    int64_t r, n;
    tt_norm_row(rb * PER + threadIdx.x / G, rows, rows, dim, &r, &n);
    const int64_t base = r * nc;
    uint4 v[K];
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int c = lane + q * G;
      TT_EMU_CHUNK(n > 0 && c < nc, true);
      v[q] = n > 0 && c < nc ? x[base + c] : make_uint4(0, 0, 0, 0);
    }
    if (RES) {
#pragma unroll
      for (int q = 0; q < K; q++) {
        const int c = lane + q * G;
        if (n <= 0 || c >= nc) continue;
        TT_EMU_CHUNK(true, true);
        const uint4 rv = res[base + c];
        uint32_t *a = &v[q].x;
        const uint32_t *b = &rv.x;
#pragma unroll
        for (int j = 0; j < 4; j++)
          a[j] = tt_bf16x2_rn(tt_add(tt_bf16_lo(a[j]), tt_bf16_lo(b[j])), tt_add(tt_bf16_hi(a[j]), tt_bf16_hi(b[j])));
        TT_EMU_CHUNK(true, true);
        h[base + c] = v[q];
      }
    }
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int q = 0; q < K; q++) {
      const uint32_t *a = &v[q].x;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float lo = tt_bf16_lo(a[j]), hi = tt_bf16_hi(a[j]);
        s0 = tt_fma(lo, lo, s0);
        s1 = tt_fma(hi, hi, s1);
      }
    }
    const float rs = tt_group_sum_then<G>((double)s0 + (double)s1, sm, rsm,
                                          [&](double t) { return (float)(1.0 / sqrt(t / (double)dim + eps)); });
    if (lane == 0 && n > 0) rstd[r] = rs;
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int c = lane + q * G;
      if (n <= 0 || c >= nc) continue;
      TT_EMU_CHUNK(true, true);
      const uint4 wv = w[c];
      const uint32_t *a = &v[q].x, *b = &wv.x;
      uint4 o;
      uint32_t *po = &o.x;
#pragma unroll
      for (int j = 0; j < 4; j++)
        po[j] = tt_bf16x2_rn(tt_mul(tt_mul(tt_bf16_lo(a[j]), rs), tt_bf16_lo(b[j])),
                             tt_mul(tt_mul(tt_bf16_hi(a[j]), rs), tt_bf16_hi(b[j])));
      TT_EMU_CHUNK(true, true);
      y[base + c] = o;
    }
  }
}

/* The lean backward (bf16, dw in the same pass, rows of whole 16-byte
 * chunks): tt_rmsnorm_dx_kernel's slots of L rows with the lean forward's
 * per-element work. The row's dot sum(dy w x) is summed by each lane in f32:
 * dy w has at most 16 significant bits and (dy w) x 24, so each product is
 * exact and only the sums round; the lanes' sums are added in double, and
 * rstd^3 dot / dim is computed once a row (tt_group_sum_then) as the default
 * kernel does. The weight row and the lane's dw sums stay in registers (the
 * default keeps the dw sums in shared memory, for registers). */
template <int K> constexpr int tt_norm_lean_bwd_blocks() { return K == 4 ? 2 : K == 2 ? 3 : 4; }

template <int G, int K>
__global__ void __launch_bounds__(TT_CUDA_THREADS, tt_norm_lean_bwd_blocks<K>())
    tt_rmsnorm_dxdw_lean_kernel(int64_t rows, int64_t dim, const uint4 *__restrict__ x, const uint4 *__restrict__ w,
                                const float *__restrict__ rstd, const uint4 *__restrict__ dy, uint4 *__restrict__ dx,
                                bool acc, int64_t L, int64_t nslot, double *__restrict__ part) {
  constexpr int PER = TT_CUDA_THREADS / G;
  __shared__ double sm[TT_WARPS];
  __shared__ float csm[PER];
  const int lane = threadIdx.x % G;
  const int nc = (int)(dim / 8);
  const int64_t group = (int64_t)blockIdx.x * PER + threadIdx.x / G;
  const int64_t slot_end = group * L + L < rows ? group * L + L : rows;
  uint4 wr[K];
  float dwa[K][8];
#pragma unroll
  for (int q = 0; q < K; q++) {
    const int c = lane + q * G;
    TT_EMU_CHUNK(c < nc, true);
    wr[q] = c < nc ? w[c] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < 8; k++) dwa[q][k] = 0.0f;
  }
  for (int64_t t = 0; t < L; t++) {
    int64_t r, n;
    tt_norm_row(group * L + t, slot_end, rows, dim, &r, &n);
    const int64_t base = r * nc;
    uint4 xv[K], gv[K];
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int c = lane + q * G;
      const bool live = n > 0 && c < nc;
      TT_EMU_CHUNK(live, true);
      xv[q] = live ? x[base + c] : make_uint4(0, 0, 0, 0);
      TT_EMU_CHUNK(live, true);
      gv[q] = live ? dy[base + c] : make_uint4(0, 0, 0, 0);
    }
    const float rs = n > 0 ? rstd[r] : 0.0f;
    float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
    for (int q = 0; q < K; q++) {
      const uint32_t *xa = &xv[q].x, *ga = &gv[q].x, *wa = &wr[q].x;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float xl = tt_bf16_lo(xa[j]), xh = tt_bf16_hi(xa[j]);
        const float gl = tt_bf16_lo(ga[j]), gh = tt_bf16_hi(ga[j]);
        d0 = tt_fma(tt_mul(gl, tt_bf16_lo(wa[j])), xl, d0);
        d1 = tt_fma(tt_mul(gh, tt_bf16_hi(wa[j])), xh, d1);
        dwa[q][2 * j] = tt_add(dwa[q][2 * j], tt_mul(tt_mul(gl, xl), rs));
        dwa[q][2 * j + 1] = tt_add(dwa[q][2 * j + 1], tt_mul(tt_mul(gh, xh), rs));
      }
    }
    const float cc = tt_group_sum_then<G>((double)d0 + (double)d1, sm, csm, [&](double dot) {
      const double r3 = (double)rs;
      return (float)(r3 * r3 * r3 * dot / (double)dim);
    });
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int c = lane + q * G;
      if (n <= 0 || c >= nc) continue;
      const uint32_t *xa = &xv[q].x, *ga = &gv[q].x, *wa = &wr[q].x;
      float v[8];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        v[2 * j] = tt_sub(tt_mul(tt_mul(rs, tt_bf16_lo(wa[j])), tt_bf16_lo(ga[j])), tt_mul(tt_bf16_lo(xa[j]), cc));
        v[2 * j + 1] = tt_sub(tt_mul(tt_mul(rs, tt_bf16_hi(wa[j])), tt_bf16_hi(ga[j])), tt_mul(tt_bf16_hi(xa[j]), cc));
      }
      if (acc) {
        TT_EMU_CHUNK(true, true);
        const uint4 old = dx[base + c];
        const uint32_t *oa = &old.x;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          v[2 * j] = tt_add(tt_bf16_lo(oa[j]), v[2 * j]);
          v[2 * j + 1] = tt_add(tt_bf16_hi(oa[j]), v[2 * j + 1]);
        }
      }
      uint4 o;
      uint32_t *po = &o.x;
#pragma unroll
      for (int j = 0; j < 4; j++) po[j] = tt_bf16x2_rn(v[2 * j], v[2 * j + 1]);
      TT_EMU_CHUNK(true, true);
      dx[base + c] = o;
    }
  }
  if (group < nslot) {
#pragma unroll
    for (int q = 0; q < K; q++) {
      const int c = lane + q * G;
      if (c >= nc) continue;
#pragma unroll
      for (int k = 0; k < 8; k++) part[group * dim + (int64_t)c * 8 + k] = (double)dwa[q][k];
    }
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
 * column] as a double; tt_rmsnorm_dw_final adds up the slots. So dw
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

/* dw[j] += the R partials of column j. A thread per column summing R
 * partials in turn left a 2048-wide row's final pass with 8 blocks, each
 * thread's loads one after another: about as long as the dx pass itself at
 * 8192 rows. Here a block takes 16 columns with 16 threads each: thread s
 * sums the partials s, s + 16, s + 32, ... of its column in order (a
 * half-warp reads 128 contiguous bytes a step), and the 16 sums meet in
 * order in shared memory. The order is a function of R alone. */
#define TT_DW_COLS 16
#define TT_DW_SEGS (TT_CUDA_THREADS / TT_DW_COLS)
template <int DT>
__global__ void tt_rmsnorm_dw_final(int64_t dim, int64_t R, const double *__restrict__ part,
                                    typename tt_ft<DT>::S *__restrict__ dw) {
  typedef typename tt_ft<DT>::C C;
  __shared__ double sm[TT_DW_SEGS][TT_DW_COLS + 1];
  const int c = threadIdx.x % TT_DW_COLS, sg = threadIdx.x / TT_DW_COLS;
  for (int64_t j0 = (int64_t)blockIdx.x * TT_DW_COLS; j0 < dim; j0 += (int64_t)gridDim.x * TT_DW_COLS) {
    const int64_t j = j0 + c;
    double acc = 0.0;
    if (j < dim) {
#pragma unroll 4
      for (int64_t k = sg; k < R; k += TT_DW_SEGS) acc = tt_add(acc, part[k * dim + j]);
    }
    sm[sg][c] = acc;
    __syncthreads();
    if (sg == 0 && j < dim) {
      double t = sm[0][c];
      for (int q = 1; q < TT_DW_SEGS; q++) t = tt_add(t, sm[q][c]);
      dw[j] = tt_ft<DT>::st((C)tt_add((double)tt_ft<DT>::ld(dw[j]), t));
    }
    __syncthreads();
  }
}

static unsigned int tt_rmsnorm_dw_final_blocks(int64_t dim) {
  int64_t b = (dim + TT_DW_COLS - 1) / TT_DW_COLS;
  return (unsigned int)(b > 65536 ? 65536 : b);
}

template <int DT, int G, int K, bool RES>
static void tt_rmsnorm_go(cudaStream_t s, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                          const void *w, void *h, void *y, void *rstd) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  tt_rmsnorm_kernel<DT, G, K, RES><<<tt_cuda_group_blocks(rows, G), TT_CUDA_THREADS, 0, s>>>(
      rows, dim, eps, (const S *)x, (const S *)res, (const S *)w, (S *)h, (S *)y, (C *)rstd);
}

/* The lean plan takes rows of whole 16-byte chunks at 16-byte addresses;
 * anything else goes to the default kernels. */
static bool tt_norm_lean_fits(int64_t dim, const void *x, const void *res, const void *w, const void *h,
                              const void *y) {
  return dim % 8 == 0 && tt_al16(x) && tt_al16(w) && tt_al16(y) && (!res || (tt_al16(res) && tt_al16(h)));
}

template <int G, int K>
static void tt_rmsnorm_lean_go(cudaStream_t s, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                               const void *w, void *h, void *y, void *rstd) {
  if (res)
    tt_rmsnorm_lean_kernel<G, K, true><<<tt_cuda_group_blocks(rows, G), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const uint4 *)x, (const uint4 *)res, (const uint4 *)w, (uint4 *)h, (uint4 *)y,
        (float *)rstd);
  else
    tt_rmsnorm_lean_kernel<G, K, false><<<tt_cuda_group_blocks(rows, G), TT_CUDA_THREADS, 0, s>>>(
        rows, dim, eps, (const uint4 *)x, NULL, (const uint4 *)w, NULL, (uint4 *)y, (float *)rstd);
}

/* res == NULL: plain RMSNorm; else h = x + res is formed and normalized.
 * The row cut as tt_norm_plan_for says. */
template <int DT>
static tt_status tt_rmsnorm_launch(int64_t rows, int64_t dim, double eps, const void *x, const void *res, const void *w,
                                   void *h, void *y, void *rstd) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  (void)device;
  tt_norm_plan p;
  if (st == TT_OK) st = tt_norm_plan_for<DT>(dim, false, res ? "add_rmsnorm" : "rmsnorm", &p);
  if (st != TT_OK) return st;
  tt_norm_with_plan<DT>(p, [&](auto gc, auto kc) {
    constexpr int G = decltype(gc)::value, K = decltype(kc)::value;
    if constexpr (DT == TT_BF16 && (G == 32 || G == TT_CUDA_THREADS) && K >= 1 && K <= 4) {
      if (p.lean && tt_norm_lean_fits(dim, x, res, w, h, y)) {
        tt_rmsnorm_lean_go<G, K>(s, rows, dim, eps, x, res, w, h, y, rstd);
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
template <int DT, int G, int K, bool LEAN>
static tt_status tt_rmsnorm_dxdw_go(int device, cudaStream_t s, int64_t rows, int64_t dim, const void *x,
                                    const void *w, const void *rstd, const void *dy, void *dx, void *dw, int acc) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  if constexpr (K == 0) {
    return tt_error_set(TT_ERR_INTERNAL, "cuda rmsnorm_backward: dw in the dx pass needs the row in registers");
  } else {
    /* LEAN: the lean kernel (launched by name below: cuemu names a launch
     * after its expression) */
    const void *kernel;
    if constexpr (LEAN) kernel = (const void *)tt_rmsnorm_dxdw_lean_kernel<G, K>;
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
    if constexpr (LEAN)
      tt_rmsnorm_dxdw_lean_kernel<G, K><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const uint4 *)x, (const uint4 *)w, (const float *)rstd, (const uint4 *)dy, (uint4 *)dx,
          acc != 0, L, nslot, (double *)ws);
    else
      tt_rmsnorm_dx_kernel<DT, G, K, true><<<blocks, TT_CUDA_THREADS, 0, s>>>(
          rows, dim, (const S *)x, (const S *)w, (const C *)rstd, (const S *)dy, (S *)dx, acc != 0, L, nslot,
          (double *)ws);
    TT_CUDA_CHECK_LAUNCH("tt_rmsnorm_dx_kernel (with dw)");
    tt_rmsnorm_dw_final<DT><<<tt_rmsnorm_dw_final_blocks(dim), TT_CUDA_THREADS, 0, s>>>(dim, nslot,
                                                                                      (const double *)ws, (S *)dw);
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
      if constexpr (DT == TT_BF16 && (G == 32 || G == TT_CUDA_THREADS) && K >= 1 && K <= 4) {
        if (p.lean && tt_norm_lean_fits(dim, x, dy, w, dx, dx))
          return tt_rmsnorm_dxdw_go<DT, G, K, true>(device, s, rows, dim, x, w, rstd, dy, dx, dw, acc);
      }
      return tt_rmsnorm_dxdw_go<DT, G, K, false>(device, s, rows, dim, x, w, rstd, dy, dx, dw, acc);
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
    tt_rmsnorm_dw_final<DT><<<tt_rmsnorm_dw_final_blocks(dim), TT_CUDA_THREADS, 0, s>>>(dim, R, part, (S *)dw);
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
