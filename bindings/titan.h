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
  uint32_t streams; /* 1 << tt_stream_kind of each other stream that used it (tt_tensor_record_stream) */
  uint32_t meta_live;    /* meta: the storage is there (tt_tensor_storage_free takes it away, as on a device) */
  uint32_t meta_counted; /* meta: made while the meta device's accounting was on (dry runs) */
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
/* TF32 for f32 matmuls on CUDA (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded
 * to 10 mantissa bits, f32 accumulation), process-wide; off by default, as
 * PyTorch. The CPU always computes f32 exactly. */
void tt_set_allow_tf32(int on);
int tt_allow_tf32(void);
/* GEMM autotuning on CUDA, process-wide, off by default (as PyTorch's
 * TunableOp): the first GEMM of each shape that overwrites its output times
 * cuBLASLt's best few candidate algorithms and keeps the fastest for that
 * shape. Runs may then pick different algorithms (timing noise), so their
 * bits may differ: deterministic mode (tt_set_deterministic) turns it off.
 * The CPU ignores it. */
void tt_set_gemm_autotune(int on);
int tt_gemm_autotune(void);
/* "OpenBLAS 0.3.21 core=Cooperlake (chosen by titan: ...)" — loads the BLAS. */
const char *tt_blas_info(void);
int tt_cuda_available(void);
int tt_cuda_device_count(void);
/* "CUDA runtime 13.0, driver 13.0, cuBLASLt ..., cuDNN ..., NCCL ..." (the
 * libraries this process loaded); "not built (TITAN_CUDA=OFF)" without CUDA. */
const char *tt_cuda_info(void);
/* Bytes free and in total on a device: the host's MemAvailable and
 * MemTotal for cpu, cudaMemGetInfo for cuda (memory Titan's caching
 * allocator holds counts as used there). TT_ERR_INVALID for meta or a
 * device that is not there. */
tt_status tt_device_memory_info(tt_device dev, int64_t *free_bytes, int64_t *total_bytes);
/* The cuDNN SDPA graph the CUDA backend would build for one attention call,
 * checked without a GPU (docs/cuda.md): the graph is built and finalized,
 * cuDNN's heuristics run for the GPU that `deviceprop_json` describes
 * (cuDNN's CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION; `sm` is its compute
 * capability, 10 major + minor), and each proposed engine config's plan is
 * finalized as far as it goes without a GPU, which is to loading its
 * compiled kernel. *accepted: the configs that got that far (0: cuDNN would
 * not run it, the fallback kernels would); report: which engines, or why
 * not. dtype bf16 or f16. TT_ERR_UNSUPPORTED: a build without CUDA, or a
 * cuDNN before 9.8 (no device properties); TT_ERR_INVALID: JSON cuDNN
 * refuses. Meant to run with the CUDA toolkit's stub libcuda where there is
 * no driver. */
tt_status tt_cuda_attention_graph_check(int backward, int dtype, int causal, int deterministic, int64_t B, int64_t T,
                                        int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int sm,
                                        const char *deviceprop_json, int *accepted, char *report, size_t report_len);
/* Waits for everything queued on dev, then reports (TT_ERR_INDEX, naming the
 * op) and clears the first out-of-range index its kernels met since the
 * last report: GPU kernels record such an index instead of faulting, and
 * device->host copies report it too. TT_OK on cpu and meta. */
tt_status tt_device_synchronize(tt_device dev);
/* Deterministic mode (config debug.deterministic), process-wide, off by
 * default: the same seed gives the same bits on every run of one GPU. The
 * CPU always is; on CUDA it keeps cuDNN attention to engine configs without
 * the NONDETERMINISTIC note (else the deterministic fallback kernel). */
void tt_set_deterministic(int on);
int tt_deterministic(void);

/* ---- device clock: marks timed where the device's work runs ------------ */
/* The profiler's clock (lua/titan/profiler.lua). A mark is recorded on
 * dev's compute stream with no host wait (a CUDA event with timing; the
 * host's monotonic clock on cpu); reading waits for the marks and gives
 * the seconds from mark 0 to each. So a region between two marks is timed
 * as the device ran it, without the syncs that slow a profiled step.
 * Marks are refused while the stream is captured into a CUDA graph
 * (TT_ERR_UNSUPPORTED). The events are made as marks first need them and
 * kept: clear() starts the count again at 0. */
typedef struct tt_timer tt_timer;
tt_status tt_timer_new(tt_device dev, tt_timer **out);
tt_status tt_timer_mark(tt_timer *t);
int64_t tt_timer_count(const tt_timer *t);
/* seconds[i] = time from mark 0 to mark i, i < n <= count (TT_ERR_INVALID past it). */
tt_status tt_timer_read(tt_timer *t, double *seconds, int64_t n);
void tt_timer_clear(tt_timer *t);
void tt_timer_free(tt_timer *t);

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
  int64_t pending; /* freed bytes whose reuse waits for another stream's work (in reserved) */
  int64_t allocated_total; /* bytes handed out since the start, every request counted (what was written) */
} tt_mem_stats;

/* On the meta device (dry runs: no memory) the statistics count what the
 * tensors made while its accounting is on would hold on a device, with the
 * pools' size classes: allocated and its peak (reserved = allocated: nothing
 * is cached). A model declared on meta before it (shapes only) is not
 * counted. tt_memory_meta_accounting(on) returns the previous setting. */
tt_status tt_memory_stats(tt_device dev, tt_mem_stats *out);
int tt_memory_meta_accounting(int on);
void tt_memory_reset_peak(tt_device dev);
void tt_memory_empty_cache(tt_device dev);
/* The pinned (page-locked) host buffers async checkpoints snapshot CUDA
 * tensors into: one cache for the process, kept between checkpoints;
 * empty_cache returns the cached ones to the system. */
