/*
 * attention.c — scaled-dot-product attention, forward and backward (CPU).
 *
 * Layout: q [B,T,Hq,D], k/v [B,S,Hkv,D], o [B,T,Hq,D], lse [B,Hq,T], all
 * contiguous. Query head h reads kv head h / (Hq/Hkv) (grouped-query
 * attention). Causal attention aligns the last query with the last key:
 * query t sees keys s <= t + (S - T). A query that sees no key gets o = 0
 * and lse = -inf.
 *
 * Nothing here allocates, and no T x S matrix ever exists. The work is cut
 * into tiles of 64 queries x 64 keys that live on the stack (at most about
 * 290 KiB per thread, in the backward's pass 1 at head_dim 256; the tiles
 * are sized for 256 whatever the head dim):
 *
 * Forward (flash-attention style): one task per (batch, head, block of 64
 * queries). It walks the key blocks left to right keeping, per query, the
 * running maximum m and sum l of exp(score - m) and an unnormalized output;
 * when a new block raises the maximum, the old sums are rescaled by
 * exp(m_old - m_new) (the "online softmax"). At the end o = acc / l and
 * lse = m + log(l), which the backward uses to recompute probabilities.
 *
 * Backward: with P = exp(scale * q.k - lse) recomputed per tile,
 *   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - Di),  Di = rowsum(dO * O),
 *   dQ = scale * dS K,  dK = scale * dS^T Q.
 * dK and dV sum over queries, dQ sums over keys, so no single loop order
 * gives every output one owner. Instead of float atomics (non-deterministic)
 * or scratch buffers (kernels never allocate) there are two passes:
 *   pass 1 — one task per (batch, kv head, block of 64 keys): holds the
 *            block's dK and dV tiles and sums into them over every query
 *            head of the group and every query block, in a fixed order;
 *   pass 2 — one task per (batch, query head, block of 64 queries): holds
 *            the block's dQ tile and sums over the key blocks in order.
 * Each output element has exactly one writer and a fixed summation order, so
 * the result is bit-identical from run to run. Pass 2 recomputes P and dS,
 * which costs 3 of the 5 matmuls again. When there are enough
 * (batch, kv head) groups to keep every thread busy, a fused single pass is
 * used instead: one task per group walks all key blocks with pass 1's code
 * and also adds each tile's dS K into dq, which that task alone owns. Both
 * schedules perform, per output element, the same floating-point operations
 * in the same order (only where the partial dq waits differs: a stack tile
 * in pass 2, dq itself in the fused pass), so the choice — which depends on
 * the thread count — never changes a bit of the result.
 *
 * Two implementations share this plan:
 *  - f32 with AVX-512 (F and DQ) and head_dim a multiple of 16, or AVX2 +
 *    FMA and head_dim a multiple of 8: the fast path, written once over a
 *    thin vector layer (16 or 8 float lanes). Tiles put 16 (8) queries or
 *    keys in the lanes of a vector, so the softmax bookkeeping is plain
 *    vertical vector math with no horizontal reductions, and every matmul is
 *    a block of 4 rows x 4 (2) vector accumulators fed by broadcasts
 *    (register blocking: each loaded vector serves 4 FMAs; AVX2 has half the
 *    registers, so it walks a tile row's 8 vectors two at a time).
 *    The forward and pass 2 put queries in lanes (Q is turned once per
 *    block, K and V rows are read in place); pass 1 puts keys in lanes (K
 *    and V turned once per key block, Q and dO rows read in place). exp is
 *    a degree-5 polynomial in base 2 (scores are pre-multiplied by
 *    log2(e)), accurate to ~1e-7. Rows of one head are Hq*D floats apart,
 *    which the hardware prefetchers follow badly, so each tile prefetches
 *    the rows the next tile will read.
 *    The two instruction sets do not give the same bits (AVX2 sums Di in
 *    the matmuls' order, AVX-512 over 16 lanes; AVX2's exp2 flushes weights
 *    below 2^-126 to 0), but each gives the same bits every run.
 *  - everything else (f64 for gradient checks, odd head dims, builds
 *    without AVX2): the same tiling on double tiles with libm exp, clear
 *    rather than fast (a tenth of the AVX2 path's speed). It always uses
 *    the two-pass backward.
 * tests/CMakeLists.txt builds test_attention a second time without AVX-512
 * (c/test_attention_avx2), so a machine with AVX-512 tests both paths.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define ATT_AVX512 1
#define ATT_FAST 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define ATT_FAST 1
#include <immintrin.h>
#endif

#define ATT_DMAX 256 /* largest head_dim the stack tiles hold (ops.c enforces it) */
#define ATT_LN2 0.69314718055994530942
#define ATT_LOG2E 1.44269504088896340736

typedef struct {
  int64_t B, T, S, Hq, Hkv, D;
  int64_t group; /* query heads per kv head */
  int64_t off;   /* S - T: causal query t sees keys s <= t + off */
  int causal;
  double scale;
} att_dims;

static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

/* Keys [0, key_end) are visible to query t. */
static inline int64_t key_end(const att_dims *a, int64_t t) {
  if (!a->causal) return a->S;
  int64_t e = t + a->off + 1;
  return e < 0 ? 0 : min64(e, a->S);
}

/* Element offsets of a row (its D values are contiguous). */
static inline int64_t q_at(const att_dims *a, int64_t b, int64_t t, int64_t h) {
  return ((b * a->T + t) * a->Hq + h) * a->D;
}
static inline int64_t kv_at(const att_dims *a, int64_t b, int64_t s, int64_t kvh) {
  return ((b * a->S + s) * a->Hkv + kvh) * a->D;
}
static inline int64_t lse_at(const att_dims *a, int64_t b, int64_t h, int64_t t) { return (b * a->Hq + h) * a->T + t; }

/* ======================================================================== */
/* Generic path: double tiles, scalar exp. f64, odd head dims, no AVX2.      */
/* ======================================================================== */

/* 16 rows of up to 256 doubles = 32 KiB per tile; the backward's key pass
 * keeps six of them. */
#define G_BQ 16
#define G_BK 16

static inline double g_ld(int dt, const void *p, int64_t i) {
  return dt == TT_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}
static inline void g_st(int dt, void *p, int64_t i, double x) {
  if (dt == TT_F64)
    ((double *)p)[i] = x;
  else
    ((float *)p)[i] = (float)x;
}

/* n rows starting at element at0, `stride` elements apart, times mul. */
static void g_load_rows(int dt, const void *p, int64_t at0, int64_t stride, int64_t n, int64_t D, double mul,
                        double (*tile)[ATT_DMAX]) {
  for (int64_t i = 0; i < n; i++)
    for (int64_t d = 0; d < D; d++) tile[i][d] = mul * g_ld(dt, p, at0 + i * stride + d);
}

