/*
 * tensor.c — tensor objects: creation, reference counts, strided views and
 * copies between dtypes, layouts and devices.
 *
 * A tensor is a view (shape, strides, offset) of a reference-counted
 * storage. Views share storage; memory returns to the device's caching
 * allocator the moment the last reference goes (never the Lua GC's call).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int64_t tt_live_tensors = 0;

int64_t tt_tensor_live_count(void) { return __atomic_load_n(&tt_live_tensors, __ATOMIC_RELAXED); }

static void tt_storage_release(tt_storage *s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) == 0) {
    if (s->device.type == TT_META && s->meta_live && s->meta_counted) tt_meta_account(s->nbytes, -1);
    tt_free_raw_streams(s->device, s->data, s->nbytes, __atomic_load_n(&s->streams, __ATOMIC_ACQUIRE));
    free(s);
  }
}

tt_status tt_tensor_record_stream(const tt_tensor *t, int stream) {
  if (!t) return tt_error_set(TT_ERR_INVALID, "record_stream: no tensor");
  if (stream != TT_STREAM_COMPUTE && stream != TT_STREAM_COMM)
    return tt_error_set(TT_ERR_INVALID, "record_stream: stream %d; expected TT_STREAM_COMPUTE (0) or TT_STREAM_COMM (1)",
                        stream);
  if (stream == TT_STREAM_COMPUTE || !t->storage || t->device.type != TT_CUDA) return TT_OK;
  __atomic_or_fetch(&t->storage->streams, 1u << stream, __ATOMIC_RELEASE);
  return TT_OK;
}

static tt_tensor *tt_tensor_alloc_struct(void) {
  tt_tensor *t = calloc(1, sizeof *t);
  if (t) {
    t->refcount = 1;
    __atomic_add_fetch(&tt_live_tensors, 1, __ATOMIC_RELAXED);
  }
  return t;
}

const char *tt_tensor_shape_str(const tt_tensor *t, char *buf, size_t len) {
  size_t pos = 0;
  pos += (size_t)snprintf(buf + pos, len - pos, "[");
  for (int i = 0; t && i < t->ndim && pos < len; i++)
    pos += (size_t)snprintf(buf + pos, len - pos, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (pos < len) snprintf(buf + pos, len - pos, "]");
  return buf;
}

tt_status tt_tensor_empty(int ndim, const int64_t *shape, int dtype, tt_device dev, tt_tensor **out) {
  *out = NULL;
  if (ndim < 0 || ndim > TT_MAX_DIMS)
    return tt_error_set(TT_ERR_SHAPE, "empty: %d dims requested, at most %d are supported", ndim, TT_MAX_DIMS);
  if (dtype < 0 || dtype >= TT_NUM_DTYPES) return tt_error_set(TT_ERR_DTYPE, "empty: invalid dtype %d", dtype);
  if (dev.type == TT_CPU) dev.index = 0;
  if (dev.type == TT_META) dev.index = 0;
  if (dev.type != TT_META && !tt_backend(dev)) {
    char nm[32];
    return tt_error_set(TT_ERR_DEVICE, "empty: device %s is not available (%s)", tt_device_name(dev, nm, sizeof nm),
                        dev.type == TT_CUDA ? (tt_cuda_device_count() ? "no such ordinal" : "no CUDA device or build")
                                            : "unknown device");
  }
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0) return tt_error_set(TT_ERR_SHAPE, "empty: negative size %lld in dim %d", (long long)shape[i], i);
    numel *= shape[i];
  }
  tt_storage *s = calloc(1, sizeof *s);
  tt_tensor *t = tt_tensor_alloc_struct();
  if (!s || !t) {
    free(s);
    if (t) tt_tensor_release(t);
    return tt_error_set(TT_ERR_OOM, "empty: out of host memory for tensor metadata");
  }
  s->refcount = 1;
  s->device = dev;
  s->nbytes = (size_t)numel * tt_dtype_size(dtype);
  tt_status st = tt_alloc_raw(dev, s->nbytes, &s->data);
  if (st != TT_OK) {
    free(s);
    tt_tensor_release(t);
    return st;
  }
  if (dev.type == TT_META) {
    s->meta_live = 1;
    s->meta_counted = (uint32_t)tt_meta_accounting_on();
    if (s->meta_counted) tt_meta_account(s->nbytes, 1);
  }
  t->storage = s;
  t->dtype = dtype;
  t->ndim = ndim;
  t->device = dev;
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    t->shape[i] = shape[i];
    t->strides[i] = stride;
    stride *= shape[i] ? shape[i] : 1;
  }
  *out = t;
  return TT_OK;
}

void tt_tensor_retain(tt_tensor *t) {
  if (t) __atomic_add_fetch(&t->refcount, 1, __ATOMIC_RELAXED);
}

void tt_tensor_release(tt_tensor *t) {
  if (!t) return;
  if (__atomic_sub_fetch(&t->refcount, 1, __ATOMIC_ACQ_REL) == 0) {
    tt_storage_release(t->storage);
    __atomic_sub_fetch(&tt_live_tensors, 1, __ATOMIC_RELAXED);
    free(t);
  }
}

int64_t tt_tensor_numel(const tt_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

int tt_tensor_is_contiguous(const tt_tensor *t) {
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 1) continue;
    if (t->shape[i] == 0) return 1;
    if (t->strides[i] != expected) return 0;
    expected *= t->shape[i];
  }
  return 1;
}

void *tt_tensor_data(const tt_tensor *t) {
  if (!t || !t->storage || !t->storage->data) return NULL;
  return (char *)t->storage->data + (size_t)t->offset * tt_dtype_size(t->dtype);
}

tt_status tt_tensor_new_view(const tt_tensor *base, int ndim, const int64_t *shape, const int64_t *strides,
                             int64_t offset, tt_tensor **out) {
  tt_tensor *t = tt_tensor_alloc_struct();
  if (!t) return tt_error_set(TT_ERR_OOM, "view: out of host memory");
  t->storage = base->storage;
  __atomic_add_fetch(&t->storage->refcount, 1, __ATOMIC_RELAXED);
  t->offset = offset;
  t->dtype = base->dtype;
  t->device = base->device;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    t->shape[i] = shape[i];
    t->strides[i] = strides[i];
  }
  *out = t;
  return TT_OK;
}

/* ---- views ------------------------------------------------------------ */

