/*
 * reduce.c — reductions over the middle dim of a contiguous [outer, n, inner]
 * (sum, mean, max with first-max index, L2 norm), sum_to (the gradient of
 * broadcasting), softmax / log-softmax and their backward, and the sum of
 * squares behind the global gradient norm.
 *
 * Determinism: every sum has one order that depends on the shape alone,
 * never on the thread count. A reduced dim of length n is cut by
 * block_plan(n) into at most RED_MAX_BLOCKS blocks of one size; each block
 * is summed on its own (16 fixed lanes when contiguous, sequentially per
 * column otherwise) and the block sums are added in block order. The serial
 * path (threads over outputs) and the parallel-over-n path (threads over
 * blocks, partials in a stack array) compute the same blocks in the same
 * way, so which path runs, and on how many threads, never changes a bit.
 * (Rows shorter than LANES are summed sequentially: also a choice made by
 * the shape alone.) f32 input is summed in double.
 */

/* The arithmetic is exactly what is written: the build passes
 * -ffp-contract=off (no a*b+c turned into an fma). With contraction the vector body and the scalar tail of one loop may
 * round differently, and then a column's bits would depend on where a
 * thread's tile happened to start. */
#if defined(__clang__)
/* clang will not vectorize the NaN-aware max loops marked `omp simd` and
 * says so as a warning; they are correct scalar loops there. */
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"
#include "../dtype_conv.h"
#include "vmath.h"

/* Generic helpers take the dtype as an argument and are always inlined into
 * callers that pass a constant, so each dtype gets its own vectorized loop. */
#define TT_INLINE static inline __attribute__((always_inline))

enum {
  LANES = 16,           /* independent accumulators of a contiguous sum: 4 AVX-512 / 8 AVX registers */
  RED_MAX_BLOCKS = 256, /* most partials one reduced dim is cut into */
  RED_MIN_BLOCK = 8192, /* smallest block worth a task of its own */
  SMALL_OUT = 16,       /* up to this many outputs, threads split n instead of the outputs */
  COL_TILE = 256,       /* most columns one task accumulates (stack arrays) */
  PAR_MIN = 1 << 15     /* elements below which a parallel region costs more than it saves */
};

static int max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The blocks of a reduced dim of length n: a function of n alone. Block
 * sizes are whole multiples of 64 elements (of cache lines, in a row). */
static void block_plan(int64_t n, int64_t *nblk, int64_t *bs) {
  int64_t nb = (n + RED_MIN_BLOCK - 1) / RED_MIN_BLOCK;
  if (nb < 1) nb = 1;
  if (nb > RED_MAX_BLOCKS) nb = RED_MAX_BLOCKS;
  int64_t b = (n + nb - 1) / nb;
  b = (b + 63) / 64 * 64;
  if (b < 64) b = 64;
  nb = (n + b - 1) / b;
  *nblk = nb < 1 ? 1 : nb;
  *bs = b;
}

TT_INLINE double ld(const void *x, int dt, int64_t i) {
  switch (dt) {
  case TT_F64: return ((const double *)x)[i];
  case TT_BF16: return (double)tt_bf16_to_f32(((const uint16_t *)x)[i]);
  case TT_F16: return (double)tt_f16_to_f32(((const uint16_t *)x)[i]);
  default: return (double)((const float *)x)[i];
  }
}

TT_INLINE void st(void *y, int dt, int64_t i, double v) {
  if (dt == TT_F64) ((double *)y)[i] = v;
  else ((float *)y)[i] = (float)v;
}

/* Max that propagates NaN (the first NaN wins) and keeps the first of equal
 * maxima, as torch.max does. */
TT_INLINE int max_takes(double v, double best) { return v > best || (v != v && best == best); }

/* ---- contiguous blocks ------------------------------------------------ */

/* Sum (or sum of squares) of x[lo, hi) in LANES fixed lanes folded by a
 * fixed tree: vectorizes without -ffast-math and the order is the same on
 * every machine, whatever its vector width. */
