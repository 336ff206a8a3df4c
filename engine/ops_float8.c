/*
 * ops_float8.c — entry points of float8 training (lua/parallel/float8.lua):
 * the tensorwise dynamic cast to fp8 and the GEMM on fp8 operands with their
 * scales (torch._scaled_mm's role).
 *
 * The scales live on the tensors' device as 0-d f32 tensors, written by the
 * cast's kernels and read by the GEMM's, so a float8 layer never waits for
 * the device. The CPU has no fp8 GEMM kernel: it widens the operands to f32
 * (exactly: every fp8 value is an f32) and multiplies them with the f32
 * GEMM, so the CPU computes what the GPU's tensor cores do up to the order
 * of the f32 sums; that is for tests and for reading the numerics, not for
 * speed.
 */
#include "ops_common.h"

static int tt_is_f8(int dtype) { return dtype == TT_F8E4M3 || dtype == TT_F8E5M2; }

static tt_status tt_chk_f8_source(const char *op, const tt_tensor *x) {
  char s1[96];
  TT_TRY(tt_tensor_check_storage(op, "x", x));
  if (x->dtype != TT_F32 && x->dtype != TT_BF16 && x->dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "%s: x %s has dtype %s; expected float32, bfloat16 or float16", op, SHP(x, s1),
                        tt_dtype_name(x->dtype));
  return tt_chk_contig(op, "x", x);
}

tt_status tt_op_float8_amax(const tt_tensor *x, tt_tensor **out) {
  const char *op = "float8_amax";
  TT_TRY(tt_chk_f8_source(op, x));
  int fresh = 0;
  TT_TRY(tt_out_prepare(op, "out", out, 0, NULL, TT_F32, x->device, &fresh));
  if (x->device.type == TT_META) return TT_OK;
  const tt_kernels *be = tt_backend(x->device);
  tt_status st = !be || !be->float8_amax
                     ? tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op)
                     : tt_kernel_check(be->float8_amax(x->dtype, tt_tensor_numel(x), tt_tensor_data(x),
                                                       (float *)tt_tensor_data(*out)),
                                       op, be, x->dtype);
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}

tt_status tt_op_to_float8(const tt_tensor *x, int dtype, const tt_tensor *amax, tt_tensor **out,
                          tt_tensor **scale_inv) {
  const char *op = "to_float8";
  char s1[96];
  TT_TRY(tt_chk_f8_source(op, x));
  if (!tt_is_f8(dtype))
    return tt_error_set(TT_ERR_DTYPE, "%s: target dtype %s; expected float8_e4m3fn or float8_e5m2", op,
                        tt_dtype_name(dtype));
  if (amax) {
    TT_TRY(tt_tensor_check_storage(op, "amax", amax));
    TT_TRY(tt_chk_same_device(op, "x", x, "amax", amax));
    if (amax->dtype != TT_F32 || tt_tensor_numel(amax) != 1)
      return tt_error_set(TT_ERR_SHAPE, "%s: amax %s of %s; expected one float32 (float8_amax's)", op, SHP(amax, s1),
                          tt_dtype_name(amax->dtype));
  }
  int f1 = 0, f2 = 0;
  TT_TRY(tt_out_prepare(op, "out", out, x->ndim, x->shape, dtype, x->device, &f1));
  tt_status st = tt_out_prepare(op, "scale_inv", scale_inv, 0, NULL, TT_F32, x->device, &f2);
  if (st == TT_OK && x->device.type != TT_META) {
    const tt_kernels *be = tt_backend(x->device);
    if (!be || !be->to_float8) st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
    else
      st = tt_kernel_check(be->to_float8(x->dtype, tt_tensor_numel(x), tt_tensor_data(x), dtype, tt_tensor_data(*out),
                                         (float *)tt_tensor_data(*scale_inv),
                                         amax ? (const float *)tt_tensor_data(amax) : NULL),
                           op, be, x->dtype);
  }
  if (st != TT_OK) {
    tt_out_discard(out, f1);
    tt_out_discard(scale_inv, f2);
  }
  return st;
}

/* The CPU's way: both operands widened to f32, one f32 GEMM scaled by the
 * product of the scales (read from host memory), then rounded to out's
 * dtype (accumulate: added in out's dtype). */