static int tt_norm_dim(int dim, int ndim) { return dim < 0 ? dim + ndim : dim; }

tt_status tt_view_reshape(const tt_tensor *t, int ndim, const int64_t *shape_in, tt_tensor **out) {
  char sa[128];
  *out = NULL;
  if (ndim < 0 || ndim > TT_MAX_DIMS) return tt_error_set(TT_ERR_SHAPE, "reshape: %d dims (max %d)", ndim, TT_MAX_DIMS);
  int64_t shape[TT_MAX_DIMS], numel = tt_tensor_numel(t), known = 1;
  int infer = -1;
  for (int i = 0; i < ndim; i++) {
    shape[i] = shape_in[i];
    if (shape[i] == -1) {
      if (infer >= 0) return tt_error_set(TT_ERR_SHAPE, "reshape: only one dimension can be -1");
      infer = i;
    } else if (shape[i] < 0) {
      return tt_error_set(TT_ERR_SHAPE, "reshape: invalid size %lld", (long long)shape[i]);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known)
      return tt_error_set(TT_ERR_SHAPE, "reshape: cannot infer -1 for a tensor of shape %s (%lld elements)",
                          tt_tensor_shape_str(t, sa, sizeof sa), (long long)numel);
    shape[infer] = numel / known;
    known *= shape[infer];
  }
  if (known != numel) {
    char sb[128];
    size_t p = 0;
    p += (size_t)snprintf(sb, sizeof sb, "[");
    for (int i = 0; i < ndim && p < sizeof sb; i++)
      p += (size_t)snprintf(sb + p, sizeof sb - p, i ? ", %lld" : "%lld", (long long)shape_in[i]);
    if (p < sizeof sb) snprintf(sb + p, sizeof sb - p, "]");
    return tt_error_set(TT_ERR_SHAPE, "reshape: shape %s is invalid for a tensor of shape %s (%lld elements)", sb,
                        tt_tensor_shape_str(t, sa, sizeof sa), (long long)numel);
  }
  /* Strides of a view, if one exists (PyTorch's computeStride): walk the old
   * dims in chunks that are contiguous among themselves and split each chunk
   * into the new dims that cover exactly its elements. */
  int64_t strides[TT_MAX_DIMS];
  if (numel == 0 || tt_tensor_is_contiguous(t)) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
      strides[i] = s;
      s *= shape[i] ? shape[i] : 1;
    }
    return tt_tensor_new_view(t, ndim, shape, strides, t->offset, out);
  }
  int view_d = ndim - 1;
  int64_t chunk_base_stride = t->ndim ? t->strides[t->ndim - 1] : 1;
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    tensor_numel *= t->shape[d];
    if (d == 0 || (t->shape[d - 1] != 1 && t->strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel)
        return tt_error_set(TT_ERR_LAYOUT,
                            "reshape: a tensor of shape %s with these strides cannot be viewed with the new shape; "
                            "call :contiguous() first",
                            tt_tensor_shape_str(t, sa, sizeof sa));
      if (d > 0) {
        chunk_base_stride = t->strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1)
    return tt_error_set(TT_ERR_LAYOUT, "reshape: no view of shape %s for this layout; call :contiguous() first",
                        tt_tensor_shape_str(t, sa, sizeof sa));
  return tt_tensor_new_view(t, ndim, shape, strides, t->offset, out);
}

