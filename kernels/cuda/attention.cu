/*
 * attention.cu — scaled-dot-product attention on CUDA, forward and backward:
 * the table entries, the choice between the two paths, and the cuDNN path.
 *
 * Semantics are kernels/cpu/attention.c's: q [B,T,Hq,D], k/v [B,S,Hkv,D],
 * o [B,T,Hq,D], lse [B,Hq,T] = natural-log log-sum-exp of each scaled score
 * row (f32; f64 for f64 input), query head h reads kv head h / (Hq/Hkv),
 * causal query t sees keys s <= t + (S - T), a row that sees no key gets
 * o = 0 and lse = -inf. dq, dk, dv are written, not accumulated.
 *
 * Two paths.
 *  1. cuDNN SDPA (flash attention), bf16 and f16, built by hand through the
 *     backend (graph) API: the operation graph cudnn-frontend's composite
 *     SDPA node emits for cuDNN 9 (matmul -> scale -> mask -> softmax ->
 *     matmul, and its backward), which cuDNN's fused attention engines
 *     recognise. A graph + execution plan is built once per (direction,
 *     dtype, B, T, S, Hq, Hkv, D, causal, deterministic mode) and kept in a
 *     small per-device cache (ATT_CACHE entries, round-robin eviction); a
 *     shape cuDNN refused is cached too, so it is not retried. One
 *     per-device workspace is allocated on first need and grown when a plan
 *     needs more (never shrunk); steady state allocates nothing. Runs on the
 *     device's compute stream.
 *  2. The plain CUDA kernels of attention_fallback.cu (tiled online softmax,
 *     deterministic two-pass backward) for everything else: f32 and f64,
 *     head dims that are not a multiple of 8 (or above what the GPU's cuDNN
 *     engines take), GPUs before sm_80, causal with S < T (rows that see no
 *     key), misaligned pointers, and any graph cuDNN rejects while the plan
 *     is built. The choice is logged once per (direction, shape, dtype) on
 *     stderr. A built plan that cudnnBackendExecute refuses (NOT_SUPPORTED
 *     or EXECUTION_FAILED) is remembered as unavailable and the fallback
 *     serves, except during a CUDA graph capture (an error there); any
 *     other failure (BAD_PARAM: this file's bug) is an error.
 *
 * Deterministic mode (tt_deterministic(), config debug.deterministic). The
 * SDPA backward engines may accumulate dQ across key blocks with float
 * atomics, so the bits of dQ depend on timing. In this mode the backward
 * graph asks for the deterministic algorithm the way cudnn-frontend does on
 * Hopper: dQ = dS K is written straight to dQ, with no non-virtual f32 dQ
 * accumulator (the accumulator is what selects the atomic engine). As a
 * second guard every engine config whose numerical notes include
 * CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC (or whose notes cannot be read) is
 * skipped; cuDNN 9.19's SDPA engines note only TENSOR_CORE, so today the
 * graph alone decides. When no config is left, the call goes to the
 * fallback kernels (deterministic by construction), logged once per shape.
 * The mode is part of the plan key: switching it never reuses a plan built
 * for the other.
 *
 * The graphs. Tensors are 4-d [batch, heads, seq, dim] views of our
 * [B, seq, heads, D] buffers, so no transposes are needed; strides in
 * elements:
 *   Q, O, dO, dQ  [B,Hq,T,D]    strides {T*Hq*D, D, Hq*D, 1}
 *   K, V, dK, dV  [B,Hkv,S,D]   strides {S*Hkv*D, D, Hkv*D, 1}
 *   K^T (and V^T) [B,Hkv,D,S]   strides {S*Hkv*D, D, 1, Hkv*D}   (same memory)
 *   Stats = lse   [B,Hq,T,1]    strides {Hq*T, T, 1, 1}           (f32)
 * Grouped-query heads are the matmuls' batch broadcast (Hq a multiple of
 * Hkv); in the backward dK and dV are first made per query head (virtual)
 * and reduced to the kv heads. Scalars (the scale, the mask's fill value,
 * the causal offset) are by-value tensors [1,1,1,1]. Virtual intermediates
 * are f32, except the probabilities fed to a matmul (io dtype).
 *
 *  forward:  S = Q K^T;  S *= scale;  [causal: S = row + (S-T) >= col ? S : -FLT_MAX]
 *            m = max_row(S); E = exp(S - m); z = sum_row(E);
 *            Stats = m + log(z)   (natural log: exactly our lse);  P = E / z;  O = P V
 *  backward: Sd = rowsum(dO * O) * 1   (f32 [B,Hq,T,1], scratch in our workspace)
 *            P = exp(scale Q K^T - Stats)  [causal mask after the subtraction]
 *            dV = P^T dO;  dS = P (dO V^T - Sd) scale;  dK = dS^T Q;
 *            dQacc = dS K (f32 [B,Hq,T,D], scratch in our workspace);  dQ = identity(dQacc)
 * The causal mask compares generated row/column indices; with S == T it is
 * the plain top-left mask, otherwise the row index is shifted by +S then -T
 * (cuDNN's "bottom-right" alignment). Dropout is off (no RNG nodes).
 *
 * Tensor uids: Q 1, K 2, V 3, O 4, Stats 5, dO 6, dQ 7, dK 8, dV 9,
 * softmax-sum scratch 10, dQ accumulator 11, scale 12, one 13, mask fill 14,
 * S 15, T 16; virtual tensors from 100 up.
 */
#include <cudnn.h>
#include <float.h>
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention.cuh"

#define ATT_CACHE 32     /* plans per device */
#define ATT_DESCS 160    /* descriptors one plan keeps alive */
#define ATT_OPS 48       /* operations in one graph */
#define ATT_CFGS 8       /* engine configs tried per heuristics mode */
#define ATT_LOGGED 256   /* (direction, shape, dtype, mode) keys whose fallback was announced */
#define ATT_REASON 320   /* bytes of a "why cuDNN is not used" text */
#define ATT_ALIGN 16     /* byte alignment the graphs declare for every tensor */
#define ATT_WS_ROUND (1u << 20)

enum { ATT_FWD = 0, ATT_BWD = 1 };

enum {
  UID_Q = 1,
  UID_K,
  UID_V,
  UID_O,
  UID_STATS,
  UID_DO,
  UID_DQ,
  UID_DK,
  UID_DV,
  UID_SOFTMAX_SUM, /* backward scratch: rowsum(dO * O), f32 [B,Hq,T,1] */
  UID_DQ_ACCUM,    /* backward scratch: f32 dQ accumulator [B,Hq,T,D] */
  UID_SCALE,       /* by value: f32 */
  UID_ONE,         /* by value: f32 1 */
  UID_NEG_INF,     /* by value: f32 -FLT_MAX, the masked score */
  UID_SKV,         /* by value: i32 S */
  UID_SQ,          /* by value: i32 T */
  UID_VIRTUAL = 100
};

/* Compared with memcmp: always memset before filling. */
struct att_key {
  int32_t dir, dtype, causal, det; /* det: built for deterministic mode */
  int64_t B, T, S, Hq, Hkv, D;
};

/* ------------------------------------------------------------------------ */
/* Graph building: every descriptor goes into one list (destroyed together)  */
/* and the first failure sticks, so the graph code reads as a plain list.    */
/* ------------------------------------------------------------------------ */

