/*
 * test_reduce.c — reduce, sum_to, softmax (+ backward) and sumsq of the CPU
 * backend against plain reference loops in double; softmax backward against
 * finite differences; bit-identical results on 1, 2 and 3 threads.
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

/* Outputs start as NaN (all bits set), so an unwritten element fails. */
static void poison(void *p, size_t nbytes) { memset(p, 0xff, nbytes); }

/* Inputs as the kernel sees them: f32 inputs are the rounded values, and
 * the reference reads exactly those. */
typedef struct {
  int dtype;
  int64_t n;
  void *data;
  double *ref;
} input;

static input make_input(int dtype, int64_t n, double scale, int ties) {
  input in = {dtype, n, NULL, NULL};
  in.ref = malloc((size_t)(n ? n : 1) * sizeof(double));
  in.data = malloc((size_t)(n ? n : 1) * 8);
  for (int64_t i = 0; i < n; i++) {
    double v = scale * tt_test_rand();
    if (ties) v = floor(v * 4.0) / 4.0; /* few distinct values: max ties */
    if (dtype == TT_F32) {
      ((float *)in.data)[i] = (float)v;
      in.ref[i] = (float)v;
    } else {
      ((double *)in.data)[i] = v;
      in.ref[i] = v;
    }
  }
  return in;
}

static void free_input(input *in) {
  free(in->data);
  free(in->ref);
}

