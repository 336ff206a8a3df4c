/*
 * test_optim.c — the fused AdamW of the CPU backend against the PyTorch
 * formula carried out step by step in double over 5 steps, for f32, f64,
 * bf16 and f16 params, with and without f32 master weights, f32 and bf16
 * grads, nonzero weight decay, both branches of ATen's lerp; and bit for
 * bit against an f32 emulation of torch.optim.AdamW(foreach=False)'s ops.
 */

/* The emulation below must round exactly as written: the build passes
 * -ffp-contract=off (see kernels/cpu/optim.c). */

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "tt_test.h"
#include "cpu/cpu.h"
#include "dtype_conv.h"

enum { STEPS = 5 };

typedef struct {
  double lr, beta1, beta2, eps, wd;
} hyper;

static float to_f32(int dtype, const void *p, int64_t i) {
  switch (dtype) {
  case TT_F64: return (float)((const double *)p)[i];
  case TT_BF16: return tt_bf16_to_f32(((const uint16_t *)p)[i]);
  case TT_F16: return tt_f16_to_f32(((const uint16_t *)p)[i]);
  default: return ((const float *)p)[i];
  }
}

static double get_f64(int dtype, const void *p, int64_t i) {
  return dtype == TT_F64 ? ((const double *)p)[i] : (double)to_f32(dtype, p, i);
}

/* Stores v rounded to nearest even in dtype. */
static void put(int dtype, void *p, int64_t i, double v) {
  switch (dtype) {
  case TT_F64: ((double *)p)[i] = v; break;
  case TT_BF16: ((uint16_t *)p)[i] = tt_f32_to_bf16((float)v); break;
  case TT_F16: ((uint16_t *)p)[i] = tt_f32_to_f16((float)v); break;
  default: ((float *)p)[i] = (float)v; break;
  }
}

/* v rounded to nearest even in dtype, as a double. */
static double round_to(int dtype, double v) {
  switch (dtype) {
  case TT_F64: return v;
  case TT_BF16: return tt_bf16_to_f32(tt_f32_to_bf16((float)v));
  case TT_F16: return tt_f16_to_f32(tt_f32_to_f16((float)v));
  default: return (float)v;
  }
}

static size_t esize(int dtype) { return dtype == TT_F64 ? 8 : dtype == TT_F32 ? 4 : 2; }

/* One case: STEPS kernel steps against the double reference; tol bounds
 * the param's error (m and v, f32 state, are held to 1e-6).
 * The reference state follows what the kernel keeps: a param without master
 * is re-rounded to its dtype after every step; m and v are f32 arrays, so
 * the f64-param reference rounds them to f32 at the end of every step too. */