struct att_graph {
  cudnnBackendDescriptor_t descs[ATT_DESCS];
  int ndescs;
  cudnnBackendDescriptor_t ops[ATT_OPS];
  int nops;
  int64_t next_uid;
  cudnnDataType_t io; /* CUDNN_DATA_BFLOAT16 or CUDNN_DATA_HALF */
  cudnnStatus_t status;
  char failure[ATT_REASON]; /* "<call> at attention.cu:<line>: <status>: <cuDNN's last message>" */
};

static void att_graph_release(att_graph *g) {
  for (int i = g->ndescs - 1; i >= 0; i--) cudnnBackendDestroyDescriptor(g->descs[i]);
  g->ndescs = 0;
  g->nops = 0;
}

/* cuDNN's own explanation of its last failure, on this thread. */
static void att_last_cudnn_message(char *buf, size_t n) {
  buf[0] = 0;
  cudnnGetLastErrorString(buf, n);
  for (char *c = buf; *c; c++)
    if (*c == '\n' || *c == '\r') *c = ' ';
}

static void att_graph_fail(att_graph *g, cudnnStatus_t st, const char *what, int line) {
  if (g->status != CUDNN_STATUS_SUCCESS) return;
  char msg[256];
  att_last_cudnn_message(msg, sizeof msg);
  g->status = st;
  snprintf(g->failure, sizeof g->failure, "%s at %s:%d: %s%s%s", what, tt_cuda_short_file(__FILE__), line,
           cudnnGetErrorString(st), msg[0] ? ": " : "", msg);
}

static cudnnBackendDescriptor_t att_new(att_graph *g, cudnnBackendDescriptorType_t type, const char *what, int line) {
  if (g->status != CUDNN_STATUS_SUCCESS) return NULL;
  if (g->ndescs == ATT_DESCS) {
    att_graph_fail(g, CUDNN_STATUS_INTERNAL_ERROR, "descriptor list full (raise ATT_DESCS)", line);
    return NULL;
  }
  cudnnBackendDescriptor_t d = NULL;
  cudnnStatus_t st = cudnnBackendCreateDescriptor(type, &d);
  if (st != CUDNN_STATUS_SUCCESS) {
    att_graph_fail(g, st, what, line);
    return NULL;
  }
  g->descs[g->ndescs++] = d;
  return d;
}

static void att_set(att_graph *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                    cudnnBackendAttributeType_t type, int64_t count, const void *value, const char *what, int line) {
  if (g->status != CUDNN_STATUS_SUCCESS) return;
  cudnnStatus_t st = cudnnBackendSetAttribute(d, name, type, count, value);
  if (st != CUDNN_STATUS_SUCCESS) att_graph_fail(g, st, what, line);
}

static void att_finalize(att_graph *g, cudnnBackendDescriptor_t d, const char *what, int line) {
  if (g->status != CUDNN_STATUS_SUCCESS) return;
  cudnnStatus_t st = cudnnBackendFinalize(d);
  if (st != CUDNN_STATUS_SUCCESS) att_graph_fail(g, st, what, line);
}

