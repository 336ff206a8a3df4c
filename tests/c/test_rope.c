/*
 * test_rope.c — RoPE table (plain and Llama 3.1 scaled) against an
 * independent transcription of Meta's formulas and known values; rotation
 * against a plain reference (in and out of place, position offsets); the
 * inverse rotation as the gradient, by finite differences in f64.
 */
#include <math.h>
#include <string.h>

#include "cpu/cpu.h"
#include "tt_test.h"

static double *dalloc(int64_t n) { return calloc((size_t)n + 1, sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }
static void nan_f32(float *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void nan_f64(double *p, int64_t n) { for (int64_t i = 0; i < n; i++) p[i] = NAN; }
static void to_f32(const double *s, float *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (float)s[i]; }
static void to_f64(const float *s, double *d, int64_t n) { for (int64_t i = 0; i < n; i++) d[i] = (double)s[i]; }

/* Meta's llama3 model.py, transcribed: freqs = 1 / theta^(arange(0, dim, 2) / dim),
 * then apply_scaling(freqs) loops over them with the Llama 3.1 constants. */
static void meta_freqs(int64_t dim, double theta, int scaled, double *out) {
  for (int64_t k = 0; k < dim; k += 2) out[k / 2] = 1.0 / pow(theta, (double)k / (double)dim);
  if (!scaled) return;
  const double scale_factor = 8, low_freq_factor = 1, high_freq_factor = 4, old_context_len = 8192;
  double low_freq_wavelen = old_context_len / low_freq_factor;
  double high_freq_wavelen = old_context_len / high_freq_factor;
  for (int64_t i = 0; i < dim / 2; i++) {
    double freq = out[i], wavelen = 2 * M_PI / freq;
    if (wavelen < high_freq_wavelen) {
      out[i] = freq;
    } else if (wavelen > low_freq_wavelen) {
      out[i] = freq / scale_factor;
    } else {
      double smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      out[i] = (1 - smooth) * freq / scale_factor + smooth * freq;
    }
  }
}

static void check_table(int64_t D, int64_t S, double theta, int scaled) {
  int64_t half = D / 2, n = S * half;
  double *c = dalloc(n), *s = dalloc(n), *f = dalloc(half), *rc = dalloc(n), *rs = dalloc(n);
  float *cf = falloc(n), *sf = falloc(n);
  double *cf64 = dalloc(n), *sf64 = dalloc(n);
  meta_freqs(D, theta, scaled, f);
  for (int64_t p = 0; p < S; p++)
    for (int64_t i = 0; i < half; i++) {
      rc[p * half + i] = cos((double)p * f[i]);
      rs[p * half + i] = sin((double)p * f[i]);
    }
  double sc = scaled ? 8.0 : 1.0;
  nan_f64(c, n); nan_f64(s, n);
  CHECK(tt_cpu_rope_table(TT_F64, D, S, theta, sc, 1.0, 4.0, 8192, c, s) == TT_OK, "f64 table");
  CHECK(tt_test_rel_err_f64(c, rc, n) < 1e-12 && tt_test_rel_err_f64(s, rs, n) < 1e-12,
        "f64 table D %ld S %ld scaled %d: cos err %g sin err %g", (long)D, (long)S, scaled,
        tt_test_rel_err_f64(c, rc, n), tt_test_rel_err_f64(s, rs, n));
  if (S > 1) { /* position 1 holds the frequencies themselves (all < pi) */
    double worst = 0;
    for (int64_t i = 0; i < half; i++) {
      double e = fabs(atan2(s[half + i], c[half + i]) - f[i]) / f[i];
      worst = e > worst ? e : worst;
    }
    CHECK(worst < 1e-12, "freqs D %ld scaled %d rel err %g", (long)D, scaled, worst);
  }
  nan_f32(cf, n); nan_f32(sf, n);
  CHECK(tt_cpu_rope_table(TT_F32, D, S, theta, sc, 1.0, 4.0, 8192, cf, sf) == TT_OK, "f32 table");
  to_f64(cf, cf64, n); to_f64(sf, sf64, n);
  CHECK(tt_test_rel_err_f64(cf64, rc, n) < 1e-7 && tt_test_rel_err_f64(sf64, rs, n) < 1e-7,
        "f32 table D %ld S %ld scaled %d", (long)D, (long)S, scaled);
  free(c); free(s); free(f); free(rc); free(rs); free(cf); free(sf); free(cf64); free(sf64);
}

/* Llama 3.1 (D 128, theta 500000) frequencies from running Meta's
 * apply_scaling in Python, one or more per regime: kept (0, 28), blended
 * (29, 32, 34), divided by 8 (35, 63). */
static void check_llama31_known(void) {
  const int64_t D = 128, half = 64, S = 2;
  const int idx[] = {0, 28, 29, 32, 34, 35, 63};
  const double want[] = {1.0, 0.0032114459947525913, 0.002166570763503359, 0.0005248461609929547,
                         0.00017850781276799638, 9.556212353964683e-05, 3.068925988914511e-07};
  double c[S * 64], s[S * 64];
  CHECK(tt_cpu_rope_table(TT_F64, D, S, 500000.0, 8.0, 1.0, 4.0, 8192, c, s) == TT_OK, "llama 3.1 table");
  for (int k = 0; k < 7; k++) {
    double got = atan2(s[half + idx[k]], c[half + idx[k]]);
    CHECK(fabs(got - want[k]) <= 1e-13 * want[k], "llama 3.1 freq %d: got %.17g want %.17g", idx[k], got, want[k]);
  }
}

static void ref_rope(int64_t B, int64_t T, int64_t H, int64_t D, const double *x, const double *c, const double *s,
                     int64_t off, int inverse, double *y) {
  int64_t half = D / 2;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < half; i++) {
          const double *xp = x + ((b * T + t) * H + h) * D + 2 * i;
          double *yp = y + ((b * T + t) * H + h) * D + 2 * i;
          double cc = c[(off + t) * half + i], ss = s[(off + t) * half + i] * (inverse ? -1 : 1);
          yp[0] = xp[0] * cc - xp[1] * ss;
          yp[1] = xp[0] * ss + xp[1] * cc;
        }
}

static void check_rope(int64_t B, int64_t T, int64_t H, int64_t D, int64_t off, int inverse) {
  int64_t n = B * T * H * D, S = off + T + 3, tn = S * (D / 2);
  double *c = dalloc(tn), *s = dalloc(tn), *x = dalloc(n), *y = dalloc(n), *ry = dalloc(n);
  float *cf = falloc(tn), *sf = falloc(tn), *xf = falloc(n), *yf = falloc(n);
  tt_cpu_rope_table(TT_F64, D, S, 10000.0, 1.0, 1.0, 4.0, 8192, c, s);
  tt_test_fill_f64(x, n, 1.0);
  ref_rope(B, T, H, D, x, c, s, off, inverse, ry);
  nan_f64(y, n);
  CHECK(tt_cpu_rope(TT_F64, B, T, H, D, x, c, s, off, inverse, y) == TT_OK, "f64 rope");
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-15, "f64 rope %ldx%ldx%ldx%ld off %ld inv %d", (long)B, (long)T,
        (long)H, (long)D, (long)off, inverse);
  memcpy(y, x, n * sizeof *y);
  CHECK(tt_cpu_rope(TT_F64, B, T, H, D, y, c, s, off, inverse, y) == TT_OK, "f64 rope in place");
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-15, "f64 rope in place %ldx%ldx%ldx%ld", (long)B, (long)T, (long)H,
        (long)D);

  to_f32(c, cf, tn); to_f32(s, sf, tn); to_f32(x, xf, n);
  nan_f32(yf, n);
  CHECK(tt_cpu_rope(TT_F32, B, T, H, D, xf, cf, sf, off, inverse, yf) == TT_OK, "f32 rope");
  to_f64(yf, y, n);
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-6, "f32 rope %ldx%ldx%ldx%ld err %g", (long)B, (long)T, (long)H,
        (long)D, tt_test_rel_err_f64(y, ry, n));
  CHECK(tt_cpu_rope(TT_F32, B, T, H, D, xf, cf, sf, off, inverse, xf) == TT_OK, "f32 rope in place");
  to_f64(xf, y, n);
  CHECK(tt_test_rel_err_f64(y, ry, n) < 1e-6, "f32 rope in place %ldx%ldx%ldx%ld", (long)B, (long)T, (long)H,
        (long)D);
  free(c); free(s); free(x); free(y); free(ry); free(cf); free(sf); free(xf); free(yf);
}

