/*
 * dist.c — process groups and the one place collectives are validated.
 * Backends (dist.h) do the communication: "fake" here, "nccl" in
 * dist_nccl.c, "mpi" (CPU tensors across processes) in dist_mpi.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"
#include "ops_common.h"

static const tt_dist_backend *tt_dist_find(const char *name) {
  if (!name || !strcmp(name, "fake")) return tt_dist_backend_fake();
  if (!strcmp(name, "nccl")) return tt_dist_backend_nccl();
  if (!strcmp(name, "mpi")) return tt_dist_backend_mpi();
  if (!strcmp(name, "local")) return tt_dist_backend_local();
  return NULL;
}

int tt_dist_backend_built(const char *name) { return tt_dist_find(name) != NULL; }

tt_status tt_group_new(const char *backend, int rank, int world, const uint8_t *unique_id, size_t id_len, int device,
                       tt_group **out) {
  *out = NULL;
  const tt_dist_backend *be = tt_dist_find(backend);
  if (!be) {
    int nccl = backend && !strcmp(backend, "nccl"), mpi = backend && !strcmp(backend, "mpi");
    return tt_error_set(nccl || mpi ? TT_ERR_UNSUPPORTED : TT_ERR_INVALID,
                        "group: backend '%s' is %s; expected fake, local, mpi or nccl", backend ? backend : "(null)",
                        nccl  ? "not built (no CUDA/NCCL in this build)"
                        : mpi ? "not built (Open MPI was not found at configure time: apt-get install libopenmpi-dev)"
                              : "unknown");
  }
  if (world < 1 || rank < 0 || rank >= world)
    return tt_error_set(TT_ERR_INVALID, "group: rank %d is not in [0, %d)", rank, world);
  tt_group *g = calloc(1, sizeof *g);
  if (!g) return tt_error_set(TT_ERR_OOM, "group: out of host memory");
  g->be = be;
  g->rank = rank;
  g->size = world;
  g->device = device;
  tt_status st = be->init ? be->init(g, unique_id, id_len) : TT_OK;
  if (st != TT_OK) {
    free(g);
    return st;
  }
  *out = g;
  return TT_OK;
}

static void tt_group_destroy(tt_group *g) {
  if (g->be->destroy) g->be->destroy(g);
  free(g);
}

void tt_group_free(tt_group *g) {
  if (!g) return;
  if (g->works > 0) {
    g->free_pending = 1; /* (tt_work_wait frees it after the last work) */
    return;
  }
  tt_group_destroy(g);
}

int tt_group_rank(const tt_group *g) { return g->rank; }
int tt_group_size(const tt_group *g) { return g->size; }
const char *tt_group_backend(const tt_group *g) { return g->be->name; }

tt_status tt_group_split(tt_group *g, int color, int key, tt_group **out) {
  *out = NULL;
  tt_group *n = calloc(1, sizeof *n);
  if (!n) return tt_error_set(TT_ERR_OOM, "group split: out of host memory");
  n->be = g->be;
  n->device = g->device;
  tt_status st = g->be->split(g, color, key, n);
  if (st != TT_OK) {
    free(n);
    return st;
  }
  *out = n;
  return TT_OK;
}

/* ---- validation ------------------------------------------------------------ */

static tt_status tt_chk_coll(const char *op, const tt_group *g, const tt_tensor *t) {
  char s[96];
  TT_TRY(tt_tensor_check_storage(op, "tensor", t));
  if (!tt_tensor_is_contiguous(t))
    return tt_error_set(TT_ERR_LAYOUT, "%s: tensor %s is not contiguous; collectives need contiguous tensors", op,
                        SHP(t, s));
  if (!strcmp(g->be->name, "nccl") && t->device.type != TT_CUDA)
    return tt_error_set(TT_ERR_DEVICE, "%s: the nccl backend needs CUDA tensors, got %s on the host", op, SHP(t, s));
  if (!strcmp(g->be->name, "mpi") && t->device.type != TT_CPU)
    return tt_error_set(TT_ERR_DEVICE, "%s: the mpi backend needs CPU tensors, got %s on %s", op, SHP(t, s),
                        t->device.type == TT_CUDA ? "a GPU (use the nccl backend)" : "the meta device");
  if (!strcmp(g->be->name, "local") && t->device.type != TT_CPU)
    return tt_error_set(TT_ERR_DEVICE, "%s: the local backend (simulated ranks) needs CPU tensors, got %s on %s", op,
                        SHP(t, s), t->device.type == TT_CUDA ? "a GPU" : "the meta device");
  return TT_OK;
}