#define ATT_NEW(g, type) att_new(g, type, "cudnnBackendCreateDescriptor(" #type ")", __LINE__)
#define ATT_SET(g, d, name, type, count, value) \
  att_set(g, d, name, type, count, value, "cudnnBackendSetAttribute(" #name ")", __LINE__)
#define ATT_FINALIZE(g, d, what) att_finalize(g, d, "cudnnBackendFinalize(" what ")", __LINE__)

/* A 4-d shape: dims and strides in elements. */
struct att_shape {
  int64_t d[4], s[4];
};

static att_shape att_shp(int64_t d0, int64_t d1, int64_t d2, int64_t d3, int64_t s0, int64_t s1, int64_t s2,
                         int64_t s3) {
  att_shape x = {{d0, d1, d2, d3}, {s0, s1, s2, s3}};
  return x;
}

/* Packed (row-major) strides. */
static att_shape att_packed(int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  return att_shp(d0, d1, d2, d3, d1 * d2 * d3, d2 * d3, d3, 1);
}

static cudnnBackendDescriptor_t att_tensor(att_graph *g, int64_t uid, cudnnDataType_t type, att_shape shape,
                                           bool is_virtual, bool by_value) {
  cudnnBackendDescriptor_t t = ATT_NEW(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t align = ATT_ALIGN;
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, shape.d);
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, shape.s);
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
  ATT_SET(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
  if (by_value) ATT_SET(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
  ATT_FINALIZE(g, t, "tensor");
  return t;
}

/* A tensor the variant pack binds (device memory). */
static cudnnBackendDescriptor_t att_io(att_graph *g, int64_t uid, cudnnDataType_t type, att_shape shape) {
  return att_tensor(g, uid, type, shape, false, false);
}

/* A host scalar passed by value. */
static cudnnBackendDescriptor_t att_scalar(att_graph *g, int64_t uid, cudnnDataType_t type) {
  return att_tensor(g, uid, type, att_shp(1, 1, 1, 1, 1, 1, 1, 1), false, true);
}

static cudnnBackendDescriptor_t att_virtual(att_graph *g, cudnnDataType_t type, att_shape shape) {
  return att_tensor(g, g->next_uid++, type, shape, true, false);
}

static void att_add_op(att_graph *g, cudnnBackendDescriptor_t op) {
  if (g->status != CUDNN_STATUS_SUCCESS) return;
  if (g->nops == ATT_OPS) {
    att_graph_fail(g, CUDNN_STATUS_INTERNAL_ERROR, "operation list full (raise ATT_OPS)", __LINE__);
    return;
  }
  g->ops[g->nops++] = op;
}

/* y = mode(x[, b[, t]]), computed in `prec`. axis: GEN_INDEX only. */
static void att_pointwise(att_graph *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis,
                          cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                          cudnnBackendDescriptor_t y) {
  cudnnBackendDescriptor_t pw = ATT_NEW(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  ATT_SET(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  ATT_SET(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
  /* axis: GEN_INDEX's dimension, the one pointwise mode that has one (as
   * cudnn-frontend sets it). */
  if (mode == CUDNN_POINTWISE_GEN_INDEX) ATT_SET(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
  ATT_FINALIZE(g, pw, "pointwise");
  cudnnBackendDescriptor_t op = ATT_NEW(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  if (b) ATT_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
  if (t) ATT_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  ATT_FINALIZE(g, op, "pointwise operation");
  att_add_op(g, op);
}

/* The common cases: f32 math, one or two inputs. */
static void att_pw1(att_graph *g, cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
  att_pointwise(g, mode, CUDNN_DATA_FLOAT, 0, x, NULL, NULL, y);
}
static void att_pw2(att_graph *g, cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                    cudnnBackendDescriptor_t y) {
  att_pointwise(g, mode, CUDNN_DATA_FLOAT, 0, x, b, NULL, y);
}

/* c = a @ b over the last two dims, batch dims broadcast; f32 accumulation. */
static void att_matmul(att_graph *g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                       cudnnBackendDescriptor_t c) {
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t mm = ATT_NEW(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  ATT_SET(g, mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  ATT_FINALIZE(g, mm, "matmul");
  cudnnBackendDescriptor_t op = ATT_NEW(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
  ATT_FINALIZE(g, op, "matmul operation");
  att_add_op(g, op);
}

/* y = reduce(x) over the dims where y is smaller (sizes 1, or kv heads). */
static void att_reduce(att_graph *g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                       cudnnBackendDescriptor_t y) {
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t rd = ATT_NEW(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  ATT_SET(g, rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
  ATT_SET(g, rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  ATT_FINALIZE(g, rd, "reduction");
  cudnnBackendDescriptor_t op = ATT_NEW(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
  ATT_FINALIZE(g, op, "reduction operation");
  att_add_op(g, op);
}

/* y = x seen through other dims/strides (here: a transpose of the last two). */
static void att_reshape(att_graph *g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
  cudnnBackendDescriptor_t op = ATT_NEW(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  ATT_SET(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  ATT_FINALIZE(g, op, "reshape operation");
  att_add_op(g, op);
}

/* The views of our buffers (see the header comment). */
struct att_views {
  att_shape q, kv, kvt, stats, scores;
};

static att_views att_make_views(const att_key *k) {
  att_views v;
  const int64_t B = k->B, T = k->T, S = k->S, Hq = k->Hq, Hkv = k->Hkv, D = k->D;
  v.q = att_shp(B, Hq, T, D, T * Hq * D, D, Hq * D, 1);
  v.kv = att_shp(B, Hkv, S, D, S * Hkv * D, D, Hkv * D, 1);
  v.kvt = att_shp(B, Hkv, D, S, S * Hkv * D, D, 1, Hkv * D);
  v.stats = att_shp(B, Hq, T, 1, Hq * T, T, 1, 1);
  v.scores = att_packed(B, Hq, T, S);
  return v;
}

/* Scores s with the causal mask applied: keep s where row + (S - T) >= col,
 * else the fill value (-FLT_MAX, as cudnn-frontend: exp of it is 0, and no
 * inf - inf). The row shift is spelled as + S then - T, as the frontend
 * emits its bottom-right alignment; with S == T it is left out. */
static cudnnBackendDescriptor_t att_causal_mask(att_graph *g, const att_key *k, cudnnBackendDescriptor_t s) {
  const att_shape sc = att_packed(k->B, k->Hq, k->T, k->S);
  cudnnBackendDescriptor_t row = att_virtual(g, CUDNN_DATA_INT32, sc);
  att_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 2, s, NULL, NULL, row);
  cudnnBackendDescriptor_t col = att_virtual(g, CUDNN_DATA_INT32, sc);
  att_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 3, s, NULL, NULL, col);
  if (k->S != k->T) {
    cudnnBackendDescriptor_t skv = att_scalar(g, UID_SKV, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t sq = att_scalar(g, UID_SQ, CUDNN_DATA_INT32);
    cudnnBackendDescriptor_t r1 = att_virtual(g, CUDNN_DATA_INT32, sc);
    att_pointwise(g, CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, 0, row, skv, NULL, r1);
    cudnnBackendDescriptor_t r2 = att_virtual(g, CUDNN_DATA_INT32, sc);
    att_pointwise(g, CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, 0, r1, sq, NULL, r2);
    row = r2;
  }
  cudnnBackendDescriptor_t keep = att_virtual(g, CUDNN_DATA_BOOLEAN, sc);
  att_pointwise(g, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, 0, row, col, NULL, keep);
  cudnnBackendDescriptor_t fill = att_scalar(g, UID_NEG_INF, CUDNN_DATA_FLOAT);
  cudnnBackendDescriptor_t out = att_virtual(g, CUDNN_DATA_FLOAT, sc);
  att_pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, 0, s, fill, keep, out);
  return out;
}

static void att_build_forward(att_graph *g, const att_key *k) {
  const att_views v = att_make_views(k);
  const att_shape row1 = v.stats; /* [B,Hq,T,1] row statistics */
  const cudnnDataType_t F = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t Q = att_io(g, UID_Q, g->io, v.q);
  cudnnBackendDescriptor_t KT = att_io(g, UID_K, g->io, v.kvt);
  cudnnBackendDescriptor_t V = att_io(g, UID_V, g->io, v.kv);
  cudnnBackendDescriptor_t O = att_io(g, UID_O, g->io, v.q);
  cudnnBackendDescriptor_t STATS = att_io(g, UID_STATS, F, v.stats);
  cudnnBackendDescriptor_t SCALE = att_scalar(g, UID_SCALE, F);

  cudnnBackendDescriptor_t s = att_virtual(g, F, v.scores);
  att_matmul(g, Q, KT, s);
  cudnnBackendDescriptor_t ss = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_MUL, s, SCALE, ss);
  if (k->causal) ss = att_causal_mask(g, k, ss);

  cudnnBackendDescriptor_t mx = att_virtual(g, F, row1);
  att_reduce(g, CUDNN_REDUCE_TENSOR_MAX, ss, mx);
  cudnnBackendDescriptor_t sub = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_SUB, ss, mx, sub);
  cudnnBackendDescriptor_t e = att_virtual(g, F, v.scores);
  att_pw1(g, CUDNN_POINTWISE_EXP, sub, e);
  cudnnBackendDescriptor_t z = att_virtual(g, F, row1);
  att_reduce(g, CUDNN_REDUCE_TENSOR_ADD, e, z);
  cudnnBackendDescriptor_t lz = att_virtual(g, F, row1);
  att_pw1(g, CUDNN_POINTWISE_LOG, z, lz);
  att_pw2(g, CUDNN_POINTWISE_ADD, mx, lz, STATS);
  cudnnBackendDescriptor_t p = att_virtual(g, g->io, v.scores); /* bmm2 takes P in the io dtype */
  att_pw2(g, CUDNN_POINTWISE_DIV, e, z, p);
  att_matmul(g, p, V, O);
}

static void att_build_backward(att_graph *g, const att_key *k) {
  const att_views v = att_make_views(k);
  const int64_t B = k->B, T = k->T, S = k->S, Hq = k->Hq, Hkv = k->Hkv, D = k->D;
  const cudnnDataType_t F = CUDNN_DATA_FLOAT;
  const att_shape row1 = v.stats;
  const att_shape scores_t = att_shp(B, Hq, S, T, Hq * T * S, T * S, 1, S); /* P^T, dS^T: same memory as [T,S] */
  const att_shape per_qhead = att_packed(B, Hq, S, D);                       /* dK, dV before the group sum */
  cudnnBackendDescriptor_t Q = att_io(g, UID_Q, g->io, v.q);
  cudnnBackendDescriptor_t KT = att_io(g, UID_K, g->io, v.kvt);
  cudnnBackendDescriptor_t VT = att_io(g, UID_V, g->io, v.kvt);
  cudnnBackendDescriptor_t O = att_io(g, UID_O, g->io, v.q);
  cudnnBackendDescriptor_t dO = att_io(g, UID_DO, g->io, v.q);
  cudnnBackendDescriptor_t STATS = att_io(g, UID_STATS, F, v.stats);
  cudnnBackendDescriptor_t dQ = att_io(g, UID_DQ, g->io, v.q);
  cudnnBackendDescriptor_t dK = att_io(g, UID_DK, g->io, v.kv);
  cudnnBackendDescriptor_t dV = att_io(g, UID_DV, g->io, v.kv);
  cudnnBackendDescriptor_t SCALE = att_scalar(g, UID_SCALE, F);
  cudnnBackendDescriptor_t ONE = att_scalar(g, UID_ONE, F);

  /* Sd = rowsum(dO * O), kept in the workspace for the whole kernel. */
  cudnnBackendDescriptor_t doo = att_virtual(g, F, att_shp(B, Hq, T, D, Hq * T * D, T * D, Hq * D, 1));
  att_pw2(g, CUDNN_POINTWISE_MUL, dO, O, doo);
  cudnnBackendDescriptor_t red = att_virtual(g, F, row1);
  att_reduce(g, CUDNN_REDUCE_TENSOR_ADD, doo, red);
  cudnnBackendDescriptor_t sd = att_io(g, UID_SOFTMAX_SUM, F, att_packed(B, Hq, T, 1));
  att_pw2(g, CUDNN_POINTWISE_MUL, red, ONE, sd);

  /* P = exp(scale Q K^T - Stats), masked. */
  cudnnBackendDescriptor_t s = att_virtual(g, F, v.scores);
  att_matmul(g, Q, KT, s);
  cudnnBackendDescriptor_t ss = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_MUL, s, SCALE, ss);
  cudnnBackendDescriptor_t sm = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_SUB, ss, STATS, sm);
  if (k->causal) sm = att_causal_mask(g, k, sm);
  cudnnBackendDescriptor_t p = att_virtual(g, F, v.scores);
  att_pw1(g, CUDNN_POINTWISE_EXP, sm, p);

  /* dV = P^T dO (per query head, then summed over the group). */
  cudnnBackendDescriptor_t pt = att_virtual(g, g->io, scores_t);
  att_reshape(g, p, pt);
  if (Hq == Hkv) {
    att_matmul(g, pt, dO, dV);
  } else {
    cudnnBackendDescriptor_t dvh = att_virtual(g, g->io, per_qhead);
    att_matmul(g, pt, dO, dvh);
    att_reduce(g, CUDNN_REDUCE_TENSOR_ADD, dvh, dV);
  }

  /* dS = P (dO V^T - Sd) scale. */
  cudnnBackendDescriptor_t dp = att_virtual(g, F, v.scores);
  att_matmul(g, dO, VT, dp);
  cudnnBackendDescriptor_t dps = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_SUB, dp, sd, dps);
  cudnnBackendDescriptor_t ds0 = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_MUL, dps, p, ds0);
  cudnnBackendDescriptor_t ds = att_virtual(g, F, v.scores);
  att_pw2(g, CUDNN_POINTWISE_MUL, ds0, SCALE, ds);

  /* dK = dS^T Q (per query head, then summed over the group). */
  cudnnBackendDescriptor_t dst = att_virtual(g, g->io, scores_t);
  att_reshape(g, ds, dst);
  if (Hq == Hkv) {
    att_matmul(g, dst, Q, dK);
  } else {
    cudnnBackendDescriptor_t dkh = att_virtual(g, g->io, per_qhead);
    att_matmul(g, dst, Q, dkh);
    att_reduce(g, CUDNN_REDUCE_TENSOR_ADD, dkh, dK);
  }

  /* dQ = dS K. The graph's shape chooses the algorithm (cudnn-frontend
   * does the same): with a non-virtual f32 accumulator in the workspace the
   * engine sums dQ with atomics across key tiles (fast, not bit-stable);
   * written straight to dQ it takes the deterministic dP-workspace kernel. */
  cudnnBackendDescriptor_t kk = att_virtual(g, F, v.kv);
  att_reshape(g, KT, kk);
  if (k->det) {
    att_matmul(g, ds, kk, dQ);
  } else {
    cudnnBackendDescriptor_t acc = att_io(g, UID_DQ_ACCUM, F, att_packed(B, Hq, T, D));
    att_matmul(g, ds, kk, acc);
    att_pw1(g, CUDNN_POINTWISE_IDENTITY, acc, dQ);
  }
}

/* ------------------------------------------------------------------------ */
/* Plans: per-device cache, workspace, handle                                */
/* ------------------------------------------------------------------------ */

enum { ATT_EMPTY = 0, ATT_READY = 1, ATT_UNAVAILABLE = 2 };

struct att_plan {
  int state;
  att_key key;
  att_graph g; /* owns every descriptor, the execution plan included */
  cudnnBackendDescriptor_t plan;
  int64_t sum_off, acc_off, plan_off; /* byte offsets in the workspace (backward scratch, cuDNN's part) */
  int64_t ws_bytes;                    /* workspace this plan needs */
  char reason[ATT_REASON];             /* ATT_UNAVAILABLE: why */
};

static struct att_dev {
  std::mutex lock; /* held for a whole call: plans and the workspace are shared */
  int state;       /* ATT_EMPTY, ATT_READY, or ATT_UNAVAILABLE (no cuDNN handle: reason) */
  char reason[ATT_REASON];
  cudnnHandle_t handle;
  int sm; /* compute capability, 10 * major + minor */
  void *ws;
  size_t ws_size;
  att_plan plans[ATT_CACHE];
  int next; /* round-robin eviction */
} att_devs[TT_CUDA_MAX_DEVICES];

static void att_plan_release(att_plan *p) {
  att_graph_release(&p->g);
  p->plan = NULL;
  p->state = ATT_EMPTY;
}

/* 1 when engine config `cfg` is marked CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC,
 * or when its notes cannot be read (then nothing says it is deterministic). */
static int att_cfg_nondeterministic(cudnnBackendDescriptor_t cfg) {
  cudnnBackendDescriptor_t engine = NULL;
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t n = 0;
  cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine);
  if (st == CUDNN_STATUS_SUCCESS)
    st = cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine);
  if (st == CUDNN_STATUS_SUCCESS)
    st = cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                  CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes);
  if (engine) cudnnBackendDestroyDescriptor(engine);
  if (st != CUDNN_STATUS_SUCCESS) return 1;
  for (int64_t i = 0; i < n && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++)
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return 1;
  return 0;
}

/* What att_find_plan saw, for the deviceless check: the engine configs
 * heuristics proposed, and those an engine accepted (its plan finalized, or
 * failed only when loading the compiled kernel into a driver that has no
 * GPU: CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER), with their engine ids. */
struct att_tally {
  int proposed, accepted;
  int64_t engines[2 * ATT_CFGS];
};

/* Finds an execution plan for the finalized operation graph `og`: the
 * engine configs heuristics mode A proposes, then mode FALLBACK's, the first
 * that finalizes wins; with `det`, only configs not marked nondeterministic.
 * For a GPU, `handle`; for a device described offline (no GPU: the
 * deviceless check), `devprop` instead, and `tally` counts what happened. */
static cudnnBackendDescriptor_t att_find_plan(att_graph *g, cudnnHandle_t handle, cudnnBackendDescriptor_t devprop,
                                              cudnnBackendDescriptor_t og, int det, int64_t *ws, att_tally *tally) {
  char last[ATT_REASON] = "no engine config proposed";
  int skipped = 0; /* configs deterministic mode refused */
  const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
  for (int m = 0; m < 2 && g->status == CUDNN_STATUS_SUCCESS; m++) {
    cudnnBackendDescriptor_t heur = ATT_NEW(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    ATT_SET(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &og);
    ATT_SET(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[m]);
#if CUDNN_VERSION >= 90800
    if (devprop) ATT_SET(g, heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &devprop);
#endif
    ATT_FINALIZE(g, heur, "engine heuristics");
    if (g->status != CUDNN_STATUS_SUCCESS) break;
    int64_t count = 0;
    cudnnStatus_t st =
        cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
    if (st != CUDNN_STATUS_SUCCESS) {
      att_graph_fail(g, st, "cudnnBackendGetAttribute(CUDNN_ATTR_ENGINEHEUR_RESULTS)", __LINE__);
      break;
    }
    if (count > ATT_CFGS) count = ATT_CFGS;
    if (count <= 0) continue;
    cudnnBackendDescriptor_t cfgs[ATT_CFGS];
    for (int64_t i = 0; i < count; i++) cfgs[i] = ATT_NEW(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (g->status != CUDNN_STATUS_SUCCESS) break;
    int64_t got = 0;
    st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                  cfgs);
    if (st != CUDNN_STATUS_SUCCESS) {
      att_graph_fail(g, st, "cudnnBackendGetAttribute(CUDNN_ATTR_ENGINEHEUR_RESULTS)", __LINE__);
      break;
    }
    for (int64_t i = 0; i < got && i < count; i++) {
      if (det && att_cfg_nondeterministic(cfgs[i])) {
        skipped++;
        continue;
      }
      if (tally) tally->proposed++;
      /* A config may fail to finalize (unsupported on this GPU): try the next. */
      cudnnBackendDescriptor_t plan = NULL;
      st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
      if (st == CUDNN_STATUS_SUCCESS && !devprop)
        st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
#if CUDNN_VERSION >= 90800
      if (st == CUDNN_STATUS_SUCCESS && devprop)
        st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                      &devprop);
#endif
      if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                      &cfgs[i]);
      if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(plan);
      if (tally && (st == CUDNN_STATUS_SUCCESS || st == CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER)) {
        cudnnBackendDescriptor_t engine = NULL;
        int64_t n = 0, id = -1;
        if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) == CUDNN_STATUS_SUCCESS &&
            cudnnBackendGetAttribute(cfgs[i], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                     &engine) == CUDNN_STATUS_SUCCESS)
          (void)cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &id);
        if (engine) cudnnBackendDestroyDescriptor(engine);
        if (tally->accepted < 2 * ATT_CFGS) tally->engines[tally->accepted] = id;
        tally->accepted++;
      }
      int64_t n = 0;
      if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, ws);
      if (st == CUDNN_STATUS_SUCCESS && g->ndescs < ATT_DESCS) {
        g->descs[g->ndescs++] = plan;
        return plan;
      }
      char msg[256];
      att_last_cudnn_message(msg, sizeof msg);
      snprintf(last, sizeof last, "no engine config finalizes (last: %s%s%s)",
               st == CUDNN_STATUS_SUCCESS ? "descriptor list full" : cudnnGetErrorString(st), msg[0] ? ": " : "",
               msg);
      if (plan) cudnnBackendDestroyDescriptor(plan);
    }
  }
  if (g->status == CUDNN_STATUS_SUCCESS) {
    g->status = CUDNN_STATUS_NOT_SUPPORTED;
    if (skipped > 0)
      snprintf(g->failure, sizeof g->failure,
               "deterministic mode: %d engine config(s) skipped as nondeterministic, none other usable (%s)", skipped,
               last);
    else
      snprintf(g->failure, sizeof g->failure, "%s", last);
  }
  return NULL;
}

