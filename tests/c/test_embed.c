/*
 * test_embed.c — embedding lookup (f32, f64, bf16 rows) and the scatter-add
 * backward with repeated ids: plain reference, finite differences in f64,
 * accumulation onto a nonzero dweight, thread-count determinism.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu/cpu.h"
#include "tt_test.h"

static double *dalloc(int64_t n) { return calloc((size_t)n + 1, sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }
static void nan_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void nan_f64(double *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void to_f32(const double *s, float *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (float)s[i]; }

/* Ids drawn from a small vocab so that repeats are common. */
static void make_ids(int64_t n, int64_t vocab, int64_t *ids) {
  for (int64_t i = 0; i < n; i++) {
    ids[i] = (int64_t)((tt_test_rand() + 1) * 0.5 * (double)vocab);
    if (ids[i] >= vocab) ids[i] = vocab - 1;
  }
}

static void check_values(int64_t n_ids, int64_t dim, int64_t vocab) {
  int64_t nw = vocab * dim, no = n_ids * dim;
  double *w = dalloc(nw), *out = dalloc(no), *dy = dalloc(no), *dw = dalloc(nw), *rdw = dalloc(nw);
  float *wf = falloc(nw), *outf = falloc(no), *dyf = falloc(no), *dwf = falloc(nw);
  int64_t *ids = calloc((size_t)n_ids + 1, sizeof *ids);
  make_ids(n_ids, vocab, ids);
  tt_test_fill_f64(w, nw, 1.0);
  tt_test_fill_f64(dy, no, 1.0);
  tt_test_fill_f64(dw, nw, 1.0); /* backward accumulates onto what is there */
  to_f32(w, wf, nw); to_f32(dy, dyf, no); to_f32(dw, dwf, nw);

  nan_f64(out, no); nan_f32(outf, no);
  CHECK(tt_cpu_embedding(TT_F64, n_ids, dim, vocab, w, ids, out) == TT_OK, "f64 embedding");
  CHECK(tt_cpu_embedding(TT_F32, n_ids, dim, vocab, wf, ids, outf) == TT_OK, "f32 embedding");
  int ok64 = 1, ok32 = 1;
  for (int64_t i = 0; i < n_ids; i++) {
    ok64 &= !memcmp(out + i * dim, w + ids[i] * dim, dim * sizeof(double));
    ok32 &= !memcmp(outf + i * dim, wf + ids[i] * dim, dim * sizeof(float));
  }
  CHECK(ok64 && ok32, "embedding rows n %ld dim %ld", (long)n_ids, (long)dim);

  /* Reference: ids in order, each addition rounded in the kernel's dtype. */
  memcpy(rdw, dw, nw * sizeof *rdw);
  for (int64_t i = 0; i < n_ids; i++)
    for (int64_t j = 0; j < dim; j++) rdw[ids[i] * dim + j] += dy[i * dim + j];
  CHECK(tt_cpu_embedding_backward(TT_F64, n_ids, dim, vocab, dy, ids, dw) == TT_OK, "f64 backward");
  CHECK(!memcmp(dw, rdw, nw * sizeof *dw), "f64 dweight n %ld dim %ld vocab %ld", (long)n_ids, (long)dim,
        (long)vocab);
  float *rdwf = falloc(nw);
  memcpy(rdwf, dwf, nw * sizeof *rdwf);
  for (int64_t i = 0; i < n_ids; i++)
    for (int64_t j = 0; j < dim; j++) rdwf[ids[i] * dim + j] += dyf[i * dim + j];
  CHECK(tt_cpu_embedding_backward(TT_F32, n_ids, dim, vocab, dyf, ids, dwf) == TT_OK, "f32 backward");
  CHECK(!memcmp(dwf, rdwf, nw * sizeof *dwf), "f32 dweight n %ld dim %ld vocab %ld", (long)n_ids, (long)dim,
        (long)vocab);
  free(w); free(out); free(dy); free(dw); free(rdw); free(wf); free(outf); free(dyf); free(dwf); free(rdwf);
  free(ids);
}

