/*
 * test_dtensor.c — the placement math of engine/dtensor.c: local boxes
 * (torch.chunk's uneven rule, empty pieces, nested shards in both orders),
 * coverage (the pieces tile the global tensor exactly once), the inverse
 * map, redistribute plans (expected step lists; every plan replayed on
 * boxes), bad input, and redistribute itself on simulated ranks (the
 * "local" backend): every from/to pair on 1-D and 2-D meshes, bit for bit
 * against the pieces cut from a known global tensor.
 */
#include <stdlib.h>
#include <string.h>

#include "titan.h"
#include "tt_test.h"

#define R_ ((tt_placement){ TT_PLACE_REPLICATE, 0, 0 })
#define S_(d) ((tt_placement){ TT_PLACE_SHARD, (d), 0 })
#define P_(op) ((tt_placement){ TT_PLACE_PARTIAL, 0, (op) })

static int contains(const char *hay, const char *needle) { return strstr(hay, needle) != NULL; }

/* ---- boxes -------------------------------------------------------------------- */

static void check_1d(int64_t n, int k, const int64_t *off, const int64_t *len) {
  int64_t g[1] = { n };
  int ms[1] = { k };
  tt_placement pl[1] = { S_(0) };
  for (int i = 0; i < k; i++) {
    int c[1] = { i };
    tt_box b;
    tt_status st = tt_dtensor_local_box(1, g, 1, ms, c, pl, NULL, &b);
    CHECK(st == TT_OK, "local_box %lld over %d, rank %d: %s", (long long)n, k, i, tt_last_error());
    CHECK(b.offset[0] == off[i] && b.shape[0] == len[i], "%lld over %d, rank %d: [%lld +%lld], expected [%lld +%lld]",
          (long long)n, k, i, (long long)b.offset[0], (long long)b.shape[0], (long long)off[i], (long long)len[i]);
  }
}

static void test_box_1d(void) {
  check_1d(10, 4, (int64_t[]){ 0, 3, 6, 9 }, (int64_t[]){ 3, 3, 3, 1 });
  /* torch.chunk gives 5 pieces; the other 3 ranks hold empty ones at n */
  check_1d(5, 8, (int64_t[]){ 0, 1, 2, 3, 4, 5, 5, 5 }, (int64_t[]){ 1, 1, 1, 1, 1, 0, 0, 0 });
  check_1d(6, 4, (int64_t[]){ 0, 2, 4, 6 }, (int64_t[]){ 2, 2, 2, 0 });
  check_1d(7, 3, (int64_t[]){ 0, 3, 6 }, (int64_t[]){ 3, 3, 1 });
  check_1d(0, 3, (int64_t[]){ 0, 0, 0 }, (int64_t[]){ 0, 0, 0 });
  check_1d(4, 1, (int64_t[]){ 0 }, (int64_t[]){ 4 });

  /* Replicate and Partial leave the whole tensor; the other dims stay whole */
  int64_t g[2] = { 10, 3 };
  int ms[1] = { 4 }, c[1] = { 2 };
  tt_box b;
  CHECK(tt_dtensor_local_box(2, g, 1, ms, c, (tt_placement[]){ R_ }, NULL, &b) == TT_OK, "%s", tt_last_error());
  CHECK(b.offset[0] == 0 && b.shape[0] == 10 && b.offset[1] == 0 && b.shape[1] == 3, "Replicate box");
  CHECK(tt_dtensor_local_box(2, g, 1, ms, c, (tt_placement[]){ P_(TT_RED_SUM) }, NULL, &b) == TT_OK, "%s",
        tt_last_error());
  CHECK(b.shape[0] == 10 && b.shape[1] == 3, "Partial box");
  CHECK(tt_dtensor_local_box(2, g, 1, ms, c, (tt_placement[]){ S_(1) }, NULL, &b) == TT_OK, "%s", tt_last_error());
  CHECK(b.offset[0] == 0 && b.shape[0] == 10 && b.offset[1] == 2 && b.shape[1] == 1, "Shard(1) of 3 over 4, rank 2");
  /* a 0-d tensor: nothing to cut */
  CHECK(tt_dtensor_local_box(0, NULL, 1, ms, c, (tt_placement[]){ R_ }, NULL, &b) == TT_OK, "%s", tt_last_error());
}

/* Nested shards: the mesh dims cut one tensor dim in `order`. */
static void test_box_nested(void) {
  int64_t g[1] = { 13 };
  int ms[2] = { 2, 3 };
  tt_placement pl[2] = { S_(0), S_(0) };
  /* order 0, 1: 13 -> 7 | 6, then each in 3: 3,3,1 | 2,2,2 */
  int64_t off01[2][3] = { { 0, 3, 6 }, { 7, 9, 11 } }, len01[2][3] = { { 3, 3, 1 }, { 2, 2, 2 } };
  /* order 1, 0: 13 -> 5 | 5 | 3, then each in 2: 3,2 | 3,2 | 2,1 */
  int64_t off10[2][3] = { { 0, 5, 10 }, { 3, 8, 12 } }, len10[2][3] = { { 3, 3, 2 }, { 2, 2, 1 } };
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 3; b++) {
      int c[2] = { a, b };
      tt_box x;
      CHECK(tt_dtensor_local_box(1, g, 2, ms, c, pl, NULL, &x) == TT_OK, "%s", tt_last_error());
      CHECK(x.offset[0] == off01[a][b] && x.shape[0] == len01[a][b], "order 0,1 (%d,%d): [%lld +%lld]", a, b,
            (long long)x.offset[0], (long long)x.shape[0]);
      CHECK(tt_dtensor_local_box(1, g, 2, ms, c, pl, (int[]){ 1, 0 }, &x) == TT_OK, "%s", tt_last_error());
      CHECK(x.offset[0] == off10[a][b] && x.shape[0] == len10[a][b], "order 1,0 (%d,%d): [%lld +%lld]", a, b,
            (long long)x.offset[0], (long long)x.shape[0]);
    }

  /* three mesh dims on one tensor dim: 10 over 2x2x2 */
  int64_t g3[1] = { 10 };
  int ms3[3] = { 2, 2, 2 };
  tt_placement pl3[3] = { S_(0), S_(0), S_(0) };
  /* 10 -> 5,5 -> 3,2,3,2 -> 2,1,1,1,2,1,1,1: pieces in nesting order */
  int64_t poff[8] = { 0, 2, 3, 4, 5, 7, 8, 9 }, plen[8] = { 2, 1, 1, 1, 2, 1, 1, 1 };
  int orders[3][3] = { { 0, 1, 2 }, { 2, 1, 0 }, { 1, 2, 0 } };
  for (int o = 0; o < 3; o++)
    for (int r = 0; r < 8; r++) {
      int c[3] = { (r >> 2) & 1, (r >> 1) & 1, r & 1 };
      /* the piece index: coordinates read outermost (order[0]) first */
      int idx = c[orders[o][0]] * 4 + c[orders[o][1]] * 2 + c[orders[o][2]];
      tt_box x;
      CHECK(tt_dtensor_local_box(1, g3, 3, ms3, c, pl3, orders[o], &x) == TT_OK, "%s", tt_last_error());
      CHECK(x.offset[0] == poff[idx] && x.shape[0] == plen[idx], "3 mesh dims, order %d%d%d, coord (%d,%d,%d)",
            orders[o][0], orders[o][1], orders[o][2], c[0], c[1], c[2]);
    }
  /* uneven and empty: 5 over 2 x 3 (nested 3,2 then 1,1,1 | 1,1,0) */
  int64_t g5[1] = { 5 };
  int c12[2] = { 1, 2 };
  tt_box x;
  CHECK(tt_dtensor_local_box(1, g5, 2, ms, c12, pl, NULL, &x) == TT_OK, "%s", tt_last_error());
  CHECK(x.offset[0] == 5 && x.shape[0] == 0, "empty nested piece sits at its parent's end: [%lld +%lld]",
        (long long)x.offset[0], (long long)x.shape[0]);

  /* two tensor dims sharded by the two mesh dims: dim 1 by mesh dim 0, dim 0 by mesh dim 1 */
  int64_t g2[2] = { 7, 5 };
  tt_placement pl2[2] = { S_(1), S_(0) };
  CHECK(tt_dtensor_local_box(2, g2, 2, ms, c12, pl2, NULL, &x) == TT_OK, "%s", tt_last_error());
  CHECK(x.offset[0] == 6 && x.shape[0] == 1 && x.offset[1] == 3 && x.shape[1] == 2,
        "(Shard(1), Shard(0)) coord (1,2): [%lld +%lld, %lld +%lld]", (long long)x.offset[0], (long long)x.shape[0],
        (long long)x.offset[1], (long long)x.shape[1]);
  int c00[2] = { 0, 0 };
  CHECK(tt_dtensor_local_box(2, g2, 2, ms, c00, pl2, (int[]){ 1, 0 }, &x) == TT_OK, "%s", tt_last_error());
  CHECK(x.offset[0] == 0 && x.shape[0] == 3 && x.offset[1] == 0 && x.shape[1] == 3, "different tensor dims: order moot");
}