tt_status tt_memory_pinned_stats(tt_mem_stats *out);
void tt_memory_pinned_empty_cache(void);
/* Live tensor objects (all devices): a leak detector for tests. */
int64_t tt_tensor_live_count(void);
/* Private memory pools (CUDA graphs, docs/cuda.md). While a pool is active on
 * a thread, that thread's allocations on the pool's device come from it;
 * its blocks return to it when freed and serve only its own later requests;
 * a shared-cache block freed while it is active is adopted by it. Any device
 * (the CPU too). tt_mempool_free releases the cached blocks now and each
 * block still in use when it is freed. The device's statistics include its
 * pools. */
typedef struct tt_mempool tt_mempool;
tt_status tt_mempool_new(tt_device dev, tt_mempool **out);
tt_status tt_mempool_begin(tt_mempool *pool);
void tt_mempool_end(tt_mempool *pool);
void tt_mempool_free(tt_mempool *pool);
tt_status tt_mempool_stats(const tt_mempool *pool, tt_mem_stats *out);

/* CUDA graphs: the kernels the calling thread queues on the device between
 * begin and end are recorded, not run (allocations come from `pool`, which
 * must outlive the graph), then replayed on the same addresses by
 * tt_graph_replay. Work that needs the host to wait for the device (reading
 * a value back, synchronizing, freeing device memory) cannot be captured:
 * end then fails with TT_ERR_UNSUPPORTED and says why. The CPU has no graphs
 * (TT_ERR_UNSUPPORTED). */
typedef struct tt_graph tt_graph;
tt_status tt_graph_capture_begin(tt_device dev, tt_mempool *pool);
tt_status tt_graph_capture_end(tt_device dev, tt_graph **out);
tt_status tt_graph_replay(tt_graph *g);
/* Kernels, copies and other nodes the graph replays. */
int64_t tt_graph_num_nodes(const tt_graph *g);
void tt_graph_free(tt_graph *g);

/* ---- tensors ---------------------------------------------------------- */
tt_status tt_tensor_empty(int ndim, const int64_t *shape, int dtype, tt_device dev, tt_tensor **out);
void tt_tensor_retain(tt_tensor *t);
void tt_tensor_release(tt_tensor *t);
/* A device's streams: kernels run on the compute stream, collectives on the
 * communication stream. */
typedef enum { TT_STREAM_COMPUTE = 0, TT_STREAM_COMM = 1 } tt_stream_kind;
/* The tensor's memory is also used by work queued on another stream of its
 * device that the compute stream does not wait for (as PyTorch's
 * Tensor.record_stream): when the memory is freed, the caching allocator
 * records an event on that stream and reuses the block only once the event
 * has completed. TT_STREAM_COMPUTE and CPU tensors: nothing to do. */
tt_status tt_tensor_record_stream(const tt_tensor *t, int stream);
int64_t tt_tensor_numel(const tt_tensor *t);
int tt_tensor_is_contiguous(const tt_tensor *t);
/* Address of element 0 (NULL on meta, and while the storage is freed). */
void *tt_tensor_data(const tt_tensor *t);
/* Free the memory of t's storage and keep the storage object (shape,
 * views and references stay valid); alloc brings back memory of the same
 * size (uninitialized). For FSDP's reshard/unshard. Ops given a tensor
 * whose storage is freed fail with a message naming it. */
tt_status tt_tensor_storage_free(tt_tensor *t);
tt_status tt_tensor_storage_alloc(tt_tensor *t);
int tt_tensor_has_storage(const tt_tensor *t);
/* TT_OK, or the error that says t's storage is freed (op, name: for the message). */
tt_status tt_tensor_check_storage(const char *op, const char *name, const tt_tensor *t);
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
/* In place over n contiguous float tensors, in few launches on a GPU (up to
 * 64 consecutive tensors of one dtype and device each): x *= alpha (the bits of
 * tt_op_unary TT_SCALE: gradient clipping), or x = value (zeroing
 * gradients). Every tensor is checked before any is written. */
tt_status tt_op_scale_multi(int n, tt_tensor *const *ts, double alpha);
tt_status tt_op_fill_multi(int n, tt_tensor *const *ts, double value);
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
/* out = x @ w^T + bias over the last dim of x (a linear layer; the bias add
 * is fused into the GEMM). x: [..., in] (leading dims folded into rows),
 * w: [out_features, in], bias: [out_features] of any float dtype, or NULL.
 * out: [..., out_features] in x's dtype, written (not accumulated). */
tt_status tt_op_linear(const tt_tensor *x, const tt_tensor *w, const tt_tensor *bias, tt_tensor **out);

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
/* The same with dx += instead of dx = (onto a gradient already waiting for x). */
tt_status tt_op_rmsnorm_backward_acc(const tt_tensor *x, const tt_tensor *weight, const tt_tensor *rstd,
                                     const tt_tensor *dy, tt_tensor *dx, tt_tensor *dweight);
/* The residual add fused into the norm: h = x + residual, y = rmsnorm(h)
 * (bit-identical to the two ops apart); rstd as tt_op_rmsnorm's, of h. */
tt_status tt_op_add_rmsnorm(const tt_tensor *x, const tt_tensor *residual, const tt_tensor *weight, double eps,
                            tt_tensor **h, tt_tensor **y, tt_tensor **rstd);

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
/* Folds one block of attention over some of the keys into a running result
 * (ring attention: context parallelism's keys arrive a rank's chunk at a
 * time). out [B, Tb, Hq, D] and lse [B, Hq, Tb] are tt_op_attention's over
 * that block; they land on rows t0 .. t0 + Tb - 1 of acc [B, T, Hq, D] and
 * acc_lse [B, Hq, T], both f32 (f64 for f64 out), as the attention over the
 * union of the keys: acc = (e^acc_lse acc + e^lse out) / (e^acc_lse + e^lse),
 * acc_lse = log(e^acc_lse + e^lse). A row whose acc_lse is -inf (no keys
 * yet) takes the block's values; one whose lse is -inf is left alone. */
tt_status tt_op_attention_merge(tt_tensor *acc, tt_tensor *acc_lse, const tt_tensor *out, const tt_tensor *lse,
                                int64_t t0);

