/*
 * ops_nn.c — entry points of the fused neural-network primitives and the
 * optimizer: embedding, RMSNorm, RoPE, attention, SwiGLU, cross-entropy,
 * AdamW, global norm. Fused kernels read raw rows, so their inputs must be
 * contiguous: a strided input is an error that says so (never a silent copy
 * on a hot path).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ops_common.h"

/* ---- embedding ------------------------------------------------------- */

tt_status tt_op_embedding(const tt_tensor *weight, const tt_tensor *ids, tt_tensor **out) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_ndim("embedding", "weight", weight, 2, "[vocab, dim]"));
  TT_TRY(tt_chk_float("embedding", "weight", weight));
  TT_TRY(tt_chk_index("embedding", "ids", ids));
  TT_TRY(tt_chk_same_device("embedding", "weight", weight, "ids", ids));
  TT_TRY(tt_chk_contig("embedding", "weight", weight));
  if (ids->ndim >= TT_MAX_DIMS)
    return tt_error_set(TT_ERR_SHAPE, "embedding: ids %s has too many dims (weight %s)", SHP(ids, s1), SHP(weight, s2));
  int64_t shape[TT_MAX_DIMS];
  for (int i = 0; i < ids->ndim; i++) shape[i] = ids->shape[i];
  shape[ids->ndim] = weight->shape[1];
  int fresh = 0;
  TT_TRY(tt_out_prepare("embedding", "out", out, ids->ndim + 1, shape, weight->dtype, weight->device, &fresh));
  if (weight->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL;
  tt_status st = tt_index_i64(ids, &idx);
  if (st == TT_OK) st = tt_chk_index_range("embedding", idx, weight->shape[0], 0, 0);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(weight->device);
    if (!be || !be->embedding) st = tt_error_set(TT_ERR_UNSUPPORTED, "embedding: not implemented on this device");
    else
      st = tt_kernel_check(be->embedding(weight->dtype, tt_tensor_numel(ids), weight->shape[1], weight->shape[0],
                                         tt_tensor_data(weight), tt_tensor_data(idx), tt_tensor_data(*out)),
                           "embedding", be, weight->dtype);
  }
  tt_tensor_release(idx);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_embedding_backward(const tt_tensor *dy, const tt_tensor *ids, tt_tensor *dweight) {
  char s1[96], s2[96], s3[96];
  TT_TRY(tt_chk_ndim("embedding_backward", "dweight", dweight, 2, "[vocab, dim]"));
  TT_TRY(tt_chk_float("embedding_backward", "dweight", dweight));
  TT_TRY(tt_chk_same_dtype("embedding_backward", "dweight", dweight, "dy", dy));
  TT_TRY(tt_chk_index("embedding_backward", "ids", ids));
  TT_TRY(tt_chk_contig("embedding_backward", "dy", dy));
  TT_TRY(tt_chk_contig("embedding_backward", "dweight", dweight));
  int ok = dy->ndim == ids->ndim + 1 && dy->shape[dy->ndim - 1] == dweight->shape[1];
  for (int i = 0; ok && i < ids->ndim; i++)
    if (dy->shape[i] != ids->shape[i]) ok = 0;
  if (!ok)
    return tt_error_set(TT_ERR_SHAPE, "embedding_backward: dy %s does not match ids %s and dweight %s", SHP(dy, s1),
                        SHP(ids, s2), SHP(dweight, s3));
  if (dweight->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL;
  tt_status st = tt_index_i64(ids, &idx);
  if (st == TT_OK) st = tt_chk_index_range("embedding_backward", idx, dweight->shape[0], 0, 0);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(dweight->device);
    if (!be || !be->embedding_backward)
      st = tt_error_set(TT_ERR_UNSUPPORTED, "embedding_backward: not implemented on this device");
    else
      st = tt_kernel_check(be->embedding_backward(dweight->dtype, tt_tensor_numel(ids), dweight->shape[1], dweight->shape[0],
                                  tt_tensor_data(dy), tt_tensor_data(idx), tt_tensor_data(dweight)), "embedding_backward", be, dweight->dtype);
  }
  tt_tensor_release(idx);
  return st;
}

/* ---- RMSNorm ----------------------------------------------------------- */

static tt_status tt_chk_norm(const char *op, const tt_tensor *x, const tt_tensor *w) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_float(op, "x", x));
  TT_TRY(tt_chk_same_dtype(op, "x", x, "weight", w));
  TT_TRY(tt_chk_same_device(op, "x", x, "weight", w));
  TT_TRY(tt_chk_contig(op, "x", x));
  TT_TRY(tt_chk_contig(op, "weight", w));
  if (x->ndim < 1 || w->ndim != 1 || w->shape[0] != x->shape[x->ndim - 1])
    return tt_error_set(TT_ERR_SHAPE, "%s: x %s and weight %s; expected weight [%lld] matching x's last dim", op,
                        SHP(x, s1), SHP(w, s2), (long long)(x->ndim ? x->shape[x->ndim - 1] : 0));
  return TT_OK;
}

tt_status tt_op_rmsnorm(const tt_tensor *x, const tt_tensor *weight, double eps, tt_tensor **y, tt_tensor **rstd) {
  TT_TRY(tt_chk_norm("rmsnorm", x, weight));
  if (!(eps >= 0)) return tt_error_set(TT_ERR_INVALID, "rmsnorm: eps must be >= 0, got %g", eps);
  int64_t dim = x->shape[x->ndim - 1], rows = dim ? tt_tensor_numel(x) / dim : 0;
  int f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare("rmsnorm", "y", y, x->ndim, x->shape, x->dtype, x->device, &f1));
  tt_status st = tt_out_prepare("rmsnorm", "rstd", rstd, x->ndim - 1, x->shape, tt_stat_dtype(x->dtype), x->device, &f2);
  if (st == TT_OK && x->device.type != TT_META) {
    const tt_kernels *be = tt_backend(x->device);
    if (!be || !be->rmsnorm) st = tt_error_set(TT_ERR_UNSUPPORTED, "rmsnorm: not implemented on this device");
    else
      st = tt_kernel_check(be->rmsnorm(x->dtype, rows, dim, eps, tt_tensor_data(x), tt_tensor_data(weight), tt_tensor_data(*y),
                       tt_tensor_data(*rstd)), "rmsnorm", be, x->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(y, f1);
    tt_out_discard(rstd, f2);
  }
  return st;
}