/* A random layout: mesh of 1..3 dims, tensor of 1..3 dims. */
typedef struct {
  int ndim, mesh_ndim;
  int64_t global[3];
  int mesh_shape[3], order[3];
  tt_placement pl[3];
} layout;

static int rnd(int n) { return (int)((tt_test_rand() + 1.0) * 0.5 * n) % n; }

static layout random_layout(void) {
  layout L;
  memset(&L, 0, sizeof L);
  L.ndim = 1 + rnd(3);
  L.mesh_ndim = 1 + rnd(3);
  for (int d = 0; d < L.ndim; d++) L.global[d] = rnd(10);
  for (int m = 0; m < L.mesh_ndim; m++) {
    L.mesh_shape[m] = 1 + rnd(4);
    int k = rnd(4);
    L.pl[m] = k == 0 ? R_ : k == 1 ? P_(TT_RED_SUM) : S_(rnd(L.ndim));
    L.order[m] = m;
  }
  for (int m = L.mesh_ndim - 1; m > 0; m--) { /* shuffle */
    int j = rnd(m + 1), t = L.order[m];
    L.order[m] = L.order[j];
    L.order[j] = t;
  }
  return L;
}

static int world_of(const layout *L) {
  int w = 1;
  for (int m = 0; m < L->mesh_ndim; m++) w *= L->mesh_shape[m];
  return w;
}

static void coord_of(int r, int mesh_ndim, const int *mesh_shape, int *c) {
  for (int m = mesh_ndim - 1; m >= 0; m--) {
    c[m] = r % mesh_shape[m];
    r /= mesh_shape[m];
  }
}

static int64_t box_numel(int ndim, const tt_box *b) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= b->shape[d];
  return n;
}

/* Count, for every element of the global tensor, the boxes over it. */
static void cover(int ndim, const int64_t *global, const tt_box *b, int *count) {
  int64_t idx[3] = { 0, 0, 0 };
  if (box_numel(ndim, b) == 0) return;
  for (;;) {
    int64_t lin = 0;
    for (int d = 0; d < ndim; d++) lin = lin * global[d] + b->offset[d] + idx[d];
    count[lin]++;
    int d = ndim - 1;
    while (d >= 0 && ++idx[d] == b->shape[d]) idx[d--] = 0;
    if (d < 0) break;
  }
}

static void test_box_coverage(void) {
  int bad = 0;
  for (int it = 0; it < 3000 && !bad; it++) {
    layout L = random_layout();
    int world = world_of(&L);
    int64_t total = 1;
    for (int d = 0; d < L.ndim; d++) total *= L.global[d];
    int *count = calloc((size_t)(total ? total : 1), sizeof *count);
    int copies = 1; /* coordinates that differ along Replicate/Partial dims hold the same box */
    for (int m = 0; m < L.mesh_ndim; m++)
      if (L.pl[m].kind != TT_PLACE_SHARD) copies *= L.mesh_shape[m];
    for (int r = 0; r < world; r++) {
      int c[3];
      tt_box b;
      coord_of(r, L.mesh_ndim, L.mesh_shape, c);
      tt_status st = tt_dtensor_local_box(L.ndim, L.global, L.mesh_ndim, L.mesh_shape, c, L.pl, L.order, &b);
      if (st != TT_OK) {
        CHECK(0, "local_box: %s", tt_last_error());
        bad = 1;
        break;
      }
      for (int d = 0; d < L.ndim; d++)
        if (b.offset[d] < 0 || b.shape[d] < 0 || b.offset[d] + b.shape[d] > L.global[d]) bad = 1;
      if (!bad) cover(L.ndim, L.global, &b, count);
    }
    for (int64_t i = 0; i < total && !bad; i++)
      if (count[i] != copies) bad = 1;
    CHECK(!bad, "layout %d: the pieces do not tile the tensor exactly %d times", it, copies);
    free(count);
  }
}

/* ---- owners --------------------------------------------------------------------- */

