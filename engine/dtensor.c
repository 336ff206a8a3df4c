/*
 * dtensor.c — the placement math of the device mesh, in one place: which
 * box of a global tensor a mesh coordinate holds (torch.chunk's uneven
 * rule, several mesh dims nesting on one tensor dim), who holds a given
 * box (checkpoint loading, HF import), and redistribute as a plan of
 * collectives and its execution on local pieces. Placements are metadata
 * on ordinary local tensors (DESIGN.md, "Device mesh and placements"), so
 * nothing here wraps a tensor: callers pass the local piece and the
 * placements, and get a local piece back.
 *
 * The planner follows PyTorch DTensor's _gen_transform_infos, generalized
 * from "mesh dims nest left to right" to an explicit nesting `order`: with
 * a sharded source it walks the mesh dims innermost first, turning a
 * target Shard whose outer shards of the same tensor dim differ between
 * source and target into Replicate (a gather that clears the nesting),
 * then walks outermost first for the shards still missing. Every step it
 * emits then works on pieces that all ranks of its group cut from one
 * common parent piece, which is what lets a collective over one mesh dim
 * run on dim 0 of equal chunks.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "ops_common.h"

#define TT_MAX_MESH 8
/* A mesh dim takes at most two steps (Shard -> Partial is a gather and a
 * partial; a Shard cleared innermost-first and re-cut outermost-first is a
 * gather and a chunk). */
#define TT_MAX_STEPS (2 * TT_MAX_MESH)

static const char *red_name(int op) {
  switch (op) {
    case TT_RED_SUM: return "sum";
    case TT_RED_AVG: return "avg";
    case TT_RED_MAX: return "max";
    case TT_RED_MIN: return "min";
    default: return "?";
  }
}

/* "Shard(1)", "Replicate()", "Partial(sum)" into buf (for messages). */
static const char *pl_str(const tt_placement *p, char *buf, size_t len) {
  if (p->kind == TT_PLACE_SHARD) snprintf(buf, len, "Shard(%d)", p->dim);
  else if (p->kind == TT_PLACE_PARTIAL) snprintf(buf, len, "Partial(%s)", red_name(p->op));
  else snprintf(buf, len, "Replicate()");
  return buf;
}

static int pl_is_shard(const tt_placement *p, int dim) { return p->kind == TT_PLACE_SHARD && p->dim == dim; }