tt_status tt_view_permute(const tt_tensor *t, const int *dims, tt_tensor **out) {
  int64_t shape[TT_MAX_DIMS], strides[TT_MAX_DIMS];
  int seen[TT_MAX_DIMS] = {0};
  char sa[128];
  *out = NULL;
  for (int i = 0; i < t->ndim; i++) {
    int d = tt_norm_dim(dims[i], t->ndim);
    if (d < 0 || d >= t->ndim || seen[d])
      return tt_error_set(TT_ERR_INVALID, "permute: dims are not a permutation of 0..%d for shape %s", t->ndim - 1,
                          tt_tensor_shape_str(t, sa, sizeof sa));
    seen[d] = 1;
    shape[i] = t->shape[d];
    strides[i] = t->strides[d];
  }
  return tt_tensor_new_view(t, t->ndim, shape, strides, t->offset, out);
}

tt_status tt_view_transpose(const tt_tensor *t, int d0, int d1, tt_tensor **out) {
  char sa[128];
  *out = NULL;
  d0 = tt_norm_dim(d0, t->ndim);
  d1 = tt_norm_dim(d1, t->ndim);
  if (d0 < 0 || d0 >= t->ndim || d1 < 0 || d1 >= t->ndim)
    return tt_error_set(TT_ERR_INDEX, "transpose: dims (%d, %d) out of range for shape %s", d0, d1,
                        tt_tensor_shape_str(t, sa, sizeof sa));
  int dims[TT_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) dims[i] = i;
  dims[d0] = d1;
  dims[d1] = d0;
  return tt_view_permute(t, dims, out);
}

