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
 *
 * Private pools (tt_mempool) serve CUDA-graph capture: a captured graph
 * replays its kernels on the very addresses they saw, so every block
 * allocated while the graph was captured must stay the graph's until the
 * graph is gone. While a pool is active on a thread, that thread's
 * allocations on the pool's device come from the pool; a block returns to
 * the pool that owns it whenever it is freed (found by address), and is
 * reused only by later allocations of the same pool. A block of the shared
 * cache freed during the capture is adopted by the pool, since the captured
 * kernels may still touch it on replay. The device's statistics include its
 * pools; each pool also keeps its own.
 *
 * Streams: blocks are handed out and reused in the compute stream's order,
 * which is safe for every kernel queued there. A block that work on
 * another stream also used (tt_tensor_record_stream: a collective on the
 * communication stream that the compute stream does not wait for) is not
 * cached when freed: an event is recorded on that stream and the block
 * waits on the pool's pending list until the event has completed, checked
 * without waiting at each allocation, waited for before an out-of-memory
 * retry and by empty_cache. Blocks of private pools (CUDA graphs, which
 * capture the compute stream only) wait for the event when they are freed.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "sim.h"

#define TT_MAX_CUDA_DEVICES 16

struct tt_mempool {
  tt_device dev;
  tt_cache cache;
  tt_mem_stats stats;
  /* Every block the pool owns (in use or cached): an open-addressing set
   * with linear probing, so a free finds its pool in O(1). */
  void **owned;
  size_t cap, count;
  int closing; /* tt_mempool_free was called: blocks go back to the system as they come back */
  struct tt_mempool *next;
};

/* A freed block waiting for another stream's event before reuse. */
typedef struct tt_pending {
  void *ptr;
  int cls;
  size_t rounded;
  void *event;
  struct tt_pending *next;
} tt_pending;

typedef struct tt_pool {
  pthread_mutex_t lock;
  tt_cache cache;
  tt_mem_stats stats;
  tt_mempool *mempools; /* this device's private pools, alive or closing */
  tt_pending *pending;  /* freed blocks other streams may still use */
} tt_pool;

/* Under the simulator (sim.c) the ranks of a job share this process's CPU
 * pool and its cache (one rank runs at a time), but each keeps statistics
 * of its own, so a simulated rank reports the allocated and peak bytes that
 * the same rank reports as a process of its own (reserved stays the
 * shared pool's). Only the simulating thread counts there: a block a
 * rank's background thread (async checkpoint writes) frees counts only in
 * the pool's figures. */
static tt_mem_stats *tt_sim_stats;
static int tt_sim_nstats;

void tt_alloc_sim_begin(int world) {
  free(tt_sim_stats);
  tt_sim_stats = calloc((size_t)world, sizeof *tt_sim_stats);
  tt_sim_nstats = tt_sim_stats ? world : 0;
}

void tt_alloc_sim_end(void) {
  free(tt_sim_stats);
  tt_sim_stats = NULL;
  tt_sim_nstats = 0;
}

static tt_mem_stats *tt_rank_stats(tt_device dev) {
  if (dev.type != TT_CPU || !tt_sim_stats) return NULL;
  int r = tt_sim_rank();
  return r >= 0 && r < tt_sim_nstats ? &tt_sim_stats[r] : NULL;
}

/* The private pool serving this thread's allocations (on its device). */
static __thread tt_mempool *tt_active_mempool;

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

size_t tt_class_bytes(int c) {
  if (c < 8) return (size_t)(c + 1) * 512;
  int p = 12 + (c - 8) / 4, k = (c - 8) % 4 + 1;
  return ((size_t)1 << p) + (size_t)k * (((size_t)1 << p) / 4);
}

/* Hands every cached block of `cache` back to the system; returns the bytes
 * released. `each` (may be NULL) sees every block first. */
static int64_t tt_cache_flush(tt_cache *cache, tt_device dev, const tt_kernels *be, void (*each)(void *, void *),
                              void *arg) {
  int64_t released = 0;
  for (int c = 0; c < TT_NUM_CLASSES; c++) {
    while (cache->free_list[c]) {
      tt_block *b = cache->free_list[c];
      cache->free_list[c] = b->next;
      if (each) each(arg, b->ptr);
      if (be) be->mem_free(dev.index, b->ptr);
      released += (int64_t)tt_class_bytes(c);
      b->next = cache->spare;
      cache->spare = b;
    }
  }
  return released;
}