static void test_owners(void) {
  int bad = 0;
  for (int it = 0; it < 2000 && !bad; it++) {
    layout L = random_layout();
    int world = world_of(&L);
    tt_box *boxes = calloc((size_t)world, sizeof *boxes), *all = calloc((size_t)world, sizeof *all);
    int *ranks = calloc((size_t)world, sizeof *ranks);
    for (int r = 0; r < world; r++) {
      int c[3];
      coord_of(r, L.mesh_ndim, L.mesh_shape, c);
      tt_dtensor_local_box(L.ndim, L.global, L.mesh_ndim, L.mesh_shape, c, L.pl, L.order, &all[r]);
    }
    /* a random box inside the tensor */
    tt_box want;
    memset(&want, 0, sizeof want);
    for (int d = 0; d < L.ndim; d++) {
      int64_t a = rnd((int)L.global[d] + 1), b = rnd((int)L.global[d] + 1);
      want.offset[d] = a < b ? a : b;
      want.shape[d] = (a < b ? b : a) - want.offset[d];
    }
    for (int unique = 0; unique < 2; unique++) {
      int n = -1, n2 = -1;
      tt_status st = tt_dtensor_owners(L.ndim, L.global, L.mesh_ndim, L.mesh_shape, L.pl, L.order, &want, unique, 0,
                                       NULL, NULL, &n);
      CHECK(st == TT_OK, "owners (sizing): %s", tt_last_error());
      st = tt_dtensor_owners(L.ndim, L.global, L.mesh_ndim, L.mesh_shape, L.pl, L.order, &want, unique, world, ranks,
                             boxes, &n2);
      CHECK(st == TT_OK && n == n2, "owners: %s (%d vs %d)", tt_last_error(), n, n2);
      /* brute force: every rank whose piece meets the box, in rank order */
      int j = 0;
      int64_t total = 1;
      for (int d = 0; d < L.ndim; d++) total *= L.global[d];
      int *count = calloc((size_t)(total ? total : 1), sizeof *count);
      for (int r = 0; r < world && !bad; r++) {
        int c[3];
        coord_of(r, L.mesh_ndim, L.mesh_shape, c);
        int skip = 0;
        for (int m = 0; unique && m < L.mesh_ndim; m++)
          if (L.pl[m].kind != TT_PLACE_SHARD && c[m]) skip = 1;
        tt_box x = all[r];
        int meets = 1;
        for (int d = 0; d < L.ndim; d++) {
          int64_t lo = x.offset[d] > want.offset[d] ? x.offset[d] : want.offset[d];
          int64_t hi = x.offset[d] + x.shape[d] < want.offset[d] + want.shape[d] ? x.offset[d] + x.shape[d]
                                                                                : want.offset[d] + want.shape[d];
          if (hi <= lo) meets = 0;
          x.offset[d] = lo;
          x.shape[d] = hi - lo;
        }
        if (skip || !meets) continue;
        if (j >= n2 || ranks[j] != r) {
          bad = 1;
          break;
        }
        for (int d = 0; d < L.ndim; d++)
          if (boxes[j].offset[d] != x.offset[d] || boxes[j].shape[d] != x.shape[d]) bad = 1;
        cover(L.ndim, L.global, &boxes[j], count);
        j++;
      }
      CHECK(!bad && j == n2, "layout %d unique %d: owners differ from the brute force (%d of %d)", it, unique, j, n2);
      /* unique: the listed pieces tile the wanted box exactly once */
      if (unique && !bad) {
        tt_box one = want;
        int *wc = calloc((size_t)(total ? total : 1), sizeof *wc);
        cover(L.ndim, L.global, &one, wc);
        for (int64_t i = 0; i < total; i++)
          if (wc[i] != count[i]) bad = 1;
        CHECK(!bad, "layout %d: unique owners do not tile the wanted box once", it);
        free(wc);
      }
      free(count);
    }
    free(boxes);
    free(all);
    free(ranks);
  }

  /* round trip: the owners of a rank's own piece include that rank with that box */
  int64_t g[2] = { 10, 7 };
  int ms[2] = { 4, 2 };
  tt_placement pl[2] = { S_(0), R_ };
  for (int r = 0; r < 8; r++) {
    int c[2] = { r / 2, r % 2 }, rk[8], n = 0;
    tt_box b, bx[8];
    tt_dtensor_local_box(2, g, 2, ms, c, pl, NULL, &b);
    tt_dtensor_owners(2, g, 2, ms, pl, NULL, &b, 0, 8, rk, bx, &n);
    int found = 0;
    for (int i = 0; i < n; i++)
      if (rk[i] == r && !memcmp(&bx[i], &b, sizeof b)) found = 1;
    CHECK(found, "rank %d is an owner of its own piece", r);
    CHECK(n == 2, "the piece of rank %d has 2 holders (Replicate over mesh dim 1), got %d", r, n);
    tt_dtensor_owners(2, g, 2, ms, pl, NULL, &b, 1, 8, rk, bx, &n);
    CHECK(n == 1 && rk[0] == (r & ~1), "unique: only the holder at coordinate 0 of the Replicate dim (got %d)", n);
  }
  /* a box straddling pieces: rows 2..7 of 10 over 4 (3,3,3,1) */
  tt_box want;
  memset(&want, 0, sizeof want);
  want.offset[0] = 2;
  want.shape[0] = 6;
  want.shape[1] = 7;
  int rk[8], n = 0;
  tt_box bx[8];
  CHECK(tt_dtensor_owners(2, g, 2, ms, pl, NULL, &want, 1, 8, rk, bx, &n) == TT_OK, "%s", tt_last_error());
  CHECK(n == 3 && rk[0] == 0 && rk[1] == 2 && rk[2] == 4, "straddling: ranks 0, 2, 4 (got %d)", n);
  CHECK(n == 3 && bx[0].offset[0] == 2 && bx[0].shape[0] == 1 && bx[1].offset[0] == 3 && bx[1].shape[0] == 3 &&
            bx[2].offset[0] == 6 && bx[2].shape[0] == 2,
        "straddling boxes");
  /* cap smaller than the count: writes cap entries, counts them all */
  rk[1] = -7;
  CHECK(tt_dtensor_owners(2, g, 2, ms, pl, NULL, &want, 0, 1, rk, bx, &n) == TT_OK && n == 6 && rk[0] == 0 &&
            rk[1] == -7,
        "cap 1: count %d", n);
}

/* ---- plans ----------------------------------------------------------------------- */

static const char *red(int op) { return op == TT_RED_SUM ? "sum" : op == TT_RED_AVG ? "avg" : op == TT_RED_MAX ? "max" : "min"; }

/* "AG1:0 AA0:0>1 RS0:1/sum AR1/avg CH0:0 PA1/sum" */
static void plan_str(int n, const tt_redist_step *s, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = 0;
  for (int i = 0; i < n && o < len; i++) {
    const char *sep = i ? " " : "";
    int w = 0;
    switch (s[i].kind) {
      case TT_REDIST_ALL_GATHER: w = snprintf(buf + o, len - o, "%sAG%d:%d", sep, s[i].mesh_dim, s[i].dim); break;
      case TT_REDIST_ALL_TO_ALL:
        w = snprintf(buf + o, len - o, "%sAA%d:%d>%d", sep, s[i].mesh_dim, s[i].dim, s[i].dim2);
        break;
      case TT_REDIST_REDUCE_SCATTER:
        w = snprintf(buf + o, len - o, "%sRS%d:%d/%s", sep, s[i].mesh_dim, s[i].dim, red(s[i].op));
        break;
      case TT_REDIST_ALL_REDUCE: w = snprintf(buf + o, len - o, "%sAR%d/%s", sep, s[i].mesh_dim, red(s[i].op)); break;
      case TT_REDIST_CHUNK: w = snprintf(buf + o, len - o, "%sCH%d:%d", sep, s[i].mesh_dim, s[i].dim); break;
      default: w = snprintf(buf + o, len - o, "%sPA%d/%s", sep, s[i].mesh_dim, red(s[i].op)); break;
    }
    o += (size_t)w;
  }
}

/* expected NULL: the plan must be refused as unsupported */
static void check_plan(int mesh_ndim, const tt_placement *from, const tt_placement *to, const int *order,
                       const char *expected) {
  tt_redist_step s[32];
  int n = -1;
  char got[256];
  tt_status st = tt_dtensor_redistribute_plan(mesh_ndim, from, to, order, 32, s, &n);
  if (!expected) {
    CHECK(st == TT_ERR_UNSUPPORTED, "plan expected to be refused, got status %d", st);
    return;
  }
  CHECK(st == TT_OK, "plan: %s", tt_last_error());
  if (st != TT_OK) return;
  plan_str(n, s, got, sizeof got);
  char fs[64] = "", ts[64] = "";
  for (int m = 0; m < mesh_ndim; m++) {
    const tt_placement *p[2] = { &from[m], &to[m] };
    char *b[2] = { fs, ts };
    for (int k = 0; k < 2; k++)
      snprintf(b[k] + strlen(b[k]), 64 - strlen(b[k]), "%s%s", m ? "," : "",
               p[k]->kind == TT_PLACE_SHARD ? (p[k]->dim ? "S1" : "S0")
               : p[k]->kind == TT_PLACE_PARTIAL ? (p[k]->op == TT_RED_SUM ? "Ps" : p[k]->op == TT_RED_AVG ? "Pa" : "Pm")
                                                : "R");
  }
  CHECK(!strcmp(got, expected), "plan (%s) -> (%s)%s: got \"%s\", expected \"%s\"", fs, ts, order ? " (order given)" : "",
        got, expected);
  /* sizing: cap 0 gives the same count */
  int n0 = -1;
  CHECK(tt_dtensor_redistribute_plan(mesh_ndim, from, to, order, 0, NULL, &n0) == TT_OK && n0 == n, "cap 0 count");
}