TT_INLINE double lanes_sum(const void *x, int dt, int sq, int64_t lo, int64_t hi) {
  double acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 0.0;
  int64_t i = lo;
  for (; i + LANES <= hi; i += LANES)
    for (int l = 0; l < LANES; l++) {
      double v = ld(x, dt, i + l);
      acc[l] += sq ? v * v : v;
    }
  for (int l = 0; i + l < hi; l++) {
    double v = ld(x, dt, i + l);
    acc[l] += sq ? v * v : v;
  }
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

static double block_sum(const void *x, int dt, int sq, int64_t lo, int64_t hi) {
  switch (dt) {
  case TT_F64: return sq ? lanes_sum(x, TT_F64, 1, lo, hi) : lanes_sum(x, TT_F64, 0, lo, hi);
  case TT_BF16: return sq ? lanes_sum(x, TT_BF16, 1, lo, hi) : lanes_sum(x, TT_BF16, 0, lo, hi);
  case TT_F16: return sq ? lanes_sum(x, TT_F16, 1, lo, hi) : lanes_sum(x, TT_F16, 0, lo, hi);
  default: return sq ? lanes_sum(x, TT_F32, 1, lo, hi) : lanes_sum(x, TT_F32, 0, lo, hi);
  }
}

/* First max of x[lo, hi) (the first NaN if there is one). Pass 1 finds
 * the largest value and counts NaNs; max is exact, so its order does not
 * matter and `omp simd` may vectorize it freely. Pass 2 finds the first
 * position holding it, and the value reported is the one stored there (so
 * a -0/+0 tie reports the first zero, as a sequential scan would). */
TT_INLINE void scan_max(const void *x, int dt, int64_t lo, int64_t hi, double *best, int64_t *at) {
  double m = -INFINITY;
  int64_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
  for (int64_t i = lo; i < hi; i++) {
    double v = ld(x, dt, i);
    m = v > m ? v : m;
    nans += v != v;
  }
  int64_t a = lo;
  if (nans) {
    while (a < hi && ld(x, dt, a) == ld(x, dt, a)) a++;
  } else if (m != -INFINITY) {
    while (a < hi && ld(x, dt, a) != m) a++;
  }
  *best = a < hi ? ld(x, dt, a) : -INFINITY;
  *at = a < hi ? a : lo;
}

static void block_max(const void *x, int dt, int64_t lo, int64_t hi, double *best, int64_t *at) {
  if (dt == TT_F64) scan_max(x, TT_F64, lo, hi, best, at);
  else scan_max(x, TT_F32, lo, hi, best, at);
}

/* ---- strided blocks: columns c0..c0+w of rows j in [lo, hi) ------------ */

TT_INLINE void cols_sum(const void *x, int dt, int sq, int64_t base, int64_t inner, int64_t lo, int64_t hi,
                        int64_t w, double *acc) {
  for (int64_t c = 0; c < w; c++) acc[c] = 0.0;
  for (int64_t j = lo; j < hi; j++) {
    int64_t row = base + j * inner;
    for (int64_t c = 0; c < w; c++) {
      double v = ld(x, dt, row + c);
      acc[c] += sq ? v * v : v;
    }
  }
}

static void col_block_sum(const void *x, int dt, int sq, int64_t base, int64_t inner, int64_t lo, int64_t hi,
                          int64_t w, double *acc) {
  if (dt == TT_F64) {
    if (sq) cols_sum(x, TT_F64, 1, base, inner, lo, hi, w, acc);
    else cols_sum(x, TT_F64, 0, base, inner, lo, hi, w, acc);
  } else {
    if (sq) cols_sum(x, TT_F32, 1, base, inner, lo, hi, w, acc);
    else cols_sum(x, TT_F32, 0, base, inner, lo, hi, w, acc);
  }
}

TT_INLINE void cols_max(const void *x, int dt, int64_t base, int64_t inner, int64_t lo, int64_t hi, int64_t w,
                        double *best, int64_t *at) {
  for (int64_t c = 0; c < w; c++) {
    best[c] = -INFINITY;
    at[c] = lo;
  }
  for (int64_t j = lo; j < hi; j++) {
    int64_t row = base + j * inner;
    for (int64_t c = 0; c < w; c++) {
      double v = ld(x, dt, row + c);
      if (max_takes(v, best[c])) {
        best[c] = v;
        at[c] = j;
      }
    }
  }
}

static void col_block_max(const void *x, int dt, int64_t base, int64_t inner, int64_t lo, int64_t hi, int64_t w,
                          double *best, int64_t *at) {
  if (dt == TT_F64) cols_max(x, TT_F64, base, inner, lo, hi, w, best, at);
  else cols_max(x, TT_F32, base, inner, lo, hi, w, best, at);
}

/* ---- combining partials (the one place block results meet) ------------ */

/* Folds nblk partials (stride apart) into one output in block order:
 * a sum starts at 0 and adds each block; max keeps the first winner. */
static void combine(int op, int dt, int64_t n, int64_t nblk, const double *part, const int64_t *pat, int64_t stride,
                    void *y, int64_t k, int64_t *idx) {
  if (op == TT_RMAX) {
    double b = -INFINITY;
    int64_t a = 0;
    for (int64_t i = 0; i < nblk; i++)
      if (max_takes(part[i * stride], b)) {
        b = part[i * stride];
        a = pat[i * stride];
      }
    st(y, dt, k, b);
    if (idx) idx[k] = a;
    return;
  }
  double s = 0.0;
  for (int64_t i = 0; i < nblk; i++) s += part[i * stride];
  if (op == TT_RMEAN) s /= (double)n; /* n == 0 gives NaN, as torch.mean does */
  else if (op == TT_RNORM2) s = sqrt(s);
  st(y, dt, k, s);
}

/* Short rows (n < LANES), sequentially: per-row overhead is what counts. */
TT_INLINE void short_rows(int dt, int op, int64_t rows, int64_t n, const void *x, void *y, int64_t *idx) {
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    if (op == TT_RMAX) {
      double b = -INFINITY;
      int64_t a = 0;
      for (int64_t j = 0; j < n; j++) {
        double v = ld(x, dt, r * n + j);
        if (max_takes(v, b)) {
          b = v;
          a = j;
        }
      }
      st(y, dt, r, b);
      if (idx) idx[r] = a;
      continue;
    }
    double s = 0.0;
    for (int64_t j = 0; j < n; j++) {
      double v = ld(x, dt, r * n + j);
      s += op == TT_RNORM2 ? v * v : v;
    }
    if (op == TT_RMEAN) s /= (double)n;
    else if (op == TT_RNORM2) s = sqrt(s);
    st(y, dt, r, s);
  }
}

