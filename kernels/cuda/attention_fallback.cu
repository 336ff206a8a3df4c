/*
 * attention_fallback.cu — tiled, online-softmax attention kernels in plain
 * CUDA, for what cuDNN's SDPA does not take (f32, f64, head dims that are not
 * a multiple of 8, older GPUs, any graph cuDNN rejects). Semantics are those
 * of kernels/cpu/attention.c: layout q [B,T,Hq,D], k/v [B,S,Hkv,D],
 * o [B,T,Hq,D], lse [B,Hq,T] (natural log), query head h reads kv head
 * h / (Hq/Hkv), causal query t sees keys s <= t + (S - T), a row that sees no
 * key gets o = 0 and lse = -inf (and contributes no gradient).
 *
 * Arithmetic is in f32 (f64 for f64 input); no T x S matrix exists; there are
 * no atomics, so every output element has one writer and a fixed summation
 * order and results are bit-identical from run to run.
 *
 * Tiling. A block is 4 warps. Head-dim vectors are staged through shared
 * memory in chunks of 64 (so D <= 256 fits the static 48 KiB in f64 too):
 * dot products loop over the chunks; the per-row outputs live in registers,
 * 2 elements per lane per chunk (lane l owns d = 64c + l and 64c + 32 + l).
 * Two roles alternate inside a tile:
 *   - "rows": each warp owns ROWS rows (queries, or keys in the dK/dV pass)
 *     and accumulates their D-vectors in registers;
 *   - "lanes": a tile of 32 partners (keys, or queries in the dK/dV pass),
 *     one per lane. Each lane computes its partner's dot products with the
 *     warp's rows (partner rows padded to 65 in shared memory: no bank
 *     conflicts), then the per-pair weights are broadcast with __shfl_sync
 *     and accumulated in partner order.
 *
 *   forward   block = (b, h, 4*ROWS queries); walks 32-key tiles left to
 *             right with the online softmax (running max m, sum l, rescale
 *             by exp(m_old - m_new)); o = acc / l, lse = m + log(l).
 *   dK, dV    block = (b, kv head, 4*ROWS keys); walks the group's query
 *             heads and 32-query tiles (from the first query that sees the
 *             block's keys): P = exp(scale q.k - lse), dS = P (dO.v - Di),
 *             dV += P^T dO, dK += dS^T Q; dK *= scale at the end.
 *   dQ        block = (b, h, 4*ROWS queries); walks 32-key tiles:
 *             dQ += dS K; dQ *= scale at the end.
 * Di = rowsum(dO * O) is recomputed where needed (a warp reduction per row)
 * rather than stored, since kernels never allocate.
 */
#include <math.h>
#include <stdint.h>

#include "attention.cuh"
#include "dtype.cuh"

#define FB_WARPS 4
#define FB_THREADS (FB_WARPS * 32)
#define FB_KT 32 /* partners per tile: one per lane */
#define FB_DC 64 /* head-dim chunk staged in shared memory */
#define FB_MAXC (TT_ATT_DMAX / FB_DC)
#define FB_FULL 0xffffffffu