/* Lookup of 2-byte rows (bf16 weights) is a plain copy. */
static void check_bf16_lookup(void) {
  const int64_t vocab = 7, dim = 5, n = 9;
  uint16_t w[35], out[45];
  int64_t ids[9];
  for (int k = 0; k < 35; k++) w[k] = (uint16_t)(0x3f80 + k);
  make_ids(n, vocab, ids);
  memset(out, 0xff, sizeof out);
  CHECK(tt_cpu_embedding(TT_BF16, n, dim, vocab, w, ids, out) == TT_OK, "bf16 embedding");
  int ok = 1;
  for (int64_t i = 0; i < n; i++) ok &= !memcmp(out + i * dim, w + ids[i] * dim, dim * sizeof(uint16_t));
  CHECK(ok, "bf16 rows");
}

/* L = sum(g * embedding(w, ids)); dL/dw by central differences, with
 * repeated ids, against the backward accumulated onto a nonzero dweight. */
static void check_gradient(void) {
  const int64_t vocab = 6, dim = 3, n = 10, nw = vocab * dim, no = n * dim;
  double *w = dalloc(nw), *g = dalloc(no), *out = dalloc(no), *dw = dalloc(nw), *dw0 = dalloc(nw);
  double *fd = dalloc(nw);
  int64_t ids[10] = {2, 0, 2, 5, 2, 1, 0, 3, 2, 5}; /* 4 never appears */
  tt_test_fill_f64(w, nw, 1.0);
  tt_test_fill_f64(g, no, 1.0);
  tt_test_fill_f64(dw0, nw, 1.0);
  const double h = 1e-6;
  for (int64_t k = 0; k < nw; k++) {
    double keep = w[k], l[2];
    for (int side = 0; side < 2; side++) {
      w[k] = keep + (side ? -h : h);
      tt_cpu_embedding(TT_F64, n, dim, vocab, w, ids, out);
      l[side] = 0;
      for (int64_t i = 0; i < no; i++) l[side] += g[i] * out[i];
    }
    w[k] = keep;
    fd[k] = (l[0] - l[1]) / (2 * h) + dw0[k];
  }
  memcpy(dw, dw0, nw * sizeof *dw);
  tt_cpu_embedding_backward(TT_F64, n, dim, vocab, g, ids, dw);
  CHECK(tt_test_rel_err_f64(dw, fd, nw) < 1e-9, "fd dweight err %g", tt_test_rel_err_f64(dw, fd, nw));
  CHECK(!memcmp(dw + 4 * dim, dw0 + 4 * dim, dim * sizeof *dw), "unused row untouched");
  free(w); free(g); free(out); free(dw); free(dw0); free(fd);
}

/* Bit-identical dweight with 1, 2 and 3 threads, on the parallel path. */
static void check_determinism(void) {
  const int64_t vocab = 50, dim = 301, n = 2000, nw = vocab * dim, no = n * dim;
  float *dy = falloc(no), *dw[3];
  int64_t *ids = calloc((size_t)n, sizeof *ids);
  make_ids(n, vocab, ids);
  tt_test_fill_f32(dy, no, 1.0);
  int saved = omp_get_max_threads();
  for (int k = 0; k < 3; k++) {
    dw[k] = falloc(nw);
    omp_set_num_threads(k + 1);
    tt_cpu_embedding_backward(TT_F32, n, dim, vocab, dy, ids, dw[k]);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; k++) CHECK(!memcmp(dw[0], dw[k], nw * sizeof(float)), "dweight differs, %d threads", k + 1);
  for (int k = 0; k < 3; k++) free(dw[k]);
  free(dy); free(ids);
}

int main(void) {
  const int64_t ns[] = {1, 5, 64}, dims[] = {1, 3, 17, 256, 768};
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 5; b++) check_values(ns[a], dims[b], 11);
  check_values(4096, 100, 37); /* parallel path, many repeats */
  check_values(300, 1000, 5000);
  check_bf16_lookup();
  check_gradient();
  check_determinism();
  double z = 0;
  int64_t id = 0;
  CHECK(tt_cpu_embedding(TT_I32, 1, 1, 1, &z, &id, &z) == TT_ERR_DTYPE, "i32 refused");
  CHECK(tt_cpu_embedding_backward(TT_BF16, 1, 1, 1, &z, &id, &z) == TT_ERR_DTYPE, "bf16 backward refused");
  return tt_test_summary("test_embed");
}