tt_status tt_op_add_rmsnorm(const tt_tensor *x, const tt_tensor *residual, const tt_tensor *weight, double eps,
                            tt_tensor **h, tt_tensor **y, tt_tensor **rstd) {
  const char *op = "add_rmsnorm";
  TT_TRY(tt_chk_norm(op, x, weight));
  TT_TRY(tt_chk_same_shape(op, "x", x, "residual", residual));
  TT_TRY(tt_chk_same_dtype(op, "x", x, "residual", residual));
  TT_TRY(tt_chk_same_device(op, "x", x, "residual", residual));
  TT_TRY(tt_chk_contig(op, "residual", residual));
  if (!(eps >= 0)) return tt_error_set(TT_ERR_INVALID, "%s: eps must be >= 0, got %g", op, eps);
  int64_t dim = x->shape[x->ndim - 1], rows = dim ? tt_tensor_numel(x) / dim : 0;
  int f0 = 0, f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare(op, "h", h, x->ndim, x->shape, x->dtype, x->device, &f0));
  tt_status st = tt_out_prepare(op, "y", y, x->ndim, x->shape, x->dtype, x->device, &f1);
  if (st == TT_OK) st = tt_out_prepare(op, "rstd", rstd, x->ndim - 1, x->shape, tt_stat_dtype(x->dtype), x->device, &f2);
  if (st == TT_OK && x->device.type != TT_META) {
    const tt_kernels *be = tt_backend(x->device);
    if (!be || !be->add_rmsnorm) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
    else
      st = tt_kernel_check(be->add_rmsnorm(x->dtype, rows, dim, eps, tt_tensor_data(x), tt_tensor_data(residual),
                                           tt_tensor_data(weight), tt_tensor_data(*h), tt_tensor_data(*y),
                                           tt_tensor_data(*rstd)), op, be, x->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(h, f0);
    tt_out_discard(y, f1);
    tt_out_discard(rstd, f2);
  }
  return st;
}

/* The backward's checks and kernel call; dx is given (acc: accumulated onto). */
static tt_status tt_rmsnorm_backward_run(const char *op, const tt_tensor *x, const tt_tensor *weight,
                                         const tt_tensor *rstd, const tt_tensor *dy, tt_tensor **dx,
                                         tt_tensor *dweight, int acc) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_norm(op, x, weight));
  TT_TRY(tt_chk_same_shape(op, "x", x, "dy", dy));
  TT_TRY(tt_chk_same_dtype(op, "x", x, "dy", dy));
  TT_TRY(tt_chk_contig(op, "dy", dy));
  int64_t dim = x->shape[x->ndim - 1], rows = dim ? tt_tensor_numel(x) / dim : 0;
  if (rstd->dtype != tt_stat_dtype(x->dtype) || tt_tensor_numel(rstd) != rows)
    return tt_error_set(TT_ERR_SHAPE, "%s: rstd %s does not hold one statistic per row of x %s", op, SHP(rstd, s1),
                        SHP(x, s2));
  if (dweight) {
    TT_TRY(tt_chk_same_shape(op, "weight", weight, "dweight", dweight));
    TT_TRY(tt_chk_same_dtype(op, "weight", weight, "dweight", dweight));
    TT_TRY(tt_chk_contig(op, "dweight", dweight));
  }
  int fresh = 0;
  TT_TRY(tt_out_prepare(op, "dx", dx, x->ndim, x->shape, x->dtype, x->device, &fresh));
  if (x->device.type == TT_META) return TT_OK;
  const tt_kernels *be = tt_backend(x->device);
  tt_status st;
  if (!be || !be->rmsnorm_backward)
    st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
  else
    st = tt_kernel_check(be->rmsnorm_backward(x->dtype, rows, dim, tt_tensor_data(x), tt_tensor_data(weight),
                                              tt_tensor_data(rstd), tt_tensor_data(dy), tt_tensor_data(*dx),
                                              dweight ? tt_tensor_data(dweight) : NULL, acc),
                         op, be, x->dtype);
  if (st != TT_OK) tt_out_discard(dx, fresh);
  return st;
}

tt_status tt_op_rmsnorm_backward(const tt_tensor *x, const tt_tensor *weight, const tt_tensor *rstd,
                                 const tt_tensor *dy, tt_tensor **dx, tt_tensor *dweight) {
  return tt_rmsnorm_backward_run("rmsnorm_backward", x, weight, rstd, dy, dx, dweight, 0);
}

tt_status tt_op_rmsnorm_backward_acc(const tt_tensor *x, const tt_tensor *weight, const tt_tensor *rstd,
                                     const tt_tensor *dy, tt_tensor *dx, tt_tensor *dweight) {
  if (!dx) return tt_error_set(TT_ERR_INVALID, "rmsnorm_backward_acc: dx (the gradient to accumulate onto) is NULL");
  return tt_rmsnorm_backward_run("rmsnorm_backward_acc", x, weight, rstd, dy, &dx, dweight, 1);
}

/* ---- RoPE ------------------------------------------------------------- */

tt_status tt_op_rope_table(int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                           double low_freq_factor, double high_freq_factor, int64_t original_max_seq, int dtype,
                           tt_tensor **cos, tt_tensor **sin) {
  if (head_dim <= 0 || head_dim % 2)
    return tt_error_set(TT_ERR_INVALID, "rope_table: head_dim must be positive and even, got %lld", (long long)head_dim);
  if (max_seq <= 0) return tt_error_set(TT_ERR_INVALID, "rope_table: max_seq must be positive, got %lld", (long long)max_seq);
  if (!(theta > 0)) return tt_error_set(TT_ERR_INVALID, "rope_table: theta must be positive, got %g", theta);
  if (scale_factor > 1 && (!(high_freq_factor > low_freq_factor) || low_freq_factor <= 0 || original_max_seq <= 0))
    return tt_error_set(TT_ERR_INVALID,
                        "rope_table: Llama 3.1 scaling needs 0 < low_freq_factor < high_freq_factor and "
                        "original_max_seq > 0 (got %g, %g, %lld)",
                        low_freq_factor, high_freq_factor, (long long)original_max_seq);
  if (dtype != TT_F32 && dtype != TT_F64)
    return tt_error_set(TT_ERR_DTYPE, "rope_table: dtype %s; expected float32 or float64", tt_dtype_name(dtype));
  int64_t shape[2] = {max_seq, head_dim / 2};
  tt_device cpu = {TT_CPU, 0};
  TT_TRY(tt_tensor_empty(2, shape, dtype, cpu, cos));
  tt_status st = tt_tensor_empty(2, shape, dtype, cpu, sin);
  if (st == TT_OK)
    st = tt_kernels_cpu()->rope_table(dtype, head_dim, max_seq, theta, scale_factor, low_freq_factor, high_freq_factor,
                                      original_max_seq, tt_tensor_data(*cos), tt_tensor_data(*sin));
  if (st != TT_OK) {
    tt_out_discard(cos, 1);
    tt_out_discard(sin, 1);
  }
  return st;
}

