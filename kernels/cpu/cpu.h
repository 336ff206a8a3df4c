/*
 * cpu.h — the CPU backend's kernel functions, one family per file
 * (gemm.c, elementwise.c, reduce.c, index.c, embed.c, norm.c, rope.c,
 * attention.c, act.c, loss.c, optim.c, copy.c, rng.c). backend.c gathers
 * them into the tt_kernels table; the signatures are those of kernels.h.
 * Internal to libtitan: Lua never calls these directly.
 */
#ifndef TT_KERNELS_CPU_H
#define TT_KERNELS_CPU_H

#include "../kernels.h"

/* copy.c */
tt_status tt_cpu_copy(int ndim, const int64_t *shape, int src_dtype, const void *src, const int64_t *src_strides,
                      int dst_dtype, void *dst, const int64_t *dst_strides);
tt_status tt_cpu_fill(int dtype, int64_t n, double value, void *dst);
tt_status tt_cpu_arange(int dtype, int64_t n, double start, double step, void *dst);
/* rng.c */
tt_status tt_cpu_rng(int kind, int dtype, int64_t n, uint64_t seed, uint64_t offset, double p0, double p1, double p2,
                     double p3, void *dst);
/* elementwise.c */
tt_status tt_cpu_binary(int op, int dtype, int ndim, const int64_t *shape, const void *a, const int64_t *a_strides,
                        const void *b, const int64_t *b_strides, void *out, const int64_t *out_strides);
tt_status tt_cpu_unary(int op, int dtype, int64_t n, double alpha, const void *x, void *y);
tt_status tt_cpu_unary_backward(int op, int dtype, int64_t n, double alpha, const void *x, const void *y,
                                const void *dy, void *dx);
tt_status tt_cpu_axpy(int dtype, int64_t n, double alpha, const void *x, void *y);
/* reduce.c */
tt_status tt_cpu_reduce(int op, int dtype, int64_t outer, int64_t n, int64_t inner, const void *x, void *y,
                        int64_t *idx);
tt_status tt_cpu_sum_to(int dtype, int ndim, const int64_t *shape, const void *x, const int64_t *out_shape, void *out);
tt_status tt_cpu_softmax(int dtype, int64_t rows, int64_t n, int log, const void *x, void *y);
tt_status tt_cpu_softmax_backward(int dtype, int64_t rows, int64_t n, int log, const void *y, const void *dy,
                                  void *dx);
tt_status tt_cpu_sumsq(int dtype, int64_t n, const void *x, double *out);
/* gemm.c */
tt_status tt_cpu_gemm(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                      double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                      int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c, const void *bias,
                      int bias_dtype, int flags);
/* index.c */
tt_status tt_cpu_index_select(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                              const int64_t *idx, void *out);
tt_status tt_cpu_index_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                           const int64_t *idx, const void *src);
tt_status tt_cpu_gather(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src, int64_t n_idx,
                        const int64_t *idx, void *out);
tt_status tt_cpu_scatter_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst, int64_t n_idx,
                             const int64_t *idx, const void *src);
/* embed.c */
tt_status tt_cpu_embedding(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *weight,
                           const int64_t *ids, void *out);
tt_status tt_cpu_embedding_backward(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *dy,
                                    const int64_t *ids, void *dweight);
/* norm.c */
tt_status tt_cpu_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *w, void *y,
                         void *rstd);
tt_status tt_cpu_add_rmsnorm(int dtype, int64_t rows, int64_t dim, double eps, const void *x, const void *res,
                             const void *w, void *h, void *y, void *rstd);
tt_status tt_cpu_rmsnorm_backward(int dtype, int64_t rows, int64_t dim, const void *x, const void *w,
                                  const void *rstd, const void *dy, void *dx, void *dw, int dx_accumulate);
/* rope.c */
tt_status tt_cpu_rope_table(int dtype, int64_t head_dim, int64_t max_seq, double theta, double scale_factor,
                            double low_freq_factor, double high_freq_factor, int64_t original_max_seq, void *cos,
                            void *sin);
tt_status tt_cpu_rope(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, const void *x, const void *cos,
                      const void *sin, int64_t pos_offset, int inverse, void *y);
/* attention.c */
tt_status tt_cpu_attention(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                           int causal, double scale, const void *q, const void *k, const void *v, void *o, void *lse);
tt_status tt_cpu_attention_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                    int causal, double scale, const void *q, const void *k, const void *v,
                                    const void *o, const void *lse, const void *dout, void *dq, void *dk, void *dv);
tt_status tt_cpu_attention_merge(int dtype, int64_t B, int64_t T, int64_t H, int64_t D, int64_t t0, int64_t Tb,
                                 void *acc, void *acc_lse, const void *out, const void *lse);
/* float8.c */
tt_status tt_cpu_to_float8(int dtype, int64_t n, const void *x, int fp8_dtype, void *y, float *scale_inv,
                           const float *amax_in);
tt_status tt_cpu_float8_amax(int dtype, int64_t n, const void *x, float *out);
/* act.c */
tt_status tt_cpu_swiglu(int dtype, int64_t n, const void *a, const void *b, void *y);
tt_status tt_cpu_swiglu_backward(int dtype, int64_t n, const void *a, const void *b, const void *dy, void *da,
                                 void *db);
/* loss.c */
tt_status tt_cpu_cross_entropy(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                               int64_t ignore_index, void *losses, void *lse);
tt_status tt_cpu_cross_entropy_backward(int dtype, int64_t N, int64_t V, const void *logits, const int64_t *targets,
                                        const void *lse, const void *dlosses, int64_t ignore_index, void *dlogits);
/* optim.c */
tt_status tt_cpu_adamw(int param_dtype, int grad_dtype, int64_t n, void *param, const void *grad, float *m, float *v,
                       float *master, double lr, double beta1, double beta2, double eps, double weight_decay,
                       double bias_correction1, double bias_correction2);
tt_status tt_cpu_adamw_multi_dev(int param_dtype, int grad_dtype, int k, const tt_adamw_tensor *ts, double beta1,
                                 double beta2, double eps, const float *decay, const float *pairs,
                                 const double *norm_clip);

#endif