/* Float8 training (lua/parallel/float8.lua; torchao's Float8Linear with
 * tensorwise dynamic scaling). to_float8: out = x * s in `dtype`
 * (TT_F8E4M3 or TT_F8E5M2), saturated to the format's largest finite value
 * (448 or 57344), with s = fmax / max(max |x|, 1e-12) in f32; scale_inv: a
 * 0-d f32 tensor on x's device, 1 / s, which multiplies the fp8 values back.
 * x: contiguous f32, bf16 or f16. Computed on the device (no host wait).
 * amax: NULL, or a 0-d f32 tensor on x's device that replaces max |x| (the
 * max over every rank's shard of a tensor: tensor parallelism). */
tt_status tt_op_to_float8(const tt_tensor *x, int dtype, const tt_tensor *amax, tt_tensor **out,
                          tt_tensor **scale_inv);
/* out: a 0-d f32 tensor on x's device, max |x| (NaN when x holds one). */
tt_status tt_op_float8_amax(const tt_tensor *x, tt_tensor **out);
/* out [M, N] = a_scale_inv * b_scale_inv * (a @ b^T) (+ out when accumulate):
 * a [M, K] and b [N, K] contiguous fp8 (not both e5m2), the scales
 * to_float8's; out of out_dtype (f32, bf16, f16). On CUDA cuBLASLt's fp8
 * GEMM (K and N multiples of 16; fast_accum: its faster accumulation, which
 * torchao uses for the forward's output); on the CPU the fp8 values widened
 * to f32 and multiplied in f32. */
tt_status tt_op_matmul_float8(const tt_tensor *a, const tt_tensor *b, const tt_tensor *a_scale_inv,
                              const tt_tensor *b_scale_inv, int out_dtype, int accumulate, int fast_accum,
                              tt_tensor **out);

/* y = silu(a) * b. */
tt_status tt_op_swiglu(const tt_tensor *a, const tt_tensor *b, tt_tensor **out);
tt_status tt_op_swiglu_backward(const tt_tensor *a, const tt_tensor *b, const tt_tensor *dy,
                                tt_tensor **da, tt_tensor **db);

/* logits [N, V], targets [N] (i32/i64). losses [N] = lse - logit[target]
 * (0 where target == ignore_index); lse [N] f32 (f64 for f64 input).
 * num_valid (may be NULL) receives the count of targets != ignore_index;
 * for targets on a GPU that count waits for the device, so a caller that
 * knows it (a trainer) passes NULL. */
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
/* tt_op_adamw over n tensors (steps[i] each; masters may be NULL, or hold
 * NULLs), all on one device, with the same bits as n tt_op_adamw calls but
 * few launches: on CUDA one per run of up to 32 tensors of the same dtypes.
 * Every tensor is checked before any is updated. */
tt_status tt_op_adamw_multi(int n, tt_tensor *const *params, tt_tensor *const *grads, tt_tensor *const *exp_avgs,
                            tt_tensor *const *exp_avg_sqs, tt_tensor *const *masters, double lr, double beta1,
                            double beta2, double eps, double weight_decay, const int64_t *steps);
/* sqrt(sum over tensors of sum(x^2)), accumulated in f64 in a fixed order. */
tt_status tt_op_global_norm(int n, tt_tensor *const *ts, double *out);

/* The optimizer step with its per-step numbers in device memory, so that a
 * CUDA graph can capture it once and replay it every step: the learning
 * rate and bias corrections become a small f32 tensor the host rewrites
 * before each replay, and the clip coefficient is computed on the device
 * from the gradient norm. Same bits as the eager step (tt_op_global_norm,
 * tt_op_scale_multi, tt_op_adamw_multi).
 *
 * tt_op_global_norm_dev: out (f64, 2 contiguous elements, on the tensors'
 * one device) receives out[0] = the norm as tt_op_global_norm computes it,
 * out[1] = max_norm / (norm + 1e-6) when norm > max_norm > 0, else 1 (the
 * clip coefficient). With a third element, out[2] is incremented when the
 * norm is NaN or inf: a running count of the steps tt_op_adamw_multi_dev
 * skips, read back whenever the host likes. Nothing is read back. */
tt_status tt_op_global_norm_dev(int n, tt_tensor *const *ts, double max_norm, tt_tensor *out);
/* out[0 .. 2n] (host floats): the step's scalars for tt_op_adamw_multi_dev,
 * exactly as tt_op_adamw_multi rounds them: out[0] = 1 - lr * weight_decay,
 * then per tensor i: out[1 + 2i] = -lr / (1 - beta1^steps[i]),
 * out[2 + 2i] = sqrt(1 - beta2^steps[i]). */
tt_status tt_adamw_scalars(int n, double lr, double beta1, double beta2, double weight_decay, const int64_t *steps,
                           float *out);
/* tt_op_adamw_multi reading lr, weight decay and bias corrections from
 * `scalars` (f32, 1 + 2n contiguous elements on the params' device, as
 * tt_adamw_scalars writes them) when the kernels run. norm_clip: NULL, or
 * tt_op_global_norm_dev's output: each gradient is first multiplied by
 * norm_clip[1] and rounded to its dtype, as tt_op_scale_multi would (the
 * gradients themselves are left as they are); where norm_clip[0] is NaN or
 * inf nothing at all is written (the step skipped on the device, decided
 * there: no host wait). f32, bf16 or f16 params and
 * gradients (f64 ones: use tt_op_adamw_multi). */
tt_status tt_op_adamw_multi_dev(int n, tt_tensor *const *params, tt_tensor *const *grads, tt_tensor *const *exp_avgs,
                                tt_tensor *const *exp_avg_sqs, tt_tensor *const *masters, double beta1,
                                double beta2, double eps, const tt_tensor *scalars, const tt_tensor *norm_clip);