tt_status tt_op_rope(const tt_tensor *x, const tt_tensor *cos, const tt_tensor *sin, int64_t pos_offset, int inverse,
                     tt_tensor **out) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_ndim("rope", "x", x, 4, "[batch, seq, heads, head_dim]"));
  TT_TRY(tt_chk_float("rope", "x", x));
  /* The angles stay in f32 (f64 for f64 x): bf16/f16 x rotate with f32 tables. */
  int table_dtype = x->dtype == TT_F64 ? TT_F64 : TT_F32;
  if (cos->dtype != table_dtype || sin->dtype != table_dtype)
    return tt_error_set(TT_ERR_DTYPE, "rope: tables are %s/%s for x %s of %s; expected %s tables",
                        tt_dtype_name(cos->dtype), tt_dtype_name(sin->dtype), SHP(x, s1), tt_dtype_name(x->dtype),
                        tt_dtype_name(table_dtype));
  TT_TRY(tt_chk_same_device("rope", "x", x, "cos", cos));
  TT_TRY(tt_chk_contig("rope", "x", x));
  TT_TRY(tt_chk_contig("rope", "cos", cos));
  TT_TRY(tt_chk_contig("rope", "sin", sin));
  TT_TRY(tt_chk_same_shape("rope", "cos", cos, "sin", sin));
  int64_t T = x->shape[1], D = x->shape[3];
  if (D % 2 || cos->ndim != 2 || cos->shape[1] != D / 2)
    return tt_error_set(TT_ERR_SHAPE, "rope: x %s and table %s; expected an even head_dim and a table [seq, %lld]",
                        SHP(x, s1), SHP(cos, s2), (long long)(D / 2));
  if (pos_offset < 0 || pos_offset + T > cos->shape[0])
    return tt_error_set(TT_ERR_SHAPE, "rope: positions [%lld, %lld) of x %s exceed the table's %lld positions",
                        (long long)pos_offset, (long long)(pos_offset + T), SHP(x, s1), (long long)cos->shape[0]);
  int fresh = 0;
  if (*out != x) TT_TRY(tt_out_prepare("rope", "out", out, 4, x->shape, x->dtype, x->device, &fresh));
  if (x->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, x->device, rope, "rope");
  tt_status st = tt_kernel_check(be->rope(x->dtype, x->shape[0], T, x->shape[2], D, tt_tensor_data(x), tt_tensor_data(cos),
                          tt_tensor_data(sin), pos_offset, inverse, tt_tensor_data(*out)), "rope", be, x->dtype);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

/* ---- attention ----------------------------------------------------------- */

static tt_status tt_chk_attention(const char *op, const tt_tensor *q, const tt_tensor *k, const tt_tensor *v) {
  char s1[96], s2[96], s3[96];
  TT_TRY(tt_chk_ndim(op, "q", q, 4, "[batch, seq, heads, head_dim]"));
  TT_TRY(tt_chk_ndim(op, "k", k, 4, "[batch, seq, kv_heads, head_dim]"));
  TT_TRY(tt_chk_ndim(op, "v", v, 4, "[batch, seq, kv_heads, head_dim]"));
  TT_TRY(tt_chk_float(op, "q", q));
  TT_TRY(tt_chk_same_dtype(op, "q", q, "k", k));
  TT_TRY(tt_chk_same_dtype(op, "q", q, "v", v));
  TT_TRY(tt_chk_same_device(op, "q", q, "k", k));
  TT_TRY(tt_chk_same_device(op, "q", q, "v", v));
  TT_TRY(tt_chk_contig(op, "q", q));
  TT_TRY(tt_chk_contig(op, "k", k));
  TT_TRY(tt_chk_contig(op, "v", v));
  TT_TRY(tt_chk_same_shape(op, "k", k, "v", v));
  if (q->shape[0] != k->shape[0] || q->shape[3] != k->shape[3] || k->shape[2] == 0 || q->shape[2] % k->shape[2])
    return tt_error_set(TT_ERR_SHAPE,
                        "%s: q %s, k %s, v %s; expected the same batch and head_dim, and query heads a multiple of "
                        "kv heads",
                        op, SHP(q, s1), SHP(k, s2), SHP(v, s3));
  if (q->shape[3] > 256)
    return tt_error_set(TT_ERR_SHAPE, "%s: head_dim %lld of q %s exceeds the supported 256", op,
                        (long long)q->shape[3], SHP(q, s1));
  return TT_OK;
}

tt_status tt_op_attention(const tt_tensor *q, const tt_tensor *k, const tt_tensor *v, int causal, double scale,
                          tt_tensor **out, tt_tensor **lse) {
  TT_TRY(tt_chk_attention("attention", q, k, v));
  int64_t B = q->shape[0], T = q->shape[1], Hq = q->shape[2], D = q->shape[3], S = k->shape[1], Hkv = k->shape[2];
  if (causal && S < T)
    return tt_error_set(TT_ERR_SHAPE, "attention: causal attention needs at least as many keys (%lld) as queries (%lld)",
                        (long long)S, (long long)T);
  int64_t lshape[3] = {B, Hq, T};
  int f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare("attention", "out", out, 4, q->shape, q->dtype, q->device, &f1));
  tt_status st = tt_out_prepare("attention", "lse", lse, 3, lshape, tt_stat_dtype(q->dtype), q->device, &f2);
  if (st == TT_OK && q->device.type != TT_META) {
    const tt_kernels *be = tt_backend(q->device);
    if (!be || !be->attention) st = tt_error_set(TT_ERR_UNSUPPORTED, "attention: not implemented on this device");
    else
      st = tt_kernel_check(be->attention(q->dtype, B, T, S, Hq, Hkv, D, causal, scale, tt_tensor_data(q), tt_tensor_data(k),
                         tt_tensor_data(v), tt_tensor_data(*out), tt_tensor_data(*lse)), "attention", be, q->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(out, f1);
    tt_out_discard(lse, f2);
  }
  return st;
}