static double get(int dtype, const void *p, int64_t i) {
  return dtype == TT_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

static const char *op_name(int op) {
  static const char *names[] = {"sum", "mean", "max", "norm2"};
  return names[op];
}

/* ---- reduce ----------------------------------------------------------- */

static void check_reduce(int op, int dtype, int64_t outer, int64_t n, int64_t inner, int ties) {
  input x = make_input(dtype, outer * n * inner, 2.0, ties);
  int64_t nout = outer * inner;
  size_t esz = dtype == TT_F32 ? 4 : 8;
  void *y = malloc((size_t)nout * esz);
  int64_t *idx = malloc((size_t)nout * sizeof(int64_t));
  poison(y, (size_t)nout * esz);
  poison(idx, (size_t)nout * sizeof(int64_t));
  tt_status st = tt_cpu_reduce(op, dtype, outer, n, inner, x.data, y, op == TT_RMAX ? idx : NULL);
  CHECK(st == TT_OK, "status %d", (int)st);
  double tol = dtype == TT_F32 ? 1e-6 : 1e-13;
  int bad = 0;
  for (int64_t o = 0; o < outer && !bad; o++)
    for (int64_t c = 0; c < inner && !bad; c++) {
      double s = 0, a = 0, sq = 0, best = -INFINITY;
      int64_t at = 0;
      for (int64_t j = 0; j < n; j++) {
        double v = x.ref[(o * n + j) * inner + c];
        s += v;
        a += fabs(v);
        sq += v * v;
        if (v > best) {
          best = v;
          at = j;
        }
      }
      double got = get(dtype, y, o * inner + c);
      int ok;
      switch (op) {
      case TT_RSUM: ok = fabs(got - s) <= tol * (a + 1e-300); break;
      case TT_RMEAN: ok = fabs(got - s / (double)n) <= tol * (a / (double)n + 1e-300); break;
      case TT_RNORM2: ok = fabs(got - sqrt(sq)) <= tol * sqrt(sq); break;
      default: ok = got == best && idx[o * inner + c] == at; break;
      }
      if (!ok) bad = 1;
      CHECK(ok, "%s dtype %d [%lld,%lld,%lld] at (%lld,%lld): got %.17g idx %lld, want sum %.17g max %.17g at %lld",
            op_name(op), dtype, (long long)outer, (long long)n, (long long)inner, (long long)o, (long long)c, got,
            op == TT_RMAX ? (long long)idx[o * inner + c] : -1LL, s, best, (long long)at);
    }
  free(y);
  free(idx);
  free_input(&x);
}

static void test_reduce_values(void) {
  /* [outer, n, inner]: ones, odd sizes, each code path (contiguous rows,
   * strided columns, few outputs split over blocks of n, many tiles). */
  static const int64_t shapes[][3] = {
      {1, 1, 1},    {1, 7, 1},       {3, 1, 5},     {5, 33, 1},    {4, 17, 3},     {2, 29, 300},
      {1, 1000, 1}, {1, 100003, 1},  {3, 70001, 1}, {1, 50001, 2}, {2, 40000, 8},  {1, 20001, 40},
      {37, 513, 1}, {300, 64, 1},    {6, 100, 257}, {1, 9, 17},    {20, 3000, 2},
  };
  int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
  int dtypes[] = {TT_F32, TT_F64};
  for (int d = 0; d < 2; d++)
    for (int op = TT_RSUM; op <= TT_RNORM2; op++)
      for (int s = 0; s < nshapes; s++) check_reduce(op, dtypes[d], shapes[s][0], shapes[s][1], shapes[s][2], 0);
  /* ties: the first maximum's index */
  for (int d = 0; d < 2; d++)
    for (int s = 0; s < nshapes; s++) check_reduce(TT_RMAX, dtypes[d], shapes[s][0], shapes[s][1], shapes[s][2], 1);
}

static void test_reduce_nan_and_max_edge(void) {
  /* A NaN is the max, and the first NaN's index is reported. */
  float x[2 * 6] = {1, 5, NAN, 2, NAN, 9, /* row 0 */ -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY,
                    -INFINITY};
  float y[2];
  int64_t idx[2];
  tt_cpu_reduce(TT_RMAX, TT_F32, 2, 6, 1, x, y, idx);
  CHECK(isnan(y[0]) && idx[0] == 2, "NaN max: %g at %lld", (double)y[0], (long long)idx[0]);
  CHECK(y[1] == -INFINITY && idx[1] == 0, "all -inf: %g at %lld", (double)y[1], (long long)idx[1]);
  /* the same through the strided path (inner = 2, columns interleaved) */
  float xc[6 * 2];
  for (int j = 0; j < 6; j++) {
    xc[j * 2] = x[j];
    xc[j * 2 + 1] = x[6 + j];
  }
  tt_cpu_reduce(TT_RMAX, TT_F32, 1, 6, 2, xc, y, idx);
  CHECK(isnan(y[0]) && idx[0] == 2 && y[1] == -INFINITY && idx[1] == 0, "strided NaN/-inf max");
  /* the blocked path: a NaN far into a long row */
  int64_t n = 300000;
  float *big = malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) big[i] = (float)(i % 1000);
  big[200000] = NAN;
  big[250000] = NAN;
  tt_cpu_reduce(TT_RMAX, TT_F32, 1, n, 1, big, y, idx);
  CHECK(isnan(y[0]) && idx[0] == 200000, "blocked NaN max at %lld", (long long)idx[0]);
  big[200000] = 0;
  big[250000] = 0;
  tt_cpu_reduce(TT_RMAX, TT_F32, 1, n, 1, big, y, idx);
  CHECK(y[0] == 999.0f && idx[0] == 999, "blocked first max at %lld", (long long)idx[0]);
  free(big);
  /* n == 0: empty sums are 0, the empty mean is NaN */
  double yd[3];
  poison(yd, sizeof yd);
  tt_cpu_reduce(TT_RSUM, TT_F64, 3, 0, 1, x, yd, NULL);
  CHECK(yd[0] == 0 && yd[1] == 0 && yd[2] == 0, "empty sum");
  CHECK(tt_cpu_reduce(TT_RSUM, TT_I32, 1, 1, 1, x, y, NULL) == TT_ERR_DTYPE, "i32 rejected");
}

/* ---- determinism ------------------------------------------------------ */

