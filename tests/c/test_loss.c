/*
 * test_loss.c — fused cross-entropy against a plain long-double reference
 * (large and shifted logits, ignored and out-of-range targets), and its
 * backward by finite differences in f64.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu/cpu.h"
#include "tt_test.h"

#define IGNORE (-100)

static double *dalloc(int64_t n) { return calloc((size_t)n + 1, sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }
static void nan_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void nan_f64(double *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void to_f32(const double *s, float *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (float)s[i]; }
static void to_f64(const float *s, double *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (double)s[i]; }

static int ignored(int64_t t, int64_t V) { return t == IGNORE || t < 0 || t >= V; }

static void ref_cross_entropy(int64_t N, int64_t V, const double *x, const int64_t *t, const double *dl,
                              double *loss, double *lse, double *dx) {
  for (int64_t i = 0; i < N; i++) {
    const double *r = x + i * V;
    long double m = r[0], s = 0;
    for (int64_t j = 1; j < V; j++) m = r[j] > m ? r[j] : m;
    for (int64_t j = 0; j < V; j++) s += expl(r[j] - m);
    long double l = m + logl(s);
    lse[i] = (double)l;
    loss[i] = ignored(t[i], V) ? 0 : (double)(l - r[t[i]]);
    for (int64_t j = 0; j < V; j++)
      dx[i * V + j] = ignored(t[i], V) ? 0 : (double)(dl[i] * (expl(r[j] - l) - (j == t[i])));
  }
}

/* Targets: random classes, every fifth row ignored, plus one out-of-range
 * target each side when there are enough rows. */
static void make_targets(int64_t N, int64_t V, int64_t *t) {
  for (int64_t i = 0; i < N; i++) {
    t[i] = (int64_t)((tt_test_rand() + 1) * 0.5 * (double)V);
    if (t[i] >= V) t[i] = V - 1;
    if (i % 5 == 3) t[i] = IGNORE;
  }
  if (N > 8) { t[6] = V; t[7] = -3; }
}

static void check_values(int64_t N, int64_t V, double scale, double shift) {
  int64_t n = N * V;
  double *x = dalloc(n), *dl = dalloc(N), *loss = dalloc(N), *lse = dalloc(N), *dx = dalloc(n);
  double *rloss = dalloc(N), *rlse = dalloc(N), *rdx = dalloc(n);
  float *xf = falloc(n), *dlf = falloc(N), *lossf = falloc(N), *lsef = falloc(N), *dxf = falloc(n);
  int64_t *t = calloc((size_t)N, sizeof *t);
  tt_test_fill_f64(x, n, scale);
  for (int64_t i = 0; i < n; i++) x[i] += shift;
  tt_test_fill_f64(dl, N, 1.0);
  make_targets(N, V, t);

  ref_cross_entropy(N, V, x, t, dl, rloss, rlse, rdx);
  nan_f64(loss, N); nan_f64(lse, N); nan_f64(dx, n);
  CHECK(tt_cpu_cross_entropy(TT_F64, N, V, x, t, IGNORE, loss, lse) == TT_OK, "f64 forward");
  CHECK(tt_cpu_cross_entropy_backward(TT_F64, N, V, x, t, lse, dl, IGNORE, dx) == TT_OK, "f64 backward");
  /* Losses relative to the row's lse scale: a loss near 0 is a difference of two lse-sized numbers. */
  CHECK(tt_test_rel_err_f64(lse, rlse, N) < 1e-14, "f64 lse N %ld V %ld", (long)N, (long)V);
  double scl = fmax(fabs(shift) + scale, 1.0);
  for (int64_t i = 0; i < N; i++) {
    CHECK(fabs(loss[i] - rloss[i]) < 1e-14 * scl, "f64 loss N %ld V %ld row %ld: %g vs %g", (long)N, (long)V,
          (long)i, loss[i], rloss[i]);
    if (ignored(t[i], V)) CHECK(loss[i] == 0, "ignored row %ld has loss %g", (long)i, loss[i]);
  }
  CHECK(tt_test_rel_err_f64(dx, rdx, n) < 1e-12 * scl, "f64 dlogits N %ld V %ld err %g", (long)N, (long)V,
        tt_test_rel_err_f64(dx, rdx, n));

  to_f32(x, xf, n); to_f32(dl, dlf, N);
  to_f64(xf, x, n); to_f64(dlf, dl, N);
  ref_cross_entropy(N, V, x, t, dl, rloss, rlse, rdx);
  nan_f32(lossf, N); nan_f32(lsef, N); nan_f32(dxf, n);
  CHECK(tt_cpu_cross_entropy(TT_F32, N, V, xf, t, IGNORE, lossf, lsef) == TT_OK, "f32 forward");
  CHECK(tt_cpu_cross_entropy_backward(TT_F32, N, V, xf, t, lsef, dlf, IGNORE, dxf) == TT_OK, "f32 backward");
  to_f64(lossf, loss, N); to_f64(lsef, lse, N); to_f64(dxf, dx, n);
  CHECK(tt_test_rel_err_f64(lse, rlse, N) < 1e-6, "f32 lse N %ld V %ld", (long)N, (long)V);
  for (int64_t i = 0; i < N; i++)
    CHECK(fabs(loss[i] - rloss[i]) < 1e-6 * scl, "f32 loss N %ld V %ld row %ld: %g vs %g", (long)N, (long)V,
          (long)i, loss[i], rloss[i]);
  /* Softmax from an f32 lse: exp(x - lse) is off by ~ulp(lse) relative. */
  CHECK(tt_test_rel_err_f64(dx, rdx, n) < 1e-6 * scl, "f32 dlogits N %ld V %ld err %g", (long)N, (long)V,
        tt_test_rel_err_f64(dx, rdx, n));
  free(x); free(dl); free(loss); free(lse); free(dx); free(rloss); free(rlse); free(rdx);
  free(xf); free(dlf); free(lossf); free(lsef); free(dxf); free(t);
}

