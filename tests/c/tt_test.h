/*
 * tt_test.h — a tiny harness for the C unit tests: checks that count
 * failures, deterministic random inputs, and comparison helpers.
 * A test program returns tt_test_summary() from main.
 */
#ifndef TT_TEST_H
#define TT_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int tt_test_failures = 0;
static int tt_test_checks = 0;

#define CHECK(cond, ...)                                                    \
  do {                                                                      \
    tt_test_checks++;                                                       \
    if (!(cond)) {                                                          \
      tt_test_failures++;                                                   \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                         \
      fprintf(stderr, "\n");                                                \
    }                                                                       \
  } while (0)

/* xorshift64*: reproducible inputs without touching the engine's RNG. */
static uint64_t tt_test_rng_state = 0x9e3779b97f4a7c15ull;
static inline double tt_test_rand(void) { /* uniform in [-1, 1) */
  uint64_t x = tt_test_rng_state;
  x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
  tt_test_rng_state = x;
  return (double)((x * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}
static inline void tt_test_fill_f32(float *p, int64_t n, double scale) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)(scale * tt_test_rand());
}
static inline void tt_test_fill_f64(double *p, int64_t n, double scale) {
  for (int64_t i = 0; i < n; i++) p[i] = scale * tt_test_rand();
}

/* max |a-b| / max(max|b|, tiny): one relative error for a whole tensor. */
static inline double tt_test_rel_err_f64(const double *a, const double *b, int64_t n) {
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs(a[i] - b[i]);
    if (d > num || isnan(d)) num = isnan(d) ? INFINITY : d;
    if (fabs(b[i]) > den) den = fabs(b[i]);
  }
  return num / den;
}
static inline double tt_test_rel_err_f32(const float *a, const float *b, int64_t n) {
  double num = 0, den = 1e-30;
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > num || isnan(d)) num = isnan(d) ? INFINITY : d;
    if (fabs((double)b[i]) > den) den = fabs((double)b[i]);
  }
  return num / den;
}

static inline int tt_test_summary(const char *name) {
  printf("%s: %d checks, %d failed\n", name, tt_test_checks, tt_test_failures);
  return tt_test_failures ? 1 : 0;
}

#endif