static void test_plan_1d(void) {
  tt_placement P[6] = { R_, S_(0), S_(1), P_(TT_RED_SUM), P_(TT_RED_AVG), P_(TT_RED_MAX) };
  /* from (rows) -> to (columns): R, S0, S1, Ps, Pa, Pm; NULL: refused */
  const char *E[6][6] = {
    { "", "CH0:0", "CH0:1", "PA0/sum", "PA0/avg", "PA0/max" },
    { "AG0:0", "", "AA0:0>1", "AG0:0 PA0/sum", "AG0:0 PA0/avg", "AG0:0 PA0/max" },
    { "AG0:1", "AA0:1>0", "", "AG0:1 PA0/sum", "AG0:1 PA0/avg", "AG0:1 PA0/max" },
    { "AR0/sum", "RS0:0/sum", "RS0:1/sum", "", NULL, NULL },
    { "AR0/avg", "RS0:0/avg", "RS0:1/avg", NULL, "", NULL },
    { "AR0/max", "RS0:0/max", "RS0:1/max", NULL, NULL, "" },
  };
  for (int a = 0; a < 6; a++)
    for (int b = 0; b < 6; b++) check_plan(1, &P[a], &P[b], NULL, E[a][b]);
}

static void test_plan_2d(void) {
  const int o10[2] = { 1, 0 };
  tt_placement S0 = S_(0), S1 = S_(1), Ps = P_(TT_RED_SUM), Pa = P_(TT_RED_AVG), Pm = P_(TT_RED_MAX), R = R_;
#define PL(a, b) ((tt_placement[]){ a, b })
  /* nested shards are gathered innermost first, in `order` terms */
  check_plan(2, PL(S0, S0), PL(R, R), NULL, "AG1:0 AG0:0");
  check_plan(2, PL(S0, S0), PL(R, R), o10, "AG0:0 AG1:0");
  check_plan(2, PL(S0, S0), PL(S0, R), NULL, "AG1:0");
  check_plan(2, PL(S0, S0), PL(R, S0), NULL, "AG1:0 AG0:0 CH1:0");
  check_plan(2, PL(S0, S0), PL(R, S0), o10, "AG0:0");
  check_plan(2, PL(S0, S0), PL(S0, S1), NULL, "AA1:0>1");
  check_plan(2, PL(S0, S0), PL(S1, S1), NULL, "AG1:0 AA0:0>1 CH1:1");
  check_plan(2, PL(S0, S1), PL(S1, S0), NULL, "AG1:1 AA0:0>1 CH1:0");
  check_plan(2, PL(S1, S0), PL(S0, S1), NULL, "AG1:0 AA0:1>0 CH1:1");
  check_plan(2, PL(S0, R), PL(R, S0), NULL, "AG0:0 CH1:0");
  check_plan(2, PL(R, S0), PL(S0, R), NULL, "AG1:0 CH0:0");
  check_plan(2, PL(R, S0), PL(S0, S0), NULL, "AG1:0 CH0:0 CH1:0");
  check_plan(2, PL(R, S0), PL(S0, S0), o10, "CH0:0");
  check_plan(2, PL(S0, R), PL(S0, S1), NULL, "CH1:1");
  check_plan(2, PL(S0, S1), PL(S0, S1), o10, "");
  check_plan(2, PL(R, R), PL(S0, S1), NULL, "CH0:0 CH1:1");
  check_plan(2, PL(R, R), PL(S1, S1), o10, "CH1:1 CH0:1");
  /* Partial sources without shards: reduce-scatters outermost first */
  check_plan(2, PL(Ps, Ps), PL(S0, S0), NULL, "RS0:0/sum RS1:0/sum");
  check_plan(2, PL(Ps, Ps), PL(S0, S0), o10, "RS1:0/sum RS0:0/sum");
  check_plan(2, PL(Ps, Ps), PL(R, R), NULL, "AR0/sum AR1/sum");
  check_plan(2, PL(Ps, R), PL(Ps, S0), NULL, "CH1:0");
  check_plan(2, PL(S0, Ps), PL(R, R), NULL, "AR1/sum AG0:0");
  check_plan(2, PL(Ps, S0), PL(S0, R), NULL, "AG1:0 RS0:0/sum");
  check_plan(2, PL(Ps, S0), PL(S0, S0), NULL, "AG1:0 RS0:0/sum CH1:0");
  check_plan(2, PL(S0, S1), PL(Ps, Ps), NULL, "AG1:1 PA1/sum AG0:0 PA0/sum");
  check_plan(2, PL(R, S1), PL(Ps, R), NULL, "AG1:1 PA0/sum");
  check_plan(2, PL(Ps, Pa), PL(R, R), NULL, "AR0/sum AR1/avg");
  check_plan(2, PL(Pm, S0), PL(Pm, R), NULL, "AG1:0");
  check_plan(2, PL(Pm, Pm), PL(R, S1), NULL, "AR0/max RS1:1/max");
  /* refused: one reduction into another; reductions whose order matters */
  check_plan(2, PL(Ps, S0), PL(Pm, S0), NULL, NULL);
  check_plan(2, PL(Ps, Pm), PL(R, R), NULL, NULL);
  check_plan(2, PL(Pm, Ps), PL(Pm, R), NULL, NULL);
  check_plan(2, PL(Ps, Pm), PL(Ps, Pm), NULL, "");
  /* three mesh dims on one tensor dim */
  check_plan(3, (tt_placement[]){ S0, S0, S0 }, (tt_placement[]){ R, R, R }, NULL, "AG2:0 AG1:0 AG0:0");
  check_plan(3, (tt_placement[]){ S0, S0, S0 }, (tt_placement[]){ R, R, R }, (int[]){ 2, 0, 1 }, "AG1:0 AG0:0 AG2:0");
  check_plan(3, (tt_placement[]){ S0, S0, S0 }, (tt_placement[]){ S0, R, S0 }, NULL, "AG2:0 AG1:0 CH2:0");
#undef PL
}

/* Every plan over 1-, 2- and 3-D meshes replayed on the boxes of every
 * coordinate: it ends at `to`, and each collective's group cuts its pieces
 * from one parent (what lets it run on dim 0 of equal chunks). */
static int piece_ok(int64_t c_off, int64_t c_len, int64_t p_off, int64_t p_len, int k, int i) {
  int64_t ch = (p_len + k - 1) / k, s = (int64_t)i * ch, e = s + ch;
  if (s > p_len) s = p_len;
  if (e > p_len) e = p_len;
  return c_off == p_off + s && c_len == e - s;
}