static void run_case(int pdt, int gdt, int use_master, int64_t n, hyper h, double tol) {
  void *param = malloc((size_t)n * esize(pdt));
  void *grad = malloc((size_t)n * esize(gdt));
  float *m = calloc((size_t)n, 4), *v = calloc((size_t)n, 4), *master = use_master ? malloc((size_t)n * 4) : NULL;
  double *rp = malloc((size_t)n * 8), *rm = calloc((size_t)n, 8), *rv = calloc((size_t)n, 8);
  for (int64_t i = 0; i < n; i++) {
    double p0 = tt_test_rand();
    if (use_master) {
      master[i] = (float)p0;
      rp[i] = master[i];
    } else {
      put(pdt, param, i, p0);
      rp[i] = get_f64(pdt, param, i);
    }
  }
  if (use_master) memset(param, 0xff, (size_t)n * esize(pdt)); /* NaN: every element must be written */
  int round_p = !use_master && pdt != TT_F32 && pdt != TT_F64;
  int64_t mism = 0;
  double ep = 0, em = 0, ev = 0;
  for (int step = 1; step <= STEPS; step++) {
    for (int64_t i = 0; i < n; i++) put(gdt, grad, i, tt_test_rand() * (i % 7 == 0 ? 1e-3 : 0.5));
    double bc1 = 1 - pow(h.beta1, step), bc2 = 1 - pow(h.beta2, step);
    tt_status st = tt_cpu_adamw(pdt, gdt, n, param, grad, m, v, master, h.lr, h.beta1, h.beta2, h.eps, h.wd, bc1, bc2);
    CHECK(st == TT_OK, "adamw status %d", (int)st);
    for (int64_t i = 0; i < n; i++) {
      double g = get_f64(gdt, grad, i);
      double p = rp[i] * (1 - h.lr * h.wd);
      double mi = rm[i] + (1 - h.beta1) * (g - rm[i]);
      double vi = rv[i] * h.beta2 + (1 - h.beta2) * g * g;
      double denom = sqrt(vi) / sqrt(bc2) + h.eps;
      p = p - (h.lr / bc1) * mi / denom;
      if (round_p) p = round_to(pdt, p);
      rp[i] = p;
      rm[i] = pdt == TT_F64 && !use_master ? (float)mi : mi;
      rv[i] = pdt == TT_F64 && !use_master ? (float)vi : vi;
    }
  }
  /* tensor-wide relative errors of the final state */
  double *kp = malloc((size_t)n * 8), *km = malloc((size_t)n * 8), *kv = malloc((size_t)n * 8);
  for (int64_t i = 0; i < n; i++) {
    kp[i] = use_master ? master[i] : get_f64(pdt, param, i);
    km[i] = m[i];
    kv[i] = v[i];
    if (use_master) {
      /* param is master rounded to the param dtype */
      if (get_f64(pdt, param, i) != round_to(pdt, master[i])) mism++;
    }
  }
  ep = tt_test_rel_err_f64(kp, rp, n);
  em = tt_test_rel_err_f64(km, rm, n);
  ev = tt_test_rel_err_f64(kv, rv, n);
  const char *names[] = {"f32", "f64", "bf16", "f16"};
  if (round_p) {
    /* bf16/f16 without master: the f32 and the double update may round to
     * neighbouring values; allow one ulp on a few elements. */
    double ulp = pdt == TT_BF16 ? 1.0 / 128 : 1.0 / 1024;
    int64_t off = 0, far = 0;
    for (int64_t i = 0; i < n; i++) {
      double d = fabs(kp[i] - rp[i]);
      if (d > 0) off++;
      if (d > ulp * fmax(fabs(rp[i]), 1e-3)) far++;
    }
    CHECK(far == 0 && off <= n / 100 + 1, "adamw %s param (no master): %lld differ, %lld by more than an ulp",
          names[pdt], (long long)off, (long long)far);
  } else {
    CHECK(ep <= tol, "adamw param %s grad %s master %d n %lld: param rel err %g", names[pdt], names[gdt], use_master,
          (long long)n, ep);
  }
  /* m and v are f32 state in every case */
  CHECK(em <= 1e-6 && ev <= 1e-6, "adamw param %s grad %s master %d: m err %g v err %g", names[pdt], names[gdt],
        use_master, em, ev);
  CHECK(mism == 0, "adamw %s: %lld params are not master rounded", names[pdt], (long long)mism);
  free(kp);
  free(km);
  free(kv);
  free(param);
  free(grad);
  free(m);
  free(v);
  free(master);
  free(rp);
  free(rm);
  free(rv);
}

static void test_against_formula(void) {
  hyper h = {1e-3, 0.9, 0.999, 1e-8, 0.1};
  run_case(TT_F32, TT_F32, 0, 1003, h, 1e-6);
  run_case(TT_F32, TT_F32, 0, 100003, h, 1e-6); /* the parallel path */
  run_case(TT_F32, TT_BF16, 0, 1003, h, 1e-6);
  run_case(TT_F32, TT_F64, 0, 777, h, 1e-6);
  run_case(TT_BF16, TT_F32, 1, 1003, h, 1e-6);
  run_case(TT_BF16, TT_BF16, 1, 70001, h, 1e-6);
  run_case(TT_F16, TT_F32, 1, 1003, h, 1e-6);
  run_case(TT_F32, TT_F32, 1, 513, h, 1e-6);
  run_case(TT_F64, TT_F32, 1, 300, h, 1e-6);
  /* f64 params: double arithmetic, but m and v round to f32 every step */
  run_case(TT_F64, TT_F64, 0, 1003, h, 1e-9);
  run_case(TT_F64, TT_BF16, 0, 999, h, 1e-9);
  hyper big = {1e-2, 0.9, 0.999, 1e-8, 0.1}; /* updates large enough to move a bf16 */
  run_case(TT_BF16, TT_F32, 0, 4001, big, 1e-6);
  run_case(TT_F16, TT_BF16, 0, 4001, big, 1e-6);
  hyper heavy = {3e-3, 0.3, 0.99, 1e-6, 0.05}; /* lerp weight 0.7: ATen's other branch */
  run_case(TT_F32, TT_F32, 0, 1003, heavy, 1e-6);
  run_case(TT_F64, TT_F64, 0, 1003, heavy, 1e-9);
  CHECK(tt_cpu_adamw(TT_I32, TT_F32, 1, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 0.1, 0.001) ==
            TT_ERR_DTYPE,
        "i32 param rejected");
  CHECK(tt_cpu_adamw(TT_F32, TT_F32, 0, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 0.1, 0.001) == TT_OK,
        "n = 0");
}

