/*
 * dist_local.c — the "local" collectives backend: the ranks of a job
 * simulated in this process (engine/sim.c, `titan --simulate N`), each with
 * its own Lua state, exchange CPU tensors through host memory.
 *
 * A collective is carried out by the last rank of the group to reach it,
 * for every rank of the group, while the others wait in the scheduler; the
 * reductions add rank 0's values, then rank 1's, ... (dist_reduce.c, as the
 * mpi backend does), so a simulated job's numbers are the bits of the same
 * job over Open MPI. Sends are buffered (a copy waits in the group's mailbox
 * for its receive), which MPI also allows. Every rank of a group must call
 * the same collectives in the same order with the same sizes: a mismatch
 * stops the job with a line naming both sides, where MPI would hang or
 * corrupt.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist.h"
#include "ops_common.h"
#include "sim.h"

typedef struct lmsg {
  struct lmsg *next;
  int src, dst, tag, dtype;
  int64_t numel;
  char data[];
} lmsg;

enum { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_BROADCAST, K_ALL_TO_ALL, K_BARRIER, K_SPLIT };
static const char *kind_name[] = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
                                   "barrier", "split" };

struct lcomm;
typedef struct {
  const tt_tensor *in;
  tt_tensor *out;
  int op, root, color, key;
  int done;
  tt_status st;
  struct lcomm *made; /* split: the new group's communicator, and this rank's place in it */
  int made_rank;
} lslot;

typedef struct lcomm {
  int size, refs;
  int *members; /* simulated rank of each group rank */
  int arrived, kind;
  lslot *slots;
  lmsg *mail, **mail_tail;
  char err[512];
} lcomm;

typedef struct {
  lcomm *c;
} tt_local;

static lcomm *comm(tt_group *g) { return ((tt_local *)g->impl)->c; }

static lcomm *lcomm_new(int size) {
  lcomm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->size = size;
  c->members = calloc((size_t)size, sizeof *c->members);
  c->slots = calloc((size_t)size, sizeof *c->slots);
  if (!c->members || !c->slots) {
    free(c->members);
    free(c->slots);
    free(c);
    return NULL;
  }
  c->mail_tail = &c->mail;
  return c;
}

static void lcomm_release(lcomm *c) {
  if (!c || --c->refs > 0) return;
  for (lmsg *m = c->mail, *n; m; m = n) {
    n = m->next;
    free(m);
  }
  free(c->members);
  free(c->slots);
  free(c);
}

/* The world communicators of the running simulation: the k-th group a rank
 * makes with tt_group_new joins the k-th one (as MPI_Comm_dup of the world). */
static struct {
  unsigned long generation;
  lcomm **worlds;
  int nworlds, *made; /* made[r]: how many rank r has joined */
  int *joined;        /* joined[k]: how many ranks have joined worlds[k] */
  int world;          /* the simulation's ranks (every world communicator's size) */
} W;

/* The registry holds a reference to each world communicator until every
 * rank has joined it: a rank that is done with it (its group freed) must
 * not free it before a slower rank joins. */
static void registry_drop(void) {
  for (int k = 0; k < W.nworlds; k++)
    if (W.joined[k] < W.world) lcomm_release(W.worlds[k]); /* (a fully joined one may be gone: not read) */
  free(W.worlds);
  free(W.made);
  free(W.joined);
  W.worlds = NULL;
  W.made = W.joined = NULL;
  W.nworlds = 0;
}