/* Equal as placements: fields a kind does not use are ignored. */
static int pl_eq(const tt_placement *a, const tt_placement *b) {
  if (a->kind != b->kind) return 0;
  if (a->kind == TT_PLACE_SHARD) return a->dim == b->dim;
  if (a->kind == TT_PLACE_PARTIAL) return a->op == b->op;
  return 1;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Piece i of k of a length-n run, as torch.chunk cuts it: chunks of
 * ceil(n / k), the last ones short or empty; an empty piece starts at n, so
 * offsets stay inside the parent whatever the coordinate. */
static void chunk_piece(int64_t n, int k, int i, int64_t *start, int64_t *len) {
  int64_t c = ceil_div(n, k), s = (int64_t)i * c, e = s + c;
  if (s > n) s = n;
  if (e > n) e = n;
  *start = s;
  *len = e - s;
}

/* ---- validation -------------------------------------------------------------- */

static tt_status chk_global(const char *op, int ndim, const int64_t *global) {
  if (ndim < 0 || ndim > TT_MAX_DIMS)
    return tt_error_set(TT_ERR_INVALID, "%s: the tensor has %d dims; expected 0 to %d", op, ndim, TT_MAX_DIMS);
  if (ndim > 0 && !global)
    return tt_error_set(TT_ERR_INVALID, "%s: the global shape is NULL; expected %d sizes", op, ndim);
  for (int d = 0; d < ndim; d++)
    if (global[d] < 0)
      return tt_error_set(TT_ERR_INVALID, "%s: global size %lld in dim %d; expected >= 0", op, (long long)global[d],
                          d);
  return TT_OK;
}

static tt_status chk_mesh(const char *op, int mesh_ndim, const int *mesh_shape) {
  if (mesh_ndim < 1 || mesh_ndim > TT_MAX_MESH)
    return tt_error_set(TT_ERR_INVALID, "%s: the mesh has %d dims; expected 1 to %d", op, mesh_ndim, TT_MAX_MESH);
  if (!mesh_shape) return tt_error_set(TT_ERR_INVALID, "%s: the mesh shape is NULL; expected %d sizes", op, mesh_ndim);
  int64_t world = 1;
  for (int m = 0; m < mesh_ndim; m++) {
    if (mesh_shape[m] < 1)
      return tt_error_set(TT_ERR_INVALID, "%s: mesh dim %d has size %d; expected >= 1", op, m, mesh_shape[m]);
    world *= mesh_shape[m];
    if (world > INT_MAX)
      return tt_error_set(TT_ERR_INVALID, "%s: the mesh holds more than %d ranks; expected a world that fits an int",
                          op, INT_MAX);
  }
  return TT_OK;
}

static tt_status chk_coord(const char *op, int mesh_ndim, const int *mesh_shape, const int *coord) {
  if (!coord)
    return tt_error_set(TT_ERR_INVALID, "%s: the mesh coordinate is NULL; expected %d indices", op, mesh_ndim);
  for (int m = 0; m < mesh_ndim; m++)
    if (coord[m] < 0 || coord[m] >= mesh_shape[m])
      return tt_error_set(TT_ERR_INDEX, "%s: coordinate %d along mesh dim %d; expected one in [0, %d)", op, coord[m],
                          m, mesh_shape[m]);
  return TT_OK;
}

/* ndim < 0: the tensor's rank is unknown here (the planner), so a Shard
 * dim is only checked against the most a tensor can have. */
static tt_status chk_placements(const char *op, const char *name, int mesh_ndim, const tt_placement *pl, int ndim) {
  if (!pl) return tt_error_set(TT_ERR_INVALID, "%s: %s is NULL; expected %d placements", op, name, mesh_ndim);
  for (int m = 0; m < mesh_ndim; m++) {
    const tt_placement *p = &pl[m];
    if (p->kind == TT_PLACE_SHARD) {
      if (ndim < 0 && (p->dim < 0 || p->dim >= TT_MAX_DIMS))
        return tt_error_set(TT_ERR_INVALID, "%s: %s[%d] is Shard(%d); expected a tensor dim in [0, %d)", op, name, m,
                            p->dim, TT_MAX_DIMS);
      if (ndim >= 0 && (p->dim < 0 || p->dim >= ndim))
        return tt_error_set(TT_ERR_INVALID,
                            "%s: %s[%d] is Shard(%d) but the tensor has %d dims; expected a dim in [0, %d)", op,
                            name, m, p->dim, ndim, ndim);
    } else if (p->kind == TT_PLACE_PARTIAL) {
      if (p->op < TT_RED_SUM || p->op > TT_RED_MIN)
        return tt_error_set(TT_ERR_INVALID, "%s: %s[%d] is Partial with reduction %d; expected sum, avg, max or min",
                            op, name, m, p->op);
    } else if (p->kind != TT_PLACE_REPLICATE) {
      return tt_error_set(TT_ERR_INVALID, "%s: %s[%d] has kind %d; expected Replicate (0), Shard (1) or Partial (2)",
                          op, name, m, p->kind);
    }
  }
  return TT_OK;
}

/* The nesting order, checked, with NULL standing for 0, 1, ... */
static tt_status chk_order(const char *op, int mesh_ndim, const int *order, int *ord) {
  int seen[TT_MAX_MESH] = {0};
  for (int i = 0; i < mesh_ndim; i++) {
    int m = order ? order[i] : i;
    if (m < 0 || m >= mesh_ndim || seen[m])
      return tt_error_set(TT_ERR_INVALID, "%s: order[%d] = %d; expected a permutation of the mesh dims 0..%d", op, i, m,
                          mesh_ndim - 1);
    seen[m] = 1;
    ord[i] = m;
  }
  return TT_OK;
}

/* ---- boxes ------------------------------------------------------------------- */

/* The box of an already validated call: every tensor dim starts whole and
 * each mesh dim, in nesting order, cuts what the earlier ones left. */
static void box_of(int ndim, const int64_t *global, int mesh_ndim, const int *mesh_shape, const int *coord,
                   const tt_placement *pl, const int *ord, tt_box *out) {
  memset(out, 0, sizeof *out);
  for (int d = 0; d < ndim; d++) out->shape[d] = global[d];
  for (int i = 0; i < mesh_ndim; i++) {
    int m = ord[i];
    if (pl[m].kind != TT_PLACE_SHARD) continue;
    int d = pl[m].dim;
    int64_t s, n;
    chunk_piece(out->shape[d], mesh_shape[m], coord[m], &s, &n);
    out->offset[d] += s;
    out->shape[d] = n;
  }
}

tt_status tt_dtensor_local_box(int ndim, const int64_t *global, int mesh_ndim, const int *mesh_shape,
                               const int *coord, const tt_placement *placements, const int *order, tt_box *out) {
  static const char *op = "dtensor local_box";
  int ord[TT_MAX_MESH];
  if (!out) return tt_error_set(TT_ERR_INVALID, "%s: out is NULL; expected a box to write", op);
  memset(out, 0, sizeof *out);
  TT_TRY(chk_global(op, ndim, global));
  TT_TRY(chk_mesh(op, mesh_ndim, mesh_shape));
  TT_TRY(chk_coord(op, mesh_ndim, mesh_shape, coord));
  TT_TRY(chk_placements(op, "placements", mesh_ndim, placements, ndim));
  TT_TRY(chk_order(op, mesh_ndim, order, ord));
  box_of(ndim, global, mesh_ndim, mesh_shape, coord, placements, ord, out);
  return TT_OK;
}

tt_status tt_dtensor_owners(int ndim, const int64_t *global, int mesh_ndim, const int *mesh_shape,
                            const tt_placement *placements, const int *order, const tt_box *want, int unique,
                            int cap, int *ranks, tt_box *boxes, int *count) {
  static const char *op = "dtensor owners";
  int ord[TT_MAX_MESH];
  if (!count) return tt_error_set(TT_ERR_INVALID, "%s: count is NULL; expected somewhere to write the count", op);
  *count = 0;
  TT_TRY(chk_global(op, ndim, global));
  TT_TRY(chk_mesh(op, mesh_ndim, mesh_shape));
  TT_TRY(chk_placements(op, "placements", mesh_ndim, placements, ndim));
  TT_TRY(chk_order(op, mesh_ndim, order, ord));
  if (!want) return tt_error_set(TT_ERR_INVALID, "%s: the wanted box is NULL; expected a box of the global tensor", op);
  for (int d = 0; d < ndim; d++)
    if (want->offset[d] < 0 || want->shape[d] < 0 || want->offset[d] > global[d] - want->shape[d])
      return tt_error_set(TT_ERR_INDEX,
                          "%s: the wanted box covers [%lld, %lld) of dim %d; expected a range inside [0, %lld)", op,
                          (long long)want->offset[d], (long long)(want->offset[d] + want->shape[d]), d,
                          (long long)global[d]);
  if (cap < 0) return tt_error_set(TT_ERR_INVALID, "%s: cap %d; expected >= 0", op, cap);
  if (cap > 0 && (!ranks || !boxes))
    return tt_error_set(TT_ERR_INVALID, "%s: cap %d with a NULL ranks or boxes array; expected both", op, cap);

  int coord[TT_MAX_MESH] = {0};
  int world = 1, n = 0;
  for (int m = 0; m < mesh_ndim; m++) world *= mesh_shape[m];
  for (int r = 0; r < world; r++) {
    /* rank r's coordinate, row-major: the last mesh dim varies fastest */
    for (int m = mesh_ndim - 1, rest = r; m >= 0; m--) {
      coord[m] = rest % mesh_shape[m];
      rest /= mesh_shape[m];
    }
    int skip = 0;
    for (int m = 0; unique && m < mesh_ndim; m++)
      if (placements[m].kind != TT_PLACE_SHARD && coord[m] != 0) skip = 1;
    if (skip) continue;
    tt_box b;
    box_of(ndim, global, mesh_ndim, mesh_shape, coord, placements, ord, &b);
    /* intersect; an empty intersection in any dim means the piece misses */
    int meets = 1;
    for (int d = 0; d < ndim; d++) {
      int64_t lo = b.offset[d] > want->offset[d] ? b.offset[d] : want->offset[d];
      int64_t hi_b = b.offset[d] + b.shape[d], hi_w = want->offset[d] + want->shape[d];
      int64_t hi = hi_b < hi_w ? hi_b : hi_w;
      if (hi <= lo) {
        meets = 0;
        break;
      }
      b.offset[d] = lo;
      b.shape[d] = hi - lo;
    }
    if (!meets) continue;
    if (n < cap) {
      ranks[n] = r;
      boxes[n] = b;
    }
    n++;
  }
  *count = n;
  return TT_OK;
}

/* ---- the plan ---------------------------------------------------------------- */

typedef struct {
  tt_redist_step *steps;
  int cap, n;
} plan_out;

static void plan_push(plan_out *p, int kind, int mesh_dim, int dim, int dim2, int op) {
  if (p->n < p->cap) {
    tt_redist_step *s = &p->steps[p->n];
    s->kind = kind;
    s->mesh_dim = mesh_dim;
    s->dim = dim;
    s->dim2 = dim2;
    s->op = op;
  }
  p->n++;
}

/* The steps that take mesh dim m from placement c to t (c != t, and not
 * Partial to Partial: refused before planning). */
static void plan_transform(plan_out *p, int m, const tt_placement *c, const tt_placement *t) {
  if (c->kind == TT_PLACE_REPLICATE) {
    if (t->kind == TT_PLACE_SHARD) plan_push(p, TT_REDIST_CHUNK, m, t->dim, -1, -1);
    else plan_push(p, TT_REDIST_PARTIAL, m, -1, -1, t->op);
  } else if (c->kind == TT_PLACE_SHARD) {
    if (t->kind == TT_PLACE_SHARD) {
      plan_push(p, TT_REDIST_ALL_TO_ALL, m, c->dim, t->dim, -1);
    } else {
      plan_push(p, TT_REDIST_ALL_GATHER, m, c->dim, -1, -1);
      if (t->kind == TT_PLACE_PARTIAL) plan_push(p, TT_REDIST_PARTIAL, m, -1, -1, t->op);
    }
  } else { /* Partial */
    if (t->kind == TT_PLACE_SHARD) plan_push(p, TT_REDIST_REDUCE_SCATTER, m, t->dim, -1, c->op);
    else plan_push(p, TT_REDIST_ALL_REDUCE, m, -1, -1, c->op);
  }
}

/* Two reductions give the same result in either order (sum and avg are
 * both linear; max with max, min with min). */
static int red_commute(int a, int b) {
  if (a == b) return 1;
  return (a == TT_RED_SUM || a == TT_RED_AVG) && (b == TT_RED_SUM || b == TT_RED_AVG);
}

/* Plans into p after validation; `op` names the caller in messages. */
static tt_status plan_build(const char *op, int mesh_ndim, const tt_placement *from, const tt_placement *to,
                            const int *ord, plan_out *p) {
  char s1[32], s2[32];
  for (int m = 0; m < mesh_ndim; m++)
    if (from[m].kind == TT_PLACE_PARTIAL && to[m].kind == TT_PLACE_PARTIAL && from[m].op != to[m].op)
      return tt_error_set(TT_ERR_UNSUPPORTED,
                          "%s: mesh dim %d goes from %s to %s; no collective turns one reduction into another "
                          "(redistribute to Replicate() first)",
                          op, m, pl_str(&from[m], s1, sizeof s1), pl_str(&to[m], s2, sizeof s2));
  /* The value of a tensor Partial over several mesh dims is their
   * reductions in some order; when the order matters (sum then max is not
   * max then sum) and the plan reduces them, the result would depend on
   * the plan. */
  for (int a = 0; a < mesh_ndim; a++)
    for (int b = a + 1; b < mesh_ndim; b++)
      if (from[a].kind == TT_PLACE_PARTIAL && from[b].kind == TT_PLACE_PARTIAL &&
          !red_commute(from[a].op, from[b].op) && (!pl_eq(&from[a], &to[a]) || !pl_eq(&from[b], &to[b])))
        return tt_error_set(TT_ERR_UNSUPPORTED,
                            "%s: mesh dims %d and %d are %s and %s, reductions whose order changes the result; "
                            "expected Partial placements that commute (sum with avg, or one op throughout)",
                            op, a, b, pl_str(&from[a], s1, sizeof s1), pl_str(&from[b], s2, sizeof s2));

  tt_placement cur[TT_MAX_MESH];
  int sharded = 0;
  for (int m = 0; m < mesh_ndim; m++) {
    cur[m] = from[m];
    if (from[m].kind == TT_PLACE_SHARD) sharded = 1;
  }
  if (sharded) {
    /* Innermost first, so a tensor dim sharded by several mesh dims is
     * gathered from the inside out. */
    for (int i = mesh_ndim - 1; i >= 0; i--) {
      int m = ord[i];
      tt_placement t = to[m];
      if (t.kind == TT_PLACE_SHARD) {
        /* The target cut of tensor dim t.dim sits under the outer mesh dims
         * that shard it; if those differ now from the target, cutting here
         * would nest under the wrong parent: replicate now, cut later. */
        int same = 1;
        for (int j = 0; j < i && same; j++)
          same = pl_is_shard(&cur[ord[j]], t.dim) == pl_is_shard(&to[ord[j]], t.dim);
        if (!same) t = (tt_placement){ .kind = TT_PLACE_REPLICATE };
      }
      if (!pl_eq(&cur[m], &t)) {
        plan_transform(p, m, &cur[m], &t);
        cur[m] = t;
      }
    }
  }
  /* Outermost first: the shards still missing, each then the innermost cut
   * of its tensor dim. */
  for (int i = 0; i < mesh_ndim; i++) {
    int m = ord[i];
    if (!pl_eq(&cur[m], &to[m])) {
      plan_transform(p, m, &cur[m], &to[m]);
      cur[m] = to[m];
    }
  }
  return TT_OK;
}

tt_status tt_dtensor_redistribute_plan(int mesh_ndim, const tt_placement *from, const tt_placement *to,
                                       const int *order, int cap, tt_redist_step *steps, int *count) {
  static const char *op = "dtensor redistribute_plan";
  int ord[TT_MAX_MESH];
  if (!count) return tt_error_set(TT_ERR_INVALID, "%s: count is NULL; expected somewhere to write the count", op);
  *count = 0;
  if (mesh_ndim < 1 || mesh_ndim > TT_MAX_MESH)
    return tt_error_set(TT_ERR_INVALID, "%s: the mesh has %d dims; expected 1 to %d", op, mesh_ndim, TT_MAX_MESH);
  TT_TRY(chk_placements(op, "from", mesh_ndim, from, -1));
  TT_TRY(chk_placements(op, "to", mesh_ndim, to, -1));
  TT_TRY(chk_order(op, mesh_ndim, order, ord));
  if (cap < 0) return tt_error_set(TT_ERR_INVALID, "%s: cap %d; expected >= 0", op, cap);
  if (cap > 0 && !steps) return tt_error_set(TT_ERR_INVALID, "%s: cap %d with a NULL steps array", op, cap);
  plan_out p = { steps, cap, 0 };
  TT_TRY(plan_build(op, mesh_ndim, from, to, ord, &p));
  *count = p.n;
  return TT_OK;
}

/* ---- execution --------------------------------------------------------------- */

/* child is piece `i` of `k` of parent along one dim (positions global). */
static int is_piece(int64_t c_off, int64_t c_len, int64_t p_off, int64_t p_len, int k, int i) {
  int64_t s, n;
  chunk_piece(p_len, k, i, &s, &n);
  return c_off == p_off + s && c_len == n;
}

static int same_except(const tt_box *a, const tt_box *b, int ndim, int d, int d2) {
  for (int e = 0; e < ndim; e++)
    if (e != d && e != d2 && (a->offset[e] != b->offset[e] || a->shape[e] != b->shape[e])) return 0;
  return 1;
}

/* The dims of a tensor reordered with d first (and d2 second when >= 0),
 * the others in their order; inv undoes it. Collectives cut dim 0, so a
 * piece is packed in this order and unpacked with inv. */
static void front_perm(int ndim, int d, int d2, int *perm, int *inv) {
  int n = 0;
  perm[n++] = d;
  if (d2 >= 0) perm[n++] = d2;
  for (int e = 0; e < ndim; e++)
    if (e != d && e != d2) perm[n++] = e;
  for (int i = 0; i < ndim; i++) inv[perm[i]] = i;
}

static void rel(tt_tensor **t) {
  if (*t) tt_tensor_release(*t);
  *t = NULL;
}

/* dst <- src[dim: start .. start+len) (a view, then a copy). */
static tt_status copy_narrowed(tt_tensor *dst, const tt_tensor *src, int dim, int64_t start, int64_t len) {
  tt_tensor *v = NULL;
  TT_TRY(tt_view_narrow(src, dim, start, len, &v));
  tt_status st = tt_tensor_copy(dst, v);
  tt_tensor_release(v);
  return st;
}

/* Zero rows [from, to) of dim 0 of a contiguous buffer: the padding of a
 * short piece, so no uninitialized bytes travel or get reduced. */
static tt_status zero_rows(tt_tensor *t, int64_t from, int64_t to) {
  if (to <= from) return TT_OK;
  tt_tensor *v = NULL;
  TT_TRY(tt_view_narrow(t, 0, from, to - from, &v));
  tt_status st = tt_tensor_fill(v, 0.0);
  tt_tensor_release(v);
  return st;
}

/* Pack `src` permuted by perm into dim-0 rows [0, rows) of the contiguous
 * buffer `buf`. */
static tt_status pack(tt_tensor *buf, const tt_tensor *src, const int *perm, int64_t rows) {
  tt_tensor *pv = NULL, *dv = NULL;
  tt_status st = tt_view_permute(src, perm, &pv);
  if (st == TT_OK) st = tt_view_narrow(buf, 0, 0, rows, &dv);
  if (st == TT_OK) st = tt_tensor_copy(dv, pv);
  rel(&pv);
  rel(&dv);
  return st;
}

/* dst <- buf's rows [0, rows) (and columns [0, cols) of dim 1 when cols
 * >= 0) permuted back by inv. */
static tt_status unpack(tt_tensor *dst, const tt_tensor *buf, const int *inv, int64_t rows, int64_t cols) {
  tt_tensor *a = NULL, *b = NULL, *c = NULL;
  tt_status st = tt_view_narrow(buf, 0, 0, rows, &a);
  if (st == TT_OK) {
    if (cols >= 0) st = tt_view_narrow(a, 1, 0, cols, &b);
    else {
      b = a;
      tt_tensor_retain(b);
    }
  }
  if (st == TT_OK) st = tt_view_permute(b, inv, &c);
  if (st == TT_OK) st = tt_tensor_copy(dst, c);
  rel(&a);
  rel(&b);
  rel(&c);
  return st;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

typedef struct {
  int ndim, k, i; /* tensor dims; the group's size and this rank's place in it */
  tt_group *g;
  const tt_box *before, *after;
  int dtype;
  tt_device dev;
} step_ctx;

/* Shard(d) -> Replicate: every piece padded to the chunk, gathered, the
 * padding cut out. */
static tt_status run_all_gather(const step_ctx *x, const tt_tensor *cur, int d, tt_tensor *res) {
  int perm[TT_MAX_DIMS], inv[TT_MAX_DIMS];
  int64_t L = x->after->shape[d], l = x->before->shape[d], c = ceil_div(L, x->k);
  int64_t shp[TT_MAX_DIMS];
  front_perm(x->ndim, d, -1, perm, inv);
  for (int e = 0; e < x->ndim; e++) shp[e] = x->before->shape[perm[e]];
  shp[0] = c;
  /* Every rank of the group has the same chunk size: all skip or none. */
  if (numel_of(x->ndim, shp) == 0) return TT_OK;
  tt_tensor *send = NULL, *recv = NULL;
  tt_status st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &send);
  if (st == TT_OK) st = zero_rows(send, l, c);
  if (st == TT_OK) st = pack(send, cur, perm, l);
  shp[0] = c * x->k;
  if (st == TT_OK) st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &recv);
  if (st == TT_OK) st = tt_dist_all_gather(x->g, send, recv);
  if (st == TT_OK) st = unpack(res, recv, inv, L, -1);
  rel(&send);
  rel(&recv);
  return st;
}

