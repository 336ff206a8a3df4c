/*
 * cuemu_device.h — the device side of cuemu, the CPU emulation of the CUDA
 * backend (tests/cuemu/README.md). Force-included (g++ -include) ahead of
 * every kernels/cuda/ .cu file, which is compiled as plain C++ against the
 * real CUDA headers; the launches `k<<<grid, block, smem, stream>>>(args)`
 * have been rewritten by rewrite.sed into `tt_emu_launch("k", k, grid,
 * block, smem, stream)(args)`.
 *
 * A launch runs every block of the grid in turn, each CUDA thread of a block
 * as a fiber on the calling host thread (runtime.cpp). A fiber runs until it
 * reaches __syncthreads or a warp shuffle, or returns; the scheduler then
 * resumes the others. So barriers and shuffles keep their CUDA meaning, and
 * the emulator reports what hardware would hang on or leave undefined: a
 * shuffle some lanes of the warp never reach, two lanes at different
 * shuffles, a block whose threads wait at different barriers.
 *
 * __shared__ variables are static thread_local: one copy per kernel
 * instantiation, which the threads of the (one) running block share.
 */
#ifndef TT_CUEMU_DEVICE_H
#define TT_CUEMU_DEVICE_H

/* Before the CUDA headers, which define these as empty only when not yet
 * defined (crt/host_defines.h). */
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

/* ---- the running thread ------------------------------------------------ */

struct tt_emu_thread_ids {
  dim3 thread, block, block_dim, grid_dim;
};
/* The fiber now running (runtime.cpp keeps it current). */
extern thread_local tt_emu_thread_ids *tt_emu_ids;

#define threadIdx (tt_emu_ids->thread)
#define blockIdx (tt_emu_ids->block)
#define blockDim (tt_emu_ids->block_dim)
#define gridDim (tt_emu_ids->grid_dim)
#define warpSize 32

/* ---- barriers and shuffles (runtime.cpp) -------------------------------- */

void tt_emu_syncthreads(void);
/* mode 0: from lane `arg` of the segment; 1: from lane ^ arg. Returns the
 * source lane's 8-byte slot. */
uint64_t tt_emu_shuffle(unsigned mask, uint64_t bits, int mode, int arg, int width);

static inline void __syncthreads(void) { tt_emu_syncthreads(); }

template <typename T> static inline T tt_emu_shfl(unsigned mask, T v, int mode, int arg, int width) {
  static_assert(sizeof(T) <= 8, "cuemu: shuffles move at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof v);
  bits = tt_emu_shuffle(mask, bits, mode, arg, width);
  T r;
  memcpy(&r, &bits, sizeof r);
  return r;
}
template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return tt_emu_shfl(mask, v, 0, src, width);
}
template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return tt_emu_shfl(mask, v, 1, lane_mask, width);
}

/* ---- atomics: blocks run one at a time, but kernels may run on several
 * host threads (a writer thread's copies), so these are real atomics. ---- */

template <typename T> static inline T atomicCAS(T *p, T expected, T desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected; /* the old value either way */
}
static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned atomicMax(unsigned *p, unsigned v) {
  unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

/* ---- arithmetic: the _rn intrinsics are IEEE operations, which host code
 * built with -ffp-contract=off performs as written. ------------------------ */

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}

/* ---- launches ------------------------------------------------------------ */

/* Runs (or, while the stream is being captured, records) `body` once per
 * thread of every block. A bad configuration sets the launch error that
 * cudaGetLastError reports, as the hardware launch would. */
void tt_emu_submit(const char *name, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   std::function<void()> body);

/* A kernel's pointer argument must be memory the GPU can reach: device
 * memory (a block's end included), pinned host memory, or NULL. Dies,
 * naming the kernel and the argument (and, for a pointer inside a struct
 * argument, its field, element `elem` of it when elem >= 0), on a pointer
 * to other host memory (which on the GPU is an illegal address). */
void tt_emu_check_arg(const char *kernel, int index, const char *field, int elem, const void *p);

/* A struct passed to a kernel by value names the pointers it carries with
 *   static void tt_emu_ptrs(const S &s, tt_emu_ptr_visit &visit)
 * under #if TITAN_CUEMU next to the struct, calling visit("x[i]", i, p)
 * for each element i of an array and visit("y", -1, p) for a plain field,
 * or says it carries none with TT_EMU_NO_PTRS(S) (cuda_common.h). A struct
 * argument with neither does not compile here, so a new one cannot carry a
 * host pointer past the check. */
struct tt_emu_ptr_visit {
  const char *kernel;
  int index;
  void operator()(const char *field, int elem, const void *p) { tt_emu_check_arg(kernel, index, field, elem, p); }
};

/* A full chunk moved by a kernel's vector helpers (TT_EMU_CHUNK,
 * cuda_common.h): in one vector access, or split into element accesses. */
void tt_emu_note_chunk(bool vector);

template <typename T, typename = void> struct tt_emu_names_ptrs : std::false_type {};
template <typename T>
struct tt_emu_names_ptrs<T, std::void_t<decltype(tt_emu_ptrs(std::declval<const T &>(),
                                                              std::declval<tt_emu_ptr_visit &>()))>>
    : std::true_type {};

template <typename T> static inline void tt_emu_check_one(const char *kernel, int index, const T &v) {
  if constexpr (std::is_pointer<T>::value) {
    tt_emu_check_arg(kernel, index, NULL, -1, (const void *)v);
  } else if constexpr (std::is_class<T>::value) {
    static_assert(tt_emu_names_ptrs<T>::value,
                  "cuemu: a struct passed to a kernel by value needs tt_emu_ptrs(const S &, tt_emu_ptr_visit &) "
                  "naming its pointers, or TT_EMU_NO_PTRS(S) (kernels/cuda/cuda_common.h)");
    tt_emu_ptr_visit visit{kernel, index};
    tt_emu_ptrs(v, visit);
  } else {
    (void)kernel, (void)index, (void)v;
  }
}

template <typename... P> struct tt_emu_launcher {
  const char *name;
  void (*fn)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  /* The arguments convert to the kernel's parameter types here and are
   * copied, as a CUDA launch copies them: a captured graph replays the
   * values of capture time. */
  void operator()(P... args) const {
    void (*f)(P...) = fn;
    std::tuple<typename std::decay<P>::type...> saved(args...);
    std::apply([this](const auto &...a) {
      int i = 0;
      (tt_emu_check_one(name, i++, a), ...);
    }, saved);
    tt_emu_submit(name, grid, block, smem, stream, [f, saved]() { std::apply(f, saved); });
  }
};

template <typename... P>
static inline tt_emu_launcher<P...> tt_emu_launch(const char *name, void (*fn)(P...), dim3 grid, dim3 block,
                                                  size_t smem = 0, cudaStream_t stream = 0) {
  return tt_emu_launcher<P...>{name, fn, grid, block, smem, stream};
}

#endif
