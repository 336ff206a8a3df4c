/*
 * runtime.cpp — cuemu's CUDA runtime: the cudart calls the backend makes,
 * implemented on the host (tests/cuemu/README.md), and the fibers that run
 * a kernel's threads.
 *
 * Execution. Work is done when it is enqueued, in the order enqueued: a
 * stream is an ordering the host already gives, an event is complete when
 * recorded. With TITAN_CUEMU_STREAMS=deferred each stream queues its work
 * instead and runs it when the host needs it done (emu_deferred). A kernel
 * runs its blocks one after another; the threads of a
 * block are fibers of the calling host thread, switched at __syncthreads,
 * at warp shuffles and when they return (cuemu_device.h). One kernel runs
 * at a time in the process.
 *
 * What the emulator checks, each a bug the hardware would show differently
 * or not at all:
 *   - launch configurations (block size, grid limits), as the launch would;
 *   - a warp shuffle that a lane of the warp never reaches, or lanes at
 *     different shuffles; threads of a block waiting at different
 *     barriers (a hang on the GPU): the process prints what and aborts;
 *   - memory: device blocks are mapped on their own, ending just before an
 *     inaccessible page, so a kernel or host write past the end of a block
 *     faults; copies must stay inside one block and match their kind
 *     (host->device needs a device destination, ...); fresh device and
 *     pinned blocks hold 0xFF bytes, so nothing can rely on zeros there;
 *     the kernels are built with UBSan's alignment check (CMakeLists.txt),
 *     so a misaligned vector access stops where a GPU would fault; a
 *     kernel's pointer arguments, and the pointers inside its struct
 *     arguments (tt_emu_ptrs), must be device or pinned memory
 *     (tt_emu_check_arg);
 *   - stream capture (CUDA graphs): work on a capturing stream is recorded
 *     with its arguments' values and replayed by cudaGraphLaunch; a call
 *     that would make the host wait for the device, allocate or free while
 *     the thread's capture mode forbids it fails with
 *     cudaErrorStreamCaptureUnsupported and invalidates the capture, whose
 *     end then reports cudaErrorStreamCaptureInvalidated, as CUDA does.
 *
 * Not emulated: timing and streams' work truly overlapping (deferred
 * streams show a missing event wait through the orders they take), data races between the threads of a kernel (fibers
 * switch only at barriers; TITAN_CUEMU_ORDER=reverse runs them the other
 * way round, which shows a missing barrier), the device's exact math
 * library (expf, logf).
 *
 * Devices: TITAN_CUEMU_DEVICES (default 1), each with TITAN_CUEMU_MEM_MB of
 * memory (default 8192) and 4 "SMs", compute capability 9.0.
 */
#include "cuemu_device.h" /* first: it defines __shared__ before the CUDA headers do */

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuemu_internal.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

/* ---- diagnostics ---------------------------------------------------------- */

void tt_emu_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "cuemu: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  fflush(stderr);
  abort();
}
#define emu_die tt_emu_die

static int emu_env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

/* ---- counters (tt_emu_counts_get) ------------------------------------------ */

/* What the host asked of the device: a spec reads them around a training
 * step to check it makes no host wait, allocation or free it should not. */
struct tt_emu_counts {
  uint64_t syncs;       /* cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize */
  uint64_t sync_copies; /* copies the host waits for: cudaMemcpy/cudaMemset, cudaMemcpyAsync to pageable memory */
  uint64_t mallocs, frees, host_allocs, host_frees;
  uint64_t kernels;
};
static std::atomic<uint64_t> emu_n_syncs{0}, emu_n_sync_copies{0}, emu_n_mallocs{0}, emu_n_frees{0},
    emu_n_host_allocs{0}, emu_n_host_frees{0}, emu_n_kernels{0};

extern "C" void tt_emu_counts_get(tt_emu_counts *out) {
  out->syncs = emu_n_syncs.load();
  out->sync_copies = emu_n_sync_copies.load();
  out->mallocs = emu_n_mallocs.load();
  out->frees = emu_n_frees.load();
  out->host_allocs = emu_n_host_allocs.load();
  out->host_frees = emu_n_host_frees.load();
  out->kernels = emu_n_kernels.load();
}

/* ---- fibers --------------------------------------------------------------- */

#if defined(__x86_64__)
/* Saves the callee-saved registers on the current stack, stores the stack
 * pointer in *from and resumes `to`. (MXCSR and the x87 control word are
 * callee-saved too, but nothing here changes them.) */
extern "C" void tt_emu_switch(void **from, void *to);
__asm__(
    ".text\n"
    ".globl tt_emu_switch\n"
    ".type tt_emu_switch,@function\n"
    "tt_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size tt_emu_switch,.-tt_emu_switch\n");
#endif

enum { F_RUN, F_SYNC, F_SHFL, F_DONE };

struct emu_fiber {
  tt_emu_thread_ids ids;
  int state;
  /* the shuffle this lane waits at */
  unsigned mask;
  int mode, arg, width;
  uint64_t bits, result;
  char *stack;
#if defined(__x86_64__)
  void *sp;
#else
  ucontext_t ctx;
#endif
};

static const size_t EMU_STACK = 256u << 10; /* the kernels' register arrays live here */

/* The threads of the block being run. A fiber that must wait (a shuffle,
 * a barrier, its end) switches straight to the next runnable fiber of its
 * warp or block; the last to arrive releases the others and goes on. The
 * scheduler (emu_run_block) starts the block and sorts out what the
 * fibers could not: the diagnostics. */
struct emu_block_runner {
  std::vector<emu_fiber> fibers;
  size_t n = 0;
  char *stacks = NULL;
  size_t nstacks = 0;
#if defined(__x86_64__)
  void *sched_sp = NULL;
#else
  ucontext_t sched;
#endif
  emu_fiber *cur = NULL;
  const std::function<void()> *body = NULL;
  const char *kernel = "";
};

thread_local tt_emu_thread_ids *tt_emu_ids = NULL;
static thread_local emu_block_runner *emu_runner = NULL;

