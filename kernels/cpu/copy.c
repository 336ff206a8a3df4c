/*
 * copy.c — strided copies with dtype conversion, fill and arange.
 *
 * The copy is the workhorse behind contiguous(), casts, cat, expand-copies
 * and host transfers. It walks the index space as rows (every dim but the
 * last) and runs a tight inner loop over the last dim; common dtype pairs get
 * their own loops, the rest go through double.
 */
#include <omp.h>
#include <string.h>

#include "cpu.h"
#include "dtype_conv.h"

static inline double tt_load(int dt, const char *p) {
  switch (dt) {
    case TT_F32: return *(const float *)p;
    case TT_F64: return *(const double *)p;
    case TT_BF16: return tt_bf16_to_f32(*(const uint16_t *)p);
    case TT_F16: return tt_f16_to_f32(*(const uint16_t *)p);
    case TT_I32: return *(const int32_t *)p;
    case TT_I64: return (double)*(const int64_t *)p;
    case TT_U8: return *(const uint8_t *)p;
    case TT_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    case TT_F8E4M3: return tt_f8_to_f32(*(const uint8_t *)p, 1);
    case TT_F8E5M2: return tt_f8_to_f32(*(const uint8_t *)p, 0);
    default: return 0;
  }
}

static inline void tt_store(int dt, char *p, double v) {
  switch (dt) {
    case TT_F32: *(float *)p = (float)v; break;
    case TT_F64: *(double *)p = v; break;
    case TT_BF16: *(uint16_t *)p = tt_f32_to_bf16((float)v); break;
    case TT_F16: *(uint16_t *)p = tt_f32_to_f16((float)v); break;
    case TT_I32: *(int32_t *)p = (int32_t)v; break;
    case TT_I64: *(int64_t *)p = (int64_t)v; break;
    case TT_U8: *(uint8_t *)p = (uint8_t)v; break;
    case TT_BOOL: *(uint8_t *)p = v != 0; break;
    case TT_F8E4M3: *(uint8_t *)p = tt_f32_to_f8((float)v, 1); break;
    case TT_F8E5M2: *(uint8_t *)p = tt_f32_to_f8((float)v, 0); break;
    default: break;
  }
}

static size_t tt_esize(int dt) {
  switch (dt) {
    case TT_F64: case TT_I64: return 8;
    case TT_F32: case TT_I32: return 4;
    case TT_BF16: case TT_F16: return 2;
    default: return 1;
  }
}

/* One row: n elements, strides in elements. */
static void tt_copy_row(int sdt, const char *s, int64_t ss, int ddt, char *d, int64_t ds, int64_t n) {
  size_t se = tt_esize(sdt), de = tt_esize(ddt);
  if (sdt == ddt && ss == 1 && ds == 1) {
    memcpy(d, s, (size_t)n * se);
  } else if (sdt == TT_F32 && ddt == TT_BF16) {
    const float *x = (const float *)s;
    uint16_t *y = (uint16_t *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = tt_f32_to_bf16(x[i * ss]);
  } else if (sdt == TT_BF16 && ddt == TT_F32) {
    const uint16_t *x = (const uint16_t *)s;
    float *y = (float *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = tt_bf16_to_f32(x[i * ss]);
  } else if (sdt == TT_F32 && ddt == TT_F64) {
    const float *x = (const float *)s;
    double *y = (double *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = x[i * ss];
  } else if (sdt == TT_F64 && ddt == TT_F32) {
    const double *x = (const double *)s;
    float *y = (float *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = (float)x[i * ss];
  } else if (sdt == ddt && se == 4) {
    const uint32_t *x = (const uint32_t *)s;
    uint32_t *y = (uint32_t *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = x[i * ss];
  } else if (sdt == ddt && se == 8) {
    const uint64_t *x = (const uint64_t *)s;
    uint64_t *y = (uint64_t *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = x[i * ss];
  } else if (sdt == ddt && se == 2) {
    const uint16_t *x = (const uint16_t *)s;
    uint16_t *y = (uint16_t *)d;
    for (int64_t i = 0; i < n; i++) y[i * ds] = x[i * ss];
  } else if (sdt == ddt) {
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else {
    for (int64_t i = 0; i < n; i++) tt_store(ddt, d + (size_t)(i * ds) * de, tt_load(sdt, s + (size_t)(i * ss) * se));
  }
}

tt_status tt_cpu_copy(int ndim, const int64_t *shape, int src_dtype, const void *src, const int64_t *src_strides,
                      int dst_dtype, void *dst, const int64_t *dst_strides) {
  if (ndim == 0) {
    tt_copy_row(src_dtype, src, 1, dst_dtype, dst, 1, 1);
    return TT_OK;
  }
  int64_t n = shape[ndim - 1], rows = 1;
  for (int i = 0; i < ndim - 1; i++) rows *= shape[i];
  if (n == 0 || rows == 0) return TT_OK;
  size_t se = tt_esize(src_dtype), de = tt_esize(dst_dtype);
  int64_t ss = src_strides[ndim - 1], ds = dst_strides[ndim - 1];
  int big = rows * n > 32768;
#pragma omp parallel for schedule(static) if (big && rows > 1)
  for (int64_t r = 0; r < rows; r++) {
    int64_t so = 0, dof = 0, rem = r;
    for (int d = ndim - 2; d >= 0; d--) {
      int64_t i = rem % shape[d];
      rem /= shape[d];
      so += i * src_strides[d];
      dof += i * dst_strides[d];
    }
    tt_copy_row(src_dtype, (const char *)src + (size_t)so * se, ss, dst_dtype, (char *)dst + (size_t)dof * de, ds, n);
  }
  return TT_OK;
}

tt_status tt_cpu_fill(int dtype, int64_t n, double value, void *dst) {
  switch (dtype) {
    case TT_F32: {
      float v = (float)value, *y = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; i++) y[i] = v;
      return TT_OK;
    }
    case TT_F64: {
      double *y = dst;
#pragma omp parallel for schedule(static) if (n > 65536)
      for (int64_t i = 0; i < n; i++) y[i] = value;
      return TT_OK;
    }
    default: {
      char one[8];
      size_t es = tt_esize(dtype);
      tt_store(dtype, one, value);
      char *y = dst;
      for (int64_t i = 0; i < n; i++) memcpy(y + (size_t)i * es, one, es);
      return TT_OK;
    }
  }
}

tt_status tt_cpu_arange(int dtype, int64_t n, double start, double step, void *dst) {
  size_t es = tt_esize(dtype);
  char *y = dst;
  for (int64_t i = 0; i < n; i++) tt_store(dtype, y + (size_t)i * es, start + (double)i * step);
  return TT_OK;
}