static void test_plan_replay(void) {
  tt_placement P[5] = { R_, S_(0), S_(1), P_(TT_RED_SUM), P_(TT_RED_AVG) };
  int meshes[4][3] = { { 3, 0, 0 }, { 2, 3, 0 }, { 3, 2, 0 }, { 2, 2, 2 } };
  int mnd[4] = { 1, 2, 2, 3 };
  int perms3[6][3] = { { 0, 1, 2 }, { 0, 2, 1 }, { 1, 0, 2 }, { 1, 2, 0 }, { 2, 0, 1 }, { 2, 1, 0 } };
  int64_t global[2] = { 7, 5 };
  int plans = 0, bad = 0;
  for (int mi = 0; mi < 4 && !bad; mi++) {
    int mn = mnd[mi], *ms = meshes[mi], np = 1;
    for (int m = 0; m < mn; m++) np *= 5;
    int nperm = mn == 1 ? 1 : mn == 2 ? 2 : 6;
    for (int pi = 0; pi < nperm && !bad; pi++) {
      int ord[3];
      if (mn == 2) {
        ord[0] = pi;
        ord[1] = 1 - pi;
      } else if (mn == 3) {
        memcpy(ord, perms3[pi], sizeof ord);
      } else {
        ord[0] = 0;
      }
      for (int fa = 0; fa < np && !bad; fa++)
        for (int ta = 0; ta < np && !bad; ta++) {
          tt_placement from[3], to[3], cur[3];
          for (int m = 0, a = fa, b = ta; m < mn; m++, a /= 5, b /= 5) {
            from[m] = P[a % 5];
            to[m] = P[b % 5];
          }
          tt_redist_step s[32];
          int n = 0;
          tt_status st = tt_dtensor_redistribute_plan(mn, from, to, ord, 32, s, &n);
          int refused = 0; /* Partial(sum) <-> Partial(avg) on one mesh dim */
          for (int m = 0; m < mn; m++)
            refused |= from[m].kind == TT_PLACE_PARTIAL && to[m].kind == TT_PLACE_PARTIAL && from[m].op != to[m].op;
          if (refused) {
            CHECK(st == TT_ERR_UNSUPPORTED, "replay: a plan between two reductions was not refused");
            continue;
          }
          if (st != TT_OK) {
            CHECK(0, "replay: plan refused: %s", tt_last_error());
            bad = 1;
            break;
          }
          plans++;
          memcpy(cur, from, sizeof cur);
          int world = 1;
          for (int m = 0; m < mn; m++) world *= ms[m];
          for (int i = 0; i < n && !bad; i++) {
            tt_placement nxt[3];
            memcpy(nxt, cur, sizeof nxt);
            int m = s[i].mesh_dim;
            switch (s[i].kind) {
              case TT_REDIST_ALL_GATHER: bad |= !(cur[m].kind == TT_PLACE_SHARD && cur[m].dim == s[i].dim); nxt[m] = R_; break;
              case TT_REDIST_ALL_REDUCE: bad |= cur[m].kind != TT_PLACE_PARTIAL; nxt[m] = R_; break;
              case TT_REDIST_REDUCE_SCATTER: bad |= cur[m].kind != TT_PLACE_PARTIAL; nxt[m] = S_(s[i].dim); break;
              case TT_REDIST_CHUNK: bad |= cur[m].kind != TT_PLACE_REPLICATE; nxt[m] = S_(s[i].dim); break;
              case TT_REDIST_ALL_TO_ALL:
                bad |= !(cur[m].kind == TT_PLACE_SHARD && cur[m].dim == s[i].dim);
                nxt[m] = S_(s[i].dim2);
                break;
              default: bad |= cur[m].kind != TT_PLACE_REPLICATE; nxt[m] = P_(s[i].op); break;
            }
            for (int r = 0; r < world && !bad; r++) {
              int c[3];
              tt_box b, a;
              coord_of(r, mn, ms, c);
              tt_dtensor_local_box(2, global, mn, ms, c, cur, ord, &b);
              tt_dtensor_local_box(2, global, mn, ms, c, nxt, ord, &a);
              int k = ms[m], ci = c[m];
              for (int d = 0; d < 2; d++) {
                int cut_after = (s[i].kind == TT_REDIST_REDUCE_SCATTER || s[i].kind == TT_REDIST_CHUNK) && d == s[i].dim;
                int cut_before = s[i].kind == TT_REDIST_ALL_GATHER && d == s[i].dim;
                if (s[i].kind == TT_REDIST_ALL_TO_ALL) {
                  cut_before = d == s[i].dim;
                  cut_after = d == s[i].dim2;
                }
                if (cut_after) bad |= !piece_ok(a.offset[d], a.shape[d], b.offset[d], b.shape[d], k, ci);
                else if (cut_before) bad |= !piece_ok(b.offset[d], b.shape[d], a.offset[d], a.shape[d], k, ci);
                else bad |= a.offset[d] != b.offset[d] || a.shape[d] != b.shape[d];
              }
            }
            if (bad) {
              char got[256];
              plan_str(n, s, got, sizeof got);
              CHECK(0, "replay: mesh %d, order %d, from %d to %d: step %d of \"%s\" does not fit the pieces", mi, pi,
                    fa, ta, i, got);
            }
            memcpy(cur, nxt, sizeof cur);
          }
          for (int m = 0; m < mn && !bad; m++)
            if (cur[m].kind != to[m].kind || (to[m].kind == TT_PLACE_SHARD && cur[m].dim != to[m].dim) ||
                (to[m].kind == TT_PLACE_PARTIAL && cur[m].op != to[m].op)) {
              CHECK(0, "replay: mesh %d, order %d, from %d to %d: the plan ends elsewhere", mi, pi, fa, ta);
              bad = 1;
            }
        }
    }
  }
  CHECK(plans > 4000, "replayed %d plans", plans);
}

/* ---- bad input -------------------------------------------------------------------- */

static void expect_err(tt_status st, tt_status want, const char *needle) {
  CHECK(st == want, "status %d, expected %d (%s)", st, want, tt_last_error());
  CHECK(contains(tt_last_error(), needle), "message \"%s\" lacks \"%s\"", tt_last_error(), needle);
  CHECK(!strchr(tt_last_error(), '\n'), "one line: \"%s\"", tt_last_error());
}

