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
 *  - f32 with AVX-512 (F and DQ) and head_dim a multiple of 16: the fast
 *    path. Tiles put 16 queries (or keys) in the lanes of a vector, so the
 *    softmax bookkeeping is plain vertical vector math with no horizontal
 *    reductions, and every matmul is a 4x4 block of vector accumulators fed
 *    by broadcasts (register blocking: each loaded vector serves 4 FMAs).
 *    The forward and pass 2 put queries in lanes (Q is turned once per
 *    block, K and V rows are read in place); pass 1 puts keys in lanes (K
 *    and V turned once per key block, Q and dO rows read in place). exp is
 *    a degree-5 polynomial in base 2 (scores are pre-multiplied by
 *    log2(e)), accurate to ~1e-7. Rows of one head are Hq*D floats apart,
 *    which the hardware prefetchers follow badly, so each tile prefetches
 *    the rows the next tile will read.
 *  - everything else (f64 for gradient checks, odd head dims, builds
 *    without AVX-512): the same tiling on double tiles with libm exp, clear
 *    rather than fast. It always uses the two-pass backward.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu.h"

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define ATT_AVX512 1
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
/* Generic path: double tiles, scalar exp. f64, odd head dims, no AVX-512.   */
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
/* Fast path: f32, AVX-512, head_dim a multiple of 16.                       */
/* ======================================================================== */
#if defined(ATT_AVX512)

#define FB 64 /* queries and keys per tile */
#define FV 4  /* 16-float vectors per tile row */
#define F_INLINE static inline __attribute__((always_inline))

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

/* 2^x for x <= ~0. x = floor(x) + f with f in [0, 1) (vreduceps); 2^f from
 * a degree-5 minimax polynomial with p(0) = 1 exactly, so a running maximum
 * that does not move rescales by exactly 1 (relative error 8.2e-8); then
 * vscalefps multiplies by 2^floor(x) itself, flushing to 0 for very negative
 * x. Seven vector operations. NaN for x = +inf (always masked off later). */
F_INLINE __m512 f_exp2(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(0.0018671300699122932f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009017030322326125f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05579991310386636f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24016445015503726f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931513118046069f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, x);
}

/* Lane numbers 16c .. 16c+15 of tile column vector c. */
F_INLINE __m512i f_iota(int c) {
  return _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                          _mm512_set1_epi32(16 * c));
}
F_INLINE int32_t f_clamp_lane(int64_t x) { return (int32_t)(x < -1 ? -1 : x > FB ? FB : x); }

/* Asks for the D floats of a row that the next tile will read (see the
 * header: strided rows defeat the hardware prefetchers). */
F_INLINE void f_prefetch_row(const float *row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(row + d), _MM_HINT_T0);
}

/* Matmul core 1 — four rows times a transposed tile:
 *   acc[r][c] = sum_d rows[r][d] * tile[d][16c .. 16c+15].
 * Row values are broadcast; the tile (D x 64, lanes along its rows) is
 * loaded once per d for all four rows. Every element is a plain FMA chain
 * over d in increasing order. */
F_INLINE void f_rows_x_tile(const float *const rows[4], const float *tile, int64_t D, __m512 acc[4][FV]) {
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < FV; c++) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    __m512 t[FV];
    for (int c = 0; c < FV; c++) t[c] = _mm512_load_ps(tile + d * FB + 16 * c);
    for (int r = 0; r < 4; r++) {
      const __m512 x = _mm512_set1_ps(rows[r][d]);
      for (int c = 0; c < FV; c++) acc[r][c] = _mm512_fmadd_ps(x, t[c], acc[r][c]);
    }
  }
}

/* Matmul core 2 — a sum over n rows into four rows of a transposed tile:
 *   out[r][16c ..] (= out * pre[c]) += sum_{j<n} row_j[r] * tile[j][16c ..]
 * where row_j = row + j * stride. Each element is an FMA chain over j in
 * increasing order, starting from its value in `out`. */
F_INLINE void f_sum_rows(float *out, const float *row, int64_t stride, int64_t n, const float *tile,
                         const __m512 *pre) {
  __m512 acc[4][FV];
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < FV; c++) {
      acc[r][c] = _mm512_load_ps(out + r * FB + 16 * c);
      if (pre) acc[r][c] = _mm512_mul_ps(acc[r][c], pre[c]);
    }
  for (int64_t j = 0; j < n; j++, row += stride) {
    __m512 t[FV];
    for (int c = 0; c < FV; c++) t[c] = _mm512_load_ps(tile + j * FB + 16 * c);
    for (int r = 0; r < 4; r++) {
      const __m512 x = _mm512_set1_ps(row[r]);
      for (int c = 0; c < FV; c++) acc[r][c] = _mm512_fmadd_ps(x, t[c], acc[r][c]);
    }
  }
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < FV; c++) _mm512_store_ps(out + r * FB + 16 * c, acc[r][c]);
}