static void emu_switch(emu_block_runner *r, emu_fiber *from, emu_fiber *to) {
  r->cur = to;
  tt_emu_ids = &to->ids;
#if defined(__x86_64__)
  tt_emu_switch(&from->sp, to->sp);
#else
  swapcontext(&from->ctx, &to->ctx);
#endif
}

static void emu_to_scheduler(emu_block_runner *r, emu_fiber *f) {
#if defined(__x86_64__)
  tt_emu_switch(&f->sp, r->sched_sp);
#else
  swapcontext(&f->ctx, &r->sched);
#endif
}

/* TITAN_CUEMU_ORDER=reverse runs the blocks of a grid and the threads of a
 * block between two barriers (or shuffles) from the last to the first. A
 * thread reading what another wrote with no barrier between them sees the
 * write in one order and not in the other, so a spec that passes both ways
 * has no such race that it exercises; the hardware gives no order at all. */
/* A two-valued setting: false for `off` (or unset), true for `on`; any
 * other value stops the process with one line and exit 2. */
static bool emu_env_switch(const char *name, const char *off, const char *on) {
  const char *o = getenv(name);
  if (!o || !*o || !strcmp(o, off)) return false;
  if (!strcmp(o, on)) return true;
  fprintf(stderr, "cuemu: %s=%s (expected %s or %s)\n", name, o, off, on);
  exit(2);
}

static bool emu_reverse(void) {
  static const bool rev = emu_env_switch("TITAN_CUEMU_ORDER", "forward", "reverse");
  return rev;
}

/* The next runnable fiber after f among [lo, hi), cyclically (before f,
 * in reverse order); NULL if none. */
static inline __attribute__((always_inline)) emu_fiber *emu_next_run(emu_block_runner *r, emu_fiber *f, size_t lo,
                                                                     size_t hi) {
  /* (no modulo: a shuffle waits here once a lane, ~10^8 times in a small
   * training step, and the division was a sixth of the emulator's time) */
  emu_fiber *fb = r->fibers.data();
  const size_t i = (size_t)(f - fb);
  if (!emu_reverse()) {
    for (size_t j = i + 1; j < hi; j++)
      if (fb[j].state == F_RUN) return &fb[j];
    for (size_t j = lo; j < i; j++)
      if (fb[j].state == F_RUN) return &fb[j];
  } else {
    for (size_t j = i; j-- > lo;)
      if (fb[j].state == F_RUN) return &fb[j];
    for (size_t j = hi; j-- > i + 1;)
      if (fb[j].state == F_RUN) return &fb[j];
  }
  return NULL;
}

static bool emu_resolve_warp(emu_block_runner *r, size_t w);

/* f waits (its state set): run another fiber, or release a completed
 * barrier or shuffle and go on, or leave it to the scheduler. */
static void emu_wait(emu_block_runner *r, emu_fiber *f) {
  const size_t i = (size_t)(f - r->fibers.data());
  size_t lo = 0, hi = r->n;
  if (f->state == F_SHFL) {
    lo = i / 32 * 32;
    hi = lo + 32 < r->n ? lo + 32 : r->n;
  }
  emu_fiber *next = emu_next_run(r, f, lo, hi);
  if (next) {
    emu_switch(r, f, next);
    return;
  }
  if (f->state == F_SHFL && emu_resolve_warp(r, i / 32)) return;
  if (f->state == F_SYNC) {
    bool all = true;
    for (size_t j = 0; j < r->n && all; j++) all = r->fibers[j].state == F_SYNC || r->fibers[j].state == F_DONE;
    if (all) { /* threads that returned count as arrived, as on sm_70+ */
      for (size_t j = 0; j < r->n; j++)
        if (r->fibers[j].state == F_SYNC) r->fibers[j].state = F_RUN;
      return;
    }
  }
  emu_to_scheduler(r, f);
}

static void emu_fiber_main(void) {
  emu_block_runner *r = emu_runner;
  emu_fiber *f = r->cur;
  (*r->body)();
  f->state = F_DONE;
  emu_fiber *next = emu_next_run(r, f, 0, r->n);
  if (next) emu_switch(r, f, next);
  else emu_to_scheduler(r, f);
  emu_die("a finished fiber was resumed");
}

static void emu_fiber_start(emu_fiber *f) {
#if defined(__x86_64__)
  /* The frame tt_emu_switch pops: r15..rbp, then the return address
   * (emu_fiber_main, entered with the stack aligned as after a call). */
  uintptr_t top = ((uintptr_t)(f->stack + EMU_STACK) & ~(uintptr_t)15) - 16;
  uint64_t *p = (uint64_t *)top;
  *p = (uint64_t)(uintptr_t)emu_fiber_main;
  for (int i = 1; i <= 6; i++) p[-i] = 0;
  f->sp = (void *)&p[-6];
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = EMU_STACK;
  f->ctx.uc_link = NULL;
  makecontext(&f->ctx, emu_fiber_main, 0);
#endif
}

static void emu_resume(emu_block_runner *r, emu_fiber *f) {
  r->cur = f;
  tt_emu_ids = &f->ids;
#if defined(__x86_64__)
  tt_emu_switch(&r->sched_sp, f->sp);
#else
  swapcontext(&r->sched, &f->ctx);
#endif
  tt_emu_ids = NULL;
}

static emu_block_runner *emu_runner_get(size_t nthreads) {
  static thread_local emu_block_runner runner;
  emu_block_runner *r = &runner;
  if (r->nstacks < nthreads) {
    if (r->stacks) munmap(r->stacks, r->nstacks * EMU_STACK);
    r->stacks = (char *)mmap(NULL, nthreads * EMU_STACK, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r->stacks == MAP_FAILED) emu_die("cannot map %zu fiber stacks", nthreads);
    /* the lowest page of each stack catches an overflow */
    for (size_t i = 0; i < nthreads; i++) mprotect(r->stacks + i * EMU_STACK, 4096, PROT_NONE);
    r->nstacks = nthreads;
  }
  r->fibers.resize(nthreads);
  r->n = nthreads;
  for (size_t i = 0; i < nthreads; i++) r->fibers[i].stack = r->stacks + i * EMU_STACK;
  return r;
}