static int64_t att_round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* Builds graph + plan for p->key; on any failure the entry records why
 * (ATT_UNAVAILABLE) and nothing is left allocated. */
static void att_plan_build(att_dev *dv, att_plan *p, const att_key *key) {
  memset(p, 0, sizeof *p);
  p->key = *key;
  att_graph *g = &p->g;
  g->next_uid = UID_VIRTUAL;
  g->io = key->dtype == TT_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  if (key->dir == ATT_FWD) att_build_forward(g, key);
  else att_build_backward(g, key);
  cudnnBackendDescriptor_t og = ATT_NEW(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  ATT_SET(g, og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nops, g->ops);
  ATT_SET(g, og, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &dv->handle);
  ATT_FINALIZE(g, og, "operation graph");
  int64_t plan_ws = 0;
  if (g->status == CUDNN_STATUS_SUCCESS) p->plan = att_find_plan(g, dv->handle, NULL, og, key->det, &plan_ws, NULL);
  if (g->status != CUDNN_STATUS_SUCCESS || !p->plan) {
    snprintf(p->reason, sizeof p->reason, "%s", g->failure);
    att_graph_release(g);
    p->plan = NULL;
    p->state = ATT_UNAVAILABLE;
    return;
  }
  /* Workspace: [backward scratch: softmax sum | dQ accumulator] [cuDNN's]. */
  int64_t off = 0;
  if (key->dir == ATT_BWD) {
    p->sum_off = off;
    off = att_round_up(off + key->B * key->Hq * key->T * (int64_t)sizeof(float), 256);
    p->acc_off = off;
    if (!key->det) off = att_round_up(off + key->B * key->Hq * key->T * key->D * (int64_t)sizeof(float), 256);
  }
  p->plan_off = off;
  p->ws_bytes = off + (plan_ws > 0 ? plan_ws : 0);
  p->state = ATT_READY;
}

/* Grows the device's workspace to `need` bytes. 0 when it cannot (why set). */
static int att_workspace(att_dev *dv, int device, cudaStream_t stream, int64_t need, char *why, size_t n) {
  if ((size_t)need <= dv->ws_size) return 1;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &cap);
  if (err == cudaSuccess && cap != cudaStreamCaptureStatusNone) {
    snprintf(why, n, "the workspace must grow to %lld bytes during CUDA graph capture", (long long)need);
    return 0;
  }
  if (tt_cuda_graphs_alive(device)) { /* the live graphs' nodes point at the current one */
    snprintf(why, n, "the workspace must grow to %lld bytes while a CUDA graph uses it", (long long)need);
    return 0;
  }
  /* The old buffer may still be in use by work queued on this stream. */
  if (err == cudaSuccess && dv->ws) err = cudaStreamSynchronize(stream);
  if (err == cudaSuccess && dv->ws) err = cudaFree(dv->ws);
  if (err != cudaSuccess) {
    cudaGetLastError();
    snprintf(why, n, "workspace release failed: %s", cudaGetErrorString(err));
    return 0;
  }
  dv->ws = NULL;
  dv->ws_size = 0;
  const size_t size = (size_t)att_round_up(need, ATT_WS_ROUND);
  err = cudaMalloc(&dv->ws, size);
  if (err != cudaSuccess) {
    cudaGetLastError(); /* not sticky: clear it */
    dv->ws = NULL;
    snprintf(why, n, "cannot allocate a %zu-byte workspace: %s", size, cudaGetErrorString(err));
    return 0;
  }
  dv->ws_size = size;
  return 1;
}

