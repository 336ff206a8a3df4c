/*
 * cuda_common.h — what the CUDA backend's files share (CUDA C++ only; the
 * engine never includes it). Everything the engine calls has C linkage.
 *
 * Device selection: the mem_* and synchronize entries take a device ordinal
 * and make it current on the calling thread; copy, fill and gemm take none
 * and run on the thread's current device (so on the device of the last
 * mem_* call), on that device's compute stream.
 */
#ifndef TT_KERNELS_CUDA_COMMON_H
#define TT_KERNELS_CUDA_COMMON_H

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "../kernels.h"

/* Provided by the engine (engine/error.c): formats into the thread-local
 * last-error buffer and returns `status`. */
__attribute__((format(printf, 2, 3))) tt_status tt_error_set(int status, const char *fmt, ...);

/* The number of CUDA devices; 0 when the driver or the devices are missing. */
int tt_cuda_device_count_impl(void);
/* "CUDA runtime 13.0, driver 13.0, cuBLASLt 130000, cuDNN 91300, NCCL 22707". */
const char *tt_cuda_info_impl(void);
/* The device's compute stream and its stream reserved for collectives
 * (cudaStream_t, created non-blocking on first use); NULL on failure. */
void *tt_cuda_stream(int device);
void *tt_cuda_comm_stream(int device);

/* Table entries defined in copy.cu and gemm.cu. */
tt_status tt_cuda_copy(int ndim, const int64_t *shape, int src_dtype, const void *src, const int64_t *src_strides,
                       int dst_dtype, void *dst, const int64_t *dst_strides);
tt_status tt_cuda_fill(int dtype, int64_t n, double value, void *dst);
tt_status tt_cuda_gemm(int dtype, int trans_a, int trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       double alpha, const void *a, int64_t lda, int64_t stride_a, const void *b, int64_t ldb,
                       int64_t stride_b, double beta, void *c, int64_t ldc, int64_t stride_c);
}

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

/* Blocks for a grid-stride loop over n elements. */
static inline unsigned int tt_cuda_blocks(int64_t n) {
  int64_t b = (n + TT_CUDA_THREADS - 1) / TT_CUDA_THREADS;
  const int64_t cap = 65536; /* the loop covers the rest; keeps launches cheap for huge n */
  return (unsigned int)(b < 1 ? 1 : (b > cap ? cap : b));
}

#endif
