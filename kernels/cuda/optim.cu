/*
 * optim.cu — fused AdamW with decoupled weight decay over one whole tensor
 * per launch, f32 optimizer state, optional f32 master weights.
 *
 * The arithmetic is kernels/cpu/optim.c's, operation for operation (that
 * file documents the sequence and why: torch.optim.AdamW(foreach=False)):
 * the same scalars computed on the host in the same double expressions, the
 * same IEEE f32 (or f64) operations in the same order on the device, with
 * the products unfused (the _rn intrinsics) except the lerp's one fma. So
 * the CPU and the GPU agree bit for bit; sqrt and division are IEEE-exact
 * on both. Precision by dtype, as on the CPU:
 *  - f32 param, no master: the sequence on the param;
 *  - master given: the sequence on master, param = master rounded to its
 *    dtype (bf16/f16 round to nearest even, f64 widens);
 *  - bf16/f16 param, no master: widened to f32, rounded once at the end;
 *  - f64 param, no master: the sequence in double with unrounded scalars,
 *    m and v widened from and rounded back to f32;
 *  - grad of f32/f64/bf16/f16 is converted to the compute type first.
 * Each thread takes 4 consecutive elements of every array, each array read
 * and written in one vector access when every pointer allows (16 bytes of
 * f32, 8 of bf16/f16), in a grid-stride loop.
 */
#include "kernel_util.cuh"

struct tt_adam_f32 {
  float decay, coeff, b2, c2, bc2_sqrt, eps, neg_step;
  int small;
};
TT_EMU_NO_PTRS(tt_adam_f32)

struct tt_adam_f64 {
  double decay, coeff, b2, c2, bc2_sqrt, eps, neg_step;
  int small;
};
TT_EMU_NO_PTRS(tt_adam_f64)

#define TT_ADAM_UNIT 4

__device__ __forceinline__ float tt_adam_step(const tt_adam_f32 &k, float p, float g, float &m, float &v) {
  float pi = __fmul_rn(p, k.decay);
  float mi = fmaf(k.coeff, __fsub_rn(g, m), k.small ? m : g);
  float vi = __fmul_rn(v, k.b2);
  vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(k.c2, g), g));
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
  m = mi;
  v = vi;
  return __fadd_rn(pi, __fdiv_rn(__fmul_rn(k.neg_step, mi), denom));
}

/* Four consecutive elements in one load/store when aligned to their size
 * (16 bytes of f32, 8 of bf16/f16, 32 of f64). */
template <typename S> struct alignas(4 * sizeof(S)) tt_quad {
  S v[4];
};

template <typename S> __host__ __device__ __forceinline__ bool tt_quad_ok(const S *p) {
  return ((uintptr_t)p % (4 * sizeof(S))) == 0;
}

/* Elements [e, e + cnt) of p as f32 (f64 rounds, 16-bit floats widen). */
template <int DT>
__device__ __forceinline__ void tt_adam_ld(const typename tt_ft<DT>::S *p, int64_t e, int cnt, bool vec, float out[4]) {
  typedef typename tt_ft<DT>::S S;
  TT_EMU_CHUNK(cnt == 4, vec);
  if (vec && cnt == 4) {
    tt_quad<S> q = *reinterpret_cast<const tt_quad<S> *>(p + e);
#pragma unroll
    for (int j = 0; j < 4; j++) out[j] = (float)tt_ft<DT>::ld(q.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; j++) out[j] = j < cnt ? (float)tt_ft<DT>::ld(p[e + j]) : 0.0f;
  }
}

/* f32 values rounded into p's dtype (f64 widens). */
template <int DT>
__device__ __forceinline__ void tt_adam_st(typename tt_ft<DT>::S *p, int64_t e, int cnt, bool vec, const float in[4]) {
  typedef typename tt_ft<DT>::S S;
  typedef typename tt_ft<DT>::C C;
  TT_EMU_CHUNK(cnt == 4, vec);
  if (vec && cnt == 4) {
    tt_quad<S> q;
#pragma unroll
    for (int j = 0; j < 4; j++) q.v[j] = tt_ft<DT>::st((C)in[j]);
    *reinterpret_cast<tt_quad<S> *>(p + e) = q;
  } else {
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (j < cnt) p[e + j] = tt_ft<DT>::st((C)in[j]);
  }
}