/* L = sum(c_i * loss_i); backward with dlosses = c against central differences. */
static void check_gradient(int64_t N, int64_t V) {
  int64_t n = N * V;
  double *x = dalloc(n), *c = dalloc(N), *loss = dalloc(N), *lse = dalloc(N), *dx = dalloc(n), *fd = dalloc(n);
  int64_t *t = calloc((size_t)N, sizeof *t);
  tt_test_fill_f64(x, n, 3.0);
  tt_test_fill_f64(c, N, 1.0);
  make_targets(N, V, t);
  const double h = 1e-6;
  for (int64_t k = 0; k < n; k++) {
    double keep = x[k], l[2];
    for (int side = 0; side < 2; side++) {
      x[k] = keep + (side ? -h : h);
      tt_cpu_cross_entropy(TT_F64, N, V, x, t, IGNORE, loss, lse);
      l[side] = 0;
      for (int64_t i = 0; i < N; i++) l[side] += c[i] * loss[i];
    }
    x[k] = keep;
    fd[k] = (l[0] - l[1]) / (2 * h);
  }
  tt_cpu_cross_entropy(TT_F64, N, V, x, t, IGNORE, loss, lse);
  nan_f64(dx, n);
  tt_cpu_cross_entropy_backward(TT_F64, N, V, x, t, lse, c, IGNORE, dx);
  CHECK(tt_test_rel_err_f64(dx, fd, n) < 1e-8, "fd dlogits N %ld V %ld err %g", (long)N, (long)V,
        tt_test_rel_err_f64(dx, fd, n));
  free(x); free(c); free(loss); free(lse); free(dx); free(fd); free(t);
}

/* One very large logit: every other exp underflows, the loss of the peak
 * class is ~0 and of any other ~the gap; nothing overflows. */
static void check_peaked(void) {
  float x[5] = {0, 3000, -5000, 1, 0}, loss[2], lse[2], dx[10];
  float xx[10];
  memcpy(xx, x, sizeof x);
  memcpy(xx + 5, x, sizeof x);
  int64_t t[2] = {1, 3};
  float dl[2] = {1, 1};
  tt_cpu_cross_entropy(TT_F32, 2, 5, xx, t, IGNORE, loss, lse);
  tt_cpu_cross_entropy_backward(TT_F32, 2, 5, xx, t, lse, dl, IGNORE, dx);
  CHECK(loss[0] == 0 && fabsf(loss[1] - 2999) < 1e-3f && lse[0] == 3000, "peaked: loss %g %g lse %g", loss[0],
        loss[1], lse[0]);
  CHECK(dx[1] == 0 && dx[0] == 0 && dx[6] == 1 && dx[8] == -1, "peaked dlogits");
  /* A NaN logit must surface as a NaN loss, not vanish in the vectorized exp. */
  float xn[40];
  for (int j = 0; j < 40; j++) xn[j] = (float)j * 0.1f;
  xn[21] = NAN;
  int64_t tn = 3;
  tt_cpu_cross_entropy(TT_F32, 1, 40, xn, &tn, IGNORE, loss, lse);
  CHECK(isnan(loss[0]), "NaN logit gives NaN loss (%g)", loss[0]);
}