/* Partial -> Shard(d): the parent padded to k chunks, reduce-scattered,
 * this rank's chunk cut to its length. */
static tt_status run_reduce_scatter(const step_ctx *x, const tt_tensor *cur, int d, int op, tt_tensor *res) {
  int perm[TT_MAX_DIMS], inv[TT_MAX_DIMS];
  int64_t L = x->before->shape[d], l = x->after->shape[d], c = ceil_div(L, x->k);
  int64_t shp[TT_MAX_DIMS];
  front_perm(x->ndim, d, -1, perm, inv);
  for (int e = 0; e < x->ndim; e++) shp[e] = x->before->shape[perm[e]];
  shp[0] = c;
  if (numel_of(x->ndim, shp) == 0) return TT_OK;
  tt_tensor *send = NULL, *recv = NULL;
  tt_status st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &recv);
  shp[0] = c * x->k;
  if (st == TT_OK) st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &send);
  if (st == TT_OK) st = zero_rows(send, L, c * x->k);
  if (st == TT_OK) st = pack(send, cur, perm, L);
  if (st == TT_OK) st = tt_dist_reduce_scatter(x->g, send, recv, op);
  if (st == TT_OK) st = unpack(res, recv, inv, l, -1);
  rel(&send);
  rel(&recv);
  return st;
}