/* The f32 path over units [first, nu) of one tensor, every `stride`-th:
 * param of PDT (f32, bf16, f16; f64 only with master). scale_g: each grad
 * is first multiplied by gs and rounded to GDT, which is what scaling the
 * grad in place (tt_cuda_foreach_scale: tt_mul(alpha, x), stored) leaves. */
template <int PDT, int GDT>
__device__ __forceinline__ void tt_adamw_f32_units(const tt_adam_f32 &k, int64_t n, bool vec, int64_t first,
                                                   int64_t stride, typename tt_ft<PDT>::S *__restrict__ param,
                                                   const typename tt_ft<GDT>::S *__restrict__ grad,
                                                   float *__restrict__ m, float *__restrict__ v,
                                                   float *__restrict__ master, bool scale_g = false,
                                                   float gs = 1.0f) {
  const int64_t nu = (n + TT_ADAM_UNIT - 1) / TT_ADAM_UNIT;
  for (int64_t u = first; u < nu; u += stride) {
    const int64_t e = u * TT_ADAM_UNIT;
    const int cnt = n - e < TT_ADAM_UNIT ? (int)(n - e) : TT_ADAM_UNIT;
    float mv[4], vv[4], pv[4], gv[4];
    tt_adam_ld<TT_F32>(m, e, cnt, vec, mv);
    tt_adam_ld<TT_F32>(v, e, cnt, vec, vv);
    tt_adam_ld<GDT>(grad, e, cnt, vec, gv);
    if (scale_g) {
#pragma unroll
      for (int j = 0; j < 4; j++)
        gv[j] = (float)tt_ft<GDT>::ld(tt_ft<GDT>::st((typename tt_ft<GDT>::C)tt_mul(gs, gv[j])));
    }
    if (master) tt_adam_ld<TT_F32>(master, e, cnt, vec, pv);
    else tt_adam_ld<PDT>(param, e, cnt, vec, pv);
#pragma unroll
    for (int j = 0; j < 4; j++) pv[j] = tt_adam_step(k, pv[j], gv[j], mv[j], vv[j]);
    tt_adam_st<TT_F32>(m, e, cnt, vec, mv);
    tt_adam_st<TT_F32>(v, e, cnt, vec, vv);
    if (master) tt_adam_st<TT_F32>(master, e, cnt, vec, pv);
    tt_adam_st<PDT>(param, e, cnt, vec, pv);
  }
}