/* inner == 1: each output is a contiguous row of length n. */
static void reduce_rows(int op, int dt, int64_t rows, int64_t n, const void *x, void *y, int64_t *idx) {
  int64_t nblk, bs;
  block_plan(n, &nblk, &bs);
  int sq = op == TT_RNORM2;
  if (n < LANES) {
    switch (op + 4 * (dt == TT_F64)) {
    case TT_RSUM: short_rows(TT_F32, TT_RSUM, rows, n, x, y, idx); break;
    case TT_RMEAN: short_rows(TT_F32, TT_RMEAN, rows, n, x, y, idx); break;
    case TT_RMAX: short_rows(TT_F32, TT_RMAX, rows, n, x, y, idx); break;
    case TT_RNORM2: short_rows(TT_F32, TT_RNORM2, rows, n, x, y, idx); break;
    case 4 + TT_RSUM: short_rows(TT_F64, TT_RSUM, rows, n, x, y, idx); break;
    case 4 + TT_RMEAN: short_rows(TT_F64, TT_RMEAN, rows, n, x, y, idx); break;
    case 4 + TT_RMAX: short_rows(TT_F64, TT_RMAX, rows, n, x, y, idx); break;
    default: short_rows(TT_F64, TT_RNORM2, rows, n, x, y, idx); break;
    }
    return;
  }
  if (rows <= SMALL_OUT && nblk > 1) {
    /* Few long rows: threads split each row's blocks. */
    double part[SMALL_OUT * RED_MAX_BLOCKS];
    int64_t pat[SMALL_OUT * RED_MAX_BLOCKS];
    int64_t ntask = rows * nblk;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t t = 0; t < ntask; t++) {
      int64_t r = t / nblk, b = t % nblk;
      int64_t lo = r * n + b * bs, hi = r * n + min64((b + 1) * bs, n);
      if (op == TT_RMAX) {
        block_max(x, dt, lo, hi, &part[t], &pat[t]);
        pat[t] -= r * n;
      } else {
        part[t] = block_sum(x, dt, sq, lo, hi);
      }
    }
    for (int64_t r = 0; r < rows; r++) combine(op, dt, n, nblk, part + r * nblk, pat + r * nblk, 1, y, r, idx);
    return;
  }
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    double part[RED_MAX_BLOCKS];
    int64_t pat[RED_MAX_BLOCKS];
    pat[0] = 0; /* written and read for max only; gcc 13 cannot see that and warns (-Werror) */
    for (int64_t b = 0; b < nblk; b++) {
      int64_t lo = r * n + b * bs, hi = r * n + min64((b + 1) * bs, n);
      if (op == TT_RMAX) {
        block_max(x, dt, lo, hi, &part[b], &pat[b]);
        pat[b] -= r * n;
      } else {
        part[b] = block_sum(x, dt, sq, lo, hi);
      }
    }
    combine(op, dt, n, nblk, part, pat, 1, y, r, idx);
  }
}

