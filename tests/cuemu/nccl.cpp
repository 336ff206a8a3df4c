/*
 * nccl.cpp — cuemu's NCCL, with NCCL's rules checked: buffers in device
 * memory of the communicator's device, root and peers in range, and a
 * send/recv to oneself only inside a group (alone, each would wait forever
 * for its partner), matched in order at ncclGroupEnd. Work goes on the given
 * stream like any other (so it can be captured).
 *
 * A communicator of one rank does each collective as a copy (or nothing when
 * in place). Across processes (a build with Open MPI, ranks started by
 * `titan_cuemu --nproc N`) a communicator is an MPI communicator: the world
 * one from ncclCommInitRank, which every MPI rank must call with its MPI
 * rank, and its ncclCommSplit children. Its collectives run over MPI when the
 * stream reaches them: reductions gather every rank's values and combine them
 * in rank order in double (int64 for the integer types), rounded once, so
 * every rank holds the same bits, as NCCL's do; a send is synchronous
 * (MPI_Ssend, and MPI_Issend in a group), as NCCL's waits for its receiver,
 * so two ranks that send to each other at once, or a batch whose send's
 * receive comes only after it, hang here as they would on GPUs.
 */
#include <nccl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <vector>

#ifdef TITAN_HAVE_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include "cuemu_internal.h"
#include "dtype_conv.h"

struct ncclComm {
  int device;
  int rank = 0, size = 1;
#ifdef TITAN_HAVE_MPI
  MPI_Comm mpi = MPI_COMM_NULL; /* size > 1 only */
#endif
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
  ncclComm *comm;
  int peer;
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

bool valid_op(ncclRedOp_t op) { return op >= ncclSum && op <= ncclAvg; }

#ifdef TITAN_HAVE_MPI

/* Work of a communicator across processes, run when its stream gets to it. */
ncclResult_t enqueue(cudaStream_t s, const char *what, std::function<void()> fn) {
  return tt_emu_enqueue(s, what, std::move(fn)) == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}

void mpi_check(int rc, const char *call) {
  if (rc != MPI_SUCCESS) tt_emu_die("nccl: %s failed (MPI error %d)", call, rc);
}

int mpi_count(size_t bytes, const char *what) {
  if (bytes > (size_t)0x7fffffff) tt_emu_die("nccl: %s of %zu bytes: cuemu moves at most 2 GiB at once", what, bytes);
  return (int)bytes;
}

/* Element i of a buffer of type t as a double (floats) or int64 (integers), and back. */
double get_f(const void *p, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclFloat16: return tt_f16_to_f32(((const uint16_t *)p)[i]);
    case ncclBfloat16: return tt_bf16_to_f32(((const uint16_t *)p)[i]);
    case ncclFloat32: return ((const float *)p)[i];
    default: return ((const double *)p)[i];
  }
}
void put_f(void *p, size_t i, ncclDataType_t t, double v) {
  switch (t) {
    case ncclFloat16: ((uint16_t *)p)[i] = tt_f32_to_f16((float)v); break;
    case ncclBfloat16: ((uint16_t *)p)[i] = tt_f32_to_bf16((float)v); break;
    case ncclFloat32: ((float *)p)[i] = (float)v; break;
    default: ((double *)p)[i] = v; break;
  }
}
int64_t get_i(const void *p, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return ((const int8_t *)p)[i];
    case ncclUint8: return ((const uint8_t *)p)[i];
    case ncclInt32: return ((const int32_t *)p)[i];
    case ncclUint32: return ((const uint32_t *)p)[i];
    default: return ((const int64_t *)p)[i]; /* (uint64 as its bits: sums wrap alike) */
  }
}
void put_i(void *p, size_t i, ncclDataType_t t, int64_t v) {
  switch (t) {
    case ncclInt8: ((int8_t *)p)[i] = (int8_t)v; break;
    case ncclUint8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case ncclInt32: ((int32_t *)p)[i] = (int32_t)v; break;
    case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    default: ((int64_t *)p)[i] = v; break;
  }
}
bool is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

/* dst[i] = op over ranks r of parts[r][i], in rank order; parts: n ranks'
 * buffers of count elements, back to back. */
void combine(const char *parts, int n, size_t count, ncclDataType_t t, ncclRedOp_t op, void *dst) {
  const size_t stride = count * type_size(t);
  for (size_t i = 0; i < count; i++) {
    if (is_float(t)) {
      double a = get_f(parts, i, t);
      for (int r = 1; r < n; r++) {
        const double b = get_f(parts + r * stride, i, t);
        a = op == ncclProd ? a * b : op == ncclMax ? (b > a ? b : a) : op == ncclMin ? (b < a ? b : a) : a + b;
      }
      put_f(dst, i, t, op == ncclAvg ? a / n : a);
    } else {
      int64_t a = get_i(parts, i, t);
      for (int r = 1; r < n; r++) {
        const int64_t b = get_i(parts + r * stride, i, t);
        a = op == ncclProd ? a * b : op == ncclMax ? (b > a ? b : a) : op == ncclMin ? (b < a ? b : a) : a + b;
      }
      put_i(dst, i, t, op == ncclAvg ? a / n : a);
    }
  }
}