/* Sets up the device's cuDNN handle once. 0 when cuDNN cannot be used (why). */
static int att_dev_ready(att_dev *dv, int device, char *why, size_t n) {
  if (dv->state == ATT_EMPTY) {
    int major = 0, minor = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
    if (err == cudaSuccess) st = cudnnCreate(&dv->handle);
    if (err != cudaSuccess) {
      cudaGetLastError();
      snprintf(dv->reason, sizeof dv->reason, "cudaDeviceGetAttribute failed: %s", cudaGetErrorString(err));
      dv->state = ATT_UNAVAILABLE;
    } else if (st != CUDNN_STATUS_SUCCESS) {
      char msg[256];
      att_last_cudnn_message(msg, sizeof msg);
      snprintf(dv->reason, sizeof dv->reason, "cudnnCreate failed: %s%s%s", cudnnGetErrorString(st),
               msg[0] ? ": " : "", msg);
      dv->handle = NULL;
      dv->state = ATT_UNAVAILABLE;
    } else {
      dv->sm = 10 * major + minor;
      dv->state = ATT_READY;
    }
  }
  if (dv->state != ATT_READY) snprintf(why, n, "%s", dv->reason);
  return dv->state == ATT_READY;
}

/* Before a graph capture (graph.cu): the cuDNN handle is made now, since
 * creating it during the capture would fail and be remembered as "cuDNN
 * unavailable" for the rest of the process. */
