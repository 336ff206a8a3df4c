/*
 * titan.h — the one public C API of libtitan.
 *
 * Everything between TT_CDEF_BEGIN and TT_CDEF_END is read by LuaJIT's ffi.cdef
 * as it is (lua/titan/ffi.lua extracts that block), so it holds plain
 * declarations only: no macros, no preprocessor, no inline functions.
 *
 * Conventions: functions return tt_status (TT_OK = 0) and hand results back
 * through pointers; on failure tt_last_error() holds one line naming the op,
 * the shapes and what was expected. Ops that produce a tensor take
 * `tt_tensor **out`: when *out is NULL a new tensor is allocated (the caller
 * owns one reference), otherwise the given tensor is validated and written.
 * Nothing aborts on user error.
 */
#ifndef TITAN_H
#define TITAN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* TT_CDEF_BEGIN */

typedef enum {
  TT_OK = 0,
  TT_ERR_INVALID = 1,     /* bad argument value */
  TT_ERR_SHAPE = 2,       /* shapes do not fit together */
  TT_ERR_DTYPE = 3,       /* dtype not supported by the op or mismatched */
  TT_ERR_DEVICE = 4,      /* tensors on different devices, or device unavailable */
  TT_ERR_OOM = 5,         /* allocation failed */
  TT_ERR_IO = 6,          /* file missing, unreadable or malformed */
  TT_ERR_UNSUPPORTED = 7, /* op not available on this backend/build */
  TT_ERR_INDEX = 8,       /* index out of range */
  TT_ERR_LAYOUT = 9,      /* tensor not contiguous where the kernel needs it */
  TT_ERR_INTERNAL = 10    /* a backend call failed (CUDA error, ...) */
} tt_status;

typedef enum {
  TT_F32 = 0,
  TT_F64 = 1,
  TT_BF16 = 2,
  TT_F16 = 3,
  TT_I32 = 4,
  TT_I64 = 5,
  TT_U8 = 6,
  TT_BOOL = 7,
  TT_F8E4M3 = 8,
  TT_F8E5M2 = 9,
  TT_NUM_DTYPES = 10
} tt_dtype;

typedef enum { TT_CPU = 0, TT_CUDA = 1, TT_META = 2 } tt_device_type;

typedef struct tt_device {
  int32_t type;  /* tt_device_type */
  int32_t index; /* cuda ordinal; 0 for cpu and meta */
} tt_device;

/* Storage is the memory; tensors are strided views of it. Both are
 * reference-counted and freed deterministically when the count reaches 0. */
typedef struct tt_storage {
  int64_t refcount;
  void *data;      /* NULL on the meta device */
  size_t nbytes;
  tt_device device;
} tt_storage;

typedef struct tt_tensor {
  int64_t refcount;
  tt_storage *storage;
  int64_t offset; /* in elements, into storage */
  int32_t dtype;  /* tt_dtype */
  int32_t ndim;   /* 0..8 */
  tt_device device;
  int64_t shape[8];
  int64_t strides[8]; /* in elements */
} tt_tensor;

/* ---- library ---------------------------------------------------------- */
const char *tt_version(void);
const char *tt_last_error(void);
void tt_clear_error(void);
int tt_num_threads(void);
void tt_set_num_threads(int n);
/* "OpenBLAS 0.3.21 core=Cooperlake (chosen by titan: ...)" — loads the BLAS. */
const char *tt_blas_info(void);
int tt_cuda_available(void);
int tt_cuda_device_count(void);

/* ---- dtypes ----------------------------------------------------------- */
size_t tt_dtype_size(int dtype);
const char *tt_dtype_name(int dtype);
int tt_dtype_is_float(int dtype);

/* ---- memory ----------------------------------------------------------- */
typedef struct tt_mem_stats {
  int64_t allocated;      /* bytes handed out and not yet returned */
  int64_t reserved;       /* bytes held from the system (allocated + cached) */
  int64_t peak_allocated; /* high-water mark of allocated since last reset */
  int64_t num_allocs;     /* allocation requests served */
  int64_t num_frees;
  int64_t num_cache_hits; /* requests served from the cache */
  int64_t num_alloc_retries; /* cache flushed and retried after a failure */
  int64_t num_ooms;
} tt_mem_stats;