/* Rows t of a call at offset `off` equal rows off + t of a call at offset 0,
 * and rotating back restores the input. */
static void check_offset_and_inverse(void) {
  const int64_t T = 9, H = 3, D = 16, off = 4, S = 32, tn = S * D / 2, row = H * D;
  double *c = dalloc(tn), *s = dalloc(tn), *x = dalloc(T * row), *y0 = dalloc(T * row), *y1 = dalloc(T * row);
  tt_cpu_rope_table(TT_F64, D, S, 10000.0, 1.0, 1.0, 4.0, 8192, c, s);
  tt_test_fill_f64(x, T * row, 1.0);
  tt_cpu_rope(TT_F64, 1, T, H, D, x, c, s, 0, 0, y0);
  tt_cpu_rope(TT_F64, 1, T - off, H, D, x + off * row, c, s, off, 0, y1);
  CHECK(!memcmp(y0 + off * row, y1, (T - off) * row * sizeof(double)), "offset rows match");
  tt_cpu_rope(TT_F64, 1, T, H, D, y0, c, s, 0, 1, y0);
  CHECK(tt_test_rel_err_f64(y0, x, T * row) < 1e-15, "inverse restores input");
  free(c); free(s); free(x); free(y0); free(y1);
}

/* L = sum(g * rope(x)); its gradient must be rope(g, inverse). */
static void check_gradient(int64_t B, int64_t T, int64_t H, int64_t D, int64_t off) {
  int64_t n = B * T * H * D, S = off + T, tn = S * D / 2;
  double *c = dalloc(tn), *s = dalloc(tn), *x = dalloc(n), *g = dalloc(n), *y = dalloc(n), *dx = dalloc(n);
  double *fd = dalloc(n);
  tt_cpu_rope_table(TT_F64, D, S, 500000.0, 8.0, 1.0, 4.0, 8192, c, s);
  tt_test_fill_f64(x, n, 1.0);
  tt_test_fill_f64(g, n, 1.0);
  const double h = 1e-5;
  for (int64_t k = 0; k < n; k++) {
    double keep = x[k], l[2];
    for (int side = 0; side < 2; side++) {
      x[k] = keep + (side ? -h : h);
      tt_cpu_rope(TT_F64, B, T, H, D, x, c, s, off, 0, y);
      l[side] = 0;
      for (int64_t i = 0; i < n; i++) l[side] += g[i] * y[i];
    }
    x[k] = keep;
    fd[k] = (l[0] - l[1]) / (2 * h);
  }
  nan_f64(dx, n);
  tt_cpu_rope(TT_F64, B, T, H, D, g, c, s, off, 1, dx);
  CHECK(tt_test_rel_err_f64(dx, fd, n) < 1e-9, "rope fd grad err %g", tt_test_rel_err_f64(dx, fd, n));
  free(c); free(s); free(x); free(g); free(y); free(dx); free(fd);
}

