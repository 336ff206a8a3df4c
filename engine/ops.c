/*
 * ops.c — entry points of the general ops: elementwise, reductions, matmul,
 * indexing. Each validates shapes, dtypes, devices and layout in one place,
 * allocates outputs, then calls the device's backend table. Meta tensors
 * get their outputs (shapes only) and no kernel runs. The neural-network
 * primitives are in ops_nn.c.
 */
#include <stdio.h>
#include <stdlib.h>

#include "ops_common.h"

/* ---- elementwise ---------------------------------------------------- */

static const char *tt_binary_name(int op) {
  static const char *names[] = {"add", "sub", "mul", "div", "maximum", "minimum"};
  return (op >= 0 && op <= TT_MINIMUM) ? names[op] : "binary";
}

/* Broadcast shape of a and b (numpy rules) and each operand's strides in it. */
static tt_status tt_broadcast(const char *op, const tt_tensor *a, const tt_tensor *b, int *ndim, int64_t *shape,
                              int64_t *as, int64_t *bs) {
  char s1[96], s2[96];
  int n = a->ndim > b->ndim ? a->ndim : b->ndim;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - a->ndim), ib = i - (n - b->ndim);
    int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
    if (da != db && da != 1 && db != 1)
      return tt_error_set(TT_ERR_SHAPE, "%s: shapes %s and %s cannot broadcast (dim %d: %lld vs %lld)", op,
                          SHP(a, s1), SHP(b, s2), i, (long long)da, (long long)db);
    shape[i] = da > db ? da : db;
    if (da == 0 || db == 0) shape[i] = 0;
    as[i] = (ia >= 0 && da != 1) ? a->strides[ia] : 0;
    bs[i] = (ib >= 0 && db != 1) ? b->strides[ib] : 0;
  }
  *ndim = n;
  return TT_OK;
}

tt_status tt_op_binary(int op, const tt_tensor *a, const tt_tensor *b, tt_tensor **out) {
  const char *name = tt_binary_name(op);
  char s1[96], s2[96];
  if (op < TT_ADD || op > TT_MINIMUM) return tt_error_set(TT_ERR_INVALID, "binary: unknown op %d", op);
  TT_TRY(tt_chk_float(name, "a", a));
  TT_TRY(tt_chk_same_dtype(name, "a", a, "b", b));
  TT_TRY(tt_chk_same_device(name, "a", a, "b", b));
  int ndim = 0;
  int64_t shape[TT_MAX_DIMS], as[TT_MAX_DIMS], bs[TT_MAX_DIMS];
  TT_TRY(tt_broadcast(name, a, b, &ndim, shape, as, bs));
  int fresh = 0;
  if (!*out) {
    TT_TRY(tt_tensor_empty(ndim, shape, a->dtype, a->device, out));
    fresh = 1;
  } else if (!tt_shape_eq(*out, ndim, shape) || (*out)->dtype != a->dtype ||
             !tt_same_device((*out)->device, a->device)) {
    return tt_error_set(TT_ERR_SHAPE, "%s: output %s %s does not match the result of %s and %s", name, SHP(*out, s1),
                        tt_dtype_name((*out)->dtype), SHP(a, s2), tt_dtype_name(a->dtype));
  }
  if (a->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, a->device, binary, name);
  tt_status st = tt_kernel_check(be->binary(op, a->dtype, ndim, shape, tt_tensor_data(a), as, tt_tensor_data(b), bs,
                            tt_tensor_data(*out), (*out)->strides), "binary", be, a->dtype);
  if (st != TT_OK) {
    tt_out_discard(out, fresh);
    return tt_error_set(st, "%s: backend %s failed on %s and %s", name, be->name, SHP(a, s1), SHP(b, s2));
  }
  return TT_OK;
}

static const char *tt_unary_name(int op) {
  static const char *names[] = {"neg",   "exp",   "log",   "sqrt", "rsqrt",   "silu",  "gelu",      "relu",
                                "scale", "add_scalar", "square", "abs", "tanh", "sigmoid", "pow", "reciprocal"};
  return (op >= 0 && op <= TT_RECIPROCAL) ? names[op] : "unary";
}