void tt_emu_syncthreads(void) {
  emu_block_runner *r = emu_runner;
  if (!r || !r->cur) emu_die("__syncthreads outside a kernel");
  emu_fiber *f = r->cur;
  f->state = F_SYNC;
  emu_wait(r, f);
}

uint64_t tt_emu_shuffle(unsigned mask, uint64_t bits, int mode, int arg, int width) {
  emu_block_runner *r = emu_runner;
  if (!r || !r->cur) emu_die("warp shuffle outside a kernel");
  emu_fiber *f = r->cur;
  if (width <= 0 || width > 32 || (width & (width - 1)))
    emu_die("kernel %s: shuffle width %d (expected a power of 2 up to 32)", r->kernel, width);
  f->mask = mask;
  f->mode = mode;
  f->arg = arg;
  f->width = width;
  f->bits = bits;
  f->state = F_SHFL;
  emu_wait(r, f);
  return f->result;
}

static void emu_thread_name(const emu_fiber *f, char *buf, size_t n) {
  snprintf(buf, n, "block (%u,%u,%u) thread (%u,%u,%u)", f->ids.block.x, f->ids.block.y, f->ids.block.z,
           f->ids.thread.x, f->ids.thread.y, f->ids.thread.z);
}

/* When no lane of warp w can run: if they all wait at a shuffle, hand out
 * the values and mark them runnable (true). A lane that returned while the
 * others shuffle is a bug (dies); lanes at a barrier: not yet (false). */
static bool emu_resolve_warp(emu_block_runner *r, size_t w) {
  const size_t nthreads = r->n;
  size_t lo = w * 32, hi = lo + 32 < nthreads ? lo + 32 : nthreads;
  const emu_fiber *first = NULL;
  for (size_t i = lo; i < hi && !first; i++)
    if (r->fibers[i].state == F_SHFL) first = &r->fibers[i];
  if (!first) return false;
  for (size_t i = lo; i < hi; i++) {
    const emu_fiber *f = &r->fibers[i];
    if (f->state == F_SHFL) continue;
    if (f->state != F_DONE) return false; /* at a barrier or not yet there: it may still come */
    char a[96], b[96];
    emu_thread_name(first, a, sizeof a);
    emu_thread_name(f, b, sizeof b);
    emu_die("kernel %s: %s waits at a warp shuffle (mask 0x%08x) that lane %zu of its warp (%s) never reaches: it "
            "returned. On the GPU the result is undefined.",
            r->kernel, a, first->mask, i - lo, b);
  }
  for (size_t i = lo; i < hi; i++) {
    const emu_fiber *f = &r->fibers[i];
    if (f->mode != first->mode || f->width != first->width || f->mask != first->mask) {
      char a[96];
      emu_thread_name(f, a, sizeof a);
      emu_die("kernel %s: %s is at a different shuffle (mode %d width %d mask 0x%08x) than lane 0 of its warp (mode "
              "%d width %d mask 0x%08x)",
              r->kernel, a, f->mode, f->width, f->mask, first->mode, first->width, first->mask);
    }
    if (f->mask != 0xffffffffu && !(f->mask >> (i - lo) & 1u)) {
      char a[96];
      emu_thread_name(f, a, sizeof a);
      emu_die("kernel %s: %s shuffles with mask 0x%08x, which leaves out its own lane", r->kernel, a, f->mask);
    }
  }
  /* (width is a power of 2, checked by tt_emu_shuffle: masks, not the
   * three divisions a lane that took a tenth of the emulator's time) */
  const int m = first->width - 1;
  for (size_t i = lo; i < hi; i++) {
    emu_fiber *f = &r->fibers[i];
    const int lane = (int)(i - lo), base = lane & ~m;
    int src = f->mode == 0 ? base + (f->arg & m) : lane ^ f->arg;
    if (f->mode == 1 && (src & ~m) != base) src = lane; /* outside the segment: own value */
    if ((size_t)src + lo >= hi) emu_die("kernel %s: shuffle from lane %d beyond the block", r->kernel, src);
    f->result = r->fibers[lo + src].bits;
    f->state = F_RUN; /* (only the bits are read across lanes) */
  }
  return true;
}

