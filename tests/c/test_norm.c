/*
 * test_norm.c — RMSNorm forward/backward against a plain double reference,
 * finite-difference gradients in f64, dw accumulation, thread-count
 * determinism; the fused residual add (bit-identical to add + norm) and the
 * backward accumulating dx onto a waiting gradient.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu/cpu.h"
#include "tt_test.h"

static const double EPS = 1e-5;

static void ref_rmsnorm(int64_t rows, int64_t dim, const double *x, const double *w, double *y, double *rstd) {
  for (int64_t r = 0; r < rows; r++) {
    double ss = 0;
    for (int64_t j = 0; j < dim; j++) ss += x[r * dim + j] * x[r * dim + j];
    rstd[r] = 1.0 / sqrt(ss / (double)dim + EPS);
    for (int64_t j = 0; j < dim; j++) y[r * dim + j] = x[r * dim + j] * rstd[r] * w[j];
  }
}

/* Straight from the chain rule through mean(x^2); dw accumulates. */
static void ref_rmsnorm_backward(int64_t rows, int64_t dim, const double *x, const double *w, const double *rstd,
                                 const double *dy, double *dx, double *dw) {
  for (int64_t r = 0; r < rows; r++) {
    const double *xr = x + r * dim, *g = dy + r * dim;
    double s = rstd[r], dot = 0;
    for (int64_t j = 0; j < dim; j++) dot += g[j] * w[j] * xr[j];
    for (int64_t j = 0; j < dim; j++) dx[r * dim + j] = s * w[j] * g[j] - xr[j] * s * s * s * dot / (double)dim;
    for (int64_t j = 0; j < dim; j++) dw[j] += g[j] * xr[j] * s;
  }
}