namespace {

struct fb_dims {
  int64_t B, T, S, Hq, Hkv, D;
  int64_t group; /* query heads per kv head */
  int64_t off;   /* S - T: causal query t sees keys s <= t + off */
  int causal;
};
TT_EMU_NO_PTRS(fb_dims)

__device__ __forceinline__ int64_t fb_min(int64_t x, int64_t y) { return x < y ? x : y; }

/* Keys [0, end) are visible to query t. */
__device__ __forceinline__ int64_t fb_key_end(const fb_dims &a, int64_t t) {
  if (!a.causal) return a.S;
  const int64_t e = t + a.off + 1;
  return e < 0 ? 0 : fb_min(e, a.S);
}

__device__ __forceinline__ bool fb_visible(const fb_dims &a, int64_t t, int64_t s) {
  return t < a.T && s < a.S && (!a.causal || s <= t + a.off);
}

template <int DT, typename A>
__device__ __forceinline__ A fb_ld(const void *p, int64_t i) {
  if constexpr (DT == TT_F64) return (A)((const double *)p)[i];
  else if constexpr (DT == TT_F32) return (A)((const float *)p)[i];
  else if constexpr (DT == TT_BF16) return (A)tt_d_bf16_to_f32(((const uint16_t *)p)[i]);
  else return (A)tt_d_f16_to_f32(((const uint16_t *)p)[i]);
}

template <int DT, typename A>
__device__ __forceinline__ void fb_st(void *p, int64_t i, A x) {
  if constexpr (DT == TT_F64) ((double *)p)[i] = (double)x;
  else if constexpr (DT == TT_F32) ((float *)p)[i] = (float)x;
  else if constexpr (DT == TT_BF16) ((uint16_t *)p)[i] = tt_d_f32_to_bf16((float)x);
  else ((uint16_t *)p)[i] = tt_d_f32_to_f16((float)x);
}

/* lse is f64 for f64 input, f32 otherwise. */
template <int DT, typename A>
__device__ __forceinline__ A fb_ld_lse(const void *p, int64_t i) {
  if constexpr (DT == TT_F64) return (A)((const double *)p)[i];
  else return (A)((const float *)p)[i];
}

template <int DT, typename A>
__device__ __forceinline__ void fb_st_lse(void *p, int64_t i, A x) {
  if constexpr (DT == TT_F64) ((double *)p)[i] = (double)x;
  else ((float *)p)[i] = (float)x;
}

__device__ __forceinline__ float fb_exp(float x) { return expf(x); }
__device__ __forceinline__ double fb_exp(double x) { return exp(x); }
__device__ __forceinline__ float fb_log(float x) { return logf(x); }
__device__ __forceinline__ double fb_log(double x) { return log(x); }

template <typename A>
__device__ __forceinline__ A fb_max(A x, A y) { return y > x ? y : x; }

/* Butterfly reductions: every lane ends with the same, order-fixed value. */
template <typename A>
__device__ __forceinline__ A fb_warp_sum(A x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FB_FULL, x, o);
  return x;
}

template <typename A>
__device__ __forceinline__ A fb_warp_max(A x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fb_max(x, (A)__shfl_xor_sync(FB_FULL, x, o));
  return x;
}

/* Stage a tile: tile[i * ld + d] = src[base + i * stride + d] for i < n,
 * d < dc; zero elsewhere (rows x FB_DC), so padding never feeds a NaN. */
template <int DT, typename A>
__device__ __forceinline__ void fb_stage(A *tile, int ld, int rows, const void *src, int64_t base, int64_t stride,
                                         int n, int dc) {
  for (int e = threadIdx.x; e < rows * FB_DC; e += FB_THREADS) {
    const int i = e / FB_DC, d = e - i * FB_DC;
    tile[i * ld + d] = (i < n && d < dc) ? fb_ld<DT, A>(src, base + (int64_t)i * stride + d) : (A)0;
  }
}

/* Di = rowsum(dO * O) of row `at` (element offset of the row), by one warp. */
template <int DT, typename A>
__device__ __forceinline__ A fb_row_dot(const void *x, const void *y, int64_t at, int64_t D, int lane) {
  A s = 0;
  for (int64_t d = lane; d < D; d += 32) s += fb_ld<DT, A>(x, at + d) * fb_ld<DT, A>(y, at + d);
  return fb_warp_sum(s);
}

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */
/* ------------------------------------------------------------------------ */