tt_status tt_op_unary(int op, const tt_tensor *a, double alpha, tt_tensor **out) {
  const char *name = tt_unary_name(op);
  if (op < TT_NEG || op > TT_RECIPROCAL) return tt_error_set(TT_ERR_INVALID, "unary: unknown op %d", op);
  TT_TRY(tt_chk_float(name, "input", a));
  int in_place = *out == a;
  if (in_place) TT_TRY(tt_chk_contig(name, "input (in place)", a));
  tt_tensor *x = NULL;
  TT_TRY(tt_tensor_contiguous(a, &x));
  int fresh = 0;
  tt_status st = tt_out_prepare(name, "out", out, a->ndim, a->shape, a->dtype, a->device, &fresh);
  if (st == TT_OK && a->device.type != TT_META) {
    const tt_kernels *be = tt_backend(a->device);
    if (!be || !be->unary) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", name);
    else st = tt_kernel_check(be->unary(op, a->dtype, tt_tensor_numel(a), alpha, tt_tensor_data(x), tt_tensor_data(*out)), "unary", be, a->dtype);
    if (st != TT_OK && st != TT_ERR_UNSUPPORTED) st = tt_error_set(st, "%s: backend failed", name);
  }
  tt_tensor_release(x);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_unary_backward(int op, const tt_tensor *x, const tt_tensor *y, const tt_tensor *dy, double alpha,
                               tt_tensor **dx) {
  const char *name = tt_unary_name(op);
  if (op < TT_NEG || op > TT_RECIPROCAL) return tt_error_set(TT_ERR_INVALID, "unary_backward: unknown op %d", op);
  TT_TRY(tt_chk_float(name, "x", x));
  TT_TRY(tt_chk_same_dtype(name, "x", x, "dy", dy));
  TT_TRY(tt_chk_same_shape(name, "x", x, "dy", dy));
  TT_TRY(tt_chk_same_device(name, "x", x, "dy", dy));
  (void)y;
  tt_tensor *xc = NULL, *dyc = NULL;
  int fresh = 0;
  tt_status st = tt_tensor_contiguous(x, &xc);
  if (st == TT_OK) st = tt_tensor_contiguous(dy, &dyc);
  if (st == TT_OK) st = tt_out_prepare(name, "dx", dx, x->ndim, x->shape, x->dtype, x->device, &fresh);
  if (st == TT_OK && x->device.type != TT_META) {
    const tt_kernels *be = tt_backend(x->device);
    if (!be || !be->unary_backward)
      st = tt_error_set(TT_ERR_UNSUPPORTED, "%s backward: not implemented on this device", name);
    else
      st = tt_kernel_check(be->unary_backward(op, x->dtype, tt_tensor_numel(x), alpha, tt_tensor_data(xc), NULL, tt_tensor_data(dyc),
                              tt_tensor_data(*dx)), "unary_backward", be, x->dtype);
  }
  tt_tensor_release(xc);
  tt_tensor_release(dyc);
  if (st != TT_OK) tt_out_discard(dx, fresh);
  return st;
}

tt_status tt_op_axpy(tt_tensor *y, double alpha, const tt_tensor *x) {
  TT_TRY(tt_chk_float("axpy", "y", y));
  TT_TRY(tt_chk_same_dtype("axpy", "y", y, "x", x));
  TT_TRY(tt_chk_same_shape("axpy", "y", y, "x", x));
  TT_TRY(tt_chk_same_device("axpy", "y", y, "x", x));
  TT_TRY(tt_chk_contig("axpy", "y", y));
  if (y->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, y->device, axpy, "axpy");
  tt_tensor *xc = NULL;
  TT_TRY(tt_tensor_contiguous(x, &xc));
  tt_status st = tt_kernel_check(be->axpy(y->dtype, tt_tensor_numel(y), alpha, tt_tensor_data(xc), tt_tensor_data(y)), "axpy", be, y->dtype);
  tt_tensor_release(xc);
  return st;
}

/* Runs of up to TT_FOREACH_MAX tensors of one dtype and device go to the backend's
 * foreach_scale; without it, each tensor is scaled (tt_op_unary in place)
 * or filled on its own. Every tensor is checked before any is written. */
static tt_status tt_foreach(const char *op, int n, tt_tensor *const *ts, double alpha, int set) {
  char what[48];
  if (n < 0) return tt_error_set(TT_ERR_INVALID, "%s: n = %d tensors", op, n);
  for (int i = 0; i < n; i++) {
    snprintf(what, sizeof what, "%s: tensor %d", op, i);
    if (!ts[i]) return tt_error_set(TT_ERR_INVALID, "%s is NULL", what);
    TT_TRY(tt_chk_float(what, "x", ts[i]));
    TT_TRY(tt_chk_contig(what, "x", ts[i]));
    if (ts[i]->device.type != TT_META && !tt_backend(ts[i]->device))
      return tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", what);
  }
  void *xs[TT_FOREACH_MAX];
  int64_t ns[TT_FOREACH_MAX];
  for (int i = 0; i < n;) {
    tt_device dev = ts[i]->device;
    int dt = ts[i]->dtype, k = 0;
    if (dev.type == TT_META) {
      i++;
      continue;
    }
    const tt_kernels *be = tt_backend(dev);
    if (!be->foreach_scale) {
      tt_tensor *t = ts[i++];
      TT_TRY(set ? tt_tensor_fill(t, alpha) : tt_op_unary(TT_SCALE, t, alpha, &t));
      continue;
    }
    /* a run: consecutive tensors of one dtype on one device */
    while (i < n && k < TT_FOREACH_MAX && ts[i]->dtype == dt && tt_same_device(ts[i]->device, dev)) {
      xs[k] = tt_tensor_data(ts[i]);
      ns[k++] = tt_tensor_numel(ts[i++]);
    }
    TT_TRY(tt_kernel_check(be->foreach_scale(dt, k, xs, ns, alpha, set), op, be, dt));
  }
  return TT_OK;
}

tt_status tt_op_scale_multi(int n, tt_tensor *const *ts, double alpha) {
  return tt_foreach("scale_multi", n, ts, alpha, 0);
}

tt_status tt_op_fill_multi(int n, tt_tensor *const *ts, double value) {
  return tt_foreach("fill_multi", n, ts, value, 1);
}

tt_status tt_op_sum_to(const tt_tensor *a, int ndim, const int64_t *shape, tt_tensor **out) {
  char s1[96];
  TT_TRY(tt_chk_float("sum_to", "input", a));
  if (ndim > a->ndim || ndim < 0)
    return tt_error_set(TT_ERR_SHAPE, "sum_to: cannot reduce %s to %d dims", SHP(a, s1), ndim);
  int64_t padded[TT_MAX_DIMS];
  int lead = a->ndim - ndim;
  for (int i = 0; i < a->ndim; i++) {
    padded[i] = i < lead ? 1 : shape[i - lead];
    if (padded[i] != a->shape[i] && padded[i] != 1)
      return tt_error_set(TT_ERR_SHAPE, "sum_to: %s does not broadcast from the target (dim %d: %lld)", SHP(a, s1), i,
                          (long long)padded[i]);
  }
  int fresh = 0;
  TT_TRY(tt_out_prepare("sum_to", "out", out, ndim, shape, a->dtype, a->device, &fresh));
  if (a->device.type == TT_META) return TT_OK;
  tt_tensor *ac = NULL;
  tt_status st = tt_tensor_contiguous(a, &ac);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(a->device);
    if (!be || !be->sum_to) st = tt_error_set(TT_ERR_UNSUPPORTED, "sum_to: not implemented on this device");
    else st = tt_kernel_check(be->sum_to(a->dtype, a->ndim, a->shape, tt_tensor_data(ac), padded, tt_tensor_data(*out)), "sum_to", be, a->dtype);
  }
  tt_tensor_release(ac);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

/* ---- reductions ------------------------------------------------------- */

tt_status tt_op_reduce(int op, const tt_tensor *a, int dim, int keepdim, tt_tensor **out, tt_tensor **indices) {
  static const char *names[] = {"sum", "mean", "max", "norm"};
  char s1[96];
  if (op < TT_RSUM || op > TT_RNORM2) return tt_error_set(TT_ERR_INVALID, "reduce: unknown op %d", op);
  const char *name = names[op];
  TT_TRY(tt_chk_float(name, "input", a));
  int64_t outer = 1, n = 1, inner = 1, oshape[TT_MAX_DIMS];
  int ondim = 0;
  if (dim == TT_DIM_ALL) {
    n = tt_tensor_numel(a);
    if (keepdim) {
      ondim = a->ndim;
      for (int i = 0; i < a->ndim; i++) oshape[i] = 1;
    }
  } else {
    int d = dim < 0 ? dim + a->ndim : dim;
    if (d < 0 || d >= a->ndim)
      return tt_error_set(TT_ERR_INDEX, "%s: dim %d out of range for shape %s", name, dim, SHP(a, s1));
    for (int i = 0; i < a->ndim; i++) {
      if (i < d) outer *= a->shape[i];
      else if (i == d) n = a->shape[i];
      else inner *= a->shape[i];
      if (i != d) oshape[ondim++] = a->shape[i];
      else if (keepdim) oshape[ondim++] = 1;
    }
  }
  if (n == 0 && op == TT_RMAX)
    return tt_error_set(TT_ERR_SHAPE, "max: cannot reduce an empty dim of %s", SHP(a, s1));
  int fresh = 0, ifresh = 0;
  TT_TRY(tt_out_prepare(name, "out", out, ondim, oshape, a->dtype, a->device, &fresh));
  tt_status st = TT_OK;
  if (indices) {
    if (op != TT_RMAX) st = tt_error_set(TT_ERR_INVALID, "%s: indices are only produced by max", name);
    else st = tt_out_prepare(name, "indices", indices, ondim, oshape, TT_I64, a->device, &ifresh);
  }
  if (st == TT_OK && a->device.type != TT_META) {
    tt_tensor *ac = NULL;
    st = tt_tensor_contiguous(a, &ac);
    if (st == TT_OK) {
      const tt_kernels *be = tt_backend(a->device);
      if (!be || !be->reduce) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", name);
      else
        st = tt_kernel_check(be->reduce(op, a->dtype, outer, n, inner, tt_tensor_data(ac), tt_tensor_data(*out),
                        indices ? (int64_t *)tt_tensor_data(*indices) : NULL), "reduce", be, a->dtype);
    }
    tt_tensor_release(ac);
  }
  if (st != TT_OK) {
    tt_out_discard(out, fresh);
    if (indices) tt_out_discard(indices, ifresh);
  }
  return st;
}

tt_status tt_op_softmax(const tt_tensor *x, int log, tt_tensor **out) {
  const char *name = log ? "log_softmax" : "softmax";
  char s1[96];
  TT_TRY(tt_chk_float(name, "x", x));
  TT_TRY(tt_chk_contig(name, "x", x));
  if (x->ndim < 1) return tt_error_set(TT_ERR_SHAPE, "%s: x %s needs at least 1 dim", name, SHP(x, s1));
  int fresh = 0;
  TT_TRY(tt_out_prepare(name, "out", out, x->ndim, x->shape, x->dtype, x->device, &fresh));
  if (x->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, x->device, softmax, name);
  int64_t n = x->shape[x->ndim - 1];
  tt_status st = tt_kernel_check(be->softmax(x->dtype, n ? tt_tensor_numel(x) / n : 0, n, log, tt_tensor_data(x), tt_tensor_data(*out)), "softmax", be, x->dtype);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_softmax_backward(const tt_tensor *y, const tt_tensor *dy, int log, tt_tensor **dx) {
  const char *name = log ? "log_softmax_backward" : "softmax_backward";
  TT_TRY(tt_chk_float(name, "y", y));
  TT_TRY(tt_chk_same_dtype(name, "y", y, "dy", dy));
  TT_TRY(tt_chk_same_shape(name, "y", y, "dy", dy));
  TT_TRY(tt_chk_same_device(name, "y", y, "dy", dy));
  TT_TRY(tt_chk_contig(name, "y", y));
  TT_TRY(tt_chk_contig(name, "dy", dy));
  int fresh = 0;
  TT_TRY(tt_out_prepare(name, "dx", dx, y->ndim, y->shape, y->dtype, y->device, &fresh));
  if (y->device.type == TT_META) return TT_OK;
  TT_KERNEL(be, y->device, softmax_backward, name);
  int64_t n = y->ndim ? y->shape[y->ndim - 1] : 1;
  tt_status st = tt_kernel_check(be->softmax_backward(y->dtype, n ? tt_tensor_numel(y) / n : 0, n, log, tt_tensor_data(y),
                                      tt_tensor_data(dy), tt_tensor_data(*dx)), "softmax_backward", be, y->dtype);
  if (st != TT_OK) tt_out_discard(dx, fresh);
  return st;
}

/* ---- matmul ------------------------------------------------------------ */

/* How BLAS should read the last two dims of t: leading dimension and whether
 * the view is a transpose of a row-major matrix. 0 when it cannot. */
static int tt_blas_layout(const tt_tensor *t, int64_t *ld, int *transposed) {
  int r = t->ndim - 2, c = t->ndim - 1;
  int64_t rows = t->shape[r], cols = t->shape[c], sr = t->strides[r], sc = t->strides[c];
  if ((sc == 1 || cols == 1) && (sr >= (cols > 1 ? cols : 1) || rows == 1)) {
    *ld = rows == 1 ? (cols > 1 ? cols : 1) : sr;
    if (*ld < cols) *ld = cols;
    *transposed = 0;
    return 1;
  }
  if ((sr == 1 || rows == 1) && (sc >= (rows > 1 ? rows : 1) || cols == 1)) {
    *ld = cols == 1 ? (rows > 1 ? rows : 1) : sc;
    if (*ld < rows) *ld = rows;
    *transposed = 1;
    return 1;
  }
  return 0;
}

static tt_status tt_to_dtype(const tt_tensor *t, int dtype, tt_tensor **out) {
  TT_TRY(tt_tensor_empty(t->ndim, t->shape, dtype, t->device, out));
  tt_status st = tt_tensor_copy(*out, t);
  if (st != TT_OK) {
    tt_tensor_release(*out);
    *out = NULL;
  }
  return st;
}

/* The bias as the gemm entry takes it (kernels.h): in the compute dtype
 * (cuBLASLt's epilogue reads the bias in D's type outside its int8/fp8
 * kernels, cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE), packed and
 * 16-byte aligned (the epilogue loads vectors). t itself, retained, when it
 * already is all that. */
static tt_status tt_gemm_bias(const tt_tensor *t, int compute_dtype, tt_tensor **out) {
  if (t->dtype == compute_dtype && tt_tensor_is_contiguous(t) && (uintptr_t)tt_tensor_data(t) % 16 == 0) {
    tt_tensor_retain((tt_tensor *)t);
    *out = (tt_tensor *)t;
    return TT_OK;
  }
  return tt_to_dtype(t, compute_dtype, out);
}

/* matmul and linear after their own checks: `name` prefixes the messages;
 * bias (NULL, or [N] checked by the caller) is added to every row of out. */
static tt_status tt_matmul_run(const char *name, const tt_tensor *a_in, const tt_tensor *b_in, int trans_a,
                               int trans_b, double alpha, double beta, const tt_tensor *bias, tt_tensor **out) {
  char s1[96], s2[96], s3[96];
  const tt_tensor *a = a_in, *b = b_in;
  if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3)
    return tt_error_set(TT_ERR_SHAPE, "%s: a %s and b %s; expected 2-D or 3-D (batched) operands", name, SHP(a, s1),
                        SHP(b, s2));
  if (!tt_dtype_is_float(a->dtype) || a->dtype == TT_F8E4M3 || a->dtype == TT_F8E5M2)
    return tt_error_set(TT_ERR_DTYPE, "%s: a %s has dtype %s; expected float32, float64, bfloat16 or float16", name,
                        SHP(a, s1), tt_dtype_name(a->dtype));
  TT_TRY(tt_chk_same_dtype(name, "a", a, "b", b));
  TT_TRY(tt_chk_same_device(name, "a", a, "b", b));
  int64_t M = trans_a ? a->shape[a->ndim - 1] : a->shape[a->ndim - 2];
  int64_t Ka = trans_a ? a->shape[a->ndim - 2] : a->shape[a->ndim - 1];
  int64_t Kb = trans_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2];
  int64_t N = trans_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
  if (Ka != Kb)
    return tt_error_set(TT_ERR_SHAPE,
                        "%s: a %s%s and b %s%s: inner dims %lld and %lld differ (expected a [M, K] @ b [K, N])", name,
                        SHP(a, s1), trans_a ? " (transposed)" : "", SHP(b, s2), trans_b ? " (transposed)" : "",
                        (long long)Ka, (long long)Kb);
  int64_t Ba = a->ndim == 3 ? a->shape[0] : 1, Bb = b->ndim == 3 ? b->shape[0] : 1;
  if (a->ndim == 3 && b->ndim == 3 && Ba != Bb)
    return tt_error_set(TT_ERR_SHAPE, "%s: a %s and b %s: batch sizes %lld and %lld differ", name, SHP(a, s1),
                        SHP(b, s2), (long long)Ba, (long long)Bb);
  int64_t batch = Ba > Bb ? Ba : Bb;
  int ondim = (a->ndim == 3 || b->ndim == 3) ? 3 : 2;
  int64_t oshape[3] = {batch, M, N};
  const int64_t *os = ondim == 3 ? oshape : oshape + 1;
  if (beta != 0 && !*out)
    return tt_error_set(TT_ERR_INVALID, "%s: beta = %g accumulates into out, but no out was given", name, beta);
  int fresh = 0;
  TT_TRY(tt_out_prepare(name, "out", out, ondim, os, a->dtype, a->device, &fresh));
  if (a->device.type == TT_META) return TT_OK;
  const tt_kernels *be = tt_backend(a->device);
  if (!be || !be->gemm) {
    tt_out_discard(out, fresh);
    return tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on %s", name, be ? be->name : "this device");
  }

  /* Operands in a layout BLAS reads: transposed views flip the flag. */
  tt_tensor *ta = NULL, *tb = NULL, *tc = NULL, *tbias = NULL;
  tt_status st = TT_OK;
  int64_t lda, ldb;
  int fa, fb;
  int compute_dtype = a->dtype;
  if (a->device.type == TT_CPU && (a->dtype == TT_BF16 || a->dtype == TT_F16)) compute_dtype = TT_F32;
  if (compute_dtype != a->dtype) {
    st = tt_to_dtype(a, compute_dtype, &ta);
    if (st == TT_OK) st = tt_to_dtype(b, compute_dtype, &tb);
    a = ta;
    b = tb;
  }
  if (st == TT_OK && (!tt_blas_layout(a, &lda, &fa) || (a->ndim == 3 && a->strides[0] == 0 && Ba > 1))) {
    tt_tensor *c;
    st = tt_tensor_contiguous(a, &c);
    tt_tensor_release(ta);
    ta = c;
    a = c;
    if (st == TT_OK) tt_blas_layout(a, &lda, &fa);
  }
  if (st == TT_OK && !tt_blas_layout(b, &ldb, &fb)) {
    tt_tensor *c;
    st = tt_tensor_contiguous(b, &c);
    tt_tensor_release(tb);
    tb = c;
    b = c;
    if (st == TT_OK) tt_blas_layout(b, &ldb, &fb);
  }
  if (st == TT_OK && compute_dtype != (*out)->dtype) {
    st = tt_tensor_empty((*out)->ndim, (*out)->shape, compute_dtype, a->device, &tc);
    if (st == TT_OK && beta != 0) st = tt_tensor_copy(tc, *out);
  }
  if (st == TT_OK && bias) st = tt_gemm_bias(bias, compute_dtype, &tbias);
  if (st == TT_OK) {
    tt_tensor *c = tc ? tc : *out;
    int64_t sa = a->ndim == 3 ? a->strides[0] : 0, sb = b->ndim == 3 ? b->strides[0] : 0;
    int64_t ldc = N > 0 ? N : 1, sc = M * N;
    /* A 3-D a whose batches are stacked rows times a 2-D b is one big GEMM. */
    int64_t m_eff = M, batch_eff = batch;
    if (a->ndim == 3 && b->ndim == 2 && !fa && !trans_a && sa == M * lda && batch > 1) {
      m_eff = M * batch;
      batch_eff = 1;
    }
    st = tt_kernel_check(be->gemm(compute_dtype, trans_a ^ fa, trans_b ^ fb, batch_eff, m_eff, N, Ka, alpha,
                                  tt_tensor_data(a), lda, sa, tt_tensor_data(b), ldb, sb, beta, tt_tensor_data(c), ldc,
                                  sc, tbias ? tt_tensor_data(tbias) : NULL, tbias ? tbias->dtype : -1,
                                  (tt_allow_tf32() ? TT_GEMM_TF32 : 0) |
                                      (tt_gemm_autotune() && !tt_deterministic() ? TT_GEMM_TUNE : 0)),
                         "gemm", be, compute_dtype);
    if (st != TT_OK) {
      char why[320]; /* the backend's own line, kept after the shapes (it is rewritten below) */
      snprintf(why, sizeof why, "%s", tt_last_error());
      st = tt_error_set(st, "%s: %s gemm failed for a %s, b %s, out %s%s%s: %s", name, be->name, SHP(a_in, s1),
                        SHP(b_in, s2), SHP(*out, s3), bias ? " with a bias" : "",
                        st == TT_ERR_UNSUPPORTED ? " (no BLAS library could be loaded)" : "", why);
    }
    if (st == TT_OK && tc) st = tt_tensor_copy(*out, tc);
  }
  tt_tensor_release(ta);
  tt_tensor_release(tb);
  tt_tensor_release(tc);
  tt_tensor_release(tbias);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_matmul(const tt_tensor *a, const tt_tensor *b, int trans_a, int trans_b, double alpha, double beta,
                       tt_tensor **out) {
  return tt_matmul_run("matmul", a, b, trans_a, trans_b, alpha, beta, NULL, out);
}

tt_status tt_op_linear(const tt_tensor *x, const tt_tensor *w, const tt_tensor *bias, tt_tensor **out) {
  char s1[96], s2[96];
  if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1])
    return tt_error_set(TT_ERR_SHAPE, "linear: x %s and weight %s; expected x [..., in] and weight [out, in]",
                        SHP(x, s1), SHP(w, s2));
  TT_TRY(tt_chk_same_dtype("linear", "x", x, "weight", w));
  TT_TRY(tt_chk_same_device("linear", "x", x, "weight", w));
  int64_t N = w->shape[0], K = w->shape[1];
  if (bias) {
    TT_TRY(tt_chk_float("linear", "bias", bias));
    TT_TRY(tt_chk_same_device("linear", "x", x, "bias", bias));
    if (bias->ndim != 1 || bias->shape[0] != N)
      return tt_error_set(TT_ERR_SHAPE, "linear: bias %s does not fit weight %s; expected bias [%lld]", SHP(bias, s1),
                          SHP(w, s2), (long long)N);
  }
  int64_t rows = 1, oshape[TT_MAX_DIMS];
  for (int i = 0; i < x->ndim - 1; i++) {
    rows *= x->shape[i];
    oshape[i] = x->shape[i];
  }
  oshape[x->ndim - 1] = N;
  int fresh = 0;
  TT_TRY(tt_out_prepare("linear", "out", out, x->ndim, oshape, x->dtype, x->device, &fresh));
  /* One [rows, in] @ [in, out] GEMM. A 2-D x goes as it is (a transposed
   * view is read through its strides); other ranks are folded into rows,
   * through a packed copy only when their strides forbid the view. */
  int64_t x2s[2] = {rows, K}, o2s[2] = {rows, N};
  tt_tensor *xc = NULL, *x2 = NULL, *o2 = NULL;
  tt_status st = TT_OK;
  if (x->ndim == 2) {
    tt_tensor_retain((tt_tensor *)x);
    x2 = (tt_tensor *)x;
  } else if ((st = tt_view_reshape(x, 2, x2s, &x2)) == TT_ERR_LAYOUT) {
    st = tt_tensor_contiguous(x, &xc);
    if (st == TT_OK) st = tt_view_reshape(xc, 2, x2s, &x2);
  }
  if (st == TT_OK) st = tt_view_reshape(*out, 2, o2s, &o2);
  if (st == TT_OK) st = tt_matmul_run("linear", x2, w, 0, 1, 1.0, 0.0, bias, &o2);
  tt_tensor_release(x2);
  tt_tensor_release(xc);
  tt_tensor_release(o2);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

