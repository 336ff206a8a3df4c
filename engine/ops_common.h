/*
 * ops_common.h — the checks every op entry point shares. Each check returns
 * a status with a message that names the op and the shapes involved, so a
 * user sees e.g. "rmsnorm: x [4, 7] is not contiguous; call :contiguous()".
 */
#ifndef TT_OPS_COMMON_H
#define TT_OPS_COMMON_H

#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Shape string of t into a caller's buffer (for messages). */
#define SHP(t, buf) tt_tensor_shape_str((t), (buf), sizeof(buf))

/* A compute dtype: f32, f64, bf16 or f16 (each backend then says which of
 * them its kernel implements; see tt_kernel_check). */
static inline tt_status tt_chk_float(const char *op, const char *name, const tt_tensor *t) {
  char s[96];
  TT_TRY(tt_tensor_check_storage(op, name, t));
  if (t->dtype != TT_F32 && t->dtype != TT_F64 && t->dtype != TT_BF16 && t->dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "%s: %s %s has dtype %s; expected float32, float64, bfloat16 or float16", op,
                        name, SHP(t, s), tt_dtype_name(t->dtype));
  return TT_OK;
}

/* After a kernel call: kernels return a bare status for what only they can
 * know (a dtype this backend does not implement, a CUDA failure whose
 * message the backend already recorded); give the bare ones a message. */
static inline tt_status tt_kernel_check(tt_status st, const char *op, const tt_kernels *be, int dtype) {
  if (st == TT_OK) return st;
  const char *bn = be ? be->name : "?";
  if (st == TT_ERR_DTYPE)
    return tt_error_set(st, "%s: dtype %s is not implemented by the %s backend", op, tt_dtype_name(dtype), bn);
  if (st == TT_ERR_UNSUPPORTED) return tt_error_set(st, "%s: not supported by the %s backend here", op, bn);
  if (st == TT_ERR_INVALID || st == TT_ERR_SHAPE) {
    /* The CUDA backend says why in a line of its own ("cuda <op>: ..."),
     * e.g. a TITAN_CUDA_NORM_GROUP it cannot use: keep it. The CPU
     * backend's kernels return bare statuses and never write such a line. */
    const char *last = tt_last_error();
    const size_t n = strlen(bn);
    if (be && strncmp(last, bn, n) == 0 && (last[n] == ' ' || last[n] == ':')) return st;
    return tt_error_set(st, "%s: the %s backend rejected these arguments (%s)", op, bn, tt_dtype_name(dtype));
  }
  return st; /* OOM / DEVICE / INTERNAL: the backend recorded the message */
}

static inline tt_status tt_chk_index(const char *op, const char *name, const tt_tensor *t) {
  char s[96];
  TT_TRY(tt_tensor_check_storage(op, name, t));
  if (t->dtype != TT_I64 && t->dtype != TT_I32)
    return tt_error_set(TT_ERR_DTYPE, "%s: %s %s has dtype %s; expected int64 or int32", op, name, SHP(t, s),
                        tt_dtype_name(t->dtype));
  return TT_OK;
}

static inline tt_status tt_chk_same_dtype(const char *op, const char *na, const tt_tensor *a, const char *nb,
                                          const tt_tensor *b) {
  char s1[96], s2[96];
  if (a->dtype != b->dtype)
    return tt_error_set(TT_ERR_DTYPE, "%s: %s %s is %s but %s %s is %s; expected the same dtype", op, na, SHP(a, s1),
                        tt_dtype_name(a->dtype), nb, SHP(b, s2), tt_dtype_name(b->dtype));
  return TT_OK;
}

static inline tt_status tt_chk_same_device(const char *op, const char *na, const tt_tensor *a, const char *nb,
                                           const tt_tensor *b) {
  char s1[96], s2[96], d1[24], d2[24];
  if (!tt_same_device(a->device, b->device))
    return tt_error_set(TT_ERR_DEVICE, "%s: %s %s is on %s but %s %s is on %s; expected one device", op, na,
                        SHP(a, s1), tt_device_name(a->device, d1, sizeof d1), nb, SHP(b, s2),
                        tt_device_name(b->device, d2, sizeof d2));
  return TT_OK;
}

static inline tt_status tt_chk_contig(const char *op, const char *name, const tt_tensor *t) {
  char s[96];
  if (!tt_tensor_is_contiguous(t))
    return tt_error_set(TT_ERR_LAYOUT, "%s: %s %s is not contiguous; expected a contiguous tensor (call :contiguous())",
                        op, name, SHP(t, s));
  return TT_OK;
}

static inline tt_status tt_chk_ndim(const char *op, const char *name, const tt_tensor *t, int ndim,
                                    const char *expected) {
  char s[96];
  if (t->ndim != ndim)
    return tt_error_set(TT_ERR_SHAPE, "%s: %s %s has %d dims; expected %s", op, name, SHP(t, s), t->ndim, expected);
  return TT_OK;
}

