/*
 * index.c — index_select, index_add, gather and scatter_add over tensors
 * viewed as contiguous [outer, n, inner] (see kernels.h); idx is i64 and
 * already validated by engine/ops.c.
 *
 * Select and gather move bytes, so they take any dtype by element size.
 * The add variants do real adds: f32, f64, i32 and i64 (wrapping), and
 * bf16/f16 through f32 with one rounding per add, as an element-by-element
 * loop in that dtype would.
 *
 * The adds are deterministic without atomics: a task owns a block of the
 * destination outright (one outer slice, a range of inner columns and, for
 * index_add, a range of destination rows) and walks j = 0..n_idx-1 in order,
 * taking only the contributions that land in its block. Every destination
 * element therefore receives its contributions in increasing j, whatever
 * the tiling or thread count: the serial loop's exact bits.
 */

/* a*b+c is never contracted (-ffp-contract=off): bf16/f16 adds round
 * exactly as written. */

#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"
#include "../dtype_conv.h"

#define TT_INLINE static inline __attribute__((always_inline))

enum {
  PAR_MIN_BYTES = 1 << 16, /* below this a parallel region costs more than the copy */
  PAR_MIN_ADDS = 1 << 15,
  MIN_TILE = 64            /* narrowest column tile worth a task */
};

static int max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int elem_size(int dtype) {
  switch (dtype) {
  case TT_F64:
  case TT_I64: return 8;
  case TT_F32:
  case TT_I32: return 4;
  case TT_BF16:
  case TT_F16: return 2;
  case TT_U8:
  case TT_BOOL:
  case TT_F8E4M3:
  case TT_F8E5M2: return 1;
  default: return 0;
  }
}

/* ---- byte movers ------------------------------------------------------ */

/* Copies `cnt` elements of `esz` bytes; the typed loops let the compiler
 * vectorize and avoid a memcpy call per element when rows are short. */
TT_INLINE void copy_elems(int esz, void *dst, const void *src, int64_t cnt) {
  switch (esz) {
  case 8:
    for (int64_t i = 0; i < cnt; i++) ((uint64_t *)dst)[i] = ((const uint64_t *)src)[i];
    break;
  case 4:
    for (int64_t i = 0; i < cnt; i++) ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
    break;
  case 2:
    for (int64_t i = 0; i < cnt; i++) ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
    break;
  default:
    for (int64_t i = 0; i < cnt; i++) ((uint8_t *)dst)[i] = ((const uint8_t *)src)[i];
    break;
  }
}

tt_status tt_cpu_index_select(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                              const int64_t *idx, void *out) {
  int esz = elem_size(dtype);
  if (!esz) return TT_ERR_DTYPE;
  int64_t rows = outer * n_idx;
  if (rows <= 0 || inner <= 0) return TT_OK;
  size_t row_bytes = (size_t)inner * (size_t)esz;
  const char *s = src;
  char *o = out;
#pragma omp parallel for schedule(static) if ((int64_t)row_bytes * rows >= PAR_MIN_BYTES)
  for (int64_t r = 0; r < rows; r++) {
    int64_t oi = r / n_idx, j = r % n_idx;
    const char *from = s + (size_t)(oi * n_src + idx[j]) * row_bytes;
    char *to = o + (size_t)r * row_bytes;
    if (row_bytes >= 256) memcpy(to, from, row_bytes);
    else copy_elems(esz, to, from, inner);
  }
  return TT_OK;
}

/* out[o, j, i] = src[o, idx[o, j, i], i] for one row (o, j). */
TT_INLINE void gather_row(int esz, const void *src_slab, const int64_t *ir, void *out_row, int64_t inner) {
  switch (esz) {
  case 8:
    for (int64_t i = 0; i < inner; i++)
      ((uint64_t *)out_row)[i] = ((const uint64_t *)src_slab)[ir[i] * inner + i];
    break;
  case 4:
    for (int64_t i = 0; i < inner; i++)
      ((uint32_t *)out_row)[i] = ((const uint32_t *)src_slab)[ir[i] * inner + i];
    break;
  case 2:
    for (int64_t i = 0; i < inner; i++)
      ((uint16_t *)out_row)[i] = ((const uint16_t *)src_slab)[ir[i] * inner + i];
    break;
  default:
    for (int64_t i = 0; i < inner; i++)
      ((uint8_t *)out_row)[i] = ((const uint8_t *)src_slab)[ir[i] * inner + i];
    break;
  }
}