static void test_bad_input(void) {
  int64_t g[2] = { 10, 4 };
  int ms[2] = { 2, 3 }, c[2] = { 1, 2 };
  tt_placement pl[2] = { S_(0), R_ };
  tt_box b;
  expect_err(tt_dtensor_local_box(9, g, 2, ms, c, pl, NULL, &b), TT_ERR_INVALID, "9 dims; expected 0 to 8");
  expect_err(tt_dtensor_local_box(2, g, 0, ms, c, pl, NULL, &b), TT_ERR_INVALID, "0 dims; expected 1 to 8");
  expect_err(tt_dtensor_local_box(2, g, 9, ms, c, pl, NULL, &b), TT_ERR_INVALID, "9 dims; expected 1 to 8");
  expect_err(tt_dtensor_local_box(2, g, 2, (int[]){ 2, 0 }, c, pl, NULL, &b), TT_ERR_INVALID,
             "mesh dim 1 has size 0; expected >= 1");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, (int[]){ 1, 3 }, pl, NULL, &b), TT_ERR_INDEX,
             "coordinate 3 along mesh dim 1; expected one in [0, 3)");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, (int[]){ -1, 0 }, pl, NULL, &b), TT_ERR_INDEX, "coordinate -1");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, c, (tt_placement[]){ R_, S_(2) }, NULL, &b), TT_ERR_INVALID,
             "placements[1] is Shard(2) but the tensor has 2 dims");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, c, (tt_placement[]){ R_, P_(7) }, NULL, &b), TT_ERR_INVALID,
             "Partial with reduction 7");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, c, (tt_placement[]){ { 5, 0, 0 }, R_ }, NULL, &b), TT_ERR_INVALID,
             "placements[0] has kind 5");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, c, pl, (int[]){ 1, 1 }, &b), TT_ERR_INVALID,
             "expected a permutation of the mesh dims 0..1");
  expect_err(tt_dtensor_local_box(2, g, 2, ms, c, pl, (int[]){ 0, 2 }, &b), TT_ERR_INVALID, "order[1] = 2");
  expect_err(tt_dtensor_local_box(2, (int64_t[]){ 10, -1 }, 2, ms, c, pl, NULL, &b), TT_ERR_INVALID,
             "global size -1 in dim 1");

  int n = 0, rk[4];
  tt_box want, bx[4];
  memset(&want, 0, sizeof want);
  want.offset[0] = 8;
  want.shape[0] = 3;
  want.shape[1] = 4;
  expect_err(tt_dtensor_owners(2, g, 2, ms, pl, NULL, &want, 0, 4, rk, bx, &n), TT_ERR_INDEX,
             "covers [8, 11) of dim 0; expected a range inside [0, 10)");
  want.shape[0] = 2;
  expect_err(tt_dtensor_owners(2, g, 2, ms, pl, NULL, &want, 0, 4, NULL, bx, &n), TT_ERR_INVALID,
             "NULL ranks or boxes");
  expect_err(tt_dtensor_owners(2, g, 2, ms, pl, NULL, &want, 0, -1, rk, bx, &n), TT_ERR_INVALID, "cap -1");

  tt_redist_step s[8];
  expect_err(tt_dtensor_redistribute_plan(1, (tt_placement[]){ P_(TT_RED_SUM) }, (tt_placement[]){ P_(TT_RED_MAX) },
                                          NULL, 8, s, &n),
             TT_ERR_UNSUPPORTED, "mesh dim 0 goes from Partial(sum) to Partial(max)");
  expect_err(tt_dtensor_redistribute_plan(2, (tt_placement[]){ R_, P_(TT_RED_AVG) },
                                          (tt_placement[]){ R_, P_(TT_RED_MIN) }, NULL, 8, s, &n),
             TT_ERR_UNSUPPORTED, "mesh dim 1 goes from Partial(avg) to Partial(min)");
  expect_err(tt_dtensor_redistribute_plan(2, (tt_placement[]){ P_(TT_RED_SUM), P_(TT_RED_MAX) },
                                          (tt_placement[]){ R_, R_ }, NULL, 8, s, &n),
             TT_ERR_UNSUPPORTED, "mesh dims 0 and 1 are Partial(sum) and Partial(max)");
  expect_err(tt_dtensor_redistribute_plan(1, (tt_placement[]){ S_(8) }, (tt_placement[]){ R_ }, NULL, 8, s, &n),
             TT_ERR_INVALID, "from[0] is Shard(8); expected a tensor dim in [0, 8)");
  expect_err(tt_dtensor_redistribute_plan(2, pl, pl, (int[]){ 0, 0 }, 8, s, &n), TT_ERR_INVALID, "order[1] = 0");

  /* the executor: a piece of the wrong shape, a missing or mismatched group;
   * nothing leaks on the way out */
  int64_t live = tt_tensor_live_count();
  tt_tensor *in = NULL, *out = NULL;
  tt_device cpu = { TT_CPU, 0 };
  tt_tensor_empty(2, (int64_t[]){ 4, 4 }, TT_F32, cpu, &in);
  tt_tensor_fill(in, 1.0);
  int ms1[1] = { 3 }, c1[1] = { 1 };
  expect_err(tt_dtensor_redistribute(NULL, 2, g, 1, ms1, (int[]){ 2 }, (tt_placement[]){ S_(0) },
                                     (tt_placement[]){ R_ }, NULL, in, &out),
             TT_ERR_SHAPE, "the local piece is [4, 4]; expected [2, 4]");
  CHECK(out == NULL, "no output on failure");
  int64_t g4[2] = { 12, 4 };
  expect_err(tt_dtensor_redistribute(NULL, 2, g4, 1, ms1, c1, (tt_placement[]){ S_(0) }, (tt_placement[]){ R_ }, NULL,
                                     in, &out),
             TT_ERR_INVALID, "runs all_gather over mesh dim 0 but its group is NULL");
  tt_group *fake = NULL;
  CHECK(tt_group_new("fake", 0, 2, NULL, 0, 0, &fake) == TT_OK, "%s", tt_last_error());
  tt_group *gs[1] = { fake };
  expect_err(tt_dtensor_redistribute(gs, 2, g4, 1, ms1, c1, (tt_placement[]){ S_(0) }, (tt_placement[]){ R_ }, NULL,
                                     in, &out),
             TT_ERR_INVALID, "the group of mesh dim 0 is rank 0 of 2; expected rank 1 (the coordinate) of 3");
  expect_err(tt_dtensor_redistribute(gs, 2, g4, 1, ms1, c1, (tt_placement[]){ P_(TT_RED_SUM) },
                                     (tt_placement[]){ P_(TT_RED_MAX) }, NULL, in, &out),
             TT_ERR_SHAPE, "expected [12, 4]");
  /* no collective needed: groups may be NULL (a local chunk, a partial) */
  tt_tensor *whole = NULL;
  tt_tensor_empty(2, g4, TT_F32, cpu, &whole);
  tt_tensor_arange(whole, 0, 1);
  CHECK(tt_dtensor_redistribute(NULL, 2, g4, 1, ms1, c1, (tt_placement[]){ R_ }, (tt_placement[]){ S_(0) }, NULL,
                                whole, &out) == TT_OK,
        "%s", tt_last_error());
  if (out) {
    float v[16];
    tt_tensor_to_host(out, v, sizeof v);
    CHECK(out->shape[0] == 4 && v[0] == 16.0f && v[15] == 31.0f, "Replicate -> Shard(0), rank 1 of 3: rows 4..7");
    tt_tensor_release(out);
    out = NULL;
  }
  CHECK(tt_dtensor_redistribute(NULL, 2, g4, 1, ms1, c1, (tt_placement[]){ R_ }, (tt_placement[]){ P_(TT_RED_SUM) },
                                NULL, whole, &out) == TT_OK,
        "%s", tt_last_error());
  if (out) {
    float v[48];
    tt_tensor_to_host(out, v, sizeof v);
    CHECK(out != whole && v[0] == 0.0f && v[47] == 0.0f, "Replicate -> Partial(sum) off coordinate 0: zeros");
    tt_tensor_release(out);
    out = NULL;
  }
  CHECK(tt_dtensor_redistribute(NULL, 2, g4, 1, ms1, c1, (tt_placement[]){ R_ }, (tt_placement[]){ R_ }, NULL, whole,
                                &out) == TT_OK &&
            out && out != whole,
        "from == to: a new tensor");
  if (out) tt_tensor_release(out);
  out = NULL;
  /* a strided piece (a transposed view) is read through its strides */
  tt_tensor *wt = NULL, *t = NULL;
  tt_tensor_empty(2, (int64_t[]){ 4, 12 }, TT_F32, cpu, &wt);
  tt_tensor_arange(wt, 0, 1);
  tt_view_transpose(wt, 0, 1, &t);
  CHECK(tt_dtensor_redistribute(NULL, 2, g4, 1, ms1, c1, (tt_placement[]){ R_ }, (tt_placement[]){ S_(0) }, NULL, t,
                                &out) == TT_OK,
        "%s", tt_last_error());
  if (out) {
    float v[16];
    tt_tensor_to_host(out, v, sizeof v);
    CHECK(v[0] == 4.0f && v[1] == 16.0f && v[4] == 5.0f && v[15] == 43.0f, "a transposed piece, rows 4..7");
    tt_tensor_release(out);
    out = NULL;
  }
  tt_tensor_release(t);
  tt_tensor_release(wt);
  /* the meta device and the fake backend (dry runs): shapes only */
  tt_device meta = { TT_META, 0 };
  tt_group *f2 = NULL, *f3 = NULL;
  tt_group_new("fake", 1, 2, NULL, 0, 0, &f2);
  tt_group_new("fake", 2, 3, NULL, 0, 0, &f3);
  tt_group *g23[2] = { f2, f3 };
  int64_t gm[2] = { 7, 5 };
  int ms23[2] = { 2, 3 }, c23[2] = { 1, 2 };
  tt_placement fm[2] = { S_(0), S_(1) }, tm[2] = { S_(1), S_(0) };
  tt_box fb, tb;
  tt_dtensor_local_box(2, gm, 2, ms23, c23, fm, NULL, &fb);
  tt_dtensor_local_box(2, gm, 2, ms23, c23, tm, NULL, &tb);
  tt_tensor *mi = NULL;
  tt_tensor_empty(2, fb.shape, TT_F32, meta, &mi);
  CHECK(tt_dtensor_redistribute(g23, 2, gm, 2, ms23, c23, fm, tm, NULL, mi, &out) == TT_OK, "meta: %s",
        tt_last_error());
  if (out) {
    CHECK(out->device.type == TT_META && out->shape[0] == tb.shape[0] && out->shape[1] == tb.shape[1],
          "meta: the target piece's shape");
    tt_tensor_release(out);
    out = NULL;
  }
  tt_tensor_release(mi);
  tt_group_free(f2);
  tt_group_free(f3);
  tt_group_free(fake);
  tt_tensor_release(whole);
  tt_tensor_release(in);
  CHECK(tt_tensor_live_count() == live, "tensors leaked: %lld live, %lld before", (long long)tt_tensor_live_count(),
        (long long)live);
}

