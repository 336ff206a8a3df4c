/*
 * cuemu_internal.h — what runtime.cpp lends the emulated libraries
 * (cublaslt.cpp, nccl.cpp): enqueueing on a stream (or into its capture) and
 * telling device memory from host memory.
 */
#ifndef TT_CUEMU_INTERNAL_H
#define TT_CUEMU_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>

#include <functional>

/* Runs fn now, or records it when stream s is being captured. */
cudaError_t tt_emu_enqueue(cudaStream_t s, const char *what, std::function<void()> fn);
/* 0: [p, p + n) lies in one device block (*device set); 1: pinned host
 * memory; -1: other host memory. Dies when p is inside a device block but
 * the range runs past its end. */
int tt_emu_classify(const void *p, size_t n, int *device);
[[noreturn]] void tt_emu_die(const char *fmt, ...);

#endif