tt_status tt_cpu_gather(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                        const int64_t *idx, void *out) {
  int esz = elem_size(dtype);
  if (!esz) return TT_ERR_DTYPE;
  int64_t rows = outer * n_idx;
  if (rows <= 0 || inner <= 0) return TT_OK;
  const char *s = src;
  char *o = out;
#pragma omp parallel for schedule(static) if (rows * inner * (esz + 8) >= PAR_MIN_BYTES)
  for (int64_t r = 0; r < rows; r++) {
    int64_t oi = r / n_idx;
    const char *slab = s + (size_t)(oi * n_src * inner) * (size_t)esz;
    gather_row(esz, slab, idx + r * inner, o + (size_t)(r * inner) * (size_t)esz, inner);
  }
  return TT_OK;
}

/* ---- adds ------------------------------------------------------------- */

static int add_supported(int dtype) {
  return dtype == TT_F32 || dtype == TT_F64 || dtype == TT_I32 || dtype == TT_I64 || dtype == TT_BF16 ||
         dtype == TT_F16;
}

/* d[c] += s[c] for c < w. Integers wrap (through unsigned: no UB). */
TT_INLINE void add_row(int dt, void *d, const void *s, int64_t w) {
  switch (dt) {
  case TT_F64:
    for (int64_t c = 0; c < w; c++) ((double *)d)[c] += ((const double *)s)[c];
    break;
  case TT_I64:
    for (int64_t c = 0; c < w; c++)
      ((int64_t *)d)[c] = (int64_t)((uint64_t)((int64_t *)d)[c] + (uint64_t)((const int64_t *)s)[c]);
    break;
  case TT_I32:
    for (int64_t c = 0; c < w; c++)
      ((int32_t *)d)[c] = (int32_t)((uint32_t)((int32_t *)d)[c] + (uint32_t)((const int32_t *)s)[c]);
    break;
  case TT_BF16:
    for (int64_t c = 0; c < w; c++)
      ((uint16_t *)d)[c] =
          tt_f32_to_bf16(tt_bf16_to_f32(((uint16_t *)d)[c]) + tt_bf16_to_f32(((const uint16_t *)s)[c]));
    break;
  case TT_F16:
    for (int64_t c = 0; c < w; c++)
      ((uint16_t *)d)[c] = tt_f32_to_f16(tt_f16_to_f32(((uint16_t *)d)[c]) + tt_f16_to_f32(((const uint16_t *)s)[c]));
    break;
  default:
    for (int64_t c = 0; c < w; c++) ((float *)d)[c] += ((const float *)s)[c];
    break;
  }
}

/* One add at element offsets (di, si). */
TT_INLINE void add_one(int dt, void *d, int64_t di, const void *s, int64_t si) {
  int esz = dt == TT_F64 || dt == TT_I64 ? 8 : dt == TT_BF16 || dt == TT_F16 ? 2 : 4;
  add_row(dt, (char *)d + di * esz, (const char *)s + si * esz, 1);
}

/* The task split: tiles of inner columns, and for index_add ranges of
 * destination rows when columns alone give too few tasks. Results never
 * depend on it (see the top of the file). */
typedef struct {
  int64_t w, ntiles, nranges;
} add_plan;

static add_plan plan_adds(int64_t outer, int64_t inner, int64_t n_dst, int64_t work, int split_rows) {
  add_plan p = {inner, 1, 1};
  int nth = max_threads();
  if (work < PAR_MIN_ADDS || nth <= 1) return p;
  int64_t want = 4 * (int64_t)nth;
  if (outer >= want) return p;
  int64_t tiles = min64((inner + MIN_TILE - 1) / MIN_TILE, (want + outer - 1) / outer);
  if (tiles < 1) tiles = 1;
  p.w = (inner + tiles - 1) / tiles;
  p.ntiles = (inner + p.w - 1) / p.w;
  /* Each row range rescans the whole index list, which pays only when the
   * rows it copies are several elements wide. */
  int64_t slabs = outer * p.ntiles;
  if (split_rows && slabs < want && inner >= 16) p.nranges = min64(n_dst, (want + slabs - 1) / slabs);
  if (p.nranges < 1) p.nranges = 1;
  return p;
}

