/*
 * graph.c — capture and replay of device work (CUDA graphs), and device
 * synchronization.
 *
 * A training step launches thousands of small kernels; for a small model
 * the host's launch overhead, not the GPU, sets the pace. Capturing the
 * step once and replaying it as one graph removes that overhead. Capture
 * records what the calling thread queues on the device's compute stream;
 * the memory those kernels touch comes from a private pool (alloc.c), so
 * the addresses stay valid, and untouched by anyone else, on every replay.
 */
#include <stdlib.h>

#include "internal.h"

struct tt_graph {
  tt_device dev;
  void *exec;
  int64_t nodes;
};

/* The capture this thread has open (a capture belongs to one thread). */
static __thread struct {
  int active;
  tt_device dev;
  tt_mempool *pool;
} tt_capture;

tt_status tt_graph_capture_begin(tt_device dev, tt_mempool *pool) {
  char nm[32];
  const tt_kernels *be = tt_backend(dev);
  if (!be || !be->graph_begin)
    return tt_error_set(TT_ERR_UNSUPPORTED, "graph_capture_begin: %s has no graphs (CUDA graphs need a cuda device)",
                        tt_device_name(dev, nm, sizeof nm));
  if (tt_capture.active)
    return tt_error_set(TT_ERR_INVALID, "graph_capture_begin: a capture is already open on this thread (on %s)",
                        tt_device_name(tt_capture.dev, nm, sizeof nm));
  if (!pool || !tt_same_device(tt_mempool_device(pool), dev))
    return tt_error_set(TT_ERR_INVALID, "graph_capture_begin: the private pool must be one of %s",
                        tt_device_name(dev, nm, sizeof nm));
  TT_TRY(tt_mempool_begin(pool));
  tt_status st = be->graph_begin(dev.index);
  if (st != TT_OK) {
    tt_mempool_end(pool);
    return st;
  }
  tt_capture.active = 1;
  tt_capture.dev = dev;
  tt_capture.pool = pool;
  return TT_OK;
}

tt_status tt_graph_capture_end(tt_device dev, tt_graph **out) {
  *out = NULL;
  char nm[32];
  if (!tt_capture.active || !tt_same_device(tt_capture.dev, dev))
    return tt_error_set(TT_ERR_INVALID, "graph_capture_end: no capture is open on this thread for %s",
                        tt_device_name(dev, nm, sizeof nm));
  tt_mempool_end(tt_capture.pool);
  tt_capture.active = 0;
  const tt_kernels *be = tt_backend(dev);
  void *exec = NULL;
  int64_t nodes = 0;
  TT_TRY(be->graph_end(dev.index, &exec, &nodes));
  tt_graph *g = malloc(sizeof *g);
  if (!g) {
    be->graph_free(dev.index, exec);
    return tt_error_set(TT_ERR_OOM, "graph_capture_end: out of host memory");
  }
  g->dev = dev;
  g->exec = exec;
  g->nodes = nodes;
  *out = g;
  return TT_OK;
}

tt_status tt_graph_replay(tt_graph *g) {
  if (!g) return tt_error_set(TT_ERR_INVALID, "graph_replay: no graph");
  return tt_backend(g->dev)->graph_launch(g->dev.index, g->exec);
}

int64_t tt_graph_num_nodes(const tt_graph *g) { return g ? g->nodes : 0; }

void tt_graph_free(tt_graph *g) {
  if (!g) return;
  tt_backend(g->dev)->graph_free(g->dev.index, g->exec);
  free(g);
}
