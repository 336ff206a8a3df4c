/* backend.c — the CPU backend table: host memory and the kernel families. */
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

static tt_status tt_cpu_mem_alloc(int device, size_t nbytes, void **out) {
  (void)device;
  /* 64-byte alignment: whole cache lines and aligned AVX-512 loads. */
  size_t n = (nbytes + 63) & ~(size_t)63;
  *out = aligned_alloc(64, n ? n : 64);
  return *out ? TT_OK : TT_ERR_OOM;
}

static void tt_cpu_mem_free(int device, void *ptr) {
  (void)device;
  free(ptr);
}

static tt_status tt_cpu_mem_copy(int device, void *dst, const void *src, size_t nbytes, int kind) {
  (void)device;
  (void)kind;
  memmove(dst, src, nbytes);
  return TT_OK;
}

static tt_status tt_cpu_synchronize(int device) {
  (void)device;
  return TT_OK;
}

static const tt_kernels tt_cpu_table = {
    .name = "cpu",
    .mem_alloc = tt_cpu_mem_alloc,
    .mem_free = tt_cpu_mem_free,
    .mem_copy = tt_cpu_mem_copy,
    .synchronize = tt_cpu_synchronize,
    .copy = tt_cpu_copy,
    .fill = tt_cpu_fill,
    .arange = tt_cpu_arange,
    .rng = tt_cpu_rng,
    .binary = tt_cpu_binary,
    .unary = tt_cpu_unary,
    .unary_backward = tt_cpu_unary_backward,
    .axpy = tt_cpu_axpy,
    .reduce = tt_cpu_reduce,
    .sum_to = tt_cpu_sum_to,
    .softmax = tt_cpu_softmax,
    .softmax_backward = tt_cpu_softmax_backward,
    .sumsq = tt_cpu_sumsq,
    .gemm = tt_cpu_gemm,
    .index_select = tt_cpu_index_select,
    .index_add = tt_cpu_index_add,
    .gather = tt_cpu_gather,
    .scatter_add = tt_cpu_scatter_add,
    .embedding = tt_cpu_embedding,
    .embedding_backward = tt_cpu_embedding_backward,
    .rmsnorm = tt_cpu_rmsnorm,
    .add_rmsnorm = tt_cpu_add_rmsnorm,
    .rmsnorm_backward = tt_cpu_rmsnorm_backward,
    .rope_table = tt_cpu_rope_table,
    .rope = tt_cpu_rope,
    .attention = tt_cpu_attention,
    .attention_backward = tt_cpu_attention_backward,
    .attention_merge = tt_cpu_attention_merge,
    .to_float8 = tt_cpu_to_float8,
    .float8_amax = tt_cpu_float8_amax,
    .swiglu = tt_cpu_swiglu,
    .swiglu_backward = tt_cpu_swiglu_backward,
    .cross_entropy = tt_cpu_cross_entropy,
    .cross_entropy_backward = tt_cpu_cross_entropy_backward,
    .adamw = tt_cpu_adamw,
    .adamw_multi_dev = tt_cpu_adamw_multi_dev,
};

const tt_kernels *tt_kernels_cpu(void) { return &tt_cpu_table; }