tt_status tt_op_attention_backward(const tt_tensor *q, const tt_tensor *k, const tt_tensor *v, const tt_tensor *out,
                                   const tt_tensor *lse, const tt_tensor *dout, int causal, double scale,
                                   tt_tensor **dq, tt_tensor **dk, tt_tensor **dv) {
  const char *op = "attention_backward";
  char s1[96], s2[96];
  TT_TRY(tt_chk_attention(op, q, k, v));
  TT_TRY(tt_chk_same_shape(op, "q", q, "out", out));
  TT_TRY(tt_chk_same_shape(op, "q", q, "dout", dout));
  TT_TRY(tt_chk_same_dtype(op, "q", q, "dout", dout));
  TT_TRY(tt_chk_contig(op, "out", out));
  TT_TRY(tt_chk_contig(op, "dout", dout));
  TT_TRY(tt_chk_contig(op, "lse", lse));
  int64_t B = q->shape[0], T = q->shape[1], Hq = q->shape[2], D = q->shape[3], S = k->shape[1], Hkv = k->shape[2];
  if (lse->ndim != 3 || lse->shape[0] != B || lse->shape[1] != Hq || lse->shape[2] != T ||
      lse->dtype != tt_stat_dtype(q->dtype))
    return tt_error_set(TT_ERR_SHAPE, "%s: lse %s does not match q %s (expected [B, Hq, T])", op, SHP(lse, s1),
                        SHP(q, s2));
  int f1 = 0, f2 = 0, f3 = 0;
  tt_status st = tt_out_prepare(op, "dq", dq, 4, q->shape, q->dtype, q->device, &f1);
  if (st == TT_OK) st = tt_out_prepare(op, "dk", dk, 4, k->shape, k->dtype, k->device, &f2);
  if (st == TT_OK) st = tt_out_prepare(op, "dv", dv, 4, v->shape, v->dtype, v->device, &f3);
  if (st == TT_OK && q->device.type != TT_META) {
    const tt_kernels *be = tt_backend(q->device);
    if (!be || !be->attention_backward)
      st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
    else
      st = tt_kernel_check(be->attention_backward(q->dtype, B, T, S, Hq, Hkv, D, causal, scale, tt_tensor_data(q), tt_tensor_data(k),
                                  tt_tensor_data(v), tt_tensor_data(out), tt_tensor_data(lse), tt_tensor_data(dout),
                                  tt_tensor_data(*dq), tt_tensor_data(*dk), tt_tensor_data(*dv)), "attention_backward", be, q->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(dq, f1);
    tt_out_discard(dk, f2);
    tt_out_discard(dv, f3);
  }
  return st;
}

tt_status tt_op_attention_merge(tt_tensor *acc, tt_tensor *acc_lse, const tt_tensor *out, const tt_tensor *lse,
                                int64_t t0) {
  const char *op = "attention_merge";
  char s1[96], s2[96];
  TT_TRY(tt_chk_ndim(op, "out", out, 4, "[batch, seq, heads, head_dim]"));
  TT_TRY(tt_chk_float(op, "out", out));
  TT_TRY(tt_chk_ndim(op, "acc", acc, 4, "[batch, seq, heads, head_dim]"));
  TT_TRY(tt_chk_ndim(op, "lse", lse, 3, "[batch, heads, seq]"));
  TT_TRY(tt_chk_ndim(op, "acc_lse", acc_lse, 3, "[batch, heads, seq]"));
  const tt_tensor *all[4] = {acc, acc_lse, out, lse};
  const char *names[4] = {"acc", "acc_lse", "out", "lse"};
  const int sd = tt_stat_dtype(out->dtype);
  for (int i = 0; i < 4; i++) {
    TT_TRY(tt_tensor_check_storage(op, names[i], all[i]));
    TT_TRY(tt_chk_contig(op, names[i], all[i]));
    TT_TRY(tt_chk_same_device(op, "out", out, names[i], all[i]));
    if (i != 2 && all[i]->dtype != sd)
      return tt_error_set(TT_ERR_DTYPE, "%s: %s %s has dtype %s; expected %s (out is %s)", op, names[i],
                          SHP(all[i], s1), tt_dtype_name(all[i]->dtype), tt_dtype_name(sd), tt_dtype_name(out->dtype));
  }
  const int64_t B = out->shape[0], Tb = out->shape[1], H = out->shape[2], D = out->shape[3], T = acc->shape[1];
  if (acc->shape[0] != B || acc->shape[2] != H || acc->shape[3] != D || t0 < 0 || t0 + Tb > T)
    return tt_error_set(TT_ERR_SHAPE, "%s: out %s at row %lld does not fit acc %s (expected the same batch, heads "
                        "and head_dim, rows within it)", op, SHP(out, s1), (long long)t0, SHP(acc, s2));
  if (lse->shape[0] != B || lse->shape[1] != H || lse->shape[2] != Tb)
    return tt_error_set(TT_ERR_SHAPE, "%s: lse %s does not match out %s (expected [B, H, Tb])", op, SHP(lse, s1),
                        SHP(out, s2));
  if (acc_lse->shape[0] != B || acc_lse->shape[1] != H || acc_lse->shape[2] != T)
    return tt_error_set(TT_ERR_SHAPE, "%s: acc_lse %s does not match acc %s (expected [B, H, T])", op,
                        SHP(acc_lse, s1), SHP(acc, s2));
  if (out->device.type == TT_META) return TT_OK;
  const tt_kernels *be = tt_backend(out->device);
  if (!be || !be->attention_merge) return tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
  return tt_kernel_check(be->attention_merge(out->dtype, B, T, H, D, t0, Tb, tt_tensor_data(acc),
                                             tt_tensor_data(acc_lse), tt_tensor_data(out), tt_tensor_data(lse)),
                         op, be, out->dtype);
}

/* ---- SwiGLU ------------------------------------------------------------ */

tt_status tt_op_swiglu(const tt_tensor *a, const tt_tensor *b, tt_tensor **out) {
  TT_TRY(tt_chk_float("swiglu", "a", a));
  TT_TRY(tt_chk_same_dtype("swiglu", "a", a, "b", b));
  TT_TRY(tt_chk_same_shape("swiglu", "a", a, "b", b));
  TT_TRY(tt_chk_same_device("swiglu", "a", a, "b", b));
  TT_TRY(tt_chk_contig("swiglu", "a", a));
  TT_TRY(tt_chk_contig("swiglu", "b", b));
  int fresh = 0;
  TT_TRY(tt_out_prepare("swiglu", "out", out, a->ndim, a->shape, a->dtype, a->device, &fresh));
  if (a->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, a->device, swiglu, "swiglu");
  tt_status st = tt_kernel_check(be->swiglu(a->dtype, tt_tensor_numel(a), tt_tensor_data(a), tt_tensor_data(b), tt_tensor_data(*out)), "swiglu", be, a->dtype);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_swiglu_backward(const tt_tensor *a, const tt_tensor *b, const tt_tensor *dy, tt_tensor **da,
                                tt_tensor **db) {
  const char *op = "swiglu_backward";
  TT_TRY(tt_chk_float(op, "a", a));
  TT_TRY(tt_chk_same_dtype(op, "a", a, "b", b));
  TT_TRY(tt_chk_same_dtype(op, "a", a, "dy", dy));
  TT_TRY(tt_chk_same_shape(op, "a", a, "b", b));
  TT_TRY(tt_chk_same_shape(op, "a", a, "dy", dy));
  TT_TRY(tt_chk_contig(op, "a", a));
  TT_TRY(tt_chk_contig(op, "b", b));
  TT_TRY(tt_chk_contig(op, "dy", dy));
  int f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare(op, "da", da, a->ndim, a->shape, a->dtype, a->device, &f1));
  tt_status st = tt_out_prepare(op, "db", db, a->ndim, a->shape, a->dtype, a->device, &f2);
  if (st == TT_OK && a->device.type != TT_META) {
    const tt_kernels *be = tt_backend(a->device);
    if (!be || !be->swiglu_backward) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
    else
      st = tt_kernel_check(be->swiglu_backward(a->dtype, tt_tensor_numel(a), tt_tensor_data(a), tt_tensor_data(b), tt_tensor_data(dy),
                               tt_tensor_data(*da), tt_tensor_data(*db)), "swiglu_backward", be, a->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(da, f1);
    tt_out_discard(db, f2);
  }
  return st;
}

/* ---- cross-entropy ------------------------------------------------------- */

static tt_status tt_chk_ce(const char *op, const tt_tensor *logits, const tt_tensor *targets) {
  char s1[96], s2[96];
  TT_TRY(tt_chk_ndim(op, "logits", logits, 2, "[tokens, vocab]"));
  TT_TRY(tt_chk_float(op, "logits", logits));
  TT_TRY(tt_chk_index(op, "targets", targets));
  TT_TRY(tt_chk_same_device(op, "logits", logits, "targets", targets));
  TT_TRY(tt_chk_contig(op, "logits", logits));
  if (targets->ndim != 1 || targets->shape[0] != logits->shape[0])
    return tt_error_set(TT_ERR_SHAPE, "%s: logits %s and targets %s; expected targets [%lld]", op, SHP(logits, s1),
                        SHP(targets, s2), (long long)logits->shape[0]);
  return TT_OK;
}

/* Targets that count towards the loss (the mean's denominator). On the CPU
 * the validation pass reads every target on the host anyway; on a device it
 * takes a count kernel and a read that waits for the device, which is why
 * callers that know the count (a trainer) do not ask for it. That read also
 * reports a bad target the loss kernel just recorded. */
static tt_status tt_count_valid(const tt_tensor *idx64, int64_t ignore_index, int64_t *count) {
  int64_t n = tt_tensor_numel(idx64), one = 1;
  if (idx64->device.type == TT_CPU) {
    const int64_t *p = tt_tensor_data(idx64);
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += p[i] != ignore_index;
    *count = c;
    return TT_OK;
  }
  TT_KERNEL(be, idx64->device, count_valid, "cross_entropy (count of targets)");
  tt_tensor *c = NULL;
  tt_status st = tt_tensor_empty(1, &one, TT_I64, idx64->device, &c);
  if (st == TT_OK)
    st = tt_kernel_check(be->count_valid(n, tt_tensor_data(idx64), ignore_index, tt_tensor_data(c)), "cross_entropy",
                         be, TT_I64);
  if (st == TT_OK) st = tt_tensor_to_host(c, count, sizeof *count);
  tt_tensor_release(c);
  return st;
}

tt_status tt_op_cross_entropy(const tt_tensor *logits, const tt_tensor *targets, int64_t ignore_index,
                              tt_tensor **losses, tt_tensor **lse, int64_t *num_valid) {
  if (num_valid) *num_valid = 0;
  TT_TRY(tt_chk_ce("cross_entropy", logits, targets));
  int64_t N = logits->shape[0], V = logits->shape[1];
  int f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare("cross_entropy", "losses", losses, 1, &N, logits->dtype, logits->device, &f1));
  tt_status st =
      tt_out_prepare("cross_entropy", "lse", lse, 1, &N, tt_stat_dtype(logits->dtype), logits->device, &f2);
  if (st == TT_OK && logits->device.type != TT_META) {
    tt_tensor *idx = NULL;
    st = tt_index_i64(targets, &idx);
    if (st == TT_OK) st = tt_chk_index_range("cross_entropy", idx, V, 1, ignore_index);
    if (st == TT_OK) {
      const tt_kernels *be = tt_backend(logits->device);
      if (!be || !be->cross_entropy) st = tt_error_set(TT_ERR_UNSUPPORTED, "cross_entropy: not implemented here");
      else
        st = tt_kernel_check(be->cross_entropy(logits->dtype, N, V, tt_tensor_data(logits), tt_tensor_data(idx), ignore_index,
                               tt_tensor_data(*losses), tt_tensor_data(*lse)), "cross_entropy", be, logits->dtype);
    }
    /* After the kernel: a device count's read then also reports its faults. */
    if (st == TT_OK && num_valid) st = tt_count_valid(idx, ignore_index, num_valid);
    tt_tensor_release(idx);
  }
  if (st != TT_OK) {
    tt_out_discard(losses, f1);
    tt_out_discard(lse, f2);
  }
  return st;
}

tt_status tt_op_cross_entropy_backward(const tt_tensor *logits, const tt_tensor *targets, const tt_tensor *lse,
                                       const tt_tensor *dlosses, int64_t ignore_index, tt_tensor **dlogits) {
  const char *op = "cross_entropy_backward";
  char s1[96], s2[96];
  TT_TRY(tt_chk_ce(op, logits, targets));
  int64_t N = logits->shape[0], V = logits->shape[1];
  if (tt_tensor_numel(lse) != N || lse->dtype != tt_stat_dtype(logits->dtype) || !tt_tensor_is_contiguous(lse))
    return tt_error_set(TT_ERR_SHAPE, "%s: lse %s does not match logits %s", op, SHP(lse, s1), SHP(logits, s2));
  if (tt_tensor_numel(dlosses) != N || dlosses->dtype != logits->dtype || !tt_tensor_is_contiguous(dlosses))
    return tt_error_set(TT_ERR_SHAPE, "%s: dlosses %s (%s) does not match logits %s; expected [%lld] contiguous", op,
                        SHP(dlosses, s1), tt_dtype_name(dlosses->dtype), SHP(logits, s2), (long long)N);
  int fresh = 0;
  TT_TRY(tt_out_prepare(op, "dlogits", dlogits, 2, logits->shape, logits->dtype, logits->device, &fresh));
  if (logits->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL;
  tt_status st = tt_index_i64(targets, &idx);
  if (st == TT_OK) st = tt_chk_index_range(op, idx, V, 1, ignore_index);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(logits->device);
    if (!be || !be->cross_entropy_backward) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented here", op);
    else
      st = tt_kernel_check(be->cross_entropy_backward(logits->dtype, N, V, tt_tensor_data(logits), tt_tensor_data(idx),
                                      tt_tensor_data(lse), tt_tensor_data(dlosses), ignore_index,
                                      tt_tensor_data(*dlogits)), "cross_entropy_backward", be, logits->dtype);
  }
  tt_tensor_release(idx);
  if (st != TT_OK) tt_out_discard(dlogits, fresh);
  return st;
}

/* ---- optimizer ------------------------------------------------------------ */

/* The checks of one AdamW update (prefix: "adamw" or "adamw_multi: tensor i"). */
static tt_status tt_chk_adamw(const char *op, const tt_tensor *param, const tt_tensor *grad, const tt_tensor *m,
                              const tt_tensor *v, const tt_tensor *master, int64_t step) {
  char s1[96];
  if (param->dtype != TT_F32 && param->dtype != TT_F64 && param->dtype != TT_BF16)
    return tt_error_set(TT_ERR_DTYPE, "%s: param %s is %s; expected float32, float64 or bfloat16", op, SHP(param, s1),
                        tt_dtype_name(param->dtype));
  if (grad->dtype != TT_F32 && grad->dtype != TT_F64 && grad->dtype != TT_BF16)
    return tt_error_set(TT_ERR_DTYPE, "%s: grad %s is %s; expected float32, float64 or bfloat16", op, SHP(grad, s1),
                        tt_dtype_name(grad->dtype));
  TT_TRY(tt_chk_same_shape(op, "param", param, "grad", grad));
  TT_TRY(tt_chk_same_shape(op, "param", param, "exp_avg", m));
  TT_TRY(tt_chk_same_shape(op, "param", param, "exp_avg_sq", v));
  TT_TRY(tt_chk_same_device(op, "param", param, "grad", grad));
  TT_TRY(tt_chk_same_device(op, "param", param, "exp_avg", m));
  TT_TRY(tt_chk_same_device(op, "param", param, "exp_avg_sq", v));
  if (m->dtype != TT_F32 || v->dtype != TT_F32 || (master && master->dtype != TT_F32))
    return tt_error_set(TT_ERR_DTYPE, "%s: optimizer state for param %s must be float32", op, SHP(param, s1));
  TT_TRY(tt_chk_contig(op, "param", param));
  TT_TRY(tt_chk_contig(op, "grad", grad));
  TT_TRY(tt_chk_contig(op, "exp_avg", m));
  TT_TRY(tt_chk_contig(op, "exp_avg_sq", v));
  if (master) {
    TT_TRY(tt_chk_same_shape(op, "param", param, "master", master));
    TT_TRY(tt_chk_same_device(op, "param", param, "master", master));
    TT_TRY(tt_chk_contig(op, "master", master));
  }
  if (step < 1) return tt_error_set(TT_ERR_INVALID, "%s: step counts from 1, got %lld", op, (long long)step);
  return TT_OK;
}

static tt_status tt_chk_adamw_hp(const char *op, double lr, double beta1, double beta2, double eps,
                                 double weight_decay) {
  if (!(lr >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(eps >= 0) || !(weight_decay >= 0))
    return tt_error_set(TT_ERR_INVALID,
                        "%s: invalid hyper-parameters lr=%g betas=(%g, %g) eps=%g weight_decay=%g; expected "
                        "lr, eps, weight_decay >= 0 and betas in [0, 1)",
                        op, lr, beta1, beta2, eps, weight_decay);
  return TT_OK;
}

tt_status tt_op_adamw(tt_tensor *param, const tt_tensor *grad, tt_tensor *m, tt_tensor *v, tt_tensor *master,
                      double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const char *op = "adamw";
  TT_TRY(tt_chk_adamw(op, param, grad, m, v, master, step));
  TT_TRY(tt_chk_adamw_hp(op, lr, beta1, beta2, eps, weight_decay));
  if (param->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, param->device, adamw, op);
  double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
  return tt_kernel_check(be->adamw(param->dtype, grad->dtype, tt_tensor_numel(param), tt_tensor_data(param), tt_tensor_data(grad),
                   tt_tensor_data(m), tt_tensor_data(v), master ? tt_tensor_data(master) : NULL, lr, beta1, beta2,
                   eps, weight_decay, bc1, bc2), "adamw", be, param->dtype);
}

/* The per-tensor checks of a multi-tensor update (op: its name); steps may
 * be NULL (the device-scalar update, whose steps the host keeps). */
static tt_status tt_chk_adamw_many(const char *name, int n, tt_tensor *const *params, tt_tensor *const *grads,
                                   tt_tensor *const *ms, tt_tensor *const *vs, tt_tensor *const *masters,
                                   const int64_t *steps) {
  char op[64];
  for (int i = 0; i < n; i++) {
    snprintf(op, sizeof op, "%s: tensor %d", name, i);
    if (!params[i] || !grads[i] || !ms[i] || !vs[i])
      return tt_error_set(TT_ERR_INVALID, "%s: param, grad, exp_avg and exp_avg_sq must all be given", op);
    TT_TRY(tt_chk_adamw(op, params[i], grads[i], ms[i], vs[i], masters ? masters[i] : NULL, steps ? steps[i] : 1));
    TT_TRY(tt_chk_same_device(op, "param", params[i], "the first param", params[0]));
  }
  return TT_OK;
}

/* Packs the run of consecutive tensors from i with tensor i's dtypes (at
 * most TT_ADAMW_MULTI_MAX) into run; returns its length. Bias corrections
 * from steps, or 0 when steps is NULL (the kernel reads them from memory). */
static int tt_adamw_pack(int i, int n, tt_tensor *const *params, tt_tensor *const *grads, tt_tensor *const *ms,
                         tt_tensor *const *vs, tt_tensor *const *masters, double beta1, double beta2,
                         const int64_t *steps, tt_adamw_tensor *run) {
  const int pd = params[i]->dtype, gd = grads[i]->dtype;
  int k = 0;
  for (; i < n && k < TT_ADAMW_MULTI_MAX && params[i]->dtype == pd && grads[i]->dtype == gd; i++) {
    tt_adamw_tensor *t = &run[k++];
    t->param = tt_tensor_data(params[i]);
    t->grad = tt_tensor_data(grads[i]);
    t->m = tt_tensor_data(ms[i]);
    t->v = tt_tensor_data(vs[i]);
    t->master = masters && masters[i] ? tt_tensor_data(masters[i]) : NULL;
    t->n = tt_tensor_numel(params[i]);
    t->bias_correction1 = steps ? 1.0 - pow(beta1, (double)steps[i]) : 0;
    t->bias_correction2 = steps ? 1.0 - pow(beta2, (double)steps[i]) : 0;
  }
  return k;
}

/* Every tensor is checked before any is updated, so a bad one leaves all
 * as they were. Runs of consecutive tensors with the same dtypes go to the
 * backend's adamw_multi as one call (one launch per TT_ADAMW_MULTI_MAX on
 * CUDA); backends without it get one adamw call per tensor. */
tt_status tt_op_adamw_multi(int n, tt_tensor *const *params, tt_tensor *const *grads, tt_tensor *const *ms,
                            tt_tensor *const *vs, tt_tensor *const *masters, double lr, double beta1, double beta2,
                            double eps, double weight_decay, const int64_t *steps) {
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "adamw_multi: n = %d tensors", n);
  TT_TRY(tt_chk_adamw_hp("adamw_multi", lr, beta1, beta2, eps, weight_decay));
  TT_TRY(tt_chk_adamw_many("adamw_multi", n, params, grads, ms, vs, masters, steps));
  if (n == 0 || params[0]->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, params[0]->device, adamw, "adamw_multi");
  tt_adamw_tensor run[TT_ADAMW_MULTI_MAX];
  for (int i = 0; i < n;) {
    const int pd = params[i]->dtype, gd = grads[i]->dtype;
    const int k = tt_adamw_pack(i, n, params, grads, ms, vs, masters, beta1, beta2, steps, run);
    i += k;
    tt_status st;
    if (be->adamw_multi) {
      st = tt_kernel_check(be->adamw_multi(pd, gd, k, run, lr, beta1, beta2, eps, weight_decay), "adamw_multi", be, pd);
    } else {
      st = TT_OK;
      for (int j = 0; j < k && st == TT_OK; j++)
        st = tt_kernel_check(be->adamw(pd, gd, run[j].n, run[j].param, run[j].grad, run[j].m, run[j].v, run[j].master,
                                       lr, beta1, beta2, eps, weight_decay, run[j].bias_correction1,
                                       run[j].bias_correction2), "adamw_multi", be, pd);
    }
    if (st != TT_OK) return st;
  }
  return TT_OK;
}

/* The scalars exactly as the backends round them from tt_op_adamw_multi's
 * doubles (kernels/cpu/optim.c, kernels/cuda/optim.cu). */
tt_status tt_adamw_scalars(int n, double lr, double beta1, double beta2, double weight_decay, const int64_t *steps,
                           float *out) {
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "adamw_scalars: n = %d tensors", n);
  TT_TRY(tt_chk_adamw_hp("adamw_scalars", lr, beta1, beta2, 0, weight_decay));
  out[0] = (float)(1.0 - lr * weight_decay);
  for (int i = 0; i < n; i++) {
    if (steps[i] < 1)
      return tt_error_set(TT_ERR_INVALID, "adamw_scalars: tensor %d: step counts from 1, got %lld", i,
                          (long long)steps[i]);
    double bc1 = 1.0 - pow(beta1, (double)steps[i]), bc2 = 1.0 - pow(beta2, (double)steps[i]);
    out[1 + 2 * i] = (float)(-(lr / bc1));
    out[2 + 2 * i] = (float)sqrt(bc2);
  }
  return TT_OK;
}