template <int PDT, int GDT>
__global__ void tt_adamw_f32_kernel(tt_adam_f32 k, int64_t n, bool vec, typename tt_ft<PDT>::S *__restrict__ param,
                                    const typename tt_ft<GDT>::S *__restrict__ grad, float *__restrict__ m,
                                    float *__restrict__ v, float *__restrict__ master) {
  tt_adamw_f32_units<PDT, GDT>(k, n, vec, (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                               (int64_t)gridDim.x * blockDim.x, param, grad, m, v, master);
}

/* Many tensors per launch (as PyTorch's multi_tensor_apply): the tensors'
 * pointers travel as a kernel argument (no copy to the device, so the
 * launch is also capturable in a CUDA graph); tensor i owns the blocks
 * [first_block[i], first_block[i + 1]) and walks its elements with them.
 * Per tensor only the bias corrections differ; the arithmetic is the
 * single-tensor kernel's, so the bits are the same. */
struct tt_adam_mt_tensor {
  void *param;
  const void *grad;
  float *m, *v, *master;
  int64_t n;
  float neg_step, bc2_sqrt;
  int vec;
  int slot; /* DEV: this tensor's pair in a.pairs */
};

/* DEV (tt_cuda_adamw_multi_dev): the step's scalars are read from device
 * memory when the kernel runs, so one captured launch serves every step of
 * a CUDA graph: decay[0], pairs[2 slot] (neg_step), pairs[2 slot + 1]
 * (bc2_sqrt), and the grads' scale (the clip coefficient) when given. */
struct tt_adam_mt_args {
  int count;
  unsigned int first_block[TT_ADAMW_MULTI_MAX + 1];
  tt_adam_mt_tensor t[TT_ADAMW_MULTI_MAX];
  const float *decay, *pairs;
  const double *norm_clip; /* {norm, clip coefficient} or NULL */
};
#if TITAN_CUEMU
static void tt_emu_ptrs(const tt_adam_mt_args &a, tt_emu_ptr_visit &visit) {
  for (int i = 0; i < a.count && i < TT_ADAMW_MULTI_MAX; i++) {
    visit("t[i].param", i, a.t[i].param), visit("t[i].grad", i, a.t[i].grad), visit("t[i].m", i, a.t[i].m);
    visit("t[i].v", i, a.t[i].v), visit("t[i].master", i, a.t[i].master);
  }
  visit("decay", -1, a.decay), visit("pairs", -1, a.pairs), visit("norm_clip", -1, a.norm_clip);
}
#endif

template <int PDT, int GDT, bool DEV>
__global__ void tt_adamw_mt_kernel(tt_adam_f32 k, const __grid_constant__ tt_adam_mt_args a) {
  int i = 0;
  while (i + 1 < a.count && a.first_block[i + 1] <= blockIdx.x) i++;
  const tt_adam_mt_tensor &d = a.t[i];
  tt_adam_f32 kk = k;
  bool scale_g = false;
  float gs = 1.0f;
  if (DEV) {
    kk.decay = a.decay[0];
    kk.neg_step = a.pairs[2 * d.slot];
    kk.bc2_sqrt = a.pairs[2 * d.slot + 1];
    if (a.norm_clip) {
      if (!isfinite(a.norm_clip[0])) return; /* a NaN/inf gradient: the step is skipped (kernels.h) */
      scale_g = true;
      gs = (float)a.norm_clip[1];
    }
  } else {
    kk.neg_step = d.neg_step;
    kk.bc2_sqrt = d.bc2_sqrt;
  }
  const int64_t blocks = a.first_block[i + 1] - a.first_block[i];
  tt_adamw_f32_units<PDT, GDT>(kk, d.n, d.vec != 0, (int64_t)(blockIdx.x - a.first_block[i]) * blockDim.x + threadIdx.x,
                               blocks * blockDim.x, (typename tt_ft<PDT>::S *)d.param,
                               (const typename tt_ft<GDT>::S *)d.grad, d.m, d.v, d.master, scale_g, gs);
}

/* The f64 path (f64 param, no master). */
template <int GDT>
__global__ void tt_adamw_f64_kernel(tt_adam_f64 k, int64_t n, double *__restrict__ param,
                                    const typename tt_ft<GDT>::S *__restrict__ grad, float *__restrict__ m,
                                    float *__restrict__ v) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    double gi = (double)tt_ft<GDT>::ld(grad[i]), mi = (double)m[i];
    double pi = __dmul_rn(param[i], k.decay);
    mi = fma(k.coeff, __dsub_rn(gi, mi), k.small ? mi : gi);
    double vi = __dmul_rn((double)v[i], k.b2);
    vi = __dadd_rn(vi, __dmul_rn(__dmul_rn(k.c2, gi), gi));
    double denom = __dadd_rn(__ddiv_rn(__dsqrt_rn(vi), k.bc2_sqrt), k.eps);
    param[i] = __dadd_rn(pi, __ddiv_rn(__dmul_rn(k.neg_step, mi), denom));
    m[i] = (float)mi;
    v[i] = (float)vi;
  }
}