/* ---- redistribute on simulated ranks ------------------------------------------------ */

#define GR 5
#define GC 7
#define MAXW 8

typedef struct {
  int mesh_ndim, mesh_shape[3];
  const int *order;
  tt_placement from[3], to[3];
  float G[GR * GC];
  float *outs[MAXW];
  int64_t out_shape[MAXW][2];
  char err[MAXW][256];
} rcase;

static const int64_t GLOBAL[2] = { GR, GC };

/* Rank (coord)'s value of global element x under the Partial dims of pl:
 * small integers whose sum, avg or max over those dims is exactly G[x]. */
static float partial_value(const rcase *k, const tt_placement *pl, const int *coord, int64_t x) {
  float g = k->G[x];
  int Q = 1, q = 0, op = -1;
  for (int m = 0; m < k->mesh_ndim; m++)
    if (pl[m].kind == TT_PLACE_PARTIAL) {
      q = q * k->mesh_shape[m] + coord[m];
      Q *= k->mesh_shape[m];
      op = pl[m].op;
    }
  if (op < 0) return g;
  if (op == TT_RED_SUM) {
    /* rank q > 0 holds e(x, q); rank 0 holds the rest */
    if (q > 0) return (float)((x * 7 + q * 3) % 11 - 5);
    float rest = g;
    for (int r = 1; r < Q; r++) rest -= (float)((x * 7 + r * 3) % 11 - 5);
    return rest;
  }
  if (op == TT_RED_AVG) {
    /* g + offsets that cancel along each Partial dim on its own */
    float v = g;
    for (int m = 0; m < k->mesh_ndim; m++)
      if (pl[m].kind == TT_PLACE_PARTIAL)
        v += (float)((2 * coord[m] - (k->mesh_shape[m] - 1)) * ((x + m) % 3 + 1));
    return v;
  }
  /* max: below g everywhere but at one coordinate */
  return g - (float)((x + q) % Q);
}

static int rank_fn(int rank, int world, void *arg) {
  rcase *k = arg;
  int coord[3];
  tt_group *wg = NULL, *groups[3] = { NULL, NULL, NULL };
  tt_tensor *in = NULL, *out = NULL;
  tt_device cpu = { TT_CPU, 0 };
  tt_status st;
  coord_of(rank, k->mesh_ndim, k->mesh_shape, coord);
  st = tt_group_new("local", rank, world, NULL, 0, 0, &wg);
  /* the group along mesh dim m: the ranks that differ only in coord[m] */
  for (int m = 0; m < k->mesh_ndim && st == TT_OK; m++) {
    int color = 0;
    for (int j = 0; j < k->mesh_ndim; j++) color = color * k->mesh_shape[j] + (j == m ? 0 : coord[j]);
    st = tt_group_split(wg, color, coord[m], &groups[m]);
  }
  tt_box b;
  if (st == TT_OK)
    st = tt_dtensor_local_box(2, GLOBAL, k->mesh_ndim, k->mesh_shape, coord, k->from, k->order, &b);
  if (st == TT_OK) st = tt_tensor_empty(2, b.shape, TT_F32, cpu, &in);
  if (st == TT_OK) {
    float *p = tt_tensor_data(in);
    for (int64_t i = 0; i < b.shape[0]; i++)
      for (int64_t j = 0; j < b.shape[1]; j++)
        p[i * b.shape[1] + j] = partial_value(k, k->from, coord, (b.offset[0] + i) * GC + b.offset[1] + j);
    st = tt_dtensor_redistribute(groups, 2, GLOBAL, k->mesh_ndim, k->mesh_shape, coord, k->from, k->to, k->order, in,
                                 &out);
  }
  if (st == TT_OK) {
    int64_t n = tt_tensor_numel(out);
    k->outs[rank] = malloc((size_t)(n ? n : 1) * sizeof(float));
    k->out_shape[rank][0] = out->shape[0];
    k->out_shape[rank][1] = out->shape[1];
    st = tt_tensor_to_host(out, k->outs[rank], (size_t)n * sizeof(float));
  }
  if (st != TT_OK) snprintf(k->err[rank], sizeof k->err[rank], "%s", tt_last_error());
  if (in) tt_tensor_release(in);
  if (out) tt_tensor_release(out);
  for (int m = 0; m < 3; m++) tt_group_free(groups[m]);
  tt_group_free(wg);
  return st == TT_OK ? 0 : 1;
}

static const char *pl_name(tt_placement p, char *buf) {
  if (p.kind == TT_PLACE_SHARD) sprintf(buf, "S%d", p.dim);
  else if (p.kind == TT_PLACE_PARTIAL) sprintf(buf, "P%s", red(p.op));
  else sprintf(buf, "R");
  return buf;
}

static void case_name(const rcase *k, char *buf, size_t len) {
  char a[3][8], b[3][8];
  int n = snprintf(buf, len, "mesh");
  for (int m = 0; m < k->mesh_ndim; m++) n += snprintf(buf + n, len - (size_t)n, "%s%d", m ? "x" : " ", k->mesh_shape[m]);
  for (int m = 0; k->order && m < k->mesh_ndim; m++)
    n += snprintf(buf + n, len - (size_t)n, "%s%d", m ? "," : " order ", k->order[m]);
  n += snprintf(buf + n, len - (size_t)n, " (");
  for (int m = 0; m < k->mesh_ndim; m++) n += snprintf(buf + n, len - (size_t)n, "%s%s", m ? "," : "", pl_name(k->from[m], a[m]));
  n += snprintf(buf + n, len - (size_t)n, ") -> (");
  for (int m = 0; m < k->mesh_ndim; m++) n += snprintf(buf + n, len - (size_t)n, "%s%s", m ? "," : "", pl_name(k->to[m], b[m]));
  snprintf(buf + n, len - (size_t)n, ")");
}

/* Runs one case on world ranks and checks every rank's piece. Returns 0
 * when it failed (so the caller can stop after a few). */
