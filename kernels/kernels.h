/*
 * kernels.h — the backend table every compute backend implements.
 *
 * A backend is a table of function pointers (as in ggml): engine/ops.c
 * validates shapes, dtypes, devices and layout, then calls the table of the
 * tensors' device. Kernels take raw pointers, sizes and strides; they never
 * allocate and they assume valid input. They return TT_OK, or a status for
 * failures only the backend can see (a CUDA launch error, a dtype the
 * backend does not implement). Strides and sizes are in elements.
 *
 * Float kernels handle at least TT_F32 and TT_F64 (f64 exists for gradient
 * checks); the matmul, copy and optimizer entries also take bf16/f16.
 * Statistics (rstd, lse) are f64 for f64 input and f32 otherwise.
 * A NULL entry means "not implemented on this backend" (ops.c reports it).
 */
#ifndef TT_KERNELS_H
#define TT_KERNELS_H

#include "titan.h"

/* Ops whose kernels check their indices on the device (tt_index_fault.op). */
enum {
  TT_FAULT_NONE = 0,
  TT_FAULT_INDEX_SELECT,
  TT_FAULT_INDEX_ADD,
  TT_FAULT_GATHER,
  TT_FAULT_SCATTER_ADD,
  TT_FAULT_EMBEDDING,
  TT_FAULT_EMBEDDING_BACKWARD,
  TT_FAULT_CROSS_ENTROPY,
  TT_FAULT_CROSS_ENTROPY_BACKWARD,
};

/* The first out-of-range index a device's kernels met: index was found at
 * flat `position` of the op's index tensor, outside [0, bound). The CUDA
 * kernels keep one in device memory, with this layout, and claim it with
 * an atomic compare-and-swap on `op`. */
typedef struct tt_index_fault {
  int32_t op; /* TT_FAULT_*; TT_FAULT_NONE: no fault */
  int32_t pad;
  int64_t index, position, bound;
} tt_index_fault;

/* Tensors per call of the foreach entries. */
#define TT_FOREACH_MAX 64

/* One tensor of a multi-tensor AdamW step (adamw_multi). */
#define TT_ADAMW_MULTI_MAX 32

/* gemm's flags */
#define TT_GEMM_TF32 1 /* f32 products may round their inputs to TF32 */
#define TT_GEMM_TUNE 2 /* time candidate algorithms for a new shape */

typedef struct tt_adamw_tensor {
  void *param;
  const void *grad;
  float *m, *v, *master; /* master may be NULL */
  int64_t n;
  double bias_correction1, bias_correction2;
} tt_adamw_tensor;