template <int DT, typename A, int ROWS>
__global__ void __launch_bounds__(FB_THREADS)
    fb_forward_kernel(fb_dims a, A scale, const void *q, const void *k, const void *v, void *o, void *lse) {
  constexpr int BQ = FB_WARPS * ROWS;
  __shared__ A qs[BQ][FB_DC];
  __shared__ A ks[FB_KT][FB_DC + 1];
  __shared__ A vs[FB_KT][FB_DC];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bh = a.B * a.Hq, nqt = (a.T + BQ - 1) / BQ, it = blockIdx.x;
  const int64_t b = it % bh / a.Hq, h = it % a.Hq, t0 = (nqt - 1 - it / bh) * BQ; /* late (long) rows first */
  const int64_t kvh = h / a.group, qstride = a.Hq * a.D, kstride = a.Hkv * a.D;
  const int64_t qbase = ((b * a.T + t0) * a.Hq + h) * a.D, kbase = (b * a.S * a.Hkv + kvh) * a.D;
  const int nq = (int)fb_min(BQ, a.T - t0), nc = (int)((a.D + FB_DC - 1) / FB_DC);
  const int64_t kend = fb_key_end(a, t0 + nq - 1);
  const A ninf = -(A)INFINITY;

  A m[ROWS], l[ROWS], acc[ROWS][FB_MAXC][2];
#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    m[r] = ninf;
    l[r] = 0;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) acc[r][c][0] = acc[r][c][1] = 0;
  }

  for (int64_t k0 = 0; k0 < kend; k0 += FB_KT) {
    const int nk = (int)fb_min(FB_KT, kend - k0);
    /* Scores: lane j holds q_r . k_j for the warp's rows. */
    A s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) s[r] = 0;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) {
      if (c >= nc) break;
      const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
      __syncthreads();
      if (nc > 1 || k0 == 0) fb_stage<DT>(&qs[0][0], FB_DC, BQ, q, qbase + d0, qstride, nq, dc);
      fb_stage<DT>(&ks[0][0], FB_DC + 1, FB_KT, k, kbase + k0 * kstride + d0, kstride, nk, dc);
      __syncthreads();
      for (int d = 0; d < dc; d++) {
        const A kd = ks[lane][d];
#pragma unroll
        for (int r = 0; r < ROWS; r++) s[r] += qs[warp * ROWS + r][d] * kd;
      }
    }
    /* Online softmax over the tile. */
    A p[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      const bool vis = lane < nk && fb_visible(a, t0 + warp * ROWS + r, k0 + lane);
      const A sc = vis ? s[r] * scale : ninf;
      const A mn = fb_max(m[r], fb_warp_max(sc));
      A alpha = 1;
      p[r] = 0;
      if (mn != ninf) { /* all -inf so far: nothing to rescale, and -inf - -inf would be NaN */
        p[r] = fb_exp(sc - mn);
        alpha = fb_exp(m[r] - mn); /* 0 on the first visible key (m = -inf) */
      }
      l[r] = l[r] * alpha + fb_warp_sum(p[r]);
      m[r] = mn;
#pragma unroll
      for (int c = 0; c < FB_MAXC; c++) {
        acc[r][c][0] *= alpha;
        acc[r][c][1] *= alpha;
      }
    }
    /* acc += P V, keys in order. */
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) {
      if (c >= nc) break;
      const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
      __syncthreads();
      fb_stage<DT>(&vs[0][0], FB_DC, FB_KT, v, kbase + k0 * kstride + d0, kstride, nk, dc);
      __syncthreads();
      for (int j = 0; j < nk; j++) {
        const A v0 = vs[j][lane], v1 = vs[j][lane + 32];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          const A pj = __shfl_sync(FB_FULL, p[r], j);
          acc[r][c][0] += pj * v0;
          acc[r][c][1] += pj * v1;
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    const int64_t t = t0 + warp * ROWS + r;
    if (t >= a.T) continue;
    const bool seen = l[r] > 0;
    const A inv = seen ? (A)1 / l[r] : (A)0;
    const int64_t at = ((b * a.T + t) * a.Hq + h) * a.D;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int64_t d = c * FB_DC + e * 32 + lane;
        if (c < nc && d < a.D) fb_st<DT, A>(o, at + d, acc[r][c][e] * inv);
      }
    if (lane == 0) fb_st_lse<DT, A>(lse, (b * a.Hq + h) * a.T + t, seen ? m[r] + fb_log(l[r]) : ninf);
  }
}

/* ------------------------------------------------------------------------ */
/* Backward, pass 1: dK and dV of a block of keys                            */
/* ------------------------------------------------------------------------ */

