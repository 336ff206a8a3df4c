/*
 * test_mempool.c — private memory pools (what CUDA graphs allocate from),
 * on the CPU, where the same routing applies: allocations while a pool is
 * active come from it, its blocks return to it by address whatever is
 * active, only it reuses them, a shared-cache block freed while it is active
 * is adopted, the device's statistics include it, and freeing it with blocks
 * still in use releases each as it comes back. Also: graph capture on the
 * CPU is refused with a clear message.
 */
#include <string.h>

#include "titan.h"
#include "tt_test.h"

static const tt_device CPU = {TT_CPU, 0};

static tt_tensor *vec(int64_t n) {
  tt_tensor *t = NULL;
  if (tt_tensor_empty(1, &n, TT_F32, CPU, &t) != TT_OK) return NULL;
  return t;
}

static tt_mem_stats dev_stats(void) {
  tt_mem_stats s;
  tt_memory_stats(CPU, &s);
  return s;
}

static tt_mem_stats pool_stats(tt_mempool *mp) {
  tt_mem_stats s;
  tt_mempool_stats(mp, &s);
  return s;
}

static void test_routing(void) {
  tt_memory_empty_cache(CPU);
  tt_mempool *mp = NULL;
  CHECK(tt_mempool_new(CPU, &mp) == TT_OK && mp, "new: %s", tt_last_error());
  tt_mem_stats d0 = dev_stats();

  tt_tensor *outside = vec(3000); /* before the pool is active: shared cache */
  CHECK(tt_mempool_begin(mp) == TT_OK, "begin: %s", tt_last_error());
  tt_tensor *a = vec(1000), *b = vec(5000);
  tt_mempool *other = NULL;
  CHECK(tt_mempool_new(CPU, &other) == TT_OK, "second pool");
  CHECK(tt_mempool_begin(other) == TT_ERR_INVALID, "two active pools on one thread");
  tt_mempool_free(other);
  void *a_ptr = tt_tensor_data(a);
  tt_mem_stats p1 = pool_stats(mp);
  CHECK(p1.num_allocs == 2, "pool served 2 allocations, got %lld", (long long)p1.num_allocs);
  CHECK(p1.allocated == 4096 + 20480, "pool allocated %lld (1000 and 5000 floats rounded to classes)",
        (long long)p1.allocated);
  tt_mem_stats d1 = dev_stats();
  CHECK(d1.allocated - d0.allocated == p1.allocated + 12288, "device stats include the pool (%lld vs %lld)",
        (long long)(d1.allocated - d0.allocated), (long long)p1.allocated);

  /* Freed while active: back to the pool, reused by the pool. */
  tt_tensor_release(a);
  tt_tensor *a2 = vec(1000);
  CHECK(tt_tensor_data(a2) == a_ptr, "the pool reuses its own block");
  CHECK(pool_stats(mp).num_cache_hits == 1, "one pool cache hit");

  /* A shared-cache block freed while the pool is active is adopted. */
  void *out_ptr = tt_tensor_data(outside);
  tt_tensor_release(outside);
  tt_mem_stats p2 = pool_stats(mp);
  CHECK(p2.reserved == 4096 + 20480 + 12288, "adopted block counted as the pool's (reserved %lld)",
        (long long)p2.reserved);
  tt_mempool_end(mp);

  /* After end: the pool's blocks still return to it and are not handed to others. */
  tt_tensor_release(a2);
  tt_tensor *c = vec(1000), *d = vec(3000);
  CHECK(tt_tensor_data(c) != a_ptr, "a pool block went to a shared allocation");
  CHECK(tt_tensor_data(d) != out_ptr, "an adopted block went to a shared allocation");
  tt_mem_stats p3 = pool_stats(mp);
  CHECK(p3.allocated == 20480, "only b is in use in the pool (%lld)", (long long)p3.allocated);
  tt_tensor_release(c);
  tt_tensor_release(d);

  /* Re-activating reuses the cached blocks. */
  CHECK(tt_mempool_begin(mp) == TT_OK, "begin again");
  tt_tensor *e = vec(3000);
  CHECK(tt_tensor_data(e) == out_ptr, "the adopted block is reused by the pool");
  tt_mempool_end(mp);
  tt_tensor_release(e);

  /* Freed with b still alive: the cache goes now, b when it is released. */
  tt_mem_stats before_free = dev_stats();
  tt_mempool_free(mp);
  tt_mem_stats after_free = dev_stats();
  CHECK(before_free.reserved - after_free.reserved == 4096 + 12288, "cached pool blocks released (%lld)",
        (long long)(before_free.reserved - after_free.reserved));
  tt_tensor_release(b);
  tt_mem_stats end = dev_stats();
  CHECK(after_free.reserved - end.reserved == 20480, "the last live block went back to the system (%lld)",
        (long long)(after_free.reserved - end.reserved));
  CHECK(end.allocated == d0.allocated, "device allocated back to its start (%lld vs %lld)", (long long)end.allocated,
        (long long)d0.allocated);
}

