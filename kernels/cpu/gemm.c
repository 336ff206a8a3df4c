/*
 * gemm.c — matrix products through OpenBLAS, loaded at run time.
 *
 * Why dlopen instead of linking: Debian's OpenBLAS 0.3.21 is a DYNAMIC_ARCH
 * build that picks its kernels once, when the library loads, and it does not
 * recognize Sapphire Rapids: it falls back to the "Prescott" SSE3 kernels
 * (measured here: ~38 GFLOP/s sgemm on 2 threads instead of ~260). The
 * choice can only be steered through OPENBLAS_CORETYPE before the library
 * loads, and a linked library loads before main(). Loading it ourselves on
 * first use lets us set that variable from the CPU's features — unless the
 * user (or the machine) set it already, which we always respect.
 * TITAN_BLAS=/path/libopenblas.so.0 picks another library build.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

enum { TT_CBLAS_ROW_MAJOR = 101, TT_CBLAS_NO_TRANS = 111, TT_CBLAS_TRANS = 112 };

typedef void (*tt_sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                            float *, int);
typedef void (*tt_dgemm_fn)(int, int, int, int, int, int, double, const double *, int, const double *, int,
                            double, double *, int);

static struct {
  pthread_once_t once;
  tt_sgemm_fn sgemm;
  tt_dgemm_fn dgemm;
  char info[256];
} tt_blas = {PTHREAD_ONCE_INIT, NULL, NULL, ""};

static const char *tt_blas_pick_coretype(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return NULL;
}

static void tt_blas_load(void) {
  const char *user_core = getenv("OPENBLAS_CORETYPE");
  const char *chosen = NULL;
  if (!user_core || !*user_core) {
    chosen = tt_blas_pick_coretype();
    if (chosen) setenv("OPENBLAS_CORETYPE", chosen, 0);
  }
  /* The OpenMP build shares libgomp's threads with our kernels (no two
   * thread pools spinning against each other on 2 cores). */
  const char *candidates[] = {getenv("TITAN_BLAS"),
                              "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
                              "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
                              "libopenblas.so.0",
                              "libopenblas.so",
                              "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"};
  void *h = NULL;
  const char *path = NULL;
  for (size_t i = 0; i < sizeof candidates / sizeof *candidates && !h; i++) {
    if (!candidates[i] || !*candidates[i]) continue;
    h = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
    path = candidates[i];
  }
  if (!h) {
    snprintf(tt_blas.info, sizeof tt_blas.info, "no BLAS found (install libopenblas0-openmp)");
    return;
  }
  tt_blas.sgemm = (tt_sgemm_fn)dlsym(h, "cblas_sgemm");
  tt_blas.dgemm = (tt_dgemm_fn)dlsym(h, "cblas_dgemm");
  char *(*corename)(void) = (char *(*)(void))dlsym(h, "openblas_get_corename");
  char *(*config)(void) = (char *(*)(void))dlsym(h, "openblas_get_config");
  snprintf(tt_blas.info, sizeof tt_blas.info, "%s core=%s (%s) from %s", config ? config() : "BLAS",
           corename ? corename() : "?",
           chosen ? "OPENBLAS_CORETYPE chosen by titan from the CPU features"
                  : (user_core && *user_core ? "OPENBLAS_CORETYPE set by the environment" : "detected by OpenBLAS"),
           path);
}

const char *tt_blas_info(void) {
  pthread_once(&tt_blas.once, tt_blas_load);
  return tt_blas.info;
}

/* C[r, :] += bias over the batch * m rows of C, after the GEMM and in the
 * same call: one pass over C while the rows are being written anyway, and
 * no broadcast tensor. Rows in parallel; the inner loop vectorizes. */
#define TT_GEMM_BIAS_ROWS(T)                                                        \
  do {                                                                              \
    const T *bv = (const T *)bias;                                                  \
    _Pragma("omp parallel for schedule(static) if (batch * m * n > 65536)")         \
    for (int64_t r = 0; r < batch * m; r++) {                                       \
      T *row = (T *)c + (r / m) * stride_c + (r % m) * ldc;                         \
      for (int64_t j = 0; j < n; j++) row[j] += bv[j];                              \
    }                                                                               \
  } while (0)

/* flags are ignored: OpenBLAS has no TF32 mode (f32 stays exact here) and
 * one algorithm per call. */
tt_status tt_cpu_gemm(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                      double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                      int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c, const void *bias,
                      int bias_dtype, int flags) {
  (void)flags;
  pthread_once(&tt_blas.once, tt_blas_load);
  if (!tt_blas.sgemm || !tt_blas.dgemm) return TT_ERR_UNSUPPORTED;
  if (dtype != TT_F32 && dtype != TT_F64) return TT_ERR_DTYPE;
  if (bias && bias_dtype != dtype) return TT_ERR_DTYPE;
  int ta = trans_a ? TT_CBLAS_TRANS : TT_CBLAS_NO_TRANS, tb = trans_b ? TT_CBLAS_TRANS : TT_CBLAS_NO_TRANS;
  if (m == 0 || n == 0) return TT_OK;
  for (int64_t i = 0; i < batch; i++) {
    if (dtype == TT_F32) {
      const float *A = (const float *)a + i * stride_a, *B = (const float *)b + i * stride_b;
      float *C = (float *)c + i * stride_c;
      if (k == 0) { /* BLAS leaves C untouched only for beta=1; be explicit */
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < n; j++) C[r * ldc + j] = beta == 0 ? 0.0f : (float)beta * C[r * ldc + j];
        continue;
      }
      tt_blas.sgemm(TT_CBLAS_ROW_MAJOR, ta, tb, (int)m, (int)n, (int)k, (float)alpha, A, (int)lda, B, (int)ldb,
                    (float)beta, C, (int)ldc);
    } else {
      const double *A = (const double *)a + i * stride_a, *B = (const double *)b + i * stride_b;
      double *C = (double *)c + i * stride_c;
      if (k == 0) {
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < n; j++) C[r * ldc + j] = beta == 0 ? 0.0 : beta * C[r * ldc + j];
        continue;
      }
      tt_blas.dgemm(TT_CBLAS_ROW_MAJOR, ta, tb, (int)m, (int)n, (int)k, alpha, A, (int)lda, B, (int)ldb, beta, C,
                    (int)ldc);
    }
  }
  if (bias) {
    if (dtype == TT_F32) TT_GEMM_BIAS_ROWS(float);
    else TT_GEMM_BIAS_ROWS(double);
  }
  return TT_OK;
}