/* Shard(d) -> Shard(d2): block j of the send buffer is this rank's piece of
 * d restricted to d2's chunk j, padded to [cd, c2]; the blocks received
 * stack rank after rank along d, which is the whole parent along d. */
static tt_status run_all_to_all(const step_ctx *x, const tt_tensor *cur, int d, int d2, tt_tensor *res) {
  int perm[TT_MAX_DIMS], inv[TT_MAX_DIMS];
  const int k = x->k;
  int64_t Ld = x->after->shape[d], ld = x->before->shape[d], cd = ceil_div(Ld, k);
  int64_t L2 = x->before->shape[d2], l2 = x->after->shape[d2], c2 = ceil_div(L2, k);
  int64_t shp[TT_MAX_DIMS];
  front_perm(x->ndim, d, d2, perm, inv);
  for (int e = 0; e < x->ndim; e++) shp[e] = x->before->shape[perm[e]];
  shp[0] = cd * k;
  shp[1] = c2;
  if (numel_of(x->ndim, shp) == 0) return TT_OK;
  tt_tensor *send = NULL, *recv = NULL, *pv = NULL;
  tt_status st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &send);
  if (st == TT_OK && (ld < cd || c2 * k != L2)) st = tt_tensor_fill(send, 0.0);
  if (st == TT_OK) st = tt_view_permute(cur, perm, &pv);
  for (int j = 0; j < k && st == TT_OK; j++) {
    int64_t s2, n2;
    chunk_piece(L2, k, j, &s2, &n2);
    tt_tensor *src = NULL, *blk = NULL, *dst = NULL;
    st = tt_view_narrow(pv, 1, s2, n2, &src);
    if (st == TT_OK) st = tt_view_narrow(send, 0, j * cd, ld, &blk);
    if (st == TT_OK) st = tt_view_narrow(blk, 1, 0, n2, &dst);
    if (st == TT_OK) st = tt_tensor_copy(dst, src);
    rel(&src);
    rel(&blk);
    rel(&dst);
  }
  if (st == TT_OK) st = tt_tensor_empty(x->ndim, shp, x->dtype, x->dev, &recv);
  if (st == TT_OK) st = tt_dist_all_to_all(x->g, send, recv);
  if (st == TT_OK) st = unpack(res, recv, inv, Ld, l2);
  rel(&pv);
  rel(&send);
  rel(&recv);
  return st;
}

