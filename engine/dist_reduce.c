/*
 * dist_reduce.c — the arithmetic of reductions across ranks, shared by the
 * "mpi" and "local" backends: both sum rank 0's values, then rank 1's, ...
 * in this one loop, so a job simulated in one process (`titan --simulate
 * N`) and the same job over Open MPI (`titan --nproc N`) get the same bits,
 * and neither depends on which algorithm an MPI library picks for a message
 * size (recursive doubling and rings add in other orders).
 */
#include "dist.h"

tt_status tt_dist_reduce_check(const char *who, int dtype, int op) {
  int is_float = dtype == TT_F32 || dtype == TT_F64;
  int is_int = dtype == TT_I32 || dtype == TT_I64 || dtype == TT_U8 || dtype == TT_BOOL;
  if (!is_float && !is_int)
    return tt_error_set(TT_ERR_DTYPE, "%s: dtype %s cannot be reduced on the CPU (expected float32, float64 or an "
                        "integer dtype; reduce gradients in float32)", who, tt_dtype_name(dtype));
  if (op < TT_RED_SUM || op > TT_RED_MIN) return tt_error_set(TT_ERR_INVALID, "%s: unknown reduction %d", who, op);
  if (op == TT_RED_AVG && !is_float)
    return tt_error_set(TT_ERR_DTYPE, "%s: avg of %s; expected float32 or float64", who, tt_dtype_name(dtype));
  return TT_OK;
}

#define RED_LOOP(T)                                                     \
  do {                                                                  \
    T *a = acc;                                                         \
    const T *b = x;                                                     \
    if (op == TT_RED_SUM || op == TT_RED_AVG)                           \
      for (int64_t i = 0; i < n; i++) a[i] = a[i] + b[i];               \
    else if (op == TT_RED_MAX)                                          \
      for (int64_t i = 0; i < n; i++) a[i] = b[i] > a[i] ? b[i] : a[i]; \
    else                                                                \
      for (int64_t i = 0; i < n; i++) a[i] = b[i] < a[i] ? b[i] : a[i]; \
  } while (0)

void tt_dist_reduce_into(void *acc, const void *x, int64_t n, int dtype, int op) {
  switch (dtype) {
    case TT_F32: RED_LOOP(float); break;
    case TT_F64: RED_LOOP(double); break;
    case TT_I32: RED_LOOP(int32_t); break;
    case TT_I64: RED_LOOP(int64_t); break;
    default: RED_LOOP(uint8_t); break;
  }
}

void tt_dist_reduce_finish(void *acc, int64_t n, int dtype, int op, int size) {
  if (op != TT_RED_AVG || size <= 1) return;
  if (dtype == TT_F32) {
    float *a = acc, s = (float)size;
    for (int64_t i = 0; i < n; i++) a[i] /= s;
  } else if (dtype == TT_F64) {
    double *a = acc, s = (double)size;
    for (int64_t i = 0; i < n; i++) a[i] /= s;
  }
}