static inline double g_dot(const double *x, const double *y, int64_t D) {
  double s = 0;
  for (int64_t d = 0; d < D; d++) s += x[d] * y[d];
  return s;
}

static void g_fwd_block(const att_dims *a, int dt, const void *q, const void *k, const void *v, void *o, void *lse,
                        int64_t b, int64_t h, int64_t qb) {
  double qs[G_BQ][ATT_DMAX], acc[G_BQ][ATT_DMAX], kt[G_BK][ATT_DMAX], vt[G_BK][ATT_DMAX];
  double m[G_BQ], l[G_BQ], p[G_BK];
  const int64_t D = a->D, t0 = qb * G_BQ, nq = min64(G_BQ, a->T - t0), kvh = h / a->group;
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;

  g_load_rows(dt, q, q_at(a, b, t0, h), qstride, nq, D, a->scale, qs);
  for (int64_t i = 0; i < nq; i++) {
    m[i] = -INFINITY;
    l[i] = 0;
    for (int64_t d = 0; d < D; d++) acc[i][d] = 0;
  }
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += G_BK) {
    const int64_t nk = min64(G_BK, kend - k0);
    g_load_rows(dt, k, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, kt);
    g_load_rows(dt, v, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, vt);
    for (int64_t i = 0; i < nq; i++) {
      const int64_t n = min64(nk, key_end(a, t0 + i) - k0);
      if (n <= 0) continue;
      double mx = m[i];
      for (int64_t j = 0; j < n; j++) {
        p[j] = g_dot(qs[i], kt[j], D);
        mx = fmax(mx, p[j]);
      }
      const double alpha = exp(m[i] - mx); /* 0 on the first visit (m = -inf) */
      double sum = 0;
      for (int64_t j = 0; j < n; j++) {
        p[j] = exp(p[j] - mx);
        sum += p[j];
      }
      l[i] = l[i] * alpha + sum;
      m[i] = mx;
      for (int64_t d = 0; d < D; d++) acc[i][d] *= alpha;
      for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d++) acc[i][d] += p[j] * vt[j][d];
    }
  }
  for (int64_t i = 0; i < nq; i++) {
    const int64_t at = q_at(a, b, t0 + i, h);
    const int seen = l[i] > 0;
    const double inv = seen ? 1.0 / l[i] : 0.0;
    for (int64_t d = 0; d < D; d++) g_st(dt, o, at + d, acc[i][d] * inv);
    g_st(dt, lse, lse_at(a, b, h, t0 + i), seen ? m[i] + log(l[i]) : -INFINITY);
  }
}

/* Rows' lse and Di = rowsum(dO * O) of a query block. */
static void g_block_stats(const att_dims *a, int dt, const void *o, const void *lse, const void *dout, int64_t b,
                          int64_t h, int64_t t0, int64_t nq, double *lsev, double *di) {
  for (int64_t i = 0; i < nq; i++) {
    const int64_t at = q_at(a, b, t0 + i, h);
    double s = 0;
    for (int64_t d = 0; d < a->D; d++) s += g_ld(dt, dout, at + d) * g_ld(dt, o, at + d);
    di[i] = s;
    lsev[i] = g_ld(dt, lse, lse_at(a, b, h, t0 + i));
  }
}

/* Pass 1: dK, dV of one key block, summed over the group's query heads and
 * all query blocks. */
static void g_bwd_kv_block(const att_dims *a, int dt, const void *q, const void *k, const void *v, const void *o,
                           const void *lse, const void *dout, void *dk, void *dv, int64_t b, int64_t kvh,
                           int64_t kb) {
  double kt[G_BK][ATT_DMAX], vt[G_BK][ATT_DMAX], dkt[G_BK][ATT_DMAX], dvt[G_BK][ATT_DMAX];
  double qs[G_BQ][ATT_DMAX], dos[G_BQ][ATT_DMAX], lsev[G_BQ], di[G_BQ];
  const int64_t D = a->D, k0 = kb * G_BK, nk = min64(G_BK, a->S - k0);
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;

  g_load_rows(dt, k, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, kt);
  g_load_rows(dt, v, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, vt);
  for (int64_t j = 0; j < nk; j++)
    for (int64_t d = 0; d < D; d++) dkt[j][d] = dvt[j][d] = 0;
  for (int64_t h = kvh * a->group; h < (kvh + 1) * a->group; h++) {
    for (int64_t t0 = 0; t0 < a->T; t0 += G_BQ) {
      const int64_t nq = min64(G_BQ, a->T - t0);
      if (key_end(a, t0 + nq - 1) <= k0) continue; /* no query of this block sees the keys */
      g_load_rows(dt, q, q_at(a, b, t0, h), qstride, nq, D, 1.0, qs);
      g_load_rows(dt, dout, q_at(a, b, t0, h), qstride, nq, D, 1.0, dos);
      g_block_stats(a, dt, o, lse, dout, b, h, t0, nq, lsev, di);
      for (int64_t i = 0; i < nq; i++) {
        const int64_t n = min64(nk, key_end(a, t0 + i) - k0);
        for (int64_t j = 0; j < n; j++) {
          const double p = exp(a->scale * g_dot(qs[i], kt[j], D) - lsev[i]);
          const double ds = p * (g_dot(dos[i], vt[j], D) - di[i]) * a->scale;
          for (int64_t d = 0; d < D; d++) {
            dvt[j][d] += p * dos[i][d];
            dkt[j][d] += ds * qs[i][d];
          }
        }
      }
    }
  }
  for (int64_t j = 0; j < nk; j++) {
    const int64_t at = kv_at(a, b, k0 + j, kvh);
    for (int64_t d = 0; d < D; d++) {
      g_st(dt, dk, at + d, dkt[j][d]);
      g_st(dt, dv, at + d, dvt[j][d]);
    }
  }
}

