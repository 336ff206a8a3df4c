/*
 * test_index.c — index_select, gather, index_add and scatter_add of the CPU
 * backend against plain serial loops. Indices repeat, so the adds are
 * checked for the serial loop's exact bits (same order per element), on
 * 1, 2 and 3 threads, for every supported dtype.
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "tt_test.h"
#include "cpu/cpu.h"
#include "dtype_conv.h"

static void set_threads(int n) {
#ifdef _OPENMP
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

static size_t esize(int dtype) {
  switch (dtype) {
  case TT_F64:
  case TT_I64: return 8;
  case TT_F32:
  case TT_I32: return 4;
  case TT_BF16:
  case TT_F16: return 2;
  default: return 1;
  }
}

static const char *dname(int dtype) {
  switch (dtype) {
  case TT_F32: return "f32";
  case TT_F64: return "f64";
  case TT_BF16: return "bf16";
  case TT_F16: return "f16";
  case TT_I32: return "i32";
  case TT_I64: return "i64";
  case TT_U8: return "u8";
  default: return "?";
  }
}

static uint64_t rand_u64(void) {
  uint64_t a = (uint64_t)((tt_test_rand() + 1.0) * 4294967296.0);
  uint64_t b = (uint64_t)((tt_test_rand() + 1.0) * 4294967296.0);
  return a << 32 ^ b;
}

static int64_t rand_index(int64_t n) {
  int64_t r = (int64_t)((tt_test_rand() + 1.0) * 0.5 * (double)n);
  return r < n ? r : n - 1;
}

/* Random values of a dtype: floats in [-2, 2), integers anywhere (so the
 * adds wrap), raw bytes for the byte movers. */
static void fill(int dtype, void *p, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = 2.0 * tt_test_rand();
    switch (dtype) {
    case TT_F32: ((float *)p)[i] = (float)v; break;
    case TT_F64: ((double *)p)[i] = v; break;
    case TT_BF16: ((uint16_t *)p)[i] = tt_f32_to_bf16((float)v); break;
    case TT_F16: ((uint16_t *)p)[i] = tt_f32_to_f16((float)(v < 0 ? v - 0.01 : v + 0.01)); break;
    case TT_I32: ((int32_t *)p)[i] = (int32_t)(uint32_t)rand_u64(); break;
    case TT_I64: ((int64_t *)p)[i] = (int64_t)rand_u64(); break;
    default: ((uint8_t *)p)[i] = (uint8_t)rand_u64(); break;
    }
  }
}

/* The reference add, element by element: what the kernel must reproduce. */
static void ref_add(int dtype, void *d, int64_t di, const void *s, int64_t si) {
  switch (dtype) {
  case TT_F32: ((float *)d)[di] += ((const float *)s)[si]; break;
  case TT_F64: ((double *)d)[di] += ((const double *)s)[si]; break;
  case TT_I32:
    ((int32_t *)d)[di] = (int32_t)((uint32_t)((int32_t *)d)[di] + (uint32_t)((const int32_t *)s)[si]);
    break;
  case TT_I64:
    ((int64_t *)d)[di] = (int64_t)((uint64_t)((int64_t *)d)[di] + (uint64_t)((const int64_t *)s)[si]);
    break;
  case TT_BF16:
    ((uint16_t *)d)[di] =
        tt_f32_to_bf16(tt_bf16_to_f32(((uint16_t *)d)[di]) + tt_bf16_to_f32(((const uint16_t *)s)[si]));
    break;
  case TT_F16:
    ((uint16_t *)d)[di] = tt_f32_to_f16(tt_f16_to_f32(((uint16_t *)d)[di]) + tt_f16_to_f32(((const uint16_t *)s)[si]));
    break;
  }
}

/* ---- index_select / gather -------------------------------------------- */

static void check_select(int dtype, int64_t outer, int64_t n_src, int64_t inner, int64_t n_idx) {
  size_t es = esize(dtype);
  int64_t nsrc = outer * n_src * inner, nout = outer * n_idx * inner;
  void *src = malloc((size_t)nsrc * es), *out = malloc((size_t)nout * es + 1), *ref = malloc((size_t)nout * es + 1);
  int64_t *idx = malloc((size_t)n_idx * sizeof(int64_t));
  fill(dtype, src, nsrc);
  for (int64_t j = 0; j < n_idx; j++) idx[j] = rand_index(n_src);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++)
      memcpy((char *)ref + (size_t)((o * n_idx + j) * inner) * es,
             (char *)src + (size_t)((o * n_src + idx[j]) * inner) * es, (size_t)inner * es);
  memset(out, 0xff, (size_t)nout * es + 1); /* NaN for floats; the last byte is a guard */
  ((uint8_t *)out)[nout * (int64_t)es] = 0x5a;
  tt_status st = tt_cpu_index_select(dtype, outer, n_src, inner, src, n_idx, idx, out);
  CHECK(st == TT_OK, "index_select status %d", (int)st);
  CHECK(memcmp(out, ref, (size_t)nout * es) == 0 && ((uint8_t *)out)[nout * (int64_t)es] == 0x5a,
        "index_select %s [%lld,%lld,%lld] n_idx %lld", dname(dtype), (long long)outer, (long long)n_src,
        (long long)inner, (long long)n_idx);
  free(src);
  free(out);
  free(ref);
  free(idx);
}

