/*
 * alloc.c — caching allocators, one pool per device.
 *
 * Training allocates the same activation sizes every step; going to the
 * system (malloc, cudaMalloc) each time is slow and fragments. Each pool
 * rounds a request up to a size class (four classes per power of two, so at
 * most 25% waste) and keeps freed blocks on a per-class free list for the
 * next request of that class. Statistics match what PyTorch reports:
 * allocated (in use), reserved (in use + cached), peak, and counts of
 * requests, cache hits, retries after flushing the cache, and OOMs.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define TT_MAX_CUDA_DEVICES 16

typedef struct tt_block {
  struct tt_block *next;
  void *ptr;
} tt_block;

typedef struct tt_pool {
  pthread_mutex_t lock;
  tt_block *free_list[TT_NUM_CLASSES];
  tt_block *spare; /* recycled list nodes, so caching itself never mallocs per call */
  tt_mem_stats stats;
} tt_pool;

static tt_pool tt_pools[1 + TT_MAX_CUDA_DEVICES];
static pthread_once_t tt_pools_once = PTHREAD_ONCE_INIT;

static void tt_pools_init(void) {
  for (int i = 0; i < 1 + TT_MAX_CUDA_DEVICES; i++) pthread_mutex_init(&tt_pools[i].lock, NULL);
}

static tt_pool *tt_pool_of(tt_device dev) {
  pthread_once(&tt_pools_once, tt_pools_init);
  if (dev.type == TT_CPU) return &tt_pools[0];
  if (dev.type == TT_CUDA && dev.index >= 0 && dev.index < TT_MAX_CUDA_DEVICES) return &tt_pools[1 + dev.index];
  return NULL;
}

/* Size class: 512 B granularity below 4 KiB, then 4 steps per power of two. */
int tt_size_class(size_t n, size_t *rounded) {
  if (n <= 4096) {
    size_t r = (n + 511) & ~(size_t)511;
    if (r == 0) r = 512;
    *rounded = r;
    return (int)(r / 512) - 1; /* 0..7 */
  }
  int p = 63 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^p < n <= 2^(p+1) */
  size_t base = (size_t)1 << p, step = base / 4;
  size_t k = (n - base + step - 1) / step; /* 1..4 */
  *rounded = base + k * step;
  int cls = 8 + (p - 12) * 4 + (int)(k - 1);
  return cls < TT_NUM_CLASSES ? cls : -1; /* -1: too large to cache */
}

static void tt_pool_flush_locked(tt_pool *pool, tt_device dev, const tt_kernels *be) {
  for (int c = 0; c < TT_NUM_CLASSES; c++) {
    while (pool->free_list[c]) {
      tt_block *b = pool->free_list[c];
      pool->free_list[c] = b->next;
      size_t rounded;
      /* class -> size: recompute from the class index */
      if (c < 8) rounded = (size_t)(c + 1) * 512;
      else {
        int p = 12 + (c - 8) / 4, k = (c - 8) % 4 + 1;
        rounded = ((size_t)1 << p) + (size_t)k * (((size_t)1 << p) / 4);
      }
      if (be) be->mem_free(dev.index, b->ptr);
      pool->stats.reserved -= (int64_t)rounded;
      b->next = pool->spare;
      pool->spare = b;
    }
  }
}