static tt_status local_init(tt_group *g, const uint8_t *id, size_t id_len) {
  (void)id, (void)id_len;
  int world = tt_sim_world(), rank = tt_sim_rank();
  if (world == 0)
    return tt_error_set(TT_ERR_INVALID, "local: the local backend joins the ranks of a simulated job; run under "
                        "titan --simulate N (or tt_sim_run)");
  if (g->size != world || g->rank != rank)
    return tt_error_set(TT_ERR_INVALID, "local: the group was asked for rank %d of %d, but this is simulated rank %d "
                        "of %d", g->rank, g->size, rank, world);
  if (W.generation != tt_sim_generation()) {
    /* another simulation's groups keep their communicators (freed with them) */
    registry_drop();
    W.made = calloc((size_t)world, sizeof *W.made);
    W.world = world;
    if (!W.made) return tt_error_set(TT_ERR_OOM, "local: out of host memory");
    W.generation = tt_sim_generation();
  }
  int k = W.made[rank];
  if (k == W.nworlds) {
    lcomm **grown = realloc(W.worlds, (size_t)(k + 1) * sizeof *grown);
    if (!grown) return tt_error_set(TT_ERR_OOM, "local: out of host memory");
    W.worlds = grown;
    int *joined = realloc(W.joined, (size_t)(k + 1) * sizeof *joined);
    if (!joined) return tt_error_set(TT_ERR_OOM, "local: out of host memory");
    W.joined = joined;
    lcomm *c = lcomm_new(world);
    if (!c) return tt_error_set(TT_ERR_OOM, "local: out of host memory for a group of %d", world);
    for (int r = 0; r < world; r++) c->members[r] = r;
    c->refs = 1; /* the registry's */
    W.joined[W.nworlds] = 0;
    W.worlds[W.nworlds++] = c;
  }
  tt_local *l = calloc(1, sizeof *l);
  if (!l) return tt_error_set(TT_ERR_OOM, "local: out of host memory");
  l->c = W.worlds[k];
  l->c->refs++;
  W.made[rank]++;
  if (++W.joined[k] == l->c->size) lcomm_release(l->c); /* every rank holds it now */
  g->impl = l;
  return TT_OK;
}

static void local_destroy(tt_group *g) {
  tt_local *l = g->impl;
  if (!l) return;
  lcomm_release(l->c);
  free(l);
  g->impl = NULL;
}

/* "[0,2,4]" (or "[0-3]" for a run) into buf: the group's simulated ranks. */
static const char *members_str(const lcomm *c, char *buf, size_t cap) {
  int run = 1;
  for (int i = 1; i < c->size; i++) run &= c->members[i] == c->members[0] + i;
  if (run && c->size > 2) {
    snprintf(buf, cap, "[%d-%d]", c->members[0], c->members[c->size - 1]);
    return buf;
  }
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < c->size && n + 16 < cap; i++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%d", i ? "," : "", c->members[i]);
  if (n + 16 >= cap) n += (size_t)snprintf(buf + n, cap - n, ",...");
  snprintf(buf + n, cap - n, "]");
  return buf;
}

static char *data_of(const tt_tensor *t) { return t ? tt_tensor_data(t) : NULL; }

/* The collectives themselves, run once every rank's slot is filled. ---------- */

