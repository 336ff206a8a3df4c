/*
 * dist_nccl.c — the "nccl" collectives backend (CUDA tensors).
 *
 * Each group holds an NCCL communicator on the group's device. Collectives
 * run on the device's communication stream (no host wait); two
 * events fence them: the comm stream waits for the compute stream's work
 * that produced the input, and the compute stream waits for the collective
 * before anything reads the output. Only compiled with TITAN_CUDA.
 */
#ifdef TITAN_HAVE_CUDA

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

/* Streams of the CUDA backend (kernels/cuda/backend.cu). */
void *tt_cuda_stream(int device);
void *tt_cuda_comm_stream(int device);

typedef struct {
  ncclComm_t comm;
  cudaEvent_t produced, done;
  float *scratch; /* one float for barriers */
} tt_nccl;

#define NCCL_TRY(call)                                                                                  \
  do {                                                                                                  \
    ncclResult_t r_ = (call);                                                                           \
    if (r_ != ncclSuccess)                                                                              \
      return tt_error_set(TT_ERR_INTERNAL, "nccl: %s failed at %s:%d: %s", #call, __FILE__, __LINE__,   \
                          ncclGetErrorString(r_));                                                      \
  } while (0)

#define CUDA_TRY(call)                                                                                  \
  do {                                                                                                  \
    cudaError_t e_ = (call);                                                                            \
    if (e_ != cudaSuccess)                                                                              \
      return tt_error_set(TT_ERR_INTERNAL, "cuda: %s failed at %s:%d: %s", #call, __FILE__, __LINE__,   \
                          cudaGetErrorString(e_));                                                      \
  } while (0)

static tt_status nccl_dtype(int dtype, ncclDataType_t *out, int reducing) {
  switch (dtype) {
    case TT_F32: *out = ncclFloat32; return TT_OK;
    case TT_F64: *out = ncclFloat64; return TT_OK;
    case TT_BF16: *out = ncclBfloat16; return TT_OK;
    case TT_F16: *out = ncclFloat16; return TT_OK;
    case TT_I32: *out = ncclInt32; return TT_OK;
    case TT_I64: *out = ncclInt64; return TT_OK;
    case TT_U8: case TT_BOOL: *out = ncclUint8; return TT_OK;
    case TT_F8E4M3: case TT_F8E5M2:
      if (reducing) break; /* bytes move fine; sums of fp8 do not */
      *out = ncclUint8;
      return TT_OK;
    default: break;
  }
  return tt_error_set(TT_ERR_DTYPE, "nccl: dtype %s cannot be %s", tt_dtype_name(dtype),
                      reducing ? "reduced" : "communicated");
}

static ncclRedOp_t nccl_op(int op) {
  switch (op) {
    case TT_RED_AVG: return ncclAvg;
    case TT_RED_MAX: return ncclMax;
    case TT_RED_MIN: return ncclMin;
    default: return ncclSum;
  }
}

static tt_nccl *impl(tt_group *g) { return (tt_nccl *)g->impl; }

static tt_status events_new(tt_nccl *n) {
  CUDA_TRY(cudaEventCreateWithFlags(&n->produced, cudaEventDisableTiming));
  CUDA_TRY(cudaEventCreateWithFlags(&n->done, cudaEventDisableTiming));
  CUDA_TRY(cudaMalloc((void **)&n->scratch, sizeof(float)));
  return TT_OK;
}

static void nccl_destroy(tt_group *g);

static tt_status nccl_init(tt_group *g, const uint8_t *id, size_t id_len) {
  if (!id || id_len != sizeof(ncclUniqueId))
    return tt_error_set(TT_ERR_INVALID, "nccl: a %zu-byte unique id from rank 0 is required, got %zu bytes",
                        sizeof(ncclUniqueId), id_len);
  CUDA_TRY(cudaSetDevice(g->device));
  tt_nccl *n = calloc(1, sizeof *n);
  if (!n) return tt_error_set(TT_ERR_OOM, "nccl: out of host memory");
  ncclUniqueId uid;
  memcpy(&uid, id, sizeof uid);
  ncclResult_t r = ncclCommInitRank(&n->comm, g->size, uid, g->rank);
  if (r != ncclSuccess) {
    free(n);
    return tt_error_set(TT_ERR_INTERNAL, "nccl: ncclCommInitRank (rank %d of %d) failed: %s", g->rank, g->size,
                        ncclGetErrorString(r));
  }
  g->impl = n;
  tt_status st = events_new(n);
  if (st != TT_OK) nccl_destroy(g); /* the caller frees g without calling destroy */
  return st;
}

