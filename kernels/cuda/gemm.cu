/*
 * gemm.cu — batched row-major GEMM through cuBLASLt.
 *
 * Row-major C = op(A) @ op(B) is, read as column-major, C^T = op(B)^T @ op(A)^T,
 * and a row-major matrix read as column-major is its transpose: so we hand
 * cuBLASLt B as its first operand and A as its second, with the callers'
 * transposes and leading dimensions unchanged. f32 accumulates in plain f32
 * (no TF32) so results stay comparable with the CPU reference, unless the
 * caller allows TF32 (tt_set_allow_tf32: CUBLAS_COMPUTE_32F_FAST_TF32, as
 * PyTorch's allow_tf32); bf16 and f16 accumulate in f32; f64 in f64.
 *
 * Bias (a linear layer's, fused as CUBLASLT_EPILOGUE_BIAS): cuBLASLt adds a
 * vector with one element per ROW of its column-major D and broadcasts it
 * over D's columns. Our D is the row-major C read column-major, i.e. C^T:
 * [n rows, m cols]. So cuBLASLt's rows are our columns, and its bias of
 * length n is added to every one of our m rows — exactly y = x W^T + b with
 * b indexed by output feature. The epilogue runs after alpha/beta (D =
 * alpha*AB + beta*C + bias: bias unscaled), and BIAS_BATCH_STRIDE stays 0,
 * so every batch gets the same vector.
 *
 * Per device: one cuBLASLt handle, one 32 MiB workspace (allocated once, on
 * the first GEMM; every GEMM runs on the one compute stream, so sharing it
 * is safe), and a small cache of descriptors + the heuristic's algorithm
 * keyed by everything the choice depends on, pointer alignment included.
 *
 * Determinism (debug.deterministic needs nothing here): cuBLASLt gives the
 * same bits for a fixed algorithm on one GPU, and none of the split-K
 * reduction schemes its heuristic may pick uses atomics (cublasLt.h,
 * cublasLtReductionScheme_t: INPLACE serialises the K slices through
 * counters in the workspace, COMPUTE_TYPE and OUTPUT_TYPE reduce them in a
 * separate pass), so CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK stays at its
 * default. The algorithm is chosen once per key by a heuristic that is a
 * function of the key, and the shared workspace is only ever used by one
 * stream.
 *
 * Autotuning (TT_GEMM_TUNE, tt_set_gemm_autotune; as PyTorch's TunableOp):
 * the key then asks the heuristic for its best TT_GEMM_TUNE_CANDIDATES
 * algorithms, and the first call of the key that overwrites C (beta = 0,
 * so the trial runs' output is overwritten by the real one) outside a
 * graph capture (which cannot time or wait) runs each candidate once to
 * warm up, then times them all in turn, twice (tt_gemm_tune), and keeps the
 * fastest for the key if it beats the heuristic's choice by 2%; until then,
 * and where no candidate ran, the heuristic's first choice serves. Which
 * candidate wins can change with timing noise, so bits can differ from run
 * to run: ops.c does not ask for it in deterministic mode.
 *
 * TITAN_CUDA_GEMM_API=cublas (read at each call; `lt`, the default, is
 * the above) runs a GEMM without a bias through cuBLAS's
 * cublasGemmStridedBatchedEx instead, as PyTorch's mm does: the same
 * mapping, the same workspace, cuBLAS's own choice of algorithm (no
 * autotuning). It is there to compare the two libraries' choices at the
 * same shapes (bench/gpu.lua), the 1B step's GEMMs being slower than
 * PyTorch's while 8192^3 runs alike. cuBLAS gives the same bits on every
 * run on one GPU with one stream (its documented reproducibility).
 *
 * fp8 (tt_cuda_gemm_float8, float8 linear layers): C = sa * sb * A @ B^T
 * with A [m, k] and B [n, k] row-major e4m3/e5m2, the scales device f32
 * scalars (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER, so they never visit the
 * host). Both operands contiguous along k is the one layout cuBLASLt's fp8
 * kernels take ("TN": read column-major, B is cuBLASLt's transposed A and
 * A its plain B). The scale pointers change from call to call and are set
 * on the shared plan before each.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <mutex>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.h"
#include "dtype.cuh"

#define TT_GEMM_WORKSPACE (32u << 20)
#define TT_GEMM_CACHE 64
#define TT_GEMM_TUNE_CANDIDATES 8
#define TT_GEMM_TUNE_RUNS 3          /* the fewest runs between two events */
#define TT_GEMM_TUNE_WINDOW_MS 20.0f /* ... and about this long, measured on the heuristic's warm-up */
#define TT_GEMM_TUNE_ROUNDS 2
#define TT_GEMM_TUNE_MARGIN 0.02f