static void test_determinism(void) {
  /* One long f32 reduction (10M into one value) and several other shapes,
   * on 1, 2 and 3 threads: identical bits. */
  int64_t N = 10 * 1000 * 1000;
  float *x = malloc((size_t)N * sizeof(float));
  for (int64_t i = 0; i < N; i++) x[i] = (float)tt_test_rand() + 0.25f;
  static const int64_t shapes[][3] = {
      {1, 10000000, 1}, {1, 2000000, 5}, {7, 1000000, 1}, {3, 100000, 33}, {1, 40000, 250}, {1000, 10000, 1}};
  for (int s = 0; s < 6; s++)
    for (int op = TT_RSUM; op <= TT_RNORM2; op++) {
      int64_t outer = shapes[s][0], n = shapes[s][1], inner = shapes[s][2];
      int64_t nout = outer * inner;
      float *y[3];
      int64_t *idx[3];
      for (int t = 0; t < 3; t++) {
        y[t] = malloc((size_t)nout * sizeof(float));
        idx[t] = malloc((size_t)nout * sizeof(int64_t));
        poison(y[t], (size_t)nout * sizeof(float));
        poison(idx[t], (size_t)nout * sizeof(int64_t));
        set_threads(t + 1);
        tt_cpu_reduce(op, TT_F32, outer, n, inner, x, y[t], op == TT_RMAX ? idx[t] : NULL);
      }
      set_threads(2);
      for (int t = 1; t < 3; t++) {
        CHECK(memcmp(y[0], y[t], (size_t)nout * sizeof(float)) == 0, "%s [%lld,%lld,%lld]: %d threads differ",
              op_name(op), (long long)outer, (long long)n, (long long)inner, t + 1);
        if (op == TT_RMAX)
          CHECK(memcmp(idx[0], idx[t], (size_t)nout * sizeof(int64_t)) == 0, "max idx differ on %d threads", t + 1);
      }
      for (int t = 0; t < 3; t++) {
        free(y[t]);
        free(idx[t]);
      }
    }
  /* The 10M sum is also accurate (blocked lanes in double). */
  long double exact = 0;
  for (int64_t i = 0; i < N; i++) exact += x[i];
  float sum32 = NAN;
  tt_cpu_reduce(TT_RSUM, TT_F32, 1, N, 1, x, &sum32, NULL);
  CHECK(fabsl((long double)sum32 - exact) <= 1e-7L * fabsl(exact), "f32 10M sum %.9g vs %.17Lg", (double)sum32, exact);
  double got;
  tt_cpu_sumsq(TT_F32, N, x, &got);
  long double exact_sq = 0;
  for (int64_t i = 0; i < N; i++) exact_sq += (long double)x[i] * x[i];
  CHECK(fabsl((long double)got - exact_sq) <= 1e-12L * exact_sq, "sumsq 10M: %.17g vs %.17Lg", got, exact_sq);
  double d[3];
  for (int t = 0; t < 3; t++) {
    set_threads(t + 1);
    tt_cpu_sumsq(TT_F32, N, x, &d[t]);
  }
  set_threads(2);
  CHECK(memcmp(&d[0], &d[1], sizeof(double)) == 0 && memcmp(&d[0], &d[2], sizeof(double)) == 0,
        "sumsq differs across threads");
  double sd[3];
  double *xd = malloc((size_t)N * sizeof(double));
  for (int64_t i = 0; i < N; i++) xd[i] = x[i];
  for (int t = 0; t < 3; t++) {
    set_threads(t + 1);
    tt_cpu_reduce(TT_RSUM, TT_F64, 1, N, 1, xd, &sd[t], NULL);
  }
  set_threads(2);
  CHECK(memcmp(&sd[0], &sd[1], 8) == 0 && memcmp(&sd[0], &sd[2], 8) == 0, "f64 10M sum differs across threads");
  CHECK(fabsl((long double)sd[0] - exact) <= 1e-12L * fabsl(exact), "f64 10M sum %.17g vs %.17Lg", sd[0], exact);
  free(xd);
  free(x);
}

/* ---- sumsq ------------------------------------------------------------ */

static void test_sumsq(void) {
  int64_t sizes[] = {0, 1, 15, 16, 17, 1000, 65537, 300001};
  for (int s = 0; s < 8; s++) {
    int64_t n = sizes[s];
    float *f = malloc((size_t)(n + 1) * 4);
    double *d = malloc((size_t)(n + 1) * 8);
    uint16_t *b = malloc((size_t)(n + 1) * 2), *h = malloc((size_t)(n + 1) * 2);
    /* long double references: a plain double loop over 300k terms is
     * itself less accurate than the kernel's blocked lanes. */
    long double rf = 0, rd = 0, rb = 0, rh = 0;
    for (int64_t i = 0; i < n; i++) {
      double v = 3.0 * tt_test_rand();
      f[i] = (float)v;
      d[i] = v;
      b[i] = tt_f32_to_bf16((float)v);
      /* f16 inputs stay normal (|v| >= 2^-14): only the decoder is involved */
      h[i] = tt_f32_to_f16((float)(v < 0 ? v - 0.001 : v + 0.001));
      rf += (long double)f[i] * f[i];
      rd += (long double)v * v;
      long double vb = tt_bf16_to_f32(b[i]), vh = tt_f16_to_f32(h[i]);
      rb += vb * vb;
      rh += vh * vh;
    }
    double got[4] = {NAN, NAN, NAN, NAN};
    CHECK(tt_cpu_sumsq(TT_F32, n, f, &got[0]) == TT_OK, "sumsq f32");
    tt_cpu_sumsq(TT_F64, n, d, &got[1]);
    tt_cpu_sumsq(TT_BF16, n, b, &got[2]);
    tt_cpu_sumsq(TT_F16, n, h, &got[3]);
    double want[4] = {(double)rf, (double)rd, (double)rb, (double)rh};
    for (int k = 0; k < 4; k++)
      CHECK(fabs(got[k] - want[k]) <= 1e-13 * want[k] + (n == 0 ? 0 : 1e-300), "sumsq n=%lld kind %d: %.17g vs %.17g",
            (long long)n, k, got[k], want[k]);
    free(f);
    free(d);
    free(b);
    free(h);
  }
  double out;
  CHECK(tt_cpu_sumsq(TT_I64, 4, sizes, &out) == TT_ERR_DTYPE, "i64 rejected");
}