#endif  // TITAN_HAVE_MPI

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

/* Different in every call and process, so ranks handed different ids are caught. */
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  static unsigned long calls = 0;
  memset(id, 0, sizeof *id);
  const unsigned long v[3] = {(unsigned long)getpid(), (unsigned long)time(NULL), ++calls};
  memcpy(id->internal, "cuemu", 5);
  memcpy(id->internal + 8, v, sizeof v);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  *comm = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  ncclComm *c = new ncclComm();
  cudaGetDevice(&c->device);
  if (nranks > 1) {
#ifdef TITAN_HAVE_MPI
    int inited = 0, wrank = 0, wsize = 0;
    MPI_Initialized(&inited);
    if (!inited)
      tt_emu_die("nccl: ncclCommInitRank of %d ranks before MPI started: cuemu's NCCL across processes runs over "
                 "MPI (titan_cuemu --nproc N makes the MPI world group first)",
                 nranks);
    MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
    MPI_Comm_size(MPI_COMM_WORLD, &wsize);
    if (wsize != nranks || wrank != rank)
      tt_emu_die("nccl: ncclCommInitRank(rank %d of %d) in MPI rank %d of %d: cuemu's NCCL makes the communicator of "
                 "every MPI rank, each at its MPI rank (smaller ones come from ncclCommSplit)",
                 rank, nranks, wrank, wsize);
    ncclUniqueId root = id;
    mpi_check(MPI_Bcast(&root, (int)sizeof root, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
    if (memcmp(&root, &id, sizeof id) != 0)
      tt_emu_die("nccl: rank %d's unique id is not rank 0's: every rank must pass the id rank 0 made", rank);
    mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &c->mpi), "MPI_Comm_dup");
    c->rank = rank;
    c->size = nranks;
#else
    delete c;
    return ncclInvalidArgument; /* one process, one rank: this build has no MPI to reach the others */
#endif
  }
  *comm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
#ifdef TITAN_HAVE_MPI
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm && comm->mpi != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm->mpi);
#endif
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  (void)config;
  *newcomm = NULL;
  if (color != NCCL_SPLIT_NOCOLOR && color < 0) return ncclInvalidArgument;
#ifdef TITAN_HAVE_MPI
  if (comm->size > 1) { /* collective over comm's ranks, as NCCL's */
    MPI_Comm m = MPI_COMM_NULL;
    mpi_check(MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &m),
              "MPI_Comm_split");
    if (m == MPI_COMM_NULL) return ncclSuccess;
    ncclComm *c = new ncclComm();
    c->device = comm->device;
    MPI_Comm_rank(m, &c->rank);
    MPI_Comm_size(m, &c->size);
    if (c->size > 1) {
      c->mpi = m;
    } else {
      c->rank = 0;
      MPI_Comm_free(&m);
    }
    *newcomm = c;
    return ncclSuccess;
  }
#else
  (void)key;
#endif
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  ncclComm *c = new ncclComm();
  c->device = comm->device;
  *newcomm = c;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  *count = comm->size;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || !valid_op(op)) return ncclInvalidArgument;
  const size_t bytes = count * type_size(t);
#ifdef TITAN_HAVE_MPI
  if (comm->size > 1) {
    dev_buf(comm, send, bytes, "send");
    dev_buf(comm, recv, bytes, "receive");
    return enqueue(s, "ncclAllReduce", [=]() {
      std::vector<char> all(bytes * comm->size);
      mpi_check(MPI_Allgather(send, mpi_count(bytes, "ncclAllReduce"), MPI_BYTE, all.data(), (int)bytes, MPI_BYTE,
                              comm->mpi),
                "MPI_Allgather");
      combine(all.data(), comm->size, count, t, op, recv);
    });
  }