static tt_status fail(lcomm *c, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static tt_status fail(lcomm *c, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
  return tt_error_set(status, "%s", c->err);
}

/* Every rank's tensor (in, or out when in is NULL) of the same size and dtype. */
static tt_status same_sizes(lcomm *c, const char *name, int use_out) {
  const tt_tensor *t0 = use_out ? c->slots[0].out : c->slots[0].in;
  for (int r = 1; r < c->size; r++) {
    const tt_tensor *t = use_out ? c->slots[r].out : c->slots[r].in;
    if (tt_tensor_numel(t) != tt_tensor_numel(t0) || t->dtype != t0->dtype) {
      char a[96], b[96];
      return fail(c, TT_ERR_SHAPE, "%s: group rank %d gave %s %s but group rank 0 gave %s %s; expected the same size "
                  "and dtype on every rank", name, r, SHP(t, a), tt_dtype_name(t->dtype), SHP(t0, b),
                  tt_dtype_name(t0->dtype));
    }
  }
  return TT_OK;
}

static int any_meta(lcomm *c) {
  for (int r = 0; r < c->size; r++) {
    const lslot *s = &c->slots[r];
    if ((s->in && !data_of(s->in)) || (s->out && !data_of(s->out))) return 1;
  }
  return 0;
}

static tt_status ex_all_reduce(lcomm *c) {
  TT_TRY(same_sizes(c, "all_reduce", 1));
  const tt_tensor *t0 = c->slots[0].out;
  int op = c->slots[0].op;
  for (int r = 1; r < c->size; r++)
    if (c->slots[r].op != op)
      return fail(c, TT_ERR_INVALID, "all_reduce: group rank %d reduces with op %d, group rank 0 with op %d", r,
                  c->slots[r].op, op);
  if (tt_dist_reduce_check("all_reduce", t0->dtype, op) != TT_OK) return fail(c, TT_ERR_DTYPE, "%s", tt_last_error());
  if (any_meta(c)) return TT_OK;
  int64_t n = tt_tensor_numel(t0);
  size_t bytes = (size_t)n * tt_dtype_size(t0->dtype);
  char *acc = malloc(bytes ? bytes : 1);
  if (!acc) return fail(c, TT_ERR_OOM, "all_reduce: out of host memory for %zu bytes", bytes);
  memcpy(acc, data_of(t0), bytes);
  for (int r = 1; r < c->size; r++) tt_dist_reduce_into(acc, data_of(c->slots[r].out), n, t0->dtype, op);
  tt_dist_reduce_finish(acc, n, t0->dtype, op, c->size);
  for (int r = 0; r < c->size; r++) memcpy(data_of(c->slots[r].out), acc, bytes);
  free(acc);
  return TT_OK;
}

static tt_status ex_reduce_scatter(lcomm *c) {
  TT_TRY(same_sizes(c, "reduce_scatter", 0));
  const tt_tensor *in0 = c->slots[0].in;
  int op = c->slots[0].op;
  if (tt_dist_reduce_check("reduce_scatter", in0->dtype, op) != TT_OK)
    return fail(c, TT_ERR_DTYPE, "%s", tt_last_error());
  if (any_meta(c)) return TT_OK;
  int64_t m = tt_tensor_numel(c->slots[0].out);
  size_t esz = tt_dtype_size(in0->dtype), bytes = (size_t)m * esz * (size_t)c->size;
  char *acc = malloc(bytes ? bytes : 1); /* every rank's result first: an out may share memory with an in */
  if (!acc) return fail(c, TT_ERR_OOM, "reduce_scatter: out of host memory for %zu bytes", bytes);
  for (int j = 0; j < c->size; j++) {
    char *a = acc + (size_t)j * (size_t)m * esz;
    memcpy(a, data_of(in0) + (size_t)j * (size_t)m * esz, (size_t)m * esz);
    for (int r = 1; r < c->size; r++)
      tt_dist_reduce_into(a, data_of(c->slots[r].in) + (size_t)j * (size_t)m * esz, m, in0->dtype, op);
    tt_dist_reduce_finish(a, m, in0->dtype, op, c->size);
  }
  for (int j = 0; j < c->size; j++)
    memcpy(data_of(c->slots[j].out), acc + (size_t)j * (size_t)m * esz, (size_t)m * esz);
  free(acc);
  return TT_OK;
}

static tt_status ex_all_gather(lcomm *c) {
  TT_TRY(same_sizes(c, "all_gather", 0));
  if (any_meta(c)) return TT_OK;
  size_t piece = (size_t)tt_tensor_numel(c->slots[0].in) * tt_dtype_size(c->slots[0].in->dtype);
  size_t bytes = piece * (size_t)c->size;
  char *all = malloc(bytes ? bytes : 1); /* (an in may be a slice of its rank's out) */
  if (!all) return fail(c, TT_ERR_OOM, "all_gather: out of host memory for %zu bytes", bytes);
  for (int r = 0; r < c->size; r++) memcpy(all + (size_t)r * piece, data_of(c->slots[r].in), piece);
  for (int r = 0; r < c->size; r++) memcpy(data_of(c->slots[r].out), all, bytes);
  free(all);
  return TT_OK;
}

static tt_status ex_broadcast(lcomm *c) {
  TT_TRY(same_sizes(c, "broadcast", 1));
  int root = c->slots[0].root;
  for (int r = 1; r < c->size; r++)
    if (c->slots[r].root != root)
      return fail(c, TT_ERR_INVALID, "broadcast: group rank %d names root %d, group rank 0 root %d", r,
                  c->slots[r].root, root);
  if (any_meta(c)) return TT_OK;
  size_t bytes = (size_t)tt_tensor_numel(c->slots[root].out) * tt_dtype_size(c->slots[root].out->dtype);
  for (int r = 0; r < c->size; r++)
    if (r != root) memcpy(data_of(c->slots[r].out), data_of(c->slots[root].out), bytes);
  return TT_OK;
}

static tt_status ex_all_to_all(lcomm *c) {
  TT_TRY(same_sizes(c, "all_to_all", 0));
  if (any_meta(c)) return TT_OK;
  int n = c->size;
  size_t chunk = (size_t)tt_tensor_numel(c->slots[0].in) / (size_t)n * tt_dtype_size(c->slots[0].in->dtype);
  size_t bytes = chunk * (size_t)n * (size_t)n;
  char *all = malloc(bytes ? bytes : 1);
  if (!all) return fail(c, TT_ERR_OOM, "all_to_all: out of host memory for %zu bytes", bytes);
  /* rank j's out, chunk r = rank r's in, chunk j */
  for (int j = 0; j < n; j++)
    for (int r = 0; r < n; r++)
      memcpy(all + ((size_t)j * (size_t)n + (size_t)r) * chunk, data_of(c->slots[r].in) + (size_t)j * chunk, chunk);
  for (int j = 0; j < n; j++) memcpy(data_of(c->slots[j].out), all + (size_t)j * (size_t)n * chunk, chunk * (size_t)n);
  free(all);
  return TT_OK;
}

static tt_status ex_barrier(lcomm *c) {
  (void)c;
  return TT_OK;
}

/* MPI_Comm_split: one new communicator per color >= 0, its ranks ordered by
 * (key, old rank). */
static tt_status ex_split(lcomm *c) {
  int n = c->size;
  int *order = malloc((size_t)n * sizeof *order);
  if (!order) return fail(c, TT_ERR_OOM, "group split: out of host memory");
  for (int r = 0; r < n; r++) c->slots[r].made = NULL;
  for (int r = 0; r < n; r++) {
    if (c->slots[r].color < 0 || c->slots[r].made) continue;
    int color = c->slots[r].color, k = 0;
    for (int q = 0; q < n; q++)
      if (c->slots[q].color == color) order[k++] = q;
    /* (insertion sort by key, stable: ties keep the old order) */
    for (int i = 1; i < k; i++)
      for (int j = i; j > 0 && c->slots[order[j - 1]].key > c->slots[order[j]].key; j--) {
        int t = order[j];
        order[j] = order[j - 1];
        order[j - 1] = t;
      }
    lcomm *nc = lcomm_new(k);
    if (!nc) {
      free(order);
      return fail(c, TT_ERR_OOM, "group split: out of host memory for a group of %d", k);
    }
    nc->refs = k;
    for (int i = 0; i < k; i++) {
      nc->members[i] = c->members[order[i]];
      c->slots[order[i]].made = nc;
      c->slots[order[i]].made_rank = i;
    }
  }
  free(order);
  return TT_OK;
}

typedef tt_status (*ex_fn)(lcomm *c);
static const ex_fn executors[] = { ex_all_reduce, ex_reduce_scatter, ex_all_gather, ex_broadcast,
                                   ex_all_to_all, ex_barrier, ex_split };

/* This rank reaches a collective: fill its slot; the last to arrive runs it
 * for all; the others wait until it has. */
static tt_status collective(tt_group *g, int kind, const lslot *mine, lslot *result) {
  lcomm *c = comm(g);
  int me = g->rank;
  char ms[96];
  if (c->arrived > 0 && c->kind != kind)
    return tt_error_set(TT_ERR_INVALID, "%s: simulated rank %d calls %s on the group of ranks %s while other ranks of "
                        "it wait in %s; every rank of a group must call the same collectives in the same order",
                        kind_name[kind], c->members[me], kind_name[kind], members_str(c, ms, sizeof ms),
                        kind_name[c->kind]);
  c->slots[me] = *mine;
  c->slots[me].done = 0;
  if (c->arrived++ == 0) c->kind = kind;
  if (c->arrived == c->size) {
    c->err[0] = 0;
    tt_status st = executors[kind](c);
    for (int r = 0; r < c->size; r++) {
      c->slots[r].st = st;
      c->slots[r].done = 1;
    }
    c->arrived = 0;
  } else {
    char what[192];
    snprintf(what, sizeof what, "waits in %s on the group of ranks %s", kind_name[kind], members_str(c, ms, sizeof ms));
    while (!c->slots[me].done) tt_sim_block(what);
    tt_sim_unblocked();
  }
  *result = c->slots[me];
  c->slots[me].done = 0;
  if (result->st != TT_OK) return tt_error_set(result->st, "%s", c->err);
  return TT_OK;
}

static tt_status local_split(tt_group *g, int color, int key, tt_group *out) {
  lslot s = { .color = color, .key = key }, r;
  TT_TRY(collective(g, K_SPLIT, &s, &r));
  if (!r.made)
    return tt_error_set(TT_ERR_INVALID, "group split: color %d leaves rank %d in no group; expected a color >= 0",
                        color, g->rank);
  tt_local *l = calloc(1, sizeof *l);
  if (!l) {
    lcomm_release(r.made);
    return tt_error_set(TT_ERR_OOM, "local: out of host memory");
  }
  l->c = r.made;
  out->impl = l;
  out->rank = r.made_rank;
  out->size = r.made->size;
  return TT_OK;
}

static tt_status local_all_reduce(tt_group *g, tt_tensor *t, int op) {
  lslot s = { .out = t, .op = op }, r;
  return collective(g, K_ALL_REDUCE, &s, &r);
}

static tt_status local_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op) {
  lslot s = { .in = in, .out = out, .op = op }, r;
  return collective(g, K_REDUCE_SCATTER, &s, &r);
}