static void nccl_destroy(tt_group *g) {
  tt_nccl *n = impl(g);
  if (!n) return;
  if (n->produced) cudaEventDestroy(n->produced);
  if (n->done) cudaEventDestroy(n->done);
  if (n->scratch) cudaFree(n->scratch);
  if (n->comm) ncclCommDestroy(n->comm);
  free(n);
  g->impl = NULL;
}

static tt_status nccl_split(tt_group *g, int color, int key, tt_group *out) {
  CUDA_TRY(cudaSetDevice(g->device)); /* the events and scratch below live on the group's device */
  tt_nccl *n = calloc(1, sizeof *n);
  if (!n) return tt_error_set(TT_ERR_OOM, "nccl: out of host memory");
  ncclResult_t r = ncclCommSplit(impl(g)->comm, color, key, &n->comm, NULL);
  if (r != ncclSuccess) {
    free(n);
    return tt_error_set(TT_ERR_INTERNAL, "nccl: ncclCommSplit failed: %s", ncclGetErrorString(r));
  }
  int rank = 0, size = 0;
  ncclCommUserRank(n->comm, &rank);
  ncclCommCount(n->comm, &size);
  out->rank = rank;
  out->size = size;
  out->impl = n;
  tt_status st = events_new(n);
  if (st != TT_OK) nccl_destroy(out);
  return st;
}

/* Fence in: the comm stream waits for the compute stream. */
static tt_status begin(tt_group *g, cudaStream_t *comm) {
  tt_nccl *n = impl(g);
  CUDA_TRY(cudaSetDevice(g->device));
  cudaStream_t compute = (cudaStream_t)tt_cuda_stream(g->device);
  *comm = (cudaStream_t)tt_cuda_comm_stream(g->device);
  if (!compute || !*comm) return tt_error_set(TT_ERR_INTERNAL, "nccl: no CUDA streams on device %d", g->device);
  CUDA_TRY(cudaEventRecord(n->produced, compute));
  CUDA_TRY(cudaStreamWaitEvent(*comm, n->produced, 0));
  return TT_OK;
}

/* Fence out: the compute stream waits for the collective. */
static tt_status end(tt_group *g, cudaStream_t comm) {
  tt_nccl *n = impl(g);
  CUDA_TRY(cudaEventRecord(n->done, comm));
  CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)tt_cuda_stream(g->device), n->done, 0));
  return TT_OK;
}

/* The all-reduce in place on the comm stream, after the compute stream's
 * work (*s: the comm stream), without the fence out. */
static tt_status all_reduce_start(tt_group *g, tt_tensor *t, int op, cudaStream_t *s) {
  ncclDataType_t dt = ncclFloat32;
  TT_TRY(nccl_dtype(t->dtype, &dt, 1));
  TT_TRY(begin(g, s));
  void *p = tt_tensor_data(t);
  NCCL_TRY(ncclAllReduce(p, p, (size_t)tt_tensor_numel(t), dt, nccl_op(op), impl(g)->comm, *s));
  return TT_OK;
}

static tt_status nccl_all_reduce(tt_group *g, tt_tensor *t, int op) {
  cudaStream_t s = NULL;
  TT_TRY(all_reduce_start(g, t, op, &s));
  return end(g, s);
}

/* In place of the fence out: an event on the comm stream after the
 * collective, which nccl_wait_coll has the compute stream wait for. */
static tt_status async_end(cudaStream_t s, void **req) {
  cudaEvent_t e = NULL;
  CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaError_t err = cudaEventRecord(e, s);
  if (err != cudaSuccess) {
    cudaEventDestroy(e);
    return tt_error_set(TT_ERR_INTERNAL, "cuda: cudaEventRecord failed at %s:%d: %s", __FILE__, __LINE__,
                        cudaGetErrorString(err));
  }
  *req = e;
  return TT_OK;
}

static tt_status nccl_all_reduce_async(tt_group *g, tt_tensor *t, int op, void **req) {
  cudaStream_t s = NULL;
  TT_TRY(all_reduce_start(g, t, op, &s));
  return async_end(s, req);
}

static tt_status nccl_wait_coll(tt_group *g, void *req) {
  cudaEvent_t e = (cudaEvent_t)req;
  cudaError_t err = cudaSetDevice(g->device);
  if (err == cudaSuccess) err = cudaStreamWaitEvent((cudaStream_t)tt_cuda_stream(g->device), e, 0);
  cudaEventDestroy(e); /* (released once the collective is done) */
  if (err != cudaSuccess)
    return tt_error_set(TT_ERR_INTERNAL, "cuda: waiting for a collective failed: %s", cudaGetErrorString(err));
  return TT_OK;
}