/* Pass 2: dQ of one query block, summed over the key blocks. */
static void g_bwd_q_block(const att_dims *a, int dt, const void *q, const void *k, const void *v, const void *o,
                          const void *lse, const void *dout, void *dq, int64_t b, int64_t h, int64_t qb) {
  double qs[G_BQ][ATT_DMAX], dos[G_BQ][ATT_DMAX], dqs[G_BQ][ATT_DMAX], kt[G_BK][ATT_DMAX], vt[G_BK][ATT_DMAX];
  double lsev[G_BQ], di[G_BQ];
  const int64_t D = a->D, t0 = qb * G_BQ, nq = min64(G_BQ, a->T - t0), kvh = h / a->group;
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;

  g_load_rows(dt, q, q_at(a, b, t0, h), qstride, nq, D, 1.0, qs);
  g_load_rows(dt, dout, q_at(a, b, t0, h), qstride, nq, D, 1.0, dos);
  g_block_stats(a, dt, o, lse, dout, b, h, t0, nq, lsev, di);
  for (int64_t i = 0; i < nq; i++)
    for (int64_t d = 0; d < D; d++) dqs[i][d] = 0;
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += G_BK) {
    const int64_t nk = min64(G_BK, kend - k0);
    g_load_rows(dt, k, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, kt);
    g_load_rows(dt, v, kv_at(a, b, k0, kvh), kvstride, nk, D, 1.0, vt);
    for (int64_t i = 0; i < nq; i++) {
      const int64_t n = min64(nk, key_end(a, t0 + i) - k0);
      for (int64_t j = 0; j < n; j++) {
        const double p = exp(a->scale * g_dot(qs[i], kt[j], D) - lsev[i]);
        const double ds = p * (g_dot(dos[i], vt[j], D) - di[i]) * a->scale;
        for (int64_t d = 0; d < D; d++) dqs[i][d] += ds * kt[j][d];
      }
    }
  }
  for (int64_t i = 0; i < nq; i++) {
    const int64_t at = q_at(a, b, t0 + i, h);
    for (int64_t d = 0; d < D; d++) g_st(dt, dq, at + d, dqs[i][d]);
  }
}

static void g_forward(const att_dims *a, int dt, const void *q, const void *k, const void *v, void *o, void *lse) {
  const int64_t nqb = (a->T + G_BQ - 1) / G_BQ, bh = a->B * a->Hq;
  /* Later query blocks see more keys (causal): hand them out first. */
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < nqb * bh; it++)
    g_fwd_block(a, dt, q, k, v, o, lse, (it % bh) / a->Hq, it % a->Hq, nqb - 1 - it / bh);
}

static void g_backward(const att_dims *a, int dt, const void *q, const void *k, const void *v, const void *o,
                       const void *lse, const void *dout, void *dq, void *dk, void *dv) {
  const int64_t nqb = (a->T + G_BQ - 1) / G_BQ, nkb = (a->S + G_BK - 1) / G_BK;
  const int64_t bh = a->B * a->Hq, bkv = a->B * a->Hkv;
  /* The passes write disjoint outputs, so threads run on into pass 2. */
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < nkb * bkv; it++)
      g_bwd_kv_block(a, dt, q, k, v, o, lse, dout, dk, dv, (it % bkv) / a->Hkv, it % a->Hkv, it / bkv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < nqb * bh; it++)
      g_bwd_q_block(a, dt, q, k, v, o, lse, dout, dq, (it % bh) / a->Hq, it % a->Hq, nqb - 1 - it / bh);
  }
}

/* ======================================================================== */
/* Fast path: f32 on AVX-512 or AVX2 + FMA, head_dim a multiple of FW.       */
/* ======================================================================== */
#if defined(ATT_FAST)

#define FB 64 /* queries and keys per tile */
#define F_INLINE static inline __attribute__((always_inline))

/* The vector layer: FW float lanes per vector, FV vectors per tile row. The
 * kernels after it are written once against it; each instruction set gives
 * the same operations. FC is how many of a tile row's vectors one matmul call keeps
 * in registers per row (4 rows x FC accumulators, the tile's FC vectors and
 * a broadcast must fit the register file: 32 zmm, 16 ymm). FA is the
 * accumulator count of the dq rows (f_dq_tile). */
#if defined(ATT_AVX512)
#define FW 16
#define FC 4
#define FA 16
typedef __m512 fv;
typedef __m512i fvi;
F_INLINE fv fv_zero(void) { return _mm512_setzero_ps(); }
F_INLINE fv fv_set1(float x) { return _mm512_set1_ps(x); }
F_INLINE fv fv_load(const float *p) { return _mm512_load_ps(p); }
F_INLINE fv fv_loadu(const float *p) { return _mm512_loadu_ps(p); }
F_INLINE void fv_store(float *p, fv x) { _mm512_store_ps(p, x); }
F_INLINE void fv_storeu(float *p, fv x) { _mm512_storeu_ps(p, x); }
F_INLINE fv fv_add(fv x, fv y) { return _mm512_add_ps(x, y); }
F_INLINE fv fv_sub(fv x, fv y) { return _mm512_sub_ps(x, y); }
F_INLINE fv fv_mul(fv x, fv y) { return _mm512_mul_ps(x, y); }
F_INLINE fv fv_max(fv x, fv y) { return _mm512_max_ps(x, y); }
F_INLINE fv fv_fmadd(fv x, fv y, fv z) { return _mm512_fmadd_ps(x, y, z); }
F_INLINE fv fv_fmsub(fv x, fv y, fv z) { return _mm512_fmsub_ps(x, y, z); }
F_INLINE float fv_sum(fv x) { return _mm512_reduce_add_ps(x); }

/* 2^x for x <= ~0. x = floor(x) + f with f in [0, 1) (vreduceps); 2^f from
 * a degree-5 minimax polynomial with p(0) = 1 exactly, so a running maximum
 * that does not move rescales by exactly 1 (relative error 8.2e-8); then
 * vscalefps multiplies by 2^floor(x) itself, flushing to 0 for very negative
 * x. Seven vector operations. NaN for x = +inf (always masked off later). */
F_INLINE fv fv_exp2_poly(fv f);
F_INLINE fv fv_exp2(fv x) {
  const fv f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(fv_exp2_poly(f), x);
}

/* Lane numbers FW*c .. FW*c + FW-1 of tile vector c. */
F_INLINE fvi fv_iota(int c) {
  return _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                          _mm512_set1_epi32(FW * c));
}
/* x where the lane number (iota) is >= thr, else `other`. */
F_INLINE fv fv_keep_ge(fv x, fvi iota, fvi thr, fv other) {
  return _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(iota, thr), other, x);
}
/* x where the lane number is >= thr (or <= lim), else 0. */
F_INLINE fv fv_keep_ge0(fv x, fvi iota, fvi thr) { return _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(iota, thr), x); }
F_INLINE fv fv_keep_le(fv x, fvi iota, fvi lim) { return _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(iota, lim), x); }
F_INLINE fvi fv_seti(int32_t x) { return _mm512_set1_epi32(x); }