static tt_status local_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  lslot s = { .in = in, .out = out }, r;
  return collective(g, K_ALL_GATHER, &s, &r);
}

static tt_status local_broadcast(tt_group *g, tt_tensor *t, int root) {
  lslot s = { .out = t, .root = root }, r;
  return collective(g, K_BROADCAST, &s, &r);
}

static tt_status local_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out) {
  lslot s = { .in = in, .out = out }, r;
  return collective(g, K_ALL_TO_ALL, &s, &r);
}

static tt_status local_barrier(tt_group *g) {
  lslot s = { 0 }, r;
  return collective(g, K_BARRIER, &s, &r);
}

static tt_status local_send(tt_group *g, const tt_tensor *t, int peer, int tag) {
  lcomm *c = comm(g);
  size_t bytes = (size_t)tt_tensor_numel(t) * tt_dtype_size(t->dtype);
  lmsg *m = malloc(sizeof *m + (bytes ? bytes : 1));
  if (!m) return tt_error_set(TT_ERR_OOM, "send: out of host memory for a message of %zu bytes", bytes);
  m->next = NULL;
  m->src = g->rank;
  m->dst = peer;
  m->tag = tag;
  m->dtype = t->dtype;
  m->numel = tt_tensor_numel(t);
  if (bytes && data_of(t)) memcpy(m->data, data_of(t), bytes);
  *c->mail_tail = m;
  c->mail_tail = &m->next;
  return TT_OK;
}