/* Column tile width for `ntask_outer` independent slabs of `cols` columns:
 * enough tasks for every thread, tiles of at least 16 columns (a few
 * vectors). Results never depend on it: columns are independent. */
static int64_t col_tile(int64_t ntask_outer, int64_t cols) {
  int64_t want = 4 * (int64_t)max_threads();
  int64_t tiles = ntask_outer >= want ? 1 : (want + ntask_outer - 1) / ntask_outer;
  int64_t w = (cols + tiles - 1) / tiles;
  w = (w + 15) / 16 * 16;
  if (w > COL_TILE) w = COL_TILE;
  if (w > cols) w = cols;
  return w < 1 ? 1 : w;
}

/* inner > 1: each output column sums a strided column of x. */
static void reduce_cols(int op, int dt, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                        int64_t *idx) {
  int64_t nblk, bs;
  block_plan(n, &nblk, &bs);
  int sq = op == TT_RNORM2;
  int64_t total = outer * n * inner;
  if (outer * inner <= SMALL_OUT && nblk > 1) {
    /* A handful of long columns: threads split the blocks of n; partial
     * (o, b, c) lives at ((o * nblk) + b) * inner + c. */
    double part[SMALL_OUT * RED_MAX_BLOCKS];
    int64_t pat[SMALL_OUT * RED_MAX_BLOCKS];
    int64_t ntask = outer * nblk;
#pragma omp parallel for schedule(static) if (total >= PAR_MIN)
    for (int64_t t = 0; t < ntask; t++) {
      int64_t o = t / nblk, b = t % nblk;
      int64_t lo = b * bs, hi = min64((b + 1) * bs, n);
      if (op == TT_RMAX) col_block_max(x, dt, o * n * inner, inner, lo, hi, inner, part + t * inner, pat + t * inner);
      else col_block_sum(x, dt, sq, o * n * inner, inner, lo, hi, inner, part + t * inner);
    }
    for (int64_t o = 0; o < outer; o++)
      for (int64_t c = 0; c < inner; c++) {
        int64_t first = o * nblk * inner + c;
        combine(op, dt, n, nblk, part + first, pat + first, inner, y, o * inner + c, idx);
      }
    return;
  }
  int64_t w = col_tile(outer, inner);
  int64_t ntiles = (inner + w - 1) / w;
  int64_t ntask = outer * ntiles;
#pragma omp parallel for schedule(static) if (total >= PAR_MIN)
  for (int64_t t = 0; t < ntask; t++) {
    int64_t o = t / ntiles, c0 = (t % ntiles) * w, wc = min64(w, inner - c0);
    int64_t base = o * n * inner + c0;
    double acc[COL_TILE], tot[COL_TILE];
    int64_t tat[COL_TILE];
    if (op == TT_RMAX) {
      /* max is exact: one pass over all of n equals block-then-combine. */
      col_block_max(x, dt, base, inner, 0, n, wc, tot, tat);
      for (int64_t c = 0; c < wc; c++) {
        st(y, dt, o * inner + c0 + c, tot[c]);
        if (idx) idx[o * inner + c0 + c] = tat[c];
      }
      continue;
    }
    for (int64_t c = 0; c < wc; c++) tot[c] = 0.0;
    for (int64_t b = 0; b < nblk; b++) {
      col_block_sum(x, dt, sq, base, inner, b * bs, min64((b + 1) * bs, n), wc, acc);
      for (int64_t c = 0; c < wc; c++) tot[c] += acc[c];
    }
    for (int64_t c = 0; c < wc; c++) {
      double s = tot[c];
      if (op == TT_RMEAN) s /= (double)n;
      else if (sq) s = sqrt(s);
      st(y, dt, o * inner + c0 + c, s);
    }
  }
}