static void emu_run_block(emu_block_runner *r, dim3 grid, dim3 block, dim3 bidx) {
  const size_t n = r->n;
  for (size_t i = 0; i < n; i++) {
    emu_fiber *f = &r->fibers[i];
    f->ids.thread = dim3((unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                         (unsigned)(i / ((size_t)block.x * block.y)));
    f->ids.block = bidx;
    f->ids.block_dim = block;
    f->ids.grid_dim = grid;
    f->state = F_RUN;
    emu_fiber_start(f);
  }
  const bool rev = emu_reverse();
  for (;;) {
    for (size_t k = 0; k < n; k++) {
      const size_t i = rev ? n - 1 - k : k;
      if (r->fibers[i].state == F_RUN) emu_resume(r, &r->fibers[i]);
    }
    size_t live = 0, waiting_sync = 0;
    for (size_t i = 0; i < n; i++) {
      if (r->fibers[i].state != F_DONE) live++;
      if (r->fibers[i].state == F_SYNC) waiting_sync++;
    }
    if (live == 0) return;
    bool progress = false;
    for (size_t w = 0; w * 32 < n; w++) progress |= emu_resolve_warp(r, w);
    if (progress) continue;
    if (waiting_sync == live) {
      for (size_t i = 0; i < n; i++)
        if (r->fibers[i].state == F_SYNC) r->fibers[i].state = F_RUN;
      continue;
    }
    /* some wait at __syncthreads while others of their warp wait at a shuffle */
    for (size_t i = 0; i < n; i++)
      if (r->fibers[i].state == F_SHFL) {
        char a[96];
        emu_thread_name(&r->fibers[i], a, sizeof a);
        emu_die("kernel %s: deadlock: %s waits at a warp shuffle while other lanes of its warp wait at "
                "__syncthreads",
                r->kernel, a);
      }
    emu_die("kernel %s: deadlock in block (%u,%u,%u)", r->kernel, bidx.x, bidx.y, bidx.z);
  }
}

static std::recursive_mutex emu_device_lock; /* one kernel at a time */

/* How each kernel read and wrote its full 16-byte chunks (tt_emu_chunks_get):
 * in one vector access, or split into element accesses, which on the GPU
 * moves the same bytes in 2 to 16 times as many instructions and falls well
 * short of HBM bandwidth. A spec reads them around a training step to check
 * the fused kernels take the vector path wherever the data allows it. */
struct tt_emu_chunk_count {
  const char *kernel;
  uint64_t launches, vector, split;
};
static std::mutex emu_chunk_lock;
static std::map<std::string, tt_emu_chunk_count> emu_chunks;
static thread_local tt_emu_chunk_count *emu_cur_chunks = NULL; /* the running kernel's (emu_device_lock) */

void tt_emu_note_chunk(bool vector) {
  if (emu_cur_chunks) (vector ? emu_cur_chunks->vector : emu_cur_chunks->split)++;
}

/* The kernels launched since the last reset, in name order; returns how many
 * there are (writes at most max). The names live until the next reset. */
extern "C" int tt_emu_chunks_get(tt_emu_chunk_count *out, int max) {
  std::lock_guard<std::mutex> guard(emu_chunk_lock);
  int n = 0;
  for (auto &kv : emu_chunks) {
    if (n < max) out[n] = kv.second;
    n++;
  }
  return n;
}

extern "C" void tt_emu_chunks_reset(void) {
  std::lock_guard<std::recursive_mutex> idle(emu_device_lock); /* no kernel holds a count */
  std::lock_guard<std::mutex> guard(emu_chunk_lock);
  emu_chunks.clear();
}

static tt_emu_chunk_count *emu_chunks_of(const char *kernel) {
  std::lock_guard<std::mutex> guard(emu_chunk_lock);
  auto it = emu_chunks.find(kernel);
  if (it == emu_chunks.end()) {
    it = emu_chunks.emplace(kernel, tt_emu_chunk_count{NULL, 0, 0, 0}).first;
    it->second.kernel = it->first.c_str();
  }
  it->second.launches++;
  return &it->second;
}

static void emu_run_kernel(const char *name, dim3 grid, dim3 block, const std::function<void()> &body) {
  std::lock_guard<std::recursive_mutex> guard(emu_device_lock);
  const size_t n = (size_t)block.x * block.y * block.z;
  emu_block_runner *saved = emu_runner;
  emu_block_runner *r = emu_runner_get(n);
  if (saved) emu_die("kernel %s launched from inside kernel %s", name, saved->kernel);
  emu_runner = r;
  r->body = &body;
  r->kernel = name;
  emu_cur_chunks = emu_chunks_of(name); /* map nodes stay put; a reset waits for the device lock */
  const size_t blocks = (size_t)grid.x * grid.y * grid.z;
  for (size_t k = 0; k < blocks; k++) {
    const size_t b = emu_reverse() ? blocks - 1 - k : k;
    emu_run_block(r, grid, block, dim3((unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                                       (unsigned)(b / ((size_t)grid.x * grid.y))));
  }
  emu_cur_chunks = NULL;
  emu_runner = NULL;
}

/* ---- errors --------------------------------------------------------------- */

static thread_local cudaError_t emu_last_error = cudaSuccess;

static cudaError_t emu_err(cudaError_t e) {
  if (e != cudaSuccess) emu_last_error = e;
  return e;
}

extern "C" cudaError_t cudaGetLastError(void) {
  cudaError_t e = emu_last_error;
  emu_last_error = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) { return emu_last_error; }

extern "C" const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    default: return "cudaError(other)";
  }
}

extern "C" const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    default: return cudaGetErrorName(e);
  }
}

/* ---- devices -------------------------------------------------------------- */

static int emu_ndev(void) {
  static int n = emu_env_int("TITAN_CUEMU_DEVICES", 1);
  return n;
}

static thread_local int emu_cur_dev = 0;

extern "C" cudaError_t cudaGetDeviceCount(int *n) {
  *n = emu_ndev();
  return *n > 0 ? cudaSuccess : emu_err(cudaErrorNoDevice);
}