/* Matmul core 3 — dq rows += dS K, for pass 1 of the fused schedule:
 *   dq[i][16c ..] += sum_{j<nk} ds[i][j] * k_j[16c ..]
 * for NI rows (nvalid of them real) and NV vectors of head dim. Same FMA
 * chain per element as core 2 computes for dq^T in pass 2. */
F_INLINE void f_dq_tile(float *dq, int64_t qstride, int64_t nvalid, const float *ds, const float *k, int64_t kvstride,
                        int64_t nk, const int NI, const int NV) {
  __m512 acc[16][4];
  const float *dsr[16];
  for (int r = 0; r < NI; r++) {
    const int64_t rr = min64(r, nvalid - 1);
    dsr[r] = ds + rr * FB;
    for (int c = 0; c < NV; c++) acc[r][c] = _mm512_loadu_ps(dq + rr * qstride + 16 * c);
  }
  for (int64_t j = 0; j < nk; j++, k += kvstride) {
    __m512 t[4];
    for (int c = 0; c < NV; c++) t[c] = _mm512_loadu_ps(k + 16 * c);
    for (int r = 0; r < NI; r++) {
      const __m512 x = _mm512_set1_ps(dsr[r][j]);
      for (int c = 0; c < NV; c++) acc[r][c] = _mm512_fmadd_ps(x, t[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NI && r < nvalid; r++)
    for (int c = 0; c < NV; c++) _mm512_storeu_ps(dq + r * qstride + 16 * c, acc[r][c]);
}

static void f_dq_rows(float *dq, int64_t qstride, int64_t nq, const float *ds, const float *k, int64_t kvstride,
                      int64_t nk, int64_t D) {
  /* 16 accumulators per call whatever the head dim: 16 rows x 1 vector at
   * head_dim 16, 4 x 4 from 64 up. */
  for (int64_t c0 = 0; c0 < D / 16;) {
    const int64_t left = D / 16 - c0;
    for (int64_t i = 0; i < nq; i += left >= 4 ? 4 : left >= 2 ? 8 : 16) {
      float *dqi = dq + i * qstride + 16 * c0;
      const float *dsi = ds + i * FB, *kc = k + 16 * c0;
      if (left >= 4)
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, 4, 4);
      else if (left >= 2)
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, 8, 2);
      else
        f_dq_tile(dqi, qstride, nq - i, dsi, kc, kvstride, nk, 16, 1);
    }
    c0 += left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

/* Turns 16 vectors of 16 floats around: r[i] lane j <-> r[j] lane i. Three
 * rounds of shuffles (pairs of floats, quads, 128-bit lanes). */
F_INLINE void f_transpose16(__m512 r[16]) {
  __m512 t[16];
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

/* A block of n <= 64 rows (row i at src + i * stride) turned so rows lie in
 * lanes: tile[d][i] = mul * row_i[d], zero for the padding rows n .. 63. */
static void f_pack_transposed(const float *src, int64_t stride, int64_t n, int64_t D, float mul, float *tile) {
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t i0 = 0; i0 < FB; i0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; i++)
        r[i] = i0 + i < n ? _mm512_mul_ps(_mm512_loadu_ps(src + (i0 + i) * stride + d0), m) : _mm512_setzero_ps();
      f_transpose16(r);
      for (int64_t d = 0; d < 16; d++) _mm512_store_ps(tile + (d0 + d) * FB + i0, r[d]);
    }
}

/* The way back, for the first n rows: row_i[d] = tile[d][i] * mul * lane[i]
 * (lane may be NULL). */
static void f_unpack_transposed(const float *tile, const float *lane, float mul, int64_t n, int64_t D, float *dst,
                                int64_t stride) {
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t i0 = 0; i0 < n; i0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int64_t d = 0; d < 16; d++) {
        r[d] = _mm512_mul_ps(_mm512_load_ps(tile + (d0 + d) * FB + i0), m);
        if (lane) r[d] = _mm512_mul_ps(r[d], _mm512_load_ps(lane + i0));
      }
      f_transpose16(r);
      for (int64_t i = 0; i < 16 && i0 + i < n; i++) _mm512_storeu_ps(dst + (i0 + i) * stride + d0, r[i]);
    }
}

/* lse in base 2 and Di = rowsum(dO * O) for the 64 rows of a query block;
 * padding rows repeat the last real row. Both backward passes read their
 * statistics from here, so they agree to the bit. */
