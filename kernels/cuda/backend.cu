/*
 * backend.cu — the CUDA backend table, device memory and streams.
 *
 * Each device gets two non-blocking streams, created on first use: one for
 * compute (every kernel, copy and GEMM of this backend) and one reserved for
 * collectives, so NCCL can overlap compute once it is fenced by events, and
 * one fixed scratch buffer for the partials of multi-pass kernels.
 *
 * Index faults. The index kernels record the first out-of-range index in a
 * small record in device memory (kernels.h: tt_index_fault), one per device
 * and never moved, so captured CUDA graphs keep writing it. Reading it
 * costs no wait of its own: every device->host copy and synchronize first
 * enqueues a copy of the record into a pinned host mirror on the compute
 * stream, so the wait they make anyway also fetches it, and check_errors
 * then reads the mirror. Device memory rather than mapped host memory for
 * the record: atomics on host memory over PCIe need platform support.
 *
 * The table's kernels live one family per file (elementwise.cu, reduce.cu,
 * index.cu, embed.cu, norm.cu, rope.cu, attention.cu (+ attention_merge.cu), act.cu, loss.cu,
 * optim.cu, rng.cu, copy.cu, gemm.cu, float8.cu); pinned host memory and the
 * asynchronous device->host copies of checkpoint snapshots are in host.cu.
 */
#include <atomic>
#include <mutex>
#include <stdio.h>
#include <string.h>
#include <utility>

#include <cublasLt.h>
#include <cudnn.h>
#include <nccl.h>

#include "cuda_common.h"

/* ---- errors ------------------------------------------------------------ */

const char *tt_cuda_short_file(const char *file) {
  const char *p = strstr(file, "kernels/");
  return p ? p : file;
}

tt_status tt_cuda_fail(cudaError_t err, const char *call, const char *file, int line) {
  (void)cudaGetLastError(); /* a non-sticky error must not resurface at the next check */
  tt_status st = TT_ERR_INTERNAL;
  if (err == cudaErrorMemoryAllocation) st = TT_ERR_OOM;
  else if (err == cudaErrorInvalidDevice || err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
    st = TT_ERR_DEVICE;
  return tt_error_set(st, "cuda: %s failed at %s:%d: %s: %s", call, tt_cuda_short_file(file), line,
                      cudaGetErrorName(err), cudaGetErrorString(err));
}

/* ---- devices and streams ---------------------------------------------- */

static struct {
  std::atomic<int> ready;
  cudaStream_t compute, comm;
  tt_index_fault *fault;      /* device memory: what the kernels write */
  tt_index_fault *fault_seen; /* pinned host mirror: what the last wait fetched */
  std::mutex fault_lock;      /* one thread takes (and clears) a fault */
} tt_cuda_devs[TT_CUDA_MAX_DEVICES];
static std::mutex tt_cuda_devs_lock;

static tt_status tt_cuda_streams_init(int device) {
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES)
    return tt_error_set(TT_ERR_DEVICE, "cuda: device %d out of range (this build handles %d devices)", device,
                        TT_CUDA_MAX_DEVICES);
  if (tt_cuda_devs[device].ready.load(std::memory_order_acquire)) return TT_OK;
  std::lock_guard<std::mutex> guard(tt_cuda_devs_lock);
  if (tt_cuda_devs[device].ready.load(std::memory_order_relaxed)) return TT_OK;
  TT_CUDA_CHECK(cudaStreamCreateWithFlags(&tt_cuda_devs[device].compute, cudaStreamNonBlocking));
  TT_CUDA_CHECK(cudaStreamCreateWithFlags(&tt_cuda_devs[device].comm, cudaStreamNonBlocking));
  /* Made here, before any kernel (and so before any graph capture), which
   * must not allocate. The clear rides on the compute stream, ahead of
   * every kernel that may write the record. */
  TT_CUDA_CHECK(cudaMalloc(&tt_cuda_devs[device].fault, sizeof(tt_index_fault)));
  TT_CUDA_CHECK(cudaMemsetAsync(tt_cuda_devs[device].fault, 0, sizeof(tt_index_fault), tt_cuda_devs[device].compute));
  TT_CUDA_CHECK(cudaHostAlloc(&tt_cuda_devs[device].fault_seen, sizeof(tt_index_fault), cudaHostAllocDefault));
  memset(tt_cuda_devs[device].fault_seen, 0, sizeof(tt_index_fault));
  tt_cuda_devs[device].ready.store(1, std::memory_order_release);
  return TT_OK;
}