static void tt_pool_flush_locked(tt_pool *pool, tt_device dev, const tt_kernels *be) {
  pool->stats.reserved -= tt_cache_flush(&pool->cache, dev, be, NULL, NULL);
}

void *tt_cache_take(tt_cache *cache, int cls) {
  tt_block *b = cache->free_list[cls];
  if (!b) return NULL;
  cache->free_list[cls] = b->next;
  b->next = cache->spare;
  cache->spare = b;
  return b->ptr;
}

int tt_cache_put(tt_cache *cache, int cls, void *ptr) {
  tt_block *b = cache->spare;
  if (b) cache->spare = b->next;
  else if (!(b = malloc(sizeof *b))) return 0; /* list nodes only, rare */
  b->ptr = ptr;
  b->next = cache->free_list[cls];
  cache->free_list[cls] = b;
  return 1;
}

/* ---- the owned-block set of a private pool --------------------------- */

static size_t tt_ptr_hash(const void *p, size_t cap) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return (size_t)x & (cap - 1);
}

static int tt_owned_has(const tt_mempool *mp, const void *p) {
  if (!mp->cap) return 0;
  for (size_t i = tt_ptr_hash(p, mp->cap);; i = (i + 1) & (mp->cap - 1)) {
    if (mp->owned[i] == p) return 1;
    if (!mp->owned[i]) return 0;
  }
}

static int tt_owned_add(tt_mempool *mp, void *p) {
  if ((mp->count + 1) * 2 > mp->cap) { /* keep the load under 1/2 */
    size_t ncap = mp->cap ? mp->cap * 2 : 64;
    void **n = calloc(ncap, sizeof *n);
    if (!n) return 0;
    for (size_t i = 0; i < mp->cap; i++) {
      if (!mp->owned[i]) continue;
      size_t j = tt_ptr_hash(mp->owned[i], ncap);
      while (n[j]) j = (j + 1) & (ncap - 1);
      n[j] = mp->owned[i];
    }
    free(mp->owned);
    mp->owned = n;
    mp->cap = ncap;
  }
  size_t i = tt_ptr_hash(p, mp->cap);
  while (mp->owned[i]) i = (i + 1) & (mp->cap - 1);
  mp->owned[i] = p;
  mp->count++;
  return 1;
}

/* Deletion by backward shift: no tombstones, so lookups stay short. */
static void tt_owned_remove(tt_mempool *mp, const void *p) {
  if (!mp->cap) return;
  size_t i = tt_ptr_hash(p, mp->cap);
  while (mp->owned[i] != p) {
    if (!mp->owned[i]) return;
    i = (i + 1) & (mp->cap - 1);
  }
  mp->owned[i] = NULL;
  mp->count--;
  for (size_t j = (i + 1) & (mp->cap - 1); mp->owned[j]; j = (j + 1) & (mp->cap - 1)) {
    size_t h = tt_ptr_hash(mp->owned[j], mp->cap);
    /* Move j back into the hole unless its home lies cyclically in (i, j]. */
    int stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
    if (!stays) {
      mp->owned[i] = mp->owned[j];
      mp->owned[j] = NULL;
      i = j;
    }
  }
}

static tt_mempool *tt_mempool_owner_locked(tt_pool *pool, const void *p) {
  for (tt_mempool *mp = pool->mempools; mp; mp = mp->next)
    if (tt_owned_has(mp, p)) return mp;
  return NULL;
}

static void tt_mempool_destroy_locked(tt_pool *pool, tt_mempool *mp) {
  for (tt_mempool **pp = &pool->mempools; *pp; pp = &(*pp)->next)
    if (*pp == mp) {
      *pp = mp->next;
      break;
    }
  for (tt_block *b = mp->cache.spare; b;) {
    tt_block *n = b->next;
    free(b);
    b = n;
  }
  free(mp->owned);
  free(mp);
}

/* refused: tt_block_alloc turned the request down before malloc (the host
 * cannot back it), rather than the device's allocator failing. in_pool: a
 * private pool's request, maybe inside a CUDA-graph capture: a GPU is not
 * asked for its free memory then (whether cudaMemGetInfo may be called
 * while capturing was not verified, and a message is not worth the risk of
 * invalidating the capture). */
