/*
 * nccl.cpp — cuemu's NCCL: communicators of one rank (every collective at
 * world size 1 is a copy, or nothing when in place), with NCCL's rules
 * checked: buffers in device memory of the communicator's device, root and
 * peers in range, and send/recv to oneself only inside a group (alone, each
 * would wait forever for its partner), matched in order at ncclGroupEnd.
 * Work goes on the given stream like any other (so it can be captured).
 */
#include <nccl.h>
#include <string.h>

#include <vector>

#include "cuemu_internal.h"

struct ncclComm {
  int device;
};

namespace {

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

struct p2p {
  bool send;
  void *buf;
  size_t bytes;
  cudaStream_t stream;
};
thread_local int group_depth = 0;
thread_local std::vector<p2p> group_ops;

ncclResult_t dev_buf(const ncclComm *c, const void *p, size_t bytes, const char *what) {
  int d = -1;
  if (bytes == 0) return ncclSuccess;
  if (tt_emu_classify(p, bytes, &d) != 0 || d != c->device)
    tt_emu_die("nccl: the %s buffer (%p, %zu bytes) is not device memory of the communicator's device %d", what, p,
               bytes, c->device);
  return ncclSuccess;
}

ncclResult_t copy(const ncclComm *c, const void *src, void *dst, size_t bytes, cudaStream_t s, const char *what) {
  dev_buf(c, src, bytes, "send");
  dev_buf(c, dst, bytes, "receive");
  if (src == dst || bytes == 0) return ncclSuccess;
  return tt_emu_enqueue(s, what, [src, dst, bytes]() { memmove(dst, src, bytes); }) == cudaSuccess
             ? ncclSuccess
             : ncclUnhandledCudaError;
}

}  // namespace

extern "C" {

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    default: return "nccl error";
  }
}

ncclResult_t ncclGetVersion(int *v) {
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  *comm = NULL;
  if (nranks != 1 || rank != 0) return ncclInvalidArgument; /* one process, one rank */
  ncclComm *c = new ncclComm();
  cudaGetDevice(&c->device);
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)key;
  (void)config;
  *newcomm = NULL;
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  if (color < 0) return ncclInvalidArgument;
  ncclComm *c = new ncclComm();
  c->device = comm->device;
  *newcomm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  (void)comm;
  *count = 1;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  (void)comm;
  *rank = 0;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || op < ncclSum || op > ncclAvg) return ncclInvalidArgument;
  return copy(comm, send, recv, count * type_size(t), s, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || op < ncclSum || op > ncclAvg) return ncclInvalidArgument;
  return copy(comm, send, recv, recvcount * type_size(t), s, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s) {
  if (!type_size(t)) return ncclInvalidArgument;
  return copy(comm, send, recv, sendcount * type_size(t), s, "ncclAllGather");
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s) {
  if (!type_size(t) || root != 0) return ncclInvalidArgument;
  return copy(comm, send, recv, count * type_size(t), s, "ncclBroadcast");
}

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || peer != 0) return ncclInvalidArgument;
  dev_buf(comm, send, count * type_size(t), "send");
  if (group_depth == 0) tt_emu_die("ncclSend to its own rank outside a group: NCCL would wait forever");
  group_ops.push_back(p2p{true, const_cast<void *>(send), count * type_size(t), s});
  return ncclSuccess;
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || peer != 0) return ncclInvalidArgument;
  dev_buf(comm, recv, count * type_size(t), "receive");
  if (group_depth == 0) tt_emu_die("ncclRecv from its own rank outside a group: NCCL would wait forever");
  group_ops.push_back(p2p{false, recv, count * type_size(t), s});
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  std::vector<p2p> sends, recvs;
  for (const p2p &o : group_ops) (o.send ? sends : recvs).push_back(o);
  group_ops.clear();
  if (sends.size() != recvs.size()) return ncclInvalidUsage;
  for (size_t i = 0; i < sends.size(); i++) {
    if (sends[i].bytes != recvs[i].bytes) return ncclInvalidUsage;
    const void *src = sends[i].buf;
    void *dst = recvs[i].buf;
    size_t n = sends[i].bytes;
    if (n && src != dst && tt_emu_enqueue(recvs[i].stream, "ncclRecv", [src, dst, n]() { memmove(dst, src, n); }) !=
                               cudaSuccess)
      return ncclUnhandledCudaError;
  }
  return ncclSuccess;
}

}  // extern "C"