extern "C" cudaError_t cudaGetDevice(int *d) {
  *d = emu_cur_dev;
  return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= emu_ndev()) return emu_err(cudaErrorInvalidDevice);
  emu_cur_dev = d;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int d) {
  if (d < 0 || d >= emu_ndev()) return emu_err(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMultiProcessorCount: *v = 4; break;
    case cudaDevAttrMaxThreadsPerBlock: *v = 1024; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *v = 2048; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *v = 48 << 10; break;
    default: return emu_err(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

/* Two blocks an SM for every kernel: kernels that size a launch to whole
 * waves then run several groups per emulated SM. */
extern "C" cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *n, const void *func, int block, size_t smem) {
  (void)smem;
  if (!n || !func || block <= 0 || block > 1024) return emu_err(cudaErrorInvalidValue);
  *n = 2;
  return cudaSuccess;
}

extern "C" cudaError_t cudaRuntimeGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDriverGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}

/* ---- memory ----------------------------------------------------------------- */

struct emu_block {
  size_t size;
  int device;
  char *map;
  size_t map_len;
};

static std::mutex emu_mem_lock;
static std::map<uintptr_t, emu_block> emu_dev_blocks; /* by start */
static std::map<uintptr_t, size_t> emu_pinned;       /* by start */
static size_t emu_dev_used[64];

static size_t emu_capacity(void) {
  static size_t cap = (size_t)emu_env_int("TITAN_CUEMU_MEM_MB", 8192) << 20;
  return cap;
}

/* The block holding [p, p + n), if p is device memory; `kind` 0 device, 1
 * pinned, -1 neither (pageable host memory). */
int tt_emu_classify(const void *p, size_t n, int *device) {
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  uintptr_t a = (uintptr_t)p;
  auto it = emu_dev_blocks.upper_bound(a);
  if (it != emu_dev_blocks.begin()) {
    --it;
    if (a >= it->first && a < it->first + (it->second.size ? it->second.size : 1)) {
      if (a + n > it->first + it->second.size)
        emu_die("a copy of %zu bytes at offset %zu runs past the end of a %zu-byte device block", n,
                (size_t)(a - it->first), it->second.size);
      if (device) *device = it->second.device;
      return 0;
    }
  }
  auto ph = emu_pinned.upper_bound(a);
  if (ph != emu_pinned.begin()) {
    --ph;
    if (a >= ph->first && a < ph->first + ph->second) {
      if (a + n > ph->first + ph->second)
        emu_die("a copy of %zu bytes runs past the end of a %zu-byte pinned host block", n, ph->second);
      return 1;
    }
  }
  return -1;
}

void tt_emu_check_arg(const char *kernel, int index, const char *field, int elem, const void *p) {
  if (!p) return;
  const uintptr_t a = (uintptr_t)p;
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  auto it = emu_dev_blocks.upper_bound(a);
  if (it != emu_dev_blocks.begin()) {
    --it;
    if (a <= it->first + (it->second.size ? it->second.size : 1)) return; /* in a device block, or at its end */
  }
  auto ph = emu_pinned.upper_bound(a);
  if (ph != emu_pinned.begin()) {
    --ph;
    if (a <= ph->first + ph->second) return; /* pinned: mapped for the device (unified addressing) */
  }
  if (field) {
    char at[24] = "";
    if (elem >= 0) snprintf(at, sizeof at, " (i = %d)", elem);
    emu_die("kernel %s: argument %d's %s%s is %p, host memory a GPU cannot read (expected device or pinned memory)",
            kernel, index, field, at, p);
  }
  emu_die("kernel %s: argument %d is %p, host memory a GPU cannot read (expected device or pinned memory)", kernel,
          index, p);
}

/* ---- streams, events, capture -------------------------------------------- */

struct emu_node {
  std::function<void()> run;
  const char *what;
};

struct CUgraph_st {
  std::vector<emu_node> nodes;
};
struct CUgraphExec_st {
  /* shared with queued launches: an exec may be destroyed while its launch
   * is still queued (deferred streams), as CUDA allows */
  std::shared_ptr<const std::vector<emu_node>> nodes;
};

/* How far a stream's queue has run; events and waits hold it, so they
 * outlive the stream (which drains its queue before it goes). */
struct emu_progress {
  uint64_t done = 0;
  bool gone = false;
};

/* An item of a stream's queue (TITAN_CUEMU_STREAMS=deferred): work, or a
 * cudaStreamWaitEvent, which runs the other stream up to the event first. */
struct emu_item {
  std::function<void()> fn;
  const char *what;
  CUstream_st *wait_on;
  std::shared_ptr<emu_progress> wait_progress;
  uint64_t wait_seq;
};

struct CUstream_st {
  int device;
  bool blocking; /* created without cudaStreamNonBlocking: orders with the legacy stream */
  uint64_t id;   /* creation order */
  /* deferred execution: enqueued counts every item ever queued (its seq) */
  std::deque<emu_item> queue;
  uint64_t enqueued = 0;
  std::shared_ptr<emu_progress> progress = std::make_shared<emu_progress>();
  /* capture */
  bool capturing = false;
  bool invalid = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id owner;
  CUgraph_st *graph = NULL;
  CUstream_st *origin = NULL; /* the stream the capture began on */
};

struct CUevent_st {
  CUstream_st *captured_in = NULL; /* last recorded while that stream captured */
  /* the last record outside a capture: complete once progress->done >= seq */
  CUstream_st *stream = NULL;
  std::shared_ptr<emu_progress> progress;
  uint64_t seq = 0;
};

static std::mutex emu_stream_lock;
static std::set<CUstream_st *> emu_streams;
static thread_local cudaStreamCaptureMode emu_thread_mode = cudaStreamCaptureModeGlobal;

static CUstream_st *emu_stream(cudaStream_t s) { return s; }

/* Is an unsafe call (a wait, an allocation, a free) forbidden for this
 * thread now? Invalidates the captures it would break. */
static bool emu_unsafe_forbidden(void) {
  if (emu_thread_mode == cudaStreamCaptureModeRelaxed) return false;
  std::lock_guard<std::mutex> guard(emu_stream_lock);
  bool forbidden = false;
  for (CUstream_st *s : emu_streams) {
    if (!s->capturing || s->origin != s || s->mode == cudaStreamCaptureModeRelaxed) continue;
    bool mine = s->owner == std::this_thread::get_id();
    if (mine || (emu_thread_mode == cudaStreamCaptureModeGlobal && s->mode == cudaStreamCaptureModeGlobal)) {
      s->invalid = true;
      forbidden = true;
    }
  }
  return forbidden;
}

static bool emu_capturing(CUstream_st *s) { return s && s->capturing; }

/* TITAN_CUEMU_STREAMS: "inline" (the default) runs work when it is
 * enqueued; "deferred" queues it on its stream and runs it only when the
 * host needs it done: a wait on the stream, one of its events or the
 * device, an event query, a copy to pageable memory, the legacy stream,
 * cudaFree. Each is an order the GPU may take; with TITAN_CUEMU_ORDER they
 * turn a missing event wait into wrong data:
 *   forward: the host's wait runs only what it needs: the stream up to that
 *     point and, through its event waits, the other streams' work before
 *     those events. Everything else stays queued, so a stream that reads,
 *     without waiting, what the waited-for stream was to write first reads
 *     it before the write (or never, before the next wait).
 *   reverse: the host's wait first runs every other stream's queued work
 *     (newest stream first), then the stream waited for. A stream that
 *     reads, without waiting, what the waited-for stream writes reads it
 *     first; a write on another stream that should have waited for the
 *     waited-for stream's read of the old data lands before that read.
 * (An event wait in a queue still runs the other stream up to the event
 * first: only orders the program left open change.) */
static bool emu_deferred(void) {
  static const bool d = emu_env_switch("TITAN_CUEMU_STREAMS", "inline", "deferred");
  return d;
}

static uint64_t emu_stream_ids = 0;

/* Runs stream s's queue up to item `upto`, an event wait first running the
 * other stream up to the event (emu_device_lock held). An item leaves the
 * queue before it runs, and waits point only at earlier work: no cycles. */
static void emu_run_to(CUstream_st *s, uint64_t upto) {
  while (s->progress->done < upto && !s->queue.empty()) {
    emu_item it = std::move(s->queue.front());
    s->queue.pop_front();
    if (it.wait_on) {
      if (!it.wait_progress->gone && it.wait_progress->done < it.wait_seq) emu_run_to(it.wait_on, it.wait_seq);
    } else {
      it.fn();
    }
    s->progress->done++;
  }
}

/* The streams with queued work (of `device`, or all when it is -1; only
 * the blocking ones when `blocking_only`), in creation order, newest first
 * with TITAN_CUEMU_ORDER=reverse. */
static std::vector<CUstream_st *> emu_busy_streams(int device, bool blocking_only) {
  std::vector<CUstream_st *> v;
  {
    std::lock_guard<std::mutex> guard(emu_stream_lock);
    for (CUstream_st *o : emu_streams)
      if ((device < 0 || o->device == device) && (!blocking_only || o->blocking) && !o->queue.empty()) v.push_back(o);
  }
  std::sort(v.begin(), v.end(),
            [](const CUstream_st *a, const CUstream_st *b) { return emu_reverse() ? a->id > b->id : a->id < b->id; });
  return v;
}

/* Runs those streams to their ends (emu_device_lock held). */
static void emu_drain_all(int device, bool blocking_only) {
  for (CUstream_st *o : emu_busy_streams(device, blocking_only)) emu_run_to(o, o->enqueued);
}

/* The host needs stream s's work up to item `upto` done. */
static void emu_drain(CUstream_st *s, uint64_t upto) {
  if (s->progress->done >= upto || s->queue.empty()) return;
  if (emu_reverse())
    for (CUstream_st *o : emu_busy_streams(-1, false))
      if (o != s) emu_run_to(o, o->enqueued);
  emu_run_to(s, upto);
}

static bool emu_event_pending(const CUevent_st *e) {
  return e->progress && !e->progress->gone && e->progress->done < e->seq;
}

/* Runs `fn` now (inline, or on the legacy stream), queues it on stream s
 * (deferred), or records it into the capture of stream s. */
cudaError_t tt_emu_enqueue(cudaStream_t s, const char *what, std::function<void()> fn) {
  CUstream_st *st = emu_stream(s);
  if (emu_capturing(st)) {
    if (st->origin->invalid) return emu_err(cudaErrorStreamCaptureInvalidated);
    st->origin->graph->nodes.push_back(emu_node{std::move(fn), what});
    return cudaSuccess;
  }
  if (!st) {
    /* the legacy stream while a capture runs is an implicit dependency */
    std::lock_guard<std::mutex> guard(emu_stream_lock);
    for (CUstream_st *o : emu_streams)
      if (o->capturing && o->origin == o) {
        o->invalid = true;
        return emu_err(cudaErrorStreamCaptureImplicit);
      }
  }
  std::lock_guard<std::recursive_mutex> guard(emu_device_lock);
  if (!st) {
    /* the legacy stream waits for the blocking streams, never for
     * cudaStreamNonBlocking ones, and the host's synchronous calls use it */
    if (emu_deferred()) emu_drain_all(-1, true);
    fn();
    return cudaSuccess;
  }
  st->enqueued++;
  if (emu_deferred()) {
    st->queue.push_back(emu_item{std::move(fn), what, NULL, NULL, 0});
  } else {
    fn();
    st->progress->done++;
  }
  return cudaSuccess;
}

void tt_emu_submit(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   std::function<void()> body) {
  emu_n_kernels++;
  const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || smem > (48u << 10)) {
    emu_err(cudaErrorInvalidConfiguration);
    if (emu_env_int("TITAN_CUEMU_VERBOSE", 0))
      fprintf(stderr, "cuemu: kernel %s: bad launch grid (%u,%u,%u) block (%u,%u,%u) smem %zu\n", name, grid.x,
              grid.y, grid.z, block.x, block.y, block.z, smem);
    return;
  }
  if (smem > 0) emu_die("kernel %s: dynamic shared memory is not emulated", name);
  cudaError_t e = tt_emu_enqueue(stream, name, [name, grid, block, body]() { emu_run_kernel(name, grid, block, body); });
  (void)e;
}

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  CUstream_st *st = new CUstream_st();
  st->device = emu_cur_dev;
  st->blocking = !(flags & cudaStreamNonBlocking);
  std::lock_guard<std::mutex> guard(emu_stream_lock);
  st->id = emu_stream_ids++;
  emu_streams.insert(st);
  *s = st;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, 0); }