static tt_status tt_oom(tt_device dev, size_t rounded, tt_mem_stats s, int refused, int in_pool) {
  char nm[32], avail[128] = "";
  int64_t free_b = 0, total_b = 0;
  if ((!in_pool || dev.type == TT_CPU) && tt_device_memory_info(dev, &free_b, &total_b) == TT_OK) {
    if (refused)
      snprintf(avail, sizeof avail, "; more than the host's %.2f MiB available (of %.2f MiB)",
               (double)free_b / 1048576.0, (double)total_b / 1048576.0);
    else
      snprintf(avail, sizeof avail, "; the %s has %.2f MiB available of %.2f MiB",
               dev.type == TT_CPU ? "host" : "device", (double)free_b / 1048576.0, (double)total_b / 1048576.0);
  }
  tt_clear_error();
  return tt_error_set(TT_ERR_OOM,
                      "out of memory on %s: tried to allocate %.2f MiB (allocated %.2f MiB, reserved %.2f MiB, "
                      "peak %.2f MiB, %lld retries, %lld OOMs)%s",
                      tt_device_name(dev, nm, sizeof nm), (double)rounded / 1048576.0,
                      (double)s.allocated / 1048576.0, (double)s.reserved / 1048576.0,
                      (double)s.peak_allocated / 1048576.0, (long long)s.num_alloc_retries, (long long)s.num_ooms,
                      avail);
}

/* A new block from the device. On the CPU, malloc overcommits: a block far
 * larger than the host can back is handed out and the kernel's OOM killer
 * ends the process when its pages are touched, with nothing said. So a large
 * host block (64 MiB and up: the rest cannot matter, and reading
 * /proc/meminfo on every small miss would) fails here when it exceeds the
 * host's available memory; the caller then flushes the cache, retries, and
 * reports out-of-memory with its statistics, as on a GPU. */
#define TT_HOST_CHECK_BYTES ((size_t)64 << 20)
static tt_status tt_block_alloc(tt_device dev, const tt_kernels *be, size_t rounded, size_t nbytes, void **p,
                                int *refused) {
  *p = NULL;
  *refused = 0;
  /* nbytes, not the rounded size: the rounding's untouched tail (under a
   * quarter) never gets pages. */
  if (dev.type == TT_CPU && nbytes >= TT_HOST_CHECK_BYTES) {
    int64_t free_b = 0, total_b = 0;
    if (tt_device_memory_info(dev, &free_b, &total_b) == TT_OK && (int64_t)nbytes > free_b) {
      tt_clear_error();
      *refused = 1;
      return TT_ERR_OOM;
    }
    tt_clear_error();
  }
  return be->mem_alloc(dev.index, rounded, p);
}

static void tt_stats_alloc(tt_mem_stats *s, size_t rounded, int hit) {
  s->num_allocs++;
  if (hit) s->num_cache_hits++;
  else s->reserved += (int64_t)rounded;
  s->allocated += (int64_t)rounded;
  s->allocated_total += (int64_t)rounded;
  if (s->allocated > s->peak_allocated) s->peak_allocated = s->allocated;
}

/* An allocation served by private pool mp (pool->lock held). No flush and
 * retry: releasing memory synchronizes the device, which a capture forbids. */
static tt_status tt_mempool_alloc_locked(tt_pool *pool, tt_mempool *mp, const tt_kernels *be, int cls,
                                         size_t rounded, size_t nbytes, void **out) {
  void *p = cls >= 0 ? tt_cache_take(&mp->cache, cls) : NULL;
  int hit = p != NULL;
  if (!p) {
    int refused;
    tt_status st = tt_block_alloc(mp->dev, be, rounded, nbytes, &p, &refused);
    if (st != TT_OK || !p) {
      pool->stats.num_ooms++;
      mp->stats.num_ooms++;
      return tt_oom(mp->dev, rounded, pool->stats, refused, 1);
    }
    if (!tt_owned_add(mp, p)) {
      be->mem_free(mp->dev.index, p);
      return tt_error_set(TT_ERR_OOM, "alloc: out of host memory for a private pool's block list");
    }
  }
  tt_stats_alloc(&mp->stats, rounded, hit);
  tt_stats_alloc(&pool->stats, rounded, hit);
  *out = p;
  return TT_OK;
}

/* Pending blocks whose events have completed go to the cache (wait: every
 * one, waiting for its event). Lock held. */