tt_status tt_cpu_reduce(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                        int64_t *idx) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (op != TT_RSUM && op != TT_RMEAN && op != TT_RMAX && op != TT_RNORM2) return TT_ERR_INVALID;
  if (outer <= 0 || inner <= 0) return TT_OK;
  if (n < 0) return TT_ERR_INVALID;
  if (inner == 1) reduce_rows(op, dtype, outer, n, x, y, idx);
  else reduce_cols(op, dtype, outer, n, inner, x, y, idx);
  return TT_OK;
}

tt_status tt_cpu_sumsq(int dtype, int64_t n, const void *x, double *out) {
  if (dtype != TT_F32 && dtype != TT_F64 && dtype != TT_BF16 && dtype != TT_F16) return TT_ERR_DTYPE;
  int64_t nblk, bs;
  block_plan(n, &nblk, &bs);
  double part[RED_MAX_BLOCKS];
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t b = 0; b < nblk; b++) part[b] = block_sum(x, dtype, 1, b * bs, min64((b + 1) * bs, n));
  double s = 0.0;
  for (int64_t b = 0; b < nblk; b++) s += part[b];
  *out = s;
  return TT_OK;
}

/* ---- sum_to ----------------------------------------------------------- */

enum { SUMTO_MAX_DIMS = 16 };

/* Offset of linear index `lin` over dims size[0..cnt) (row-major) with
 * strides `stride`. */
static int64_t offset_of(int64_t lin, int cnt, const int64_t *size, const int64_t *stride) {
  int64_t off = 0;
  for (int d = cnt - 1; d >= 0; d--) {
    off += (lin % size[d]) * stride[d];
    lin /= size[d];
  }
  return off;
}

/* Innermost group kept (K columns): each output row of K sums, over every
 * reduced index in row-major order, contiguous rows of x. */
TT_INLINE void sum_to_kept_task(int dt, const void *x, void *out, int64_t t, int64_t ntiles, int64_t w, int64_t K,
                                int nk, const int64_t *ksize, const int64_t *kstride, int nr, const int64_t *rsize,
                                const int64_t *rstride, int64_t nred) {
  int64_t ko = t / ntiles, c0 = (t % ntiles) * w, wc = min64(w, K - c0);
  int64_t base = offset_of(ko, nk, ksize, kstride) + c0;
  double acc[COL_TILE];
  for (int64_t c = 0; c < wc; c++) acc[c] = 0.0;
  for (int64_t r = 0; r < nred; r++) {
    int64_t row = base + offset_of(r, nr, rsize, rstride);
    for (int64_t c = 0; c < wc; c++) acc[c] += ld(x, dt, row + c);
  }
  for (int64_t c = 0; c < wc; c++) st(out, dt, ko * K + c0 + c, acc[c]);
}

/* The general case, two or more separate reduced groups (e.g. [R, K, R]).
 * Threads split the outputs; each output sums in row-major order. */
