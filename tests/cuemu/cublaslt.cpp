/*
 * cublaslt.cpp — cuemu's cuBLASLt (and the few cuBLAS calls of
 * TITAN_CUDA_GEMM_API=cublas): the calls kernels/cuda/gemm.cu makes, with
 * their documented column-major semantics, computed on the host.
 *
 * D = alpha op(A) op(B) + beta C (+ bias[i] on row i with the BIAS
 * epilogue), every matrix column-major with its layout's rows, cols and
 * leading dimension, batched by BATCH_COUNT and STRIDED_BATCH_OFFSET. The
 * result rounds once to D's type; FAST_TF32 rounds A and B to TF32 first. beta == 0 does
 * not read C (which may hold NaN), as in BLAS. The products are the CPU
 * backend's GEMM (OpenBLAS) in f32, or f64 for f64 operands. fp8 operands
 * (e4m3, e5m2) are widened exactly and the product times the A and B scale
 * pointers' values, read when the GEMM runs; cuBLASLt's fp8 rules are
 * enforced (both fp8, not both e5m2, the TN layout, f32 compute, leading
 * dimensions multiples of 16, 16-byte aligned operands).
 *
 * Checked as cuBLASLt would refuse it, so gemm.cu's row-major mapping is
 * tested for real: op(A) m x k, op(B) k x n, C and D m x n; ld >= rows;
 * a batch count every layout agrees on; pointers aligned as the preference
 * promised the heuristic; a workspace no bigger than the preference's.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdint.h>
#include <atomic>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cuemu_internal.h"

extern "C" {
#include "kernels.h" /* the CPU backend's GEMM does the arithmetic */
#include "dtype_conv.h" /* fp8 operands widened as the CPU backend widens them */
}

namespace {

struct layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;
};

struct desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void *bias = NULL;
  int bias_type = -1; /* -1: D's */
  const float *a_scale = NULL, *b_scale = NULL; /* fp8 operands' device scales (NULL: 1) */
};

bool is_f8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

struct pref {
  uint64_t workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256}; /* A, B, C, D: cuBLASLt's defaults */
};

/* What the heuristic promised, kept in the algo's opaque words. */
struct algo_words {
  uint64_t magic;
  uint32_t align[4];
  uint64_t workspace;
  uint32_t index; /* which of the heuristic's candidates (they all compute alike here) */
};
const uint64_t ALGO_MAGIC = 0x6375656d75616c67ull;

int elem_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
    case CUDA_R_16F:
    case CUDA_R_16BF: return 2;
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2: return 1;
    default: return 0;
  }
}

double load(cudaDataType_t t, const void *p, size_t i) {
  switch (t) {
    case CUDA_R_32F: return ((const float *)p)[i];
    case CUDA_R_64F: return ((const double *)p)[i];
    case CUDA_R_16F: return (double)__half2float(((const __half *)p)[i]);
    case CUDA_R_8F_E4M3: return (double)tt_f8_to_f32(((const uint8_t *)p)[i], 1);
    case CUDA_R_8F_E5M2: return (double)tt_f8_to_f32(((const uint8_t *)p)[i], 0);
    default: return (double)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
  }
}

void store(cudaDataType_t t, void *p, size_t i, double v) {
  switch (t) {
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_64F: ((double *)p)[i] = v; break;
    /* via float, as a kernel with an f32 accumulator rounds */
    case CUDA_R_16F: ((__half *)p)[i] = __float2half_rn((float)v); break;
    default: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
  }
}

/* An f32 rounded to TF32 (10 mantissa bits, to nearest even), as the
 * tensor cores read f32 operands under CUBLAS_COMPUTE_32F_FAST_TF32. */
double tf32(double x) {
  float f = (float)x;
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
  memcpy(&f, &u, 4);
  return f;
}

bool aligned(const void *p, uint32_t a) { return a == 0 || (uintptr_t)p % a == 0; }

/* op(X) dimensions of a layout */
void op_dims(const layout *l, cublasOperation_t t, uint64_t *r, uint64_t *c) {
  *r = t == CUBLAS_OP_N ? l->rows : l->cols;
  *c = t == CUBLAS_OP_N ? l->cols : l->rows;
}