/* The reduce-scatter and all-gather on the comm stream after the compute
 * stream's work (*s: the comm stream), without the fence out. */
static tt_status reduce_scatter_start(tt_group *g, const tt_tensor *in, tt_tensor *out, int op, cudaStream_t *s) {
  ncclDataType_t dt = ncclFloat32;
  TT_TRY(nccl_dtype(in->dtype, &dt, 1));
  TT_TRY(begin(g, s));
  NCCL_TRY(ncclReduceScatter(tt_tensor_data(in), tt_tensor_data(out), (size_t)tt_tensor_numel(out), dt, nccl_op(op),
                             impl(g)->comm, *s));
  return TT_OK;
}

static tt_status all_gather_start(tt_group *g, const tt_tensor *in, tt_tensor *out, cudaStream_t *s) {
  ncclDataType_t dt = ncclFloat32;
  TT_TRY(nccl_dtype(in->dtype, &dt, 0));
  TT_TRY(begin(g, s));
  NCCL_TRY(ncclAllGather(tt_tensor_data(in), tt_tensor_data(out), (size_t)tt_tensor_numel(in), dt, impl(g)->comm, *s));
  return TT_OK;
}

static tt_status nccl_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op) {
  cudaStream_t s = NULL;
  TT_TRY(reduce_scatter_start(g, in, out, op, &s));
  return end(g, s);
}

static tt_status nccl_reduce_scatter_async(tt_group *g, const tt_tensor *in, tt_tensor *out, int op, void **req) {
  cudaStream_t s = NULL;
  TT_TRY(reduce_scatter_start(g, in, out, op, &s));
  return async_end(s, req);
}

static tt_status nccl_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  cudaStream_t s = NULL;
  TT_TRY(all_gather_start(g, in, out, &s));
  return end(g, s);
}

static tt_status nccl_all_gather_async(tt_group *g, const tt_tensor *in, tt_tensor *out, void **req) {
  cudaStream_t s = NULL;
  TT_TRY(all_gather_start(g, in, out, &s));
  return async_end(s, req);
}

static tt_status nccl_broadcast(tt_group *g, tt_tensor *t, int root) {
  ncclDataType_t dt = ncclFloat32;
  cudaStream_t s = NULL;
  TT_TRY(nccl_dtype(t->dtype, &dt, 0));
  TT_TRY(begin(g, &s));
  void *p = tt_tensor_data(t);
  NCCL_TRY(ncclBroadcast(p, p, (size_t)tt_tensor_numel(t), dt, root, impl(g)->comm, s));
  return end(g, s);
}

static tt_status nccl_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  ncclDataType_t dt = ncclFloat32;
  cudaStream_t s = NULL;
  TT_TRY(nccl_dtype(in->dtype, &dt, 0));
  TT_TRY(begin(g, &s));
  size_t chunk = (size_t)tt_tensor_numel(in) / (size_t)g->size, esz = tt_dtype_size(in->dtype);
  const char *src = tt_tensor_data(in);
  char *dst = tt_tensor_data(out);
  NCCL_TRY(ncclGroupStart());
  /* The group is always closed, even when a call in it fails: an open
   * group would swallow every later NCCL call of this thread. */
  ncclResult_t r_ = ncclSuccess;
  int failed_peer = -1;
  for (int r = 0; r < g->size && r_ == ncclSuccess; r++) {
    r_ = ncclSend(src + (size_t)r * chunk * esz, chunk, dt, r, impl(g)->comm, s);
    if (r_ == ncclSuccess) r_ = ncclRecv(dst + (size_t)r * chunk * esz, chunk, dt, r, impl(g)->comm, s);
    if (r_ != ncclSuccess) failed_peer = r;
  }
  ncclResult_t end_r = ncclGroupEnd();
  if (r_ != ncclSuccess)
    return tt_error_set(TT_ERR_INTERNAL, "nccl: all_to_all: send/recv with rank %d failed: %s", failed_peer,
                        ncclGetErrorString(r_));
  if (end_r != ncclSuccess)
    return tt_error_set(TT_ERR_INTERNAL, "nccl: all_to_all: ncclGroupEnd failed: %s", ncclGetErrorString(end_r));
  return end(g, s);
}

/* (NCCL matches a peer's messages in order: the tag is not needed) */
static tt_status nccl_send(tt_group *g, const tt_tensor *t, int peer, int tag) {
  (void)tag;
  ncclDataType_t dt = ncclFloat32;
  cudaStream_t s = NULL;
  TT_TRY(nccl_dtype(t->dtype, &dt, 0));
  TT_TRY(begin(g, &s));
  NCCL_TRY(ncclSend(tt_tensor_data(t), (size_t)tt_tensor_numel(t), dt, peer, impl(g)->comm, s));
  return end(g, s);
}