static void sum_to_general(int dt, int ng, const int64_t *gsize, const int *gred, const void *x, void *out) {
  int64_t gstride[SUMTO_MAX_DIMS];
  int64_t s = 1;
  for (int g = ng - 1; g >= 0; g--) {
    gstride[g] = s;
    s *= gsize[g];
  }
  int64_t total = s;
  int last_red = gred[ng - 1];
  /* Kept and reduced groups, leaving out the innermost one (handled as a
   * contiguous row or as the column range). */
  int nk = 0, nr = 0;
  int64_t ksize[SUMTO_MAX_DIMS], kstride[SUMTO_MAX_DIMS], rsize[SUMTO_MAX_DIMS], rstride[SUMTO_MAX_DIMS];
  int64_t nko = 1, nred = 1;
  for (int g = 0; g < ng - 1; g++) {
    if (gred[g]) {
      rsize[nr] = gsize[g];
      rstride[nr++] = gstride[g];
      nred *= gsize[g];
    } else {
      ksize[nk] = gsize[g];
      kstride[nk++] = gstride[g];
      nko *= gsize[g];
    }
  }
  int64_t L = gsize[ng - 1];
  if (last_red) {
    /* Innermost reduced: every output sums nred contiguous rows of L. */
#pragma omp parallel for schedule(static) if (total >= PAR_MIN)
    for (int64_t k = 0; k < nko; k++) {
      int64_t base = offset_of(k, nk, ksize, kstride);
      double acc = 0.0;
      for (int64_t r = 0; r < nred; r++) {
        int64_t row = base + offset_of(r, nr, rsize, rstride);
        acc += block_sum(x, dt, 0, row, row + L);
      }
      st(out, dt, k, acc);
    }
    return;
  }
  int64_t w = col_tile(nko, L);
  int64_t ntiles = (L + w - 1) / w;
  int64_t ntask = nko * ntiles;
#pragma omp parallel for schedule(static) if (total >= PAR_MIN)
  for (int64_t t = 0; t < ntask; t++) {
    if (dt == TT_F64) sum_to_kept_task(TT_F64, x, out, t, ntiles, w, L, nk, ksize, kstride, nr, rsize, rstride, nred);
    else sum_to_kept_task(TT_F32, x, out, t, ntiles, w, L, nk, ksize, kstride, nr, rsize, rstride, nred);
  }
}

tt_status tt_cpu_sum_to(int dtype, int ndim, const int64_t *shape, const void *x, const int64_t *out_shape,
                        void *out) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (ndim < 0 || ndim > SUMTO_MAX_DIMS) return TT_ERR_INVALID;
  /* Collapse: drop size-1 dims, merge neighbours of the same kind (both
   * summed or both kept); contiguity makes a merged group one dim. */
  int64_t gsize[SUMTO_MAX_DIMS];
  int gred[SUMTO_MAX_DIMS];
  int ng = 0;
  int64_t nout = 1, total = 1;
  for (int d = 0; d < ndim; d++) {
    int64_t s = shape[d];
    total *= s;
    if (out_shape[d] != 1) nout *= out_shape[d];
    if (s == 1) continue;
    int red = out_shape[d] == 1;
    if (ng > 0 && gred[ng - 1] == red) {
      gsize[ng - 1] *= s;
    } else {
      gsize[ng] = s;
      gred[ng++] = red;
    }
  }
  if (nout == 0) return TT_OK;
  size_t esz = dtype == TT_F64 ? 8 : 4;
  if (total == 0) { /* sums over an empty dim */
    memset(out, 0, (size_t)nout * esz);
    return TT_OK;
  }
  int nred_groups = 0, rg = -1;
  for (int g = 0; g < ng; g++)
    if (gred[g]) {
      nred_groups++;
      rg = g;
    }
  if (nred_groups == 0) { /* nothing to sum: the same elements */
    memcpy(out, x, (size_t)total * esz);
    return TT_OK;
  }
  if (nred_groups == 1) { /* [outer, n, inner]: exactly a reduction */
    int64_t outer = 1, inner = 1;
    for (int g = 0; g < rg; g++) outer *= gsize[g];
    for (int g = rg + 1; g < ng; g++) inner *= gsize[g];
    return tt_cpu_reduce(TT_RSUM, dtype, outer, gsize[rg], inner, x, out, NULL);
  }
  sum_to_general(dtype, ng, gsize, gred, x, out);
  return TT_OK;
}

/* ---- softmax ---------------------------------------------------------- */

/* Row max ignoring NaN (a NaN still reaches every output through the sum). */
TT_INLINE double row_max(const void *x, int dt, int64_t off, int64_t n) {
  double m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = off; i < off + n; i++) {
    double v = ld(x, dt, i);
    m = v > m ? v : m;
  }
  return m;
}

/* exp in the input's precision. */
TT_INLINE double exp_dt(int dt, double a) { return dt == TT_F64 ? exp(a) : (double)tt_expf((float)a); }

enum { SM_CHUNK = 1024 }; /* exps staged on the stack: a multiple of LANES */

/* f32 row: y = exp(x - max) / sum, or x - max - log(sum); the sum over
 * fixed lanes in double. x == y is allowed: each chunk reads x before it
 * writes y, and log-softmax writes only in the last pass. */