/* out is `in` with dim 0 multiplied (gather) or divided (scatter) by the group size. */
static tt_status tt_chk_dim0(const char *op, const tt_group *g, const tt_tensor *small, const tt_tensor *big) {
  char s1[96], s2[96];
  int ok = small->ndim == big->ndim && small->ndim >= 1 && big->shape[0] == small->shape[0] * g->size &&
           small->dtype == big->dtype;
  for (int i = 1; ok && i < small->ndim; i++) ok = small->shape[i] == big->shape[i];
  if (!ok)
    return tt_error_set(TT_ERR_SHAPE, "%s: chunk %s and full %s over %d ranks; expected full dim 0 = %d x chunk dim 0",
                        op, SHP(small, s1), SHP(big, s2), g->size, g->size);
  return TT_OK;
}

static tt_status tt_chk_op(const char *name, int op) {
  if (op < TT_RED_SUM || op > TT_RED_MIN) return tt_error_set(TT_ERR_INVALID, "%s: unknown reduction %d", name, op);
  return TT_OK;
}

/* One call of kind k carrying t's bytes (after validation: a refused call counts nothing). */
static void tt_count(tt_group *g, int k, const tt_tensor *t) {
  g->calls[k]++;
  g->bytes[k] += (int64_t)(tt_tensor_numel(t) * (int64_t)tt_dtype_size(t->dtype));
}

tt_status tt_group_traffic(const tt_group *g, int64_t *calls, int64_t *bytes, int n) {
  if (!g) return tt_error_set(TT_ERR_INVALID, "group_traffic: no group");
  for (int k = 0; k < n && k < TT_COLL_KINDS; k++) {
    if (calls) calls[k] = g->calls[k];
    if (bytes) bytes[k] = g->bytes[k];
  }
  return TT_OK;
}

void tt_group_traffic_reset(tt_group *g) {
  if (!g) return;
  memset(g->calls, 0, sizeof g->calls);
  memset(g->bytes, 0, sizeof g->bytes);
}

tt_status tt_dist_all_reduce(tt_group *g, tt_tensor *t, int op) {
  TT_TRY(tt_chk_op("all_reduce", op));
  TT_TRY(tt_chk_coll("all_reduce", g, t));
  tt_count(g, TT_COLL_ALL_REDUCE, t);
  const int64_t wd = tt_watch_begin("all_reduce", g, tt_tensor_numel(t) * (int64_t)tt_dtype_size(t->dtype));
  const tt_status st = g->be->all_reduce(g, t, op);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op) {
  TT_TRY(tt_chk_op("reduce_scatter", op));
  TT_TRY(tt_chk_coll("reduce_scatter", g, in));
  TT_TRY(tt_chk_coll("reduce_scatter", g, out));
  TT_TRY(tt_chk_dim0("reduce_scatter", g, out, in));
  tt_count(g, TT_COLL_REDUCE_SCATTER, in);
  const int64_t wd = tt_watch_begin("reduce_scatter", g, tt_tensor_numel(in) * (int64_t)tt_dtype_size(in->dtype));
  const tt_status st = g->be->reduce_scatter(g, in, out, op);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  TT_TRY(tt_chk_coll("all_gather", g, in));
  TT_TRY(tt_chk_coll("all_gather", g, out));
  TT_TRY(tt_chk_dim0("all_gather", g, in, out));
  tt_count(g, TT_COLL_ALL_GATHER, out);
  const int64_t wd = tt_watch_begin("all_gather", g, tt_tensor_numel(out) * (int64_t)tt_dtype_size(out->dtype));
  const tt_status st = g->be->all_gather(g, in, out);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_broadcast(tt_group *g, tt_tensor *t, int root) {
  if (root < 0 || root >= g->size)
    return tt_error_set(TT_ERR_INVALID, "broadcast: root %d is not in [0, %d)", root, g->size);
  TT_TRY(tt_chk_coll("broadcast", g, t));
  tt_count(g, TT_COLL_BROADCAST, t);
  const int64_t wd = tt_watch_begin("broadcast", g, tt_tensor_numel(t) * (int64_t)tt_dtype_size(t->dtype));
  const tt_status st = g->be->broadcast(g, t, root);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_coll("all_to_all", g, in));
  TT_TRY(tt_chk_coll("all_to_all", g, out));
  if (tt_tensor_numel(in) != tt_tensor_numel(out) || in->dtype != out->dtype || in->ndim < 1 ||
      in->shape[0] % g->size)
    return tt_error_set(TT_ERR_SHAPE, "all_to_all: in %s and out %s; expected equal sizes and dim 0 divisible by %d",
                        SHP(in, s1), SHP(out, s2), g->size);
  tt_count(g, TT_COLL_ALL_TO_ALL, in);
  const int64_t wd = tt_watch_begin("all_to_all", g, tt_tensor_numel(in) * (int64_t)tt_dtype_size(in->dtype));
  const tt_status st = g->be->all_to_all(g, in, out);
  tt_watch_end(wd);
  return st;
}