/* A small f64/f32 vector of at least `need` contiguous elements on `dev`. */
static tt_status tt_chk_scalar_vec(const char *op, const char *name, const tt_tensor *t, int dtype, int64_t need,
                                   tt_device dev) {
  char nm[32], nm2[32];
  if (!t) return tt_error_set(TT_ERR_INVALID, "%s: %s must be given", op, name);
  if (t->dtype != dtype || tt_tensor_numel(t) < need)
    return tt_error_set(TT_ERR_SHAPE, "%s: %s is %s with %lld elements; expected %s with at least %lld", op, name,
                        tt_dtype_name(t->dtype), (long long)tt_tensor_numel(t), tt_dtype_name(dtype), (long long)need);
  TT_TRY(tt_chk_contig(op, name, t));
  if (!tt_same_device(t->device, dev))
    return tt_error_set(TT_ERR_DEVICE, "%s: %s is on %s; expected %s", op, name,
                        tt_device_name(t->device, nm, sizeof nm), tt_device_name(dev, nm2, sizeof nm2));
  return TT_OK;
}

tt_status tt_op_adamw_multi_dev(int n, tt_tensor *const *params, tt_tensor *const *grads, tt_tensor *const *ms,
                                tt_tensor *const *vs, tt_tensor *const *masters, double beta1, double beta2,
                                double eps, const tt_tensor *scalars, const tt_tensor *norm_clip) {
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "adamw_multi_dev: n = %d tensors", n);
  TT_TRY(tt_chk_adamw_hp("adamw_multi_dev", 0, beta1, beta2, eps, 0));
  TT_TRY(tt_chk_adamw_many("adamw_multi_dev", n, params, grads, ms, vs, masters, NULL));
  for (int i = 0; i < n; i++)
    if (params[i]->dtype == TT_F64 || grads[i]->dtype == TT_F64)
      return tt_error_set(TT_ERR_DTYPE, "adamw_multi_dev: tensor %d: float64 params and grads take tt_op_adamw_multi "
                          "(host scalars)", i);
  if (n == 0 || params[0]->device.type == TT_META) return TT_OK;
  tt_device dev = params[0]->device;
  TT_TRY(tt_chk_scalar_vec("adamw_multi_dev", "scalars", scalars, TT_F32, 1 + 2 * (int64_t)n, dev));
  if (norm_clip) TT_TRY(tt_chk_scalar_vec("adamw_multi_dev", "norm_clip", norm_clip, TT_F64, 2, dev));
  const tt_kernels *be = tt_backend(dev);
  if (!be || !be->adamw_multi_dev)
    return tt_error_set(TT_ERR_UNSUPPORTED, "adamw_multi_dev: not implemented on this device");
  const float *sc = tt_tensor_data(scalars);
  const double *nc = norm_clip ? (const double *)tt_tensor_data(norm_clip) : NULL;
  tt_adamw_tensor run[TT_ADAMW_MULTI_MAX];
  for (int i = 0; i < n;) {
    const int pd = params[i]->dtype, gd = grads[i]->dtype, first = i;
    const int k = tt_adamw_pack(i, n, params, grads, ms, vs, masters, beta1, beta2, NULL, run);
    i += k;
    TT_TRY(tt_kernel_check(be->adamw_multi_dev(pd, gd, k, run, beta1, beta2, eps, sc, sc + 1 + 2 * first, nc),
                           "adamw_multi_dev", be, pd));
  }
  return TT_OK;
}