tt_status tt_view_narrow(const tt_tensor *t, int dim, int64_t start, int64_t length, tt_tensor **out) {
  char sa[128];
  *out = NULL;
  int d = tt_norm_dim(dim, t->ndim);
  if (d < 0 || d >= t->ndim)
    return tt_error_set(TT_ERR_INDEX, "narrow: dim %d out of range for shape %s", dim,
                        tt_tensor_shape_str(t, sa, sizeof sa));
  if (start < 0) start += t->shape[d];
  if (start < 0 || length < 0 || start + length > t->shape[d])
    return tt_error_set(TT_ERR_INDEX, "narrow: [%lld, %lld) is out of range for dim %d of size %lld (shape %s)",
                        (long long)start, (long long)(start + length), d, (long long)t->shape[d],
                        tt_tensor_shape_str(t, sa, sizeof sa));
  int64_t shape[TT_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[d] = length;
  return tt_tensor_new_view(t, t->ndim, shape, t->strides, t->offset + start * t->strides[d], out);
}

tt_status tt_view_expand(const tt_tensor *t, int ndim, const int64_t *shape_in, tt_tensor **out) {
  char sa[128];
  *out = NULL;
  if (ndim < t->ndim || ndim > TT_MAX_DIMS)
    return tt_error_set(TT_ERR_SHAPE, "expand: cannot expand shape %s to %d dims",
                        tt_tensor_shape_str(t, sa, sizeof sa), ndim);
  int64_t shape[TT_MAX_DIMS], strides[TT_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    int j = i - lead;
    int64_t want = shape_in[i];
    if (j < 0) {
      if (want < 0) return tt_error_set(TT_ERR_SHAPE, "expand: -1 is not allowed for a new leading dim %d", i);
      shape[i] = want;
      strides[i] = 0;
    } else if (want == -1 || want == t->shape[j]) {
      shape[i] = t->shape[j];
      strides[i] = t->strides[j];
    } else if (t->shape[j] == 1) {
      shape[i] = want;
      strides[i] = 0;
    } else {
      return tt_error_set(TT_ERR_SHAPE, "expand: size %lld of dim %d of shape %s cannot expand to %lld (only size-1 dims can)",
                          (long long)t->shape[j], j, tt_tensor_shape_str(t, sa, sizeof sa), (long long)want);
    }
  }
  return tt_tensor_new_view(t, ndim, shape, strides, t->offset, out);
}

/* ---- fill and copies ------------------------------------------------- */

static tt_status tt_need_data(const tt_tensor *t, const char *op) {
  if (t->device.type == TT_META)
    return tt_error_set(TT_ERR_DEVICE, "%s: a meta tensor has no data (materialize it on cpu or cuda first)", op);
  return tt_tensor_check_storage(op, "source", t);
}

tt_status tt_tensor_check_storage(const char *op, const char *name, const tt_tensor *t) {
  char s[96];
  if (t->device.type == TT_META || !t->storage || t->storage->data || t->storage->nbytes == 0) return TT_OK;
  return tt_error_set(TT_ERR_INVALID,
                      "%s: %s %s has no memory: its storage was freed (a parameter that FSDP keeps sharded outside "
                      "its module's forward and backward); expected a tensor with memory",
                      op, name, tt_tensor_shape_str(t, s, sizeof s));
}

/* FSDP frees a parameter's memory after its block has run and brings it
 * back before the block runs again, as FSDP2 resizes the storage to 0 and
 * back: the storage object stays, so every view of it and every reference
 * an autograd node holds sees the memory that comes back. */
tt_status tt_tensor_storage_free(tt_tensor *t) {
  if (!t || !t->storage) return tt_error_set(TT_ERR_INVALID, "storage_free: no tensor");
  tt_storage *s = t->storage;
  if (t->device.type == TT_META) {
    if (s->meta_live && s->meta_counted) tt_meta_account(s->nbytes, -1);
    s->meta_live = 0;
    return TT_OK;
  }
  if (!s->data) return TT_OK;
  tt_free_raw_streams(s->device, s->data, s->nbytes, __atomic_exchange_n(&s->streams, 0u, __ATOMIC_ACQ_REL));
  s->data = NULL;
  return TT_OK;
}

tt_status tt_tensor_storage_alloc(tt_tensor *t) {
  if (!t || !t->storage) return tt_error_set(TT_ERR_INVALID, "storage_alloc: no tensor");
  tt_storage *s = t->storage;
  if (t->device.type == TT_META) {
    if (!s->meta_live && s->nbytes > 0) {
      s->meta_live = 1;
      s->meta_counted = (uint32_t)tt_meta_accounting_on();
      if (s->meta_counted) tt_meta_account(s->nbytes, 1);
    }
    return TT_OK;
  }
  if (s->data || s->nbytes == 0) return TT_OK;
  return tt_alloc_raw(s->device, s->nbytes, &s->data);
}

int tt_tensor_has_storage(const tt_tensor *t) {
  /* (on meta: unless its storage was freed, as a real one's is: dry runs follow FSDP's frees) */
  return t && t->storage &&
         (t->storage->data || t->storage->nbytes == 0 || (t->device.type == TT_META && t->storage->meta_live));
}

tt_status tt_tensor_contiguous(const tt_tensor *t, tt_tensor **out) {
  if (tt_tensor_is_contiguous(t)) {
    tt_tensor_retain((tt_tensor *)t);
    *out = (tt_tensor *)t;
    return TT_OK;
  }
  TT_TRY(tt_tensor_empty(t->ndim, t->shape, t->dtype, t->device, out));
  tt_status st = tt_tensor_copy(*out, t);
  if (st != TT_OK) {
    tt_tensor_release(*out);
    *out = NULL;
  }
  return st;
}

tt_status tt_tensor_fill(tt_tensor *t, double value) {
  if (t->device.type == TT_META) return TT_OK;
  TT_TRY(tt_tensor_check_storage("fill", "tensor", t));
  const tt_kernels *be = tt_backend(t->device);
  if (tt_tensor_is_contiguous(t)) return be->fill(t->dtype, tt_tensor_numel(t), value, tt_tensor_data(t));
  /* Strided: fill a packed scalar and broadcast-copy it. */
  tt_tensor *one;
  int64_t shp[1] = {1};
  TT_TRY(tt_tensor_empty(0, shp, t->dtype, t->device, &one));
  tt_status st = be->fill(t->dtype, 1, value, tt_tensor_data(one));
  int64_t zero[TT_MAX_DIMS] = {0};
  if (st == TT_OK)
    st = be->copy(t->ndim, t->shape, one->dtype, tt_tensor_data(one), zero, t->dtype, tt_tensor_data(t), t->strides);
  tt_tensor_release(one);
  return st;
}

tt_status tt_tensor_arange(tt_tensor *t, double start, double step) {
  if (t->device.type == TT_META) return TT_OK;
  char sa[128];
  if (!tt_tensor_is_contiguous(t))
    return tt_error_set(TT_ERR_LAYOUT, "arange: output of shape %s must be contiguous",
                        tt_tensor_shape_str(t, sa, sizeof sa));
  return tt_backend(t->device)->arange(t->dtype, tt_tensor_numel(t), start, step, tt_tensor_data(t));
}

static int tt_same_shape(const tt_tensor *a, const tt_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

tt_status tt_tensor_copy(tt_tensor *dst, const tt_tensor *src) {
  char sa[128], sb[128];
  if (!tt_same_shape(dst, src))
    return tt_error_set(TT_ERR_SHAPE, "copy: destination shape %s and source shape %s differ",
                        tt_tensor_shape_str(dst, sa, sizeof sa), tt_tensor_shape_str(src, sb, sizeof sb));
  if (dst->device.type == TT_META) return TT_OK;
  TT_TRY(tt_need_data(src, "copy"));
  TT_TRY(tt_tensor_check_storage("copy", "destination", dst));
  if (tt_tensor_numel(dst) == 0) return TT_OK;
  if (tt_same_device(dst->device, src->device)) {
    const tt_kernels *be = tt_backend(dst->device);
    return be->copy(dst->ndim, dst->shape, src->dtype, tt_tensor_data(src), src->strides, dst->dtype,
                    tt_tensor_data(dst), dst->strides);
  }
  /* Across devices: pack on the source side in the destination dtype, move
   * the bytes, then unpack on the destination side if it is strided. */
  tt_tensor *packed = NULL, *landed = NULL;
  tt_status st = tt_tensor_empty(src->ndim, src->shape, dst->dtype, src->device, &packed);
  if (st == TT_OK) st = tt_tensor_copy(packed, src);
  if (st == TT_OK) {
    if (tt_tensor_is_contiguous(dst)) {
      landed = dst;
      tt_tensor_retain(dst);
    } else {
      st = tt_tensor_empty(dst->ndim, dst->shape, dst->dtype, dst->device, &landed);
    }
  }
  if (st == TT_OK) {
    size_t nbytes = (size_t)tt_tensor_numel(dst) * tt_dtype_size(dst->dtype);
    if (src->device.type == TT_CPU && dst->device.type == TT_CUDA) {
      st = tt_backend(dst->device)->mem_copy(dst->device.index, tt_tensor_data(landed), tt_tensor_data(packed), nbytes, 0);
    } else if (src->device.type == TT_CUDA && dst->device.type == TT_CPU) {
      st = tt_backend(src->device)->mem_copy(src->device.index, tt_tensor_data(landed), tt_tensor_data(packed), nbytes, 1);
      /* The host just waited for the device: the moment to report what its
       * index kernels recorded (they cannot stop the op themselves). */
      if (st == TT_OK) st = tt_device_report(src->device);
    } else { /* cuda:i -> cuda:j through the host */
      tt_tensor *host = NULL;
      tt_device cpu = {TT_CPU, 0};
      st = tt_tensor_empty(dst->ndim, dst->shape, dst->dtype, cpu, &host);
      if (st == TT_OK) st = tt_tensor_copy(host, packed);
      if (st == TT_OK) st = tt_tensor_copy(landed, host);
      tt_tensor_release(host);
    }
  }
  if (st == TT_OK && landed != dst) st = tt_tensor_copy(dst, landed);
  tt_tensor_release(packed);
  tt_tensor_release(landed);
  return st;
}

/* Copy between a packed host buffer of `buf_dtype` and t (either direction). */
static tt_status tt_copy_host_buffer(tt_tensor *t, void *buf, int buf_dtype, int64_t n, int to_tensor,
                                     const char *op) {
  char sa[128];
  TT_TRY(tt_need_data(t, op));
  if (n != tt_tensor_numel(t))
    return tt_error_set(TT_ERR_SHAPE, "%s: %lld values given for a tensor of shape %s (%lld elements)", op,
                        (long long)n, tt_tensor_shape_str(t, sa, sizeof sa), (long long)tt_tensor_numel(t));
  if (n == 0) return TT_OK;
  if (t->device.type != TT_CPU) {
    tt_tensor *host = NULL;
    tt_device cpu = {TT_CPU, 0};
    tt_status st = tt_tensor_empty(t->ndim, t->shape, t->dtype, cpu, &host);
    if (st == TT_OK && !to_tensor) st = tt_tensor_copy(host, t);
    if (st == TT_OK) st = tt_copy_host_buffer(host, buf, buf_dtype, n, to_tensor, op);
    if (st == TT_OK && to_tensor) st = tt_tensor_copy(t, host);
    tt_tensor_release(host);
    return st;
  }
  int64_t packed[TT_MAX_DIMS], s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    packed[i] = s;
    s *= t->shape[i];
  }
  const tt_kernels *be = tt_kernels_cpu();
  if (to_tensor) return be->copy(t->ndim, t->shape, buf_dtype, buf, packed, t->dtype, tt_tensor_data(t), t->strides);
  return be->copy(t->ndim, t->shape, t->dtype, tt_tensor_data(t), t->strides, buf_dtype, buf, packed);
}

tt_status tt_tensor_from_f64(tt_tensor *dst, const double *src, int64_t n) {
  return tt_copy_host_buffer(dst, (void *)src, TT_F64, n, 1, "from_table");
}

tt_status tt_tensor_to_f64(const tt_tensor *src, double *dst, int64_t n) {
  return tt_copy_host_buffer((tt_tensor *)src, dst, TT_F64, n, 0, "to_table");
}

tt_status tt_tensor_from_host(tt_tensor *dst, const void *src, size_t nbytes) {
  int64_t n = tt_tensor_numel(dst);
  if (nbytes != (size_t)n * tt_dtype_size(dst->dtype))
    return tt_error_set(TT_ERR_SHAPE, "from_host: %zu bytes given, the tensor holds %zu", nbytes,
                        (size_t)n * tt_dtype_size(dst->dtype));
  return tt_copy_host_buffer(dst, (void *)src, dst->dtype, n, 1, "from_host");
}

tt_status tt_tensor_to_host(const tt_tensor *src, void *dst, size_t nbytes) {
  int64_t n = tt_tensor_numel(src);
  if (nbytes != (size_t)n * tt_dtype_size(src->dtype))
    return tt_error_set(TT_ERR_SHAPE, "to_host: buffer of %zu bytes, the tensor holds %zu", nbytes,
                        (size_t)n * tt_dtype_size(src->dtype));
  return tt_copy_host_buffer((tt_tensor *)src, dst, src->dtype, n, 0, "to_host");
}

/* ---- random numbers ---------------------------------------------------- */

static tt_status tt_rng_fill(tt_tensor *t, int kind, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                             double p3, const char *op) {
  char sa[128];
  if (t->device.type == TT_META) return TT_OK;
  if (!tt_dtype_is_float(t->dtype))
    return tt_error_set(TT_ERR_DTYPE, "%s: needs a floating-point tensor, got %s", op, tt_dtype_name(t->dtype));
  if (!tt_tensor_is_contiguous(t))
    return tt_error_set(TT_ERR_LAYOUT, "%s: tensor of shape %s must be contiguous", op,
                        tt_tensor_shape_str(t, sa, sizeof sa));
  const tt_kernels *be = tt_backend(t->device);
  if (be->rng) return be->rng(kind, t->dtype, tt_tensor_numel(t), seed, offset, p0, p1, p2, p3, tt_tensor_data(t));
  /* A backend without its own generator draws on the host and copies: the
   * numbers are the same by construction (counter-based), only slower. */
  tt_tensor *host = NULL;
  tt_device cpu = {TT_CPU, 0};
  tt_status st = tt_tensor_empty(t->ndim, t->shape, t->dtype, cpu, &host);
  if (st == TT_OK) st = tt_kernels_cpu()->rng(kind, t->dtype, tt_tensor_numel(t), seed, offset, p0, p1, p2, p3,
                                              tt_tensor_data(host));
  if (st == TT_OK) st = tt_tensor_copy(t, host);
  tt_tensor_release(host);
  return st;
}

tt_status tt_rng_uniform(tt_tensor *t, uint64_t seed, uint64_t offset, double low, double high) {
  return tt_rng_fill(t, 0, seed, offset, low, high, 0, 0, "uniform");
}

tt_status tt_rng_normal(tt_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
  if (std < 0) return tt_error_set(TT_ERR_INVALID, "normal: std must be >= 0, got %g", std);
  return tt_rng_fill(t, 1, seed, offset, mean, std, 0, 0, "normal");
}

tt_status tt_rng_trunc_normal(tt_tensor *t, uint64_t seed, uint64_t offset, double mean, double std, double a,
                              double b) {
  if (!(a < b)) return tt_error_set(TT_ERR_INVALID, "trunc_normal: needs a < b, got a=%g b=%g", a, b);
  if (std < 0) return tt_error_set(TT_ERR_INVALID, "trunc_normal: std must be >= 0, got %g", std);
  return tt_rng_fill(t, 2, seed, offset, mean, std, a, b, "trunc_normal");
}

uint64_t tt_hash_string(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; s && *s; s++) {
    h ^= (unsigned char)*s;
    h *= 1099511628211ull;
  }
  return h;
}
