/*
 * graph.cu — CUDA graphs: stream capture of the compute stream and replay.
 *
 * Capture runs in thread-local mode: a call on the capturing thread that
 * would make the host wait for the device (a synchronize, a read-back, a
 * cudaFree) invalidates the capture instead of silently recording a graph
 * that does something else; other threads (the checkpoint writer) are not
 * affected. The caching allocator's cudaMalloc during capture is made
 * legal by a relaxed-mode window around it (backend.cu).
 */
#include <atomic>
#include <stdio.h>

#include "cuda_common.h"

/* Executable graphs alive per device: while any is, library state its
 * nodes point at (cuDNN's workspace and plans) must not be freed. */
static std::atomic<int> tt_graphs_alive[TT_CUDA_MAX_DEVICES];

extern "C" int tt_cuda_graphs_alive(int device) {
  return device >= 0 && device < TT_CUDA_MAX_DEVICES ? tt_graphs_alive[device].load() : 0;
}

/* The device's one-time setup (the kernel workspace, cuBLASLt's handle and
 * workspace, cuDNN's handle), which the first kernel of each kind makes
 * lazily, is made before the capture: allocating during it is refused. */
static tt_status tt_cuda_graph_prepare(int device) {
  void *ws;
  std::unique_lock<std::mutex> hold;
  tt_status st = tt_cuda_workspace(device, &ws, &hold);
  if (st == TT_OK) {
    hold.unlock();
    st = tt_cuda_gemm_prepare(device);
  }
  if (st == TT_OK) st = tt_cuda_attention_prepare(device);
  return st;
}

extern "C" tt_status tt_cuda_graph_begin(int device) {
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st == TT_OK) st = tt_cuda_graph_prepare(device);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  return TT_OK;
}

extern "C" tt_status tt_cuda_graph_end(int device, void **graph, int64_t *nodes) {
  *graph = NULL;
  *nodes = 0;
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st != TT_OK) return st;
  cudaGraph_t g = NULL;
  cudaError_t err = cudaStreamEndCapture(s, &g);
  if (err != cudaSuccess || !g) {
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError(); /* capture errors are not sticky: the device stays usable */
    return tt_error_set(TT_ERR_UNSUPPORTED,
                        "cuda graph: the capture on cuda:%d failed (%s: %s); the captured work waited for the "
                        "device (a value read back to the host, a synchronize or a free) or used another stream",
                        device, cudaGetErrorName(err), cudaGetErrorString(err));
  }
  size_t n = 0;
  err = cudaGraphGetNodes(g, NULL, &n);
  cudaGraphExec_t exec = NULL;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (err != cudaSuccess) return tt_cuda_fail(err, "cudaGraphInstantiate", __FILE__, __LINE__);
  *graph = (void *)exec;
  *nodes = (int64_t)n;
  tt_graphs_alive[device]++;
  return TT_OK;
}

extern "C" tt_status tt_cuda_graph_launch(int device, void *graph) {
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, s));
  return TT_OK;
}

extern "C" void tt_cuda_graph_free(int device, void *graph) {
  if (!graph) return;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaGraphExecDestroy((cudaGraphExec_t)graph);
  if (err != cudaSuccess) tt_cuda_fail(err, "cudaGraphExecDestroy", __FILE__, __LINE__);
  if (device >= 0 && device < TT_CUDA_MAX_DEVICES) tt_graphs_alive[device]--;
}
