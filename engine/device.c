/* device.c — which backend serves a device, and process-wide settings. */
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <unistd.h>

#include "internal.h"

#ifdef TITAN_HAVE_CUDA
int tt_cuda_device_count_impl(void);
const char *tt_cuda_info_impl(void);
tt_status tt_cuda_memory_info_impl(int device, int64_t *free_bytes, int64_t *total_bytes);
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

const char *tt_cuda_info(void) {
#ifdef TITAN_HAVE_CUDA
  return tt_cuda_info_impl();
#else
  return "not built (TITAN_CUDA=OFF)";
#endif
}

/* MemTotal and MemAvailable of /proc/meminfo (kB), else sysconf's pages. */
static tt_status tt_host_memory_info(int64_t *free_bytes, int64_t *total_bytes) {
  long long total_kb = -1, avail_kb = -1;
  FILE *f = fopen("/proc/meminfo", "r");
  if (f) {
    char line[256];
    while (fgets(line, sizeof line, f)) {
      long long v;
      if (sscanf(line, "MemTotal: %lld kB", &v) == 1) total_kb = v;
      else if (sscanf(line, "MemAvailable: %lld kB", &v) == 1) avail_kb = v;
    }
    fclose(f);
  }
  long page = sysconf(_SC_PAGESIZE);
  if (total_kb < 0) {
    long n = sysconf(_SC_PHYS_PAGES);
    if (n <= 0 || page <= 0) return tt_error_set(TT_ERR_UNSUPPORTED, "memory_info: cannot read the host's memory size");
    total_kb = (long long)n * page / 1024;
  }
  if (avail_kb < 0) {
    long n = sysconf(_SC_AVPHYS_PAGES);
    avail_kb = n > 0 && page > 0 ? (long long)n * page / 1024 : total_kb;
  }
  *total_bytes = (int64_t)total_kb * 1024;
  *free_bytes = (int64_t)avail_kb * 1024;
  return TT_OK;
}

tt_status tt_device_memory_info(tt_device dev, int64_t *free_bytes, int64_t *total_bytes) {
  if (!free_bytes || !total_bytes) return tt_error_set(TT_ERR_INVALID, "memory_info: NULL output");
  char name[32];
  switch (dev.type) {
    case TT_CPU: return tt_host_memory_info(free_bytes, total_bytes);
    case TT_CUDA:
#ifdef TITAN_HAVE_CUDA
      if (dev.index >= 0 && dev.index < tt_cuda_device_count())
        return tt_cuda_memory_info_impl(dev.index, free_bytes, total_bytes);
#endif
      return tt_error_set(TT_ERR_INVALID, "memory_info: %s: %s", tt_device_name(dev, name, sizeof name),
                          tt_cuda_device_count() ? "no such ordinal" : "no CUDA device or build");
    default:
      return tt_error_set(TT_ERR_INVALID, "memory_info: %s has no memory to report",
                          tt_device_name(dev, name, sizeof name));
  }
}

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

tt_status tt_cuda_attention_graph_check(int backward, int dtype, int causal, int deterministic, int64_t B, int64_t T,
                                        int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int sm,
                                        const char *deviceprop_json, int *accepted, char *report, size_t report_len) {
  (void)backward, (void)dtype, (void)causal, (void)deterministic, (void)B, (void)T, (void)S, (void)Hq, (void)Hkv;
  (void)D, (void)sm, (void)deviceprop_json;
  if (accepted) *accepted = 0;
  if (report && report_len) report[0] = '\0';
  return tt_error_set(TT_ERR_UNSUPPORTED, "attention graph check: this build has no CUDA backend (TITAN_CUDA=OFF)");
}
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

/* The engine's op names for the kernels' fault codes (kernels.h). */
static const char *tt_fault_op_name(int op) {
  static const char *names[] = {"?",         "index_select", "index_add",          "gather",
                                "scatter_add", "embedding",  "embedding_backward", "cross_entropy",
                                "cross_entropy_backward"};
  return op > TT_FAULT_NONE && op <= TT_FAULT_CROSS_ENTROPY_BACKWARD ? names[op] : "an index op";
}

tt_status tt_device_report(tt_device dev) {
  const tt_kernels *be = tt_backend(dev);
  if (!be || !be->check_errors) return TT_OK;
  tt_index_fault f;
  TT_TRY(be->check_errors(dev.index, &f));
  if (f.op == TT_FAULT_NONE) return TT_OK;
  char dn[24];
  return tt_error_set(TT_ERR_INDEX,
                      "%s: index %lld at position %lld is out of range [0, %lld) (%s; detected at the next "
                      "synchronization)",
                      tt_fault_op_name(f.op), (long long)f.index, (long long)f.position, (long long)f.bound,
                      tt_device_name(dev, dn, sizeof dn));
}

tt_status tt_device_synchronize(tt_device dev) {
  char dn[24];
  if (dev.type == TT_META) return TT_OK;
  const tt_kernels *be = tt_backend(dev);
  if (!be)
    return tt_error_set(TT_ERR_DEVICE, "synchronize: %s is not available in this build or on this machine",
                        tt_device_name(dev, dn, sizeof dn));
  TT_TRY(be->synchronize(dev.index));
  return tt_device_report(dev);
}

int tt_same_device(tt_device a, tt_device b) { return a.type == b.type && (a.type != TT_CUDA || a.index == b.index); }

int tt_num_threads(void) { return omp_get_max_threads(); }

void tt_set_num_threads(int n) {
  if (n > 0) omp_set_num_threads(n);
}

/* Process-wide switches read by every attention call (deterministic, the
 * plans are keyed by it) and every matmul (TF32), on whichever thread runs
 * the op: atomics, and a change applies to the next call. */
static atomic_int tt_deterministic_on = 0;

void tt_set_deterministic(int on) { atomic_store(&tt_deterministic_on, on != 0); }

int tt_deterministic(void) { return atomic_load(&tt_deterministic_on); }

static atomic_int tt_tf32 = 0;

void tt_set_allow_tf32(int on) { atomic_store(&tt_tf32, on != 0); }

int tt_allow_tf32(void) { return atomic_load(&tt_tf32); }

static atomic_int tt_tune = 0;

void tt_set_gemm_autotune(int on) { atomic_store(&tt_tune, on != 0); }

int tt_gemm_autotune(void) { return atomic_load(&tt_tune); }

const char *tt_version(void) { return TITAN_VERSION; }