TT_INLINE void index_add_task(int dt, int64_t t, add_plan p, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                              const int64_t *idx, const void *src) {
  int esz = dt == TT_F64 || dt == TT_I64 ? 8 : dt == TT_BF16 || dt == TT_F16 ? 2 : 4;
  int64_t per_o = p.ntiles * p.nranges;
  int64_t o = t / per_o, rest = t % per_o;
  int64_t tile = rest / p.nranges, range = rest % p.nranges;
  int64_t c0 = tile * p.w, w = min64(p.w, inner - c0);
  int64_t r0 = range * n_dst / p.nranges, r1 = (range + 1) * n_dst / p.nranges;
  char *d = dst;
  const char *s = src;
  for (int64_t j = 0; j < n_idx; j++) {
    int64_t r = idx[j];
    if (r < r0 || r >= r1) continue;
    add_row(dt, d + (size_t)((o * n_dst + r) * inner + c0) * esz, s + (size_t)((o * n_idx + j) * inner + c0) * esz,
            w);
  }
}

tt_status tt_cpu_index_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                           const int64_t *idx, const void *src) {
  if (!add_supported(dtype)) return TT_ERR_DTYPE;
  if (outer <= 0 || inner <= 0 || n_idx <= 0 || n_dst <= 0) return TT_OK;
  int64_t work = outer * n_idx * inner;
  add_plan p = plan_adds(outer, inner, n_dst, work, 1);
  int64_t ntask = outer * p.ntiles * p.nranges;
#pragma omp parallel for schedule(static) if (ntask > 1 && work >= PAR_MIN_ADDS)
  for (int64_t t = 0; t < ntask; t++) {
    switch (dtype) {
    case TT_F64: index_add_task(TT_F64, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_I64: index_add_task(TT_I64, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_I32: index_add_task(TT_I32, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_BF16: index_add_task(TT_BF16, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_F16: index_add_task(TT_F16, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    default: index_add_task(TT_F32, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    }
  }
  return TT_OK;
}

/* dst[o, idx[o, j, i], i] += src[o, j, i]: column i of slice o only ever
 * touches column i of dst slice o, so a task owns (o, a tile of columns). */
TT_INLINE void scatter_add_task(int dt, int64_t t, add_plan p, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                                const int64_t *idx, const void *src) {
  int64_t o = t / p.ntiles, c0 = (t % p.ntiles) * p.w, w = min64(p.w, inner - c0);
  int64_t dbase = o * n_dst * inner;
  for (int64_t j = 0; j < n_idx; j++) {
    int64_t row = (o * n_idx + j) * inner + c0;
    const int64_t *ir = idx + row;
    for (int64_t c = 0; c < w; c++) add_one(dt, dst, dbase + ir[c] * inner + c0 + c, src, row + c);
  }
}

tt_status tt_cpu_scatter_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                             const int64_t *idx, const void *src) {
  if (!add_supported(dtype)) return TT_ERR_DTYPE;
  if (outer <= 0 || inner <= 0 || n_idx <= 0 || n_dst <= 0) return TT_OK;
  int64_t work = outer * n_idx * inner;
  add_plan p = plan_adds(outer, inner, n_dst, work, 0);
  int64_t ntask = outer * p.ntiles;
#pragma omp parallel for schedule(static) if (ntask > 1 && work >= PAR_MIN_ADDS)
  for (int64_t t = 0; t < ntask; t++) {
    switch (dtype) {
    case TT_F64: scatter_add_task(TT_F64, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_I64: scatter_add_task(TT_I64, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_I32: scatter_add_task(TT_I32, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_BF16: scatter_add_task(TT_BF16, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    case TT_F16: scatter_add_task(TT_F16, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    default: scatter_add_task(TT_F32, t, p, n_dst, inner, dst, n_idx, idx, src); break;
    }
  }
  return TT_OK;
}