typedef struct tt_kernels {
  const char *name;

  /* -- device memory (the engine's caching allocator sits above these) -- */
  tt_status (*mem_alloc)(int device, size_t nbytes, void **out);
  void (*mem_free)(int device, void *ptr);
  /* kind: 0 host->device, 1 device->host, 2 device->device */
  tt_status (*mem_copy)(int device, void *dst, const void *src, size_t nbytes, int kind);
  tt_status (*synchronize)(int device);
  /* -- graphs (NULL where the backend has none): capture the kernels the
   *    calling thread queues on the device, then replay them -- */
  tt_status (*graph_begin)(int device);
  /* *graph: an executable graph; *nodes: how many nodes it replays. A
   * capture that failed ends here too (the device leaves capture mode). */
  tt_status (*graph_end)(int device, void **graph, int64_t *nodes);
  tt_status (*graph_launch)(int device, void *graph);
  void (*graph_free)(int device, void *graph);
  /* Indices on a device cannot be read before its kernels run without a
   * wait per op (which CUDA-graph capture forbids), so its index kernels
   * write zeros for (or skip) an index outside its range and record a
   * fault instead. This takes the device's fault (op TT_FAULT_NONE: none)
   * and clears it. Valid right after mem_copy kind 1 or synchronize: the
   * waits the host makes anyway also fetch the record. NULL on backends
   * whose indices the engine checks before the kernel (the CPU). */
  tt_status (*check_errors)(int device, tt_index_fault *fault);

  /* -- pinned host memory and asynchronous device->host copies: the
   *    snapshots of async checkpoints (engine/checkpoint.c; engine/pinned.c
   *    caches the buffers). All five are set or none (the CPU: its
   *    snapshots are a plain copy). -- */
  /* Page-locked host memory that any device can copy into asynchronously. */
  tt_status (*host_alloc)(size_t nbytes, void **out);
  void (*host_free)(void *ptr);
  /* dst (from host_alloc) <- src (device memory) with no host wait, ordered
   * after the work already queued on the device's compute stream; work
   * queued there afterwards runs after the copy, so it may overwrite src.
   * *event: the copy's completion, for event_wait, then event_free. */
  tt_status (*copy_to_host_async)(int device, void *dst, const void *src, size_t nbytes, void **event);
  /* Blocks the calling thread (any thread) until the event has completed. */
  tt_status (*event_wait)(void *event);
  void (*event_free)(void *event);
  /* *event: recorded now on `stream` (tt_stream_kind) of the device, for
   * event_query / event_wait, then event_free. NULL on the CPU. */
  tt_status (*event_record)(int device, int stream, void **event);
  /* 1: the event's work is done; 0: not yet; < 0: the query failed. */
  int (*event_query)(void *event);
  /* The device clock of engine/timer.c (the profiler's marks): *event
   * made with timing, recorded on nothing yet; timer_event_mark records it
   * (again) on the device's compute stream, refused while that stream is
   * captured into a CUDA graph; timer_event_elapsed gives the milliseconds
   * from `start` to `end`, both complete (event_wait on the later first).
   * NULL on the CPU (the host's clock); freed with event_free. */
  tt_status (*timer_event_new)(int device, void **event);
  tt_status (*timer_event_mark)(int device, void *event);
  tt_status (*timer_event_elapsed)(void *start, void *end, float *ms);

  /* -- data movement -- */
  /* dst[idx] = (dst_dtype) src[idx] over an ndim index space. */
  tt_status (*copy)(int ndim, const int64_t *shape, int src_dtype, const void *src, const int64_t *src_strides,
                    int dst_dtype, void *dst, const int64_t *dst_strides);
  tt_status (*fill)(int dtype, int64_t n, double value, void *dst);
  tt_status (*arange)(int dtype, int64_t n, double start, double step, void *dst);
  /* kind 0 uniform(p0, p1), 1 normal(p0, p1), 2 trunc-normal(mean p0, std p1, a p2, b p3). */
  tt_status (*rng)(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1,
                   double p2, double p3, void *dst);

  /* -- elementwise -- */
  /* out = a op b; strides 0 on broadcast dims. */
  tt_status (*binary)(int op, int dtype, int ndim, const int64_t *shape, const void *a, const int64_t *a_strides,
                      const void *b, const int64_t *b_strides, void *out, const int64_t *out_strides);
  /* contiguous; x == y allowed (in place). */
  tt_status (*unary)(int op, int dtype, int64_t n, double alpha, const void *x, void *y);
  /* dx = dy * f'(x); y = f(x) may be NULL. contiguous. */
  tt_status (*unary_backward)(int op, int dtype, int64_t n, double alpha, const void *x, const void *y,
                              const void *dy, void *dx);
  /* y += alpha * x, contiguous. */
  tt_status (*axpy)(int dtype, int64_t n, double alpha, const void *x, void *y);
  /* k <= TT_FOREACH_MAX contiguous tensors of one dtype in one go: x *= alpha
   * (the bits of unary TT_SCALE), or x = alpha when set. NULL: the engine
   * calls unary / fill per tensor. */
  tt_status (*foreach_scale)(int dtype, int k, void *const *xs, const int64_t *ns, double alpha, int set);

  /* -- reductions over the middle dim of a contiguous [outer, n, inner] -- */
  /* y: [outer, inner]; idx (i64, TT_RMAX only) may be NULL. */
  tt_status (*reduce)(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                      int64_t *idx);
  /* out (contiguous, out_ndim == ndim, size 1 on reduced dims) = sum of x
   * (contiguous, `shape`) over the dims where out_shape is 1 and shape is not. */
  tt_status (*sum_to)(int dtype, int ndim, const int64_t *shape, const void *x, const int64_t *out_shape, void *out);
  /* rows of length n, contiguous. */
  tt_status (*softmax)(int dtype, int64_t rows, int64_t n, int log, const void *x, void *y);
  tt_status (*softmax_backward)(int dtype, int64_t rows, int64_t n, int log, const void *y, const void *dy,
                                void *dx);
  /* sum of squares of n elements accumulated in f64, fixed order. */
  tt_status (*sumsq)(int dtype, int64_t n, const void *x, double *out);
  /* out[i] = sumsq of tensor i (contiguous), each as sumsq computes it, with
   * one wait for all (NULL: the engine calls sumsq per tensor). */
  tt_status (*sumsq_many)(int k, const int *dtypes, const int64_t *ns, const void *const *xs, double *out);
  /* The same sums with no read-back: out (2 doubles of device memory) =
   * {sqrt of their sum in tensor order, clip coefficient}, as
   * tt_op_global_norm_dev defines them; with count_nonfinite, out[2] is
   * also incremented when the norm is NaN or inf. NULL: the engine
   * computes them on the host (the CPU, whose device memory is host memory). */
  tt_status (*global_norm_dev)(int k, const int *dtypes, const int64_t *ns, const void *const *xs, double max_norm,
                               double *out, int count_nonfinite);

  /* -- matmul: C[i] = alpha * op(A[i]) @ op(B[i]) + beta * C[i] + bias,
   *    row-major, i < batch, stride_* = 0 broadcasts an operand. dtype
   *    f32/f64 on the CPU (ops.c converts bf16/f16), plus bf16/f16 on CUDA.
   *    bias: NULL, or n packed elements added to every row of every C[i]
   *    (a linear layer's bias, fused into the GEMM), 16-byte aligned, of
   *    bias_dtype = dtype (ops.c converts the bias to the GEMM's dtype
   *    first; a backend may reject any other bias_dtype).
   *    flags: TT_GEMM_TF32, f32 products may round their inputs to TF32;
   *    TT_GEMM_TUNE, the backend may time candidate algorithms for a new
   *    shape (where it has them; the CPU computes exactly whatever the
   *    flags). -- */
  tt_status (*gemm)(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                    double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                    int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c, const void *bias,
                    int bias_dtype, int flags);

  /* -- float8 (tt_op_to_float8, tt_op_matmul_float8). to_float8: x of
   *    f32/bf16/f16 -> y fp8 (fp8_dtype) = clamp(x * s) with s = fmax /
   *    max(amax, 1e-12) in f32, amax = *amax_in when given (a max over
   *    several ranks' shards: tensor parallelism) else max |x|; *scale_inv
   *    (device memory, also the kernels' scratch) = 1 / s. float8_amax:
   *    *out = max |x| (device f32; a NaN wins). gemm_float8: C[m, n] = *sa * *sb *
   *    A[m, k] @ B[n, k]^T + beta * C, A and B row-major fp8 (not both
   *    e5m2), sa and sb device f32, C of c_dtype (f32, bf16, f16); fast_accum
   *    lets the tensor cores skip periodic f32 promotion. NULL: the engine
   *    widens the operands to f32 and runs gemm (the CPU). -- */
  tt_status (*to_float8)(int dtype, int64_t n, const void *x, int fp8_dtype, void *y, float *scale_inv,
                         const float *amax_in);
  tt_status (*float8_amax)(int dtype, int64_t n, const void *x, float *out);
  tt_status (*gemm_float8)(int a_dtype, int b_dtype, int c_dtype, int64_t m, int64_t n, int64_t k, const void *a,
                           const void *b, const float *sa, const float *sb, double beta, void *c, int fast_accum);

  /* -- indexing; src/dst viewed as contiguous [outer, n, inner], idx i64.
   *    The engine checks CPU indices before the call; a backend without
   *    that check (check_errors != NULL) reads an index outside [0, n) as
   *    zeros, skips it in the adds and records it. The same holds for the
   *    ids of embedding and the targets of cross_entropy (ignore_index
   *    aside). -- */
  tt_status (*index_select)(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                            const int64_t *idx, void *out);
  /* dst[:, idx[j], :] += src[:, j, :], deterministic. */
  tt_status (*index_add)(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                         const int64_t *idx, const void *src);
  /* out[o, j, i] = src[o, idx[o, j, i], i]; idx and out are [outer, n_idx, inner]. */
  tt_status (*gather)(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                      const int64_t *idx, void *out);
  /* dst[o, idx[o, j, i], i] += src[o, j, i], deterministic. */
  tt_status (*scatter_add)(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                           const int64_t *idx, const void *src);

  /* -- nn primitives, all contiguous -- */
  /* vocab: the rows of weight, the bound of ids. */
  tt_status (*embedding)(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *weight, const int64_t *ids,
                         void *out);
  /* dweight[ids[i], :] += dy[i, :], deterministic (no float atomics). */
  tt_status (*embedding_backward)(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *dy,
                                  const int64_t *ids, void *dweight);
  tt_status (*rmsnorm)(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *w, void *y,
                       void *rstd);
  /* h = x + res (rounded to dtype), then y = rmsnorm(h): the residual add
   * fused into the norm's first pass. */
  tt_status (*add_rmsnorm)(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                           const void *w, void *h, void *y, void *rstd);
  /* dw (may be NULL) accumulates; dx is written, or accumulated onto when
   * dx_accumulate (a gradient already waiting for x). */
  tt_status (*rmsnorm_backward)(int dtype, int64_t rows, int64_t dim, const void *x, const void *w,
                                const void *rstd, const void *dy, void *dx, void *dw, int dx_accumulate);
  /* cos/sin: [max_seq, head_dim/2] of `dtype` (f32 or f64). */
  tt_status (*rope_table)(int dtype, int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                          double low_freq_factor, double high_freq_factor, int64_t original_max_seq, void *cos,
                          void *sin);
  /* x, y: [B, T, H, D]; y == x allowed. position of row t is pos_offset + t.
   * cos/sin are f64 for f64 x and f32 otherwise (bf16/f16 x rotate in f32). */
  tt_status (*rope)(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, const void *x, const void *cos,
                    const void *sin, int64_t pos_offset, int inverse, void *y);
  /* q [B,T,Hq,D], k/v [B,S,Hkv,D], o [B,T,Hq,D], lse [B,Hq,T]. */
  tt_status (*attention)(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                         int causal, double scale, const void *q, const void *k, const void *v, void *o, void *lse);
  /* dq, dk, dv are written (not accumulated). */
  tt_status (*attention_backward)(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                  int causal, double scale, const void *q, const void *k, const void *v,
                                  const void *o, const void *lse, const void *dout, void *dq, void *dk, void *dv);
  /* out [B, Tb, H, D] of `dtype`, lse [B, H, Tb] folded into rows t0.. of
   * acc [B, T, H, D] and acc_lse [B, H, T] (f64 for f64, else f32): see
   * tt_op_attention_merge. */
  tt_status (*attention_merge)(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                               void *acc, void *acc_lse, const void *out, const void *lse);
  tt_status (*swiglu)(int dtype, int64_t n, const void *a, const void *b, void *y);
  tt_status (*swiglu_backward)(int dtype, int64_t n, const void *a, const void *b, const void *dy, void *da,
                               void *db);
  /* logits [N, V]; targets i64 [N]; losses, lse [N]. */
  tt_status (*cross_entropy)(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                             int64_t ignore_index, void *losses, void *lse);
  tt_status (*cross_entropy_backward)(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                                      const void *lse, const void *dlosses, int64_t ignore_index, void *dlogits);
  /* *count (one i64 in device memory) = targets != ignore_index among N.
   * NULL on the CPU, where the engine counts while it checks the targets. */
  tt_status (*count_valid)(int64_t N, const int64_t *targets, int64_t ignore_index, int64_t *count);

  /* -- optimizer -- */
  /* adamw over k <= TT_ADAMW_MULTI_MAX tensors of the same dtypes in one
   * go, each with its own bias corrections; the same bits as k adamw calls.
   * NULL: the engine calls adamw per tensor. */
  tt_status (*adamw_multi)(int param_dtype, int grad_dtype, int k, const tt_adamw_tensor *ts, double lr, double beta1,
                           double beta2, double eps, double weight_decay);
  /* adamw_multi with the scalars in device memory, read when the kernels
   * run: decay[0] = f32(1 - lr * wd); pairs[2j], pairs[2j + 1] = tensor j's
   * f32(-lr / bc1), f32(sqrt(bc2)). norm_clip: NULL or two doubles, the
   * gradients' norm and clip coefficient (tt_op_global_norm_dev's): each
   * grad is first multiplied by the coefficient in f32 and rounded to
   * grad_dtype; where the norm is not finite nothing is written (the step
   * is skipped where it runs: a NaN or inf gradient never reaches the
   * weights or the moments, with no host wait).
   * f32/bf16/f16 params and grads only. */
  tt_status (*adamw_multi_dev)(int param_dtype, int grad_dtype, int k, const tt_adamw_tensor *ts, double beta1,
                               double beta2, double eps, const float *decay, const float *pairs,
                               const double *norm_clip);
  /* param (param_dtype), grad (grad_dtype), m, v, master: f32 (master may be NULL). */
  tt_status (*adamw)(int param_dtype, int grad_dtype, int64_t n, void *param, const void *grad, float *m, float *v,
                     float *master, double lr, double beta1, double beta2, double eps, double weight_decay,
                     double bias_correction1, double bias_correction2);
} tt_kernels;

/* The backends. cuda is NULL when built without TITAN_CUDA. */
const tt_kernels *tt_kernels_cpu(void);
const tt_kernels *tt_kernels_cuda(void);

#endif /* TT_KERNELS_H */