tt_status tt_memory_stats(tt_device dev, tt_mem_stats *out);
void tt_memory_reset_peak(tt_device dev);
void tt_memory_empty_cache(tt_device dev);
/* Live tensor objects (all devices): a leak detector for tests. */
int64_t tt_tensor_live_count(void);

/* ---- tensors ---------------------------------------------------------- */
tt_status tt_tensor_empty(int ndim, const int64_t *shape, int dtype, tt_device dev, tt_tensor **out);
void tt_tensor_retain(tt_tensor *t);
void tt_tensor_release(tt_tensor *t);
int64_t tt_tensor_numel(const tt_tensor *t);
int tt_tensor_is_contiguous(const tt_tensor *t);
/* Address of element 0 (NULL on meta). */
void *tt_tensor_data(const tt_tensor *t);
/* "[2, 3]" into buf; returns buf. */
const char *tt_tensor_shape_str(const tt_tensor *t, char *buf, size_t len);

tt_status tt_tensor_fill(tt_tensor *t, double value);
tt_status tt_tensor_arange(tt_tensor *t, double start, double step);
/* Copy between any dtypes, devices and strides; shapes must match. */
tt_status tt_tensor_copy(tt_tensor *dst, const tt_tensor *src);
/* Host buffers of doubles <-> tensor (any dtype, any strides): for Lua. */
tt_status tt_tensor_from_f64(tt_tensor *dst, const double *src, int64_t n);
tt_status tt_tensor_to_f64(const tt_tensor *src, double *dst, int64_t n);
/* Raw host bytes in the tensor's own dtype, contiguous order. */
tt_status tt_tensor_from_host(tt_tensor *dst, const void *src, size_t nbytes);
tt_status tt_tensor_to_host(const tt_tensor *src, void *dst, size_t nbytes);
/* Returns t itself (retained) when already contiguous, else a packed copy. */
tt_status tt_tensor_contiguous(const tt_tensor *t, tt_tensor **out);

/* ---- views (share storage) ------------------------------------------- */
/* shape may hold one -1; fails with TT_ERR_LAYOUT when strides forbid a view. */
tt_status tt_view_reshape(const tt_tensor *t, int ndim, const int64_t *shape, tt_tensor **out);
tt_status tt_view_permute(const tt_tensor *t, const int *dims, tt_tensor **out);
tt_status tt_view_transpose(const tt_tensor *t, int d0, int d1, tt_tensor **out);
tt_status tt_view_narrow(const tt_tensor *t, int dim, int64_t start, int64_t length, tt_tensor **out);
tt_status tt_view_expand(const tt_tensor *t, int ndim, const int64_t *shape, tt_tensor **out);

/* ---- random numbers: counter-based (Philox4x32-10) ------------------ */
/* Element i of the (contiguous order of the) tensor draws from counter
 * (offset + i) under key seed, so the numbers do not depend on device,
 * threads or how the tensor is later sharded. */
tt_status tt_rng_uniform(tt_tensor *t, uint64_t seed, uint64_t offset, double low, double high);
tt_status tt_rng_normal(tt_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);
tt_status tt_rng_trunc_normal(tt_tensor *t, uint64_t seed, uint64_t offset, double mean, double std, double a, double b);
/* 64-bit FNV-1a of a string: per-parameter-name RNG keys. */
uint64_t tt_hash_string(const char *s);

/* ---- elementwise ------------------------------------------------------ */
typedef enum {
  TT_ADD = 0, TT_SUB = 1, TT_MUL = 2, TT_DIV = 3, TT_MAXIMUM = 4, TT_MINIMUM = 5
} tt_binary_op;

typedef enum {
  TT_NEG = 0, TT_EXP = 1, TT_LOG = 2, TT_SQRT = 3, TT_RSQRT = 4,
  TT_SILU = 5, TT_GELU = 6, TT_RELU = 7, TT_SCALE = 8, TT_ADD_SCALAR = 9,
  TT_SQUARE = 10, TT_ABS = 11, TT_TANH = 12, TT_SIGMOID = 13, TT_POW_SCALAR = 14,
  TT_RECIPROCAL = 15
} tt_unary_op;