static void check_gather(int dtype, int64_t outer, int64_t n_src, int64_t inner, int64_t n_idx) {
  size_t es = esize(dtype);
  int64_t nsrc = outer * n_src * inner, nout = outer * n_idx * inner;
  void *src = malloc((size_t)nsrc * es), *out = malloc((size_t)nout * es + 1), *ref = malloc((size_t)nout * es + 1);
  int64_t *idx = malloc((size_t)nout * sizeof(int64_t));
  fill(dtype, src, nsrc);
  for (int64_t k = 0; k < nout; k++) idx[k] = rand_index(n_src);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++)
      for (int64_t i = 0; i < inner; i++) {
        int64_t k = (o * n_idx + j) * inner + i;
        memcpy((char *)ref + (size_t)k * es, (char *)src + (size_t)((o * n_src + idx[k]) * inner + i) * es, es);
      }
  memset(out, 0xff, (size_t)nout * es + 1);
  ((uint8_t *)out)[nout * (int64_t)es] = 0x5a;
  tt_status st = tt_cpu_gather(dtype, outer, n_src, inner, src, n_idx, idx, out);
  CHECK(st == TT_OK, "gather status %d", (int)st);
  CHECK(memcmp(out, ref, (size_t)nout * es) == 0 && ((uint8_t *)out)[nout * (int64_t)es] == 0x5a,
        "gather %s [%lld,%lld,%lld] n_idx %lld", dname(dtype), (long long)outer, (long long)n_src, (long long)inner,
        (long long)n_idx);
  free(src);
  free(out);
  free(ref);
  free(idx);
}

static const int64_t move_shapes[][4] = {
    /* outer, n_src, inner, n_idx */
    {1, 1, 1, 1},   {1, 10, 1, 37}, {3, 7, 5, 20},      {1, 5, 130, 9},
    {4, 3, 1, 100}, {2, 100, 300, 50}, {64, 20, 8, 30}, {1, 1000, 1, 100000},
};

static void test_moves(void) {
  int dtypes[] = {TT_U8, TT_BF16, TT_F32, TT_I32, TT_F64, TT_I64};
  int nshapes = (int)(sizeof move_shapes / sizeof move_shapes[0]);
  for (int d = 0; d < 6; d++)
    for (int s = 0; s < nshapes; s++) {
      const int64_t *sh = move_shapes[s];
      check_select(dtypes[d], sh[0], sh[1], sh[2], sh[3]);
      check_gather(dtypes[d], sh[0], sh[1], sh[2], sh[3]);
    }
  float x = 1.0f, y;
  int64_t i0 = 0;
  CHECK(tt_cpu_index_select(99, 1, 1, 1, &x, 1, &i0, &y) == TT_ERR_DTYPE, "unknown dtype rejected");
}

/* ---- index_add / scatter_add ------------------------------------------ */

/* skew: every index lands on row 0 (worst case for row-range tasks). */
static void check_index_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx, int skew) {
  size_t es = esize(dtype);
  int64_t ndst = outer * n_dst * inner, nsrc = outer * n_idx * inner;
  void *dst0 = malloc((size_t)ndst * es), *ref = malloc((size_t)ndst * es), *src = malloc((size_t)nsrc * es);
  void *got = malloc((size_t)ndst * es);
  int64_t *idx = malloc((size_t)n_idx * sizeof(int64_t));
  fill(dtype, dst0, ndst);
  fill(dtype, src, nsrc);
  for (int64_t j = 0; j < n_idx; j++) idx[j] = skew ? 0 : rand_index(n_dst);
  memcpy(ref, dst0, (size_t)ndst * es);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++)
      for (int64_t i = 0; i < inner; i++)
        ref_add(dtype, ref, (o * n_dst + idx[j]) * inner + i, src, (o * n_idx + j) * inner + i);
  for (int t = 1; t <= 3; t++) {
    set_threads(t);
    memcpy(got, dst0, (size_t)ndst * es);
    tt_status st = tt_cpu_index_add(dtype, outer, n_dst, inner, got, n_idx, idx, src);
    CHECK(st == TT_OK, "index_add status %d", (int)st);
    CHECK(memcmp(got, ref, (size_t)ndst * es) == 0, "index_add %s [%lld,%lld,%lld] n_idx %lld skew %d on %d threads",
          dname(dtype), (long long)outer, (long long)n_dst, (long long)inner, (long long)n_idx, skew, t);
  }
  set_threads(2);
  free(dst0);
  free(ref);
  free(src);
  free(got);
  free(idx);
}

