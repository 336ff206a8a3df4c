/*
 * embed.cu — embedding lookup and its weight gradient.
 *
 * The lookup is index_select's row mover with outer 1 (16-byte units when
 * the rows allow): f32, f64, bf16 and f16 weights. The gradient is
 * index_add's deterministic add with outer 1: the ids sorted by row (a
 * counting sort, stable), then each row's hits summed in id order by the
 * row's own threads, so every row of dweight receives its additions in id
 * order — no float atomics, bit-identical from run to run and to the CPU
 * for f32 and f64 (bf16/f16 gradients round after each addition, as
 * index_add does); see index.cu.
 * Ids outside [0, vocab) give zero rows, add nothing and are recorded as
 * index faults (see index.cu).
 */
#include "kernel_util.cuh"

extern "C" tt_status tt_cuda_embedding(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *weight,
                                       const int64_t *ids, void *out) {
  if (dtype != TT_F32 && dtype != TT_F64 && dtype != TT_BF16 && dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "cuda embedding: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  return tt_cuda_select_rows(TT_FAULT_EMBEDDING, (int)tt_cuda_float_size(dtype), 1, vocab, dim, weight, n_ids, ids,
                             out);
}

extern "C" tt_status tt_cuda_embedding_backward(int dtype, int64_t n_ids, int64_t dim, int64_t vocab, const void *dy,
                                                const int64_t *ids, void *dweight) {
  if (dtype != TT_F32 && dtype != TT_F64 && dtype != TT_BF16 && dtype != TT_F16)
    return tt_error_set(TT_ERR_DTYPE, "cuda embedding_backward: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  return tt_cuda_add_rows(TT_FAULT_EMBEDDING_BACKWARD, "embedding_backward", 0, dtype, 1, vocab, dim, dweight, n_ids,
                          ids, dy);
}
