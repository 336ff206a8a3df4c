/*
 * embed.c — embedding lookup and its weight gradient (CPU).
 *
 * The lookup is a row copy, so it serves any 2-, 4- or 8-byte float dtype
 * (bf16/f16 weights included). The backward scatters dy rows into dweight;
 * repeated ids make that a reduction, so threads split the dim columns and
 * each scans every id in order: every element of dweight then receives its
 * additions in id order whatever the thread count, with no atomics and no
 * scratch memory.
 */
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

#include "cpu.h"

#define EMBED_PAR_MIN 32768

tt_status tt_cpu_embedding(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *weight,
                           const int64_t *ids, void *out) {
  (void)vocab; /* the engine checked every id against it */
  size_t es;
  switch (dtype) {
  case TT_F32: es = 4; break;
  case TT_F64: es = 8; break;
  case TT_BF16:
  case TT_F16: es = 2; break;
  default: return TT_ERR_DTYPE;
  }
  size_t row = (size_t)dim * es;
  const char *w = weight;
  char *o = out;
  int par = n_ids > 1 && n_ids * dim >= EMBED_PAR_MIN;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t i = 0; i < n_ids; i++) memcpy(o + (size_t)i * row, w + (size_t)ids[i] * row, row);
  return TT_OK;
}

/* Column range [*j0, *j1) of thread tid of nt, in multiples of 16 elements
 * (a 64-byte line of f32) so neighbours rarely share a cache line. */
static void embed_cols(int64_t dim, int tid, int nt, int64_t *j0, int64_t *j1) {
  int64_t chunk = ((dim + nt - 1) / nt + 15) / 16 * 16;
  int64_t a = (int64_t)tid * chunk, b = a + chunk;
  *j0 = a < dim ? a : dim;
  *j1 = b < dim ? b : dim;
}

#define DEF_EMBEDDING_BACKWARD(T, SFX)                                                                                \
  static void embedding_backward_##SFX(int64_t n_ids, int64_t dim, const T *restrict dy,                              \
                                       const int64_t *ids, T *restrict dweight) {                                     \
    int par = dim > 16 && n_ids * dim >= EMBED_PAR_MIN;                                                               \
    _Pragma("omp parallel if (par)") {                                                                                \
      int64_t j0, j1;                                                                                                 \
      embed_cols(dim, omp_get_thread_num(), omp_get_num_threads(), &j0, &j1);                                         \
      for (int64_t i = 0; i < n_ids; i++) {                                                                           \
        T *dst = dweight + ids[i] * dim;                                                                              \
        const T *src = dy + i * dim;                                                                                  \
        for (int64_t j = j0; j < j1; j++) dst[j] += src[j];                                                           \
      }                                                                                                               \
    }                                                                                                                 \
  }

DEF_EMBEDDING_BACKWARD(float, f32)
DEF_EMBEDDING_BACKWARD(double, f64)

tt_status tt_cpu_embedding_backward(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *dy,
                                    const int64_t *ids, void *dweight) {
  (void)vocab; /* ids are validated by ops.c */
  switch (dtype) {
  case TT_F32: embedding_backward_f32(n_ids, dim, dy, ids, dweight); return TT_OK;
  case TT_F64: embedding_backward_f64(n_ids, dim, dy, ids, dweight); return TT_OK;
  default: return TT_ERR_DTYPE;
  }
}