/* The stream's queued work still runs (CUDA finishes it too). */
extern "C" cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s) return emu_err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  emu_run_to(s, s->enqueued);
  s->progress->gone = true;
  std::lock_guard<std::mutex> guard(emu_stream_lock);
  emu_streams.erase(s);
  delete s;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  emu_n_syncs++;
  CUstream_st *st = emu_stream(s);
  if (emu_capturing(st)) {
    st->origin->invalid = true;
    return emu_err(cudaErrorStreamCaptureUnsupported);
  }
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (st) emu_drain(st, st->enqueued);
  else if (emu_deferred()) emu_drain_all(-1, true);
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceSynchronize(void) {
  emu_n_syncs++;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  {
    std::lock_guard<std::mutex> guard(emu_stream_lock);
    for (CUstream_st *s : emu_streams)
      if (s->capturing) {
        s->origin->invalid = true;
        return emu_err(cudaErrorStreamCaptureUnsupported);
      }
  }
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  emu_drain_all(emu_cur_dev, false);
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
  CUstream_st *st = emu_stream(s);
  if (!emu_capturing(st)) *status = cudaStreamCaptureStatusNone;
  else *status = st->origin->invalid ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

extern "C" cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  cudaStreamCaptureMode old = emu_thread_mode;
  emu_thread_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
  CUstream_st *st = emu_stream(s);
  if (!st) return emu_err(cudaErrorStreamCaptureUnsupported); /* the legacy stream cannot be captured */
  if (st->capturing) return emu_err(cudaErrorIllegalState);
  std::lock_guard<std::mutex> guard(emu_stream_lock);
  st->capturing = true;
  st->invalid = false;
  st->mode = mode;
  st->owner = std::this_thread::get_id();
  st->graph = new CUgraph_st();
  st->origin = st;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
  CUstream_st *st = emu_stream(s);
  *graph = NULL;
  if (!emu_capturing(st) || st->origin != st) return emu_err(cudaErrorIllegalState);
  if (st->owner != std::this_thread::get_id() && st->mode != cudaStreamCaptureModeRelaxed)
    return emu_err(cudaErrorStreamCaptureWrongThread);
  std::lock_guard<std::mutex> guard(emu_stream_lock);
  bool invalid = st->invalid;
  CUgraph_st *g = st->graph;
  for (CUstream_st *o : emu_streams)
    if (o->capturing && o->origin == st) {
      o->capturing = false;
      o->origin = NULL;
    }
  st->capturing = false;
  st->graph = NULL;
  st->origin = NULL;
  if (invalid) {
    delete g;
    return emu_err(cudaErrorStreamCaptureInvalidated);
  }
  *graph = g;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *nodes, size_t *n) {
  if (nodes) return emu_err(cudaErrorInvalidValue); /* only the count is emulated */
  *n = g->nodes.size();
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t g, unsigned long long flags) {
  (void)flags;
  CUgraphExec_st *e = new CUgraphExec_st();
  e->nodes = std::make_shared<const std::vector<emu_node>>(g->nodes);
  *exec = e;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  if (!exec) return emu_err(cudaErrorInvalidValue);
  CUstream_st *st = emu_stream(s);
  if (emu_capturing(st)) {
    for (const emu_node &n : *exec->nodes) st->origin->graph->nodes.push_back(n);
    return cudaSuccess;
  }
  std::shared_ptr<const std::vector<emu_node>> nodes = exec->nodes;
  return tt_emu_enqueue(s, "cudaGraphLaunch", [nodes]() {
    for (const emu_node &n : *nodes) n.run();
  });
}