/* ---- sum_to ----------------------------------------------------------- */

static void check_sum_to(int dtype, int ndim, const int64_t *shape, const int64_t *oshape) {
  int64_t total = 1, nout = 1;
  for (int d = 0; d < ndim; d++) {
    total *= shape[d];
    nout *= oshape[d];
  }
  input x = make_input(dtype, total, 1.0, 0);
  size_t esz = dtype == TT_F32 ? 4 : 8;
  void *out = malloc((size_t)(nout ? nout : 1) * esz);
  poison(out, (size_t)(nout ? nout : 1) * esz);
  double *ref = calloc((size_t)(nout ? nout : 1), sizeof(double));
  double *mag = calloc((size_t)(nout ? nout : 1), sizeof(double));
  /* Scatter every element of x to the output index it broadcasts from. */
  for (int64_t i = 0; i < total; i++) {
    int64_t rem = i, o = 0, ostride = 1;
    for (int d = ndim - 1; d >= 0; d--) {
      int64_t c = rem % shape[d];
      rem /= shape[d];
      if (oshape[d] != 1) o += c * ostride;
      ostride *= oshape[d];
    }
    ref[o] += x.ref[i];
    mag[o] += fabs(x.ref[i]);
  }
  tt_status st = tt_cpu_sum_to(dtype, ndim, shape, x.data, oshape, out);
  CHECK(st == TT_OK, "sum_to status %d", (int)st);
  double tol = dtype == TT_F32 ? 1e-6 : 1e-13;
  int64_t bad = -1;
  for (int64_t k = 0; k < nout && bad < 0; k++)
    if (!(fabs(get(dtype, out, k) - ref[k]) <= tol * mag[k] + 1e-300 || (mag[k] == 0 && get(dtype, out, k) == 0)))
      bad = k;
  char desc[128];
  int len = 0;
  for (int d = 0; d < ndim; d++)
    len += snprintf(desc + len, sizeof desc - (size_t)len, "%lld->%lld ", (long long)shape[d], (long long)oshape[d]);
  CHECK(bad < 0, "sum_to dtype %d [%s] at %lld: got %.17g want %.17g", dtype, desc, (long long)bad,
        bad >= 0 ? get(dtype, out, bad) : 0.0, bad >= 0 ? ref[bad] : 0.0);
  free(out);
  free(ref);
  free(mag);
  free_input(&x);
}