static tt_status tt_lt_fail(cublasStatus_t s, const char *call, const char *file, int line) {
  return tt_error_set(TT_ERR_INTERNAL, "cublasLt: %s failed at %s:%d: %s", call, tt_cuda_short_file(file), line,
                      cublasLtGetStatusString(s));
}

#define TT_LT_CHECK(call)                                                                     \
  do {                                                                                        \
    cublasStatus_t tt_lt_st_ = (call);                                                        \
    if (tt_lt_st_ != CUBLAS_STATUS_SUCCESS) return tt_lt_fail(tt_lt_st_, #call, __FILE__, __LINE__); \
  } while (0)

/* bias_dtype is -1 without a bias; align_bias 0 then. a8 and b8: the fp8
 * operands' dtypes of tt_cuda_gemm_float8's keys (dtype then C's), else 0. */
struct tt_gemm_key {
  int32_t dtype, trans_a, trans_b, align_a, align_b, align_c, bias_dtype, align_bias, tf32, tune, a8, b8, fast;
  int64_t batch, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c;
};

struct tt_gemm_plan {
  int used;
  int no_algo; /* a bias key cuBLASLt has no epilogue algorithm for: the bias is added apart */
  tt_gemm_key key;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc; /* of cuBLASLt's A (our B), B (our A), C */
  cublasLtMatmulAlgo_t algo;
  /* a tuned key whose candidates are still to be timed (the heuristic's
   * first serves meanwhile) */
  int ncand;
  cublasLtMatmulAlgo_t cand[TT_GEMM_TUNE_CANDIDATES];
};

static struct tt_gemm_dev {
  std::mutex lock; /* held for a whole call: plans are reused, not copied */
  int ready;
  cublasLtHandle_t lt;
  cublasHandle_t blas; /* TITAN_CUDA_GEMM_API=cublas's, made on its first GEMM */
  void *workspace;
  tt_gemm_plan plans[TT_GEMM_CACHE];
  int next; /* round-robin eviction */
} tt_gemm_devs[TT_CUDA_MAX_DEVICES];

static void tt_gemm_plan_release(tt_gemm_plan *p) {
  if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->op) cublasLtMatmulDescDestroy(p->op);
  memset(p, 0, sizeof *p);
}

/* The cached plan of key, or NULL. */
static tt_gemm_plan *tt_gemm_plan_find(tt_gemm_dev *g, const tt_gemm_key *key) {
  for (int i = 0; i < TT_GEMM_CACHE; i++)
    if (g->plans[i].used && memcmp(&g->plans[i].key, key, sizeof *key) == 0) return &g->plans[i];
  return NULL;
}

/* A released slot for a new plan (round-robin eviction). */
static tt_gemm_plan *tt_gemm_plan_slot(tt_gemm_dev *g) {
  tt_gemm_plan *p = &g->plans[g->next];
  g->next = (g->next + 1) % TT_GEMM_CACHE;
  tt_gemm_plan_release(p);
  return p;
}

/* A preference with the shared workspace's size and the operands' alignments
 * (A, B, C, D in cuBLASLt's order). */
static cublasStatus_t tt_gemm_pref(cublasLtMatmulPreference_t pref, const uint32_t al[4]) {
  uint64_t ws = TT_GEMM_WORKSPACE;
  const cublasLtMatmulPreferenceAttributes_t which[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                          sizeof ws);
  for (int i = 0; i < 4 && s == CUBLAS_STATUS_SUCCESS; i++)
    s = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], 4);
  return s;
}