/* ---- tokenizer (engine/tokenizer.c) ------------------------------------- */
/* TT_SECTION_TOKENIZER: byte-level BPE (engine/tokenizer.c, engine/tokenizer_train.c;
 * files are parsed by lua/titan/tokenizer.lua). A tokenizer is immutable once
 * built: any number of threads may encode and decode with it at once. */
typedef struct tt_tokenizer tt_tokenizer;

/* What a tokenizer is built from: flat arrays, as a parser hands them over. */
typedef struct tt_tokenizer_spec {
  const char *source;           /* file name for error messages (NULL or "": none) */
  const char *pattern;          /* pre-tokenizer regex (PCRE2, UTF + UCP); NULL: the Llama 3 pattern */
  int32_t n_tokens;             /* regular tokens; all 256 single bytes must be among them */
  const uint8_t *token_bytes;   /* their bytes, back to back */
  const int32_t *token_lens;    /* [n_tokens] */
  const int32_t *token_ids;     /* [n_tokens] */
  int32_t tiktoken;             /* 1: no merge list; a pair's rank is the id (rank) of its concatenation */
  int32_t n_merges;             /* otherwise: merges, lowest rank first (HF tokenizer.json) */
  const int32_t *merges;        /* [2 * n_merges] (left id, right id) */
  int32_t n_specials;           /* special tokens: decoded, never produced from text */
  const uint8_t *special_bytes;
  const int32_t *special_lens;
  const int32_t *special_ids;
  int32_t bos_id;               /* -1: none */
  int32_t eos_id;               /* -1: none */
  int32_t ignore_merges;        /* 1: a piece that is itself a token is emitted whole (tiktoken, HF ignore_merges) */
} tt_tokenizer_spec;

typedef struct tt_tokenizer_desc {
  int32_t vocab_size;           /* highest id + 1, specials included */
  int32_t n_tokens;
  int32_t n_merges;
  int32_t n_specials;
  int32_t bos_id;
  int32_t eos_id;
  int32_t max_token_len;
  int32_t ignore_merges;
} tt_tokenizer_desc;

tt_status tt_tokenizer_new(const tt_tokenizer_spec *spec, tt_tokenizer **out);
void tt_tokenizer_free(tt_tokenizer *tok);
tt_status tt_tokenizer_describe(const tt_tokenizer *tok, tt_tokenizer_desc *out);
/* The pre-tokenizer regex (tok NULL: the Llama 3 pattern). */
tt_status tt_tokenizer_pattern(const tt_tokenizer *tok, const char **out);
/* Bytes of one token (owned by tok); is_special may be NULL. */
tt_status tt_tokenizer_token(const tt_tokenizer *tok, int32_t id, const uint8_t **bytes, int32_t *len,
                             int32_t *is_special);
/* Merge number `rank` (0 = applied first): (left, right) -> merged. */
tt_status tt_tokenizer_merge(const tt_tokenizer *tok, int32_t rank, int32_t *left, int32_t *right, int32_t *merged);
/* Text (any bytes) -> ids, with <|begin_of_text|> / <|end_of_text|> when bos / eos.
 * Special-token text inside `text` is plain text. *n receives the count;
 * cap = len + 2 always suffices. */
tt_status tt_tokenizer_encode(const tt_tokenizer *tok, const char *text, size_t len, int32_t bos, int32_t eos,
                              int32_t *ids, int64_t cap, int64_t *n);
/* Bytes that decoding ids gives (checks every id). */
tt_status tt_tokenizer_decode_length(const tt_tokenizer *tok, const int32_t *ids, int64_t n, size_t *len);
tt_status tt_tokenizer_decode(const tt_tokenizer *tok, const int32_t *ids, int64_t n, char *out, size_t cap,
                              size_t *len);
/* Pre-tokenizer pieces: ends[i] is the byte offset where piece i ends. */
tt_status tt_tokenizer_split(const tt_tokenizer *tok, const char *text, size_t len, int64_t *ends, int64_t cap,
                             int64_t *n);

/* Trainer: add text, then merge in steps (progress between them), then finish. */
typedef struct tt_tokenizer_trainer tt_tokenizer_trainer;
typedef struct tt_tokenizer_train_stats {
  int64_t bytes;                /* text added */
  int64_t pieces;               /* pre-tokenizer pieces in it */
  int64_t unique_pieces;
  int64_t pairs;                /* distinct adjacent pairs seen (once merging started) */
  int32_t merges;               /* merges done */
  int32_t tokens;               /* distinct tokens: 256 bytes + new ones (a merge may remake a known token) */
  int64_t last_count;           /* occurrences of the last merged pair */
} tt_tokenizer_train_stats;

/* pattern NULL: the Llama 3 pattern. */
tt_status tt_tokenizer_trainer_new(const char *pattern, tt_tokenizer_trainer **out);
void tt_tokenizer_trainer_free(tt_tokenizer_trainer *tr);
tt_status tt_tokenizer_trainer_add(tt_tokenizer_trainer *tr, const char *text, size_t len);
/* Up to max_merges more merges (fewer when no pair is left): the most
 * frequent pair first, ties to the smaller (left id, right id). */
tt_status tt_tokenizer_trainer_merge(tt_tokenizer_trainer *tr, int32_t max_merges, int32_t *done);
tt_status tt_tokenizer_trainer_stats(const tt_tokenizer_trainer *tr, tt_tokenizer_train_stats *out);
/* The trained tokenizer: ids 0..255 are the bytes, then the new tokens in
 * merge order, then the specials; bos_special / eos_special index them (-1: none). */
tt_status tt_tokenizer_trainer_finish(const tt_tokenizer_trainer *tr, int32_t n_specials, const uint8_t *special_bytes,
                                      const int32_t *special_lens, int32_t bos_special, int32_t eos_special,
                                      tt_tokenizer **out);

/* ---- token datasets (engine/dataset.c) ----------------------------------- */
/* Binary token files (docs/data.md): a 64-byte little-endian header
 * ("TTOKENS1", version 1, token width, counts, vocab) then uint16/uint32
 * tokens. Written to "<path>.tmp.<pid>" and renamed into place by finish. */