#define TT_TAG_LIMIT (1 << 20)

static tt_status tt_chk_peer(const char *op, const tt_group *g, int peer, int tag) {
  if (peer < 0 || peer >= g->size || peer == g->rank)
    return tt_error_set(TT_ERR_INVALID, "%s: peer %d is not another rank of [0, %d) (this is rank %d)", op, peer,
                        g->size, g->rank);
  if (tag < 0 || tag >= TT_TAG_LIMIT)
    return tt_error_set(TT_ERR_INVALID, "%s: tag %d is not in [0, %d)", op, tag, TT_TAG_LIMIT);
  return TT_OK;
}

tt_status tt_dist_send(tt_group *g, const tt_tensor *t, int peer, int tag) {
  TT_TRY(tt_chk_peer("send", g, peer, tag));
  TT_TRY(tt_chk_coll("send", g, t));
  tt_count(g, TT_COLL_SEND, t);
  const int64_t wd = tt_watch_begin("send", g, tt_tensor_numel(t) * (int64_t)tt_dtype_size(t->dtype));
  const tt_status st = g->be->send(g, t, peer, tag);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_recv(tt_group *g, tt_tensor *t, int peer, int tag) {
  TT_TRY(tt_chk_peer("recv", g, peer, tag));
  TT_TRY(tt_chk_coll("recv", g, t));
  tt_count(g, TT_COLL_RECV, t);
  const int64_t wd = tt_watch_begin("recv", g, tt_tensor_numel(t) * (int64_t)tt_dtype_size(t->dtype));
  const tt_status st = g->be->recv(g, t, peer, tag);
  tt_watch_end(wd);
  return st;
}

tt_status tt_dist_barrier(tt_group *g) {
  const int64_t wd = tt_watch_begin("barrier", g, 0);
  const tt_status st = g->be->barrier(g);
  tt_watch_end(wd);
  return st;
}

void tt_group_set_label(tt_group *g, const char *label) {
  if (g) snprintf(g->label, sizeof g->label, "%s", label ? label : "");
}

struct tt_work {
  tt_group *g;
  tt_tensor *t, *t2; /* kept alive until the work completes (t2: a collective's output, or NULL) */
  tt_tensor **held;  /* a batch's tensors (nheld of them), kept alive the same way */
  int nheld;
  void *req;         /* the backend's; NULL when the work already completed */
  int coll;          /* a collective or a batch (wait_coll), else a send (wait) */
};

static tt_status isend_impl(tt_group *g, const tt_tensor *t, int peer, int tag, tt_work **out);

tt_status tt_dist_isend(tt_group *g, const tt_tensor *t, int peer, int tag, tt_work **out) {
  *out = NULL;
  TT_TRY(tt_chk_peer("isend", g, peer, tag));
  TT_TRY(tt_chk_coll("isend", g, t));
  tt_count(g, TT_COLL_SEND, t);
  return isend_impl(g, t, peer, tag, out);
}

/* A send started (validated and counted by the caller). */
static tt_status isend_impl(tt_group *g, const tt_tensor *t, int peer, int tag, tt_work **out) {
  tt_work *w = calloc(1, sizeof *w);
  if (!w) return tt_error_set(TT_ERR_OOM, "isend: out of host memory");
  w->g = g;
  tt_status st = g->be->isend ? g->be->isend(g, t, peer, tag, &w->req) : g->be->send(g, t, peer, tag);
  if (st != TT_OK) {
    free(w);
    return st;
  }
  tt_tensor_retain((tt_tensor *)t);
  w->t = (tt_tensor *)t;
  g->works++;
  *out = w;
  return TT_OK;
}

/* A collective's work, started by start(g, w) (which sets w->req, or
 * completes it at once and leaves it NULL); it keeps t and t2 alive. */
static tt_status coll_work(const char *name, tt_group *g, tt_tensor *t, tt_tensor *t2, tt_work **out,
                           tt_status (*start)(tt_group *g, tt_work *w, void *arg), void *arg) {
  tt_work *w = calloc(1, sizeof *w);
  if (!w) return tt_error_set(TT_ERR_OOM, "%s: out of host memory", name);
  w->g = g;
  w->coll = 1;
  tt_status st = start(g, w, arg);
  if (st != TT_OK) {
    free(w);
    return st;
  }
  tt_tensor_retain(t);
  w->t = t;
  if (t2) tt_tensor_retain(t2);
  w->t2 = t2;
  g->works++;
  *out = w;
  return TT_OK;
}

struct coll_args {
  const tt_tensor *in;
  tt_tensor *out;
  int op;
};

static tt_status start_all_reduce(tt_group *g, tt_work *w, void *arg) {
  struct coll_args *a = arg;
  return g->be->all_reduce_async ? g->be->all_reduce_async(g, a->out, a->op, &w->req)
                                 : g->be->all_reduce(g, a->out, a->op);
}

static tt_status start_reduce_scatter(tt_group *g, tt_work *w, void *arg) {
  struct coll_args *a = arg;
  return g->be->reduce_scatter_async ? g->be->reduce_scatter_async(g, a->in, a->out, a->op, &w->req)
                                     : g->be->reduce_scatter(g, a->in, a->out, a->op);
}

static tt_status start_all_gather(tt_group *g, tt_work *w, void *arg) {
  struct coll_args *a = arg;
  return g->be->all_gather_async ? g->be->all_gather_async(g, a->in, a->out, &w->req)
                                 : g->be->all_gather(g, a->in, a->out);
}

tt_status tt_dist_all_reduce_async(tt_group *g, tt_tensor *t, int op, tt_work **out) {
  *out = NULL;
  TT_TRY(tt_chk_op("all_reduce_async", op));
  TT_TRY(tt_chk_coll("all_reduce_async", g, t));
  tt_count(g, TT_COLL_ALL_REDUCE, t);
  struct coll_args a = { NULL, t, op };
  return coll_work("all_reduce_async", g, t, NULL, out, start_all_reduce, &a);
}

tt_status tt_dist_reduce_scatter_async(tt_group *g, const tt_tensor *in, tt_tensor *out, int op, tt_work **w) {
  *w = NULL;
  TT_TRY(tt_chk_op("reduce_scatter_async", op));
  TT_TRY(tt_chk_coll("reduce_scatter_async", g, in));
  TT_TRY(tt_chk_coll("reduce_scatter_async", g, out));
  TT_TRY(tt_chk_dim0("reduce_scatter_async", g, out, in));
  tt_count(g, TT_COLL_REDUCE_SCATTER, in);
  struct coll_args a = { in, out, op };
  return coll_work("reduce_scatter_async", g, (tt_tensor *)in, out, w, start_reduce_scatter, &a);
}

tt_status tt_dist_all_gather_async(tt_group *g, const tt_tensor *in, tt_tensor *out, tt_work **w) {
  *w = NULL;
  TT_TRY(tt_chk_coll("all_gather_async", g, in));
  TT_TRY(tt_chk_coll("all_gather_async", g, out));
  TT_TRY(tt_chk_dim0("all_gather_async", g, in, out));
  tt_count(g, TT_COLL_ALL_GATHER, out);
  struct coll_args a = { in, out, 0 };
  return coll_work("all_gather_async", g, (tt_tensor *)in, out, w, start_all_gather, &a);
}

tt_status tt_work_wait(tt_work *w) {
  if (!w) return TT_OK;
  tt_status st = TT_OK;
  const int64_t wd = w->req ? tt_watch_begin(w->coll ? "wait (collective)" : "wait (send)", w->g, 0) : -1;
  if (w->req && w->coll) st = w->g->be->wait_coll(w->g, w->req);
  else if (w->req && w->g->be->wait) st = w->g->be->wait(w->g, w->req);
  tt_watch_end(wd);
  tt_tensor_release(w->t);
  if (w->t2) tt_tensor_release(w->t2);
  for (int i = 0; i < w->nheld; i++) tt_tensor_release(w->held[i]);
  free(w->held);
  tt_group *g = w->g;
  free(w);
  if (--g->works == 0 && g->free_pending) tt_group_destroy(g);
  return st;
}

static tt_status tt_chk_batch(const char *name, tt_group *g, int n, const int *is_send, tt_tensor *const *ts,
                              const int *peers, const int *tags) {
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "%s: %d operations", name, n);
  char op[64];
  for (int i = 0; i < n; i++) {
    snprintf(op, sizeof op, "%s %s", name, is_send[i] ? "send" : "recv");
    TT_TRY(tt_chk_peer(op, g, peers[i], tags[i]));
    TT_TRY(tt_chk_coll(op, g, ts[i]));
  }
  return TT_OK;
}

