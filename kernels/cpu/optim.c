/*
 * optim.c — fused AdamW with decoupled weight decay, matching
 * torch.optim.AdamW(foreach=False) on the CPU operation by operation.
 *
 * PyTorch's single-tensor step is, for each parameter (Python floats are
 * doubles; each tensor op rounds to the tensor's dtype, and a Python scalar
 * meets an f32 tensor as an f32 value):
 *
 *   param.mul_(1 - lr * weight_decay)                  p = p * f(1 - lr*wd)
 *   exp_avg.lerp_(grad, 1 - beta1)                     w = f(1 - b1)
 *       |w| < 0.5:  m = fma(w, g - m, m)               (ATen's lerp_vec uses
 *       otherwise:  m = fma(w - 1, g - m, g)            a fused multiply-add)
 *   exp_avg_sq.mul_(beta2)                             v = v * f(b2)
 *             .addcmul_(grad, grad, value=1 - beta2)   v = v + (f(1 - b2) * g) * g
 *   step_size = lr / bias_correction1                  (double)
 *   denom = (exp_avg_sq.sqrt() / sqrt(bias_correction2)).add_(eps)
 *                                                      d = sqrt(v) / f(sqrt(bc2)) + f(eps)
 *   param.addcdiv_(exp_avg, denom, value=-step_size)   p = p + (f(-step_size) * m) / d
 *
 * where f() rounds a double to f32. Every line above is one IEEE f32
 * operation here too, in that order, with no other fused multiply-adds
 * (ATen's vectorized addcmul/addcdiv have none; its scalar tail loops may be
 * contracted by its compiler, an ulp at most). The caller passes
 * bias_correction1 = 1 - b1^step and bias_correction2 = 1 - b2^step.
 *
 * Precision by dtype:
 *  - f32 param, no master: exactly the sequence above on the param.
 *  - master (f32) given: the sequence runs on master; param then receives
 *    master rounded to its dtype (bf16/f16 round to nearest even).
 *  - bf16/f16 param, no master: the param is widened to f32, the sequence
 *    runs in f32, and the result is rounded once to the param dtype.
 *  - f64 param, no master: the same sequence in double, scalars unrounded
 *    (1 - lr*wd, 1 - b1, b2, 1 - b2, sqrt(bc2), eps, -lr/bc1 as doubles);
 *    m and v are read from their f32 arrays into double, updated in double,
 *    used in double for this step's update, and rounded to f32 when stored.
 *  - grad of any of f32/f64/bf16/f16 is converted to the compute type first.
 */

/* Only the fused multiply-adds written as fma() are fused: the build passes
 * -ffp-contract=off, or we would no longer round as ATen does. */

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"
#include "../dtype_conv.h"

enum {
  CHUNK = 512,      /* elements staged in f32 on the stack (L1-sized) */
  PAR_MIN = 1 << 14 /* elements below which one thread is faster */
};

typedef struct {
  float decay, w, w_coeff, b2, c2, bc2_sqrt, eps, neg_step;
  int w_small;
} adam_f32;

typedef struct {
  double decay, w, w_coeff, b2, c2, bc2_sqrt, eps, neg_step;
  int w_small;
} adam_f64;