static void f_block_stats(const f_args *g, int64_t b, int64_t h, int64_t t0, int64_t nq, float *lse2, float *di) {
  const att_dims *a = &g->a;
  for (int64_t i = 0; i < FB; i++) {
    const int64_t t = t0 + min64(i, nq - 1), at = q_at(a, b, t, h);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < a->D; d += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(g->dout + at + d), _mm512_loadu_ps(g->o + at + d), acc);
    di[i] = _mm512_reduce_add_ps(acc);
    lse2[i] = g->lse[lse_at(a, b, h, t)] * (float)ATT_LOG2E;
  }
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
  const __m512 neg = _mm512_set1_ps(F_NEG);

  f_pack_transposed(g->q + q_at(a, b, t0, h), qstride, nq, D, g->c, qt);
  memset(ot, 0, sizeof(float) * (size_t)(D * FB));
  __m512 m[FV], l[FV];
  for (int c = 0; c < FV; c++) {
    m[c] = neg;
    l[c] = _mm512_setzero_ps();
  }
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += FB) {
    const int64_t nk = min64(FB, a->S - k0);
    const int masked = nk < FB || (a->causal && k0 + FB - 1 > t0 + a->off);
    __m512 mx[FV];
    for (int c = 0; c < FV; c++) mx[c] = m[c];
    for (int64_t j = 0; j < nk; j += 4) {
      const float *rows[4];
      __m512 acc[4][FV];
      for (int r = 0; r < 4; r++) rows[r] = kbase + min64(k0 + j + r, k0 + nk - 1) * kvstride;
      f_rows_x_tile(rows, qt, D, acc);
      for (int r = 0; r < 4; r++) {
        /* key k0+j+r is visible to the queries (lanes) i >= thr */
        const int64_t thr = j + r >= nk ? FB : a->causal ? k0 + j + r - t0 - a->off : 0;
        const __m512i vthr = _mm512_set1_epi32(f_clamp_lane(thr));
        for (int c = 0; c < FV; c++) {
          __m512 x = acc[r][c];
          if (masked) x = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(f_iota(c), vthr), neg, x);
          _mm512_store_ps(st + (j + r) * FB + 16 * c, x);
          mx[c] = _mm512_max_ps(mx[c], x);
        }
      }
    }
    __m512 alpha[FV], sum[FV];
    for (int c = 0; c < FV; c++) {
      alpha[c] = f_exp2(_mm512_sub_ps(m[c], mx[c]));
      m[c] = mx[c];
      sum[c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < nk; j++) {
      if (k0 + FB + j < kend) {
        f_prefetch_row(kbase + (k0 + FB + j) * kvstride, D);
        f_prefetch_row(vbase + (k0 + FB + j) * kvstride, D);
      }
      for (int c = 0; c < FV; c++) {
        const __m512 p = f_exp2(_mm512_sub_ps(_mm512_load_ps(st + j * FB + 16 * c), m[c]));
        _mm512_store_ps(st + j * FB + 16 * c, p);
        sum[c] = _mm512_add_ps(sum[c], p);
      }
    }
    for (int c = 0; c < FV; c++) l[c] = _mm512_fmadd_ps(l[c], alpha[c], sum[c]);
    for (int64_t d0 = 0; d0 < D; d0 += 4) f_sum_rows(ot + d0 * FB, vbase + k0 * kvstride + d0, kvstride, nk, st, alpha);
  }
  for (int c = 0; c < FV; c++) {
    _mm512_store_ps(mf + 16 * c, m[c]);
    _mm512_store_ps(lf + 16 * c, l[c]);
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
  const __m512 cv = _mm512_set1_ps(g->c);

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
        __m512 acc[4][FV];
        for (int64_t r = i; r < i + 4 && t0 + FB + r < a->T; r++) {
          const int64_t at = q_at(a, b, t0 + FB + r, h);
          f_prefetch_row(g->q + at, D);
          f_prefetch_row(g->dout + at, D);
          f_prefetch_row(g->o + at, D);
          if (with_dq) f_prefetch_row(g->dq + at, D);
        }
        /* P = exp2(c * q.k - lse2), 0 where masked (and in lanes >= nk). */
        for (int r = 0; r < 4; r++) rows[r] = qrow0 + min64(i + r, nq - 1) * qstride;
        f_rows_x_tile(rows, kt, D, acc);
        for (int r = 0; r < 4; r++) {
          const int64_t ii = min64(i + r, nq - 1);
          const __m512 l2 = _mm512_set1_ps(lse2[ii]);
          /* query t0+ii sees the keys (lanes) j <= lim */
          const int64_t lim = a->causal ? min64(nk - 1, t0 + ii + a->off - k0) : nk - 1;
          const __m512i vlim = _mm512_set1_epi32(f_clamp_lane(lim));
          for (int c = 0; c < FV; c++) {
            __m512 x = f_exp2(_mm512_fmsub_ps(acc[r][c], cv, l2));
            if (masked) x = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(f_iota(c), vlim), x);
            _mm512_store_ps(p + (i + r) * FB + 16 * c, x);
          }
        }
        /* dS = P * (dO.v - Di) */
        for (int r = 0; r < 4; r++) rows[r] = dorow0 + min64(i + r, nq - 1) * qstride;
        f_rows_x_tile(rows, vt, D, acc);
        for (int r = 0; r < 4; r++) {
          const __m512 dir = _mm512_set1_ps(di[min64(i + r, nq - 1)]);
          for (int c = 0; c < FV; c++) {
            const __m512 pr = _mm512_load_ps(p + (i + r) * FB + 16 * c);
            _mm512_store_ps(ds + (i + r) * FB + 16 * c, _mm512_mul_ps(pr, _mm512_sub_ps(acc[r][c], dir)));
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
  const __m512 cv = _mm512_set1_ps(g->c);
  __m512 l2[FV], dv[FV];

  f_pack_transposed(g->q + q_at(a, b, t0, h), qstride, nq, D, 1.0f, qt);
  f_pack_transposed(g->dout + q_at(a, b, t0, h), qstride, nq, D, 1.0f, dot);
  memset(dqt, 0, sizeof(float) * (size_t)(D * FB));
  f_block_stats(g, b, h, t0, nq, lse2, di);
  for (int c = 0; c < FV; c++) {
    l2[c] = _mm512_load_ps(lse2 + 16 * c);
    dv[c] = _mm512_load_ps(di + 16 * c);
  }
  const int64_t kend = key_end(a, t0 + nq - 1);
  for (int64_t k0 = 0; k0 < kend; k0 += FB) {
    const int64_t nk = min64(FB, a->S - k0);
    const int masked = nk < FB || (a->causal && k0 + FB - 1 > t0 + a->off);
    const float *krow0 = g->k + kv_at(a, b, k0, kvh), *vrow0 = g->v + kv_at(a, b, k0, kvh);
    for (int64_t j = 0; j < nk; j += 4) {
      const float *rows[4];
      __m512 acc[4][FV];
      for (int64_t r = j; r < j + 4 && k0 + FB + r < kend; r++) {
        f_prefetch_row(krow0 + (FB + r) * kvstride, D);
        f_prefetch_row(vrow0 + (FB + r) * kvstride, D);
      }
      for (int r = 0; r < 4; r++) rows[r] = krow0 + min64(j + r, nk - 1) * kvstride;
      f_rows_x_tile(rows, qt, D, acc);
      for (int r = 0; r < 4; r++) {
        const int64_t thr = j + r >= nk ? FB : a->causal ? k0 + j + r - t0 - a->off : 0;
        const __m512i vthr = _mm512_set1_epi32(f_clamp_lane(thr));
        for (int c = 0; c < FV; c++) {
          __m512 x = f_exp2(_mm512_fmsub_ps(acc[r][c], cv, l2[c]));
          if (masked) x = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(f_iota(c), vthr), x);
          _mm512_store_ps(pt + (j + r) * FB + 16 * c, x);
        }
      }
      for (int r = 0; r < 4; r++) rows[r] = vrow0 + min64(j + r, nk - 1) * kvstride;
      f_rows_x_tile(rows, dot, D, acc);
      for (int r = 0; r < 4; r++)
        for (int c = 0; c < FV; c++) {
          const __m512 pr = _mm512_load_ps(pt + (j + r) * FB + 16 * c);
          _mm512_store_ps(dst + (j + r) * FB + 16 * c, _mm512_mul_ps(pr, _mm512_sub_ps(acc[r][c], dv[c])));
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

#endif /* ATT_AVX512 */

/* ======================================================================== */

static int use_fast_path(int dtype, int64_t D) {
#if defined(ATT_AVX512)
  return dtype == TT_F32 && D > 0 && D % 16 == 0 && D <= ATT_DMAX;
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
#if defined(ATT_AVX512)
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
#if defined(ATT_AVX512)
    const f_args g = {a, q, k, v, o, lse, dout, NULL, NULL, dq, dk, dv, (float)(scale * ATT_LOG2E), (float)scale};
    f_backward(&g);
#endif
  } else {
    g_backward(&a, dtype, q, k, v, o, lse, dout, dq, dk, dv);
  }
  return TT_OK;
}