static void test_sum_to(void) {
  struct {
    int ndim;
    int64_t shape[4], out[4];
  } cases[] = {
      {3, {4, 5, 6}, {1, 5, 6}},         /* leading: bias gradient */
      {3, {4, 5, 6}, {4, 1, 6}},         /* middle */
      {3, {4, 5, 6}, {4, 5, 1}},         /* trailing */
      {3, {4, 5, 6}, {1, 1, 1}},         /* everything */
      {3, {4, 5, 6}, {1, 5, 1}},         /* two groups, innermost summed */
      {4, {3, 4, 5, 6}, {1, 4, 1, 6}},   /* two groups, innermost kept */
      {4, {3, 4, 5, 6}, {3, 1, 5, 1}},   /* kept, summed, kept, summed */
      {4, {2, 1, 3, 4}, {1, 1, 3, 1}},   /* a size-1 dim in the input */
      {4, {2, 3, 4, 5}, {1, 1, 4, 5}},   /* adjacent summed dims merge */
      {3, {4, 5, 6}, {4, 5, 6}},         /* nothing to sum */
      {2, {1, 7}, {1, 7}},               /* all kept with ones */
      {0, {0}, {0}},                     /* 0-d */
      {2, {0, 3}, {1, 3}},               /* empty sum gives zeros */
      {2, {300, 1000}, {1, 1000}},       /* parallel over columns */
      {2, {1000, 300}, {1000, 1}},       /* parallel over rows */
      {3, {64, 33, 257}, {1, 33, 1}},    /* general, parallel */
      {3, {2, 100000, 3}, {2, 1, 3}},    /* few outputs, long reduction */
      {4, {5, 40, 3, 70}, {5, 1, 3, 1}}, /* general, innermost summed */
  };
  int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int c = 0; c < ncases; c++) {
    check_sum_to(TT_F32, cases[c].ndim, cases[c].shape, cases[c].out);
    check_sum_to(TT_F64, cases[c].ndim, cases[c].shape, cases[c].out);
  }
  /* deterministic across threads on the general path too */
  int64_t shape[3] = {64, 300, 513}, oshape[3] = {1, 300, 1};
  input x = make_input(TT_F32, 64 * 300 * 513, 1.0, 0);
  float a[300], b[300];
  set_threads(1);
  tt_cpu_sum_to(TT_F32, 3, shape, x.data, oshape, a);
  set_threads(2);
  tt_cpu_sum_to(TT_F32, 3, shape, x.data, oshape, b);
  CHECK(memcmp(a, b, sizeof a) == 0, "sum_to differs across threads");
  free_input(&x);
}

/* ---- softmax ---------------------------------------------------------- */

static void ref_softmax(int lg, int64_t rows, int64_t n, const double *x, double *y) {
  for (int64_t r = 0; r < rows; r++) {
    const double *xr = x + r * n;
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < n; i++) m = xr[i] > m ? xr[i] : m;
    for (int64_t i = 0; i < n; i++) s += exp(xr[i] - m);
    for (int64_t i = 0; i < n; i++) y[r * n + i] = lg ? xr[i] - m - log(s) : exp(xr[i] - m) / s;
  }
}

static void test_softmax_values(void) {
  static const int64_t shapes[][2] = {{1, 1}, {3, 1}, {1, 17}, {5, 33}, {2, 1000}, {64, 257}, {300, 100}};
  for (int dti = 0; dti < 2; dti++)
    for (int lg = 0; lg < 2; lg++)
      for (int s = 0; s < 7; s++) {
        int dtype = dti ? TT_F64 : TT_F32;
        int64_t rows = shapes[s][0], n = shapes[s][1];
        input x = make_input(dtype, rows * n, 30.0, 0); /* wide range: needs the max shift */
        size_t esz = dtype == TT_F32 ? 4 : 8;
        void *y = malloc((size_t)(rows * n) * esz);
        double *ref = malloc((size_t)(rows * n) * sizeof(double));
        poison(y, (size_t)(rows * n) * esz);
        CHECK(tt_cpu_softmax(dtype, rows, n, lg, x.data, y) == TT_OK, "softmax status");
        ref_softmax(lg, rows, n, x.ref, ref);
        double err = 0, mx = 0;
        for (int64_t i = 0; i < rows * n; i++) {
          double d = fabs(get(dtype, y, i) - ref[i]);
          err = (d > err || isnan(d)) ? (isnan(d) ? INFINITY : d) : err;
          /* log-softmax values are judged against their own size (and 1) */
          double scale = lg ? fmax(1.0, fabs(ref[i])) : 1.0;
          if (d / scale > mx || isnan(d)) mx = isnan(d) ? INFINITY : d / scale;
        }
        double tol = dtype == TT_F32 ? 2e-6 : 1e-13;
        CHECK(mx <= tol, "softmax dtype %d log %d [%lld,%lld]: err %g", dtype, lg, (long long)rows, (long long)n, mx);
        /* in place gives the same bits */
        void *z = malloc((size_t)(rows * n) * esz);
        memcpy(z, x.data, (size_t)(rows * n) * esz);
        tt_cpu_softmax(dtype, rows, n, lg, z, z);
        CHECK(memcmp(z, y, (size_t)(rows * n) * esz) == 0, "softmax in place differs");
        free(z);
        free(y);
        free(ref);
        free_input(&x);
      }
}

/* Finite differences in f64 of L = sum(w * softmax(x)): the backward with
 * dy = w must equal dL/dx. */
