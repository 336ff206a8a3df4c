/* device.c — which backend serves a device, and process-wide settings. */
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>

#include "internal.h"

#ifdef TITAN_HAVE_CUDA
int tt_cuda_device_count_impl(void);
#endif

int tt_cuda_device_count(void) {
#ifdef TITAN_HAVE_CUDA
  static int count = -1; /* the driver is asked once: it is slow to start */
  if (count < 0) count = tt_cuda_device_count_impl();
  return count;
#else
  return 0;
#endif
}

int tt_cuda_available(void) { return tt_cuda_device_count() > 0; }

const tt_kernels *tt_backend(tt_device dev) {
  switch (dev.type) {
    case TT_CPU: return tt_kernels_cpu();
    case TT_CUDA:
#ifdef TITAN_HAVE_CUDA
      if (dev.index >= 0 && dev.index < tt_cuda_device_count()) return tt_kernels_cuda();
#endif
      return NULL;
    default: return NULL;
  }
}

#ifndef TITAN_HAVE_CUDA
const tt_kernels *tt_kernels_cuda(void) { return NULL; }
#endif

const char *tt_device_name(tt_device dev, char *buf, size_t len) {
  switch (dev.type) {
    case TT_CPU: snprintf(buf, len, "cpu"); break;
    case TT_CUDA: snprintf(buf, len, "cuda:%d", dev.index); break;
    case TT_META: snprintf(buf, len, "meta"); break;
    default: snprintf(buf, len, "device(%d)", dev.type);
  }
  return buf;
}

int tt_same_device(tt_device a, tt_device b) { return a.type == b.type && (a.type != TT_CUDA || a.index == b.index); }

int tt_num_threads(void) { return omp_get_max_threads(); }

void tt_set_num_threads(int n) {
  if (n > 0) omp_set_num_threads(n);
}

/* Atomic: every matmul reads it, on whichever thread runs the op. */
static atomic_int tt_tf32 = 0;

void tt_set_allow_tf32(int on) { atomic_store(&tt_tf32, on != 0); }

int tt_allow_tf32(void) { return atomic_load(&tt_tf32); }

const char *tt_version(void) { return TITAN_VERSION; }