/* Largest power of two (up to 256) dividing the address of every batch's matrix. */
static int32_t tt_gemm_align(const void *p, int64_t batch, int64_t stride, size_t es) {
  uintptr_t a = (uintptr_t)p | 256u;
  if (batch > 1) a |= (uintptr_t)(stride * (int64_t)es);
  return (int32_t)(a & (~a + 1));
}

static tt_status tt_gemm_layout(cublasLtMatrixLayout_t *out, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                                int64_t batch, int64_t stride) {
  TT_LT_CHECK(cublasLtMatrixLayoutCreate(out, t, (uint64_t)rows, (uint64_t)cols, ld));
  if (batch > 1) {
    int32_t count = (int32_t)batch;
    TT_LT_CHECK(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    TT_LT_CHECK(
        cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
  return TT_OK;
}

/* The bias pointer goes into the descriptor before the heuristic (which
 * reads its alignment) and again before every call (plans are shared by
 * every bias of the same alignment). */
static tt_status tt_gemm_set_bias(cublasLtMatmulDesc_t op, const void *bias) {
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  return TT_OK;
}

static tt_status tt_gemm_plan_build(tt_gemm_dev *g, tt_gemm_plan *p, const tt_gemm_key *key, cudaDataType_t t,
                                    cublasComputeType_t ct, cudaDataType_t scale, const void *bias) {
  memset(p, 0, sizeof *p);
  const tt_gemm_key *q = key;
  cublasOperation_t opa = q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, opb = q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  TT_LT_CHECK(cublasLtMatmulDescCreate(&p->op, ct, scale));
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  tt_status st;
  if (bias) {
    uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
    TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    /* The bias is in D's type, cuBLASLt's default (the engine converts it). */
    if ((st = tt_gemm_set_bias(p->op, bias)) != TT_OK) return st;
  }
  if ((st = tt_gemm_layout(&p->la, t, q->trans_b ? q->k : q->n, q->trans_b ? q->n : q->k, q->ldb, q->batch,
                           q->stride_b)) != TT_OK)
    return st;
  if ((st = tt_gemm_layout(&p->lb, t, q->trans_a ? q->m : q->k, q->trans_a ? q->k : q->m, q->lda, q->batch,
                           q->stride_a)) != TT_OK)
    return st;
  if ((st = tt_gemm_layout(&p->lc, t, q->n, q->m, q->ldc, q->batch, q->stride_c)) != TT_OK) return st;

  cublasLtMatmulPreference_t pref;
  TT_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t al[4] = {(uint32_t)q->align_b, (uint32_t)q->align_a, (uint32_t)q->align_c, (uint32_t)q->align_c};
  cublasStatus_t s = tt_gemm_pref(pref, al);
  cublasLtMatmulHeuristicResult_t h[TT_GEMM_TUNE_CANDIDATES];
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(g->lt, p->op, p->la, p->lb, p->lc, p->lc, pref,
                                       q->tune ? TT_GEMM_TUNE_CANDIDATES : 1, h, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED)
    return tt_lt_fail(s, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)
    return tt_error_set(q->dtype == TT_F64 ? TT_ERR_DTYPE : TT_ERR_INTERNAL,
                        "cuda gemm: cuBLASLt has no algorithm for dtype %d, batch %lld, m %lld, n %lld, k %lld, "
                        "trans_a %d, trans_b %d, ld %lld/%lld/%lld, alignment %d/%d/%d, bias dtype %d (alignment %d), "
                        "tf32 %d",
                        q->dtype, (long long)q->batch, (long long)q->m, (long long)q->n, (long long)q->k, q->trans_a,
                        q->trans_b, (long long)q->lda, (long long)q->ldb, (long long)q->ldc, q->align_a, q->align_b,
                        q->align_c, q->bias_dtype, q->align_bias, q->tf32);
  p->algo = h[0].algo;
  if (q->tune && found > 1)
    for (int i = 0; i < found; i++)
      if (h[i].state == CUBLAS_STATUS_SUCCESS && h[i].workspaceSize <= TT_GEMM_WORKSPACE)
        p->cand[p->ncand++] = h[i].algo;
  if (p->ncand < 2) p->ncand = 0; /* nothing to choose between */
  p->key = *key;
  p->used = 1;
  return TT_OK;
}

/* Times the plan's candidates on the call's operands (C overwritten: beta =
 * 0) and keeps the fastest; a candidate that fails to run is passed over.
 * Each candidate first runs once (its warm-up), then TT_GEMM_TUNE_ROUNDS
 * rounds each time every candidate in turn, back to back for about
 * TT_GEMM_TUNE_WINDOW_MS (at least TT_GEMM_TUNE_RUNS runs) between two
 * events, and a candidate's figure is its best round. The first GPU check
 * timed the candidates one after the other, the second in rounds of 3 runs
 * (about 1 ms); in both a candidate that timed faster in the tuner ran 5%
 * slower than the heuristic's choice in the benchmark's sustained runs (8B
 * w1/w3, bench/RESULTS.md, 2026-12-04): a GPU holding its power limit
 * lowers its clock within milliseconds, so a kernel that is fast in a burst
 * need not be fast in a training step. The heuristic's first choice is kept
 * unless a candidate beats it by TT_GEMM_TUNE_MARGIN: a near tie is noise,
 * and the heuristic's choice is the same from run to run. Errors of the
 * events (not of a candidate) end the timing, with the heuristic's first
 * choice kept. */
static tt_status tt_gemm_tune(tt_gemm_dev *g, tt_gemm_plan *p, cudaStream_t s, const void *alpha, const void *beta,
                              const void *a, const void *b, void *c) {
  cudaEvent_t e0 = NULL, e1 = NULL;
  cudaError_t err = cudaEventCreate(&e0);
  if (err == cudaSuccess) err = cudaEventCreate(&e1);
  float best[TT_GEMM_TUNE_CANDIDATES];
  float one = 0.0f; /* the heuristic's warm-up run, ms */
  for (int i = 0; i < p->ncand; i++) {
    if (i == 0 && err == cudaSuccess) err = cudaEventRecord(e0, s);
    best[i] = cublasLtMatmul(g->lt, p->op, alpha, b, p->la, a, p->lb, beta, c, p->lc, c, p->lc, &p->cand[i],
                             g->workspace, TT_GEMM_WORKSPACE, s) == CUBLAS_STATUS_SUCCESS
                  ? 0.0f
                  : -1.0f; /* -1: cannot run; 0: not timed yet */
    if (i == 0 && err == cudaSuccess) err = cudaEventRecord(e1, s);
    if (i == 0 && err == cudaSuccess) err = cudaEventSynchronize(e1);
    if (i == 0 && err == cudaSuccess) err = cudaEventElapsedTime(&one, e0, e1);
  }
  int runs = TT_GEMM_TUNE_RUNS;
  if (one > 0.0f && TT_GEMM_TUNE_WINDOW_MS / one > (float)runs)
    runs = TT_GEMM_TUNE_WINDOW_MS / one > 1000.0f ? 1000 : (int)(TT_GEMM_TUNE_WINDOW_MS / one);
  for (int round = 0; round < TT_GEMM_TUNE_ROUNDS && err == cudaSuccess; round++) {
    for (int i = 0; i < p->ncand && err == cudaSuccess; i++) {
      if (best[i] < 0.0f) continue;
      err = cudaEventRecord(e0, s);
      int ran = 1;
      for (int r = 0; r < runs && ran && err == cudaSuccess; r++)
        ran = cublasLtMatmul(g->lt, p->op, alpha, b, p->la, a, p->lb, beta, c, p->lc, c, p->lc, &p->cand[i],
                             g->workspace, TT_GEMM_WORKSPACE, s) == CUBLAS_STATUS_SUCCESS;
      if (err == cudaSuccess) err = cudaEventRecord(e1, s);
      if (err == cudaSuccess) err = cudaEventSynchronize(e1);
      float ms = 0.0f;
      if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, e0, e1);
      if (err == cudaSuccess) best[i] = !ran ? -1.0f : (round == 0 || ms < best[i] ? ms : best[i]);
    }
  }
  if (e1) cudaEventDestroy(e1);
  if (e0) cudaEventDestroy(e0);
  if (err == cudaSuccess) {
    int won = -1;
    for (int i = 0; i < p->ncand; i++)
      if (best[i] >= 0.0f && (won < 0 || best[i] < best[won])) won = i;
    if (won > 0 && best[0] >= 0.0f && best[won] > best[0] * (1.0f - TT_GEMM_TUNE_MARGIN)) won = 0;
    if (won >= 0) p->algo = p->cand[won];
  }
  p->ncand = 0;
  if (err != cudaSuccess) return tt_cuda_fail(err, "gemm autotune (events)", __FILE__, __LINE__);
  return TT_OK;
}

/* C[b, i, j] = beta * C[b, i, j] + bias[j], C not read when beta is 0 (as
 * BLAS): what a GEMM with k = 0 leaves. bias may be NULL. */
__global__ void tt_gemm_scale_c(int dtype, int64_t batch, int64_t m, int64_t n, int64_t ldc, int64_t stride_c,
                                double beta, void *c, const void *bias, int bias_dtype) {
  int64_t total = batch * m * n;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
    int64_t j = t % n, i = t / n % m, b = t / n / m;
    int64_t off = b * stride_c + i * ldc + j;
    double v = beta == 0.0 ? 0.0 : beta * tt_d_load_float<double>(dtype, c, off);
    if (bias) v += tt_d_load_float<double>(bias_dtype, bias, j);
    if (dtype == TT_F64) tt_d_store_float<double>(dtype, c, off, v);
    else tt_d_store_float<float>(dtype, c, off, (float)v);
  }
}

/* The device's handle and workspace, made on first use (g->lock held). */
static tt_status tt_gemm_dev_init(tt_gemm_dev *g) {
  if (g->ready) return TT_OK;
  TT_LT_CHECK(cublasLtCreate(&g->lt));
  cudaError_t err = cudaMalloc(&g->workspace, TT_GEMM_WORKSPACE);
  if (err != cudaSuccess) {
    cublasLtDestroy(g->lt);
    g->workspace = NULL;
    return tt_cuda_fail(err, "cudaMalloc(gemm workspace)", __FILE__, __LINE__);
  }
  g->ready = 1;
  return TT_OK;
}

/* TITAN_CUDA_GEMM_API: 0 lt (unset, empty or "lt"), 1 cublas, -1 anything else. */
static int tt_gemm_api(void) {
  const char *e = getenv("TITAN_CUDA_GEMM_API");
  if (!e || !*e || !strcmp(e, "lt")) return 0;
  return !strcmp(e, "cublas") ? 1 : -1;
}

/* The product through cuBLAS (g->lock held): column-major C^T = op(B)^T op(A)^T
 * as for cuBLASLt, cuBLAS's first operand our B. */
static tt_status tt_gemm_cublas(tt_gemm_dev *g, cudaStream_t s, cudaDataType_t t, cublasComputeType_t ct, int trans_a,
                                int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k, const void *alpha,
                                const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                                int64_t stride_b, const void *beta, void *c, int64_t ldc, int64_t stride_c) {
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
    return tt_error_set(TT_ERR_INVALID, "cuda gemm (cublas): %lldx%lldx%lld (ld %lld/%lld/%lld) beyond cuBLAS's int "
                        "sizes; expected TITAN_CUDA_GEMM_API=lt", (long long)m, (long long)n, (long long)k,
                        (long long)lda, (long long)ldb, (long long)ldc);
  if (!g->blas) {
    TT_LT_CHECK(cublasCreate(&g->blas));
    cublasStatus_t w = cublasSetWorkspace(g->blas, g->workspace, TT_GEMM_WORKSPACE);
    if (w != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(g->blas);
      g->blas = NULL;
      return tt_lt_fail(w, "cublasSetWorkspace", __FILE__, __LINE__);
    }
  }
  TT_LT_CHECK(cublasSetStream(g->blas, s));
  const cublasOperation_t opa = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, opb = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  TT_LT_CHECK(cublasGemmStridedBatchedEx(g->blas, opa, opb, (int)n, (int)m, (int)k, alpha, b, t, (int)ldb,
                                         batch > 1 ? stride_b : 0, a, t, (int)lda, batch > 1 ? stride_a : 0, beta, c,
                                         t, (int)ldc, batch > 1 ? stride_c : 0, (int)batch, ct, CUBLAS_GEMM_DEFAULT));
  return TT_OK;
}

/* Before a graph capture, which must not allocate (graph.cu). */
extern "C" tt_status tt_cuda_gemm_prepare(int device) {
  if (device < 0 || device >= TT_CUDA_MAX_DEVICES)
    return tt_error_set(TT_ERR_DEVICE, "cuda gemm: device %d beyond the %d supported", device, TT_CUDA_MAX_DEVICES);
  tt_gemm_dev *g = &tt_gemm_devs[device];
  std::lock_guard<std::mutex> guard(g->lock);
  return tt_gemm_dev_init(g);
}

extern "C" tt_status tt_cuda_gemm(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                                  double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b,
                                  int64_t ldb, int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c,
                                  const void *bias, int bias_dtype, int flags) {
  cudaDataType_t t, scale = CUDA_R_32F;
  cublasComputeType_t ct = CUBLAS_COMPUTE_32F;
  size_t es;
  switch (dtype) {
    case TT_F32:
      t = CUDA_R_32F;
      es = 4;
      if (flags & TT_GEMM_TF32) ct = CUBLAS_COMPUTE_32F_FAST_TF32;
      break;
    case TT_BF16: t = CUDA_R_16BF; es = 2; break;
    case TT_F16: t = CUDA_R_16F; es = 2; break;
    case TT_F64: t = CUDA_R_64F; es = 8; scale = CUDA_R_64F; ct = CUBLAS_COMPUTE_64F; break;
    default: return tt_error_set(TT_ERR_DTYPE, "cuda gemm: dtype %d not supported (f32, f64, bf16, f16)", dtype);
  }
  if (bias && bias_dtype != dtype)
    return tt_error_set(TT_ERR_DTYPE, "cuda gemm: bias dtype %d with dtype %d (expected the same)", bias_dtype, dtype);
  if (batch <= 0 || m <= 0 || n <= 0) return TT_OK;
  if (batch > 1 && stride_c == 0)
    return tt_error_set(TT_ERR_INVALID, "cuda gemm: batch %lld with stride_c 0 (C cannot be broadcast)",
                        (long long)batch);
  if (batch > INT32_MAX) return tt_error_set(TT_ERR_INVALID, "cuda gemm: batch %lld too large", (long long)batch);

  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;

  if (k <= 0) {
    if (beta == 1.0 && !bias) return TT_OK;
    tt_gemm_scale_c<<<tt_cuda_blocks(batch * m * n), TT_CUDA_THREADS, 0, s>>>(dtype, batch, m, n, ldc, stride_c, beta,
                                                                              c, bias, bias_dtype);
    TT_CUDA_CHECK_LAUNCH("tt_gemm_scale_c");
    return TT_OK;
  }

  const int api = tt_gemm_api();
  if (api < 0)
    return tt_error_set(TT_ERR_INVALID, "cuda gemm: TITAN_CUDA_GEMM_API=%s: expected lt or cublas",
                        getenv("TITAN_CUDA_GEMM_API"));
  tt_gemm_dev *g = &tt_gemm_devs[device];
  std::lock_guard<std::mutex> guard(g->lock);
  if ((st = tt_gemm_dev_init(g)) != TT_OK) return st;
  if (api == 1 && !bias) {
    float alpha_f = (float)alpha, beta_f = (float)beta;
    return tt_gemm_cublas(g, s, t, ct, trans_a, trans_b, batch, m, n, k,
                          dtype == TT_F64 ? (const void *)&alpha : (const void *)&alpha_f, a, lda, stride_a, b, ldb,
                          stride_b, dtype == TT_F64 ? (const void *)&beta : (const void *)&beta_f, c, ldc, stride_c);
  }

  /* The bias rides in the epilogue; where cuBLASLt has no algorithm with
   * it (f64, or odd alignments), the plain GEMM runs and a small kernel adds
   * the bias after it (the shape's refusal is cached like a plan). */
  const void *epi_bias = bias;
  for (int attempt = 0; attempt < 2; attempt++) {
    tt_gemm_key key;
    memset(&key, 0, sizeof key); /* keys compare with memcmp */
    key.dtype = dtype;
    key.trans_a = trans_a != 0;
    key.trans_b = trans_b != 0;
    key.align_a = tt_gemm_align(a, batch, stride_a, es);
    key.align_b = tt_gemm_align(b, batch, stride_b, es);
    key.align_c = tt_gemm_align(c, batch, stride_c, es);
    key.bias_dtype = epi_bias ? bias_dtype : -1;
    key.align_bias = epi_bias ? tt_gemm_align(epi_bias, 1, 0, 4) : 0;
    key.tf32 = ct == CUBLAS_COMPUTE_32F_FAST_TF32;
    key.tune = (flags & TT_GEMM_TUNE) != 0;
    key.batch = batch;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    if (batch > 1) {
      key.stride_a = stride_a;
      key.stride_b = stride_b;
      key.stride_c = stride_c;
    }

    tt_gemm_plan *p = tt_gemm_plan_find(g, &key);
    if (!p) {
      p = tt_gemm_plan_slot(g);
      st = tt_gemm_plan_build(g, p, &key, t, ct, scale, epi_bias);
      if (st != TT_OK) {
        tt_gemm_plan_release(p);
        if (!epi_bias) return st;
        p->used = 1;
        p->no_algo = 1;
        p->key = key;
      }
    } else if (epi_bias && !p->no_algo && (st = tt_gemm_set_bias(p->op, epi_bias)) != TT_OK) {
      return st;
    }
    if (p->no_algo) {
      epi_bias = NULL;
      continue;
    }

    float alpha_f = (float)alpha, beta_f = (float)beta;
    const void *pa = dtype == TT_F64 ? (const void *)&alpha : (const void *)&alpha_f;
    const void *pb = dtype == TT_F64 ? (const void *)&beta : (const void *)&beta_f;
    if (p->ncand && beta == 0.0) {
      cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(s, &cap) == cudaSuccess && cap == cudaStreamCaptureStatusNone &&
          (st = tt_gemm_tune(g, p, s, pa, pb, a, b, c)) != TT_OK)
        return st;
    }
    TT_LT_CHECK(cublasLtMatmul(g->lt, p->op, pa, b, p->la, a, p->lb, pb, c, p->lc, c, p->lc, &p->algo, g->workspace,
                               TT_GEMM_WORKSPACE, s));
    break;
  }
  if (bias && !epi_bias) {
    tt_gemm_scale_c<<<tt_cuda_blocks(batch * m * n), TT_CUDA_THREADS, 0, s>>>(dtype, batch, m, n, ldc, stride_c, 1.0,
                                                                              c, bias, bias_dtype);
    TT_CUDA_CHECK_LAUNCH("tt_gemm_scale_c (bias)");
  }
  return TT_OK;
}