/* Many blocks: the owned-address set grows and deletes correctly. */
static void test_many_blocks(void) {
  enum { N = 700 };
  tt_mempool *mp = NULL;
  CHECK(tt_mempool_new(CPU, &mp) == TT_OK, "new");
  CHECK(tt_mempool_begin(mp) == TT_OK, "begin");
  tt_tensor *ts[N];
  for (int i = 0; i < N; i++) ts[i] = vec(128 + (i % 7) * 300);
  tt_mempool_end(mp);
  for (int i = 0; i < N; i += 2) tt_tensor_release(ts[i]);
  for (int i = 1; i < N; i += 2) tt_tensor_release(ts[i]);
  tt_mem_stats p = pool_stats(mp);
  CHECK(p.allocated == 0 && p.num_frees == N, "all %d blocks back in the pool (allocated %lld, frees %lld)", N,
        (long long)p.allocated, (long long)p.num_frees);
  tt_mem_stats d = dev_stats();
  tt_mempool_free(mp);
  tt_mem_stats d2 = dev_stats();
  CHECK(d.reserved - d2.reserved == p.reserved, "freeing the pool releases all it reserved");
  /* A shared allocation afterwards is unaffected. */
  tt_tensor *x = vec(128);
  CHECK(x != NULL, "shared allocation after the pool is gone");
  tt_tensor_release(x);
}

/* A closing pool's block freed while another pool is active is adopted by
 * that one (releasing it would synchronize, which a capture forbids). */
static void test_closing_block_adopted(void) {
  tt_mempool *a = NULL, *b = NULL;
  CHECK(tt_mempool_new(CPU, &a) == TT_OK && tt_mempool_new(CPU, &b) == TT_OK, "two pools");
  CHECK(tt_mempool_begin(a) == TT_OK, "begin a");
  tt_tensor *x = vec(1000);
  tt_mempool_end(a);
  tt_mempool_free(a); /* closing: x still alive */
  tt_mem_stats d0 = dev_stats();
  CHECK(tt_mempool_begin(b) == TT_OK, "begin b");
  tt_tensor_release(x);
  tt_mem_stats pb = pool_stats(b), d1 = dev_stats();
  CHECK(pb.reserved == 4096, "b adopted the closing pool's block (reserved %lld)", (long long)pb.reserved);
  CHECK(d1.reserved == d0.reserved, "nothing went back to the system during b's activity");
  tt_tensor *y = vec(1000);
  CHECK(pool_stats(b).num_cache_hits == 1, "b reuses the adopted block");
  tt_mempool_end(b);
  tt_tensor_release(y);
  tt_mempool_free(b);
  CHECK(dev_stats().reserved == d0.reserved - 4096, "freeing b releases it");
}

static void test_capture_on_cpu(void) {
  tt_mempool *mp = NULL;
  CHECK(tt_mempool_new(CPU, &mp) == TT_OK, "new");
  tt_status st = tt_graph_capture_begin(CPU, mp);
  CHECK(st == TT_ERR_UNSUPPORTED, "capture on the CPU: status %d", st);
  CHECK(strstr(tt_last_error(), "cuda") != NULL, "message names what is needed: %s", tt_last_error());
  tt_graph *g = NULL;
  CHECK(tt_graph_capture_end(CPU, &g) == TT_ERR_INVALID && g == NULL, "end without begin");
  /* The failed begin must not leave the pool active. */
  tt_mem_stats before = pool_stats(mp);
  tt_tensor *x = vec(64);
  CHECK(pool_stats(mp).num_allocs == before.num_allocs, "pool not active after a refused capture");
  tt_tensor_release(x);
  tt_mempool_free(mp);
  CHECK(tt_device_synchronize(CPU) == TT_OK, "synchronize the CPU");
}

int main(void) {
  test_routing();
  test_many_blocks();
  test_closing_block_adopted();
  test_capture_on_cpu();
  return tt_test_summary("mempool");
}
