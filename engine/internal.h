/*
 * internal.h — what the engine's files share and Lua never sees.
 */
#ifndef TT_ENGINE_INTERNAL_H
#define TT_ENGINE_INTERNAL_H

#include "titan.h"
#include "kernels.h"

/* Record the last error (thread-local) and return `status`, so call sites
 * read `return tt_error_set(TT_ERR_SHAPE, "matmul: ...")`. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
tt_status tt_error_set(int status, const char *fmt, ...);

/* The backend of a device, or NULL (meta, or cuda without a CUDA build). */
const tt_kernels *tt_backend(tt_device dev);
const char *tt_device_name(tt_device dev, char *buf, size_t len);
/* After the host waited for dev (a device->host copy, a synchronize): the
 * out-of-range index its kernels recorded, if any, as TT_ERR_INDEX naming
 * the op; the record is cleared. TT_OK on devices that check up front. */
tt_status tt_device_report(tt_device dev);

/* Caching allocator (alloc.c): per device, size-bucketed free lists. */
tt_status tt_alloc_raw(tt_device dev, size_t nbytes, void **out);
/* The meta device's accounting: a storage of nbytes counted in (sign 1) or out (-1). */
void tt_meta_account(size_t nbytes, int sign);
int tt_meta_accounting_on(void);
void tt_free_raw(tt_device dev, void *ptr, size_t nbytes);
/* tt_free_raw for a block that other streams (1 << tt_stream_kind) used. */
void tt_free_raw_streams(tt_device dev, void *ptr, size_t nbytes, uint32_t streams);
/* The device a private pool serves. */
tt_device tt_mempool_device(const tt_mempool *pool);
/* The size class of an n-byte request (< TT_NUM_CLASSES; -1: too large to
 * cache) and the size it is rounded up to; the size of class c. */
#define TT_NUM_CLASSES 256
int tt_size_class(size_t n, size_t *rounded);
size_t tt_class_bytes(int c);

/* Free lists by size class, and the list nodes they recycle so caching
 * itself never mallocs per call (the caller locks). Shared by the device
 * pools (alloc.c) and the pinned-buffer cache (pinned.c). */
typedef struct tt_block {
  struct tt_block *next;
  void *ptr;
} tt_block;
typedef struct tt_cache {
  tt_block *free_list[TT_NUM_CLASSES];
  tt_block *spare;
} tt_cache;
/* Pop a cached block of class cls (NULL when none). */
void *tt_cache_take(tt_cache *cache, int cls);
/* Push a block; 0 when no list node could be had (the caller frees it). */
int tt_cache_put(tt_cache *cache, int cls, void *ptr);

/* Pinned host buffers (pinned.c) from be->host_alloc, cached by size class:
 * the snapshots of async checkpoints. Any thread may free. */
tt_status tt_pinned_alloc(const tt_kernels *be, size_t nbytes, void **out);
void tt_pinned_free(void *ptr, size_t nbytes);

/* Tensors (tensor.c). */
tt_status tt_tensor_new_view(const tt_tensor *base, int ndim, const int64_t *shape, const int64_t *strides,
                             int64_t offset, tt_tensor **out);
int tt_same_device(tt_device a, tt_device b);

#define TT_DIM_ALL (-100)
#define TT_MAX_DIMS 8

#define TT_TRY(expr)                 \
  do {                               \
    tt_status _st = (expr);          \
    if (_st != TT_OK) return _st;    \
  } while (0)

#endif