template <int DT, typename A, int ROWS>
__global__ void __launch_bounds__(FB_THREADS)
    fb_backward_dkv_kernel(fb_dims a, A scale, const void *q, const void *k, const void *v, const void *o,
                           const void *lse, const void *dout, void *dk, void *dv) {
  constexpr int BK = FB_WARPS * ROWS;
  __shared__ A ks[BK][FB_DC];
  __shared__ A vs[BK][FB_DC];
  __shared__ A qs[FB_KT][FB_DC + 1];
  __shared__ A dos[FB_KT][FB_DC + 1];
  __shared__ A lse_s[FB_KT], di_s[FB_KT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bkv = a.B * a.Hkv, it = blockIdx.x;
  const int64_t b = it % bkv / a.Hkv, kvh = it % a.Hkv, k0 = it / bkv * BK; /* early (long) keys first */
  const int64_t qstride = a.Hq * a.D, kstride = a.Hkv * a.D;
  const int64_t kbase = ((b * a.S + k0) * a.Hkv + kvh) * a.D;
  const int nk = (int)fb_min(BK, a.S - k0), nc = (int)((a.D + FB_DC - 1) / FB_DC);
  const A ninf = -(A)INFINITY;
  /* The first query that sees key k0: t + off >= k0. */
  const int64_t tfirst = a.causal ? (k0 - a.off > 0 ? k0 - a.off : 0) : 0;

  A dka[ROWS][FB_MAXC][2], dva[ROWS][FB_MAXC][2];
#pragma unroll
  for (int r = 0; r < ROWS; r++)
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) dka[r][c][0] = dka[r][c][1] = dva[r][c][0] = dva[r][c][1] = 0;

  bool first = true;
  for (int64_t h = kvh * a.group; h < (kvh + 1) * a.group; h++) {
    for (int64_t q0 = tfirst; q0 < a.T; q0 += FB_KT) {
      const int nq = (int)fb_min(FB_KT, a.T - q0);
      const int64_t qbase = ((b * a.T + q0) * a.Hq + h) * a.D;
      __syncthreads(); /* the previous tile is done with lse_s, di_s */
      for (int i = warp; i < FB_KT; i += FB_WARPS) {
        const A di = i < nq ? fb_row_dot<DT, A>(dout, o, qbase + i * qstride, a.D, lane) : (A)0;
        if (lane == 0) {
          di_s[i] = di;
          lse_s[i] = i < nq ? fb_ld_lse<DT, A>(lse, (b * a.Hq + h) * a.T + q0 + i) : ninf;
        }
      }
      /* Lane i: scores s = q_i . k_r and dp = dO_i . v_r for the warp's keys. */
      A s[ROWS], dp[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; r++) s[r] = dp[r] = 0;
#pragma unroll
      for (int c = 0; c < FB_MAXC; c++) {
        if (c >= nc) break;
        const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
        __syncthreads();
        fb_stage<DT>(&qs[0][0], FB_DC + 1, FB_KT, q, qbase + d0, qstride, nq, dc);
        fb_stage<DT>(&dos[0][0], FB_DC + 1, FB_KT, dout, qbase + d0, qstride, nq, dc);
        if (nc > 1 || first) {
          fb_stage<DT>(&ks[0][0], FB_DC, BK, k, kbase + d0, kstride, nk, dc);
          fb_stage<DT>(&vs[0][0], FB_DC, BK, v, kbase + d0, kstride, nk, dc);
        }
        __syncthreads();
        for (int d = 0; d < dc; d++) {
          const A qd = qs[lane][d], od = dos[lane][d];
#pragma unroll
          for (int r = 0; r < ROWS; r++) {
            s[r] += qd * ks[warp * ROWS + r][d];
            dp[r] += od * vs[warp * ROWS + r][d];
          }
        }
      }
      first = false;
      __syncthreads(); /* lse_s, di_s written (also when D has no chunk) */
      const A li = lse_s[lane], di = di_s[lane];
      A p[ROWS], ds[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        const bool vis = lane < nq && li != ninf && fb_visible(a, q0 + lane, k0 + warp * ROWS + r);
        p[r] = vis ? fb_exp(s[r] * scale - li) : (A)0;
        ds[r] = p[r] * (dp[r] - di);
      }
      /* dV += P^T dO, dK += dS^T Q, queries in order. The last chunk is
       * still staged; the others are staged again. */
#pragma unroll
      for (int c = FB_MAXC - 1; c >= 0; c--) {
        if (c >= nc) continue;
        if (c != nc - 1) {
          const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
          __syncthreads();
          fb_stage<DT>(&qs[0][0], FB_DC + 1, FB_KT, q, qbase + d0, qstride, nq, dc);
          fb_stage<DT>(&dos[0][0], FB_DC + 1, FB_KT, dout, qbase + d0, qstride, nq, dc);
          __syncthreads();
        }
        for (int i = 0; i < nq; i++) {
          const A q0v = qs[i][lane], q1v = qs[i][lane + 32], o0 = dos[i][lane], o1 = dos[i][lane + 32];
#pragma unroll
          for (int r = 0; r < ROWS; r++) {
            const A pi = __shfl_sync(FB_FULL, p[r], i), dsi = __shfl_sync(FB_FULL, ds[r], i);
            dva[r][c][0] += pi * o0;
            dva[r][c][1] += pi * o1;
            dka[r][c][0] += dsi * q0v;
            dka[r][c][1] += dsi * q1v;
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    const int j = warp * ROWS + r;
    if (j >= nk) continue;
    const int64_t at = kbase + (int64_t)j * kstride;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int64_t d = c * FB_DC + e * 32 + lane;
        if (c < nc && d < a.D) {
          fb_st<DT, A>(dk, at + d, dka[r][c][e] * scale);
          fb_st<DT, A>(dv, at + d, dva[r][c][e]);
        }
      }
  }
}

/* ------------------------------------------------------------------------ */
/* Backward, pass 2: dQ of a block of queries                                */
/* ------------------------------------------------------------------------ */

template <int DT, typename A, int ROWS>
__global__ void __launch_bounds__(FB_THREADS)
    fb_backward_dq_kernel(fb_dims a, A scale, const void *q, const void *k, const void *v, const void *o,
                          const void *lse, const void *dout, void *dq) {
  constexpr int BQ = FB_WARPS * ROWS;
  __shared__ A qs[BQ][FB_DC];
  __shared__ A dos[BQ][FB_DC];
  __shared__ A ks[FB_KT][FB_DC + 1];
  __shared__ A vs[FB_KT][FB_DC + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t bh = a.B * a.Hq, nqt = (a.T + BQ - 1) / BQ, it = blockIdx.x;
  const int64_t b = it % bh / a.Hq, h = it % a.Hq, t0 = (nqt - 1 - it / bh) * BQ;
  const int64_t kvh = h / a.group, qstride = a.Hq * a.D, kstride = a.Hkv * a.D;
  const int64_t qbase = ((b * a.T + t0) * a.Hq + h) * a.D, kbase = (b * a.S * a.Hkv + kvh) * a.D;
  const int nq = (int)fb_min(BQ, a.T - t0), nc = (int)((a.D + FB_DC - 1) / FB_DC);
  const int64_t kend = fb_key_end(a, t0 + nq - 1);
  const A ninf = -(A)INFINITY;

  /* The warp's rows: lse and Di (held by every lane). */
  A lr[ROWS], dr[ROWS], dqa[ROWS][FB_MAXC][2];
#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    const int64_t t = t0 + warp * ROWS + r;
    lr[r] = t < a.T ? fb_ld_lse<DT, A>(lse, (b * a.Hq + h) * a.T + t) : ninf;
    dr[r] = t < a.T ? fb_row_dot<DT, A>(dout, o, ((b * a.T + t) * a.Hq + h) * a.D, a.D, lane) : (A)0;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) dqa[r][c][0] = dqa[r][c][1] = 0;
  }

  for (int64_t k0 = 0; k0 < kend; k0 += FB_KT) {
    const int nk = (int)fb_min(FB_KT, kend - k0);
    /* Lane j: s = q_r . k_j and dp = dO_r . v_j for the warp's rows. */
    A s[ROWS], dp[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) s[r] = dp[r] = 0;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++) {
      if (c >= nc) break;
      const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
      __syncthreads();
      if (nc > 1 || k0 == 0) {
        fb_stage<DT>(&qs[0][0], FB_DC, BQ, q, qbase + d0, qstride, nq, dc);
        fb_stage<DT>(&dos[0][0], FB_DC, BQ, dout, qbase + d0, qstride, nq, dc);
      }
      fb_stage<DT>(&ks[0][0], FB_DC + 1, FB_KT, k, kbase + k0 * kstride + d0, kstride, nk, dc);
      fb_stage<DT>(&vs[0][0], FB_DC + 1, FB_KT, v, kbase + k0 * kstride + d0, kstride, nk, dc);
      __syncthreads();
      for (int d = 0; d < dc; d++) {
        const A kd = ks[lane][d], vd = vs[lane][d];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          s[r] += qs[warp * ROWS + r][d] * kd;
          dp[r] += dos[warp * ROWS + r][d] * vd;
        }
      }
    }
    A ds[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      const bool vis = lane < nk && lr[r] != ninf && fb_visible(a, t0 + warp * ROWS + r, k0 + lane);
      const A p = vis ? fb_exp(s[r] * scale - lr[r]) : (A)0;
      ds[r] = p * (dp[r] - dr[r]);
    }
    /* dQ += dS K, keys in order; the last chunk of K is still staged. */
#pragma unroll
    for (int c = FB_MAXC - 1; c >= 0; c--) {
      if (c >= nc) continue;
      if (c != nc - 1) {
        const int d0 = c * FB_DC, dc = (int)fb_min(FB_DC, a.D - d0);
        __syncthreads();
        fb_stage<DT>(&ks[0][0], FB_DC + 1, FB_KT, k, kbase + k0 * kstride + d0, kstride, nk, dc);
        __syncthreads();
      }
      for (int j = 0; j < nk; j++) {
        const A k0v = ks[j][lane], k1v = ks[j][lane + 32];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          const A dsj = __shfl_sync(FB_FULL, ds[r], j);
          dqa[r][c][0] += dsj * k0v;
          dqa[r][c][1] += dsj * k1v;
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; r++) {
    const int64_t t = t0 + warp * ROWS + r;
    if (t >= a.T) continue;
    const int64_t at = ((b * a.T + t) * a.Hq + h) * a.D;
#pragma unroll
    for (int c = 0; c < FB_MAXC; c++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int64_t d = c * FB_DC + e * 32 + lane;
        if (c < nc && d < a.D) fb_st<DT, A>(dq, at + d, dqa[r][c][e] * scale);
      }
  }
}

/* ------------------------------------------------------------------------ */
/* Launchers                                                                 */
/* ------------------------------------------------------------------------ */

fb_dims fb_make(int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int causal) {
  fb_dims a;
  a.B = B;
  a.T = T;
  a.S = S;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.D = D;
  a.group = Hq / Hkv;
  a.off = S - T;
  a.causal = causal != 0;
  return a;
}

/* Blocks for `tiles` tiles of each of `heads` (batch x head) pairs. */
tt_status fb_grid(const char *kernel, int64_t tiles, int64_t heads, unsigned int *blocks) {
  const int64_t n = tiles * heads;
  if (n > INT32_MAX)
    return tt_error_set(TT_ERR_SHAPE, "cuda attention: %lld blocks for %s exceed the grid limit", (long long)n,
                        kernel);
  *blocks = (unsigned int)n;
  return TT_OK;
}

/* f64 keeps fewer rows per warp in the backward: its register accumulators
 * and shared tiles are twice the size. */
template <typename A>
constexpr int fb_bwd_rows() {
  return sizeof(A) == 8 ? 2 : 4;
}

template <int DT, typename A>
tt_status fb_forward(const fb_dims &a, double scale, const void *q, const void *k, const void *v, void *o, void *lse,
                     cudaStream_t s) {
  constexpr int ROWS = 4, BQ = FB_WARPS * ROWS;
  unsigned int blocks = 0;
  tt_status st = fb_grid("the forward", (a.T + BQ - 1) / BQ, a.B * a.Hq, &blocks);
  if (st != TT_OK || blocks == 0) return st;
  fb_forward_kernel<DT, A, ROWS><<<blocks, FB_THREADS, 0, s>>>(a, (A)scale, q, k, v, o, lse);
  TT_CUDA_CHECK_LAUNCH("fb_forward_kernel");
  return TT_OK;
}

template <int DT, typename A>
tt_status fb_backward(const fb_dims &a, double scale, const void *q, const void *k, const void *v, const void *o,
                      const void *lse, const void *dout, void *dq, void *dk, void *dv, cudaStream_t s) {
  constexpr int ROWS = fb_bwd_rows<A>(), BLK = FB_WARPS * ROWS;
  unsigned int blocks = 0;
  tt_status st = fb_grid("the dK/dV pass", (a.S + BLK - 1) / BLK, a.B * a.Hkv, &blocks);
  if (st != TT_OK) return st;
  if (blocks > 0) {
    fb_backward_dkv_kernel<DT, A, ROWS><<<blocks, FB_THREADS, 0, s>>>(a, (A)scale, q, k, v, o, lse, dout, dk, dv);
    TT_CUDA_CHECK_LAUNCH("fb_backward_dkv_kernel");
  }
  st = fb_grid("the dQ pass", (a.T + BLK - 1) / BLK, a.B * a.Hq, &blocks);
  if (st != TT_OK) return st;
  if (blocks > 0) {
    fb_backward_dq_kernel<DT, A, ROWS><<<blocks, FB_THREADS, 0, s>>>(a, (A)scale, q, k, v, o, lse, dout, dq);
    TT_CUDA_CHECK_LAUNCH("fb_backward_dq_kernel");
  }
  return TT_OK;
}

} // namespace

tt_status tt_att_fallback_forward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                  int causal, double scale, const void *q, const void *k, const void *v, void *o,
                                  void *lse, cudaStream_t stream) {
  if (D > TT_ATT_DMAX)
    return tt_error_set(TT_ERR_SHAPE, "cuda attention: head_dim %lld exceeds %d", (long long)D, TT_ATT_DMAX);
  if (B <= 0 || T <= 0 || Hq <= 0 || Hkv <= 0) return TT_OK;
  const fb_dims a = fb_make(B, T, S, Hq, Hkv, D, causal);
  switch (dtype) {
    case TT_F32: return fb_forward<TT_F32, float>(a, scale, q, k, v, o, lse, stream);
    case TT_F64: return fb_forward<TT_F64, double>(a, scale, q, k, v, o, lse, stream);
    case TT_BF16: return fb_forward<TT_BF16, float>(a, scale, q, k, v, o, lse, stream);
    case TT_F16: return fb_forward<TT_F16, float>(a, scale, q, k, v, o, lse, stream);
    default: return tt_error_set(TT_ERR_DTYPE, "cuda attention: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  }
}

tt_status tt_att_fallback_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                   int causal, double scale, const void *q, const void *k, const void *v,
                                   const void *o, const void *lse, const void *dout, void *dq, void *dk, void *dv,
                                   cudaStream_t stream) {
  if (D > TT_ATT_DMAX)
    return tt_error_set(TT_ERR_SHAPE, "cuda attention_backward: head_dim %lld exceeds %d", (long long)D,
                        TT_ATT_DMAX);
  /* D = 0: dq, dk, dv have no elements. */
  if (B <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0) return TT_OK;
  const fb_dims a = fb_make(B, T, S, Hq, Hkv, D, causal);
  switch (dtype) {
    case TT_F32: return fb_backward<TT_F32, float>(a, scale, q, k, v, o, lse, dout, dq, dk, dv, stream);
    case TT_F64: return fb_backward<TT_F64, double>(a, scale, q, k, v, o, lse, dout, dq, dk, dv, stream);
    case TT_BF16: return fb_backward<TT_BF16, float>(a, scale, q, k, v, o, lse, dout, dq, dk, dv, stream);
    case TT_F16: return fb_backward<TT_F16, float>(a, scale, q, k, v, o, lse, dout, dq, dk, dv, stream);
    default:
      return tt_error_set(TT_ERR_DTYPE, "cuda attention_backward: dtype %d not supported (f32, f64, bf16, f16)",
                          dtype);
  }
}
