/*
 * pinned.c — the cache of pinned (page-locked) host buffers that async
 * checkpoints snapshot CUDA tensors into (engine/checkpoint.c).
 *
 * Pinning is slow (the pages are mapped and locked: it costs more than the
 * copy itself), and every checkpoint of a run snapshots the same tensor
 * sizes. So a freed buffer is kept on the free list of its size class
 * (alloc.c's classes and free lists) for the next checkpoint, and is returned to the
 * system only by tt_memory_pinned_empty_cache, or to make room when
 * pinning fails. One cache for the process: pinned memory is the host's and
 * any device copies into it. Statistics as alloc.c's (titan.memory_stats
 * ("pinned")); the writer thread frees into it, hence the lock.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static struct {
  pthread_mutex_t lock;
  const tt_kernels *be; /* whose host_alloc pinned the cached buffers */
  tt_cache cache;
  tt_mem_stats stats;
} tt_pinned = {PTHREAD_MUTEX_INITIALIZER, NULL, {{NULL}, NULL}, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};

static void tt_pinned_flush_locked(void) {
  for (int c = 0; c < TT_NUM_CLASSES; c++) {
    void *p;
    while ((p = tt_cache_take(&tt_pinned.cache, c))) {
      tt_pinned.be->host_free(p);
      tt_pinned.stats.reserved -= (int64_t)tt_class_bytes(c);
    }
  }
}

tt_status tt_pinned_alloc(const tt_kernels *be, size_t nbytes, void **out) {
  size_t rounded;
  int cls = tt_size_class(nbytes, &rounded);
  pthread_mutex_lock(&tt_pinned.lock);
  tt_pinned.stats.num_allocs++;
  *out = cls >= 0 ? tt_cache_take(&tt_pinned.cache, cls) : NULL;
  if (*out) {
    tt_pinned.stats.num_cache_hits++;
  } else {
    tt_status st = be->host_alloc(rounded, out);
    if (st != TT_OK && tt_pinned.be) {
      /* Cached buffers of other sizes may hold the locked-memory budget. */
      tt_pinned.stats.num_alloc_retries++;
      tt_pinned_flush_locked();
      st = be->host_alloc(rounded, out);
    }
    if (st != TT_OK) {
      tt_pinned.stats.num_ooms++;
      tt_mem_stats s = tt_pinned.stats;
      pthread_mutex_unlock(&tt_pinned.lock);
      char why[512];
      snprintf(why, sizeof why, "%s", tt_last_error());
      return tt_error_set(st, "pinned host memory: cannot allocate %.2f MiB for a checkpoint snapshot (allocated "
                          "%.2f MiB, reserved %.2f MiB): %s", (double)rounded / 1048576.0,
                          (double)s.allocated / 1048576.0, (double)s.reserved / 1048576.0, why);
    }
    tt_pinned.be = be;
    tt_pinned.stats.reserved += (int64_t)rounded;
  }
  tt_pinned.stats.allocated += (int64_t)rounded;
  if (tt_pinned.stats.allocated > tt_pinned.stats.peak_allocated)
    tt_pinned.stats.peak_allocated = tt_pinned.stats.allocated;
  pthread_mutex_unlock(&tt_pinned.lock);
  return TT_OK;
}

void tt_pinned_free(void *ptr, size_t nbytes) {
  if (!ptr) return;
  size_t rounded;
  int cls = tt_size_class(nbytes, &rounded);
  pthread_mutex_lock(&tt_pinned.lock);
  tt_pinned.stats.num_frees++;
  tt_pinned.stats.allocated -= (int64_t)rounded;
  if (!(cls >= 0 && tt_cache_put(&tt_pinned.cache, cls, ptr))) {
    tt_pinned.be->host_free(ptr);
    tt_pinned.stats.reserved -= (int64_t)rounded;
  }
  pthread_mutex_unlock(&tt_pinned.lock);
}

tt_status tt_memory_pinned_stats(tt_mem_stats *out) {
  pthread_mutex_lock(&tt_pinned.lock);
  *out = tt_pinned.stats;
  pthread_mutex_unlock(&tt_pinned.lock);
  return TT_OK;
}

void tt_memory_pinned_empty_cache(void) {
  pthread_mutex_lock(&tt_pinned.lock);
  if (tt_pinned.be) tt_pinned_flush_locked();
  pthread_mutex_unlock(&tt_pinned.lock);
}