/* out = a op b with numpy broadcasting. */
tt_status tt_op_binary(int op, const tt_tensor *a, const tt_tensor *b, tt_tensor **out);
/* out = f(a; alpha). in place when *out == a. */
tt_status tt_op_unary(int op, const tt_tensor *a, double alpha, tt_tensor **out);
/* dx = dy * f'(x) (y = f(x) may be given for ops that use it). */
tt_status tt_op_unary_backward(int op, const tt_tensor *x, const tt_tensor *y, const tt_tensor *dy,
                               double alpha, tt_tensor **dx);
/* y += alpha * x (same shape): gradient accumulation. */
tt_status tt_op_axpy(tt_tensor *y, double alpha, const tt_tensor *x);
/* Sum a broadcast result back to `shape` (the gradient of broadcasting). */
tt_status tt_op_sum_to(const tt_tensor *a, int ndim, const int64_t *shape, tt_tensor **out);

/* ---- reductions ------------------------------------------------------- */
typedef enum { TT_RSUM = 0, TT_RMEAN = 1, TT_RMAX = 2, TT_RNORM2 = 3 } tt_reduce_op;
/* Reduce over `dim` (negative counts from the end). For TT_RMAX, indices
 * (i64) may be requested. dim = -100 reduces everything into a 0-d tensor. */
tt_status tt_op_reduce(int op, const tt_tensor *a, int dim, int keepdim, tt_tensor **out, tt_tensor **indices);
/* Softmax / log-softmax over the last dim, and their backward. */
tt_status tt_op_softmax(const tt_tensor *x, int log, tt_tensor **out);
tt_status tt_op_softmax_backward(const tt_tensor *y, const tt_tensor *dy, int log, tt_tensor **dx);

/* ---- matmul ----------------------------------------------------------- */
/* out = alpha * op(a) @ op(b) + beta * out. a: [M,K] or [B,M,K] (as stored,
 * before the transpose flag); b likewise; a 2-D operand broadcasts over the
 * batch. beta != 0 needs *out given (accumulation: weight gradients).
 * A transposed view is recognised from its strides: no copy is made. */
tt_status tt_op_matmul(const tt_tensor *a, const tt_tensor *b, int trans_a, int trans_b,
                       double alpha, double beta, tt_tensor **out);

/* ---- indexing --------------------------------------------------------- */
tt_status tt_op_cat(int n, tt_tensor *const *ts, int dim, tt_tensor **out);
/* out = src.index_select(dim, index); index is i32/i64, 1-D. */
tt_status tt_op_index_select(const tt_tensor *src, int dim, const tt_tensor *index, tt_tensor **out);
/* dst.index_add_(dim, index, src) — deterministic (no float atomics). */
tt_status tt_op_index_add(tt_tensor *dst, int dim, const tt_tensor *index, const tt_tensor *src);
/* out[..., j, ...] = src[..., index[..., j, ...], ...] along dim (torch.gather). */
tt_status tt_op_gather(const tt_tensor *src, int dim, const tt_tensor *index, tt_tensor **out);
/* dst.scatter_add_(dim, index, src). */
tt_status tt_op_scatter_add(tt_tensor *dst, int dim, const tt_tensor *index, const tt_tensor *src);

/* ---- neural-network primitives (forward + backward) ------------------ */
/* out[..., :] = weight[ids[...], :]. */
tt_status tt_op_embedding(const tt_tensor *weight, const tt_tensor *ids, tt_tensor **out);
/* dweight += scatter of dy rows by ids (accumulates). */
tt_status tt_op_embedding_backward(const tt_tensor *dy, const tt_tensor *ids, tt_tensor *dweight);

/* y = x * rsqrt(mean(x^2) + eps) * weight over the last dim; rstd [rows]
 * (f32, f64 for f64 input) is kept for the backward. */