typedef struct tt_tokens tt_tokens;
typedef struct tt_tokens_writer tt_tokens_writer;

typedef struct tt_tokens_header {
  uint32_t version;      /* 1 */
  uint32_t token_bytes;  /* 2 (uint16) or 4 (uint32) */
  uint64_t num_tokens;
  uint64_t num_docs;
  uint32_t vocab_size;
  uint32_t header_bytes; /* 64 */
} tt_tokens_header;

/* token_bytes 0 picks 2 when vocab_size <= 65536, else 4. */
tt_status tt_tokens_writer_open(const char *path, uint32_t vocab_size, uint32_t token_bytes, tt_tokens_writer **out);
/* Appends n tokens (each checked to be in [0, vocab_size)) that complete
 * num_docs documents. */
tt_status tt_tokens_writer_append(tt_tokens_writer *w, const int32_t *tokens, int64_t n, int64_t num_docs);
/* The temporary file the bytes go to until finish. */
const char *tt_tokens_writer_temp_path(const tt_tokens_writer *w);
/* Writes the header, fsyncs, renames into place; frees w (also on failure,
 * when the temporary file is removed). */
tt_status tt_tokens_writer_finish(tt_tokens_writer *w);
/* Removes the temporary file and frees w. */
void tt_tokens_writer_abort(tt_tokens_writer *w);

/* Maps the file; fails (TT_ERR_IO) on a bad magic, version or width, or a
 * size other than header + num_tokens * token_bytes. */
tt_status tt_tokens_open(const char *path, tt_tokens **out);
void tt_tokens_close(tt_tokens *t);
int64_t tt_tokens_len(const tt_tokens *t);
tt_status tt_tokens_describe(const tt_tokens *t, tt_tokens_header *out);
/* Tokens [start, start + len) into dst as int32 or int64 (dtype TT_I32/TT_I64). */
tt_status tt_tokens_read(const tt_tokens *t, int64_t start, int64_t len, int dtype, void *dst);
/* The same into a contiguous cpu i32/i64 tensor, from element dst_offset. */
tt_status tt_tokens_read_tensor(const tt_tokens *t, int64_t start, int64_t len, tt_tensor *dst, int64_t dst_offset);

/* ---- checkpoints (engine/checkpoint.c, engine/safetensors.c) ---- */
/* TT_SECTION_CHECKPOINT: the byte side of checkpoints (docs/checkpoint_format.md);
 * the decisions (chunks, boxes, metadata) are Lua's: lua/titan/checkpoint/. */

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of n bytes,
 * continuing from crc (0 to start): tt_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t tt_crc32c(uint32_t crc, const void *data, size_t n);

/* One rank's data file: a 64-byte header ("TITANCKP", version, rank, chunk
 * count, file size), then each queued tensor packed at a 64-byte aligned
 * offset. The file is created with O_EXCL (never replaces one) and fsync'ed. */
typedef struct tt_ckpt_writer tt_ckpt_writer;
tt_status tt_ckpt_writer_open(const char *path, int rank, tt_ckpt_writer **out);
/* Queue t's elements (contiguous order) stored as dtype (-1: t's own).
 * snapshot = 1 copies them into host memory now, so t may change as soon as
 * this returns (async saves): a CUDA tensor without a host wait, into pinned
 * memory on a copy stream that later kernels of the compute stream wait for
 * (the writer waits for the copy before it writes); else t is retained and
 * read when written. *offset, *nbytes: where the bytes will lie in the file. */
tt_status tt_ckpt_writer_add(tt_ckpt_writer *w, tt_tensor *t, int dtype, int snapshot, uint64_t *offset,
                             uint64_t *nbytes);
/* Write everything: now (async = 0), or on a POSIX thread (async = 1). */
tt_status tt_ckpt_writer_start(tt_ckpt_writer *w, int async);
/* 1 once the write has finished (or failed), 0 while it runs. */
int tt_ckpt_writer_done(tt_ckpt_writer *w);
/* Joins the thread; the write's status (its message in tt_last_error). */
tt_status tt_ckpt_writer_wait(tt_ckpt_writer *w);
/* After a successful wait: CRC-32C of item i's bytes; the file's size. */
uint32_t tt_ckpt_writer_crc(const tt_ckpt_writer *w, int64_t i);
uint64_t tt_ckpt_writer_size(const tt_ckpt_writer *w);
/* Joins a running thread first; releases what is still queued. */
void tt_ckpt_writer_free(tt_ckpt_writer *w);
/* A data file's header fields and its size on disk (fails on a bad magic
 * or a file shorter than the header). */
tt_status tt_ckpt_file_header(const char *path, uint32_t *version, uint32_t *rank, uint64_t *nchunks,
                              uint64_t *size_field, uint64_t *actual_size);

/* Copy the box [start, start + count) of a stored chunk (a packed row-major
 * array of `shape` in `dtype` at byte `offset` of `path`) into the box at
 * dst_start of dst (any dtype, strides, device): pread of the overlapping
 * byte ranges (one read of the span when dense, one per contiguous run when
 * sparse), converted on the way. verify = 1 (whole chunk only) checks the
 * bytes against crc. `what` (the tensor's name) goes into error messages. */
tt_status tt_ckpt_read(const char *path, uint64_t offset, int dtype, int ndim, const int64_t *shape,
                       const int64_t *start, const int64_t *count, tt_tensor *dst, const int64_t *dst_start,
                       int verify, uint32_t crc, const char *what);
/* CRC-32C of bytes [offset, offset + nbytes) of path against crc (streamed). */
tt_status tt_ckpt_verify(const char *path, uint64_t offset, uint64_t nbytes, uint32_t crc, const char *what);
/* tt_ckpt_verify that also counts the NaN and inf elements of the bytes as
 * `dtype` (a float dtype; any other counts none) into *nonfinite. */
tt_status tt_ckpt_verify_values(const char *path, uint64_t offset, uint64_t nbytes, uint32_t crc, int dtype,
                                int64_t *nonfinite, const char *what);

