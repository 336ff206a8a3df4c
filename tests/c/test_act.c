/*
 * test_act.c — SwiGLU forward/backward against a plain double reference
 * (including |a| large enough to overflow a naive exp), finite-difference
 * gradients in f64.
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
static void to_f64(const float *s, double *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (double)s[i]; }

/* long double keeps the reference ahead of the f64 kernel. */
static long double ref_sigmoid(long double a) { return 1.0L / (1.0L + expl(-a)); }

static void ref_swiglu(int64_t n, const double *a, const double *b, const double *dy, double *y, double *da,
                       double *db) {
  for (int64_t i = 0; i < n; i++) {
    long double s = ref_sigmoid(a[i]);
    y[i] = (double)(a[i] * s * b[i]);
    da[i] = (double)(dy[i] * b[i] * (s + a[i] * s * (1 - s)));
    db[i] = (double)(dy[i] * a[i] * s);
  }
}

/* Elementwise kernels: compare element by element, relative to each value
 * (with a floor), so tiny outputs of very negative a are checked too. */
static double max_rel(const double *x, const double *ref, int64_t n, double floor) {
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs(x[i] - ref[i]) / fmax(fabs(ref[i]), floor);
    if (isnan(e)) return INFINITY;
    worst = e > worst ? e : worst;
  }
  return worst;
}

static void check_values(int64_t n, double scale) {
  double *a = dalloc(n), *b = dalloc(n), *dy = dalloc(n), *y = dalloc(n), *da = dalloc(n), *db = dalloc(n);
  double *ry = dalloc(n), *rda = dalloc(n), *rdb = dalloc(n);
  float *af = falloc(n), *bf = falloc(n), *dyf = falloc(n), *yf = falloc(n), *daf = falloc(n), *dbf = falloc(n);
  tt_test_fill_f64(a, n, scale);
  tt_test_fill_f64(b, n, 1.0);
  tt_test_fill_f64(dy, n, 1.0);
  ref_swiglu(n, a, b, dy, ry, rda, rdb);
  nan_f64(y, n); nan_f64(da, n); nan_f64(db, n);
  CHECK(tt_cpu_swiglu(TT_F64, n, a, b, y) == TT_OK, "f64 swiglu");
  CHECK(tt_cpu_swiglu_backward(TT_F64, n, a, b, dy, da, db) == TT_OK, "f64 swiglu backward");
  CHECK(max_rel(y, ry, n, 1e-300) < 1e-14, "f64 y n %ld scale %g err %g", (long)n, scale, max_rel(y, ry, n, 1e-300));
  /* silu' = s (1 + a (1 - s)) crosses zero near a = -1.28 by cancellation,
   * so da gets an absolute floor where the other outputs get a relative one. */
  CHECK(max_rel(da, rda, n, 1e-4) < 1e-12, "f64 da n %ld scale %g err %g", (long)n, scale,
        max_rel(da, rda, n, 1e-4));
  CHECK(max_rel(db, rdb, n, 1e-300) < 1e-14, "f64 db n %ld scale %g", (long)n, scale);

  to_f32(a, af, n); to_f32(b, bf, n); to_f32(dy, dyf, n);
  to_f64(af, a, n); to_f64(bf, b, n); to_f64(dyf, dy, n);
  ref_swiglu(n, a, b, dy, ry, rda, rdb);
  nan_f32(yf, n); nan_f32(daf, n); nan_f32(dbf, n);
  CHECK(tt_cpu_swiglu(TT_F32, n, af, bf, yf) == TT_OK, "f32 swiglu");
  CHECK(tt_cpu_swiglu_backward(TT_F32, n, af, bf, dyf, daf, dbf) == TT_OK, "f32 swiglu backward");
  to_f64(yf, y, n); to_f64(daf, da, n); to_f64(dbf, db, n);
  /* Floors near 1e-36: for a below about -87, exp(a) is subnormal in f32
   * and carries only a few significant bits, which silu(a) = a exp(a) keeps. */
  CHECK(max_rel(y, ry, n, 1e-36) < 2e-6, "f32 y n %ld scale %g err %g", (long)n, scale, max_rel(y, ry, n, 1e-36));
  CHECK(max_rel(da, rda, n, 1e-2) < 2e-6, "f32 da n %ld scale %g err %g", (long)n, scale, max_rel(da, rda, n, 1e-2));
  CHECK(max_rel(db, rdb, n, 1e-36) < 2e-6, "f32 db n %ld scale %g err %g", (long)n, scale,
        max_rel(db, rdb, n, 1e-36));
  free(a); free(b); free(dy); free(y); free(da); free(db); free(ry); free(rda); free(rdb);
  free(af); free(bf); free(dyf); free(yf); free(daf); free(dbf);
}

/* Inputs where exp(-a) overflows or underflows: outputs must be finite and
 * right (silu(a) -> a for a >> 0, -> 0 from below for a << 0). */