/* Turns 16 vectors of 16 floats around: r[i] lane j <-> r[j] lane i. Three
 * rounds of shuffles (pairs of floats, quads, 128-bit lanes). */
F_INLINE void fv_transpose(fv r[FW]) {
  fv t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#else /* AVX2 + FMA */
#define FW 8
#define FC 2
#define FA 8
typedef __m256 fv;
typedef __m256i fvi;
F_INLINE fv fv_zero(void) { return _mm256_setzero_ps(); }
F_INLINE fv fv_set1(float x) { return _mm256_set1_ps(x); }
F_INLINE fv fv_load(const float *p) { return _mm256_load_ps(p); }
F_INLINE fv fv_loadu(const float *p) { return _mm256_loadu_ps(p); }
F_INLINE void fv_store(float *p, fv x) { _mm256_store_ps(p, x); }
F_INLINE void fv_storeu(float *p, fv x) { _mm256_storeu_ps(p, x); }
F_INLINE fv fv_add(fv x, fv y) { return _mm256_add_ps(x, y); }
F_INLINE fv fv_sub(fv x, fv y) { return _mm256_sub_ps(x, y); }
F_INLINE fv fv_mul(fv x, fv y) { return _mm256_mul_ps(x, y); }
F_INLINE fv fv_max(fv x, fv y) { return _mm256_max_ps(x, y); }
F_INLINE fv fv_fmadd(fv x, fv y, fv z) { return _mm256_fmadd_ps(x, y, z); }
F_INLINE fv fv_fmsub(fv x, fv y, fv z) { return _mm256_fmsub_ps(x, y, z); }

/* 2^x for x <= ~0, as the AVX-512 version: x = floor(x) + f, the same
 * polynomial for 2^f, times 2^floor(x) built in the exponent bits. x is
 * first raised to -127, where that power reads as 0 (AVX-512's vscalefps
 * gives the subnormals instead: weights below 2^-126 of a row's largest, no
 * difference to any sum). max(-127, x) keeps a NaN x a NaN. */
F_INLINE fv fv_exp2_poly(fv f);
F_INLINE fv fv_exp2(fv x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
  const fv fl = _mm256_floor_ps(x);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(fv_exp2_poly(_mm256_sub_ps(x, fl)), _mm256_castsi256_ps(e));
}

F_INLINE fvi fv_iota(int c) {
  return _mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(FW * c));
}
/* iota >= thr  <=>  iota > thr - 1 (lane numbers and thresholds lie in [-1, 64]) */
F_INLINE fv fv_ge_mask(fvi iota, fvi thr) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(iota, _mm256_sub_epi32(thr, _mm256_set1_epi32(1))));
}
F_INLINE fv fv_keep_ge(fv x, fvi iota, fvi thr, fv other) { return _mm256_blendv_ps(other, x, fv_ge_mask(iota, thr)); }
F_INLINE fv fv_keep_ge0(fv x, fvi iota, fvi thr) { return _mm256_and_ps(fv_ge_mask(iota, thr), x); }
F_INLINE fv fv_keep_le(fv x, fvi iota, fvi lim) {
  return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(iota, lim)), x);
}
F_INLINE fvi fv_seti(int32_t x) { return _mm256_set1_epi32(x); }

/* 8 x 8 transpose: pairs of floats, quads, then the 128-bit halves. */
F_INLINE void fv_transpose(fv r[FW]) {
  fv t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}
#endif

#define FV (FB / FW) /* vectors per tile row */

/* Pins a loaded vector in a register. Without it GCC folds the load into
 * each FMA that reads it (`vfmadd231ps mem, ...`), so a matmul core's tile
 * vector is loaded once per row it meets instead of once: 12 loads per 8
 * FMAs in the AVX2 cores, which then wait on the load ports, not the FMAs. */
F_INLINE fv fv_reg(fv x) {
  __asm__("" : "+v"(x));
  return x;
}

/* 2^f for f in [0, 1): degree-5 minimax polynomial, p(0) = 1 exactly. */
F_INLINE fv fv_exp2_poly(fv f) {
  fv p = fv_set1(0.0018671300699122932f);
  p = fv_fmadd(p, f, fv_set1(0.009017030322326125f));
  p = fv_fmadd(p, f, fv_set1(0.05579991310386636f));
  p = fv_fmadd(p, f, fv_set1(0.24016445015503726f));
  p = fv_fmadd(p, f, fv_set1(0.6931513118046069f));
  return fv_fmadd(p, f, fv_set1(1.0f));
}

/* A masked score. Finite, so exp2(masked - max) is exactly 0 even when every
 * score of a row is masked (where -inf - -inf would give NaN). */
#define F_NEG (-1e30f)

typedef struct {
  att_dims a;
  const float *q, *k, *v, *o, *lse, *dout;
  float *out, *lse_out, *dq, *dk, *dv;
  float c;     /* scale * log2(e): base-2 scores, so exp2 does the work of exp */
  float scale;
} f_args;

F_INLINE int32_t f_clamp_lane(int64_t x) { return (int32_t)(x < -1 ? -1 : x > FB ? FB : x); }

/* Asks for the D floats of a row that the next tile will read (see the
 * header: strided rows defeat the hardware prefetchers); 16 floats a line. */
F_INLINE void f_prefetch_row(const float *row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(row + d), _MM_HINT_T0);
}

/* Matmul core 1 — four rows times FC vectors of a transposed tile:
 *   acc[r][c] = sum_d rows[r][d] * tile[d][FW*c .. FW*c + FW-1].
 * Row values are broadcast; the tile's vectors (D x 64, lanes along its
 * rows; `tile` points at the first of the FC) are loaded once per d for all
 * four rows. Every element is a plain FMA chain over d in increasing order.
 * Callers walk a tile row's FV vectors FC at a time (once on AVX-512). */
F_INLINE void f_rows_x_tile(const float *const rows[4], const float *tile, int64_t D, fv acc[4][FC]) {
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < FC; c++) acc[r][c] = fv_zero();
  for (int64_t d = 0; d < D; d++) {
    fv t[FC];
    for (int c = 0; c < FC; c++) t[c] = fv_reg(fv_load(tile + d * FB + FW * c));
    for (int r = 0; r < 4; r++) {
      const fv x = fv_set1(rows[r][d]);
      for (int c = 0; c < FC; c++) acc[r][c] = fv_fmadd(x, t[c], acc[r][c]);
    }
  }
}

/* Matmul core 2 — a sum over n rows into four rows of a transposed tile:
 *   out[r][FW*c ..] (= out * pre[c]) += sum_{j<n} row_j[r] * tile[j][FW*c ..]
 * where row_j = row + j * stride. Each element is an FMA chain over j in
 * increasing order, starting from its value in `out`. */