static inline int tt_shape_eq(const tt_tensor *t, int ndim, const int64_t *shape) {
  if (t->ndim != ndim) return 0;
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] != shape[i]) return 0;
  return 1;
}

static inline tt_status tt_chk_same_shape(const char *op, const char *na, const tt_tensor *a, const char *nb,
                                          const tt_tensor *b) {
  char s1[96], s2[96];
  if (!tt_shape_eq(b, a->ndim, a->shape))
    return tt_error_set(TT_ERR_SHAPE, "%s: %s %s and %s %s; expected the same shape", op, na, SHP(a, s1), nb,
                        SHP(b, s2));
  return TT_OK;
}

/* Output handling: allocate when *out is NULL, otherwise check the given
 * tensor has the expected shape/dtype/device and is contiguous. *fresh
 * records an allocation so a later failure can release it. */
static inline tt_status tt_out_prepare(const char *op, const char *name, tt_tensor **out, int ndim,
                                       const int64_t *shape, int dtype, tt_device dev, int *fresh) {
  char s1[96], s2[96];
  *fresh = 0;
  if (!*out) {
    TT_TRY(tt_tensor_empty(ndim, shape, dtype, dev, out));
    *fresh = 1;
    return TT_OK;
  }
  tt_tensor tmp;
  memset(&tmp, 0, sizeof tmp);
  tmp.ndim = ndim;
  for (int i = 0; i < ndim; i++) tmp.shape[i] = shape[i];
  if (!tt_shape_eq(*out, ndim, shape))
    return tt_error_set(TT_ERR_SHAPE, "%s: output %s has shape %s; expected %s", op, name, SHP(*out, s1),
                        SHP(&tmp, s2));
  if ((*out)->dtype != dtype)
    return tt_error_set(TT_ERR_DTYPE, "%s: output %s is %s; expected %s", op, name, tt_dtype_name((*out)->dtype),
                        tt_dtype_name(dtype));
  if (!tt_same_device((*out)->device, dev))
    return tt_error_set(TT_ERR_DEVICE, "%s: output %s is on another device than the inputs", op, name);
  return tt_chk_contig(op, name, *out);
}

static inline void tt_out_discard(tt_tensor **out, int fresh) {
  if (fresh && *out) {
    tt_tensor_release(*out);
    *out = NULL;
  }
}

/* The backend entry for the inputs' device; NULL entry -> a clear error. */
#define TT_KERNEL(be, dev, entry, op)                                                                       \
  const tt_kernels *be = tt_backend(dev);                                                                   \
  if ((dev).type != TT_META && (!be || !be->entry)) {                                                        \
    char _dn[24];                                                                                           \
    return tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on %s in this build", op,                   \
                        tt_device_name((dev), _dn, sizeof _dn));                                             \
  }

/* Stats dtype for f32/f64 kernels. */
static inline int tt_stat_dtype(int dtype) { return dtype == TT_F64 ? TT_F64 : TT_F32; }

/* A packed int64 copy of an index tensor (kernels take i64). Retains t when
 * it already is one. */
static inline tt_status tt_index_i64(const tt_tensor *t, tt_tensor **out) {
  if (t->dtype == TT_I64 && tt_tensor_is_contiguous(t)) {
    tt_tensor_retain((tt_tensor *)t);
    *out = (tt_tensor *)t;
    return TT_OK;
  }
  TT_TRY(tt_tensor_empty(t->ndim, t->shape, TT_I64, t->device, out));
  tt_status st = tt_tensor_copy(*out, t);
  if (st != TT_OK) {
    tt_tensor_release(*out);
    *out = NULL;
  }
  return st;
}

/* Every index in [0, n) — or == ignore when allow_ignore. CPU-side check:
 * reading GPU indices here would wait for the device at every op, so GPU
 * kernels check them and the fault they record is reported at the next
 * wait (tt_device_report). */
static inline tt_status tt_chk_index_range(const char *op, const tt_tensor *idx64, int64_t n, int allow_ignore,
                                           int64_t ignore) {
  if (idx64->device.type != TT_CPU) return TT_OK;
  const int64_t *p = tt_tensor_data(idx64);
  int64_t cnt = tt_tensor_numel(idx64);
  for (int64_t i = 0; i < cnt; i++) {
    if (allow_ignore && p[i] == ignore) continue;
    if (p[i] < 0 || p[i] >= n)
      return tt_error_set(TT_ERR_INDEX, "%s: index %lld at position %lld is out of range [0, %lld)", op,
                          (long long)p[i], (long long)i, (long long)n);
  }
  return TT_OK;
}

#endif
