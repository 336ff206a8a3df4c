/*
 * host.cu — pinned host memory and asynchronous device->host copies: the
 * snapshots of async checkpoints (engine/checkpoint.c; the engine caches
 * the pinned buffers in engine/pinned.c).
 *
 * A snapshot must not stall the host, and it must hold the tensor as it is
 * when the save is called. So the copy runs on the device's copy stream
 * (created on first use), fenced by events on both sides: the copy stream
 * waits for what the compute stream has queued so far (the kernels that
 * produced the tensor), and the compute stream waits for the copy before
 * what is queued on it afterwards (the optimizer step that overwrites the
 * tensor). Both waits happen on the device; the host only enqueues. The
 * destination is pinned: from pageable memory cudaMemcpyAsync would copy
 * synchronously.
 */
#include <mutex>

#include "cuda_common.h"

static struct {
  std::mutex lock; /* `produced` is recorded and waited for under it */
  int ready;
  cudaStream_t stream;
  cudaEvent_t produced; /* reused: a wait takes the event's state when it is enqueued */
} tt_cuda_copy_devs[TT_CUDA_MAX_DEVICES];

/* Destroys an event the call did not hand over. */
struct tt_cuda_event_guard {
  cudaEvent_t e;
  ~tt_cuda_event_guard() {
    if (e) cudaEventDestroy(e);
  }
};

extern "C" tt_status tt_cuda_host_alloc(size_t nbytes, void **out) {
  *out = NULL;
  /* Portable: every device (context) may copy into it. */
  cudaError_t err = cudaHostAlloc(out, nbytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    *out = NULL;
    tt_status st = tt_cuda_fail(err, "cudaHostAlloc", __FILE__, __LINE__);
    if (st == TT_ERR_OOM)
      return tt_error_set(TT_ERR_OOM, "cuda: out of pinned host memory allocating %zu bytes", nbytes);
    return st;
  }
  return TT_OK;
}

extern "C" void tt_cuda_host_free(void *ptr) {
  if (!ptr) return;
  cudaError_t err = cudaFreeHost(ptr);
  if (err != cudaSuccess) tt_cuda_fail(err, "cudaFreeHost", __FILE__, __LINE__);
}

extern "C" tt_status tt_cuda_copy_to_host_async(int device, void *dst, const void *src, size_t nbytes,
                                                void **event) {
  *event = NULL;
  cudaStream_t compute;
  tt_status st = tt_cuda_select(device, &compute);
  if (st != TT_OK) return st;
  auto *c = &tt_cuda_copy_devs[device];
  std::lock_guard<std::mutex> guard(c->lock);
  if (!c->ready) {
    TT_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    TT_CUDA_CHECK(cudaEventCreateWithFlags(&c->produced, cudaEventDisableTiming));
    c->ready = 1;
  }
  tt_cuda_event_guard done = {NULL};
  TT_CUDA_CHECK(cudaEventCreateWithFlags(&done.e, cudaEventDisableTiming));
  TT_CUDA_CHECK(cudaEventRecord(c->produced, compute));
  TT_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->produced, 0));
  TT_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, c->stream));
  TT_CUDA_CHECK(cudaEventRecord(done.e, c->stream));
  TT_CUDA_CHECK(cudaStreamWaitEvent(compute, done.e, 0));
  *event = (void *)done.e;
  done.e = NULL;
  return TT_OK;
}

extern "C" tt_status tt_cuda_event_wait(void *event) {
  TT_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)event));
  return TT_OK;
}

extern "C" void tt_cuda_event_free(void *event) {
  cudaError_t err = cudaEventDestroy((cudaEvent_t)event);
  if (err != cudaSuccess) tt_cuda_fail(err, "cudaEventDestroy", __FILE__, __LINE__);
}

/* An event on one of the device's streams (the caching allocator's
 * record_stream: a freed block waits for it before reuse). */
extern "C" tt_status tt_cuda_event_record(int device, int stream, void **event) {
  *event = NULL;
  if (stream != TT_STREAM_COMPUTE && stream != TT_STREAM_COMM)
    return tt_error_set(TT_ERR_INVALID, "cuda: event_record on stream %d (expected compute or comm)", stream);
  cudaStream_t compute;
  tt_status st = tt_cuda_select(device, &compute);
  if (st != TT_OK) return st;
  cudaStream_t s = stream == TT_STREAM_COMM ? (cudaStream_t)tt_cuda_comm_stream(device) : compute;
  if (!s) return tt_error_set(TT_ERR_INTERNAL, "cuda: no stream %d on device %d", stream, device);
  tt_cuda_event_guard ev = {NULL};
  TT_CUDA_CHECK(cudaEventCreateWithFlags(&ev.e, cudaEventDisableTiming));
  TT_CUDA_CHECK(cudaEventRecord(ev.e, s));
  *event = (void *)ev.e;
  ev.e = NULL;
  return TT_OK;
}

extern "C" int tt_cuda_event_query(void *event) {
  cudaError_t err = cudaEventQuery((cudaEvent_t)event);
  if (err == cudaSuccess) return 1;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); /* "not yet" is not an error: do not leave it behind */
    return 0;
  }
  tt_cuda_fail(err, "cudaEventQuery", __FILE__, __LINE__);
  return -1;
}

/* The profiler's device clock (engine/timer.c): events with timing, made
 * once and recorded again at each mark, on the compute stream, so a
 * region's time is what the stream spent between its marks, with no host
 * wait in between. */
extern "C" tt_status tt_cuda_timer_event_new(int device, void **event) {
  *event = NULL;
  cudaStream_t compute;
  tt_status st = tt_cuda_select(device, &compute);
  if (st != TT_OK) return st;
  cudaEvent_t e;
  TT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
  *event = (void *)e;
  return TT_OK;
}

extern "C" tt_status tt_cuda_timer_event_mark(int device, void *event) {
  cudaStream_t compute;
  tt_status st = tt_cuda_select(device, &compute);
  if (st != TT_OK) return st;
  /* In a capture the record would become a graph dependency, not a time. */
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  TT_CUDA_CHECK(cudaStreamIsCapturing(compute, &cap));
  if (cap != cudaStreamCaptureStatusNone)
    return tt_error_set(TT_ERR_UNSUPPORTED, "timer: cuda:%d's stream is being captured into a CUDA graph; device "
                        "marks time eager work only", device);
  TT_CUDA_CHECK(cudaEventRecord((cudaEvent_t)event, compute));
  return TT_OK;
}

extern "C" tt_status tt_cuda_timer_event_elapsed(void *start, void *end, float *ms) {
  TT_CUDA_CHECK(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)end));
  return TT_OK;
}