extern "C" tt_status tt_cuda_attention_prepare(int device) {
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES)
    return tt_error_set(TT_ERR_DEVICE, "cuda attention: device %d beyond the %d supported", device,
                        TT_CUDA_MAX_DEVICES);
  att_dev *dv = &att_devs[device];
  std::lock_guard<std::mutex> guard(dv->lock);
  char why[ATT_REASON];
  (void)att_dev_ready(dv, device, why, sizeof why); /* unavailable is no error: the fallback serves */
  return TT_OK;
}

/* What cuDNN 9's SDPA engines take (cudnn-frontend's support surface for
 * its composite node) on a GPU of compute capability sm (10 major + minor),
 * checked before a graph is built. 0 + why if not. */
static int att_cudnn_takes(int sm, const att_key *k, char *why, size_t n) {
  const size_t ver = cudnnGetVersion();
  const int major = sm / 10;
  if (sm < 80) {
    snprintf(why, n, "compute capability %d.%d; cuDNN SDPA needs 8.0 or newer", major, sm % 10);
    return 0;
  }
  if (ver == 91000 || ver == 91001) {
    snprintf(why, n, "cuDNN %zu has known SDPA bugs", ver);
    return 0;
  }
  if (k->D < 8 || k->D % 8 != 0 || k->D > 256) {
    snprintf(why, n, "head_dim %lld is not a multiple of 8 in [8, 256]", (long long)k->D);
    return 0;
  }
  if (k->S < 1) {
    snprintf(why, n, "no keys");
    return 0;
  }
  if (k->causal && k->S < k->T) {
    snprintf(why, n, "causal with fewer keys than queries (rows that see no key)");
    return 0;
  }
  if (k->causal && k->S != k->T && ver < 90600) {
    snprintf(why, n, "the bottom-right causal mask (S != T) needs cuDNN 9.6, this is %zu", ver);
    return 0;
  }
  if (k->dir == ATT_FWD) {
    if (((major == 8 && ver <= 90900) || (major == 10 && ver < 90900)) && k->D > 128) {
      snprintf(why, n, "head_dim %lld > 128 on sm_%d needs a newer cuDNN than %zu", (long long)k->D, sm, ver);
      return 0;
    }
    return 1;
  }
  if (k->T == 1 && k->S == 1) {
    snprintf(why, n, "the backward does not take T = S = 1");
    return 0;
  }
  if (major != 9 && k->D > 128) {
    snprintf(why, n, "the backward takes head_dim > 128 on Hopper only (this is sm_%d)", sm);
    return 0;
  }
  if (ver <= 91500 && k->S % 128 != 0) {
    snprintf(why, n, "the backward with S %% 128 != 0 needs a padding mask before cuDNN 9.16 (this is %zu)", ver);
    return 0;
  }
  return 1;
}

static tt_status att_cudnn_fail(cudnnStatus_t st, const char *call, const char *file, int line) {
  char msg[256];
  att_last_cudnn_message(msg, sizeof msg);
  return tt_error_set(TT_ERR_INTERNAL, "cudnn: %s failed at %s:%d: %s%s%s", call, tt_cuda_short_file(file), line,
                      cudnnGetErrorString(st), msg[0] ? ": " : "", msg);
}

#define ATT_CUDNN_CHECK(call)                                                                          \
  do {                                                                                                 \
    cudnnStatus_t att_st_ = (call);                                                                    \
    if (att_st_ != CUDNN_STATUS_SUCCESS) return att_cudnn_fail(att_st_, #call, __FILE__, __LINE__);     \
  } while (0)

/* Destroys a descriptor when the scope ends (the variant pack). */
struct att_desc_guard {
  cudnnBackendDescriptor_t d;
  ~att_desc_guard() {
    if (d) cudnnBackendDestroyDescriptor(d);
  }
};

/* The device buffers of one call, by role. */
struct att_ptrs {
  const void *q, *k, *v, *o, *lse, *dout;
  void *out, *lse_out, *dq, *dk, *dv;
};

static int att_misaligned(const void *p) { return p && ((uintptr_t)p % ATT_ALIGN) != 0; }

/* Runs the cuDNN graph for `key` when cuDNN takes it. *unavailable = 1 (and
 * why) hands the call to the fallback; an error status means a CUDA/cuDNN
 * call failed while executing. */
static tt_status att_cudnn_run(int device, cudaStream_t stream, const att_key *key, double scale, const att_ptrs *x,
                               int *unavailable, char *why, size_t n) {
  *unavailable = 1;
  const void *all[] = {x->q, x->k, x->v, x->o, x->lse, x->dout, x->out, x->lse_out, x->dq, x->dk, x->dv};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (att_misaligned(all[i])) {
      snprintf(why, n, "a buffer is not %d-byte aligned", ATT_ALIGN);
      return TT_OK;
    }

  att_dev *dv = &att_devs[device];
  std::lock_guard<std::mutex> guard(dv->lock);
  if (!att_dev_ready(dv, device, why, n)) return TT_OK;

  att_plan *p = NULL;
  for (int i = 0; i < ATT_CACHE && !p; i++)
    if (dv->plans[i].state != ATT_EMPTY && memcmp(&dv->plans[i].key, key, sizeof *key) == 0) p = &dv->plans[i];
  if (!p) {
    /* Building a plan allocates and evicting one frees kernels a captured
     * graph may replay: neither during a capture. Not cached, so the next
     * eager call builds it (the trainer's warm-up step does). */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    TT_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
    if (cap != cudaStreamCaptureStatusNone) {
      snprintf(why, n, "no cuDNN plan for this shape was built before the CUDA-graph capture");
      return TT_OK;
    }
    p = &dv->plans[dv->next];
    if (p->state == ATT_READY && tt_cuda_graphs_alive(device)) {
      /* A live graph may replay the kernels this plan owns. */
      snprintf(why, n, "the cuDNN plan cache is full and a live CUDA graph may use its plans");
      return TT_OK;
    }
    dv->next = (dv->next + 1) % ATT_CACHE;
    /* Work queued with the evicted plan may still run (its kernels live in the plan). */
    if (p->state == ATT_READY) TT_CUDA_CHECK(cudaStreamSynchronize(stream));
    att_plan_release(p);
    if (!att_cudnn_takes(dv->sm, key, p->reason, sizeof p->reason)) {
      p->key = *key;
      p->state = ATT_UNAVAILABLE;
    } else {
      att_plan_build(dv, p, key);
    }
  }
  if (p->state != ATT_READY) {
    snprintf(why, n, "%s", p->reason);
    return TT_OK;
  }
  if (!att_workspace(dv, device, stream, p->ws_bytes, why, n)) return TT_OK;
  /* *unavailable stays 1 until the plan has run: a refusal below still
   * hands the call to the fallback. */

  char *ws = (char *)dv->ws;
  const size_t ver = cudnnGetVersion();
  float scale_f = (float)scale, one = 1.0f, neg_inf = -FLT_MAX;
  int32_t skv = (int32_t)key->S, sq = (int32_t)key->T;
  /* Every non-virtual uid at most once: UID_SQ (16) of them. */
  int64_t uids[UID_SQ];
  void *ptrs[UID_SQ];
  int nb = 0;
  auto bind = [&](int64_t uid, const void *ptr) {
    if (nb == UID_SQ) return; /* cannot happen: each uid is bound once */
    uids[nb] = uid;
    ptrs[nb] = (void *)ptr;
    nb++;
  };
  bind(UID_Q, x->q);
  bind(UID_K, x->k);
  bind(UID_V, x->v);
  bind(UID_SCALE, &scale_f);
  if (key->causal) {
    bind(UID_NEG_INF, &neg_inf);
    if (key->S != key->T) {
      bind(UID_SKV, &skv);
      bind(UID_SQ, &sq);
    }
  }
  if (key->dir == ATT_FWD) {
    bind(UID_O, x->out);
    bind(UID_STATS, x->lse_out);
  } else {
    bind(UID_O, x->o);
    bind(UID_STATS, x->lse);
    bind(UID_DO, x->dout);
    bind(UID_DQ, x->dq);
    bind(UID_DK, x->dk);
    bind(UID_DV, x->dv);
    bind(UID_ONE, &one);
    bind(UID_SOFTMAX_SUM, ws + p->sum_off);
    if (!key->det) {
      bind(UID_DQ_ACCUM, ws + p->acc_off);
      /* Before 9.6 the engine expects a zeroed dQ accumulator. */
      if (ver < 90600)
        TT_CUDA_CHECK(cudaMemsetAsync(ws + p->acc_off, 0,
                                      (size_t)(key->B * key->Hq * key->T * key->D) * sizeof(float), stream));
    }
  }
  void *plan_ws = ws ? ws + p->plan_off : NULL;

  ATT_CUDNN_CHECK(cudnnSetStream(dv->handle, stream));
  att_desc_guard pack = {NULL};
  ATT_CUDNN_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack.d));
  ATT_CUDNN_CHECK(
      cudnnBackendSetAttribute(pack.d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &plan_ws));
  ATT_CUDNN_CHECK(cudnnBackendSetAttribute(pack.d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, nb,
                                           ptrs));
  ATT_CUDNN_CHECK(
      cudnnBackendSetAttribute(pack.d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, nb, uids));
  ATT_CUDNN_CHECK(cudnnBackendFinalize(pack.d));
  const cudnnStatus_t ex = cudnnBackendExecute(dv->handle, p->plan, pack.d);
  if (ex != CUDNN_STATUS_SUCCESS) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const bool capturing = cudaStreamIsCapturing(stream, &cap) == cudaSuccess && cap != cudaStreamCaptureStatusNone;
    /* NOT_SUPPORTED_* (3xxx) or EXECUTION_FAILED_* (5xxx); a BAD_PARAM is
     * this file's bug and is reported as an error. */
    const bool refused = (int)ex / 1000 == 3 || (int)ex / 1000 == 5;
    if (refused && !capturing) {
      /* A plan that finalized but will not run this shape here: remember
       * that, and let the fallback kernel take this and every later call
       * (it writes every output, so whatever cuDNN left is overwritten). */
      char msg[256];
      att_last_cudnn_message(msg, sizeof msg);
      snprintf(p->reason, sizeof p->reason, "cudnnBackendExecute refused the plan: %s%s%s",
               cudnnGetErrorString(ex), msg[0] ? ": " : "", msg);
      char reason[sizeof p->reason];
      memcpy(reason, p->reason, sizeof reason);
      cudaGetLastError(); /* a launch error it left is not sticky: clear it */
      TT_CUDA_CHECK(cudaStreamSynchronize(stream)); /* earlier work may still use the plan's kernels */
      att_plan_release(p);
      p->key = *key;
      p->state = ATT_UNAVAILABLE;
      memcpy(p->reason, reason, sizeof reason);
      snprintf(why, n, "%s", p->reason);
      return TT_OK; /* *unavailable is still 1 */
    }
    return att_cudnn_fail(ex, "cudnnBackendExecute", __FILE__, __LINE__);
  }
  *unavailable = 0;
  return TT_OK;
}