template <int PDT, int GDT>
static void tt_adamw_f32_go(const tt_adam_f32 &k, int64_t n, bool vec, void *param, const void *grad, float *m,
                            float *v, float *master, cudaStream_t s) {
  tt_adamw_f32_kernel<PDT, GDT><<<tt_cuda_blocks((n + TT_ADAM_UNIT - 1) / TT_ADAM_UNIT), TT_CUDA_THREADS, 0, s>>>(
      k, n, vec, (typename tt_ft<PDT>::S *)param, (const typename tt_ft<GDT>::S *)grad, m, v, master);
}

template <int PDT>
static void tt_adamw_f32_by_grad(int grad_dtype, const tt_adam_f32 &k, int64_t n, bool vec, void *param,
                                 const void *grad, float *m, float *v, float *master, cudaStream_t s) {
  switch (grad_dtype) {
    case TT_F32: tt_adamw_f32_go<PDT, TT_F32>(k, n, vec, param, grad, m, v, master, s); break;
    case TT_F64: tt_adamw_f32_go<PDT, TT_F64>(k, n, vec, param, grad, m, v, master, s); break;
    case TT_BF16: tt_adamw_f32_go<PDT, TT_BF16>(k, n, vec, param, grad, m, v, master, s); break;
    default: tt_adamw_f32_go<PDT, TT_F16>(k, n, vec, param, grad, m, v, master, s); break;
  }
}

static int tt_adam_dtype_ok(int dt) { return dt == TT_F32 || dt == TT_F64 || dt == TT_BF16 || dt == TT_F16; }

/* The scalars exactly as the CPU computes them (host double, rounded to f32). */
static tt_adam_f32 tt_adam_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   double bias_correction1, double bias_correction2) {
  tt_adam_f32 k;
  k.decay = (float)(1.0 - lr * weight_decay);
  float w = (float)(1.0 - beta1);
  k.small = fabsf(w) < 0.5f;
  k.coeff = k.small ? w : w - 1.0f;
  k.b2 = (float)beta2;
  k.c2 = (float)(1.0 - beta2);
  k.bc2_sqrt = (float)sqrt(bias_correction2);
  k.eps = (float)eps;
  k.neg_step = (float)(-(lr / bias_correction1));
  return k;
}

/* Every array of the update allows 4-element vector accesses. */
static bool tt_adam_vec_ok(int param_dtype, int grad_dtype, const void *param, const void *grad, const float *m,
                           const float *v, const float *master) {
  bool vec = tt_quad_ok(m) && tt_quad_ok(v) && (!master || tt_quad_ok(master));
  if (grad_dtype == TT_F64) vec = vec && tt_quad_ok((const double *)grad);
  else if (grad_dtype == TT_F32) vec = vec && tt_quad_ok((const float *)grad);
  else vec = vec && tt_quad_ok((const uint16_t *)grad);
  if (param_dtype == TT_F64) vec = vec && tt_quad_ok((const double *)param);
  else if (param_dtype == TT_F32) vec = vec && tt_quad_ok((const float *)param);
  else vec = vec && tt_quad_ok((const uint16_t *)param);
  return vec;
}