tt_status tt_cuda_select(int device, cudaStream_t *stream) {
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES) return tt_cuda_streams_init(device);
  /* Every op selects its device: ask first, and switch only when it differs
   * (cudaGetDevice is a cheap thread-local read, also during graph capture). */
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) TT_CUDA_CHECK(cudaSetDevice(device));
  tt_status st = tt_cuda_streams_init(device);
  if (st != TT_OK) return st;
  *stream = tt_cuda_devs[device].compute;
  return TT_OK;
}

tt_status tt_cuda_current(int *device, cudaStream_t *stream) {
  TT_CUDA_CHECK(cudaGetDevice(device));
  tt_status st = tt_cuda_streams_init(*device);
  if (st != TT_OK) return st;
  *stream = tt_cuda_devs[*device].compute;
  return TT_OK;
}

tt_index_fault *tt_cuda_fault(int device) { return tt_cuda_devs[device].fault; }

/* Enqueue the record's copy into the mirror, ahead of a wait for stream s. */
static tt_status tt_cuda_fault_fetch(int device, cudaStream_t s) {
  TT_CUDA_CHECK(cudaMemcpyAsync(tt_cuda_devs[device].fault_seen, tt_cuda_devs[device].fault, sizeof(tt_index_fault),
                                cudaMemcpyDeviceToHost, s));
  return TT_OK;
}

extern "C" void *tt_cuda_stream(int device) {
  cudaStream_t s;
  return tt_cuda_select(device, &s) == TT_OK ? (void *)s : NULL;
}

extern "C" void *tt_cuda_comm_stream(int device) {
  cudaStream_t s;
  return tt_cuda_select(device, &s) == TT_OK ? (void *)tt_cuda_devs[device].comm : NULL;
}

extern "C" int tt_cuda_device_count_impl(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError(); /* no driver, a stub driver or no device: simply none */
    return 0;
  }
  return n;
}

extern "C" tt_status tt_cuda_memory_info_impl(int device, int64_t *free_bytes, int64_t *total_bytes) {
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st != TT_OK) return st;
  size_t f = 0, t = 0;
  TT_CUDA_CHECK(cudaMemGetInfo(&f, &t));
  *free_bytes = (int64_t)f;
  *total_bytes = (int64_t)t;
  return TT_OK;
}

extern "C" const char *tt_cuda_info_impl(void) {
  static thread_local char buf[160];
  int rt = 0, drv = 0, nccl = 0;
  if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  (void)cudaGetLastError();
  if (ncclGetVersion(&nccl) != ncclSuccess) nccl = 0;
  snprintf(buf, sizeof buf, "CUDA runtime %d.%d, driver %d.%d, cuBLASLt %zu, cuDNN %zu, NCCL %d", rt / 1000,
           rt % 1000 / 10, drv / 1000, drv % 1000 / 10, cublasLtGetVersion(), cudnnGetVersion(), nccl);
  return buf;
}

/* ---- scratch ------------------------------------------------------------ */

static struct {
  std::mutex lock;
  void *ptr;
} tt_cuda_ws[TT_CUDA_MAX_DEVICES];