static void tt_pending_collect_locked(tt_pool *pool, tt_device dev, const tt_kernels *be, int wait) {
  tt_pending **pp = &pool->pending;
  while (*pp) {
    tt_pending *p = *pp;
    int done = wait ? 1 : be->event_query(p->event);
    if (done == 0) {
      pp = &p->next;
      continue;
    }
    if (wait || done < 0) (void)be->event_wait(p->event); /* a failed query: be sure before reuse */
    be->event_free(p->event);
    *pp = p->next;
    pool->stats.pending -= (int64_t)p->rounded;
    if (!(p->cls >= 0 && tt_cache_put(&pool->cache, p->cls, p->ptr))) {
      be->mem_free(dev.index, p->ptr);
      pool->stats.reserved -= (int64_t)p->rounded;
    }
    free(p);
  }
}

/* The meta device's accounting (dry runs, titan estimate): what the same
 * tensors would hold on a device, rounded to the pools' size classes, so
 * that a step run on meta has the allocated bytes and the peak a real one has. */
static pthread_mutex_t tt_meta_lock = PTHREAD_MUTEX_INITIALIZER;
static tt_mem_stats tt_meta_stats;
static int tt_meta_on;

int tt_memory_meta_accounting(int on) { return __atomic_exchange_n(&tt_meta_on, on ? 1 : 0, __ATOMIC_ACQ_REL); }
int tt_meta_accounting_on(void) { return __atomic_load_n(&tt_meta_on, __ATOMIC_ACQUIRE); }

void tt_meta_account(size_t nbytes, int sign) {
  size_t rounded;
  (void)tt_size_class(nbytes, &rounded);
  pthread_mutex_lock(&tt_meta_lock);
  if (sign > 0) {
    tt_meta_stats.num_allocs++;
    tt_meta_stats.allocated += (int64_t)rounded;
    tt_meta_stats.allocated_total += (int64_t)rounded;
    if (tt_meta_stats.allocated > tt_meta_stats.peak_allocated) tt_meta_stats.peak_allocated = tt_meta_stats.allocated;
  } else {
    tt_meta_stats.num_frees++;
    tt_meta_stats.allocated -= (int64_t)rounded;
  }
  tt_meta_stats.reserved = tt_meta_stats.allocated;
  pthread_mutex_unlock(&tt_meta_lock);
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
  tt_mempool *mp = tt_active_mempool;
  if (mp && tt_same_device(mp->dev, dev)) {
    tt_status st = tt_mempool_alloc_locked(pool, mp, be, cls, rounded, nbytes, out);
    pthread_mutex_unlock(&pool->lock);
    return st;
  }
  if (pool->pending) tt_pending_collect_locked(pool, dev, be, 0);
  void *p = cls >= 0 ? tt_cache_take(&pool->cache, cls) : NULL;
  int hit = p != NULL;
  if (!p) {
    int refused;
    tt_status st = tt_block_alloc(dev, be, rounded, nbytes, &p, &refused);
    if (st != TT_OK || !p) {
      /* Cached blocks of other sizes may be what stands in the way, and
       * so may blocks still waiting for another stream. */
      pool->stats.num_alloc_retries++;
      if (pool->pending) tt_pending_collect_locked(pool, dev, be, 1);
      tt_pool_flush_locked(pool, dev, be);
      st = tt_block_alloc(dev, be, rounded, nbytes, &p, &refused);
    }
    if (st != TT_OK || !p) {
      pool->stats.num_ooms++;
      tt_mem_stats s = pool->stats;
      pthread_mutex_unlock(&pool->lock);
      return tt_oom(dev, rounded, s, refused, 0);
    }
  }
  tt_stats_alloc(&pool->stats, rounded, hit);
  tt_mem_stats *rs = tt_rank_stats(dev);
  if (rs) tt_stats_alloc(rs, rounded, hit);
  *out = p;
  pthread_mutex_unlock(&pool->lock);
  return TT_OK;
}