static tt_status local_recv(tt_group *g, tt_tensor *t, int peer, int tag) {
  lcomm *c = comm(g);
  lmsg **at = NULL;
  char what[192], ms[96];
  snprintf(what, sizeof what, "waits to receive from group rank %d (tag %d) in the group of ranks %s", peer, tag,
           members_str(c, ms, sizeof ms));
  for (;;) {
    for (at = &c->mail; *at; at = &(*at)->next)
      if ((*at)->src == peer && (*at)->dst == g->rank && (*at)->tag == tag) break;
    if (*at) break;
    tt_sim_block(what);
  }
  tt_sim_unblocked();
  lmsg *m = *at;
  *at = m->next;
  if (c->mail_tail == &m->next) c->mail_tail = at;
  tt_status st = TT_OK;
  if (m->numel != tt_tensor_numel(t) || m->dtype != t->dtype) {
    char s[96];
    st = tt_error_set(TT_ERR_SHAPE, "recv: group rank %d sent %lld elements of %s (tag %d) but group rank %d receives "
                      "%s %s; expected the same size and dtype", peer, (long long)m->numel, tt_dtype_name(m->dtype),
                      tag, g->rank, SHP(t, s), tt_dtype_name(t->dtype));
  } else if (data_of(t)) {
    memcpy(data_of(t), m->data, (size_t)m->numel * tt_dtype_size(m->dtype));
  }
  free(m);
  return st;
}

static const tt_dist_backend tt_local_backend = {
    .name = "local",
    .init = local_init,
    .destroy = local_destroy,
    .split = local_split,
    .all_reduce = local_all_reduce,
    .reduce_scatter = local_reduce_scatter,
    .all_gather = local_all_gather,
    .broadcast = local_broadcast,
    .all_to_all = local_all_to_all,
    .send = local_send,
    .recv = local_recv,
    .barrier = local_barrier,
};

const tt_dist_backend *tt_dist_backend_local(void) { return &tt_local_backend; }