cublasStatus_t check_shapes(const desc *d, const layout *A, const layout *B, const layout *C, const layout *D) {
  uint64_t am, ak, bk, bn;
  op_dims(A, d->ta, &am, &ak);
  op_dims(B, d->tb, &bk, &bn);
  if (ak != bk || am != D->rows || bn != D->cols || C->rows != D->rows || C->cols != D->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  const layout *ls[4] = {A, B, C, D};
  for (const layout *l : ls)
    if (l->ld < (int64_t)l->rows || l->ld < 1 || elem_size(l->type) == 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (A->batch != D->batch || B->batch != D->batch || C->batch != D->batch) return CUBLAS_STATUS_INVALID_VALUE;
  if (C->type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (is_f8(A->type) || is_f8(B->type)) {
    /* fp8 (cuBLASLt's documented rules): both operands fp8, not both e5m2, the "TN" layout, f32 compute and
     * scale, D of f32, bf16 or f16, leading dimensions of A and B multiples of 16, no bias epilogue here */
    if (!is_f8(A->type) || !is_f8(B->type) || (A->type == CUDA_R_8F_E5M2 && B->type == CUDA_R_8F_E5M2) ||
        d->ta != CUBLAS_OP_T || d->tb != CUBLAS_OP_N || d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F ||
        D->type == CUDA_R_64F || A->ld % 16 || B->ld % 16 || d->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (A->type != B->type) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (d->ta != CUBLAS_OP_N && d->ta != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d->tb != CUBLAS_OP_N && d->tb != CUBLAS_OP_T) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d->epilogue != CUBLASLT_EPILOGUE_DEFAULT && d->epilogue != CUBLASLT_EPILOGUE_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool f64 = D->type == CUDA_R_64F;
  if (f64 != (d->compute == CUBLAS_COMPUTE_64F)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (f64 && d->epilogue == CUBLASLT_EPILOGUE_BIAS) return CUBLAS_STATUS_NOT_SUPPORTED; /* as on the GPU */
  if (d->compute == CUBLAS_COMPUTE_32F_FAST_TF32 && A->type != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

template <typename T> T *as(void *p) { return reinterpret_cast<T *>(p); }

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
  *h = (cublasLtHandle_t)malloc(16);
  return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  free(h);
  return CUBLAS_STATUS_SUCCESS;
}

size_t cublasLtGetVersion(void) { return 0; }

const char *cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_(other)";
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
  desc *x = new desc();
  x->compute = compute;
  x->scale = scale;
  *d = as<cublasLtMatmulDescOpaque_t>(x);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete as<desc>(d);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t dd, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
  desc *d = as<desc>(dd);
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      d->ta = (cublasOperation_t) * (const int32_t *)buf;
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      d->tb = (cublasOperation_t) * (const int32_t *)buf;
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      d->epilogue = (cublasLtEpilogue_t) * (const uint32_t *)buf;
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
      memcpy(&d->bias, buf, sizeof(void *));
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      d->bias_type = *(const int32_t *)buf;
      break;
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      if (size != sizeof(void *)) return CUBLAS_STATUS_INVALID_VALUE;
      memcpy(attr == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER ? &d->a_scale : &d->b_scale, buf, sizeof(void *));
      break;
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM: /* the same sums here */
      if (size != sizeof(int8_t)) return CUBLAS_STATUS_INVALID_VALUE;
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  layout *x = new layout();
  x->type = type;
  x->rows = rows;
  x->cols = cols;
  x->ld = ld;
  *l = as<cublasLtMatrixLayoutOpaque_t>(x);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete as<layout>(l);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t ll, cublasLtMatrixLayoutAttribute_t attr,
                                                const void *buf, size_t size) {
  layout *l = as<layout>(ll);
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      l->batch = *(const int32_t *)buf;
      break;
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      if (size != sizeof(int64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      l->stride = *(const int64_t *)buf;
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
  *p = as<cublasLtMatmulPreferenceOpaque_t>(new pref());
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete as<pref>(p);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pp,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
  pref *p = as<pref>(pp);
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      if (size != sizeof(uint64_t)) return CUBLAS_STATUS_INVALID_VALUE;
      p->workspace = *(const uint64_t *)buf;
      break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
      if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      int i = attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES   ? 0
              : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES ? 1
              : attr == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES ? 2
                                                                   : 3;
      p->align[i] = *(const uint32_t *)buf;
      break;
    }
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      if (size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pp, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned) {
  (void)h;
  *returned = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  cublasStatus_t s = check_shapes(as<desc>(op), as<layout>(a), as<layout>(b), as<layout>(c), as<layout>(d));
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const pref *p = as<pref>(pp);
  if (is_f8(as<layout>(a)->type) && (p->align[0] % 16 || p->align[1] % 16 || p->align[2] % 16 || p->align[3] % 16))
    return CUBLAS_STATUS_NOT_SUPPORTED; /* fp8 kernels take 16-byte aligned operands only */
  /* Up to EMU_CANDIDATES candidates, as cuBLASLt ranks several: an
   * autotuner has something to time (they compute alike; cuemu times
   * nothing, so the first stays the fastest). */
  const int EMU_CANDIDATES = 3;
  for (int i = 0; i < requested && i < EMU_CANDIDATES; i++) {
    memset(&results[i], 0, sizeof results[i]);
    algo_words w;
    memset(&w, 0, sizeof w);
    w.magic = ALGO_MAGIC;
    memcpy(w.align, p->align, sizeof w.align);
    w.workspace = p->workspace;
    w.index = (uint32_t)i;
    static_assert(sizeof w <= sizeof results[0].algo, "algo words fit the opaque algo");
    memcpy(&results[i].algo, &w, sizeof w);
    results[i].workspaceSize = 0;
    results[i].state = CUBLAS_STATUS_SUCCESS;
    results[i].wavesCount = 1.0f;
    *returned = i + 1;
  }
  return CUBLAS_STATUS_SUCCESS;
}

/* cublasLtMatmul calls that ran, and of them those with a candidate other
 * than the heuristic's first: a spec reads them around a GEMM (autotuning). */
static std::atomic<uint64_t> emu_matmuls{0}, emu_matmuls_other{0};
extern "C" void tt_emu_matmul_counts(uint64_t *all, uint64_t *other) {
  *all = emu_matmuls.load();
  *other = emu_matmuls_other.load();
}
/* cuBLAS's GEMMs that ran (TITAN_CUDA_GEMM_API=cublas). */
static std::atomic<uint64_t> emu_blas_gemms{0};
extern "C" uint64_t tt_emu_blas_gemm_count(void) { return emu_blas_gemms.load(); }

static void emu_matmul(const char *name, const desc &d, const layout &la, const layout &lb, const layout &lc,
                       const layout &ld, double al, double be, const void *A, const void *B, const void *C, void *D,
                       cudaStream_t stream);

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t adesc, const void *B, cublasLtMatrixLayout_t bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t cdesc, void *D,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_size, cudaStream_t stream) {
  (void)h;
  const desc d = *as<desc>(op);
  const layout la = *as<layout>(adesc), lb = *as<layout>(bdesc), lc = *as<layout>(cdesc), ld = *as<layout>(ddesc);
  cublasStatus_t s = check_shapes(&d, &la, &lb, &lc, &ld);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  if (!algo) return CUBLAS_STATUS_INVALID_VALUE;
  algo_words w;
  memcpy(&w, algo, sizeof w);
  if (w.magic != ALGO_MAGIC) return CUBLAS_STATUS_INVALID_VALUE;
  const void *ptrs[4] = {A, B, C, D};
  for (int i = 0; i < 4; i++)
    if (!aligned(ptrs[i], w.align[i]))
      tt_emu_die("cublasLtMatmul: operand %c at %p is not aligned to the %u bytes the heuristic was promised",
                 "ABCD"[i], ptrs[i], w.align[i]);
  if (workspace_size > w.workspace)
    tt_emu_die("cublasLtMatmul: a %zu-byte workspace where the preference allowed %llu", workspace_size,
               (unsigned long long)w.workspace);
  emu_matmuls++;
  if (w.index) emu_matmuls_other++;
  int dev;
  if (workspace_size && tt_emu_classify(workspace, workspace_size, &dev) != 0)
    tt_emu_die("cublasLtMatmul: the workspace is not device memory");
  const bool f64 = d.scale == CUDA_R_64F;
  const double al = f64 ? *(const double *)alpha : *(const float *)alpha;
  const double be = f64 ? *(const double *)beta : *(const float *)beta;
  emu_matmul("cublasLtMatmul", d, la, lb, lc, ld, al, be, A, B, C, D, stream);
  return CUBLAS_STATUS_SUCCESS;
}

/* D = al op(A) op(B) + be C (+ the bias), enqueued on stream; checked shapes. */
static void emu_matmul(const char *name, const desc &d, const layout &la, const layout &lb, const layout &lc,
                       const layout &ld, double al, double be, const void *A, const void *B, const void *C, void *D,
                       cudaStream_t stream) {
  int dev;
  uint64_t m = ld.rows, n = ld.cols, k;
  {
    uint64_t am;
    op_dims(&la, d.ta, &am, &k);
  }
  const int32_t batch = ld.batch;
  /* every operand inside device memory */
  /* bytes from a matrix's first element to one past its last, all batches */
  auto extent = [](const layout &l) {
    return (size_t)((l.batch - 1) * l.stride + (int64_t)(l.cols - 1) * l.ld + (int64_t)l.rows) * elem_size(l.type);
  };
  if (tt_emu_classify(A, extent(la), &dev) != 0 || tt_emu_classify(B, extent(lb), &dev) != 0 ||
      tt_emu_classify(D, extent(ld), &dev) != 0 || (be != 0.0 && tt_emu_classify(C, extent(lc), &dev) != 0))
    tt_emu_die("%s: an operand is not (entirely) in device memory", name);
  const bool bias = d.epilogue == CUBLASLT_EPILOGUE_BIAS;
  const cudaDataType_t bias_type = d.bias_type < 0 ? ld.type : (cudaDataType_t)d.bias_type;
  if (bias && (!d.bias || tt_emu_classify(d.bias, m * elem_size(bias_type), &dev) != 0))
    tt_emu_die("%s: the bias epilogue without a device bias vector of %llu elements", name, (unsigned long long)m);
  const void *bias_ptr = d.bias;
  if (is_f8(la.type) && (!d.a_scale || !d.b_scale || tt_emu_classify(d.a_scale, 4, &dev) != 0 ||
                         tt_emu_classify(d.b_scale, 4, &dev) != 0))
    tt_emu_die("%s: fp8 operands without both scale pointers in device memory", name);
  tt_emu_enqueue(stream, name, [=]() {
    /* (an fp8 GEMM's scales are read when it runs, as the GPU reads them: after the kernels before it) */
    const double scale = d.a_scale && d.b_scale ? (double)*d.a_scale * (double)*d.b_scale : 1.0;
    /* Dense copies, column-major: a is m x k, b is k x n; the product in
     * f64 for f64 and in f32 otherwise (cuBLASLt's accumulators), by the
     * CPU backend's row-major GEMM: column-major D = a b is row-major
     * D^T = b^T a^T, and a column-major matrix is its row-major transpose. */
    const bool wide = ld.type == CUDA_R_64F, fast = d.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    const int dt = wide ? TT_F64 : TT_F32;
    const size_t es = wide ? 8 : 4;
    std::vector<char> a(m * k * es), b(k * n * es), acc(m * n * es);
    auto put = [&](std::vector<char> &v, size_t i, double x) {
      if (fast) x = tf32(x);
      if (wide) ((double *)v.data())[i] = x;
      else ((float *)v.data())[i] = (float)x;
    };
    auto get = [&](const std::vector<char> &v, size_t i) {
      return wide ? ((const double *)v.data())[i] : (double)((const float *)v.data())[i];
    };
    for (int32_t bt = 0; bt < batch; bt++) {
      const char *pa = (const char *)A + (size_t)(bt * la.stride) * elem_size(la.type);
      const char *pb = (const char *)B + (size_t)(bt * lb.stride) * elem_size(lb.type);
      const char *pc = (const char *)C + (size_t)(bt * lc.stride) * elem_size(lc.type);
      char *pd = (char *)D + (size_t)(bt * ld.stride) * elem_size(ld.type);
      for (uint64_t p = 0; p < k; p++)
        for (uint64_t i = 0; i < m; i++)
          put(a, i + p * m, load(la.type, pa, d.ta == CUBLAS_OP_N ? i + p * la.ld : p + i * la.ld));
      for (uint64_t j = 0; j < n; j++)
        for (uint64_t p = 0; p < k; p++)
          put(b, p + j * k, load(lb.type, pb, d.tb == CUBLAS_OP_N ? p + j * lb.ld : j + p * lb.ld));
      tt_status st = tt_kernels_cpu()->gemm(dt, 0, 0, 1, (int64_t)n, (int64_t)m, (int64_t)k, 1.0, b.data(),
                                            (int64_t)k, 0, a.data(), (int64_t)m, 0, 0.0, acc.data(), (int64_t)m, 0,
                                            NULL, dt, 0);
      if (st != TT_OK) tt_emu_die("%s: the CPU GEMM failed (status %d)", name, (int)st);
      for (uint64_t j = 0; j < n; j++)
        for (uint64_t i = 0; i < m; i++) {
          double v = al * scale * get(acc, i + j * m);
          if (be != 0.0) v += be * load(lc.type, pc, i + j * lc.ld);
          if (bias) v += load(bias_type, bias_ptr, i);
          store(ld.type, pd, i + j * ld.ld, v);
        }
    }
  });
}

/* cuBLAS's handle: the stream and workspace it was given. */
struct cublasContext {
  cudaStream_t stream = NULL;
  void *workspace = NULL;
  size_t workspace_size = 0;
};

cublasStatus_t cublasCreate_v2(cublasHandle_t *h) {
  *h = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void *workspace, size_t bytes) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  int dev;
  if (bytes && tt_emu_classify(workspace, bytes, &dev) != 0)
    tt_emu_die("cublasSetWorkspace: the workspace is not device memory");
  h->workspace = workspace;
  h->workspace_size = bytes;
  return CUBLAS_STATUS_SUCCESS;
}

/* cuBLAS's column-major GEMM, checked as cuBLAS checks it (ld >= the stored
 * rows, sizes >= 0), computed as cublasLtMatmul's. */
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb, int m,
                                          int n, int k, const void *alpha, const void *A, cudaDataType Atype, int lda,
                                          long long int strideA, const void *B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void *beta, void *C, cudaDataType Ctype,
                                          int ldc, long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  (void)algo;
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || batchCount < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if (Atype != Btype || Atype != Ctype) return CUBLAS_STATUS_NOT_SUPPORTED;
  const int arows = transa == CUBLAS_OP_N ? m : k, brows = transb == CUBLAS_OP_N ? k : n;
  if (lda < (arows > 1 ? arows : 1) || ldb < (brows > 1 ? brows : 1) || ldc < (m > 1 ? m : 1))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0 || batchCount == 0) return CUBLAS_STATUS_SUCCESS;
  desc d;
  d.compute = computeType;
  d.scale = computeType == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F;
  d.ta = transa;
  d.tb = transb;
  layout la{Atype, (uint64_t)arows, (uint64_t)(transa == CUBLAS_OP_N ? k : m), lda, batchCount, strideA};
  layout lb{Btype, (uint64_t)brows, (uint64_t)(transb == CUBLAS_OP_N ? n : k), ldb, batchCount, strideB};
  layout lc{Ctype, (uint64_t)m, (uint64_t)n, ldc, batchCount, strideC};
  const bool f64 = d.scale == CUDA_R_64F;
  const double al = f64 ? *(const double *)alpha : *(const float *)alpha;
  const double be = f64 ? *(const double *)beta : *(const float *)beta;
  emu_blas_gemms++;
  emu_matmul("cublasGemmStridedBatchedEx", d, la, lb, lc, lc, al, be, A, B, C, C, h->stream);
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