/* Checks that a planned step fits the pieces before and after it: every
 * rank of the group must cut its piece from one common parent, else the
 * collective would mix pieces of different parents. A failure is a bug in
 * the planner, never the caller's. */
static int step_fits(const tt_redist_step *s, const step_ctx *x) {
  const tt_box *b = x->before, *a = x->after;
  switch (s->kind) {
    case TT_REDIST_ALL_GATHER:
      return same_except(a, b, x->ndim, s->dim, -1) &&
             is_piece(b->offset[s->dim], b->shape[s->dim], a->offset[s->dim], a->shape[s->dim], x->k, x->i);
    case TT_REDIST_REDUCE_SCATTER:
    case TT_REDIST_CHUNK:
      return same_except(a, b, x->ndim, s->dim, -1) &&
             is_piece(a->offset[s->dim], a->shape[s->dim], b->offset[s->dim], b->shape[s->dim], x->k, x->i);
    case TT_REDIST_ALL_TO_ALL:
      return same_except(a, b, x->ndim, s->dim, s->dim2) &&
             is_piece(b->offset[s->dim], b->shape[s->dim], a->offset[s->dim], a->shape[s->dim], x->k, x->i) &&
             is_piece(a->offset[s->dim2], a->shape[s->dim2], b->offset[s->dim2], b->shape[s->dim2], x->k, x->i);
    default:
      return same_except(a, b, x->ndim, -1, -1);
  }
}