tt_status tt_cuda_workspace(int device, void **ptr, std::unique_lock<std::mutex> *hold) {
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES)
    return tt_error_set(TT_ERR_DEVICE, "cuda: device %d out of range (this build handles %d devices)", device,
                        TT_CUDA_MAX_DEVICES);
  std::unique_lock<std::mutex> guard(tt_cuda_ws[device].lock);
  if (!tt_cuda_ws[device].ptr) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, TT_CUDA_WORKSPACE);
    if (err != cudaSuccess) return tt_cuda_fail(err, "cudaMalloc(kernel workspace)", __FILE__, __LINE__);
    tt_cuda_ws[device].ptr = p;
  }
  *ptr = tt_cuda_ws[device].ptr;
  *hold = std::move(guard);
  return TT_OK;
}

/* ---- memory ------------------------------------------------------------ */

static tt_status tt_cuda_mem_alloc(int device, size_t nbytes, void **out) {
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st != TT_OK) return st;
  *out = NULL;
  /* cudaMalloc queues nothing on a stream, so it is safe while the compute
   * stream is being captured (the block joins the graph's private pool);
   * the thread-local capture mode would refuse it, so relax it for the call. */
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t err = cudaMalloc(out, nbytes);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) {
    st = tt_cuda_fail(err, "cudaMalloc", __FILE__, __LINE__);
    if (st == TT_ERR_OOM)
      return tt_error_set(TT_ERR_OOM, "cuda: out of memory allocating %zu bytes on cuda:%d", nbytes, device);
    return st;
  }
  return TT_OK;
}

/* cudaFree waits for the device, so no kernel still reads the block. */
static void tt_cuda_mem_free(int device, void *ptr) {
  if (!ptr) return;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaFree(ptr);
  if (err != cudaSuccess) tt_cuda_fail(err, "cudaFree", __FILE__, __LINE__);
}

/* Host->device from pageable memory returns once the source is staged, so
 * the caller may reuse it; device->host waits for the data. */
static tt_status tt_cuda_mem_copy(int device, void *dst, const void *src, size_t nbytes, int kind) {
  static const cudaMemcpyKind kinds[3] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice};
  if (kind < 0 || kind > 2) return tt_error_set(TT_ERR_INVALID, "cuda: mem_copy kind %d (expected 0, 1 or 2)", kind);
  if (nbytes == 0) return TT_OK;
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kinds[kind], s));
  if (kind == 1) {
    st = tt_cuda_fault_fetch(device, s);
    if (st != TT_OK) return st;
    TT_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  return TT_OK;
}

/* Waits for every stream of the device, the comm stream and the libraries' included. */
static tt_status tt_cuda_synchronize(int device) {
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st == TT_OK) st = tt_cuda_fault_fetch(device, s);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaDeviceSynchronize());
  return TT_OK;
}

/* The mirror says whether the last wait saw a fault (almost always not:
 * one host read). If it did, the record itself is read again under the
 * lock, so of two threads that both saw it only one takes it. */
static tt_status tt_cuda_check_errors(int device, tt_index_fault *fault) {
  memset(fault, 0, sizeof *fault);
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES || !tt_cuda_devs[device].ready.load(std::memory_order_acquire))
    return TT_OK; /* no stream yet, so no kernel ever ran there */
  if (((volatile tt_index_fault *)tt_cuda_devs[device].fault_seen)->op == TT_FAULT_NONE) return TT_OK;
  std::lock_guard<std::mutex> guard(tt_cuda_devs[device].fault_lock);
  cudaStream_t s;
  tt_status st = tt_cuda_select(device, &s);
  if (st == TT_OK) st = tt_cuda_fault_fetch(device, s);
  if (st != TT_OK) return st;
  TT_CUDA_CHECK(cudaStreamSynchronize(s));
  *fault = *tt_cuda_devs[device].fault_seen;
  memset(tt_cuda_devs[device].fault_seen, 0, sizeof(tt_index_fault));
  /* Kernels enqueued after the clear find the record free again. */
  if (fault->op != TT_FAULT_NONE)
    TT_CUDA_CHECK(cudaMemsetAsync(tt_cuda_devs[device].fault, 0, sizeof(tt_index_fault), s));
  return TT_OK;
}