F_INLINE void f_sum_rows(float *out, const float *row, int64_t stride, int64_t n, const float *tile, const fv *pre) {
  for (int cg = 0; cg < FV; cg += FC) {
    fv acc[4][FC];
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < FC; c++) {
        acc[r][c] = fv_load(out + r * FB + FW * (cg + c));
        if (pre) acc[r][c] = fv_mul(acc[r][c], pre[cg + c]);
      }
    const float *rj = row;
    for (int64_t j = 0; j < n; j++, rj += stride) {
      fv t[FC];
      for (int c = 0; c < FC; c++) t[c] = fv_reg(fv_load(tile + j * FB + FW * (cg + c)));
      for (int r = 0; r < 4; r++) {
        const fv x = fv_set1(rj[r]);
        for (int c = 0; c < FC; c++) acc[r][c] = fv_fmadd(x, t[c], acc[r][c]);
      }
    }
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < FC; c++) fv_store(out + r * FB + FW * (cg + c), acc[r][c]);
  }
}

/* Matmul core 3 — dq rows += dS K, for pass 1 of the fused schedule:
 *   dq[i][FW*c ..] += sum_{j<nk} ds[i][j] * k_j[FW*c ..]
 * for NI rows (nvalid of them real) and NV vectors of head dim. Same FMA
 * chain per element as core 2 computes for dq^T in pass 2. */