/* ---- fp8 ------------------------------------------------------------------ */

static int tt_gemm_f8_type(int dtype, cudaDataType_t *t) {
  switch (dtype) {
    case TT_F8E4M3: *t = CUDA_R_8F_E4M3; return 1;
    case TT_F8E5M2: *t = CUDA_R_8F_E5M2; return 1;
    default: return 0;
  }
}

static tt_status tt_gemm_f8_plan_build(tt_gemm_dev *g, tt_gemm_plan *p, const tt_gemm_key *q, cudaDataType_t ta,
                                       cudaDataType_t tb, cudaDataType_t tc) {
  memset(p, 0, sizeof *p);
  const cublasOperation_t opa = CUBLAS_OP_T, opb = CUBLAS_OP_N;
  TT_LT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  const int8_t fast = (int8_t)q->fast;
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  tt_status st;
  if ((st = tt_gemm_layout(&p->la, tb, q->k, q->n, q->ldb, 1, 0)) != TT_OK) return st;
  if ((st = tt_gemm_layout(&p->lb, ta, q->k, q->m, q->lda, 1, 0)) != TT_OK) return st;
  if ((st = tt_gemm_layout(&p->lc, tc, q->n, q->m, q->ldc, 1, 0)) != TT_OK) return st;
  cublasLtMatmulPreference_t pref;
  TT_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t al[4] = {(uint32_t)q->align_b, (uint32_t)q->align_a, (uint32_t)q->align_c, (uint32_t)q->align_c};
  cublasStatus_t s = tt_gemm_pref(pref, al);
  cublasLtMatmulHeuristicResult_t h;
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(g->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &h, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED)
    return tt_lt_fail(s, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || found == 0)
    return tt_error_set(TT_ERR_UNSUPPORTED,
                        "cuda float8 matmul: cuBLASLt has no fp8 algorithm for m %lld, n %lld, k %lld (a dtype %d, "
                        "b dtype %d, out dtype %d, alignment %d/%d/%d); fp8 GEMMs need compute capability 8.9 or "
                        "newer and k and n multiples of 16",
                        (long long)q->m, (long long)q->n, (long long)q->k, q->a8, q->b8, q->dtype, q->align_a,
                        q->align_b, q->align_c);
  p->algo = h.algo;
  p->key = *q;
  p->used = 1;
  return TT_OK;
}