static tt_status tt_matmul_float8_widened(const tt_kernels *be, const tt_tensor *a, const tt_tensor *b, float sa,
                                          float sb, int accumulate, tt_tensor *out) {
  const int64_t m = a->shape[0], k = a->shape[1], n = b->shape[0];
  tt_tensor *a32 = NULL, *b32 = NULL, *c32 = NULL;
  tt_status st = tt_tensor_empty(2, a->shape, TT_F32, a->device, &a32);
  if (st == TT_OK) st = tt_tensor_empty(2, b->shape, TT_F32, b->device, &b32);
  if (st == TT_OK) st = tt_tensor_copy(a32, a);
  if (st == TT_OK) st = tt_tensor_copy(b32, b);
  const int direct = out->dtype == TT_F32;
  if (st == TT_OK && !direct) st = tt_tensor_empty(2, out->shape, TT_F32, out->device, &c32);
  if (st == TT_OK)
    st = tt_kernel_check(be->gemm(TT_F32, 0, 1, 1, m, n, k, (double)(sa * sb), tt_tensor_data(a32), k, 0,
                                  tt_tensor_data(b32), k, 0, direct && accumulate ? 1.0 : 0.0,
                                  tt_tensor_data(direct ? out : c32), n, 0, NULL, -1, 0),
                         "matmul_float8", be, TT_F32);
  if (st == TT_OK && !direct) {
    if (accumulate) {
      tt_tensor *cr = NULL;
      st = tt_tensor_empty(2, out->shape, out->dtype, out->device, &cr);
      if (st == TT_OK) st = tt_tensor_copy(cr, c32);
      if (st == TT_OK) st = tt_op_axpy(out, 1.0, cr);
      if (cr) tt_tensor_release(cr);
    } else {
      st = tt_tensor_copy(out, c32);
    }
  }
  if (c32) tt_tensor_release(c32);
  if (b32) tt_tensor_release(b32);
  if (a32) tt_tensor_release(a32);
  return st;
}

tt_status tt_op_matmul_float8(const tt_tensor *a, const tt_tensor *b, const tt_tensor *a_scale_inv,
                              const tt_tensor *b_scale_inv, int out_dtype, int accumulate, int fast_accum,
                              tt_tensor **out) {
  const char *op = "matmul_float8";
  char s1[96], s2[96];
  TT_TRY(tt_tensor_check_storage(op, "a", a));
  TT_TRY(tt_tensor_check_storage(op, "b", b));
  if (!tt_is_f8(a->dtype) || !tt_is_f8(b->dtype) || (a->dtype == TT_F8E5M2 && b->dtype == TT_F8E5M2))
    return tt_error_set(TT_ERR_DTYPE, "%s: a is %s and b is %s; expected float8_e4m3fn or float8_e5m2, not both "
                        "float8_e5m2", op, tt_dtype_name(a->dtype), tt_dtype_name(b->dtype));
  if (a->ndim != 2 || b->ndim != 2 || a->shape[1] != b->shape[1])
    return tt_error_set(TT_ERR_SHAPE, "%s: a %s and b %s; expected a [M, K] and b [N, K]", op, SHP(a, s1), SHP(b, s2));
  TT_TRY(tt_chk_contig(op, "a", a));
  TT_TRY(tt_chk_contig(op, "b", b));
  TT_TRY(tt_chk_same_device(op, "a", a, "b", b));
  const tt_tensor *sc[2] = {a_scale_inv, b_scale_inv};
  const char *sn[2] = {"a_scale_inv", "b_scale_inv"};
  for (int i = 0; i < 2; i++) {
    TT_TRY(tt_tensor_check_storage(op, sn[i], sc[i]));
    TT_TRY(tt_chk_same_device(op, "a", a, sn[i], sc[i]));
    if (sc[i]->dtype != TT_F32 || tt_tensor_numel(sc[i]) != 1)
      return tt_error_set(TT_ERR_SHAPE, "%s: %s %s of %s; expected one float32 (to_float8's scale_inv)", op, sn[i],
                          SHP(sc[i], s1), tt_dtype_name(sc[i]->dtype));
  }
  if (out_dtype != TT_F32 && out_dtype != TT_BF16 && out_dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "%s: out dtype %s; expected float32, bfloat16 or float16", op,
                        tt_dtype_name(out_dtype));
  if (accumulate && !*out)
    return tt_error_set(TT_ERR_INVALID, "%s: accumulate needs the output to add into", op);
  const int64_t m = a->shape[0], k = a->shape[1], n = b->shape[0];
  if (a->device.type == TT_CUDA && (k % 16 || n % 16))
    return tt_error_set(TT_ERR_SHAPE, "%s: a %s and b %s; cuBLASLt's fp8 GEMMs need K and N multiples of 16", op,
                        SHP(a, s1), SHP(b, s2));
  const int64_t shape[2] = {m, n};
  int fresh = 0;
  TT_TRY(tt_out_prepare(op, "out", out, 2, shape, out_dtype, a->device, &fresh));
  tt_status st = TT_OK;
  if (a->device.type != TT_META) {
    const tt_kernels *be = tt_backend(a->device);
    if (be && be->gemm_float8)
      st = tt_kernel_check(be->gemm_float8(a->dtype, b->dtype, out_dtype, m, n, k, tt_tensor_data(a),
                                           tt_tensor_data(b), (const float *)tt_tensor_data(a_scale_inv),
                                           (const float *)tt_tensor_data(b_scale_inv), accumulate ? 1.0 : 0.0,
                                           tt_tensor_data(*out), fast_accum),
                           op, be, out_dtype);
    else if (be && be->gemm && a->device.type == TT_CPU)
      st = tt_matmul_float8_widened(be, a, b, *(const float *)tt_tensor_data(a_scale_inv),
                                    *(const float *)tt_tensor_data(b_scale_inv), accumulate, *out);
    else
      st = tt_error_set(TT_ERR_UNSUPPORTED, "%s: not implemented on this device", op);
  }
  if (st != TT_OK) tt_out_discard(out, fresh);
  return st;
}