F_INLINE void f_dq_tile(float *dq, int64_t qstride, int64_t nvalid, const float *ds, const float *k, int64_t kvstride,
                        int64_t nk, const int NI, const int NV) {
  fv acc[FA][4];
  const float *dsr[FA];
  for (int r = 0; r < NI; r++) {
    const int64_t rr = min64(r, nvalid - 1);
    dsr[r] = ds + rr * FB;
    for (int c = 0; c < NV; c++) acc[r][c] = fv_loadu(dq + rr * qstride + FW * c);
  }
  for (int64_t j = 0; j < nk; j++, k += kvstride) {
    fv t[4];
    for (int c = 0; c < NV; c++) t[c] = fv_reg(fv_loadu(k + FW * c));
    for (int r = 0; r < NI; r++) {
      const fv x = fv_set1(dsr[r][j]);
      for (int c = 0; c < NV; c++) acc[r][c] = fv_fmadd(x, t[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NI && r < nvalid; r++)
    for (int c = 0; c < NV; c++) fv_storeu(dq + r * qstride + FW * c, acc[r][c]);
}

static void f_dq_rows(float *dq, int64_t qstride, int64_t nq, const float *ds, const float *k, int64_t kvstride,
                      int64_t nk, int64_t D) {
  /* FA accumulators per call whatever the head dim: FA rows x 1 vector at
   * head_dim FW, FA/4 x 4 from 4*FW up. */
  for (int64_t c0 = 0; c0 < D / FW;) {
    const int64_t left = D / FW - c0;
    for (int64_t i = 0; i < nq; i += left >= 4 ? FA / 4 : left >= 2 ? FA / 2 : FA) {
      float *dqi = dq + i * qstride + FW * c0;
      const float *dsi = ds + i * FB, *kc = k + FW * c0;
      if (left >= 4)
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, FA / 4, 4);
      else if (left >= 2)
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, FA / 2, 2);
      else
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, FA, 1);
    }
    c0 += left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

/* A block of n <= 64 rows (row i at src + i * stride) turned so rows lie in
 * lanes: tile[d][i] = mul * row_i[d], zero for the padding rows n .. 63. */
static void f_pack_transposed(const float *src, int64_t stride, int64_t n, int64_t D, float mul, float *tile) {
  const fv m = fv_set1(mul);
  for (int64_t i0 = 0; i0 < FB; i0 += FW)
    for (int64_t d0 = 0; d0 < D; d0 += FW) {
      fv r[FW];
      for (int64_t i = 0; i < FW; i++)
        r[i] = i0 + i < n ? fv_mul(fv_loadu(src + (i0 + i) * stride + d0), m) : fv_zero();
      fv_transpose(r);
      for (int64_t d = 0; d < FW; d++) fv_store(tile + (d0 + d) * FB + i0, r[d]);
    }
}

/* The way back, for the first n rows: row_i[d] = tile[d][i] * mul * lane[i]
 * (lane may be NULL). */
static void f_unpack_transposed(const float *tile, const float *lane, float mul, int64_t n, int64_t D, float *dst,
                                int64_t stride) {
  const fv m = fv_set1(mul);
  for (int64_t i0 = 0; i0 < n; i0 += FW)
    for (int64_t d0 = 0; d0 < D; d0 += FW) {
      fv r[FW];
      for (int64_t d = 0; d < FW; d++) {
        r[d] = fv_mul(fv_load(tile + (d0 + d) * FB + i0), m);
        if (lane) r[d] = fv_mul(r[d], fv_load(lane + i0));
      }
      fv_transpose(r);
      for (int64_t i = 0; i < FW && i0 + i < n; i++) fv_storeu(dst + (i0 + i) * stride + d0, r[i]);
    }
}

/* lse in base 2 and Di = rowsum(dO * O) for the 64 rows of a query block;
 * padding rows repeat the last real row. Both backward passes read their
 * statistics from here, so they agree to the bit. */
static void f_block_stats(const f_args *g, int64_t b, int64_t h, int64_t t0, int64_t nq, float *lse2, float *di) {
  const att_dims *a = &g->a;
  for (int64_t i = 0; i < FB; i++) lse2[i] = g->lse[lse_at(a, b, h, t0 + min64(i, nq - 1))] * (float)ATT_LOG2E;
#if defined(ATT_AVX512)
  for (int64_t i = 0; i < FB; i++) {
    const int64_t at = q_at(a, b, t0 + min64(i, nq - 1), h);
    fv acc = fv_zero();
    for (int64_t d = 0; d < a->D; d += FW) acc = fv_fmadd(fv_loadu(g->dout + at + d), fv_loadu(g->o + at + d), acc);
    di[i] = fv_sum(acc);
  }
#else
  /* One FMA chain over d in increasing order, as the matmul cores compute
   * dP = dO.v: where a row's output is one value row (all its weight on one
   * key, e.g. T = S = 1), dP - Di then cancels exactly instead of leaving a
   * rounding residue in dS. Eight rows at a time, so the chains overlap. */
  for (int64_t i0 = 0; i0 < FB; i0 += 8) {
    const float *x[8], *y[8];
    float s[8];
    for (int r = 0; r < 8; r++) {
      const int64_t at = q_at(a, b, t0 + min64(i0 + r, nq - 1), h);
      x[r] = g->dout + at, y[r] = g->o + at, s[r] = 0.0f;
    }
    for (int64_t d = 0; d < a->D; d++)
      for (int r = 0; r < 8; r++) s[r] = fmaf(x[r][d], y[r][d], s[r]);
    for (int r = 0; r < 8; r++) di[i0 + r] = s[r];
  }
#endif
}

static void f_fwd_block(const f_args *g, int64_t b, int64_t h, int64_t qb) {
  const att_dims *a = &g->a;
  const int64_t D = a->D, t0 = qb * FB, nq = min64(FB, a->T - t0), kvh = h / a->group;
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;
  const float *kbase = g->k + kv_at(a, b, 0, kvh), *vbase = g->v + kv_at(a, b, 0, kvh);
  /* qt: the block's queries times scale*log2(e), turned (d rows, queries in
   * lanes); ot: the unnormalized output, turned likewise; st: scores, then
   * probabilities, of one key block (key rows, queries in lanes). */
  _Alignas(64) float qt[ATT_DMAX * FB], ot[ATT_DMAX * FB], st[FB * FB];
  _Alignas(64) float mf[FB], lf[FB];
  const fv neg = fv_set1(F_NEG);

  f_pack_transposed(g->q + q_at(a, b, t0, h), qstride, nq, D, g->c, qt);
  memset(ot, 0, sizeof(float) * (size_t)(D * FB));
  fv m[FV], l[FV];
  for (int c = 0; c < FV; c++) {
    m[c] = neg;
    l[c] = fv_zero();
  }
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += FB) {
    const int64_t nk = min64(FB, a->S - k0);
    const int masked = nk < FB || (a->causal && k0 + FB - 1 > t0 + a->off);
    fv mx[FV];
    for (int c = 0; c < FV; c++) mx[c] = m[c];
    for (int64_t j = 0; j < nk; j += 4) {
      const float *rows[4];
      for (int r = 0; r < 4; r++) rows[r] = kbase + min64(k0 + j + r, k0 + nk - 1) * kvstride;
      for (int cg = 0; cg < FV; cg += FC) {
        fv acc[4][FC];
        f_rows_x_tile(rows, qt + FW * cg, D, acc);
        for (int r = 0; r < 4; r++) {
          /* key k0+j+r is visible to the queries (lanes) i >= thr */
          const int64_t thr = j + r >= nk ? FB : a->causal ? k0 + j + r - t0 - a->off : 0;
          const fvi vthr = fv_seti(f_clamp_lane(thr));
          for (int c = 0; c < FC; c++) {
            fv x = acc[r][c];
            if (masked) x = fv_keep_ge(x, fv_iota(cg + c), vthr, neg);
            fv_store(st + (j + r) * FB + FW * (cg + c), x);
            mx[cg + c] = fv_max(mx[cg + c], x);
          }
        }
      }
    }
    fv alpha[FV], sum[FV];
    for (int c = 0; c < FV; c++) {
      alpha[c] = fv_exp2(fv_sub(m[c], mx[c]));
      m[c] = mx[c];
      sum[c] = fv_zero();
    }
    for (int64_t j = 0; j < nk; j++) {
      if (k0 + FB + j < kend) {
        f_prefetch_row(kbase + (k0 + FB + j) * kvstride, D);
        f_prefetch_row(vbase + (k0 + FB + j) * kvstride, D);
      }
      for (int c = 0; c < FV; c++) {
        const fv p = fv_exp2(fv_sub(fv_load(st + j * FB + FW * c), m[c]));
        fv_store(st + j * FB + FW * c, p);
        sum[c] = fv_add(sum[c], p);
      }
    }
    for (int c = 0; c < FV; c++) l[c] = fv_fmadd(l[c], alpha[c], sum[c]);
    for (int64_t d0 = 0; d0 < D; d0 += 4) f_sum_rows(ot + d0 * FB, vbase + k0 * kvstride + d0, kvstride, nk, st, alpha);
  }
  for (int c = 0; c < FV; c++) {
    fv_store(mf + FW * c, m[c]);
    fv_store(lf + FW * c, l[c]);
  }
  for (int64_t i = 0; i < FB; i++) {
    const int seen = i < nq && key_end(a, t0 + i) > 0;
    if (i < nq)
      g->lse_out[lse_at(a, b, h, t0 + i)] = seen ? (float)(((double)mf[i] + log2((double)lf[i])) * ATT_LN2) : -INFINITY;
    lf[i] = seen ? 1.0f / lf[i] : 0.0f; /* a row that sees no key gets o = 0 */
  }
  f_unpack_transposed(ot, lf, 1.0f, nq, D, g->out + q_at(a, b, t0, h), qstride);
}

/* Pass 1 (and the fused pass when with_dq): the key block kb of kv head kvh.
 * Tiles here put keys in lanes: kt/vt are K and V turned (d rows), p and ds
 * hold one query block's probabilities and score gradients (query rows),
 * dkt/dvt accumulate dK/dV turned. */
static void f_bwd_kv_block(const f_args *g, int64_t b, int64_t kvh, int64_t kb, int with_dq) {
  const att_dims *a = &g->a;
  const int64_t D = a->D, k0 = kb * FB, nk = min64(FB, a->S - k0);
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;
  const float *krow0 = g->k + kv_at(a, b, k0, kvh), *vrow0 = g->v + kv_at(a, b, k0, kvh);
  _Alignas(64) float kt[ATT_DMAX * FB], vt[ATT_DMAX * FB], dkt[ATT_DMAX * FB], dvt[ATT_DMAX * FB];
  _Alignas(64) float p[FB * FB], ds[FB * FB], lse2[FB], di[FB];
  const fv cv = fv_set1(g->c);

  f_pack_transposed(krow0, kvstride, nk, D, 1.0f, kt);
  f_pack_transposed(vrow0, kvstride, nk, D, 1.0f, vt);
  memset(dkt, 0, sizeof(float) * (size_t)(D * FB));
  memset(dvt, 0, sizeof(float) * (size_t)(D * FB));
  for (int64_t h = kvh * a->group; h < (kvh + 1) * a->group; h++) {
    for (int64_t t0 = 0; t0 < a->T; t0 += FB) {
      const int64_t nq = min64(FB, a->T - t0);
      if (key_end(a, t0 + nq - 1) <= k0) continue; /* no query of this block sees the keys */
      const int masked = nk < FB || (a->causal && k0 + FB - 1 > t0 + a->off);
      const float *qrow0 = g->q + q_at(a, b, t0, h), *dorow0 = g->dout + q_at(a, b, t0, h);
      f_block_stats(g, b, h, t0, nq, lse2, di);
      for (int64_t i = 0; i < nq; i += 4) {
        const float *rows[4];
        for (int64_t r = i; r < i + 4 && t0 + FB + r < a->T; r++) {
          const int64_t at = q_at(a, b, t0 + FB + r, h);
          f_prefetch_row(g->q + at, D);
          f_prefetch_row(g->dout + at, D);
          f_prefetch_row(g->o + at, D);
          if (with_dq) f_prefetch_row(g->dq + at, D);
        }
        /* P = exp2(c * q.k - lse2), 0 where masked (and in lanes >= nk). */
        for (int r = 0; r < 4; r++) rows[r] = qrow0 + min64(i + r, nq - 1) * qstride;
        for (int cg = 0; cg < FV; cg += FC) {
          fv acc[4][FC];
          f_rows_x_tile(rows, kt + FW * cg, D, acc);
          for (int r = 0; r < 4; r++) {
            const int64_t ii = min64(i + r, nq - 1);
            const fv l2 = fv_set1(lse2[ii]);
            /* query t0+ii sees the keys (lanes) j <= lim */
            const int64_t lim = a->causal ? min64(nk - 1, t0 + ii + a->off - k0) : nk - 1;
            const fvi vlim = fv_seti(f_clamp_lane(lim));
            for (int c = 0; c < FC; c++) {
              fv x = fv_exp2(fv_fmsub(acc[r][c], cv, l2));
              if (masked) x = fv_keep_le(x, fv_iota(cg + c), vlim);
              fv_store(p + (i + r) * FB + FW * (cg + c), x);
            }
          }
        }
        /* dS = P * (dO.v - Di) */
        for (int r = 0; r < 4; r++) rows[r] = dorow0 + min64(i + r, nq - 1) * qstride;
        for (int cg = 0; cg < FV; cg += FC) {
          fv acc[4][FC];
          f_rows_x_tile(rows, vt + FW * cg, D, acc);
          for (int r = 0; r < 4; r++) {
            const fv dir = fv_set1(di[min64(i + r, nq - 1)]);
            for (int c = 0; c < FC; c++) {
              const fv pr = fv_load(p + (i + r) * FB + FW * (cg + c));
              fv_store(ds + (i + r) * FB + FW * (cg + c), fv_mul(pr, fv_sub(acc[r][c], dir)));
            }
          }
        }
      }
      for (int64_t d0 = 0; d0 < D; d0 += 4) {
        f_sum_rows(dvt + d0 * FB, dorow0 + d0, qstride, nq, p, NULL);  /* dV^T += dO^T P  */
        f_sum_rows(dkt + d0 * FB, qrow0 + d0, qstride, nq, ds, NULL); /* dK^T += Q^T dS */
      }
      if (with_dq) f_dq_rows(g->dq + q_at(a, b, t0, h), qstride, nq, ds, krow0, kvstride, nk, D);
    }
  }
  f_unpack_transposed(dkt, NULL, g->scale, nk, D, g->dk + kv_at(a, b, k0, kvh), kvstride);
  f_unpack_transposed(dvt, NULL, 1.0f, nk, D, g->dv + kv_at(a, b, k0, kvh), kvstride);
}

/* Pass 2: dQ of query block qb of head h. Queries in lanes, as in the
 * forward: qt/dot are Q and dO turned, pt/dst are P and dS turned (key
 * rows), dqt accumulates dQ turned. */
static void f_bwd_q_block(const f_args *g, int64_t b, int64_t h, int64_t qb) {
  const att_dims *a = &g->a;
  const int64_t D = a->D, t0 = qb * FB, nq = min64(FB, a->T - t0), kvh = h / a->group;
  const int64_t qstride = a->Hq * D, kvstride = a->Hkv * D;
  _Alignas(64) float qt[ATT_DMAX * FB], dot[ATT_DMAX * FB], dqt[ATT_DMAX * FB];
  _Alignas(64) float pt[FB * FB], dst[FB * FB], lse2[FB], di[FB];
  const fv cv = fv_set1(g->c);
  fv l2[FV], dv[FV];

  f_pack_transposed(g->q + q_at(a, b, t0, h), qstride, nq, D, 1.0f, qt);
  f_pack_transposed(g->dout + q_at(a, b, t0, h), qstride, nq, D, 1.0f, dot);
  memset(dqt, 0, sizeof(float) * (size_t)(D * FB));
  f_block_stats(g, b, h, t0, nq, lse2, di);
  for (int c = 0; c < FV; c++) {
    l2[c] = fv_load(lse2 + FW * c);
    dv[c] = fv_load(di + FW * c);
  }
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += FB) {
    const int64_t nk = min64(FB, a->S - k0);
    const int masked = nk < FB || (a->causal && k0 + FB - 1 > t0 + a->off);
    const float *krow0 = g->k + kv_at(a, b, k0, kvh), *vrow0 = g->v + kv_at(a, b, k0, kvh);
    for (int64_t j = 0; j < nk; j += 4) {
      const float *rows[4];
      for (int64_t r = j; r < j + 4 && k0 + FB + r < kend; r++) {
        f_prefetch_row(krow0 + (FB + r) * kvstride, D);
        f_prefetch_row(vrow0 + (FB + r) * kvstride, D);
      }
      for (int r = 0; r < 4; r++) rows[r] = krow0 + min64(j + r, nk - 1) * kvstride;
      for (int cg = 0; cg < FV; cg += FC) {
        fv acc[4][FC];
        f_rows_x_tile(rows, qt + FW * cg, D, acc);
        for (int r = 0; r < 4; r++) {
          const int64_t thr = j + r >= nk ? FB : a->causal ? k0 + j + r - t0 - a->off : 0;
          const fvi vthr = fv_seti(f_clamp_lane(thr));
          for (int c = 0; c < FC; c++) {
            fv x = fv_exp2(fv_fmsub(acc[r][c], cv, l2[cg + c]));
            if (masked) x = fv_keep_ge0(x, fv_iota(cg + c), vthr);
            fv_store(pt + (j + r) * FB + FW * (cg + c), x);
          }
        }
      }
      for (int r = 0; r < 4; r++) rows[r] = vrow0 + min64(j + r, nk - 1) * kvstride;
      for (int cg = 0; cg < FV; cg += FC) {
        fv acc[4][FC];
        f_rows_x_tile(rows, dot + FW * cg, D, acc);
        for (int r = 0; r < 4; r++)
          for (int c = 0; c < FC; c++) {
            const fv pr = fv_load(pt + (j + r) * FB + FW * (cg + c));
            fv_store(dst + (j + r) * FB + FW * (cg + c), fv_mul(pr, fv_sub(acc[r][c], dv[cg + c])));
          }
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 4) f_sum_rows(dqt + d0 * FB, krow0 + d0, kvstride, nk, dst, NULL);
  }
  f_unpack_transposed(dqt, NULL, g->scale, nq, D, g->dq + q_at(a, b, t0, h), qstride);
}

static void f_forward(const f_args *g) {
  const att_dims *a = &g->a;
  const int64_t nqb = (a->T + FB - 1) / FB, bh = a->B * a->Hq;
  /* Head by head, so the threads share that head's K and V in cache; later
   * query blocks see more keys (causal), so they go out first. */
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t it = 0; it < nqb * bh; it++) f_fwd_block(g, it / nqb / a->Hq, it / nqb % a->Hq, nqb - 1 - it % nqb);
}

