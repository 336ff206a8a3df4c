/*
 * dist_mpi.c — the "mpi" collectives backend: CPU tensors across processes
 * (Open MPI), for real multi-process runs on one host (`titan --nproc N`)
 * or several (mpirun/srun). Rank and world come from MPI_COMM_WORLD; the
 * values a caller passes must agree with them, so a launcher mix-up is an
 * error rather than a silently different layout.
 *
 * MPI is initialized by the first mpi group (not at program start: a
 * single-process run never touches it) and finalized by tt_dist_shutdown,
 * which the executable calls on its way out.
 */
#ifdef TITAN_HAVE_MPI
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"

typedef struct {
  MPI_Comm comm;
} tt_mpi;

static tt_mpi *impl(tt_group *g) { return (tt_mpi *)g->impl; }

static tt_status mpi_err(const char *what, int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "error %d", rc);
  return tt_error_set(TT_ERR_INTERNAL, "mpi: %s failed: %s", what, msg);
}

#define MPI_TRY(what, call)               \
  do {                                    \
    int rc_ = (call);                     \
    if (rc_ != MPI_SUCCESS) return mpi_err(what, rc_); \
  } while (0)

/* Before a call that blocks this process on another rank: under cuemu
 * (the CUDA backend emulated on the CPU, tests/cuemu) with deferred
 * streams, the emulated GPU's queued work runs now. A GPU progresses on its
 * own while the host waits; a deferred queue runs only when the host needs
 * it, so a rank blocked here with its NCCL sends still queued would wait
 * forever for a rank that waits on those sends. Nothing elsewhere. */
#if defined(TITAN_CUEMU)
void tt_emu_progress(void);
static void host_blocks(void) { tt_emu_progress(); }
#else
static void host_blocks(void) {}
#endif

/* MPI counts are ints: long buffers go in pieces of at most 2^30 elements. */
#define TT_MPI_PIECE ((int64_t)1 << 30)

static int initialized_here;

static tt_status mpi_init(tt_group *g, const uint8_t *id, size_t id_len) {
  (void)id, (void)id_len;
  int inited = 0, provided = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    /* Only the main thread calls MPI (the checkpoint writer thread does file I/O). */
    MPI_TRY("MPI_Init_thread", MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided));
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    initialized_here = 1;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != g->rank || size != g->size)
    return tt_error_set(TT_ERR_INVALID,
                        "mpi: this process is rank %d of %d in MPI_COMM_WORLD, but the group was asked for rank %d "
                        "of %d (launch with titan --nproc N or mpirun -np N, and let the ranks come from it)",
                        rank, size, g->rank, g->size);
  tt_mpi *m = calloc(1, sizeof *m);
  if (!m) return tt_error_set(TT_ERR_OOM, "mpi: out of host memory");
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &m->comm);
  if (rc != MPI_SUCCESS) {
    free(m);
    return mpi_err("MPI_Comm_dup", rc);
  }
  MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  g->impl = m;
  return TT_OK;
}

static void mpi_destroy(tt_group *g) {
  tt_mpi *m = impl(g);
  if (!m) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&m->comm);
  free(m);
  g->impl = NULL;
}

static tt_status mpi_split(tt_group *g, int color, int key, tt_group *out) {
  tt_mpi *m = calloc(1, sizeof *m);
  if (!m) return tt_error_set(TT_ERR_OOM, "mpi: out of host memory");
  int rc = MPI_Comm_split(impl(g)->comm, color < 0 ? MPI_UNDEFINED : color, key, &m->comm);
  if (rc != MPI_SUCCESS) {
    free(m);
    return mpi_err("MPI_Comm_split", rc);
  }
  if (m->comm == MPI_COMM_NULL) {
    free(m);
    return tt_error_set(TT_ERR_INVALID, "group split: color %d leaves rank %d in no group; expected a color >= 0",
                        color, g->rank);
  }
  MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(m->comm, &out->rank);
  MPI_Comm_size(m->comm, &out->size);
  out->impl = m;
  return TT_OK;
}

static tt_status fits_int(const char *op, int64_t n) {
  if (n > INT_MAX)
    return tt_error_set(TT_ERR_SHAPE, "mpi: %s of %lld elements per rank; at most %d", op, (long long)n, INT_MAX);
  return TT_OK;
}

/* Moves: one "element" is a contiguous run of the dtype's bytes. */
static tt_status bytes_type(int dtype, MPI_Datatype *dt) {
  size_t esz = tt_dtype_size(dtype);
  if (esz == 1) {
    *dt = MPI_BYTE;
    return TT_OK;
  }
  MPI_TRY("MPI_Type_contiguous", MPI_Type_contiguous((int)esz, MPI_BYTE, dt));
  MPI_TRY("MPI_Type_commit", MPI_Type_commit(dt));
  return TT_OK;
}