extern "C" tt_status tt_cuda_gemm_float8(int a_dtype, int b_dtype, int c_dtype, int64_t m, int64_t n, int64_t k,
                                         const void *a, const void *b, const float *sa, const float *sb, double beta,
                                         void *c, int fast_accum) {
  cudaDataType_t ta, tb, tc;
  size_t es;
  if (!tt_gemm_f8_type(a_dtype, &ta) || !tt_gemm_f8_type(b_dtype, &tb) ||
      (a_dtype == TT_F8E5M2 && b_dtype == TT_F8E5M2))
    return tt_error_set(TT_ERR_DTYPE, "cuda float8 matmul: operand dtypes %d and %d (expected e4m3 or e5m2, not both "
                        "e5m2)", a_dtype, b_dtype);
  switch (c_dtype) {
    case TT_F32: tc = CUDA_R_32F; es = 4; break;
    case TT_BF16: tc = CUDA_R_16BF; es = 2; break;
    case TT_F16: tc = CUDA_R_16F; es = 2; break;
    default: return tt_error_set(TT_ERR_DTYPE, "cuda float8 matmul: out dtype %d (expected f32, bf16, f16)", c_dtype);
  }
  if (m <= 0 || n <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  if (k <= 0) {
    if (beta == 1.0) return TT_OK;
    tt_gemm_scale_c<<<tt_cuda_blocks(m * n), TT_CUDA_THREADS, 0, s>>>(c_dtype, 1, m, n, n, 0, beta, c, NULL, 0);
    TT_CUDA_CHECK_LAUNCH("tt_gemm_scale_c");
    return TT_OK;
  }
  tt_gemm_dev *g = &tt_gemm_devs[device];
  std::lock_guard<std::mutex> guard(g->lock);
  if ((st = tt_gemm_dev_init(g)) != TT_OK) return st;
  tt_gemm_key key;
  memset(&key, 0, sizeof key);
  key.dtype = c_dtype;
  key.a8 = a_dtype;
  key.b8 = b_dtype;
  key.fast = fast_accum != 0;
  key.trans_b = 1;
  key.align_a = tt_gemm_align(a, 1, 0, 1);
  key.align_b = tt_gemm_align(b, 1, 0, 1);
  key.align_c = tt_gemm_align(c, 1, 0, es);
  key.bias_dtype = -1;
  key.batch = 1;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = k;
  key.ldb = k;
  key.ldc = n;
  tt_gemm_plan *p = tt_gemm_plan_find(g, &key);
  if (!p) {
    p = tt_gemm_plan_slot(g);
    if ((st = tt_gemm_f8_plan_build(g, p, &key, ta, tb, tc)) != TT_OK) {
      tt_gemm_plan_release(p);
      return st;
    }
  }
  /* cuBLASLt's A is our B and its B our A: their scales swap likewise */
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof sb));
  TT_LT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof sa));
  const float alpha_f = 1.0f, beta_f = (float)beta;
  TT_LT_CHECK(cublasLtMatmul(g->lt, p->op, &alpha_f, b, p->la, a, p->lb, &beta_f, c, p->lc, c, p->lc, &p->algo,
                             g->workspace, TT_GEMM_WORKSPACE, s));
  return TT_OK;
}
