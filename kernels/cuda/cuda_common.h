/*
 * cuda_common.h — what the CUDA backend's files share (CUDA C++ only; the
 * engine never includes it). Everything the engine calls has C linkage.
 *
 * Device selection: the mem_* and synchronize entries take a device ordinal
 * and make it current on the calling thread; every other entry (copy, fill,
 * gemm and the kernels) takes none and runs on the thread's current device
 * (so on the device of the last mem_* call), on that device's compute stream.
 */
#ifndef TT_KERNELS_CUDA_COMMON_H
#define TT_KERNELS_CUDA_COMMON_H

#include <cuda_runtime.h>
#include <mutex>
#include <stdint.h>

extern "C" {
#include "../kernels.h"

/* Provided by the engine (engine/error.c): formats into the thread-local
 * last-error buffer and returns `status`. */
__attribute__((format(printf, 2, 3))) tt_status tt_error_set(int status, const char *fmt, ...);

/* The number of CUDA devices; 0 when the driver or the devices are missing. */
int tt_cuda_device_count_impl(void);
/* cudaMemGetInfo on that device: bytes free (what Titan's cache holds counts
 * as used) and in total. */
tt_status tt_cuda_memory_info_impl(int device, int64_t *free_bytes, int64_t *total_bytes);
/* "CUDA runtime 13.0, driver 13.0, cuBLASLt 130000, cuDNN 91300, NCCL 22707". */
const char *tt_cuda_info_impl(void);
/* The device's compute stream and its stream reserved for collectives
 * (cudaStream_t, created non-blocking on first use); NULL on failure. */
void *tt_cuda_stream(int device);
void *tt_cuda_comm_stream(int device);

/* Make what the first GEMM / attention call of a device would otherwise
 * make lazily (handles, workspaces): graph.cu calls them before a capture. */
tt_status tt_cuda_gemm_prepare(int device);
tt_status tt_cuda_attention_prepare(int device);

/* graph.cu: stream capture and replay; how many executable graphs of the
 * device are alive (their nodes may point at library workspaces). */
int tt_cuda_graphs_alive(int device);
/* graph.cu: stream capture and replay. */
tt_status tt_cuda_graph_begin(int device);
tt_status tt_cuda_graph_end(int device, void **graph, int64_t *nodes);
tt_status tt_cuda_graph_launch(int device, void *graph);
void tt_cuda_graph_free(int device, void *graph);

/* Table entries defined in copy.cu and gemm.cu. */
tt_status tt_cuda_copy(int ndim, const int64_t *shape, int src_dtype, const void *src, const int64_t *src_strides,
                       int dst_dtype, void *dst, const int64_t *dst_strides);
tt_status tt_cuda_fill(int dtype, int64_t n, double value, void *dst);
tt_status tt_cuda_gemm(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                       int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c, const void *bias,
                       int bias_dtype, int flags);

/* host.cu: pinned host memory and asynchronous device->host copies. */
tt_status tt_cuda_host_alloc(size_t nbytes, void **out);
void tt_cuda_host_free(void *ptr);
tt_status tt_cuda_copy_to_host_async(int device, void *dst, const void *src, size_t nbytes, void **event);
tt_status tt_cuda_event_wait(void *event);
void tt_cuda_event_free(void *event);
tt_status tt_cuda_event_record(int device, int stream, void **event);
int tt_cuda_event_query(void *event);
tt_status tt_cuda_timer_event_new(int device, void **event);
tt_status tt_cuda_timer_event_mark(int device, void *event);
tt_status tt_cuda_timer_event_elapsed(void *start, void *end, float *ms);

/* rng.cu: arange and random numbers (the same Philox stream as the CPU). */
tt_status tt_cuda_arange(int dtype, int64_t n, double start, double step, void *dst);
tt_status tt_cuda_rng(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                      double p3, void *dst);
/* elementwise.cu */
tt_status tt_cuda_binary(int op, int dtype, int ndim, const int64_t *shape, const void *a, const int64_t *a_strides,
                         const void *b, const int64_t *b_strides, void *out, const int64_t *out_strides);
tt_status tt_cuda_unary(int op, int dtype, int64_t n, double alpha, const void *x, void *y);
tt_status tt_cuda_unary_backward(int op, int dtype, int64_t n, double alpha, const void *x, const void *y,
                                 const void *dy, void *dx);
tt_status tt_cuda_axpy(int dtype, int64_t n, double alpha, const void *x, void *y);
tt_status tt_cuda_foreach_scale(int dtype, int k, void *const *xs, const int64_t *ns, double alpha, int set);
/* reduce.cu */
tt_status tt_cuda_reduce(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                         int64_t *idx);
tt_status tt_cuda_sum_to(int dtype, int ndim, const int64_t *shape, const void *x, const int64_t *out_shape,
                         void *out);
tt_status tt_cuda_softmax(int dtype, int64_t rows, int64_t n, int log, const void *x, void *y);
tt_status tt_cuda_softmax_backward(int dtype, int64_t rows, int64_t n, int log, const void *y, const void *dy,
                                   void *dx);
tt_status tt_cuda_sumsq(int dtype, int64_t n, const void *x, double *out);
tt_status tt_cuda_sumsq_many(int k, const int *dtypes, const int64_t *ns, const void *const *xs, double *out);
/* index.cu */
tt_status tt_cuda_index_select(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src,
                               int64_t n_idx, const int64_t *idx, void *out);
tt_status tt_cuda_index_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                            const int64_t *idx, const void *src);
tt_status tt_cuda_gather(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                         const int64_t *idx, void *out);
tt_status tt_cuda_scatter_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                              const int64_t *idx, const void *src);
/* embed.cu */
tt_status tt_cuda_embedding(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *weight,
                            const int64_t *ids, void *out);