static void bytes_type_free(MPI_Datatype *dt) {
  if (*dt != MPI_BYTE) MPI_Type_free(dt);
}

/* Reductions add rank 0's values, then rank 1's, ... (dist_reduce.c), as the
 * local backend does, rather than in the order an MPI library's algorithm
 * for the message size picks: a job's bits are then the same over Open MPI,
 * in a simulated run (`titan --simulate N`) and whatever MPI is installed.
 * An all-reduce moves what a ring does: each rank gathers every rank's copy
 * of its segment (MPI_Alltoallv), reduces it in rank order, and the
 * segments are gathered back (MPI_Allgatherv). */
static tt_status mpi_all_reduce(tt_group *g, tt_tensor *t, int op) {
  host_blocks();
  TT_TRY(tt_dist_reduce_check("mpi: all_reduce", t->dtype, op));
  int n = g->size, me = g->rank;
  char *p = tt_tensor_data(t);
  int64_t total = tt_tensor_numel(t);
  size_t esz = tt_dtype_size(t->dtype);
  int *counts = calloc((size_t)n * 3, sizeof *counts);
  if (!counts) return tt_error_set(TT_ERR_OOM, "mpi: all_reduce: out of host memory");
  int *displs = counts + n, *rcounts = counts + 2 * n;
  int *rdispls = calloc((size_t)n, sizeof *rdispls);
  char *tmp = NULL;
  MPI_Datatype dt = MPI_BYTE;
  tt_status st = rdispls ? bytes_type(t->dtype, &dt) : tt_error_set(TT_ERR_OOM, "mpi: all_reduce: out of host memory");
  for (int64_t at = 0; st == TT_OK && at < total; at += TT_MPI_PIECE) {
    int64_t len = total - at < TT_MPI_PIECE ? total - at : TT_MPI_PIECE, seg = (len + n - 1) / n;
    for (int j = 0; j < n; j++) {
      int64_t lo = (int64_t)j * seg < len ? (int64_t)j * seg : len, hi = lo + seg < len ? lo + seg : len;
      counts[j] = (int)(hi - lo);
      displs[j] = (int)lo;
    }
    for (int r = 0; r < n; r++) {
      rcounts[r] = counts[me];
      rdispls[r] = r * counts[me];
    }
    free(tmp);
    tmp = malloc((size_t)n * (size_t)counts[me] * esz + 1);
    if (!tmp) {
      st = tt_error_set(TT_ERR_OOM, "mpi: all_reduce: out of host memory");
      break;
    }
    char *piece = p + at * (int64_t)esz;
    int rc = MPI_Alltoallv(piece, counts, displs, dt, tmp, rcounts, rdispls, dt, impl(g)->comm);
    if (rc != MPI_SUCCESS) {
      st = mpi_err("MPI_Alltoallv", rc);
      break;
    }
    for (int r = 1; r < n; r++)
      tt_dist_reduce_into(tmp, tmp + (size_t)r * (size_t)counts[me] * esz, counts[me], t->dtype, op);
    tt_dist_reduce_finish(tmp, counts[me], t->dtype, op, n);
    memcpy(piece + (size_t)displs[me] * esz, tmp, (size_t)counts[me] * esz);
    rc = MPI_Allgatherv(MPI_IN_PLACE, 0, dt, piece, counts, displs, dt, impl(g)->comm);
    if (rc != MPI_SUCCESS) st = mpi_err("MPI_Allgatherv", rc);
  }
  if (rdispls) bytes_type_free(&dt);
  free(tmp);
  free(rdispls);
  free(counts);
  return st;
}

/* Each rank receives every rank's copy of its chunk (MPI_Alltoall) and
 * reduces them in rank order. */
static tt_status mpi_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op) {
  host_blocks();
  TT_TRY(tt_dist_reduce_check("mpi: reduce_scatter", in->dtype, op));
  int64_t m = tt_tensor_numel(out);
  TT_TRY(fits_int("reduce_scatter", m));
  size_t esz = tt_dtype_size(in->dtype);
  char *tmp = malloc((size_t)g->size * (size_t)m * esz + 1);
  if (!tmp) return tt_error_set(TT_ERR_OOM, "mpi: reduce_scatter: out of host memory");
  MPI_Datatype dt = MPI_BYTE;
  tt_status st = bytes_type(in->dtype, &dt);
  if (st == TT_OK) {
    int rc = MPI_Alltoall(tt_tensor_data(in), (int)m, dt, tmp, (int)m, dt, impl(g)->comm);
    bytes_type_free(&dt);
    if (rc != MPI_SUCCESS) st = mpi_err("MPI_Alltoall", rc);
  }
  if (st == TT_OK) {
    for (int r = 1; r < g->size; r++) tt_dist_reduce_into(tmp, tmp + (size_t)r * (size_t)m * esz, m, in->dtype, op);
    tt_dist_reduce_finish(tmp, m, in->dtype, op, g->size);
    memcpy(tt_tensor_data(out), tmp, (size_t)m * esz);
  }
  free(tmp);
  return st;
}