extern "C" cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  (void)flags;
  *e = new CUevent_st();
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, 0); }

extern "C" cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!e) return emu_err(cudaErrorInvalidResourceHandle);
  CUstream_st *st = emu_stream(s);
  e->captured_in = emu_capturing(st) ? st->origin : NULL;
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (e->captured_in || !st) {
    /* in a capture: the graph's order; on the legacy stream: its work ran */
    e->stream = NULL;
    e->progress.reset();
    e->seq = 0;
  } else {
    e->stream = st;
    e->progress = st->progress;
    e->seq = st->enqueued;
  }
  return cudaSuccess;
}

/* Not ready while the event's work is queued; the query then runs it, so a
 * host that polls sees it complete, as it would on the GPU. cudaErrorNotReady
 * is not an error (cudaGetLastError does not keep it). */
extern "C" cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (!e) return emu_err(cudaErrorInvalidResourceHandle);
  if (e->captured_in) return emu_err(cudaErrorCapturedEvent);
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (!emu_event_pending(e)) return cudaSuccess;
  emu_drain(e->stream, e->seq);
  return cudaErrorNotReady;
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  emu_n_syncs++;
  if (!e) return emu_err(cudaErrorInvalidResourceHandle);
  if (e->captured_in) return emu_err(cudaErrorCapturedEvent);
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (emu_event_pending(e)) emu_drain(e->stream, e->seq);
  return cudaSuccess;
}

/* Both events complete (else cudaErrorNotReady, as on the GPU): 0 ms, for
 * cuemu times nothing (an autotuner sees every candidate tie). */
extern "C" cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms || !start || !end || start->captured_in || end->captured_in) return emu_err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (emu_event_pending(start) || emu_event_pending(end)) return cudaErrorNotReady;
  *ms = 0.0f;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  (void)flags;
  if (!e) return emu_err(cudaErrorInvalidResourceHandle);
  CUstream_st *st = emu_stream(s);
  if (e->captured_in) {
    /* a fork: s joins the capture the event was recorded in */
    if (!st) return emu_err(cudaErrorStreamCaptureImplicit);
    if (!st->capturing) {
      std::lock_guard<std::mutex> guard(emu_stream_lock);
      st->capturing = true;
      st->origin = e->captured_in;
    } else if (st->origin != e->captured_in) {
      return emu_err(cudaErrorStreamCaptureIsolation);
    }
    return cudaSuccess;
  }
  /* a capturing stream may not wait on work outside its capture */
  if (emu_capturing(st)) {
    st->origin->invalid = true;
    return emu_err(cudaErrorStreamCaptureIsolation);
  }
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  if (!emu_event_pending(e)) return cudaSuccess;
  if (!st) {
    emu_drain(e->stream, e->seq); /* the legacy stream runs its work at once */
    return cudaSuccess;
  }
  /* the wait takes the event's state now: a later record does not move it */
  st->enqueued++;
  st->queue.push_back(
      emu_item{std::function<void()>(), "cudaStreamWaitEvent", e->stream, e->progress, e->seq});
  return cudaSuccess;
}

/* ---- allocation ------------------------------------------------------------- */

extern "C" cudaError_t cudaMalloc(void **p, size_t n) {
  emu_n_mallocs++;
  *p = NULL;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  const int d = emu_cur_dev;
  const size_t page = 4096, size = n ? n : 1;
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  if (emu_dev_used[d] + size > emu_capacity() || size > emu_capacity()) return emu_err(cudaErrorMemoryAllocation);
  /* the block ends at most 255 bytes before an inaccessible page, and
   * starts 256-byte aligned, as cudaMalloc's do */
  const size_t body = (size + 255) & ~(size_t)255, len = (body + page - 1) / page * page + page;
  char *m = (char *)mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return emu_err(cudaErrorMemoryAllocation);
  mprotect(m + len - page, page, PROT_NONE);
  char *start = m + (len - page) - body;
  /* fresh memory holds what was there before, never zeros to rely on:
   * 0xFF bytes, NaN in every float type and -1 in every integer type */
  memset(start, 0xFF, body);
  emu_block b;
  b.size = n;
  b.device = d;
  b.map = m;
  b.map_len = len;
  emu_dev_blocks[(uintptr_t)start] = b;
  emu_dev_used[d] += size;
  *p = start;
  return cudaSuccess;
}