/* A block of private pool mp comes back (pool->lock held). */
static void tt_mempool_put_locked(tt_pool *pool, tt_mempool *mp, const tt_kernels *be, int cls, size_t rounded,
                                  void *ptr) {
  mp->stats.num_frees++;
  mp->stats.allocated -= (int64_t)rounded;
  if (!mp->closing && cls >= 0 && tt_cache_put(&mp->cache, cls, ptr)) return;
  tt_owned_remove(mp, ptr);
  tt_mempool *active = tt_active_mempool;
  if (active && active != mp && tt_same_device(active->dev, mp->dev) && cls >= 0 && tt_owned_add(active, ptr)) {
    /* Freed while another pool captures: releasing it would synchronize
     * (refused during a capture), and the captured kernels may have used
     * it; the capturing pool adopts it. */
    mp->stats.reserved -= (int64_t)rounded;
    active->stats.reserved += (int64_t)rounded;
    if (!tt_cache_put(&active->cache, cls, ptr)) tt_owned_remove(active, ptr); /* leaked rather than freed mid-capture */
    if (mp->closing && mp->count == 0) tt_mempool_destroy_locked(pool, mp);
    return;
  }
  be->mem_free(mp->dev.index, ptr);
  mp->stats.reserved -= (int64_t)rounded;
  pool->stats.reserved -= (int64_t)rounded;
  if (mp->closing && mp->count == 0) tt_mempool_destroy_locked(pool, mp);
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
  tt_mem_stats *rs = tt_rank_stats(dev);
  if (rs) {
    rs->num_frees++;
    rs->allocated -= (int64_t)rounded;
  }
  tt_mempool *mp = pool->mempools ? tt_mempool_owner_locked(pool, ptr) : NULL;
  if (mp) {
    tt_mempool_put_locked(pool, mp, be, cls, rounded, ptr);
    pthread_mutex_unlock(&pool->lock);
    return;
  }
  tt_mempool *active = tt_active_mempool;
  if (active && tt_same_device(active->dev, dev) && tt_owned_add(active, ptr)) {
    /* Freed during a capture: the captured kernels may still use it on replay. */
    active->stats.reserved += (int64_t)rounded;
    active->stats.allocated += (int64_t)rounded;
    tt_mempool_put_locked(pool, active, be, cls, rounded, ptr);
    active->stats.num_frees--; /* adopted, not a free of the pool's own */
    pthread_mutex_unlock(&pool->lock);
    return;
  }
  if (!(cls >= 0 && tt_cache_put(&pool->cache, cls, ptr))) {
    be->mem_free(dev.index, ptr);
    pool->stats.reserved -= (int64_t)rounded;
  }
  pthread_mutex_unlock(&pool->lock);
}

void tt_free_raw_streams(tt_device dev, void *ptr, size_t nbytes, uint32_t streams) {
  const uint32_t others = streams & ~(1u << TT_STREAM_COMPUTE);
  const tt_kernels *be = others && ptr && dev.type == TT_CUDA ? tt_backend(dev) : NULL;
  if (!be || !be->event_record || !be->event_query) {
    tt_free_raw(dev, ptr, nbytes);
    return;
  }
  tt_pool *pool = tt_pool_of(dev);
  if (!pool) return;
  /* One event per other stream that used the block; only the comm stream
   * exists besides compute today. */
  void *ev = NULL;
  tt_status st = be->event_record(dev.index, TT_STREAM_COMM, &ev);
  tt_pending *p = st == TT_OK && ev ? malloc(sizeof *p) : NULL;
  pthread_mutex_lock(&pool->lock);
  int simple = !p || pool->mempools || tt_active_mempool;
  pthread_mutex_unlock(&pool->lock);
  if (simple) {
    /* No event (or no list node), or private pools in play: wait now, then
     * free as usual (the stream's work on the block is done). */
    free(p);
    if (ev) {
      (void)be->event_wait(ev);
      be->event_free(ev);
    } else {
      (void)be->synchronize(dev.index);
    }
    tt_free_raw(dev, ptr, nbytes);
    return;
  }
  size_t rounded;
  p->cls = tt_size_class(nbytes, &rounded);
  p->ptr = ptr;
  p->rounded = rounded;
  p->event = ev;
  pthread_mutex_lock(&pool->lock);
  pool->stats.num_frees++;
  pool->stats.allocated -= (int64_t)rounded;
  pool->stats.pending += (int64_t)rounded;
  p->next = pool->pending;
  pool->pending = p;
  pthread_mutex_unlock(&pool->lock);
}

/* ---- private pools ------------------------------------------------------ */