/* ------------------------------------------------------------------------ */
/* Entry points                                                              */
/* ------------------------------------------------------------------------ */

static const char *att_dtype_name(int dtype) {
  switch (dtype) {
    case TT_F32: return "f32";
    case TT_F64: return "f64";
    case TT_BF16: return "bf16";
    case TT_F16: return "f16";
    default: return "?";
  }
}

/* The mode is read per call: the trainer sets it once at start, a test may
 * switch it between calls. */
static att_key att_make_key(int dir, int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                            int causal) {
  att_key k;
  memset(&k, 0, sizeof k);
  k.dir = dir;
  k.dtype = dtype;
  k.causal = causal != 0;
  k.det = tt_deterministic() != 0;
  k.B = B;
  k.T = T;
  k.S = S;
  k.Hq = Hq;
  k.Hkv = Hkv;
  k.D = D;
  return k;
}

static std::mutex att_log_lock;
static att_key att_logged[ATT_LOGGED];
static int att_nlogged;

/* Whether this process is a rank other than 0 of a launch (mpirun, srun,
 * torchrun): every rank takes the same path for the same shapes, so rank
 * 0's line says it once for the job instead of once per GPU. */
static bool att_other_rank(void) {
  static const bool other = [] {
    const char *names[] = {"OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "RANK"};
    for (const char *n : names) {
      const char *v = getenv(n);
      if (v && *v) return strcmp(v, "0") != 0;
    }
    return false;
  }();
  return other;
}

/* One stderr line per (direction, shape, dtype, mode), from rank 0 of a
 * launch; quiet once ATT_LOGGED distinct keys have been announced. */
static void att_log_fallback(const att_key *k, const char *why) {
  if (att_other_rank()) return;
  {
    std::lock_guard<std::mutex> guard(att_log_lock);
    for (int i = 0; i < att_nlogged; i++)
      if (memcmp(&att_logged[i], k, sizeof *k) == 0) return;
    if (att_nlogged == ATT_LOGGED) return;
    att_logged[att_nlogged++] = *k;
  }
  fprintf(stderr,
          "attention: cuDNN SDPA unavailable for %s B=%lld T=%lld S=%lld Hq=%lld Hkv=%lld D=%lld%s %s%s (%s): "
          "using the CUDA fallback kernel\n",
          k->dir == ATT_FWD ? "forward" : "backward", (long long)k->B, (long long)k->T, (long long)k->S,
          (long long)k->Hq, (long long)k->Hkv, (long long)k->D, k->causal ? " causal" : "",
          att_dtype_name(k->dtype), k->det ? " deterministic" : "", why);
}

static tt_status att_check(const char *op, int dtype, int64_t D) {
  if (dtype != TT_F32 && dtype != TT_F64 && dtype != TT_BF16 && dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "cuda %s: dtype %d not supported (f32, f64, bf16, f16)", op, dtype);
  if (D > TT_ATT_DMAX)
    return tt_error_set(TT_ERR_SHAPE, "cuda %s: head_dim %lld exceeds %d", op, (long long)D, TT_ATT_DMAX);
  return TT_OK;
}

static tt_status att_current(int *device, cudaStream_t *stream) {
  tt_status st = tt_cuda_current(device, stream);
  if (st != TT_OK) return st;
  if (*device < 0 || *device >= TT_CUDA_MAX_DEVICES)
    return tt_error_set(TT_ERR_DEVICE, "cuda attention: device %d beyond the %d supported", *device,
                        TT_CUDA_MAX_DEVICES);
  return TT_OK;
}

extern "C" tt_status tt_cuda_attention(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv,
                                       int64_t D, int causal, double scale, const void *q, const void *k,
                                       const void *v, void *o, void *lse) {
  tt_status st = att_check("attention", dtype, D);
  if (st != TT_OK) return st;
  if (B <= 0 || T <= 0 || Hq <= 0 || Hkv <= 0) return TT_OK;
  int device;
  cudaStream_t stream;
  if ((st = att_current(&device, &stream)) != TT_OK) return st;

  /* Empty problems (no keys, no head dim) are the fallback's, silently. */
  if (S > 0 && D > 0) {
    const att_key key = att_make_key(ATT_FWD, dtype, B, T, S, Hq, Hkv, D, causal);
    char why[ATT_REASON];
    int unavailable = 1;
    if (dtype == TT_BF16 || dtype == TT_F16) {
      const att_ptrs x = {q, k, v, NULL, NULL, NULL, o, lse, NULL, NULL, NULL};
      st = att_cudnn_run(device, stream, &key, scale, &x, &unavailable, why, sizeof why);
      if (st != TT_OK || !unavailable) return st;
    } else {
      snprintf(why, sizeof why, "cuDNN SDPA takes bf16 and f16 only");
    }
    att_log_fallback(&key, why);
  }
  return tt_att_fallback_forward(dtype, B, T, S, Hq, Hkv, D, causal, scale, q, k, v, o, lse, stream);
}

extern "C" tt_status tt_cuda_attention_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv,
                                                int64_t D, int causal, double scale, const void *q, const void *k,
                                                const void *v, const void *o, const void *lse, const void *dout,
                                                void *dq, void *dk, void *dv) {
  tt_status st = att_check("attention_backward", dtype, D);
  if (st != TT_OK) return st;
  if (B <= 0 || Hq <= 0 || Hkv <= 0) return TT_OK;
  int device;
  cudaStream_t stream;
  if ((st = att_current(&device, &stream)) != TT_OK) return st;

  if (T > 0 && S > 0 && D > 0) {
    const att_key key = att_make_key(ATT_BWD, dtype, B, T, S, Hq, Hkv, D, causal);
    char why[ATT_REASON];
    int unavailable = 1;
    if (dtype == TT_BF16 || dtype == TT_F16) {
      const att_ptrs x = {q, k, v, o, lse, dout, NULL, NULL, dq, dk, dv};
      st = att_cudnn_run(device, stream, &key, scale, &x, &unavailable, why, sizeof why);
      if (st != TT_OK || !unavailable) return st;
    } else {
      snprintf(why, sizeof why, "cuDNN SDPA takes bf16 and f16 only");
    }
    att_log_fallback(&key, why);
  }
  return tt_att_fallback_backward(dtype, B, T, S, Hq, Hkv, D, causal, scale, q, k, v, o, lse, dout, dq, dk, dv,
                                  stream);
}