extern "C" tt_status tt_cuda_adamw(int param_dtype, int grad_dtype, int64_t n, void *param, const void *grad,
                                   float *m, float *v, float *master, double lr, double beta1, double beta2,
                                   double eps, double weight_decay, double bias_correction1,
                                   double bias_correction2) {
  if (!tt_adam_dtype_ok(param_dtype) || !tt_adam_dtype_ok(grad_dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda adamw: param dtype %d, grad dtype %d (expected f32, f64, bf16 or f16)",
                        param_dtype, grad_dtype);
  if (n <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;

  if (param_dtype == TT_F64 && !master) {
    tt_adam_f64 k;
    k.decay = 1.0 - lr * weight_decay;
    double w = 1.0 - beta1;
    k.small = fabs(w) < 0.5;
    k.coeff = k.small ? w : w - 1.0;
    k.b2 = beta2;
    k.c2 = 1.0 - beta2;
    k.bc2_sqrt = sqrt(bias_correction2);
    k.eps = eps;
    k.neg_step = -(lr / bias_correction1);
    unsigned int g = tt_cuda_blocks(n);
    switch (grad_dtype) {
      case TT_F32: tt_adamw_f64_kernel<TT_F32><<<g, TT_CUDA_THREADS, 0, s>>>(k, n, (double *)param, (const float *)grad, m, v); break;
      case TT_F64: tt_adamw_f64_kernel<TT_F64><<<g, TT_CUDA_THREADS, 0, s>>>(k, n, (double *)param, (const double *)grad, m, v); break;
      case TT_BF16: tt_adamw_f64_kernel<TT_BF16><<<g, TT_CUDA_THREADS, 0, s>>>(k, n, (double *)param, (const uint16_t *)grad, m, v); break;
      default: tt_adamw_f64_kernel<TT_F16><<<g, TT_CUDA_THREADS, 0, s>>>(k, n, (double *)param, (const uint16_t *)grad, m, v); break;
    }
    TT_CUDA_CHECK_LAUNCH("tt_adamw_f64_kernel");
    return TT_OK;
  }

  tt_adam_f32 k = tt_adam_scalars(lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2);
  bool vec = tt_adam_vec_ok(param_dtype, grad_dtype, param, grad, m, v, master);
  switch (param_dtype) {
    case TT_F32: tt_adamw_f32_by_grad<TT_F32>(grad_dtype, k, n, vec, param, grad, m, v, master, s); break;
    case TT_BF16: tt_adamw_f32_by_grad<TT_BF16>(grad_dtype, k, n, vec, param, grad, m, v, master, s); break;
    case TT_F16: tt_adamw_f32_by_grad<TT_F16>(grad_dtype, k, n, vec, param, grad, m, v, master, s); break;
    default: tt_adamw_f32_by_grad<TT_F64>(grad_dtype, k, n, vec, param, grad, m, v, master, s); break;
  }
  TT_CUDA_CHECK_LAUNCH("tt_adamw_f32_kernel");
  return TT_OK;
}

template <int PDT, bool DEV>
static void tt_adamw_mt_by_grad(int grad_dtype, unsigned int grid, const tt_adam_f32 &k, const tt_adam_mt_args &a,
                                cudaStream_t s) {
  switch (grad_dtype) {
    case TT_F32: tt_adamw_mt_kernel<PDT, TT_F32, DEV><<<grid, TT_CUDA_THREADS, 0, s>>>(k, a); break;
    case TT_F64: tt_adamw_mt_kernel<PDT, TT_F64, DEV><<<grid, TT_CUDA_THREADS, 0, s>>>(k, a); break;
    case TT_BF16: tt_adamw_mt_kernel<PDT, TT_BF16, DEV><<<grid, TT_CUDA_THREADS, 0, s>>>(k, a); break;
    default: tt_adamw_mt_kernel<PDT, TT_F16, DEV><<<grid, TT_CUDA_THREADS, 0, s>>>(k, a); break;
  }
}

/* The launch of k <= TT_ADAMW_MULTI_MAX tensors (empty ones skipped);
 * with scalars (DEV), tensor j reads pairs[2j], pairs[2j + 1]. */
template <bool DEV>
static tt_status tt_adamw_mt_launch(int param_dtype, int grad_dtype, int count, const tt_adamw_tensor *ts,
                                    const tt_adam_f32 &k, double lr, double beta1, double beta2, double eps,
                                    double weight_decay, const float *decay, const float *pairs,
                                    const double *norm_clip) {
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_adam_mt_args a;
  memset(&a, 0, sizeof a);
  a.decay = decay;
  a.pairs = pairs;
  a.norm_clip = norm_clip;
  unsigned int grid = 0;
  for (int i = 0; i < count; i++) {
    if (ts[i].n <= 0) continue;
    tt_adam_mt_tensor &d = a.t[a.count];
    d.param = ts[i].param;
    d.grad = ts[i].grad;
    d.m = ts[i].m;
    d.v = ts[i].v;
    d.master = ts[i].master;
    d.n = ts[i].n;
    d.slot = i;
    if (!DEV) {
      tt_adam_f32 ki = tt_adam_scalars(lr, beta1, beta2, eps, weight_decay, ts[i].bias_correction1,
                                       ts[i].bias_correction2);
      d.neg_step = ki.neg_step;
      d.bc2_sqrt = ki.bc2_sqrt;
    }
    d.vec = tt_adam_vec_ok(param_dtype, grad_dtype, d.param, d.grad, d.m, d.v, d.master);
    a.first_block[a.count] = grid;
    grid += tt_cuda_blocks((d.n + TT_ADAM_UNIT - 1) / TT_ADAM_UNIT);
    a.count++;
  }
  if (a.count == 0) return TT_OK;
  a.first_block[a.count] = grid;
  switch (param_dtype) {
    case TT_F32: tt_adamw_mt_by_grad<TT_F32, DEV>(grad_dtype, grid, k, a, s); break;
    case TT_BF16: tt_adamw_mt_by_grad<TT_BF16, DEV>(grad_dtype, grid, k, a, s); break;
    default: tt_adamw_mt_by_grad<TT_F16, DEV>(grad_dtype, grid, k, a, s); break;
  }
  TT_CUDA_CHECK_LAUNCH("tt_adamw_mt_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_adamw_multi(int param_dtype, int grad_dtype, int count, const tt_adamw_tensor *ts,
                                         double lr, double beta1, double beta2, double eps, double weight_decay) {
  if (!tt_adam_dtype_ok(param_dtype) || !tt_adam_dtype_ok(grad_dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda adamw_multi: param dtype %d, grad dtype %d (expected f32, f64, bf16 or f16)",
                        param_dtype, grad_dtype);
  if (count < 0 || count > TT_ADAMW_MULTI_MAX)
    return tt_error_set(TT_ERR_INVALID, "cuda adamw_multi: %d tensors (at most %d per call)", count, TT_ADAMW_MULTI_MAX);
  /* f64 parameters (reference checks) keep their double scalars and one launch each. */
  if (param_dtype == TT_F64) {
    for (int i = 0; i < count; i++) {
      tt_status st = tt_cuda_adamw(param_dtype, grad_dtype, ts[i].n, ts[i].param, ts[i].grad, ts[i].m, ts[i].v,
                                   ts[i].master, lr, beta1, beta2, eps, weight_decay, ts[i].bias_correction1,
                                   ts[i].bias_correction2);
      if (st != TT_OK) return st;
    }
    return TT_OK;
  }
  tt_adam_f32 k = tt_adam_scalars(lr, beta1, beta2, eps, weight_decay, 1.0, 1.0);
  return tt_adamw_mt_launch<false>(param_dtype, grad_dtype, count, ts, k, lr, beta1, beta2, eps, weight_decay, NULL,
                                   NULL, NULL);
}

extern "C" tt_status tt_cuda_adamw_multi_dev(int param_dtype, int grad_dtype, int count, const tt_adamw_tensor *ts,
                                             double beta1, double beta2, double eps, const float *decay,
                                             const float *pairs, const double *norm_clip) {
  if (param_dtype == TT_F64 || grad_dtype == TT_F64 || !tt_adam_dtype_ok(param_dtype) ||
      !tt_adam_dtype_ok(grad_dtype))
    return tt_error_set(TT_ERR_DTYPE, "cuda adamw_multi_dev: param dtype %d, grad dtype %d (expected f32, bf16 or f16)",
                        param_dtype, grad_dtype);
  if (count < 0 || count > TT_ADAMW_MULTI_MAX)
    return tt_error_set(TT_ERR_INVALID, "cuda adamw_multi_dev: %d tensors (at most %d per call)", count,
                        TT_ADAMW_MULTI_MAX);
  /* lr = 1, bias corrections = 1: placeholders for what the kernel reads */
  tt_adam_f32 k = tt_adam_scalars(1.0, beta1, beta2, eps, 0.0, 1.0, 1.0);
  return tt_adamw_mt_launch<true>(param_dtype, grad_dtype, count, ts, k, 0, beta1, beta2, eps, 0, decay, pairs,
                                  norm_clip);
}