static void test_softmax_backward_fd(void) {
  static const int64_t shapes[][2] = {{1, 1}, {1, 5}, {3, 17}, {2, 40}};
  for (int lg = 0; lg < 2; lg++)
    for (int s = 0; s < 4; s++) {
      int64_t rows = shapes[s][0], n = shapes[s][1], tot = rows * n;
      double *x = malloc((size_t)tot * 8), *w = malloc((size_t)tot * 8), *y = malloc((size_t)tot * 8);
      double *dx = malloc((size_t)tot * 8), *yp = malloc((size_t)tot * 8), *fd = malloc((size_t)tot * 8);
      tt_test_fill_f64(x, tot, 3.0);
      tt_test_fill_f64(w, tot, 1.0);
      tt_cpu_softmax(TT_F64, rows, n, lg, x, y);
      poison(dx, (size_t)tot * 8);
      CHECK(tt_cpu_softmax_backward(TT_F64, rows, n, lg, y, w, dx) == TT_OK, "softmax_backward status");
      double h = 1e-5;
      for (int64_t i = 0; i < tot; i++) {
        double keep = x[i], lp = 0, lm = 0;
        x[i] = keep + h;
        tt_cpu_softmax(TT_F64, rows, n, lg, x, yp);
        for (int64_t k = 0; k < tot; k++) lp += w[k] * yp[k];
        x[i] = keep - h;
        tt_cpu_softmax(TT_F64, rows, n, lg, x, yp);
        for (int64_t k = 0; k < tot; k++) lm += w[k] * yp[k];
        x[i] = keep;
        fd[i] = (lp - lm) / (2 * h);
      }
      double err = tt_test_rel_err_f64(dx, fd, tot);
      /* n == 1 softmax has a zero gradient: compare absolutely */
      double abs_err = 0;
      for (int64_t i = 0; i < tot; i++) abs_err = fmax(abs_err, fabs(dx[i] - fd[i]));
      CHECK(err <= 1e-7 || abs_err <= 1e-9, "softmax backward FD log %d [%lld,%lld]: rel err %g", lg, (long long)rows,
            (long long)n, err);
      /* f32 backward agrees with f64 on the same (rounded) inputs */
      float *yf = malloc((size_t)tot * 4), *wf = malloc((size_t)tot * 4), *dxf = malloc((size_t)tot * 4);
      for (int64_t i = 0; i < tot; i++) {
        yf[i] = (float)y[i];
        wf[i] = (float)w[i];
        y[i] = yf[i];
        w[i] = wf[i];
      }
      poison(dxf, (size_t)tot * 4);
      tt_cpu_softmax_backward(TT_F32, rows, n, lg, yf, wf, dxf);
      tt_cpu_softmax_backward(TT_F64, rows, n, lg, y, w, dx);
      double e32 = 0, mx = 1e-30;
      for (int64_t i = 0; i < tot; i++) {
        e32 = fmax(e32, fabs((double)dxf[i] - dx[i]));
        mx = fmax(mx, fabs(w[i]));
      }
      CHECK(e32 <= 1e-6 * mx && !isnan(e32), "softmax backward f32 vs f64 log %d: %g", lg, e32);
      free(yf);
      free(wf);
      free(dxf);
      free(x);
      free(w);
      free(y);
      free(dx);
      free(yp);
      free(fd);
    }
  /* a large batch runs the parallel path and matches the serial bits */
  int64_t rows = 512, n = 300, tot = rows * n;
  float *y = malloc((size_t)tot * 4), *dy = malloc((size_t)tot * 4), *a = malloc((size_t)tot * 4),
        *b = malloc((size_t)tot * 4);
  tt_test_fill_f32(dy, tot, 1.0);
  tt_test_fill_f32(a, tot, 5.0);
  tt_cpu_softmax(TT_F32, rows, n, 0, a, y);
  set_threads(1);
  tt_cpu_softmax_backward(TT_F32, rows, n, 0, y, dy, a);
  set_threads(2);
  tt_cpu_softmax_backward(TT_F32, rows, n, 0, y, dy, b);
  CHECK(memcmp(a, b, (size_t)tot * 4) == 0, "softmax backward differs across threads");
  free(y);
  free(dy);
  free(a);
  free(b);
}

int main(void) {
  set_threads(2);
  test_reduce_values();
  test_reduce_nan_and_max_edge();
  test_sumsq();
  test_sum_to();
  test_softmax_values();
  test_softmax_backward_fd();
  test_determinism();
  return tt_test_summary("test_reduce");
}