tt_status tt_cuda_embedding_backward(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *dy,
                                     const int64_t *ids, void *dweight);
/* norm.cu */
tt_status tt_cuda_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *w, void *y,
                          void *rstd);
tt_status tt_cuda_add_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                              const void *w, void *h, void *y, void *rstd);
tt_status tt_cuda_rmsnorm_backward(int dtype, int64_t rows, int64_t dim, const void *x, const void *w,
                                   const void *rstd, const void *dy, void *dx, void *dw, int dx_accumulate);
/* rope.cu */
tt_status tt_cuda_rope_table(int dtype, int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                             double low_freq_factor, double high_freq_factor, int64_t original_max_seq, void *cos,
                             void *sin);
tt_status tt_cuda_rope(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, const void *x, const void *cos,
                       const void *sin, int64_t pos_offset, int inverse, void *y);
/* attention.cu */
tt_status tt_cuda_attention(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                            int causal, double scale, const void *q, const void *k, const void *v, void *o,
                            void *lse);
tt_status tt_cuda_attention_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                     int causal, double scale, const void *q, const void *k, const void *v,
                                     const void *o, const void *lse, const void *dout, void *dq, void *dk,
                                     void *dv);
/* float8.cu, gemm.cu */
tt_status tt_cuda_to_float8(int dtype, int64_t n, const void *x, int fp8_dtype, void *y, float *scale_inv,
                            const float *amax_in);
tt_status tt_cuda_float8_amax(int dtype, int64_t n, const void *x, float *out);
tt_status tt_cuda_gemm_float8(int a_dtype, int b_dtype, int c_dtype, int64_t m, int64_t n, int64_t k, const void *a,
                              const void *b, const float *sa, const float *sb, double beta, void *c, int fast_accum);
/* attention_merge.cu */
tt_status tt_cuda_attention_merge(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                                  void *acc, void *acc_lse, const void *out, const void *lse);
/* act.cu */
tt_status tt_cuda_swiglu(int dtype, int64_t n, const void *a, const void *b, void *y);
tt_status tt_cuda_swiglu_backward(int dtype, int64_t n, const void *a, const void *b, const void *dy, void *da,
                                  void *db);
/* loss.cu */
tt_status tt_cuda_cross_entropy(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                                int64_t ignore_index, void *losses, void *lse);
tt_status tt_cuda_cross_entropy_backward(int dtype, int64_t N, int64_t V, const void *logits,
                                         const int64_t *targets, const void *lse, const void *dlosses,
                                         int64_t ignore_index, void *dlogits);
tt_status tt_cuda_count_valid(int64_t N, const int64_t *targets, int64_t ignore_index, int64_t *count);
/* optim.cu */
tt_status tt_cuda_adamw(int param_dtype, int grad_dtype, int64_t n, void *param, const void *grad, float *m,
                        float *v, float *master, double lr, double beta1, double beta2, double eps,
                        double weight_decay, double bias_correction1, double bias_correction2);