/* safetensors: writes the 8-byte little-endian length, the JSON header
 * (padded with spaces to 8 bytes) and the tensors' packed bytes in order
 * (O_EXCL, fsync'ed). header must list them with matching data_offsets. */
tt_status tt_safetensors_write(const char *path, const char *header, size_t header_len, int n,
                               tt_tensor *const *ts);
/* The JSON header (buf = NULL: only *len); data starts at *data_start. */
tt_status tt_safetensors_header(const char *path, char *buf, size_t cap, size_t *len, uint64_t *data_start);

/* File-system steps of a crash-safe commit. */
tt_status tt_fs_mkdirs(const char *path);
/* Creates path (O_EXCL), writes n bytes, fsyncs. */
tt_status tt_fs_write_file(const char *path, const void *data, size_t n);
tt_status tt_fs_sync_dir(const char *path);
/* Takes an exclusive advisory lock (flock) on path, created if missing, and
 * writes `note` into it (who holds it); *fd_out keeps it until
 * tt_fs_unlock or the process ends. Held by another open file: TT_ERR_IO,
 * and the holder's note in holder (cap bytes, NUL-terminated). */
tt_status tt_fs_lock(const char *path, const char *note, int *fd_out, char *holder, size_t cap);
void tt_fs_unlock(int fd);
/* Appends n bytes to path (created if missing) or none: a write that fails
 * part-way (a full disk) is cut back to the file's earlier size. */
tt_status tt_fs_append(const char *path, const void *data, size_t n);
/* exchange = 0: rename, failing when `to` exists; 1: swap the two atomically. */
tt_status tt_fs_rename(const char *from, const char *to, int exchange);
tt_status tt_fs_remove_all(const char *path);
/* Names in dir, each followed by '\n' (*len: bytes needed, without the NUL). */
tt_status tt_fs_list(const char *dir, char *buf, size_t cap, size_t *len);
/* Size in bytes; -1 when missing, -2 for a folder. */
int64_t tt_fs_size(const char *path);
int64_t tt_process_id(void);

/* SIGTERM/SIGINT set a flag (a second one while it is pending kills as
 * usual); the trainer polls it at step boundaries, saves and stops. */
tt_status tt_signal_install(void);
/* The pending signal's number, 0 when none. */
int tt_signal_pending(void);
void tt_signal_clear(void);

/* ---- collectives (engine/dist.c, engine/dist_nccl.c) ---------------------- */
/* A process group over `world` ranks with a backend: "fake" (this process
 * pretends to be rank r of N: collectives keep shapes right and copy local
 * data — dry runs, memory estimates, the REPL; exact at world 1), "mpi"
 * (CPU tensors across processes; rank and world must be MPI_COMM_WORLD's;
 * MPI is initialized by the first such group) or "nccl" (CUDA tensors;
 * NCCL's unique id travels through the launcher, e.g. MPI). NCCL
 * collectives run on the device's communication stream, fenced by events
 * against its compute stream. Shapes: all_gather/reduce_scatter concatenate
 * or split rank chunks along dim 0. */
typedef struct tt_group tt_group;
typedef enum { TT_RED_SUM = 0, TT_RED_AVG = 1, TT_RED_MAX = 2, TT_RED_MIN = 3 } tt_reduce_kind;
/* The MPI library's version line ("Open MPI v4.1.4"), or why there is none. */
const char *tt_dist_mpi_info(void);
/* 1 when this build has the backend ("fake", "mpi", "nccl"), else 0. */
int tt_dist_backend_built(const char *name);
/* NCCL's unique id (128 bytes) for rank 0 to share; TT_ERR_UNSUPPORTED without NCCL. */
tt_status tt_dist_unique_id(uint8_t *out, size_t cap, size_t *len);
tt_status tt_group_new(const char *backend, int rank, int world, const uint8_t *unique_id, size_t id_len,
                       int device, tt_group **out);
void tt_group_free(tt_group *g);
int tt_group_rank(const tt_group *g);
int tt_group_size(const tt_group *g);
const char *tt_group_backend(const tt_group *g);
/* What this rank handed to g's collectives since g was made (or reset), by
 * kind: calls and payload bytes. The payload is the tensor this rank puts
 * in: all_reduce and broadcast its tensor, reduce_scatter its input (the
 * whole), all_gather its output (the whole), all_to_all its input, a send
 * what it sends, a receive what it receives (async and batched calls
 * alike). Dry runs on the fake backend count the same as real runs. */
typedef enum {
  TT_COLL_ALL_REDUCE = 0, TT_COLL_REDUCE_SCATTER = 1, TT_COLL_ALL_GATHER = 2, TT_COLL_BROADCAST = 3,
  TT_COLL_ALL_TO_ALL = 4, TT_COLL_SEND = 5, TT_COLL_RECV = 6, TT_COLL_KINDS = 7
} tt_coll_kind;
tt_status tt_group_traffic(const tt_group *g, int64_t *calls, int64_t *bytes, int n);
/* While on, the fake backend's collectives do no arithmetic (a sum is this
 * rank's values): titan estimate's dry runs. Returns the previous setting. */
int tt_dist_fake_dry(int on);
void tt_group_traffic_reset(tt_group *g);
/* The name the watchdog's messages and trace give the group (e.g. "tp
 * [4,5]"); copied, at most 95 bytes. */
void tt_group_set_label(tt_group *g, const char *label);

/* The collectives watchdog (engine/watchdog.c): once started, every blocking
 * call of a group (a collective, send, receive, barrier, wait) is recorded
 * in a ring of the last `capacity` calls; one that waits longer than
 * init_timeout_s (until tt_watchdog_training) or train_timeout_s (after; 0:
 * never) writes the ring to trace_path (JSON lines), prints one line naming
 * the call and its group, and exits the process with code 124. Starting
 * again changes the settings. */
tt_status tt_watchdog_start(int rank, int world, double init_timeout_s, double train_timeout_s, int capacity,
                            const char *trace_path);