/* calloc: zeroed memory, so the compiler sees the inputs initialized. */
static double *dalloc(int64_t n) { return calloc((size_t)n + 1, sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }

static void nan_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void nan_f64(double *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void to_f32(const double *s, float *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (float)s[i]; }
static void to_f64(const float *s, double *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (double)s[i]; }

/* Forward and backward of one shape in both dtypes against the reference. */
static void check_values(int64_t rows, int64_t dim) {
  int64_t n = rows * dim;
  double *x = dalloc(n), *w = dalloc(dim), *dy = dalloc(n);
  double *dw0 = dalloc(dim), *y = dalloc(n), *rstd = dalloc(rows);
  double *dx = dalloc(n), *dw = dalloc(dim);
  double *ry = dalloc(n), *rrstd = dalloc(rows), *rdx = dalloc(n);
  double *rdw = dalloc(dim);
  tt_test_fill_f64(x, n, 2.0);
  for (int64_t j = 0; j < dim; j++) w[j] = 1.0 + 0.5 * tt_test_rand();
  tt_test_fill_f64(dy, n, 1.0);
  tt_test_fill_f64(dw0, dim, 1.0);

  /* f64: reference on the same inputs. */
  ref_rmsnorm(rows, dim, x, w, ry, rrstd);
  memcpy(rdw, dw0, dim * sizeof *rdw);
  ref_rmsnorm_backward(rows, dim, x, w, rrstd, dy, rdx, rdw);
  nan_f64(y, n); nan_f64(rstd, rows); nan_f64(dx, n);
  memcpy(dw, dw0, dim * sizeof *dw);
  CHECK(tt_cpu_rmsnorm(TT_F64, rows, dim, EPS, x, w, y, rstd) == TT_OK, "f64 forward");
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-13, "f64 y rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(y, ry, n));
  CHECK(tt_test_rel_err_f64(rstd, rrstd, rows) < 1e-13, "f64 rstd rows %ld dim %ld", (long)rows, (long)dim);
  CHECK(tt_cpu_rmsnorm_backward(TT_F64, rows, dim, x, w, rstd, dy, dx, dw, 0) == TT_OK, "f64 backward");
  CHECK(tt_test_rel_err_f64(dx, rdx, n) < 1e-12, "f64 dx rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dx, rdx, n));
  CHECK(tt_test_rel_err_f64(dw, rdw, dim) < 1e-12, "f64 dw rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dw, rdw, dim));
  nan_f64(dx, n);
  CHECK(tt_cpu_rmsnorm_backward(TT_F64, rows, dim, x, w, rstd, dy, dx, NULL, 0) == TT_OK, "f64 backward dw NULL");
  CHECK(tt_test_rel_err_f64(dx, rdx, n) < 1e-12, "f64 dx (dw NULL)");

  /* f32: inputs rounded to f32, reference in double on the rounded values. */
  float *xf = falloc(n), *wf = falloc(dim), *dyf = falloc(n);
  float *yf = falloc(n), *rstdf = falloc(rows), *dxf = falloc(n);
  float *dwf = falloc(dim);
  to_f32(x, xf, n); to_f32(w, wf, dim); to_f32(dy, dyf, n); to_f32(dw0, dwf, dim);
  to_f64(xf, x, n); to_f64(wf, w, dim); to_f64(dyf, dy, n); to_f64(dwf, rdw, dim);
  ref_rmsnorm(rows, dim, x, w, ry, rrstd);
  ref_rmsnorm_backward(rows, dim, x, w, rrstd, dy, rdx, rdw);
  nan_f32(yf, n); nan_f32(rstdf, rows); nan_f32(dxf, n);
  CHECK(tt_cpu_rmsnorm(TT_F32, rows, dim, EPS, xf, wf, yf, rstdf) == TT_OK, "f32 forward");
  to_f64(yf, y, n); to_f64(rstdf, rstd, rows);
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-6, "f32 y rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(y, ry, n));
  CHECK(tt_test_rel_err_f64(rstd, rrstd, rows) < 1e-6, "f32 rstd rows %ld dim %ld", (long)rows, (long)dim);
  CHECK(tt_cpu_rmsnorm_backward(TT_F32, rows, dim, xf, wf, rstdf, dyf, dxf, dwf, 0) == TT_OK, "f32 backward");
  to_f64(dxf, dx, n); to_f64(dwf, dw, dim);
  /* At dim 1, y = sign(x) w up to eps: dx is the cancellation of two O(1)
   * terms, so the f32 rounding of rstd alone costs ~1e-2 of it. */
  double dx_tol = dim == 1 ? 5e-2 : 1e-5;
  CHECK(tt_test_rel_err_f64(dx, rdx, n) < dx_tol, "f32 dx rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dx, rdx, n));
  CHECK(tt_test_rel_err_f64(dw, rdw, dim) < 1e-6, "f32 dw rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dw, rdw, dim));

  free(x); free(w); free(dy); free(dw0); free(y); free(rstd); free(dx); free(dw); free(ry); free(rrstd);
  free(rdx); free(rdw); free(xf); free(wf); free(dyf); free(yf); free(rstdf); free(dxf); free(dwf);
}

/* L = sum(g * rmsnorm(x, w)); compare backward's dx and dw (accumulated onto
 * a nonzero dw) with central differences. */
static double loss_of(int64_t rows, int64_t dim, const double *x, const double *w, const double *g, double *y,
                      double *rstd) {
  tt_cpu_rmsnorm(TT_F64, rows, dim, EPS, x, w, y, rstd);
  double l = 0;
  for (int64_t i = 0; i < rows * dim; i++) l += g[i] * y[i];
  return l;
}

static void check_gradients(int64_t rows, int64_t dim) {
  int64_t n = rows * dim;
  double *x = dalloc(n), *w = dalloc(dim), *g = dalloc(n);
  double *y = dalloc(n), *rstd = dalloc(rows), *dx = dalloc(n);
  double *dw = dalloc(dim), *dw0 = dalloc(dim);
  double *fdx = dalloc(n), *fdw = dalloc(dim);
  tt_test_fill_f64(x, n, 1.5);
  for (int64_t j = 0; j < dim; j++) w[j] = 1.0 + 0.5 * tt_test_rand();
  tt_test_fill_f64(g, n, 1.0);
  tt_test_fill_f64(dw0, dim, 1.0);
  const double h = 1e-6;
  for (int64_t i = 0; i < n; i++) {
    double s = x[i];
    x[i] = s + h; double lp = loss_of(rows, dim, x, w, g, y, rstd);
    x[i] = s - h; double lm = loss_of(rows, dim, x, w, g, y, rstd);
    x[i] = s;
    fdx[i] = (lp - lm) / (2 * h);
  }
  for (int64_t j = 0; j < dim; j++) {
    double s = w[j];
    w[j] = s + h; double lp = loss_of(rows, dim, x, w, g, y, rstd);
    w[j] = s - h; double lm = loss_of(rows, dim, x, w, g, y, rstd);
    w[j] = s;
    fdw[j] = (lp - lm) / (2 * h) + dw0[j];
  }
  loss_of(rows, dim, x, w, g, y, rstd);
  nan_f64(dx, n);
  memcpy(dw, dw0, dim * sizeof *dw);
  tt_cpu_rmsnorm_backward(TT_F64, rows, dim, x, w, rstd, g, dx, dw, 0);
  CHECK(tt_test_rel_err_f64(dx, fdx, n) < 1e-7, "fd dx rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dx, fdx, n));
  CHECK(tt_test_rel_err_f64(dw, fdw, dim) < 1e-7, "fd dw rows %ld dim %ld err %g", (long)rows, (long)dim,
        tt_test_rel_err_f64(dw, fdw, dim));
  free(x); free(w); free(g); free(y); free(rstd); free(dx); free(dw); free(dw0); free(fdx); free(fdw);
}

/* Same inputs, 1, 2 and 3 threads: bit-identical outputs (large enough to
 * take the parallel path). */
static void check_determinism(void) {
  const int64_t rows = 300, dim = 1000, n = rows * dim;
  float *x = falloc(n), *w = falloc(dim), *dy = falloc(n);
  float *y[3], *rstd[3], *dx[3], *dw[3];
  tt_test_fill_f32(x, n, 1.0);
  tt_test_fill_f32(w, dim, 1.0);
  tt_test_fill_f32(dy, n, 1.0);
  int saved = omp_get_max_threads();
  for (int k = 0; k < 3; k++) {
    y[k] = falloc(n); rstd[k] = falloc(rows);
    dx[k] = falloc(n); dw[k] = falloc(dim);
    omp_set_num_threads(k + 1);
    tt_cpu_rmsnorm(TT_F32, rows, dim, EPS, x, w, y[k], rstd[k]);
    tt_cpu_rmsnorm_backward(TT_F32, rows, dim, x, w, rstd[k], dy, dx[k], dw[k], 0);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; k++) {
    CHECK(!memcmp(y[0], y[k], n * sizeof(float)), "y differs with %d threads", k + 1);
    CHECK(!memcmp(dx[0], dx[k], n * sizeof(float)), "dx differs with %d threads", k + 1);
    CHECK(!memcmp(dw[0], dw[k], dim * sizeof(float)), "dw differs with %d threads", k + 1);
  }
  for (int k = 0; k < 3; k++) { free(y[k]); free(rstd[k]); free(dx[k]); free(dw[k]); }
  free(x); free(w); free(dy);
}

/* add_rmsnorm == (h = x + r; rmsnorm(h)) bit for bit; backward with dx
 * accumulation == dx0 + the written dx (f64: exactly up to one rounding). */
static void check_fused(int64_t rows, int64_t dim) {
  int64_t n = rows * dim;
  float *x = calloc(n, 4), *r = calloc(n, 4), *w = calloc(dim, 4), *h = calloc(n, 4), *y = calloc(n, 4),
        *rs = calloc(rows, 4), *h2 = calloc(n, 4), *y2 = calloc(n, 4), *rs2 = calloc(rows, 4);
  tt_test_fill_f32(x, n, 1.0);
  tt_test_fill_f32(r, n, 1.0);
  tt_test_fill_f32(w, dim, 1.0);
  CHECK(tt_cpu_add_rmsnorm(TT_F32, rows, dim, EPS, x, r, w, h, y, rs) == TT_OK, "f32 add_rmsnorm");
  for (int64_t i = 0; i < n; i++) h2[i] = x[i] + r[i];
  tt_cpu_rmsnorm(TT_F32, rows, dim, EPS, h2, w, y2, rs2);
  CHECK(memcmp(h, h2, n * 4) == 0, "fused h == x + r (%lld x %lld)", (long long)rows, (long long)dim);
  CHECK(memcmp(y, y2, n * 4) == 0, "fused y == rmsnorm(x + r) bit for bit (%lld x %lld)", (long long)rows,
        (long long)dim);
  CHECK(memcmp(rs, rs2, rows * 4) == 0, "fused rstd == rmsnorm's");

  double *xd = calloc(n, 8), *wd = calloc(dim, 8), *rsd = calloc(rows, 8), *yd = calloc(n, 8), *dy = calloc(n, 8),
         *dx = calloc(n, 8), *acc = calloc(n, 8), *dw = calloc(dim, 8), *dw2 = calloc(dim, 8);
  tt_test_fill_f64(xd, n, 1.0);
  tt_test_fill_f64(wd, dim, 1.0);
  tt_test_fill_f64(dy, n, 1.0);
  tt_test_fill_f64(acc, n, 1.0);
  tt_cpu_rmsnorm(TT_F64, rows, dim, EPS, xd, wd, yd, rsd);
  tt_cpu_rmsnorm_backward(TT_F64, rows, dim, xd, wd, rsd, dy, dx, dw, 0);
  double *want = calloc(n, 8);
  for (int64_t i = 0; i < n; i++) want[i] = acc[i] + dx[i];
  CHECK(tt_cpu_rmsnorm_backward(TT_F64, rows, dim, xd, wd, rsd, dy, acc, dw2, 1) == TT_OK, "f64 backward, accumulate");
  double err = tt_test_rel_err_f64(acc, want, n);
  CHECK(err <= 1e-15, "dx accumulated onto the waiting gradient: rel err %g", err);
  CHECK(memcmp(dw, dw2, dim * 8) == 0, "dw unaffected by dx accumulation");
  free(x); free(r); free(w); free(h); free(y); free(rs); free(h2); free(y2); free(rs2);
  free(xd); free(wd); free(rsd); free(yd); free(dy); free(dx); free(acc); free(dw); free(dw2); free(want);
}

int main(void) {
  const int64_t rows[] = {1, 5, 64}, dims[] = {1, 3, 17, 256, 768};
  for (int r = 0; r < 3; r++)
    for (int d = 0; d < 5; d++) check_values(rows[r], dims[d]);
  check_values(700, 300); /* parallel path, several dw column blocks */
  check_gradients(1, 1);
  check_gradients(3, 7);
  check_gradients(4, 130); /* crosses a dw column block */
  check_determinism();
  /* last: the checks above are tuned to the inputs the shared random stream gives them */
  check_fused(1, 1);
  check_fused(5, 17);
  check_fused(64, 768);
  check_fused(700, 300);
  double z = 0;
  CHECK(tt_cpu_rmsnorm(TT_BF16, 1, 1, EPS, &z, &z, &z, &z) == TT_ERR_DTYPE, "bf16 refused");
  CHECK(tt_cpu_rmsnorm_backward(TT_I64, 1, 1, &z, &z, &z, &z, &z, NULL, 0) == TT_ERR_DTYPE, "i64 refused");
  return tt_test_summary("test_norm");
}