/* ---- indexing --------------------------------------------------------- */

tt_status tt_op_cat(int n, tt_tensor *const *ts, int dim, tt_tensor **out) {
  char s1[96], s2[96];
  if (n < 1) return tt_error_set(TT_ERR_INVALID, "cat: needs at least one tensor");
  const tt_tensor *t0 = ts[0];
  int d = dim < 0 ? dim + t0->ndim : dim;
  if (d < 0 || d >= t0->ndim)
    return tt_error_set(TT_ERR_INDEX, "cat: dim %d out of range for shape %s", dim, SHP(t0, s1));
  int64_t total = 0;
  for (int i = 0; i < n; i++) {
    const tt_tensor *t = ts[i];
    TT_TRY(tt_chk_same_dtype("cat", "tensor 0", t0, "another tensor", t));
    TT_TRY(tt_chk_same_device("cat", "tensor 0", t0, "another tensor", t));
    int ok = t->ndim == t0->ndim;
    for (int j = 0; ok && j < t0->ndim; j++)
      if (j != d && t->shape[j] != t0->shape[j]) ok = 0;
    if (!ok)
      return tt_error_set(TT_ERR_SHAPE, "cat: tensor %d %s does not match tensor 0 %s outside dim %d", i, SHP(t, s1),
                          SHP(t0, s2), d);
    total += t->shape[d];
  }
  int64_t shape[TT_MAX_DIMS];
  memcpy(shape, t0->shape, sizeof shape);
  shape[d] = total;
  int fresh = 0;
  TT_TRY(tt_out_prepare("cat", "out", out, t0->ndim, shape, t0->dtype, t0->device, &fresh));
  int64_t off = 0;
  tt_status st = TT_OK;
  for (int i = 0; i < n && st == TT_OK; i++) {
    tt_tensor *slot = NULL;
    st = tt_view_narrow(*out, d, off, ts[i]->shape[d], &slot);
    if (st == TT_OK) st = tt_tensor_copy(slot, ts[i]);
    tt_tensor_release(slot);
    off += ts[i]->shape[d];
  }
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

static void tt_split3(const tt_tensor *t, int d, int64_t *outer, int64_t *inner) {
  *outer = 1;
  *inner = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (i < d) *outer *= t->shape[i];
    if (i > d) *inner *= t->shape[i];
  }
}