tt_status tt_op_rmsnorm(const tt_tensor *x, const tt_tensor *weight, double eps, tt_tensor **y, tt_tensor **rstd);
/* dx written (allocated when NULL); dweight accumulated when non-NULL. */
tt_status tt_op_rmsnorm_backward(const tt_tensor *x, const tt_tensor *weight, const tt_tensor *rstd,
                                 const tt_tensor *dy, tt_tensor **dx, tt_tensor *dweight);

/* cos/sin tables [max_seq, head_dim/2] (f32) for rotary embeddings, with the
 * Llama 3.1 frequency scaling when scale_factor > 1 (else plain RoPE). */
tt_status tt_op_rope_table(int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                           double low_freq_factor, double high_freq_factor, int64_t original_max_seq,
                           int dtype, tt_tensor **cos, tt_tensor **sin);
/* x: [B, T, H, D] contiguous; rotates adjacent pairs (2i, 2i+1) by the
 * angle of position pos_offset + t. inverse = 1 rotates backwards (the
 * gradient). */
tt_status tt_op_rope(const tt_tensor *x, const tt_tensor *cos, const tt_tensor *sin, int64_t pos_offset,
                     int inverse, tt_tensor **out);

/* Scaled dot-product attention. q: [B, T, Hq, D], k and v: [B, S, Hkv, D]
 * with Hq a multiple of Hkv (grouped-query heads). out: [B, T, Hq, D];
 * lse: [B, Hq, T] f32 (f64 for f64 input), log-sum-exp of each row, kept
 * for the backward. Causal aligns the last query with the last key. */
tt_status tt_op_attention(const tt_tensor *q, const tt_tensor *k, const tt_tensor *v, int causal,
                          double scale, tt_tensor **out, tt_tensor **lse);
tt_status tt_op_attention_backward(const tt_tensor *q, const tt_tensor *k, const tt_tensor *v,
                                   const tt_tensor *out, const tt_tensor *lse, const tt_tensor *dout,
                                   int causal, double scale, tt_tensor **dq, tt_tensor **dk, tt_tensor **dv);

/* y = silu(a) * b. */
tt_status tt_op_swiglu(const tt_tensor *a, const tt_tensor *b, tt_tensor **out);
tt_status tt_op_swiglu_backward(const tt_tensor *a, const tt_tensor *b, const tt_tensor *dy,
                                tt_tensor **da, tt_tensor **db);

/* logits [N, V], targets [N] (i32/i64). losses [N] = lse - logit[target]
 * (0 where target == ignore_index); lse [N] f32 (f64 for f64 input).
 * num_valid (may be NULL) receives the count of targets != ignore_index. */
tt_status tt_op_cross_entropy(const tt_tensor *logits, const tt_tensor *targets, int64_t ignore_index,
                              tt_tensor **losses, tt_tensor **lse, int64_t *num_valid);
/* dlogits = dlosses[:,None] * (softmax(logits) - onehot(targets)). */
tt_status tt_op_cross_entropy_backward(const tt_tensor *logits, const tt_tensor *targets, const tt_tensor *lse,
                                       const tt_tensor *dlosses, int64_t ignore_index, tt_tensor **dlogits);

/* ---- optimizer primitives -------------------------------------------- */
/* Fused AdamW step (decoupled weight decay, bias correction for `step`,
 * counted from 1). m, v are f32. When master (f32) is given, the update is
 * applied to it and param receives its rounded copy (bf16 params). */
tt_status tt_op_adamw(tt_tensor *param, const tt_tensor *grad, tt_tensor *m, tt_tensor *v, tt_tensor *master,
                      double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step);
/* sqrt(sum over tensors of sum(x^2)), accumulated in f64 in a fixed order. */
tt_status tt_op_global_norm(int n, tt_tensor *const *ts, double *out);

/* ---- tokenizer (engine/tokenizer.c) ------------------------------------- */
/* TT_SECTION_TOKENIZER */

/* ---- token datasets (engine/dataset.c) ----------------------------------- */
/* TT_SECTION_DATA */

/* TT_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* TITAN_H */