/* ---- the table --------------------------------------------------------- */

static tt_kernels tt_cuda_table_make(void) {
  tt_kernels k;
  memset(&k, 0, sizeof k); /* NULL: "not implemented on cuda" */
  k.name = "cuda";
  k.mem_alloc = tt_cuda_mem_alloc;
  k.mem_free = tt_cuda_mem_free;
  k.mem_copy = tt_cuda_mem_copy;
  k.synchronize = tt_cuda_synchronize;
  k.graph_begin = tt_cuda_graph_begin;
  k.graph_end = tt_cuda_graph_end;
  k.graph_launch = tt_cuda_graph_launch;
  k.graph_free = tt_cuda_graph_free;
  k.check_errors = tt_cuda_check_errors;
  k.copy = tt_cuda_copy;
  k.fill = tt_cuda_fill;
  k.arange = tt_cuda_arange;
  k.rng = tt_cuda_rng;
  k.binary = tt_cuda_binary;
  k.unary = tt_cuda_unary;
  k.unary_backward = tt_cuda_unary_backward;
  k.axpy = tt_cuda_axpy;
  k.foreach_scale = tt_cuda_foreach_scale;
  k.reduce = tt_cuda_reduce;
  k.sum_to = tt_cuda_sum_to;
  k.softmax = tt_cuda_softmax;
  k.softmax_backward = tt_cuda_softmax_backward;
  k.sumsq = tt_cuda_sumsq;
  k.sumsq_many = tt_cuda_sumsq_many;
  k.gemm = tt_cuda_gemm;
  k.index_select = tt_cuda_index_select;
  k.index_add = tt_cuda_index_add;
  k.gather = tt_cuda_gather;
  k.scatter_add = tt_cuda_scatter_add;
  k.embedding = tt_cuda_embedding;
  k.embedding_backward = tt_cuda_embedding_backward;
  k.rmsnorm = tt_cuda_rmsnorm;
  k.add_rmsnorm = tt_cuda_add_rmsnorm;
  k.rmsnorm_backward = tt_cuda_rmsnorm_backward;
  k.rope_table = tt_cuda_rope_table;
  k.rope = tt_cuda_rope;
  k.attention = tt_cuda_attention;
  k.attention_backward = tt_cuda_attention_backward;
  k.attention_merge = tt_cuda_attention_merge;
  k.to_float8 = tt_cuda_to_float8;
  k.float8_amax = tt_cuda_float8_amax;
  k.gemm_float8 = tt_cuda_gemm_float8;
  k.swiglu = tt_cuda_swiglu;
  k.swiglu_backward = tt_cuda_swiglu_backward;
  k.cross_entropy = tt_cuda_cross_entropy;
  k.cross_entropy_backward = tt_cuda_cross_entropy_backward;
  k.count_valid = tt_cuda_count_valid;
  k.adamw = tt_cuda_adamw;
  k.adamw_multi = tt_cuda_adamw_multi;
  k.adamw_multi_dev = tt_cuda_adamw_multi_dev;
  k.global_norm_dev = tt_cuda_global_norm_dev;
  /* pinned host memory, asynchronous snapshots (host.cu) */
  k.host_alloc = tt_cuda_host_alloc;
  k.host_free = tt_cuda_host_free;
  k.copy_to_host_async = tt_cuda_copy_to_host_async;
  k.event_wait = tt_cuda_event_wait;
  k.event_free = tt_cuda_event_free;
  k.event_record = tt_cuda_event_record;
  k.event_query = tt_cuda_event_query;
  k.timer_event_new = tt_cuda_timer_event_new;
  k.timer_event_mark = tt_cuda_timer_event_mark;
  k.timer_event_elapsed = tt_cuda_timer_event_elapsed;
  return k;
}

extern "C" const tt_kernels *tt_kernels_cuda(void) {
  static const tt_kernels table = tt_cuda_table_make();
  return &table;
}