tt_status tt_mempool_new(tt_device dev, tt_mempool **out) {
  *out = NULL;
  tt_pool *pool = tt_pool_of(dev);
  char nm[32];
  if (!pool || !tt_backend(dev))
    return tt_error_set(TT_ERR_DEVICE, "mempool_new: device %s is not available in this build or machine",
                        tt_device_name(dev, nm, sizeof nm));
  tt_mempool *mp = calloc(1, sizeof *mp);
  if (!mp) return tt_error_set(TT_ERR_OOM, "mempool_new: out of host memory");
  mp->dev = dev;
  pthread_mutex_lock(&pool->lock);
  mp->next = pool->mempools;
  pool->mempools = mp;
  pthread_mutex_unlock(&pool->lock);
  *out = mp;
  return TT_OK;
}

tt_status tt_mempool_begin(tt_mempool *mp) {
  if (tt_active_mempool && tt_active_mempool != mp)
    return tt_error_set(TT_ERR_INVALID, "mempool_begin: another private pool is already active on this thread");
  if (mp->closing) return tt_error_set(TT_ERR_INVALID, "mempool_begin: the pool was freed");
  tt_active_mempool = mp;
  return TT_OK;
}

void tt_mempool_end(tt_mempool *mp) {
  if (tt_active_mempool == mp) tt_active_mempool = NULL;
}

static void tt_mempool_forget(void *mp, void *ptr) { tt_owned_remove(mp, ptr); }

void tt_mempool_free(tt_mempool *mp) {
  if (!mp) return;
  tt_mempool_end(mp);
  tt_pool *pool = tt_pool_of(mp->dev);
  pthread_mutex_lock(&pool->lock);
  int64_t released = tt_cache_flush(&mp->cache, mp->dev, tt_backend(mp->dev), tt_mempool_forget, mp);
  mp->stats.reserved -= released;
  pool->stats.reserved -= released;
  mp->closing = 1;
  /* Blocks still in use (a graph's outputs someone holds) go back to the
   * system when they are freed; the last one takes the pool with it. */
  if (mp->count == 0) tt_mempool_destroy_locked(pool, mp);
  pthread_mutex_unlock(&pool->lock);
}

tt_device tt_mempool_device(const tt_mempool *mp) { return mp->dev; }

tt_status tt_mempool_stats(const tt_mempool *mp, tt_mem_stats *out) {
  tt_pool *pool = tt_pool_of(mp->dev);
  pthread_mutex_lock(&pool->lock);
  *out = mp->stats;
  pthread_mutex_unlock(&pool->lock);
  return TT_OK;
}

tt_status tt_memory_stats(tt_device dev, tt_mem_stats *out) {
  tt_pool *pool = tt_pool_of(dev);
  if (dev.type == TT_META) {
    pthread_mutex_lock(&tt_meta_lock);
    *out = tt_meta_stats;
    pthread_mutex_unlock(&tt_meta_lock);
    return TT_OK;
  }
  if (!pool) {
    memset(out, 0, sizeof *out);
    return tt_error_set(TT_ERR_DEVICE, "memory_stats: unknown device");
  }
  pthread_mutex_lock(&pool->lock);
  *out = pool->stats;
  tt_mem_stats *rs = tt_rank_stats(dev);
  if (rs) {
    *out = *rs;
    out->reserved = pool->stats.reserved;
    out->pending = pool->stats.pending;
  }
  pthread_mutex_unlock(&pool->lock);
  return TT_OK;
}

void tt_memory_reset_peak(tt_device dev) {
  if (dev.type == TT_META) {
    pthread_mutex_lock(&tt_meta_lock);
    tt_meta_stats.peak_allocated = tt_meta_stats.allocated;
    pthread_mutex_unlock(&tt_meta_lock);
    return;
  }
  tt_pool *pool = tt_pool_of(dev);
  if (!pool) return;
  pthread_mutex_lock(&pool->lock);
  tt_mem_stats *rs = tt_rank_stats(dev);
  if (rs) rs->peak_allocated = rs->allocated;
  pool->stats.peak_allocated = pool->stats.allocated;
  pthread_mutex_unlock(&pool->lock);
}

void tt_memory_empty_cache(tt_device dev) {
  tt_pool *pool = tt_pool_of(dev);
  const tt_kernels *be = tt_backend(dev);
  if (!pool || !be) return;
  pthread_mutex_lock(&pool->lock);
  if (pool->pending) tt_pending_collect_locked(pool, dev, be, 1);
  tt_pool_flush_locked(pool, dev, be);
  pthread_mutex_unlock(&pool->lock);
}