/* The norm and clip coefficient, as the eager step computes them on the
 * host (trainer: optim.clip_grad_norm), written into device memory. */
tt_status tt_op_global_norm_dev(int n, tt_tensor *const *ts, double max_norm, tt_tensor *out) {
  const char *op = "global_norm_dev";
  if (n < 1) return tt_error_set(TT_ERR_INVALID, "%s: n = %d tensors; expected at least 1", op, n);
  for (int i = 0; i < n; i++) {
    if (!ts[i]) return tt_error_set(TT_ERR_INVALID, "%s: tensor %d is missing", op, i);
    if (!tt_dtype_is_float(ts[i]->dtype))
      return tt_error_set(TT_ERR_DTYPE, "%s: tensor %d has dtype %s; expected a float tensor", op, i,
                          tt_dtype_name(ts[i]->dtype));
    TT_TRY(tt_chk_contig(op, "tensor", ts[i]));
    TT_TRY(tt_chk_same_device(op, "tensor", ts[i], "the first tensor", ts[0]));
  }
  tt_device dev = ts[0]->device;
  if (!out) return tt_error_set(TT_ERR_INVALID, "%s: out must be given", op);
  if (dev.type == TT_META) return TT_OK;
  TT_TRY(tt_chk_scalar_vec(op, "out", out, TT_F64, 2, dev));
  const tt_kernels *be = tt_backend(dev);
  if (!be) return tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
  double *o = tt_tensor_data(out);
  const int count = tt_tensor_numel(out) >= 3; /* out[2]: the norms that were NaN or inf, counted */
  if (!be->global_norm_dev) {
    /* host memory: the host computes it, as the eager step does */
    double norm;
    TT_TRY(tt_op_global_norm(n, ts, &norm));
    o[0] = norm;
    o[1] = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    if (count && !isfinite(norm)) o[2] += 1.0;
    return TT_OK;
  }
  int *dts = malloc((size_t)n * sizeof *dts);
  int64_t *ns = malloc((size_t)n * sizeof *ns);
  const void **xs = malloc((size_t)n * sizeof *xs);
  tt_status st = dts && ns && xs ? TT_OK : tt_error_set(TT_ERR_OOM, "%s: out of host memory", op);
  for (int i = 0; st == TT_OK && i < n; i++) {
    dts[i] = ts[i]->dtype;
    ns[i] = tt_tensor_numel(ts[i]);
    xs[i] = tt_tensor_data(ts[i]);
  }
  if (st == TT_OK) st = tt_kernel_check(be->global_norm_dev(n, dts, ns, xs, max_norm, o, count), op, be, dts[0]);
  free(dts); free(ns); free(xs);
  return st;
}