tt_status tt_cuda_adamw_multi_dev(int param_dtype, int grad_dtype, int count, const tt_adamw_tensor *ts, double beta1,
                                 double beta2, double eps, const float *decay, const float *pairs,
                                 const double *norm_clip);
tt_status tt_cuda_global_norm_dev(int k, const int *dtypes, const int64_t *ns, const void *const *xs, double max_norm,
                                  double *out, int count_nonfinite);
tt_status tt_cuda_adamw_multi(int param_dtype, int grad_dtype, int count, const tt_adamw_tensor *ts, double lr,
                              double beta1, double beta2, double eps, double weight_decay);
}

/* cuemu (tests/cuemu), which runs these kernels on the CPU in CI, checks
 * that every pointer a launch hands a kernel is device or pinned memory. A
 * struct passed to a kernel by value walks its pointers for it with a
 * tt_emu_ptrs overload (under #if TITAN_CUEMU), or says it has none here;
 * one with neither does not compile on cuemu. Nothing on a real build. */
#if defined(TITAN_CUEMU)
#define TT_EMU_NO_PTRS(S) \
  static inline void tt_emu_ptrs(const S &, tt_emu_ptr_visit &) {}
#else
#define TT_EMU_NO_PTRS(S)
#endif

/* cuemu also counts, per kernel, the full chunks the vector helpers moved
 * in one 16-byte (AdamW: 4-element) access and those they split into
 * element accesses (tt_emu_chunks_get): a spec checks a training step's
 * fused kernels take the vector path wherever the data allows it, which on
 * the GPU decides whether they reach HBM bandwidth. */
#if defined(TITAN_CUEMU)
#define TT_EMU_CHUNK(full, vec) ((full) ? tt_emu_note_chunk(vec) : (void)0)
#else
#define TT_EMU_CHUNK(full, vec) ((void)0)
#endif

#define TT_CUDA_MAX_DEVICES 16
#define TT_CUDA_THREADS 256

/* Records "cuda: <call> failed at <file>:<line>: <name>: <description>",
 * clears the runtime's (non-sticky) error and returns the status it maps
 * to: TT_ERR_OOM, TT_ERR_DEVICE or TT_ERR_INTERNAL. */
tt_status tt_cuda_fail(cudaError_t err, const char *call, const char *file, int line);
/* __FILE__ without the directories above kernels/. */
const char *tt_cuda_short_file(const char *file);

#define TT_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    cudaError_t tt_cuda_err_ = (call);                                               \
    if (tt_cuda_err_ != cudaSuccess) return tt_cuda_fail(tt_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

/* After a <<<>>> launch: catches bad configurations and earlier async faults. */
#define TT_CUDA_CHECK_LAUNCH(kernel)                                                           \
  do {                                                                                         \
    cudaError_t tt_cuda_err_ = cudaGetLastError();                                             \
    if (tt_cuda_err_ != cudaSuccess) return tt_cuda_fail(tt_cuda_err_, "launch of " kernel, __FILE__, __LINE__); \
  } while (0)

/* Make `device` current and return its compute stream. */
tt_status tt_cuda_select(int device, cudaStream_t *stream);
/* The calling thread's current device and its compute stream. */
tt_status tt_cuda_current(int *device, cudaStream_t *stream);

/* The device's index-fault record (kernels.h), in device memory: made with
 * the streams and never moved, so a kernel captured into a CUDA graph keeps
 * writing the record that check_errors reads. Valid once tt_cuda_select or
 * tt_cuda_current succeeded for `device`. */
tt_index_fault *tt_cuda_fault(int device);

/* The device's scratch buffer for the partial results of multi-pass
 * kernels (deterministic reductions): TT_CUDA_WORKSPACE bytes, allocated
 * once per device on first use and never per call. The caller keeps `hold`
 * locked until every kernel that uses the buffer is enqueued on the compute
 * stream; the stream then orders those kernels before any later user's. */
#define TT_CUDA_WORKSPACE (16u << 20)
tt_status tt_cuda_workspace(int device, void **ptr, std::unique_lock<std::mutex> *hold);

/* Blocks for a grid-stride loop over n elements. */
static inline unsigned int tt_cuda_blocks(int64_t n) {
  int64_t b = (n + TT_CUDA_THREADS - 1) / TT_CUDA_THREADS;
  const int64_t cap = 65536; /* the loop covers the rest; keeps launches cheap for huge n */
  return (unsigned int)(b < 1 ? 1 : (b > cap ? cap : b));
}

#endif