static void check_scatter_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx, int skew) {
  size_t es = esize(dtype);
  int64_t ndst = outer * n_dst * inner, nsrc = outer * n_idx * inner;
  void *dst0 = malloc((size_t)ndst * es), *ref = malloc((size_t)ndst * es), *src = malloc((size_t)nsrc * es);
  void *got = malloc((size_t)ndst * es);
  int64_t *idx = malloc((size_t)nsrc * sizeof(int64_t));
  fill(dtype, dst0, ndst);
  fill(dtype, src, nsrc);
  for (int64_t k = 0; k < nsrc; k++) idx[k] = skew ? 0 : rand_index(n_dst);
  memcpy(ref, dst0, (size_t)ndst * es);
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < n_idx; j++)
      for (int64_t i = 0; i < inner; i++) {
        int64_t k = (o * n_idx + j) * inner + i;
        ref_add(dtype, ref, (o * n_dst + idx[k]) * inner + i, src, k);
      }
  for (int t = 1; t <= 3; t++) {
    set_threads(t);
    memcpy(got, dst0, (size_t)ndst * es);
    tt_status st = tt_cpu_scatter_add(dtype, outer, n_dst, inner, got, n_idx, idx, src);
    CHECK(st == TT_OK, "scatter_add status %d", (int)st);
    CHECK(memcmp(got, ref, (size_t)ndst * es) == 0,
          "scatter_add %s [%lld,%lld,%lld] n_idx %lld skew %d on %d threads", dname(dtype), (long long)outer,
          (long long)n_dst, (long long)inner, (long long)n_idx, skew, t);
  }
  set_threads(2);
  free(dst0);
  free(ref);
  free(src);
  free(got);
  free(idx);
}

static void test_adds(void) {
  static const int64_t shapes[][4] = {
      /* outer, n_dst, inner, n_idx: n_idx > n_dst repeats indices */
      {1, 1, 1, 5},      {1, 10, 1, 37},     {3, 7, 5, 20},   {1, 50, 1000, 200}, {1, 500, 32, 3000},
      {64, 20, 8, 30},   {2, 1000, 300, 100}, {1, 7, 130, 60}, {5, 3, 1, 10000},  {1, 2000, 17, 4000},
  };
  int dtypes[] = {TT_F32, TT_F64, TT_BF16, TT_F16, TT_I32, TT_I64};
  int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  for (int d = 0; d < 6; d++)
    for (int s = 0; s < nshapes; s++)
      for (int skew = 0; skew < 2; skew++) {
        const int64_t *sh = shapes[s];
        check_index_add(dtypes[d], sh[0], sh[1], sh[2], sh[3], skew);
        check_scatter_add(dtypes[d], sh[0], sh[1], sh[2], sh[3], skew);
      }
  /* a known small case, by hand: dst [3] += src at idx {2, 0, 2, 2} */
  float dst[3] = {1, 2, 3}, src[4] = {10, 20, 30, 40};
  int64_t idx[4] = {2, 0, 2, 2};
  tt_cpu_index_add(TT_F32, 1, 3, 1, dst, 4, idx, src);
  CHECK(dst[0] == 21 && dst[1] == 2 && dst[2] == 83, "index_add by hand: %g %g %g", (double)dst[0], (double)dst[1],
        (double)dst[2]);
  float d2[3] = {1, 2, 3};
  tt_cpu_scatter_add(TT_F32, 1, 3, 1, d2, 4, idx, src);
  CHECK(d2[0] == 21 && d2[1] == 2 && d2[2] == 83, "scatter_add by hand");
  uint8_t u[2] = {0, 0};
  CHECK(tt_cpu_index_add(TT_U8, 1, 2, 1, u, 1, idx + 1, u) == TT_ERR_DTYPE, "u8 add rejected");
  CHECK(tt_cpu_scatter_add(TT_BOOL, 1, 2, 1, u, 1, idx + 1, u) == TT_ERR_DTYPE, "bool add rejected");
}

int main(void) {
  set_threads(2);
  test_moves();
  test_adds();
  return tt_test_summary("test_index");
}