/* ------------------------------------------------------------------------ */
/* The deviceless check (bindings/titan.h): the graph and plan search above, */
/* for a GPU described by cuDNN's JSON device properties instead of a GPU.  */
/* ------------------------------------------------------------------------ */

extern "C" tt_status tt_cuda_attention_graph_check(int backward, int dtype, int causal, int deterministic, int64_t B,
                                                   int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int sm,
                                                   const char *deviceprop_json, int *accepted, char *report,
                                                   size_t report_len) {
  if (!accepted || !report || report_len == 0 || !deviceprop_json)
    return tt_error_set(TT_ERR_INVALID, "attention graph check: accepted, report and deviceprop_json are required");
  *accepted = 0;
  report[0] = '\0';
  if (dtype != TT_BF16 && dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "attention graph check: dtype %d (cuDNN SDPA takes bf16 and f16)", dtype);
  if (B <= 0 || T <= 0 || S <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv != 0)
    return tt_error_set(TT_ERR_SHAPE, "attention graph check: B %lld T %lld S %lld Hq %lld Hkv %lld D %lld (all > 0, "
                        "Hq a multiple of Hkv)", (long long)B, (long long)T, (long long)S, (long long)Hq,
                        (long long)Hkv, (long long)D);
#if CUDNN_VERSION < 90800
  (void)backward, (void)causal, (void)deterministic, (void)sm;
  return tt_error_set(TT_ERR_UNSUPPORTED, "attention graph check: built against cuDNN %d; device properties "
                      "without a GPU need cuDNN 9.8", (int)CUDNN_VERSION);
#else
  if (cudnnGetVersion() < 90800)
    return tt_error_set(TT_ERR_UNSUPPORTED, "attention graph check: cuDNN %zu; device properties without a GPU need "
                        "cuDNN 9.8", cudnnGetVersion());
  att_key key;
  memset(&key, 0, sizeof key);
  key.dir = backward ? ATT_BWD : ATT_FWD;
  key.dtype = dtype;
  key.causal = causal != 0;
  key.det = deterministic != 0;
  key.B = B, key.T = T, key.S = S, key.Hq = Hq, key.Hkv = Hkv, key.D = D;
  /* Titan's own rules first: a shape they refuse never reaches cuDNN. */
  char why[ATT_REASON];
  if (!att_cudnn_takes(sm, &key, why, sizeof why)) {
    snprintf(report, report_len, "not offered to cuDNN: %s", why);
    return TT_OK;
  }
  cudnnBackendDescriptor_t devprop = NULL;
  cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, &devprop);
  if (st == CUDNN_STATUS_SUCCESS)
    st = cudnnBackendSetAttribute(devprop, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                  (int64_t)strlen(deviceprop_json), deviceprop_json);
  if (st == CUDNN_STATUS_SUCCESS) st = cudnnBackendFinalize(devprop);
  if (st != CUDNN_STATUS_SUCCESS) {
    char msg[256];
    att_last_cudnn_message(msg, sizeof msg);
    if (devprop) cudnnBackendDestroyDescriptor(devprop);
    return tt_error_set(TT_ERR_INVALID, "attention graph check: cuDNN refused the device properties: %s%s%s",
                        cudnnGetErrorString(st), msg[0] ? ": " : "", msg);
  }
  att_graph *g = new att_graph();
  g->next_uid = UID_VIRTUAL;
  g->io = dtype == TT_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  if (key.dir == ATT_FWD) att_build_forward(g, &key);
  else att_build_backward(g, &key);
  cudnnBackendDescriptor_t og = ATT_NEW(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  ATT_SET(g, og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nops, g->ops);
  ATT_FINALIZE(g, og, "operation graph");
  att_tally tally;
  memset(&tally, 0, sizeof tally);
  int64_t ws = 0;
  if (g->status == CUDNN_STATUS_SUCCESS) (void)att_find_plan(g, NULL, devprop, og, key.det, &ws, &tally);
  *accepted = tally.accepted;
  if (tally.accepted > 0) {
    int n = snprintf(report, report_len, "%d of %d engine config(s) accepted the %d-op graph (engine", tally.accepted,
                     tally.proposed, g->nops);
    for (int i = 0; i < tally.accepted && i < 2 * ATT_CFGS && n > 0 && (size_t)n < report_len; i++)
      n += snprintf(report + n, report_len - n, "%s %lld", i ? "," : "", (long long)tally.engines[i]);
    if (n > 0 && (size_t)n < report_len) snprintf(report + n, report_len - n, ")");
  } else {
    snprintf(report, report_len, "rejected (%d engine config(s) proposed): %s", tally.proposed,
             g->status != CUDNN_STATUS_SUCCESS ? g->failure : "no engine config finalizes");
  }
  att_graph_release(g);
  delete g;
  cudnnBackendDestroyDescriptor(devprop);
  return TT_OK;
#endif
}