/* The f32 step over cnt elements; p may be the param itself or master. */
static void adam_core_f32(const adam_f32 *k, int64_t cnt, float *restrict p, const float *restrict g,
                          float *restrict m, float *restrict v) {
  const float decay = k->decay, coeff = k->w_coeff, b2 = k->b2, c2 = k->c2;
  const float bc2_sqrt = k->bc2_sqrt, eps = k->eps, neg_step = k->neg_step;
  const int small = k->w_small;
  for (int64_t i = 0; i < cnt; i++) {
    float gi = g[i], mi = m[i];
    float pi = p[i] * decay;
    mi = fmaf(coeff, gi - mi, small ? mi : gi);
    float vi = v[i] * b2;
    vi = vi + c2 * gi * gi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = pi + neg_step * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

static void adam_core_f64(const adam_f64 *k, int64_t cnt, double *restrict p, const double *restrict g,
                          float *restrict m, float *restrict v) {
  const double decay = k->decay, coeff = k->w_coeff, b2 = k->b2, c2 = k->c2;
  const double bc2_sqrt = k->bc2_sqrt, eps = k->eps, neg_step = k->neg_step;
  const int small = k->w_small;
  for (int64_t i = 0; i < cnt; i++) {
    double gi = g[i], mi = m[i];
    double pi = p[i] * decay;
    mi = fma(coeff, gi - mi, small ? mi : gi);
    double vi = (double)v[i] * b2;
    vi = vi + c2 * gi * gi;
    double denom = sqrt(vi) / bc2_sqrt + eps;
    p[i] = pi + neg_step * mi / denom;
    m[i] = (float)mi;
    v[i] = (float)vi;
  }
}

/* Widen cnt elements of x (dtype dt, from element lo) into f32 / f64. */
static void load_f32(float *restrict out, int dt, const void *x, int64_t lo, int64_t cnt) {
  switch (dt) {
  case TT_F64:
    for (int64_t i = 0; i < cnt; i++) out[i] = (float)((const double *)x)[lo + i];
    break;
  case TT_BF16:
    for (int64_t i = 0; i < cnt; i++) out[i] = tt_bf16_to_f32(((const uint16_t *)x)[lo + i]);
    break;
  case TT_F16:
    for (int64_t i = 0; i < cnt; i++) out[i] = tt_f16_to_f32(((const uint16_t *)x)[lo + i]);
    break;
  default:
    for (int64_t i = 0; i < cnt; i++) out[i] = ((const float *)x)[lo + i];
    break;
  }
}

static void load_f64(double *restrict out, int dt, const void *x, int64_t lo, int64_t cnt) {
  switch (dt) {
  case TT_F64:
    for (int64_t i = 0; i < cnt; i++) out[i] = ((const double *)x)[lo + i];
    break;
  case TT_BF16:
    for (int64_t i = 0; i < cnt; i++) out[i] = tt_bf16_to_f32(((const uint16_t *)x)[lo + i]);
    break;
  case TT_F16:
    for (int64_t i = 0; i < cnt; i++) out[i] = tt_f16_to_f32(((const uint16_t *)x)[lo + i]);
    break;
  default:
    for (int64_t i = 0; i < cnt; i++) out[i] = ((const float *)x)[lo + i];
    break;
  }
}

/* Round cnt f32 values into x (dtype dt) from element lo. */
static void store_f32(void *x, int dt, const float *restrict in, int64_t lo, int64_t cnt) {
  switch (dt) {
  case TT_F64:
    for (int64_t i = 0; i < cnt; i++) ((double *)x)[lo + i] = in[i];
    break;
  case TT_BF16:
    for (int64_t i = 0; i < cnt; i++) ((uint16_t *)x)[lo + i] = tt_f32_to_bf16(in[i]);
    break;
  case TT_F16:
    for (int64_t i = 0; i < cnt; i++) ((uint16_t *)x)[lo + i] = tt_f32_to_f16(in[i]);
    break;
  default:
    for (int64_t i = 0; i < cnt; i++) ((float *)x)[lo + i] = in[i];
    break;
  }
}

static int dtype_ok(int dt) { return dt == TT_F32 || dt == TT_F64 || dt == TT_BF16 || dt == TT_F16; }

/* The scalars that do not change from step to step. */
static void adam_f32_scalars(adam_f32 *k, double beta1, double beta2, double eps) {
  k->w = (float)(1.0 - beta1);
  k->w_small = fabsf(k->w) < 0.5f;
  k->w_coeff = k->w_small ? k->w : k->w - 1.0f;
  k->b2 = (float)beta2;
  k->c2 = (float)(1.0 - beta2);
  k->eps = (float)eps;
}

/* The f32 path (every param dtype but f64 without master). grad_scale: the
 * grad is first multiplied by f32(*grad_scale) and rounded to its dtype,
 * as scaling the grad in place (tt_op_scale_multi) would leave it. */
static void adamw_f32_run(const adam_f32 *kp, int param_dtype, int grad_dtype, int64_t n, void *param,
                          const void *grad, float *m, float *v, float *master, const double *grad_scale) {
  const adam_f32 k = *kp;
  const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
  const float gs = grad_scale ? (float)*grad_scale : 1.0f;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t c = 0; c < nchunks; c++) {
    int64_t lo = c * CHUNK, cnt = n - lo < CHUNK ? n - lo : CHUNK;
    float gb[CHUNK], pb[CHUNK];
    const float *g = (const float *)grad + lo;
    if (grad_dtype != TT_F32 || grad_scale) {
      load_f32(gb, grad_dtype, grad, lo, cnt);
      if (grad_scale) {
        if (grad_dtype == TT_BF16)
          for (int64_t i = 0; i < cnt; i++) gb[i] = tt_bf16_to_f32(tt_f32_to_bf16(gs * gb[i]));
        else if (grad_dtype == TT_F16)
          for (int64_t i = 0; i < cnt; i++) gb[i] = tt_f16_to_f32(tt_f32_to_f16(gs * gb[i]));
        else
          for (int64_t i = 0; i < cnt; i++) gb[i] = gs * gb[i];
      }
      g = gb;
    }
    if (master) {
      adam_core_f32(&k, cnt, master + lo, g, m + lo, v + lo);
      store_f32(param, param_dtype, master + lo, lo, cnt);
    } else if (param_dtype == TT_F32) {
      adam_core_f32(&k, cnt, (float *)param + lo, g, m + lo, v + lo);
    } else {
      load_f32(pb, param_dtype, param, lo, cnt);
      adam_core_f32(&k, cnt, pb, g, m + lo, v + lo);
      store_f32(param, param_dtype, pb, lo, cnt);
    }
  }
}

tt_status tt_cpu_adamw(int param_dtype, int grad_dtype, int64_t n, void *param, const void *grad, float *m, float *v,
                       float *master, double lr, double beta1, double beta2, double eps, double weight_decay,
                       double bias_correction1, double bias_correction2) {
  if (!dtype_ok(param_dtype) || !dtype_ok(grad_dtype)) return TT_ERR_DTYPE;
  if (n <= 0) return TT_OK;
  int64_t nchunks = (n + CHUNK - 1) / CHUNK;

  if (param_dtype == TT_F64 && !master) {
    adam_f64 k;
    k.decay = 1.0 - lr * weight_decay;
    k.w = 1.0 - beta1;
    k.w_small = fabs(k.w) < 0.5;
    k.w_coeff = k.w_small ? k.w : k.w - 1.0;
    k.b2 = beta2;
    k.c2 = 1.0 - beta2;
    k.bc2_sqrt = sqrt(bias_correction2);
    k.eps = eps;
    k.neg_step = -(lr / bias_correction1);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int64_t c = 0; c < nchunks; c++) {
      int64_t lo = c * CHUNK, cnt = n - lo < CHUNK ? n - lo : CHUNK;
      double gb[CHUNK];
      const double *g = (const double *)grad + lo;
      if (grad_dtype != TT_F64) {
        load_f64(gb, grad_dtype, grad, lo, cnt);
        g = gb;
      }
      adam_core_f64(&k, cnt, (double *)param + lo, g, m + lo, v + lo);
    }
    return TT_OK;
  }

  adam_f32 k;
  adam_f32_scalars(&k, beta1, beta2, eps);
  k.decay = (float)(1.0 - lr * weight_decay);
  k.bc2_sqrt = (float)sqrt(bias_correction2);
  k.neg_step = (float)(-(lr / bias_correction1));
  adamw_f32_run(&k, param_dtype, grad_dtype, n, param, grad, m, v, master, NULL);
  return TT_OK;
}

/* The step's scalars come from memory (kernels.h: adamw_multi_dev); on the
 * CPU that is host memory, read now. */
tt_status tt_cpu_adamw_multi_dev(int param_dtype, int grad_dtype, int k, const tt_adamw_tensor *ts, double beta1,
                                 double beta2, double eps, const float *decay, const float *pairs,
                                 const double *norm_clip) {
  if (param_dtype == TT_F64 || grad_dtype == TT_F64 || !dtype_ok(param_dtype) || !dtype_ok(grad_dtype))
    return TT_ERR_DTYPE;
  if (norm_clip && !isfinite(norm_clip[0])) return TT_OK; /* a NaN/inf gradient: the step is skipped */
  adam_f32 kk;
  adam_f32_scalars(&kk, beta1, beta2, eps);
  kk.decay = decay[0];
  for (int j = 0; j < k; j++) {
    kk.neg_step = pairs[2 * j];
    kk.bc2_sqrt = pairs[2 * j + 1];
    adamw_f32_run(&kk, param_dtype, grad_dtype, ts[j].n, ts[j].param, ts[j].grad, ts[j].m, ts[j].v, ts[j].master,
                  norm_clip ? norm_clip + 1 : NULL);
  }
  return TT_OK;
}