static tt_status mpi_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  host_blocks();
  int64_t n = tt_tensor_numel(in);
  TT_TRY(fits_int("all_gather", n));
  MPI_Datatype dt = MPI_BYTE;
  TT_TRY(bytes_type(in->dtype, &dt));
  int rc = MPI_Allgather(tt_tensor_data(in), (int)n, dt, tt_tensor_data(out), (int)n, dt, impl(g)->comm);
  bytes_type_free(&dt);
  return rc == MPI_SUCCESS ? TT_OK : mpi_err("MPI_Allgather", rc);
}

static tt_status mpi_broadcast(tt_group *g, tt_tensor *t, int root) {
  host_blocks();
  MPI_Datatype dt = MPI_BYTE;
  TT_TRY(bytes_type(t->dtype, &dt));
  char *p = tt_tensor_data(t);
  int64_t n = tt_tensor_numel(t), esz = (int64_t)tt_dtype_size(t->dtype);
  int rc = MPI_SUCCESS;
  for (int64_t i = 0; i < n && rc == MPI_SUCCESS; i += TT_MPI_PIECE) {
    int c = (int)(n - i < TT_MPI_PIECE ? n - i : TT_MPI_PIECE);
    rc = MPI_Bcast(p + i * esz, c, dt, root, impl(g)->comm);
  }
  bytes_type_free(&dt);
  return rc == MPI_SUCCESS ? TT_OK : mpi_err("MPI_Bcast", rc);
}

static tt_status mpi_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  host_blocks();
  int64_t chunk = tt_tensor_numel(in) / g->size;
  TT_TRY(fits_int("all_to_all", chunk));
  MPI_Datatype dt = MPI_BYTE;
  TT_TRY(bytes_type(in->dtype, &dt));
  int rc = MPI_Alltoall(tt_tensor_data(in), (int)chunk, dt, tt_tensor_data(out), (int)chunk, dt, impl(g)->comm);
  bytes_type_free(&dt);
  return rc == MPI_SUCCESS ? TT_OK : mpi_err("MPI_Alltoall", rc);
}

/* Point to point: one message per piece, MPI tag = tag x 64 + piece index
 * (the standard promises tags up to 32767 only: checked once). */
#define TT_MPI_PIECES 64
static tt_status mpi_tag_base(const char *op, int64_t n, int tag, int *out) {
  static int ub = -1;
  if (ub < 0) {
    int *v = NULL, flag = 0;
    ub = MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag) == MPI_SUCCESS && flag ? *v : 32767;
  }
  if ((n + TT_MPI_PIECE - 1) / TT_MPI_PIECE > TT_MPI_PIECES)
    return tt_error_set(TT_ERR_INVALID, "mpi: %s of %lld elements: more than %d pieces of 2^30", op, (long long)n,
                        TT_MPI_PIECES);
  if ((int64_t)tag * TT_MPI_PIECES + TT_MPI_PIECES - 1 > ub)
    return tt_error_set(TT_ERR_INVALID, "mpi: %s: tag %d is past this MPI's largest tag (%d / %d)", op, tag, ub,
                        TT_MPI_PIECES);
  *out = tag * TT_MPI_PIECES;
  return TT_OK;
}

static tt_status mpi_p2p(tt_group *g, tt_tensor *t, int peer, int user_tag, int sending) {
  host_blocks();
  int64_t n = tt_tensor_numel(t), esz = (int64_t)tt_dtype_size(t->dtype);
  int rc = MPI_SUCCESS, tag = 0;
  TT_TRY(mpi_tag_base(sending ? "send" : "recv", n, user_tag, &tag));
  MPI_Datatype dt = MPI_BYTE;
  TT_TRY(bytes_type(t->dtype, &dt));
  char *p = tt_tensor_data(t);
  for (int64_t i = 0; i < n && rc == MPI_SUCCESS; i += TT_MPI_PIECE, tag++) {
    int c = (int)(n - i < TT_MPI_PIECE ? n - i : TT_MPI_PIECE);
    rc = sending ? MPI_Send(p + i * esz, c, dt, peer, tag, impl(g)->comm)
                 : MPI_Recv(p + i * esz, c, dt, peer, tag, impl(g)->comm, MPI_STATUS_IGNORE);
  }
  bytes_type_free(&dt);
  return rc == MPI_SUCCESS ? TT_OK : mpi_err(sending ? "MPI_Send" : "MPI_Recv", rc);
}