/* engine/dist_mpi.c, before a call that blocks the process on another
 * rank: a GPU progresses while its host waits, so the queued work runs
 * (deferred streams; a rank waiting on the network with its NCCL sends
 * still queued would hang a neighbour that waits on them). */
extern "C" void tt_emu_progress(void) {
  if (!emu_deferred()) return;
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  emu_drain_all(-1, false);
}

/* Frees wait for the device (queued work may still use the block). */
static void emu_free_sync(void) {
  if (!emu_deferred()) return;
  std::lock_guard<std::recursive_mutex> run(emu_device_lock);
  emu_drain_all(-1, false);
}

extern "C" cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  emu_n_frees++;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  emu_free_sync();
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  auto it = emu_dev_blocks.find((uintptr_t)p);
  if (it == emu_dev_blocks.end()) emu_die("cudaFree(%p): not the start of a device block", p);
  emu_dev_used[it->second.device] -= it->second.size ? it->second.size : 1;
  munmap(it->second.map, it->second.map_len);
  emu_dev_blocks.erase(it);
  return cudaSuccess;
}

extern "C" cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int flags) {
  emu_n_host_allocs++;
  (void)flags;
  *p = NULL;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  void *m = NULL;
  if (posix_memalign(&m, 4096, n ? n : 1) != 0) return emu_err(cudaErrorMemoryAllocation);
  memset(m, 0xFF, n ? n : 1); /* as device memory: no zeros to rely on */
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  emu_pinned[(uintptr_t)m] = n ? n : 1;
  *p = m;
  return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void **p, size_t n) { return cudaHostAlloc(p, n, 0); }

extern "C" cudaError_t cudaFreeHost(void *p) {
  if (!p) return cudaSuccess;
  emu_n_host_frees++;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  emu_free_sync();
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  auto it = emu_pinned.find((uintptr_t)p);
  if (it == emu_pinned.end()) emu_die("cudaFreeHost(%p): not a pinned block", p);
  emu_pinned.erase(it);
  free(p);
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total) {
  std::lock_guard<std::mutex> guard(emu_mem_lock);
  *total = emu_capacity();
  *free_b = emu_capacity() - emu_dev_used[emu_cur_dev];
  return cudaSuccess;
}

/* ---- copies ------------------------------------------------------------------- */

/* *src_pageable / *dst_pageable: that side is host memory that is not pinned. */
static cudaError_t emu_check_copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind, bool *src_pageable,
                                  bool *dst_pageable) {
  int dd = -1, sd = -1;
  int dk = tt_emu_classify(dst, n, &dd), sk = tt_emu_classify(src, n, &sd);
  *src_pageable = sk < 0;
  *dst_pageable = dk < 0;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      if (dk != 0 || sk == 0) return cudaErrorInvalidValue;
      break;
    case cudaMemcpyDeviceToHost:
      if (sk != 0 || dk == 0) return cudaErrorInvalidValue;
      break;
    case cudaMemcpyDeviceToDevice:
      if (sk != 0 || dk != 0) return cudaErrorInvalidValue;
      break;
    case cudaMemcpyHostToHost: break;
    case cudaMemcpyDefault: break;
    default: return cudaErrorInvalidMemcpyDirection;
  }
  return cudaSuccess;
}

/* With pageable host memory a copy is synchronous for the host as far as
 * that memory goes (CUDA's "API synchronization behavior"): a pageable
 * source is staged before the call returns, so the caller may reuse it; a
 * pageable destination holds the data when the call returns. Pinned memory
 * is read and written when the copy runs. */
extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                                       cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  bool src_pageable, dst_pageable;
  cudaError_t e = emu_check_copy(dst, src, n, kind, &src_pageable, &dst_pageable);
  if (e != cudaSuccess) {
    if (emu_env_int("TITAN_CUEMU_VERBOSE", 0))
      fprintf(stderr, "cuemu: cudaMemcpyAsync(%p, %p, %zu, kind %d): pointers do not match the kind\n", dst, src, n,
              (int)kind);
    return emu_err(e);
  }
  CUstream_st *st = emu_stream(s);
  if (dst_pageable && st) emu_n_sync_copies++;
  if (emu_capturing(st) && (src_pageable || dst_pageable)) { /* pageable memory cannot be part of a graph */
    st->origin->invalid = true;
    return emu_err(cudaErrorStreamCaptureUnsupported);
  }
  if (!emu_deferred() || !st || emu_capturing(st))
    return tt_emu_enqueue(s, "memcpy", [dst, src, n]() { memmove(dst, src, n); });
  if (src_pageable) {
    auto staged = std::make_shared<std::vector<char>>((const char *)src, (const char *)src + n);
    e = tt_emu_enqueue(s, "memcpy", [dst, staged, n]() { memmove(dst, staged->data(), n); });
  } else {
    e = tt_emu_enqueue(s, "memcpy", [dst, src, n]() { memmove(dst, src, n); });
  }
  if (e == cudaSuccess && dst_pageable) {
    std::lock_guard<std::recursive_mutex> run(emu_device_lock);
    emu_drain(st, st->enqueued);
  }
  return e;
}

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
  emu_n_sync_copies++;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  return cudaMemcpyAsync(dst, src, n, kind, NULL);
}

extern "C" cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  int d;
  if (tt_emu_classify(p, n, &d) != 0) return emu_err(cudaErrorInvalidValue);
  return tt_emu_enqueue(s, "memset", [p, v, n]() { memset(p, v, n); });
}

extern "C" cudaError_t cudaMemset(void *p, int v, size_t n) {
  emu_n_sync_copies++;
  if (emu_unsafe_forbidden()) return emu_err(cudaErrorStreamCaptureUnsupported);
  return cudaMemsetAsync(p, v, n, NULL);
}