static void tt_count_batch(tt_group *g, int n, const int *is_send, tt_tensor *const *ts) {
  for (int i = 0; i < n; i++) tt_count(g, is_send[i] ? TT_COLL_SEND : TT_COLL_RECV, ts[i]);
}

static tt_status batch_p2p_impl(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                const int *tags);

tt_status tt_dist_batch_p2p_async(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                  const int *tags, tt_work **out) {
  *out = NULL;
  TT_TRY(tt_chk_batch("batch_p2p_async", g, n, is_send, ts, peers, tags));
  tt_count_batch(g, n, is_send, ts);
  tt_work *w = calloc(1, sizeof *w);
  tt_tensor **held = calloc((size_t)(n > 0 ? n : 1), sizeof *held);
  if (!w || !held) {
    free(w);
    free(held);
    return tt_error_set(TT_ERR_OOM, "batch_p2p_async: out of host memory");
  }
  w->g = g;
  w->coll = 1;
  tt_status st = g->be->batch_p2p_async ? g->be->batch_p2p_async(g, n, is_send, ts, peers, tags, &w->req)
                                        : batch_p2p_impl(g, n, is_send, ts, peers, tags);
  if (st != TT_OK) {
    free(held);
    free(w);
    return st;
  }
  for (int i = 0; i < n; i++) {
    tt_tensor_retain(ts[i]);
    held[i] = ts[i];
  }
  w->held = held;
  w->nheld = n;
  g->works++;
  *out = w;
  return TT_OK;
}