void tt_watchdog_training(void);
/* The ring as it is now, to path. */
tt_status tt_watchdog_dump(const char *path);
/* Ranks with the same color form a new group, ordered by key (as MPI_Comm_split). */
tt_status tt_group_split(tt_group *g, int color, int key, tt_group **out);
tt_status tt_dist_all_reduce(tt_group *g, tt_tensor *t, int op);
tt_status tt_dist_reduce_scatter(tt_group *g, const tt_tensor *in, tt_tensor *out, int op);
tt_status tt_dist_all_gather(tt_group *g, const tt_tensor *in, tt_tensor *out);
tt_status tt_dist_broadcast(tt_group *g, tt_tensor *t, int root);
tt_status tt_dist_all_to_all(tt_group *g, const tt_tensor *in, tt_tensor *out);
/* Point to point. tag (0 <= tag < 2^20) tells apart messages between the same
 * two ranks that a receiver may take in another order than they were sent
 * (mpi; nccl matches in order and ignores it). */
tt_status tt_dist_send(tt_group *g, const tt_tensor *t, int peer, int tag);
tt_status tt_dist_recv(tt_group *g, tt_tensor *t, int peer, int tag);
tt_status tt_dist_barrier(tt_group *g);
/* A send that returns at once, for pipeline schedules: two neighbouring
 * stages may both be sending (an activation one way, a gradient the other)
 * and blocking sends would wait on each other. The work keeps a reference
 * to t; t's values must not change until tt_work_wait, which waits for the
 * send to complete and frees the work (also when it fails); a group freed
 * while works are pending is freed by the last wait. Backends
 * without a nonblocking send (nccl: already ordered on its stream) send at
 * once and their wait returns. */
typedef struct tt_work tt_work;
tt_status tt_dist_isend(tt_group *g, const tt_tensor *t, int peer, int tag, tt_work **out);
tt_status tt_work_wait(tt_work *w);
/* An all-reduce in place that later work does not wait for, so that it can
 * overlap computation (DDP's buckets during the backward): on nccl it runs
 * on the communication stream after the compute stream's work that
 * produced t, and tt_work_wait makes the compute stream's later work wait
 * for it (no host wait). t must be neither read nor written until then; the
 * work keeps a reference to it. Backends without it (mpi) reduce at once
 * and their wait returns. */
tt_status tt_dist_all_reduce_async(tt_group *g, tt_tensor *t, int op, tt_work **out);
/* A reduce-scatter and an all-gather started as tt_dist_all_reduce_async
 * (FSDP's overlap: a block's gradients reduced while the GPU computes the
 * blocks before it, the next block's parameters gathered while it computes
 * this one): neither in nor out may be touched until tt_work_wait, after
 * which the compute stream's work sees out; the work keeps references to
 * both. Backends without them (mpi) run the collective at once. */
tt_status tt_dist_reduce_scatter_async(tt_group *g, const tt_tensor *in, tt_tensor *out, int op, tt_work **w);
tt_status tt_dist_all_gather_async(tt_group *g, const tt_tensor *in, tt_tensor *out, tt_work **w);
/* n point-to-point operations that progress together, as
 * torch.distributed.batch_isend_irecv: op i sends ts[i] to peers[i] when
 * is_send[i], else receives into it, with tags[i]. On nccl they are one
 * ncclGroupStart/End on the communication stream (a lone send there waits
 * for its receiver, so two ranks sending to each other need this); on mpi,
 * nonblocking sends, the receives, then the sends' completion. Returns when
 * the receives' values are there (nccl: for the compute stream's later work)
 * and the sends' tensors may change. */
tt_status tt_dist_batch_p2p(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                            const int *tags);
/* tt_dist_batch_p2p started and not waited for (pipeline schedules on nccl:
 * a rank posts the receives of messages it needs several steps later, and
 * its next computation must not wait for them). The work keeps references
 * to every ts[i]; a sent tensor must not change and a received one must not
 * be read until tt_work_wait, which on nccl makes the compute stream's
 * later work wait for the whole batch (no host wait). Backends without it
 * (mpi) run tt_dist_batch_p2p at once and their wait returns. */
tt_status tt_dist_batch_p2p_async(tt_group *g, int n, const int *is_send, tt_tensor *const *ts, const int *peers,
                                  const int *tags, tt_work **out);
/* On the way out of a process: finalizes MPI if a group started it and
 * the run succeeded (a failed rank exits without it, so the launcher stops
 * the job rather than wait for it). A no-op otherwise. */
void tt_dist_shutdown(int failed);

/* ---- the simulator (engine/sim.c): N ranks of one job in this process ---- */
/* fn(rank, world, arg) runs for every rank in [0, world), each on a stack of
 * its own, cooperatively and in a fixed order: a rank runs until it waits in
 * a collective of the "local" backend (or returns), then the next one runs.
 * So a job's ranks share one process and its cores, one rank at a time, and
 * the interleaving is the same in every run. Returns TT_OK when every rank
 * returned 0. A rank returning non-zero stops the run at once (as a launcher
 * stops a job whose process failed): *failed_rank is that rank and the
 * status TT_ERR_INVALID; when every rank left waits on another (a deadlock,
 * a rank that finished while others wait for it) the status is
 * TT_ERR_INTERNAL, *failed_rank -1, and tt_last_error lists what each rank
 * waits for. Not reentrant: one simulation at a time per process. */
typedef int (*tt_sim_fn)(int rank, int world, void *arg);
tt_status tt_sim_run(int world, tt_sim_fn fn, void *arg, int *failed_rank);
/* The rank running now and the simulated world (-1 and 0 outside tt_sim_run). */
int tt_sim_rank(void);
int tt_sim_world(void);

/* ---- device mesh placements (engine/dtensor.c) ------------------------- */
/* How a tensor lies along one mesh dimension, DTensor's placements:
 * Replicate (every coordinate holds the same values), Shard(dim) (the
 * tensor dim split into torch.chunk pieces, one per coordinate) and
 * Partial(op) (every coordinate holds a part; the tensor is their sum, avg
 * or max). op is a tt_reduce_kind. */
