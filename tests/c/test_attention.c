/*
 * test_attention.c — attention forward/backward against a naive double
 * reference that materializes every score row, finite-difference gradients
 * in f64, rows that see no key, every output written (outputs start as
 * NaN), and bit-identical backward results whatever the thread count (which
 * also switches the CPU kernel between its fused and two-pass schedules).
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu/cpu.h"
#include "tt_test.h"

typedef struct {
  int64_t B, T, S, Hq, Hkv, D;
  int causal;
} shape;

static int64_t n_q(const shape *s) { return s->B * s->T * s->Hq * s->D; }
static int64_t n_kv(const shape *s) { return s->B * s->S * s->Hkv * s->D; }
static int64_t n_lse(const shape *s) { return s->B * s->Hq * s->T; }
static double scale_of(const shape *s) { return 1.0 / sqrt((double)s->D); }

/* calloc: zeroed memory, so the compiler sees the inputs initialized. */
static double *dalloc(int64_t n) { return calloc((size_t)n + 1, sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }
static void nan_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void nan_f64(double *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void to_f32(const double *s, float *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (float)s[i]; }
static void to_f64(const float *s, double *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (double)s[i]; }
static int all_finite_f64(const double *p, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(p[i])) return 0;
  return 1;
}

/* max|a-b| / max(max|b|, floor): the floor makes the check absolute for
 * gradients that are zero in theory (dq and dk of a query that sees one
 * key), which the kernel reproduces only up to rounding. */
static double grad_err(const double *a, const double *b, int64_t n, double floor) {
  double num = 0, den = floor;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs(a[i] - b[i]);
    if (d > num || isnan(d)) num = isnan(d) ? INFINITY : d;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

/* lse may be -inf (rows that see no key): equal infinities count as equal. */
static double lse_err(const double *a, const double *b, int64_t n) {
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    if (isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    double d = fabs(a[i] - b[i]);
    if (d > num || isnan(d)) num = isnan(d) ? INFINITY : d;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}

static int64_t visible_end(const shape *s, int64_t t) {
  if (!s->causal) return s->S;
  int64_t e = t + s->S - s->T + 1;
  return e < 0 ? 0 : e > s->S ? s->S : e;
}

/* The textbook definition: one full score row per query, softmax, then the
 * chain rule. dq/dk/dv are computed only when dout is given. */
static void ref_attention(const shape *s, const double *q, const double *k, const double *v, const double *dout,
                          double *o, double *lse, double *dq, double *dk, double *dv) {
  const int64_t D = s->D, group = s->Hq / s->Hkv;
  const double scale = scale_of(s);
  double *p = dalloc(s->S), *dp = dalloc(s->S);
  if (dout) {
    memset(dq, 0, sizeof(double) * (size_t)n_q(s));
    memset(dk, 0, sizeof(double) * (size_t)n_kv(s));
    memset(dv, 0, sizeof(double) * (size_t)n_kv(s));
  }
  for (int64_t b = 0; b < s->B; b++)
    for (int64_t h = 0; h < s->Hq; h++)
      for (int64_t t = 0; t < s->T; t++) {
        const int64_t kvh = h / group, n = visible_end(s, t);
        const double *qr = q + ((b * s->T + t) * s->Hq + h) * D;
        double *orow = o + ((b * s->T + t) * s->Hq + h) * D;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < n; j++) {
          const double *kr = k + ((b * s->S + j) * s->Hkv + kvh) * D;
          double x = 0;
          for (int64_t d = 0; d < D; d++) x += qr[d] * kr[d];
          p[j] = x * scale;
          if (p[j] > mx) mx = p[j];
        }
        for (int64_t j = 0; j < n; j++) sum += (p[j] = exp(p[j] - mx));
        for (int64_t d = 0; d < D; d++) orow[d] = 0;
        for (int64_t j = 0; j < n; j++) {
          const double *vr = v + ((b * s->S + j) * s->Hkv + kvh) * D;
          p[j] /= sum;
          for (int64_t d = 0; d < D; d++) orow[d] += p[j] * vr[d];
        }
        lse[(b * s->Hq + h) * s->T + t] = n ? mx + log(sum) : -INFINITY;
        if (!dout) continue;
        const double *g = dout + ((b * s->T + t) * s->Hq + h) * D;
        double di = 0;
        for (int64_t j = 0; j < n; j++) {
          const double *vr = v + ((b * s->S + j) * s->Hkv + kvh) * D;
          dp[j] = 0;
          for (int64_t d = 0; d < D; d++) dp[j] += g[d] * vr[d];
          di += p[j] * dp[j];
        }
        for (int64_t j = 0; j < n; j++) {
          const int64_t kat = ((b * s->S + j) * s->Hkv + kvh) * D;
          const double ds = p[j] * (dp[j] - di) * scale;
          for (int64_t d = 0; d < D; d++) {
            dq[((b * s->T + t) * s->Hq + h) * D + d] += ds * k[kat + d];
            dk[kat + d] += ds * qr[d];
            dv[kat + d] += p[j] * g[d];
          }
        }
      }
  free(p);
  free(dp);
}

typedef struct {
  double *q, *k, *v, *dout;                 /* inputs */
  double *o, *lse, *dq, *dk, *dv;           /* reference outputs */
} problem;

/* Random inputs; queries a bit larger so the softmax is not flat. */
static problem make_problem(const shape *s) {
  problem P;
  P.q = dalloc(n_q(s)), P.k = dalloc(n_kv(s)), P.v = dalloc(n_kv(s)), P.dout = dalloc(n_q(s));
  P.o = dalloc(n_q(s)), P.lse = dalloc(n_lse(s)), P.dq = dalloc(n_q(s));
  P.dk = dalloc(n_kv(s)), P.dv = dalloc(n_kv(s));
  tt_test_fill_f64(P.q, n_q(s), 3.0);
  tt_test_fill_f64(P.k, n_kv(s), 1.0);
  tt_test_fill_f64(P.v, n_kv(s), 1.0);
  tt_test_fill_f64(P.dout, n_q(s), 1.0);
  return P;
}
static void free_problem(problem *P) {
  double *ps[] = {P->q, P->k, P->v, P->dout, P->o, P->lse, P->dq, P->dk, P->dv};
  for (size_t i = 0; i < sizeof ps / sizeof *ps; i++) free(ps[i]);
}

#define SHAPE_FMT "B=%lld T=%lld S=%lld Hq=%lld Hkv=%lld D=%lld causal=%d"
#define SHAPE_ARGS(s) \
  (long long)(s)->B, (long long)(s)->T, (long long)(s)->S, (long long)(s)->Hq, (long long)(s)->Hkv, (long long)(s)->D, \
      (s)->causal

/* Forward and (when `backward`) backward of one shape, f64 then f32. The f32
 * inputs are the rounded f64 ones, and the reference runs on exactly those,
 * so the error measured is the kernel's own. */
static void check_values(shape s, int backward) {
  const int64_t nq = n_q(&s), nkv = n_kv(&s), nl = n_lse(&s);
  const double scale = scale_of(&s);
  problem P = make_problem(&s);
  /* Round the inputs to f32 first: both dtypes then see the same values. */
  float *q32 = falloc(nq), *k32 = falloc(nkv), *v32 = falloc(nkv), *g32 = falloc(nq);
  to_f32(P.q, q32, nq), to_f32(P.k, k32, nkv), to_f32(P.v, v32, nkv), to_f32(P.dout, g32, nq);
  to_f64(q32, P.q, nq), to_f64(k32, P.k, nkv), to_f64(v32, P.v, nkv), to_f64(g32, P.dout, nq);
  ref_attention(&s, P.q, P.k, P.v, backward ? P.dout : NULL, P.o, P.lse, P.dq, P.dk, P.dv);

  /* f64 */
  double *o = dalloc(nq), *lse = dalloc(nl), *dq = dalloc(nq), *dk = dalloc(nkv), *dv = dalloc(nkv);
  nan_f64(o, nq), nan_f64(lse, nl);
  tt_status st = tt_cpu_attention(TT_F64, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale, P.q, P.k, P.v, o, lse);
  CHECK(st == TT_OK, "f64 forward status %d", (int)st);
  double e = tt_test_rel_err_f64(o, P.o, nq);
  CHECK(e < 1e-12, "f64 o rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  e = lse_err(lse, P.lse, nl);
  CHECK(e < 1e-12, "f64 lse rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  if (backward) {
    nan_f64(dq, nq), nan_f64(dk, nkv), nan_f64(dv, nkv);
    st = tt_cpu_attention_backward(TT_F64, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale, P.q, P.k, P.v, o, lse,
                                   P.dout, dq, dk, dv);
    CHECK(st == TT_OK, "f64 backward status %d", (int)st);
    e = grad_err(dq, P.dq, nq, 1e-2);
    CHECK(e < 1e-11, "f64 dq rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
    e = grad_err(dk, P.dk, nkv, 1e-2);
    CHECK(e < 1e-11, "f64 dk rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
    e = grad_err(dv, P.dv, nkv, 1e-2);
    CHECK(e < 1e-11, "f64 dv rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  }

  /* f32 */
  float *o32 = falloc(nq), *lse32 = falloc(nl), *dq32 = falloc(nq), *dk32 = falloc(nkv), *dv32 = falloc(nkv);
  nan_f32(o32, nq), nan_f32(lse32, nl);
  st = tt_cpu_attention(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale, q32, k32, v32, o32, lse32);
  CHECK(st == TT_OK, "f32 forward status %d", (int)st);
  to_f64(o32, o, nq), to_f64(lse32, lse, nl);
  e = tt_test_rel_err_f64(o, P.o, nq);
  CHECK(e < 1e-5, "f32 o rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  e = lse_err(lse, P.lse, nl);
  CHECK(e < 1e-5, "f32 lse rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  if (backward) {
    nan_f32(dq32, nq), nan_f32(dk32, nkv), nan_f32(dv32, nkv);
    st = tt_cpu_attention_backward(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale, q32, k32, v32, o32,
                                   lse32, g32, dq32, dk32, dv32);
    CHECK(st == TT_OK, "f32 backward status %d", (int)st);
    to_f64(dq32, dq, nq), to_f64(dk32, dk, nkv), to_f64(dv32, dv, nkv);
    e = grad_err(dq, P.dq, nq, 1e-2);
    CHECK(e < 1e-5, "f32 dq rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
    e = grad_err(dk, P.dk, nkv, 1e-2);
    CHECK(e < 1e-5, "f32 dk rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
    e = grad_err(dv, P.dv, nkv, 1e-2);
    CHECK(e < 1e-5, "f32 dv rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  }
  free(o), free(lse), free(dq), free(dk), free(dv);
  free(o32), free(lse32), free(dq32), free(dk32), free(dv32);
  free(q32), free(k32), free(v32), free(g32);
  free_problem(&P);
}

/* L = sum(o * r): central differences against the backward with dout = r. */
static double fd_loss(const shape *s, const double *q, const double *k, const double *v, const double *r, double *o,
                      double *lse) {
  tt_cpu_attention(TT_F64, s->B, s->T, s->S, s->Hq, s->Hkv, s->D, s->causal, scale_of(s), q, k, v, o, lse);
  double L = 0;
  for (int64_t i = 0; i < n_q(s); i++) L += o[i] * r[i];
  return L;
}

static double fd_err(const shape *s, problem *P, double *x, const double *grad, int64_t n, double *o, double *lse) {
  const double h = 1e-5;
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = fd_loss(s, P->q, P->k, P->v, P->dout, o, lse);
    x[i] = x0 - h;
    const double lm = fd_loss(s, P->q, P->k, P->v, P->dout, o, lse);
    x[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    if (fabs(fd - grad[i]) > num || isnan(grad[i])) num = isnan(grad[i]) ? INFINITY : fabs(fd - grad[i]);
    if (fabs(fd) > den) den = fabs(fd);
  }
  return num / den;
}

static void check_gradients(shape s) {
  const int64_t nq = n_q(&s), nkv = n_kv(&s), nl = n_lse(&s);
  problem P = make_problem(&s);
  double *o = dalloc(nq), *lse = dalloc(nl), *dq = dalloc(nq), *dk = dalloc(nkv), *dv = dalloc(nkv);
  nan_f64(dq, nq), nan_f64(dk, nkv), nan_f64(dv, nkv);
  fd_loss(&s, P.q, P.k, P.v, P.dout, o, lse);
  tt_cpu_attention_backward(TT_F64, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale_of(&s), P.q, P.k, P.v, o, lse,
                            P.dout, dq, dk, dv);
  double e = fd_err(&s, &P, P.q, dq, nq, o, lse);
  CHECK(e < 1e-6, "fd dq rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  e = fd_err(&s, &P, P.k, dk, nkv, o, lse);
  CHECK(e < 1e-6, "fd dk rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  e = fd_err(&s, &P, P.v, dv, nkv, o, lse);
  CHECK(e < 1e-6, "fd dv rel err %.3g, " SHAPE_FMT, e, SHAPE_ARGS(&s));
  free(o), free(lse), free(dq), free(dk), free(dv);
  free_problem(&P);
}

/* Causal with fewer keys than queries: the first T - S queries see nothing
 * and must come out as o = 0, lse = -inf, dq = 0, with no NaN anywhere. */
static void check_unseen_rows(shape s) {
  const int64_t nq = n_q(&s), nkv = n_kv(&s), nl = n_lse(&s);
  problem P = make_problem(&s);
  float *q32 = falloc(nq), *k32 = falloc(nkv), *v32 = falloc(nkv), *g32 = falloc(nq);
  float *o32 = falloc(nq), *l32 = falloc(nl), *dq32 = falloc(nq), *dk32 = falloc(nkv), *dv32 = falloc(nkv);
  double *dq = dalloc(nq), *dk = dalloc(nkv), *dv = dalloc(nkv);
  to_f32(P.q, q32, nq), to_f32(P.k, k32, nkv), to_f32(P.v, v32, nkv), to_f32(P.dout, g32, nq);
  nan_f32(o32, nq), nan_f32(l32, nl), nan_f32(dq32, nq), nan_f32(dk32, nkv), nan_f32(dv32, nkv);
  tt_cpu_attention(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale_of(&s), q32, k32, v32, o32, l32);
  tt_cpu_attention_backward(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale_of(&s), q32, k32, v32, o32, l32,
                            g32, dq32, dk32, dv32);
  int bad = 0;
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t t = 0; t < s.T; t++)
      for (int64_t h = 0; h < s.Hq; h++) {
        const int unseen = visible_end(&s, t) == 0;
        const float lse = l32[(b * s.Hq + h) * s.T + t];
        if (unseen ? !(isinf(lse) && lse < 0) : !isfinite(lse)) bad++;
        for (int64_t d = 0; d < s.D; d++) {
          const int64_t i = ((b * s.T + t) * s.Hq + h) * s.D + d;
          if (unseen ? (o32[i] != 0 || dq32[i] != 0) : !(isfinite(o32[i]) && isfinite(dq32[i]))) bad++;
        }
      }
  CHECK(bad == 0, "%d bad elements in rows that see no key, " SHAPE_FMT, bad, SHAPE_ARGS(&s));
  to_f64(dk32, dk, nkv), to_f64(dv32, dv, nkv);
  CHECK(all_finite_f64(dk, nkv) && all_finite_f64(dv, nkv), "non-finite dk/dv, " SHAPE_FMT, SHAPE_ARGS(&s));
  free(q32), free(k32), free(v32), free(g32), free(o32), free(l32), free(dq32), free(dk32), free(dv32);
  free(dq), free(dk), free(dv);
  free_problem(&P);
}

/* The same call on 1, 2 and 3 threads gives the same bits. With B*Hkv = 3
 * groups the kernel runs its fused schedule on 1 and 3 threads and the
 * two-pass one on 2, so this also pins the two schedules to each other. */
static void check_determinism(shape s) {
  const int64_t nq = n_q(&s), nkv = n_kv(&s), nl = n_lse(&s);
  problem P = make_problem(&s);
  float *q = falloc(nq), *k = falloc(nkv), *v = falloc(nkv), *g = falloc(nq), *o = falloc(nq), *lse = falloc(nl);
  float *out[3][5];
  to_f32(P.q, q, nq), to_f32(P.k, k, nkv), to_f32(P.v, v, nkv), to_f32(P.dout, g, nq);
  const int saved = omp_get_max_threads();
  for (int r = 0; r < 3; r++) {
    float *oo = out[r][0] = falloc(nq), *ll = out[r][1] = falloc(nl);
    float *dq = out[r][2] = falloc(nq), *dk = out[r][3] = falloc(nkv), *dv = out[r][4] = falloc(nkv);
    omp_set_num_threads(r + 1);
    tt_cpu_attention(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale_of(&s), q, k, v, oo, ll);
    if (r == 0) memcpy(o, oo, sizeof(float) * (size_t)nq), memcpy(lse, ll, sizeof(float) * (size_t)nl);
    tt_cpu_attention_backward(TT_F32, s.B, s.T, s.S, s.Hq, s.Hkv, s.D, s.causal, scale_of(&s), q, k, v, o, lse, g, dq,
                              dk, dv);
  }
  omp_set_num_threads(saved);
  const int64_t sizes[5] = {nq, nl, nq, nkv, nkv};
  const char *names[5] = {"o", "lse", "dq", "dk", "dv"};
  for (int r = 1; r < 3; r++)
    for (int x = 0; x < 5; x++)
      CHECK(memcmp(out[r][x], out[0][x], sizeof(float) * (size_t)sizes[x]) == 0,
            "%s differs between 1 and %d threads, " SHAPE_FMT, names[x], r + 1, SHAPE_ARGS(&s));
  for (int r = 0; r < 3; r++)
    for (int x = 0; x < 5; x++) free(out[r][x]);
  free(q), free(k), free(v), free(g), free(o), free(lse);
  free_problem(&P);
}

int main(void) {
  /* {B, T, S, Hq, Hkv, D, causal} */
  const shape values[] = {
      {1, 1, 1, 1, 1, 16, 1},       {1, 1, 37, 2, 1, 64, 1},      {1, 1, 37, 2, 2, 17, 0},
      {2, 7, 7, 4, 2, 17, 1},       {1, 7, 7, 3, 3, 3, 0},        {2, 7, 7, 4, 1, 32, 1},
      {1, 128, 128, 4, 1, 64, 1},   {2, 128, 128, 2, 2, 16, 0},   {1, 128, 128, 2, 1, 3, 1},
      {1, 100, 160, 6, 3, 32, 1},   {1, 70, 130, 2, 1, 48, 0},    {1, 65, 200, 4, 2, 80, 1},
      {1, 33, 33, 2, 1, 128, 1},    {1, 20, 40, 1, 1, 256, 1},    {1, 67, 67, 2, 2, 256, 0},
      {1, 1024, 1024, 2, 1, 16, 1}, {1, 1024, 1024, 1, 1, 64, 1}, {1, 1024, 1024, 4, 2, 16, 1},
      {2, 256, 320, 4, 1, 64, 1},
  };

  for (size_t i = 0; i < sizeof values / sizeof *values; i++) check_values(values[i], 1);
  /* Forward only at T = 1024 in the odd / generic head dims. */
  check_values((shape){1, 1024, 1024, 1, 1, 17, 1}, 0);
  check_values((shape){1, 1024, 1024, 2, 2, 32, 0}, 0);

  const shape grads[] = {
      {1, 5, 5, 4, 2, 3, 1}, {2, 3, 6, 3, 1, 5, 1}, {1, 4, 4, 2, 2, 16, 0}, {1, 6, 9, 2, 1, 4, 0},
  };
  for (size_t i = 0; i < sizeof grads / sizeof *grads; i++) check_gradients(grads[i]);

  check_unseen_rows((shape){1, 9, 5, 2, 1, 16, 1});
  check_unseen_rows((shape){2, 80, 10, 2, 2, 3, 1});
  check_unseen_rows((shape){1, 130, 60, 1, 1, 64, 1});

  check_determinism((shape){1, 200, 200, 6, 3, 32, 1});
  check_determinism((shape){1, 150, 190, 3, 3, 16, 1});
  check_determinism((shape){3, 100, 100, 2, 1, 80, 0});
  check_determinism((shape){1, 130, 130, 3, 3, 48, 1});

  /* Only f32 and f64 exist on the CPU. */
  float one = 1;
  CHECK(tt_cpu_attention(TT_BF16, 1, 1, 1, 1, 1, 1, 1, 1.0, &one, &one, &one, &one, &one) == TT_ERR_DTYPE,
        "bf16 must be refused");
  CHECK(tt_cpu_attention_backward(TT_I32, 1, 1, 1, 1, 1, 1, 1, 1.0, &one, &one, &one, &one, &one, &one, &one, &one,
                                  &one) == TT_ERR_DTYPE,
        "i32 must be refused");
  return tt_test_summary("test_attention");
}