/* torch.optim.AdamW(foreach=False), one f32 element, op by op as ATen's
 * vectorized CPU kernels round (Python scalars enter as f32). */
static void torch_step(float *p, float g, float *m, float *v, const hyper *h, double bc1, double bc2) {
  *p = *p * (float)(1 - h->lr * h->wd);                    /* param.mul_(1 - lr * wd) */
  float w = (float)(1 - h->beta1);                         /* exp_avg.lerp_(grad, 1 - beta1) */
  *m = fabsf(w) < 0.5f ? fmaf(w, g - *m, *m) : fmaf(w - 1.0f, g - *m, g);
  *v = *v * (float)h->beta2;                               /* exp_avg_sq.mul_(beta2) */
  *v = *v + (float)(1 - h->beta2) * g * g;                 /* .addcmul_(grad, grad, value=1 - beta2) */
  double step_size = h->lr / bc1;
  float denom = sqrtf(*v) / (float)sqrt(bc2) + (float)h->eps; /* (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps) */
  *p = *p + (float)(-step_size) * *m / denom;              /* param.addcdiv_(exp_avg, denom, value=-step_size) */
}

static void test_bitwise_torch_order(void) {
  hyper hs[2] = {{1e-3, 0.9, 0.999, 1e-8, 0.1}, {3e-3, 0.3, 0.99, 1e-6, 0.05}};
  for (int k = 0; k < 2; k++) {
    int64_t n = 40001;
    float *p = malloc((size_t)n * 4), *g = malloc((size_t)n * 4), *m = calloc((size_t)n, 4), *v = calloc((size_t)n, 4);
    float *ep = malloc((size_t)n * 4), *em = calloc((size_t)n, 4), *ev = calloc((size_t)n, 4);
    tt_test_fill_f32(p, n, 1.0);
    memcpy(ep, p, (size_t)n * 4);
    int64_t bad = 0;
    for (int step = 1; step <= STEPS; step++) {
      tt_test_fill_f32(g, n, 0.3);
      double bc1 = 1 - pow(hs[k].beta1, step), bc2 = 1 - pow(hs[k].beta2, step);
      tt_cpu_adamw(TT_F32, TT_F32, n, p, g, m, v, NULL, hs[k].lr, hs[k].beta1, hs[k].beta2, hs[k].eps, hs[k].wd, bc1,
                   bc2);
      for (int64_t i = 0; i < n; i++) torch_step(&ep[i], g[i], &em[i], &ev[i], &hs[k], bc1, bc2);
    }
    for (int64_t i = 0; i < n; i++)
      if (memcmp(&p[i], &ep[i], 4) || memcmp(&m[i], &em[i], 4) || memcmp(&v[i], &ev[i], 4)) bad++;
    CHECK(bad == 0, "adamw differs from the torch op order in %lld of %lld elements (case %d)", (long long)bad,
          (long long)n, k);
    free(p);
    free(g);
    free(m);
    free(v);
    free(ep);
    free(em);
    free(ev);
  }
}

/* The result never depends on the thread count. */
static void test_threads(void) {
  int64_t n = 200003;
  float *g = malloc((size_t)n * 4), *pa = malloc((size_t)n * 4), *pb = malloc((size_t)n * 4);
  float *ma = calloc((size_t)n, 4), *va = calloc((size_t)n, 4), *mb = calloc((size_t)n, 4), *vb = calloc((size_t)n, 4);
  tt_test_fill_f32(pa, n, 1.0);
  memcpy(pb, pa, (size_t)n * 4);
  tt_test_fill_f32(g, n, 0.1);
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
  tt_cpu_adamw(TT_F32, TT_F32, n, pa, g, ma, va, NULL, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05);
#ifdef _OPENMP
  omp_set_num_threads(2);
#endif
  tt_cpu_adamw(TT_F32, TT_F32, n, pb, g, mb, vb, NULL, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.1, 0.05);
  CHECK(memcmp(pa, pb, (size_t)n * 4) == 0 && memcmp(ma, mb, (size_t)n * 4) == 0 && memcmp(va, vb, (size_t)n * 4) == 0,
        "adamw differs across thread counts");
  free(g);
  free(pa);
  free(pb);
  free(ma);
  free(va);
  free(mb);
  free(vb);
}

int main(void) {
  test_against_formula();
  test_bitwise_torch_order();
  test_threads();
  return tt_test_summary("test_optim");
}