static void check_extremes(void) {
  const double a[] = {-1e4, -1000, -100, -89, -88, -87.5, -87, -20, -1e-3, 0, 1e-3, 20, 87, 88, 100, 1000, 1e4};
  const int64_t n = sizeof a / sizeof a[0];
  double b[17], dy[17], y[17], da[17], db[17], ry[17], rda[17], rdb[17];
  float af[17], bf[17], dyf[17], yf[17], daf[17], dbf[17];
  for (int64_t i = 0; i < n; i++) b[i] = dy[i] = 1.0;
  ref_swiglu(n, a, b, dy, ry, rda, rdb);
  tt_cpu_swiglu(TT_F64, n, a, b, y);
  tt_cpu_swiglu_backward(TT_F64, n, a, b, dy, da, db);
  CHECK(max_rel(y, ry, n, 1e-300) < 1e-14, "f64 extremes y");
  CHECK(max_rel(da, rda, n, 1e-300) < 1e-13, "f64 extremes da err %g", max_rel(da, rda, n, 1e-300));
  to_f32(a, af, n); to_f32(b, bf, n); to_f32(dy, dyf, n);
  tt_cpu_swiglu(TT_F32, n, af, bf, yf);
  tt_cpu_swiglu_backward(TT_F32, n, af, bf, dyf, daf, dbf);
  to_f64(yf, y, n); to_f64(daf, da, n); to_f64(dbf, db, n);
  CHECK(max_rel(y, ry, n, 1e-36) < 2e-6, "f32 extremes y err %g", max_rel(y, ry, n, 1e-36));
  CHECK(max_rel(da, rda, n, 1e-36) < 2e-6, "f32 extremes da err %g", max_rel(da, rda, n, 1e-36));
  CHECK(max_rel(db, rdb, n, 1e-36) < 2e-6, "f32 extremes db err %g", max_rel(db, rdb, n, 1e-36));
}

/* A NaN input yields NaN outputs (the vectorized exp must not swallow it). */
static void check_nan(void) {
  float a[20], b[20], y[20], da[20], db[20];
  for (int i = 0; i < 20; i++) a[i] = b[i] = 1.0f;
  a[17] = NAN;
  tt_cpu_swiglu(TT_F32, 20, a, b, y);
  tt_cpu_swiglu_backward(TT_F32, 20, a, b, b, da, db);
  CHECK(isnan(y[17]) && isnan(da[17]) && isnan(db[17]) && !isnan(y[16]), "NaN propagates");
}

/* L = sum(g * swiglu(a, b)); backward with dy = g against central differences. */
static void check_gradient(int64_t n) {
  double *a = dalloc(n), *b = dalloc(n), *g = dalloc(n), *y = dalloc(n), *da = dalloc(n), *db = dalloc(n);
  double *fa = dalloc(n), *fb = dalloc(n);
  tt_test_fill_f64(a, n, 6.0);
  tt_test_fill_f64(b, n, 2.0);
  tt_test_fill_f64(g, n, 1.0);
  const double h = 1e-6;
  for (int which = 0; which < 2; which++) {
    double *p = which ? b : a, *fd = which ? fb : fa;
    for (int64_t k = 0; k < n; k++) {
      double keep = p[k], l[2];
      for (int side = 0; side < 2; side++) {
        p[k] = keep + (side ? -h : h);
        tt_cpu_swiglu(TT_F64, n, a, b, y);
        l[side] = 0;
        for (int64_t i = 0; i < n; i++) l[side] += g[i] * y[i];
      }
      p[k] = keep;
      fd[k] = (l[0] - l[1]) / (2 * h);
    }
  }
  tt_cpu_swiglu_backward(TT_F64, n, a, b, g, da, db);
  CHECK(tt_test_rel_err_f64(da, fa, n) < 1e-8, "fd da n %ld err %g", (long)n, tt_test_rel_err_f64(da, fa, n));
  CHECK(tt_test_rel_err_f64(db, fb, n) < 1e-8, "fd db n %ld err %g", (long)n, tt_test_rel_err_f64(db, fb, n));
  free(a); free(b); free(g); free(y); free(da); free(db); free(fa); free(fb);
}

/* y may be one of its inputs (in place). */
static void check_in_place(void) {
  const int64_t n = 1000;
  float *a = falloc(n), *b = falloc(n), *y = falloc(n);
  tt_test_fill_f32(a, n, 4.0);
  tt_test_fill_f32(b, n, 1.0);
  tt_cpu_swiglu(TT_F32, n, a, b, y);
  tt_cpu_swiglu(TT_F32, n, a, b, a);
  CHECK(!memcmp(a, y, n * sizeof(float)), "in place matches");
  free(a); free(b); free(y);
}

/* Bit-identical results with 1, 2 and 3 threads (an odd n on the parallel path). */
static void check_determinism(void) {
  const int64_t n = 300007;
  float *a = falloc(n), *b = falloc(n), *dy = falloc(n), *out[3][3];
  tt_test_fill_f32(a, n, 8.0);
  tt_test_fill_f32(b, n, 1.0);
  tt_test_fill_f32(dy, n, 1.0);
  int saved = omp_get_max_threads();
  for (int k = 0; k < 3; k++) {
    for (int m = 0; m < 3; m++) out[k][m] = falloc(n);
    omp_set_num_threads(k + 1);
    tt_cpu_swiglu(TT_F32, n, a, b, out[k][0]);
    tt_cpu_swiglu_backward(TT_F32, n, a, b, dy, out[k][1], out[k][2]);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; k++)
    for (int m = 0; m < 3; m++)
      CHECK(!memcmp(out[0][m], out[k][m], n * sizeof(float)), "output %d differs with %d threads", m, k + 1);
  for (int k = 0; k < 3; k++)
    for (int m = 0; m < 3; m++) free(out[k][m]);
  free(a); free(b); free(dy);
}

int main(void) {
  const int64_t ns[] = {1, 3, 17, 256, 768, 1001, 200003};
  for (int k = 0; k < 7; k++) {
    check_values(ns[k], 4.0);
    check_values(ns[k], 40.0);
  }
  check_values(100000, 120.0); /* well past where f32 exp(-a) overflows */
  check_extremes();
  check_nan();
  check_gradient(1);
  check_gradient(17);
  check_in_place();
  check_determinism();
  double z = 0;
  CHECK(tt_cpu_swiglu(TT_F16, 1, &z, &z, &z) == TT_ERR_DTYPE, "f16 refused");
  return tt_test_summary("test_act");
}
