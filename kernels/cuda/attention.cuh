/*
 * attention.cuh — what attention.cu (entry points, cuDNN SDPA graphs) and
 * attention_fallback.cu (the plain CUDA kernels) share. CUDA C++ only.
 */
#ifndef TT_KERNELS_CUDA_ATTENTION_CUH
#define TT_KERNELS_CUDA_ATTENTION_CUH

#include "cuda_common.h"

/* The largest head dim either path takes (engine/ops_nn.c enforces it). */
#define TT_ATT_DMAX 256

/* The tiled online-softmax kernels: every dtype (f32, f64, bf16, f16), any
 * B, T, S, Hq, Hkv (Hq a multiple of Hkv), D <= TT_ATT_DMAX, causal or not.
 * Deterministic (no atomics). Enqueued on `stream`; nothing is allocated.
 * Sizes must be positive except S (S = 0: every row sees no key). */
tt_status tt_att_fallback_forward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                  int causal, double scale, const void *q, const void *k, const void *v, void *o,
                                  void *lse, cudaStream_t stream);
tt_status tt_att_fallback_backward(int dtype, int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                                   int causal, double scale, const void *q, const void *k, const void *v,
                                   const void *o, const void *lse, const void *dout, void *dq, void *dk, void *dv,
                                   cudaStream_t stream);

#endif