static int run_case(rcase *k) {
  int world = 1, failed = -1;
  char name[160];
  for (int m = 0; m < k->mesh_ndim; m++) world *= k->mesh_shape[m];
  for (int r = 0; r < MAXW; r++) {
    k->outs[r] = NULL;
    k->err[r][0] = 0;
  }
  case_name(k, name, sizeof name);
  int64_t live = tt_tensor_live_count();
  tt_status st = tt_sim_run(world, rank_fn, k, &failed);
  int ok = st == TT_OK;
  CHECK(ok, "%s: %s (rank %d: %s)", name, tt_last_error(), failed, failed >= 0 ? k->err[failed] : "");
  /* (a failed run leaves the other ranks' tensors where they stopped) */
  if (ok) CHECK(tt_tensor_live_count() == live, "%s: tensors leaked", name);
  int has_partial = 0, from_partial = 0;
  for (int m = 0; m < k->mesh_ndim; m++) {
    has_partial |= k->to[m].kind == TT_PLACE_PARTIAL;
    from_partial |= k->from[m].kind == TT_PLACE_PARTIAL;
  }
  for (int r = 0; r < world && ok; r++) {
    int c[3];
    tt_box b;
    coord_of(r, k->mesh_ndim, k->mesh_shape, c);
    tt_dtensor_local_box(2, GLOBAL, k->mesh_ndim, k->mesh_shape, c, k->to, k->order, &b);
    if (k->out_shape[r][0] != b.shape[0] || k->out_shape[r][1] != b.shape[1]) {
      CHECK(0, "%s: rank %d got [%lld, %lld], expected [%lld, %lld]", name, r, (long long)k->out_shape[r][0],
            (long long)k->out_shape[r][1], (long long)b.shape[0], (long long)b.shape[1]);
      ok = 0;
      break;
    }
    /* the coordinates whose pieces reduce into this one (to's Partial dims) */
    int skip = 0;
    for (int m = 0; m < k->mesh_ndim; m++)
      if (k->to[m].kind == TT_PLACE_PARTIAL && c[m]) skip = 1;
    for (int64_t i = 0; i < b.shape[0] && ok; i++)
      for (int64_t j = 0; j < b.shape[1] && ok; j++) {
        int64_t x = (b.offset[0] + i) * GC + b.offset[1] + j, li = i * b.shape[1] + j;
        float got = k->outs[r][li];
        if (has_partial && !from_partial) {
          /* Replicate -> Partial is documented: the values at coordinate 0
           * (and everywhere for avg/max), zeros elsewhere for sum */
          int zero = 0;
          for (int m = 0; m < k->mesh_ndim; m++)
            if (k->to[m].kind == TT_PLACE_PARTIAL && k->to[m].op == TT_RED_SUM && c[m]) zero = 1;
          float want = zero ? 0.0f : k->G[x];
          if (memcmp(&got, &want, sizeof got)) {
            CHECK(0, "%s: rank %d element (%lld, %lld): %g, expected %g", name, r, (long long)(b.offset[0] + i),
                  (long long)(b.offset[1] + j), got, want);
            ok = 0;
          }
          continue;
        }
        if (has_partial) {
          if (skip) continue;
          /* reduce over to's Partial dims (one op a case), in double: the
           * values are small integers, so any order is exact */
          double acc = 0;
          int Q = 0, op = -1;
          for (int r2 = 0; r2 < world; r2++) {
            int c2[3], same = 1;
            coord_of(r2, k->mesh_ndim, k->mesh_shape, c2);
            for (int m = 0; m < k->mesh_ndim; m++)
              if (k->to[m].kind != TT_PLACE_PARTIAL && c2[m] != c[m]) same = 0;
            if (!same) continue;
            for (int m = 0; m < k->mesh_ndim; m++)
              if (k->to[m].kind == TT_PLACE_PARTIAL) op = k->to[m].op;
            double v = k->outs[r2][li];
            acc = Q == 0 ? v : op == TT_RED_MAX ? (v > acc ? v : acc) : acc + v;
            Q++;
          }
          if (op == TT_RED_AVG) acc /= Q;
          if ((float)acc != k->G[x]) {
            CHECK(0, "%s: rank %d element (%lld, %lld) reduces to %g, expected %g", name, r,
                  (long long)(b.offset[0] + i), (long long)(b.offset[1] + j), acc, k->G[x]);
            ok = 0;
          }
          continue;
        }
        if (memcmp(&got, &k->G[x], sizeof got)) {
          CHECK(0, "%s: rank %d element (%lld, %lld): %g, expected %g", name, r, (long long)(b.offset[0] + i),
                (long long)(b.offset[1] + j), got, k->G[x]);
          ok = 0;
        }
      }
  }
  for (int r = 0; r < MAXW; r++) free(k->outs[r]);
  return ok;
}

static void test_redistribute(void) {
  rcase k;
  memset(&k, 0, sizeof k);
  for (int x = 0; x < GR * GC; x++) k.G[x] = (float)((x * 37) % 101 - 50); /* distinct integers */
  /* 5 x 7 over 8 and over 2 x 3 leaves empty pieces; 2 x 2 x 2 nests
   * three mesh dims on two tensor dims */
  int meshes[8][3] = { { 2 }, { 3 }, { 4 }, { 8 }, { 2, 2 }, { 2, 3 }, { 3, 2 }, { 2, 2, 2 } };
  int mnd[8] = { 1, 1, 1, 1, 2, 2, 2, 3 };
  static const int orders2[2][2] = { { 0, 1 }, { 1, 0 } };
  static const int orders3[6][3] = { { 0, 1, 2 }, { 0, 2, 1 }, { 1, 0, 2 }, { 1, 2, 0 }, { 2, 0, 1 }, { 2, 1, 0 } };
  int ops[3] = { TT_RED_SUM, TT_RED_AVG, TT_RED_MAX };
  int cases = 0, failures = 0;
  for (int oi = 0; oi < 3; oi++) {
    tt_placement P[4] = { R_, S_(0), S_(1), P_(ops[oi]) };
    for (int mi = 0; mi < 8; mi++) {
      k.mesh_ndim = mnd[mi];
      memcpy(k.mesh_shape, meshes[mi], sizeof k.mesh_shape);
      int np = 1;
      for (int m = 0; m < k.mesh_ndim; m++) np *= 4;
      int norders = k.mesh_ndim == 1 ? 1 : k.mesh_ndim == 2 ? 2 : 6;
      for (int oo = 0; oo < norders; oo++) {
        k.order = k.mesh_ndim == 1 ? NULL : k.mesh_ndim == 2 ? orders2[oo] : orders3[oo];
        if (oo == 0) k.order = NULL; /* NULL is the mesh dims in order */
        if (oi > 0 && k.mesh_ndim == 3 && oo != 0 && oo != 3 && oo != 5) continue; /* time: three orders do */
        for (int fa = 0; fa < np; fa++)
          for (int ta = 0; ta < np; ta++) {
            int partial = 0;
            for (int m = 0, a = fa, b = ta; m < k.mesh_ndim; m++, a /= 4, b /= 4) {
              k.from[m] = P[a % 4];
              k.to[m] = P[b % 4];
              partial |= a % 4 == 3 || b % 4 == 3;
            }
            /* avg and max: the pairs the sum pass did not already run */
            if (oi > 0 && !partial) continue;
            cases++;
            if (!run_case(&k) && ++failures > 10) return;
          }
      }
    }
  }
  printf("redistribute: %d cases on simulated ranks\n", cases);
}

int main(void) {
  test_box_1d();
  test_box_nested();
  test_box_coverage();
  test_owners();
  test_plan_1d();
  test_plan_2d();
  test_plan_replay();
  test_bad_input();
  test_redistribute();
  return tt_test_summary("test_dtensor");
}