/* The tensors' sums of squares come back in one wait per device where the
 * backend has sumsq_many (a GPU: not one wait per tensor); they are added on
 * the host in the tensors' order either way, so the bits do not depend on it. */
tt_status tt_op_global_norm(int n, tt_tensor *const *ts, double *out) {
  *out = 0;
  if (n <= 0) return TT_OK;
  tt_tensor **packed = calloc((size_t)n, sizeof *packed);
  double *sq = calloc((size_t)n, sizeof *sq);
  char *done = calloc((size_t)n, 1);
  /* the current device's batch, compacted */
  int *bi = calloc((size_t)n, sizeof *bi), *bdt = calloc((size_t)n, sizeof *bdt);
  int64_t *bn = calloc((size_t)n, sizeof *bn);
  const void **bx = calloc((size_t)n, sizeof *bx);
  double *bres = calloc((size_t)n, sizeof *bres);
  tt_status st = packed && sq && done && bi && bdt && bn && bx && bres
                     ? TT_OK
                     : tt_error_set(TT_ERR_OOM, "global_norm: out of host memory");
  for (int i = 0; st == TT_OK && i < n; i++) {
    const tt_tensor *t = ts[i];
    if (!t || t->device.type == TT_META) {
      if (done) done[i] = 1;
      continue;
    }
    if (!tt_dtype_is_float(t->dtype))
      st = tt_error_set(TT_ERR_DTYPE, "global_norm: tensor %d has dtype %s; expected a float tensor", i,
                        tt_dtype_name(t->dtype));
    else if (!tt_backend(t->device))
      st = tt_error_set(TT_ERR_UNSUPPORTED, "global_norm: not implemented on this device");
    else
      st = tt_tensor_contiguous(t, &packed[i]);
  }
  /* One batch per device, in the order the devices first appear. */
  for (int first = 0; st == TT_OK && first < n; first++) {
    if (done[first]) continue;
    tt_device dev = packed[first]->device;
    const tt_kernels *be = tt_backend(dev);
    int k = 0;
    for (int i = first; i < n; i++) {
      if (done[i] || !tt_same_device(packed[i]->device, dev)) continue;
      bi[k] = i;
      bdt[k] = packed[i]->dtype;
      bn[k] = tt_tensor_numel(packed[i]);
      bx[k] = tt_tensor_data(packed[i]);
      k++;
    }
    if (be->sumsq_many)
      st = tt_kernel_check(be->sumsq_many(k, bdt, bn, bx, bres), "sumsq", be, bdt[0]);
    else if (!be->sumsq)
      st = tt_error_set(TT_ERR_UNSUPPORTED, "global_norm: not implemented on this device");
    else
      for (int j = 0; j < k && st == TT_OK; j++)
        st = tt_kernel_check(be->sumsq(bdt[j], bn[j], bx[j], &bres[j]), "sumsq", be, bdt[j]);
    if (st != TT_OK) {
      char nm[32], why[256];
      snprintf(why, sizeof why, "%s", tt_last_error()); /* the message is rewritten below */
      st = tt_error_set(st, "global_norm: sumsq failed on the tensors of %s (%s)", tt_device_name(dev, nm, sizeof nm),
                        why);
    }
    for (int j = 0; j < k && st == TT_OK; j++) {
      sq[bi[j]] = bres[j];
      done[bi[j]] = 1;
    }
  }
  double total = 0;
  for (int i = 0; st == TT_OK && i < n; i++) total += sq[i]; /* fixed order: the tensors' */
  if (st == TT_OK) *out = sqrt(total);
  for (int i = 0; packed && i < n; i++) tt_tensor_release(packed[i]);
  free(packed); free(sq); free(done); free(bi); free(bdt); free(bn); free(bx); free(bres);
  return st;
}