#endif
  return copy(comm, send, recv, bytes, s, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
  if (!type_size(t) || !valid_op(op)) return ncclInvalidArgument;
  const size_t bytes = recvcount * type_size(t);
#ifdef TITAN_HAVE_MPI
  if (comm->size > 1) {
    dev_buf(comm, send, bytes * comm->size, "send");
    dev_buf(comm, recv, bytes, "receive");
    return enqueue(s, "ncclReduceScatter", [=]() {
      /* chunk `rank` of every rank's send buffer, in rank order */
      std::vector<char> mine(bytes * comm->size);
      const int n = mpi_count(bytes, "ncclReduceScatter");
      mpi_check(MPI_Alltoall(send, n, MPI_BYTE, mine.data(), n, MPI_BYTE, comm->mpi), "MPI_Alltoall");
      combine(mine.data(), comm->size, recvcount, t, op, recv);
    });
  }
#endif
  return copy(comm, send, recv, bytes, s, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s) {
  if (!type_size(t)) return ncclInvalidArgument;
  const size_t bytes = sendcount * type_size(t);
#ifdef TITAN_HAVE_MPI
  if (comm->size > 1) {
    dev_buf(comm, send, bytes, "send");
    dev_buf(comm, recv, bytes * comm->size, "receive");
    return enqueue(s, "ncclAllGather", [=]() {
      const int n = mpi_count(bytes, "ncclAllGather");
      /* in place: this rank's part already sits at its slot of recv */
      const bool in_place = send == (const char *)recv + bytes * comm->rank;
      mpi_check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, MPI_BYTE, recv, n, MPI_BYTE, comm->mpi),
                "MPI_Allgather");
    });
  }
#endif
  return copy(comm, send, recv, bytes, s, "ncclAllGather");
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s) {
  if (!type_size(t) || root < 0 || root >= comm->size) return ncclInvalidArgument;
  const size_t bytes = count * type_size(t);
#ifdef TITAN_HAVE_MPI
  if (comm->size > 1) {
    if (comm->rank == root) dev_buf(comm, send, bytes, "send");
    dev_buf(comm, recv, bytes, "receive");
    return enqueue(s, "ncclBroadcast", [=]() {
      if (comm->rank == root && send != recv) memmove(recv, send, bytes);
      mpi_check(MPI_Bcast(recv, mpi_count(bytes, "ncclBroadcast"), MPI_BYTE, root, comm->mpi), "MPI_Bcast");
    });
  }
#endif
  return copy(comm, send, recv, bytes, s, "ncclBroadcast");
}

ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

static ncclResult_t p2p_op(bool send, void *buf, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                           cudaStream_t s) {
  if (!type_size(t) || peer < 0 || peer >= comm->size) return ncclInvalidArgument;
  const size_t bytes = count * type_size(t);
  dev_buf(comm, buf, bytes, send ? "send" : "receive");
  if (group_depth > 0) {
    group_ops.push_back(p2p{send, buf, bytes, s, comm, peer});
    return ncclSuccess;
  }
  if (peer == comm->rank)
    tt_emu_die("%s %s its own rank outside a group: NCCL would wait forever", send ? "ncclSend to" : "ncclRecv from");
#ifdef TITAN_HAVE_MPI
  return enqueue(s, send ? "ncclSend" : "ncclRecv", [=]() {
    const int n = mpi_count(bytes, send ? "ncclSend" : "ncclRecv");
    if (send)
      mpi_check(MPI_Ssend(buf, n, MPI_BYTE, peer, 0, comm->mpi), "MPI_Ssend");
    else
      mpi_check(MPI_Recv(buf, n, MPI_BYTE, peer, 0, comm->mpi, MPI_STATUS_IGNORE), "MPI_Recv");
  });
#else
  return ncclInvalidArgument;
#endif
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  return p2p_op(true, const_cast<void *>(send), count, t, peer, comm, s);
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s) {
  return p2p_op(false, recv, count, t, peer, comm, s);
}

/* A group's sends and receives run together: to oneself (communicators of
 * one rank), matched in order; across processes, all posted at once and
 * waited for (on the stream of the group's first operation). */
ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0) return ncclSuccess;
  std::vector<p2p> sends, recvs, remote;
  for (const p2p &o : group_ops) (o.comm->size > 1 ? remote : o.send ? sends : recvs).push_back(o);
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
  if (remote.empty()) return ncclSuccess;
#ifdef TITAN_HAVE_MPI
  return enqueue(remote[0].stream, "ncclGroupEnd", [remote]() {
    std::vector<MPI_Request> reqs(remote.size());
    for (size_t i = 0; i < remote.size(); i++) {
      const p2p &o = remote[i];
      const int n = mpi_count(o.bytes, o.send ? "ncclSend" : "ncclRecv");
      /* synchronous sends (MPI_Issend): a send completes only once its receive is posted, as
       * NCCL's do at the sizes of real activations, however small the message here (MPI would
       * let a small MPI_Isend complete from its buffer, and hide a batch that waits forever) */
      mpi_check(o.send ? MPI_Issend(o.buf, n, MPI_BYTE, o.peer, 0, o.comm->mpi, &reqs[i])
                       : MPI_Irecv(o.buf, n, MPI_BYTE, o.peer, 0, o.comm->mpi, &reqs[i]),
                o.send ? "MPI_Issend" : "MPI_Irecv");
    }
    mpi_check(MPI_Waitall((int)reqs.size(), reqs.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
  });
#else
  return ncclInvalidUsage;
#endif
}

}  // extern "C"