static tt_status mpi_send(tt_group *g, const tt_tensor *t, int peer, int tag) {
  return mpi_p2p(g, (tt_tensor *)t, peer, tag, 1);
}
static tt_status mpi_recv(tt_group *g, tt_tensor *t, int peer, int tag) { return mpi_p2p(g, t, peer, tag, 0); }

/* The nonblocking send: the same pieces and tags as mpi_p2p, one request each. */
typedef struct {
  int n;
  MPI_Request reqs[];
} tt_mpi_sends;

static tt_status mpi_isend(tt_group *g, const tt_tensor *t, int peer, int user_tag, void **req) {
  *req = NULL;
  int tag = 0;
  TT_TRY(mpi_tag_base("isend", tt_tensor_numel(t), user_tag, &tag));
  MPI_Datatype dt = MPI_BYTE;
  TT_TRY(bytes_type(t->dtype, &dt));
  const char *p = tt_tensor_data(t);
  int64_t n = tt_tensor_numel(t), esz = (int64_t)tt_dtype_size(t->dtype);
  int pieces = (int)((n + TT_MPI_PIECE - 1) / TT_MPI_PIECE);
  tt_mpi_sends *s = calloc(1, sizeof *s + (size_t)(pieces > 0 ? pieces : 1) * sizeof(MPI_Request));
  if (!s) {
    bytes_type_free(&dt);
    return tt_error_set(TT_ERR_OOM, "mpi: isend: out of host memory");
  }
  int rc = MPI_SUCCESS;
  for (int64_t i = 0; i < n && rc == MPI_SUCCESS; i += TT_MPI_PIECE, tag++) {
    int c = (int)(n - i < TT_MPI_PIECE ? n - i : TT_MPI_PIECE);
    rc = MPI_Isend(p + i * esz, c, dt, peer, tag, impl(g)->comm, &s->reqs[s->n]);
    if (rc == MPI_SUCCESS) s->n++;
  }
  bytes_type_free(&dt); /* (MPI keeps its own reference to a committed type until the sends end) */
  if (rc != MPI_SUCCESS) {
    MPI_Waitall(s->n, s->reqs, MPI_STATUSES_IGNORE);
    free(s);
    return mpi_err("MPI_Isend", rc);
  }
  *req = s;
  return TT_OK;
}

static tt_status mpi_wait(tt_group *g, void *req) {
  host_blocks();
  (void)g;
  tt_mpi_sends *s = req;
  int rc = MPI_Waitall(s->n, s->reqs, MPI_STATUSES_IGNORE);
  free(s);
  return rc == MPI_SUCCESS ? TT_OK : mpi_err("MPI_Waitall", rc);
}

static tt_status mpi_barrier(tt_group *g) {
  host_blocks();
  MPI_TRY("MPI_Barrier", MPI_Barrier(impl(g)->comm));
  return TT_OK;
}

static const tt_dist_backend tt_mpi_backend = {
    .name = "mpi",
    .init = mpi_init,
    .destroy = mpi_destroy,
    .split = mpi_split,
    .all_reduce = mpi_all_reduce,
    .reduce_scatter = mpi_reduce_scatter,
    .all_gather = mpi_all_gather,
    .broadcast = mpi_broadcast,
    .all_to_all = mpi_all_to_all,
    .send = mpi_send,
    .recv = mpi_recv,
    .barrier = mpi_barrier,
    .isend = mpi_isend,
    .wait = mpi_wait,
};

const tt_dist_backend *tt_dist_backend_mpi(void) { return &tt_mpi_backend; }

const char *tt_dist_mpi_info(void) {
  static char info[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (!info[0] && MPI_Get_library_version(info, &len) == MPI_SUCCESS) {
    char *nl = strchr(info, '\n'); /* Open MPI adds its repository and date after a comma */
    if (nl) *nl = 0;
    char *comma = strchr(info, ',');
    if (comma) *comma = 0;
  }
  return info;
}

/* A clean exit finalizes MPI (every rank does, so the launcher sees a
 * finished job). A failing rank does not: MPI_Finalize waits for the other
 * ranks, which may be blocked in a collective this rank will never join;
 * exiting without it makes mpirun stop the whole job instead of hanging. */
void tt_dist_shutdown(int failed) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized || !initialized_here) return;
  if (!failed) MPI_Finalize();
}

#else
typedef int tt_dist_mpi_unused;
#endif