static void f_backward(const f_args *g) {
  const att_dims *a = &g->a;
  const int64_t nqb = (a->T + FB - 1) / FB, nkb = (a->S + FB - 1) / FB;
  const int64_t bh = a->B * a->Hq, bkv = a->B * a->Hkv;
  const int64_t nt = omp_get_max_threads(), rounds = (bkv + nt - 1) / nt;
  /* Fused when the (batch, kv head) groups fill the threads at >= 80%: it
   * saves pass 2's recomputation (2 of 7 matmuls and half of the exps). */
  if (5 * bkv >= 4 * rounds * nt) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < bkv; it++) {
      const int64_t b = it / a->Hkv, kvh = it % a->Hkv;
      for (int64_t t = 0; t < a->T; t++)
        memset(g->dq + q_at(a, b, t, kvh * a->group), 0, sizeof(float) * (size_t)(a->group * a->D));
      for (int64_t kb = 0; kb < nkb; kb++) f_bwd_kv_block(g, b, kvh, kb, 1);
      for (int64_t t = 0; t < a->T; t++) {
        float *r = g->dq + q_at(a, b, t, kvh * a->group);
        for (int64_t e = 0; e < a->group * a->D; e++) r[e] *= g->scale;
      }
    }
    return;
  }
  /* The passes write disjoint outputs, so threads run on into pass 2. */