tt_status tt_alloc_raw(tt_device dev, size_t nbytes, void **out) {
  *out = NULL;
  if (dev.type == TT_META) return TT_OK;
  tt_pool *pool = tt_pool_of(dev);
  const tt_kernels *be = tt_backend(dev);
  if (!pool || !be) {
    char nm[32];
    return tt_error_set(TT_ERR_DEVICE, "alloc: device %s is not available in this build or machine",
                        tt_device_name(dev, nm, sizeof nm));
  }
  size_t rounded;
  int cls = tt_size_class(nbytes, &rounded);
  pthread_mutex_lock(&pool->lock);
  pool->stats.num_allocs++;
  if (cls >= 0 && pool->free_list[cls]) {
    tt_block *b = pool->free_list[cls];
    pool->free_list[cls] = b->next;
    *out = b->ptr;
    b->next = pool->spare;
    pool->spare = b;
    pool->stats.num_cache_hits++;
  } else {
    tt_status st = be->mem_alloc(dev.index, rounded, out);
    if (st != TT_OK || !*out) {
      /* Cached blocks of other sizes may be what stands in the way. */
      pool->stats.num_alloc_retries++;
      tt_pool_flush_locked(pool, dev, be);
      st = be->mem_alloc(dev.index, rounded, out);
    }
    if (st != TT_OK || !*out) {
      pool->stats.num_ooms++;
      tt_mem_stats s = pool->stats;
      pthread_mutex_unlock(&pool->lock);
      char nm[32];
      return tt_error_set(TT_ERR_OOM,
                          "out of memory on %s: tried to allocate %.2f MiB (allocated %.2f MiB, reserved %.2f MiB, "
                          "peak %.2f MiB, %lld retries, %lld OOMs)",
                          tt_device_name(dev, nm, sizeof nm), (double)rounded / 1048576.0,
                          (double)s.allocated / 1048576.0, (double)s.reserved / 1048576.0,
                          (double)s.peak_allocated / 1048576.0, (long long)s.num_alloc_retries,
                          (long long)s.num_ooms);
    }
    pool->stats.reserved += (int64_t)rounded;
  }
  pool->stats.allocated += (int64_t)rounded;
  if (pool->stats.allocated > pool->stats.peak_allocated) pool->stats.peak_allocated = pool->stats.allocated;
  pthread_mutex_unlock(&pool->lock);
  return TT_OK;
}

void tt_free_raw(tt_device dev, void *ptr, size_t nbytes) {
  if (!ptr || dev.type == TT_META) return;
  tt_pool *pool = tt_pool_of(dev);
  const tt_kernels *be = tt_backend(dev);
  if (!pool || !be) return;
  size_t rounded;
  int cls = tt_size_class(nbytes, &rounded);
  pthread_mutex_lock(&pool->lock);
  pool->stats.num_frees++;
  pool->stats.allocated -= (int64_t)rounded;
  tt_block *b = pool->spare;
  if (cls >= 0 && !b) b = malloc(sizeof *b); /* list nodes only, rare */
  else if (b) pool->spare = b->next;
  if (cls >= 0 && b) {
    b->ptr = ptr;
    b->next = pool->free_list[cls];
    pool->free_list[cls] = b;
  } else {
    if (b) { b->next = pool->spare; pool->spare = b; }
    be->mem_free(dev.index, ptr);
    pool->stats.reserved -= (int64_t)rounded;
  }
  pthread_mutex_unlock(&pool->lock);
}

tt_status tt_memory_stats(tt_device dev, tt_mem_stats *out) {
  tt_pool *pool = tt_pool_of(dev);
  if (!pool) {
    memset(out, 0, sizeof *out);
    return dev.type == TT_META ? TT_OK : tt_error_set(TT_ERR_DEVICE, "memory_stats: unknown device");
  }
  pthread_mutex_lock(&pool->lock);
  *out = pool->stats;
  pthread_mutex_unlock(&pool->lock);
  return TT_OK;
}

void tt_memory_reset_peak(tt_device dev) {
  tt_pool *pool = tt_pool_of(dev);
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  pool->stats.peak_allocated = pool->stats.allocated;
  pthread_mutex_unlock(&pool->lock);
}

void tt_memory_empty_cache(tt_device dev) {
  tt_pool *pool = tt_pool_of(dev);
  const tt_kernels *be = tt_backend(dev);
  if (!pool || !be) return;
  pthread_mutex_lock(&pool->lock);
  tt_pool_flush_locked(pool, dev, be);
  pthread_mutex_unlock(&pool->lock);
}