static void softmax_row_f32(int lg, const float *x, float *y, int64_t n) {
  float m = (float)row_max(x, TT_F32, 0, n);
  double acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 0.0;
  float eb[SM_CHUNK];
  for (int64_t c0 = 0; c0 < n; c0 += SM_CHUNK) {
    int64_t len = min64(SM_CHUNK, n - c0);
    for (int64_t i = 0; i < len; i++) eb[i] = tt_expf(x[c0 + i] - m);
    if (!lg)
      for (int64_t i = 0; i < len; i++) y[c0 + i] = eb[i];
    int64_t i = 0;
    for (; i + LANES <= len; i += LANES)
      for (int l = 0; l < LANES; l++) acc[l] += (double)eb[i + l];
    for (int l = 0; i + l < len; l++) acc[l] += (double)eb[i + l];
  }
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  if (lg) {
    double sub = (double)m + log(acc[0]);
    for (int64_t i = 0; i < n; i++) y[i] = (float)((double)x[i] - sub);
  } else {
    double inv = 1.0 / acc[0];
    for (int64_t i = 0; i < n; i++) y[i] = (float)((double)y[i] * inv);
  }
}

/* f64 rows (gradient checks): the same passes with libm's exp. */
static void softmax_row_f64(int lg, const double *x, double *y, int64_t n) {
  double m = row_max(x, TT_F64, 0, n);
  double acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 0.0;
  for (int64_t i = 0; i < n; i += LANES)
    for (int l = 0; l < LANES && i + l < n; l++) {
      double e = exp(x[i + l] - m);
      if (!lg) y[i + l] = e;
      acc[l] += e;
    }
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  if (lg) {
    double lse = log(acc[0]);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] - m - lse;
  } else {
    double inv = 1.0 / acc[0];
    for (int64_t i = 0; i < n; i++) y[i] *= inv;
  }
}

tt_status tt_cpu_softmax(int dtype, int64_t rows, int64_t n, int log, const void *x, void *y) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (rows <= 0 || n <= 0) return TT_OK;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN / 4 && rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    if (dtype == TT_F64) softmax_row_f64(log, (const double *)x + r * n, (double *)y + r * n, n);
    else softmax_row_f32(log, (const float *)x + r * n, (float *)y + r * n, n);
  }
  return TT_OK;
}

/* softmax: dx = y * (dy - sum(dy * y)); log-softmax: dx = dy - exp(y) * sum(dy).
 * The sum is in double over fixed lanes; dx may alias dy. */
TT_INLINE void softmax_bwd_row(int dt, int lg, const void *y, const void *dy, void *dx, int64_t off, int64_t n) {
  double acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 0.0;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; l++) {
      double g = ld(dy, dt, off + i + l);
      acc[l] += lg ? g : g * ld(y, dt, off + i + l);
    }
  for (int l = 0; i + l < n; l++) {
    double g = ld(dy, dt, off + i + l);
    acc[l] += lg ? g : g * ld(y, dt, off + i + l);
  }
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  double s = acc[0];
  if (lg) {
    for (int64_t j = 0; j < n; j++)
      st(dx, dt, off + j, ld(dy, dt, off + j) - exp_dt(dt, ld(y, dt, off + j)) * s);
  } else {
    for (int64_t j = 0; j < n; j++) {
      double yv = ld(y, dt, off + j);
      st(dx, dt, off + j, yv * (ld(dy, dt, off + j) - s));
    }
  }
}

tt_status tt_cpu_softmax_backward(int dtype, int64_t rows, int64_t n, int log, const void *y, const void *dy,
                                  void *dx) {
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (rows <= 0 || n <= 0) return TT_OK;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN && rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    if (dtype == TT_F64) {
      if (log) softmax_bwd_row(TT_F64, 1, y, dy, dx, r * n, n);
      else softmax_bwd_row(TT_F64, 0, y, dy, dx, r * n, n);
    } else {
      if (log) softmax_bwd_row(TT_F32, 1, y, dy, dx, r * n, n);
      else softmax_bwd_row(TT_F32, 0, y, dy, dx, r * n, n);
    }
  }
  return TT_OK;
}