#pragma omp parallel
  {
    /* Early key blocks are seen by more queries (causal): first out. */
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t it = 0; it < nkb * bkv; it++) f_bwd_kv_block(g, (it % bkv) / a->Hkv, it % a->Hkv, it / bkv, 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < nqb * bh; it++) f_bwd_q_block(g, it / nqb / a->Hq, it / nqb % a->Hq, nqb - 1 - it % nqb);
  }
}

#endif /* ATT_FAST */

/* ======================================================================== */

static int use_fast_path(int dtype, int64_t D) {
#if defined(ATT_FAST)
  return dtype == TT_F32 && D > 0 && D % FW == 0 && D <= ATT_DMAX;
#else
  (void)dtype;
  (void)D;
  return 0;
#endif
}

tt_status tt_cpu_attention(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                           int causal, double scale, const void *q, const void *k, const void *v, void *o, void *lse) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (D > ATT_DMAX) return TT_ERR_SHAPE;
  if (B <= 0 || T <= 0 || Hq <= 0 || Hkv <= 0) return TT_OK;
  const att_dims a = {B, T, S, Hq, Hkv, D, Hq / Hkv, S - T, causal != 0, scale};
  if (use_fast_path(dtype, D)) {
#if defined(ATT_FAST)
    const f_args g = {a, q, k, v, NULL, NULL, NULL, o, lse, NULL, NULL, NULL,
                      (float)(scale * ATT_LOG2E), (float)scale};
    f_forward(&g);
#endif
  } else {
    g_forward(&a, dtype, q, k, v, o, lse);
  }
  return TT_OK;
}

tt_status tt_cpu_attention_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                    int causal, double scale, const void *q, const void *k, const void *v,
                                    const void *o, const void *lse, const void *dout, void *dq, void *dk, void *dv) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (D > ATT_DMAX) return TT_ERR_SHAPE;
  if (B <= 0 || Hq <= 0 || Hkv <= 0) return TT_OK;
  const att_dims a = {B, T, S, Hq, Hkv, D, Hq / Hkv, S - T, causal != 0, scale};
  if (use_fast_path(dtype, D)) {
#if defined(ATT_FAST)
    const f_args g = {a, q, k, v, o, lse, dout, NULL, NULL, dq, dk, dv, (float)(scale * ATT_LOG2E), (float)scale};
    f_backward(&g);
#endif
  } else {
    g_backward(&a, dtype, q, k, v, o, lse, dout, dq, dk, dv);
  }
  return TT_OK;
}

/* ======================================================================== */
/* Ring attention's merge (context parallelism: lua/parallel/cp.lua).        */
/* ======================================================================== */

/* The weights come from the two log-sum-exps about their larger one, so
 * neither exponential overflows; log1p keeps the new lse exact when one
 * block dominates. */
tt_status tt_cpu_attention_merge(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                                 void *acc, void *acc_lse, const void *out, const void *lse) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  const int st = dtype; /* the accumulator's dtype: the stat dtype, f32 for f32 */
#pragma omp parallel for schedule(static)
  for (int64_t bi = 0; bi < B * Tb; bi++) {
    const int64_t b = bi / Tb, i = bi % Tb, t = t0 + i;
    for (int64_t h = 0; h < H; h++) {
      const int64_t la_at = (b * H + h) * T + t;
      const double la = g_ld(st, acc_lse, la_at), lb = g_ld(dtype, lse, (b * H + h) * Tb + i);
      if (lb == -INFINITY) continue;
      const int64_t a0 = ((b * T + t) * H + h) * D, o0 = ((b * Tb + i) * H + h) * D;
      if (la == -INFINITY) {
        for (int64_t d = 0; d < D; d++) g_st(st, acc, a0 + d, g_ld(dtype, out, o0 + d));
        g_st(st, acc_lse, la_at, lb);
        continue;
      }
      const double m = la > lb ? la : lb, nl = m + log1p(exp(-fabs(la - lb)));
      const double wa = exp(la - nl), wb = exp(lb - nl);
      for (int64_t d = 0; d < D; d++) g_st(st, acc, a0 + d, wa * g_ld(st, acc, a0 + d) + wb * g_ld(dtype, out, o0 + d));
      g_st(st, acc_lse, la_at, nl);
    }
  }
  return TT_OK;
}