int main(void) {
  const int64_t Ds[] = {2, 8, 64, 128};
  for (int k = 0; k < 4; k++) {
    check_table(Ds[k], 1, 10000.0, 0);
    check_table(Ds[k], 37, 10000.0, 0);
    check_table(Ds[k], 300, 500000.0, 1);
  }
  check_table(128, 8192, 500000.0, 1); /* parallel path, long angles */
  check_table(6, 5, 10000.0, 1);       /* half not a multiple of anything */
  check_table(200, 3, 500000.0, 1);    /* more than one frequency chunk */
  check_llama31_known();

  for (int inv = 0; inv < 2; inv++) {
    check_rope(1, 1, 1, 2, 0, inv);
    check_rope(2, 5, 3, 6, 0, inv);
    check_rope(1, 17, 4, 64, 7, inv);
    check_rope(2, 3, 2, 128, 100, inv);
    check_rope(2, 64, 8, 64, 5, inv); /* parallel path */
  }
  check_offset_and_inverse();
  check_gradient(1, 3, 2, 4, 0);
  check_gradient(2, 2, 1, 6, 9000); /* past the original context: scaled freqs */

  double z[4] = {0};
  CHECK(tt_cpu_rope(TT_F64, 1, 1, 1, 3, z, z, z, 0, 0, z) == TT_ERR_SHAPE, "odd head dim refused");
  CHECK(tt_cpu_rope_table(TT_F64, 3, 1, 1e4, 1, 1, 4, 8192, z, z) == TT_ERR_SHAPE, "odd table dim refused");
  CHECK(tt_cpu_rope(TT_BF16, 1, 1, 1, 2, z, z, z, 0, 0, z) == TT_ERR_DTYPE, "bf16 refused");
  return tt_test_summary("test_rope");
}