tt_status tt_dist_batch_p2p(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                            const int *tags) {
  TT_TRY(tt_chk_batch("batch_p2p", g, n, is_send, ts, peers, tags));
  tt_count_batch(g, n, is_send, ts);
  const int64_t wd = tt_watch_begin("batch_p2p", g, 0);
  const tt_status st = batch_p2p_impl(g, n, is_send, ts, peers, tags);
  tt_watch_end(wd);
  return st;
}

/* The batch, validated and counted by the caller. */
static tt_status batch_p2p_impl(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                const int *tags) {
  if (g->be->batch_p2p) return g->be->batch_p2p(g, n, is_send, ts, peers, tags);
  /* sends started first, so that no receive waits on a send of this rank */
  tt_work **works = calloc((size_t)(n > 0 ? n : 1), sizeof *works);
  if (!works) return tt_error_set(TT_ERR_OOM, "batch_p2p: out of host memory");
  tt_status st = TT_OK;
  for (int i = 0; i < n && st == TT_OK; i++)
    if (is_send[i]) st = isend_impl(g, ts[i], peers[i], tags[i], &works[i]);
  for (int i = 0; i < n && st == TT_OK; i++)
    if (!is_send[i]) st = g->be->recv(g, ts[i], peers[i], tags[i]);
  for (int i = 0; i < n; i++) {
    tt_status w = tt_work_wait(works[i]); /* (its own watch replaces batch_p2p's: one call in flight) */ /* (every work is waited for and freed, also after a failure) */
    if (st == TT_OK) st = w;
  }
  free(works);
  return st;
}