static const char *step_name(int kind) {
  static const char *names[] = { "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "partial" };
  return kind >= 0 && kind <= TT_REDIST_PARTIAL ? names[kind] : "?";
}

/* The placements after a step (the planner's state, replayed). */
static void step_apply(const tt_redist_step *s, tt_placement *cur) {
  tt_placement *p = &cur[s->mesh_dim];
  switch (s->kind) {
    case TT_REDIST_ALL_GATHER:
    case TT_REDIST_ALL_REDUCE: *p = (tt_placement){ .kind = TT_PLACE_REPLICATE }; break;
    case TT_REDIST_REDUCE_SCATTER:
    case TT_REDIST_CHUNK: *p = (tt_placement){ .kind = TT_PLACE_SHARD, .dim = s->dim }; break;
    case TT_REDIST_ALL_TO_ALL: *p = (tt_placement){ .kind = TT_PLACE_SHARD, .dim = s->dim2 }; break;
    default: *p = (tt_placement){ .kind = TT_PLACE_PARTIAL, .op = s->op }; break;
  }
}

static int step_needs_group(int kind) { return kind != TT_REDIST_CHUNK && kind != TT_REDIST_PARTIAL; }

tt_status tt_dtensor_redistribute(tt_group *const *groups, int ndim, const int64_t *global, int mesh_ndim,
                                  const int *mesh_shape, const int *coord, const tt_placement *from,
                                  const tt_placement *to, const int *order, const tt_tensor *in, tt_tensor **out) {
  static const char *op = "dtensor redistribute";
  char s1[96], s2[96];
  int ord[TT_MAX_MESH];
  if (!out) return tt_error_set(TT_ERR_INVALID, "%s: out is NULL; expected somewhere to put the new piece", op);
  *out = NULL;
  TT_TRY(chk_global(op, ndim, global));
  TT_TRY(chk_mesh(op, mesh_ndim, mesh_shape));
  TT_TRY(chk_coord(op, mesh_ndim, mesh_shape, coord));
  TT_TRY(chk_placements(op, "from", mesh_ndim, from, ndim));
  TT_TRY(chk_placements(op, "to", mesh_ndim, to, ndim));
  TT_TRY(chk_order(op, mesh_ndim, order, ord));
  if (!in) return tt_error_set(TT_ERR_INVALID, "%s: the local piece is NULL; expected a tensor", op);
  TT_TRY(tt_tensor_check_storage(op, "the local piece", in));

  tt_box box;
  box_of(ndim, global, mesh_ndim, mesh_shape, coord, from, ord, &box);
  if (!tt_shape_eq(in, ndim, box.shape)) {
    tt_tensor want;
    memset(&want, 0, sizeof want);
    want.ndim = ndim;
    for (int d = 0; d < ndim; d++) want.shape[d] = box.shape[d];
    return tt_error_set(TT_ERR_SHAPE, "%s: the local piece is %s; expected %s, this coordinate's piece under `from`",
                        op, SHP(in, s1), SHP(&want, s2));
  }

  tt_redist_step steps[TT_MAX_STEPS];
  plan_out p = { steps, TT_MAX_STEPS, 0 };
  TT_TRY(plan_build(op, mesh_ndim, from, to, ord, &p));
  if (p.n > TT_MAX_STEPS) return tt_error_set(TT_ERR_INTERNAL, "%s: the plan has %d steps (at most %d expected)", op,
                                              p.n, TT_MAX_STEPS);

  /* Every group is checked before the first collective, so a bad argument
   * fails on every rank alike rather than leave the others waiting. */
  for (int s = 0; s < p.n; s++) {
    if (!step_needs_group(steps[s].kind)) continue;
    int m = steps[s].mesh_dim;
    tt_group *g = groups ? groups[m] : NULL;
    if (!g)
      return tt_error_set(TT_ERR_INVALID, "%s: the plan runs %s over mesh dim %d but its group is NULL", op,
                          step_name(steps[s].kind), m);
    if (tt_group_size(g) != mesh_shape[m] || tt_group_rank(g) != coord[m])
      return tt_error_set(TT_ERR_INVALID,
                          "%s: the group of mesh dim %d is rank %d of %d; expected rank %d (the coordinate) of %d (the "
                          "mesh dim's size)",
                          op, m, tt_group_rank(g), tt_group_size(g), coord[m], mesh_shape[m]);
  }

  tt_placement cur_pl[TT_MAX_MESH];
  for (int m = 0; m < mesh_ndim; m++) cur_pl[m] = from[m];
  /* cur: the piece so far; `in` itself (retained, never written) until a
   * step makes a new one. */
  tt_tensor *cur = (tt_tensor *)in;
  tt_tensor_retain(cur);
  tt_status st = TT_OK;
  for (int s = 0; s < p.n && st == TT_OK; s++) {
    const tt_redist_step *sp = &steps[s];
    int m = sp->mesh_dim;
    tt_box after;
    step_apply(sp, cur_pl);
    box_of(ndim, global, mesh_ndim, mesh_shape, coord, cur_pl, ord, &after);
    step_ctx x = { ndim, mesh_shape[m], coord[m], groups ? groups[m] : NULL, &box, &after, in->dtype, in->device };
    if (!step_fits(sp, &x)) {
      st = tt_error_set(TT_ERR_INTERNAL, "%s: step %d (%s over mesh dim %d) does not fit the pieces (a planner bug)",
                        op, s, step_name(sp->kind), m);
      break;
    }
    tt_tensor *res = NULL;
    switch (sp->kind) {
      case TT_REDIST_ALL_GATHER:
      case TT_REDIST_REDUCE_SCATTER:
      case TT_REDIST_ALL_TO_ALL:
      case TT_REDIST_CHUNK:
        st = tt_tensor_empty(ndim, after.shape, in->dtype, in->device, &res);
        if (st != TT_OK) break;
        if (sp->kind == TT_REDIST_ALL_GATHER) st = run_all_gather(&x, cur, sp->dim, res);
        else if (sp->kind == TT_REDIST_REDUCE_SCATTER) st = run_reduce_scatter(&x, cur, sp->dim, sp->op, res);
        else if (sp->kind == TT_REDIST_ALL_TO_ALL) st = run_all_to_all(&x, cur, sp->dim, sp->dim2, res);
        else st = copy_narrowed(res, cur, sp->dim, after.offset[sp->dim] - box.offset[sp->dim], after.shape[sp->dim]);
        break;
      case TT_REDIST_ALL_REDUCE:
        /* In place on a piece of our own; `in` is the caller's. */
        if (cur == in) {
          st = tt_tensor_empty(ndim, after.shape, in->dtype, in->device, &res);
          if (st == TT_OK) st = tt_tensor_copy(res, cur);
        } else {
          res = cur;
          tt_tensor_retain(res);
        }
        if (st == TT_OK && tt_tensor_numel(res) > 0) st = tt_dist_all_reduce(x.g, res, sp->op);
        break;
      default: /* partial: coordinate 0 keeps the values; the others too, but zeros for a sum */
        if (sp->op == TT_RED_SUM && coord[m] != 0) {
          st = tt_tensor_empty(ndim, after.shape, in->dtype, in->device, &res);
          if (st == TT_OK) st = tt_tensor_fill(res, 0.0);
        } else {
          res = cur;
          tt_tensor_retain(res);
        }
        break;
    }
    if (st != TT_OK) {
      rel(&res);
      break;
    }
    tt_tensor_release(cur);
    cur = res;
    box = after;
  }
  if (st == TT_OK && cur == in) {
    /* The caller gets a tensor of its own even when nothing moved. */
    tt_tensor *res = NULL;
    st = tt_tensor_empty(ndim, box.shape, in->dtype, in->device, &res);
    if (st == TT_OK) st = tt_tensor_copy(res, cur);
    tt_tensor_release(cur);
    cur = res;
    if (st != TT_OK) rel(&cur);
  }
  if (st != TT_OK) {
    rel(&cur);
    return st;
  }
  *out = cur;
  return TT_OK;
}