tt_status tt_op_index_select(const tt_tensor *src, int dim, const tt_tensor *index, tt_tensor **out) {
  char s1[96], s2[96];
  int d = dim < 0 ? dim + src->ndim : dim;
  if (d < 0 || d >= src->ndim)
    return tt_error_set(TT_ERR_INDEX, "index_select: dim %d out of range for src %s", dim, SHP(src, s1));
  TT_TRY(tt_chk_index("index_select", "index", index));
  TT_TRY(tt_chk_same_device("index_select", "src", src, "index", index));
  if (index->ndim != 1)
    return tt_error_set(TT_ERR_SHAPE, "index_select: index %s must be 1-D (src %s)", SHP(index, s1), SHP(src, s2));
  int64_t shape[TT_MAX_DIMS];
  memcpy(shape, src->shape, sizeof shape);
  shape[d] = index->shape[0];
  int fresh = 0;
  TT_TRY(tt_out_prepare("index_select", "out", out, src->ndim, shape, src->dtype, src->device, &fresh));
  if (src->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL, *sc = NULL;
  tt_status st = tt_index_i64(index, &idx);
  if (st == TT_OK) st = tt_chk_index_range("index_select", idx, src->shape[d], 0, 0);
  if (st == TT_OK) st = tt_tensor_contiguous(src, &sc);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(src->device);
    int64_t outer, inner;
    tt_split3(src, d, &outer, &inner);
    if (!be || !be->index_select) st = tt_error_set(TT_ERR_UNSUPPORTED, "index_select: not implemented here");
    else
      st = tt_kernel_check(be->index_select(src->dtype, outer, src->shape[d], inner, tt_tensor_data(sc), index->shape[0],
                            tt_tensor_data(idx), tt_tensor_data(*out)), "index_select", be, src->dtype);
  }
  tt_tensor_release(idx);
  tt_tensor_release(sc);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_index_add(tt_tensor *dst, int dim, const tt_tensor *index, const tt_tensor *src) {
  char s1[96], s2[96];
  int d = dim < 0 ? dim + dst->ndim : dim;
  if (d < 0 || d >= dst->ndim)
    return tt_error_set(TT_ERR_INDEX, "index_add: dim %d out of range for dst %s", dim, SHP(dst, s1));
  TT_TRY(tt_chk_index("index_add", "index", index));
  TT_TRY(tt_chk_same_dtype("index_add", "dst", dst, "src", src));
  TT_TRY(tt_chk_same_device("index_add", "dst", dst, "src", src));
  TT_TRY(tt_chk_contig("index_add", "dst", dst));
  int ok = index->ndim == 1 && src->ndim == dst->ndim;
  for (int i = 0; ok && i < dst->ndim; i++)
    if (src->shape[i] != (i == d ? index->shape[0] : dst->shape[i])) ok = 0;
  if (!ok)
    return tt_error_set(TT_ERR_SHAPE, "index_add: src %s does not fit dst %s with a 1-D index of %lld along dim %d",
                        SHP(src, s1), SHP(dst, s2), (long long)(index->ndim ? index->shape[0] : 0), d);
  if (dst->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL, *sc = NULL;
  tt_status st = tt_index_i64(index, &idx);
  if (st == TT_OK) st = tt_chk_index_range("index_add", idx, dst->shape[d], 0, 0);
  if (st == TT_OK) st = tt_tensor_contiguous(src, &sc);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(dst->device);
    int64_t outer, inner;
    tt_split3(dst, d, &outer, &inner);
    if (!be || !be->index_add) st = tt_error_set(TT_ERR_UNSUPPORTED, "index_add: not implemented here");
    else
      st = tt_kernel_check(be->index_add(dst->dtype, outer, dst->shape[d], inner, tt_tensor_data(dst), index->shape[0],
                         tt_tensor_data(idx), tt_tensor_data(sc)), "index_add", be, dst->dtype);
    if (st == TT_ERR_DTYPE) st = tt_error_set(st, "index_add: dtype %s not supported", tt_dtype_name(dst->dtype));
  }
  tt_tensor_release(idx);
  tt_tensor_release(sc);
  return st;
}

/* gather/scatter_add use a [outer, n, inner] view, so index must match the
 * data tensor on every dim but `dim`. */
static tt_status tt_chk_gather_shapes(const char *op, const tt_tensor *data, const char *dname, const tt_tensor *index,
                                      int d) {
  char s1[96], s2[96];
  int ok = index->ndim == data->ndim;
  for (int i = 0; ok && i < data->ndim; i++)
    if (i != d && index->shape[i] != data->shape[i]) ok = 0;
  if (!ok)
    return tt_error_set(TT_ERR_SHAPE, "%s: index %s must match %s %s on every dim except %d", op, SHP(index, s1), dname,
                        SHP(data, s2), d);
  return TT_OK;
}

tt_status tt_op_gather(const tt_tensor *src, int dim, const tt_tensor *index, tt_tensor **out) {
  char s1[96];
  int d = dim < 0 ? dim + src->ndim : dim;
  if (d < 0 || d >= src->ndim)
    return tt_error_set(TT_ERR_INDEX, "gather: dim %d out of range for src %s", dim, SHP(src, s1));
  TT_TRY(tt_chk_index("gather", "index", index));
  TT_TRY(tt_chk_same_device("gather", "src", src, "index", index));
  TT_TRY(tt_chk_gather_shapes("gather", src, "src", index, d));
  int fresh = 0;
  TT_TRY(tt_out_prepare("gather", "out", out, index->ndim, index->shape, src->dtype, src->device, &fresh));
  if (src->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL, *sc = NULL;
  tt_status st = tt_index_i64(index, &idx);
  if (st == TT_OK) st = tt_chk_index_range("gather", idx, src->shape[d], 0, 0);
  if (st == TT_OK) st = tt_tensor_contiguous(src, &sc);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(src->device);
    int64_t outer, inner;
    tt_split3(src, d, &outer, &inner);
    if (!be || !be->gather) st = tt_error_set(TT_ERR_UNSUPPORTED, "gather: not implemented here");
    else
      st = tt_kernel_check(be->gather(src->dtype, outer, src->shape[d], inner, tt_tensor_data(sc), index->shape[d],
                      tt_tensor_data(idx), tt_tensor_data(*out)), "gather", be, src->dtype);
  }
  tt_tensor_release(idx);
  tt_tensor_release(sc);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_scatter_add(tt_tensor *dst, int dim, const tt_tensor *index, const tt_tensor *src) {
  char s1[96];
  int d = dim < 0 ? dim + dst->ndim : dim;
  if (d < 0 || d >= dst->ndim)
    return tt_error_set(TT_ERR_INDEX, "scatter_add: dim %d out of range for dst %s", dim, SHP(dst, s1));
  TT_TRY(tt_chk_index("scatter_add", "index", index));
  TT_TRY(tt_chk_same_dtype("scatter_add", "dst", dst, "src", src));
  TT_TRY(tt_chk_same_device("scatter_add", "dst", dst, "src", src));
  TT_TRY(tt_chk_contig("scatter_add", "dst", dst));
  TT_TRY(tt_chk_gather_shapes("scatter_add", dst, "dst", index, d));
  TT_TRY(tt_chk_same_shape("scatter_add", "index", index, "src", src));
  if (dst->device.type == TT_META) return TT_OK;
  tt_tensor *idx = NULL, *sc = NULL;
  tt_status st = tt_index_i64(index, &idx);
  if (st == TT_OK) st = tt_chk_index_range("scatter_add", idx, dst->shape[d], 0, 0);
  if (st == TT_OK) st = tt_tensor_contiguous(src, &sc);
  if (st == TT_OK) {
    const tt_kernels *be = tt_backend(dst->device);
    int64_t outer, inner;
    tt_split3(dst, d, &outer, &inner);
    if (!be || !be->scatter_add) st = tt_error_set(TT_ERR_UNSUPPORTED, "scatter_add: not implemented here");
    else
      st = tt_kernel_check(be->scatter_add(dst->dtype, outer, dst->shape[d], inner, tt_tensor_data(dst), index->shape[d],
                           tt_tensor_data(idx), tt_tensor_data(sc)), "scatter_add", be, dst->dtype);
    if (st == TT_ERR_DTYPE) st = tt_error_set(st, "scatter_add: dtype %s not supported", tt_dtype_name(dst->dtype));
  }
  tt_tensor_release(idx);
  tt_tensor_release(sc);
  return st;
}