/* ---- the fake backend ---------------------------------------------------------
 * One process standing for rank r of N, for dry runs and layouts worked out
 * offline (titan estimate, the REPL, --dry-run): every rank is assumed to
 * hold the same data as this one, so results have the right shapes and are
 * exact when N = 1 (sum over N identical copies = N x local; avg = local;
 * on the meta device nothing is computed at all). Sends go nowhere and a
 * receive leaves its buffer as it is, so a pipeline's schedule runs
 * through. While a dry run is on (tt_dist_fake_dry: titan estimate) the
 * collectives do no arithmetic at all: a sum is this rank's values, as the
 * sizes a rank derives from them (expert parallelism's rows) must be. */

static int tt_fake_dry;

int tt_dist_fake_dry(int on) { return __atomic_exchange_n(&tt_fake_dry, on ? 1 : 0, __ATOMIC_ACQ_REL); }

static tt_status fake_init(tt_group *g, const uint8_t *id, size_t n) {
  (void)g, (void)id, (void)n;
  return TT_OK;
}

static tt_status fake_split(tt_group *g, int color, int key, tt_group *out) {
  (void)color;
  (void)key;
  out->rank = 0; /* only this process is known: it forms a group of one */
  out->size = 1;
  (void)g;
  return TT_OK;
}

static tt_status fake_all_reduce(tt_group *g, tt_tensor *t, int op) {
  if (op == TT_RED_SUM && g->size > 1 && !__atomic_load_n(&tt_fake_dry, __ATOMIC_ACQUIRE)) {
    tt_tensor *out = t;
    return tt_op_unary(TT_SCALE, t, (double)g->size, &out);
  }
  return TT_OK;
}

static tt_status fake_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op) {
  tt_tensor *chunk = NULL;
  TT_TRY(tt_view_narrow(in, 0, (int64_t)g->rank * out->shape[0], out->shape[0], &chunk));
  tt_status st = tt_tensor_copy(out, chunk);
  tt_tensor_release(chunk);
  if (st == TT_OK) st = fake_all_reduce(g, out, op);
  return st;
}

static tt_status fake_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  for (int r = 0; r < g->size; r++) {
    tt_tensor *slot = NULL;
    TT_TRY(tt_view_narrow(out, 0, (int64_t)r * in->shape[0], in->shape[0], &slot));
    tt_status st = tt_tensor_copy(slot, in);
    tt_tensor_release(slot);
    TT_TRY(st);
  }
  return TT_OK;
}

static tt_status fake_broadcast(tt_group *g, tt_tensor *t, int root) {
  (void)g, (void)t, (void)root;
  return TT_OK;
}

static tt_status fake_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  (void)g;
  return tt_tensor_copy(out, in);
}

static tt_status fake_send(tt_group *g, const tt_tensor *t, int peer, int tag) {
  (void)g, (void)t, (void)peer, (void)tag;
  return TT_OK;
}
static tt_status fake_recv(tt_group *g, tt_tensor *t, int peer, int tag) {
  (void)g, (void)t, (void)peer, (void)tag;
  return TT_OK;
}

static tt_status fake_barrier(tt_group *g) {
  (void)g;
  return TT_OK;
}

static const tt_dist_backend tt_fake = {
    .name = "fake",
    .init = fake_init,
    .split = fake_split,
    .all_reduce = fake_all_reduce,
    .reduce_scatter = fake_reduce_scatter,
    .all_gather = fake_all_gather,
    .broadcast = fake_broadcast,
    .all_to_all = fake_all_to_all,
    .send = fake_send,
    .recv = fake_recv,
    .barrier = fake_barrier,
};

const tt_dist_backend *tt_dist_backend_fake(void) { return &tt_fake; }

#ifndef TITAN_HAVE_MPI
const tt_dist_backend *tt_dist_backend_mpi(void) { return NULL; }
const char *tt_dist_mpi_info(void) { return "not built (Open MPI was not found at configure time)"; }
void tt_dist_shutdown(int failed) { (void)failed; }
#endif

#ifndef TITAN_HAVE_CUDA
const tt_dist_backend *tt_dist_backend_nccl(void) { return NULL; }
tt_status tt_dist_unique_id(uint8_t *out, size_t cap, size_t *len) {
  (void)out, (void)cap;
  *len = 0;
  return tt_error_set(TT_ERR_UNSUPPORTED, "dist: NCCL is not built in (configure with TITAN_CUDA=ON)");
}
#endif