static tt_status nccl_recv(tt_group *g, tt_tensor *t, int peer, int tag) {
  (void)tag;
  ncclDataType_t dt = ncclFloat32;
  cudaStream_t s = NULL;
  TT_TRY(nccl_dtype(t->dtype, &dt, 0));
  TT_TRY(begin(g, &s));
  NCCL_TRY(ncclRecv(tt_tensor_data(t), (size_t)tt_tensor_numel(t), dt, peer, impl(g)->comm, s));
  return end(g, s);
}

/* One group on the communication stream: NCCL progresses its sends and
 * receives together, so neighbours that send to each other at once meet.
 * Without the fence out (*s: the comm stream). */
static tt_status batch_p2p_start(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                 cudaStream_t *s) {
  for (int i = 0; i < n; i++) {
    ncclDataType_t dt;
    TT_TRY(nccl_dtype(ts[i]->dtype, &dt, 0));
  }
  TT_TRY(begin(g, s));
  NCCL_TRY(ncclGroupStart());
  ncclResult_t r = ncclSuccess;
  for (int i = 0; i < n && r == ncclSuccess; i++) {
    ncclDataType_t dt = ncclFloat32;
    (void)nccl_dtype(ts[i]->dtype, &dt, 0);
    const size_t count = (size_t)tt_tensor_numel(ts[i]);
    r = is_send[i] ? ncclSend(tt_tensor_data(ts[i]), count, dt, peers[i], impl(g)->comm, *s)
                   : ncclRecv(tt_tensor_data(ts[i]), count, dt, peers[i], impl(g)->comm, *s);
  }
  ncclResult_t end_r = ncclGroupEnd();
  if (r != ncclSuccess)
    return tt_error_set(TT_ERR_INTERNAL, "nccl: batch_p2p: ncclSend/ncclRecv failed: %s", ncclGetErrorString(r));
  if (end_r != ncclSuccess)
    return tt_error_set(TT_ERR_INTERNAL, "nccl: batch_p2p: ncclGroupEnd failed: %s", ncclGetErrorString(end_r));
  return TT_OK;
}

static tt_status nccl_batch_p2p(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                const int *tags) {
  (void)tags;
  cudaStream_t s = NULL;
  TT_TRY(batch_p2p_start(g, n, is_send, ts, peers, &s));
  return end(g, s);
}

static tt_status nccl_batch_p2p_async(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                      const int *tags, void **req) {
  (void)tags;
  cudaStream_t s = NULL;
  TT_TRY(batch_p2p_start(g, n, is_send, ts, peers, &s));
  return async_end(s, req);
}

static tt_status nccl_barrier(tt_group *g) {
  cudaStream_t s = NULL;
  TT_TRY(begin(g, &s));
  NCCL_TRY(ncclAllReduce(impl(g)->scratch, impl(g)->scratch, 1, ncclFloat32, ncclSum, impl(g)->comm, s));
  CUDA_TRY(cudaStreamSynchronize(s));
  return end(g, s);
}

static const tt_dist_backend tt_nccl_backend = {
    .name = "nccl",
    .init = nccl_init,
    .destroy = nccl_destroy,
    .split = nccl_split,
    .all_reduce = nccl_all_reduce,
    .reduce_scatter = nccl_reduce_scatter,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .all_to_all = nccl_all_to_all,
    .send = nccl_send,
    .recv = nccl_recv,
    .barrier = nccl_barrier,
    .batch_p2p = nccl_batch_p2p,
    .all_reduce_async = nccl_all_reduce_async,
    .wait_coll = nccl_wait_coll,
    .reduce_scatter_async = nccl_reduce_scatter_async,
    .all_gather_async = nccl_all_gather_async,
    .batch_p2p_async = nccl_batch_p2p_async,
};

const tt_dist_backend *tt_dist_backend_nccl(void) { return &tt_nccl_backend; }

tt_status tt_dist_unique_id(uint8_t *out, size_t cap, size_t *len) {
  *len = sizeof(ncclUniqueId);
  if (cap < sizeof(ncclUniqueId))
    return tt_error_set(TT_ERR_INVALID, "dist: the unique id needs %zu bytes, buffer has %zu", sizeof(ncclUniqueId), cap);
  ncclUniqueId id;
  NCCL_TRY(ncclGetUniqueId(&id));
  memcpy(out, &id, sizeof id);
  return TT_OK;
}

#else
/* Without CUDA this file is empty; dist.c provides the stubs. */
typedef int tt_dist_nccl_unused;
#endif