/* A single logit far above the rest, at every position of the row (vector
 * lanes and tail alike): exp(x - max) overflows unless the max is right. */
static void check_peak_positions(void) {
  const int64_t V = 37;
  float lossf[37], lsef[37];
  double lossd[37], lsed[37];
  int64_t t[37];
  static float xfs[37 * 37];
  static double xds[37 * 37];
  for (int64_t p = 0; p < V; p++) {
    for (int64_t j = 0; j < V; j++) xfs[p * V + j] = (float)(xds[p * V + j] = j == p ? 500.0 : -1.0);
    t[p] = (p + 1) % V;
  }
  tt_cpu_cross_entropy(TT_F32, V, V, xfs, t, IGNORE, lossf, lsef);
  tt_cpu_cross_entropy(TT_F64, V, V, xds, t, IGNORE, lossd, lsed);
  int ok = 1;
  for (int64_t p = 0; p < V; p++)
    ok &= lsef[p] == 500.0f && lossf[p] == 501.0f && lsed[p] == 500.0 && lossd[p] == 501.0;
  CHECK(ok, "peak at every position");
}

/* dlogits written over the logits gives the same bits as a separate buffer. */
static void check_in_place(void) {
  const int64_t N = 9, V = 1000, n = N * V;
  float *x = falloc(n), *dl = falloc(N), *loss = falloc(N), *lse = falloc(N), *dx = falloc(n);
  int64_t *t = calloc((size_t)N, sizeof *t);
  tt_test_fill_f32(x, n, 5.0);
  tt_test_fill_f32(dl, N, 1.0);
  make_targets(N, V, t);
  tt_cpu_cross_entropy(TT_F32, N, V, x, t, IGNORE, loss, lse);
  tt_cpu_cross_entropy_backward(TT_F32, N, V, x, t, lse, dl, IGNORE, dx);
  tt_cpu_cross_entropy_backward(TT_F32, N, V, x, t, lse, dl, IGNORE, x);
  CHECK(!memcmp(x, dx, n * sizeof(float)), "in-place dlogits match");
  free(x); free(dl); free(loss); free(lse); free(dx); free(t);
}

/* Bit-identical results with 1, 2 and 3 threads on the parallel path. */
static void check_determinism(void) {
  const int64_t N = 37, V = 3001, n = N * V;
  float *x = falloc(n), *dl = falloc(N), *loss[3], *lse[3], *dx[3];
  int64_t *t = calloc((size_t)N, sizeof *t);
  tt_test_fill_f32(x, n, 8.0);
  tt_test_fill_f32(dl, N, 1.0);
  make_targets(N, V, t);
  int saved = omp_get_max_threads();
  for (int k = 0; k < 3; k++) {
    loss[k] = falloc(N); lse[k] = falloc(N); dx[k] = falloc(n);
    omp_set_num_threads(k + 1);
    tt_cpu_cross_entropy(TT_F32, N, V, x, t, IGNORE, loss[k], lse[k]);
    tt_cpu_cross_entropy_backward(TT_F32, N, V, x, t, lse[k], dl, IGNORE, dx[k]);
  }
  omp_set_num_threads(saved);
  for (int k = 1; k < 3; k++)
    CHECK(!memcmp(loss[0], loss[k], N * sizeof(float)) && !memcmp(lse[0], lse[k], N * sizeof(float)) &&
              !memcmp(dx[0], dx[k], n * sizeof(float)),
          "results differ with %d threads", k + 1);
  for (int k = 0; k < 3; k++) { free(loss[k]); free(lse[k]); free(dx[k]); }
  free(x); free(dl); free(t);
}

int main(void) {
  const int64_t Ns[] = {1, 5, 64}, Vs[] = {1, 3, 17, 256, 768};
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 5; b++) {
      check_values(Ns[a], Vs[b], 4.0, 0.0);
      check_values(Ns[a], Vs[b], 30.0, 1000.0); /* exp(x) alone would overflow */
    }
  check_values(40, 5000, 10.0, -50.0); /* parallel path */
  check_peaked();
  check_peak_positions();
  check_determinism();
  check_in_place();
  check_gradient(1, 1);
  check_gradient(3, 7);
  check_gradient(10, 11); /* ignored and out-of-range targets included */
  double z = 0;
  int64_t t0 = 0;
  CHECK(tt_cpu_cross_entropy(TT_BF16, 1, 1, &z, &t0, IGNORE, &z, &z) == TT_ERR_DTYPE, "bf16 refused");
  return tt_test_summary("test_loss");
}