typedef enum { TT_PLACE_REPLICATE = 0, TT_PLACE_SHARD = 1, TT_PLACE_PARTIAL = 2 } tt_place_kind;
typedef struct tt_placement {
  int kind; /* tt_place_kind */
  int dim;  /* Shard: the tensor dim */
  int op;   /* Partial: the reduction */
} tt_placement;
/* A box of a global tensor: offset and shape per tensor dim. */
typedef struct tt_box {
  int64_t offset[8];
  int64_t shape[8];
} tt_box;
/* The piece of a global tensor of shape global[0..ndim) that the mesh
 * coordinate coord[0..mesh_ndim) holds under placements[0..mesh_ndim), as a
 * box. A sharded dim is cut as torch.chunk cuts it (chunks of ceil(n / k):
 * 10 rows over 4 ranks are 3, 3, 3, 1; 5 over 8 leave ranks 5..7 empty pieces,
 * shape 0 and offset n). Mesh dims sharding the same tensor dim nest: the
 * mesh dims are applied in `order` (mesh dim indices, each once; NULL: 0, 1,
 * ...), each cutting the piece the earlier ones left (an empty piece then
 * sits at the end of the piece it was cut from). ndim 0..8, mesh_ndim 1..8,
 * mesh sizes >= 1, Shard dims < ndim; box entries past ndim are 0. */
tt_status tt_dtensor_local_box(int ndim, const int64_t *global, int mesh_ndim, const int *mesh_shape,
                               const int *coord, const tt_placement *placements, const int *order, tt_box *out);
/* The inverse: the pieces of box `want` and who holds them. For every mesh
 * coordinate in row-major order (rank = its index) whose piece meets `want`
 * (their intersection is not empty), one entry: ranks[i] and the
 * intersection boxes[i] (in global coordinates). Coordinates that differ
 * only along Replicate or Partial dims hold the same box; with unique = 1
 * only the one at coordinate 0 along those dims is listed (what a loader
 * reads from: those boxes tile `want` exactly once). Writes at most cap
 * entries and *count = how many there are (call with cap 0 and NULL arrays
 * to size). */
tt_status tt_dtensor_owners(int ndim, const int64_t *global, int mesh_ndim, const int *mesh_shape,
                            const tt_placement *placements, const int *order, const tt_box *want, int unique,
                            int cap, int *ranks, tt_box *boxes, int *count);
/* Redistribute as collectives: the steps that take a tensor from placements
 * `from` to `to` (one per mesh dim each). kind: all_gather (Shard(dim) ->
 * Replicate over mesh_dim), reduce_scatter (Partial(op) -> Shard(dim)),
 * all_reduce (Partial(op) -> Replicate), all_to_all (Shard(dim) ->
 * Shard(dim2)), chunk (Replicate -> Shard(dim): keep this coordinate's piece,
 * no communication), partial (Replicate -> Partial: coordinate 0 keeps the
 * values, the others hold zeros for sum, the values for avg and max). */
typedef enum {
  TT_REDIST_ALL_GATHER = 0,
  TT_REDIST_REDUCE_SCATTER = 1,
  TT_REDIST_ALL_REDUCE = 2,
  TT_REDIST_ALL_TO_ALL = 3,
  TT_REDIST_CHUNK = 4,
  TT_REDIST_PARTIAL = 5
} tt_redist_kind;
typedef struct tt_redist_step {
  int kind;     /* tt_redist_kind */
  int mesh_dim; /* the mesh dim whose group runs it */
  int dim;      /* the tensor dim sharded before (all_gather, all_to_all) or after (reduce_scatter,
                 * chunk); -1 for all_reduce and partial */
  int dim2;     /* all_to_all: the tensor dim sharded after; -1 otherwise */
  int op;       /* reduce_scatter, all_reduce: the tt_reduce_kind; partial: the Partial's; -1 otherwise */
} tt_redist_step;
/* Writes at most cap steps, *count = how many (never more than 2 per mesh
 * dim: Shard -> Partial is an all_gather and a partial). As DTensor plans:
 * with a sharded source the mesh dims are visited innermost first (the
 * last of `order` first), so a tensor dim sharded by several mesh dims is
 * gathered from the inside out, and a target Shard whose outer shards of
 * the same tensor dim differ from the target's is replicated now and cut
 * on a second visit, outermost first; without a sharded source one visit,
 * outermost first (Partial -> Shard stays a reduce_scatter). Fails
 * (TT_ERR_UNSUPPORTED, naming the mesh dims) for what has no plan:
 * Partial(a) -> Partial(b) with a != b, and a source Partial over two mesh
 * dims whose reductions do not commute (sum and max: the result would
 * depend on the order of the steps) unless both stay as they are. */
tt_status tt_dtensor_redistribute_plan(int mesh_ndim, const tt_placement *from, const tt_placement *to,
                                       const int *order, int cap, tt_redist_step *steps, int *count);
/* Runs the plan on this rank's piece `in` (its box under `from`, any
 * strides; never written): groups[m] is the process group along mesh dim m
 * (its rank = coord[m], its size mesh_shape[m]; NULL where the plan uses no
 * collective over that dim, groups itself NULL when none does; checked
 * before the first collective). *out is a new contiguous tensor holding
 * this rank's piece under `to` (uneven pieces padded for the collectives
 * and cut back), also when from == to. Every rank of the mesh calls it
 * with the same arguments but coord and in. Partial(avg) and Partial(max)
 * reduce with TT_RED_AVG and TT_RED_MAX. */
tt_status tt_dtensor_redistribute(tt_group *const *groups, int ndim, const int64_t *global, int mesh_ndim,
                                  const int *mesh_shape, const int *coord, const tt_placement *from,
                                  const tt_placement *to, const int *order, const tt_tensor *in, tt_tensor **out);

/* TT_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* TITAN_H */
