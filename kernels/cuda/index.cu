/*
 * index.cu — index_select, gather, index_add and scatter_add over tensors
 * viewed as contiguous [outer, n, inner] (see kernels.h); idx is i64.
 *
 * Select and gather move bytes, so they take any dtype by element size;
 * index_select copies whole rows in the widest unit (up to 16 bytes) that
 * the row length and the pointers allow. Indices on this device are not
 * read by the engine before the kernels run (that would cost a wait per
 * op), so an index outside [0, n) reads as zero here, is skipped by the
 * adds, and is recorded in the device's fault record (tt_d_index_fault),
 * which the engine reports at the next wait for the device.
 *
 * The adds (f32, f64, i32 and i64 wrapping, bf16/f16 through f32 with one
 * rounding per add) are deterministic without atomics, as on the CPU: a
 * thread owns a destination column c of one outer slice and a range of
 * destination rows outright, walks j = 0..n_idx-1 in order and applies only
 * the contributions that land in its range. Every destination element so
 * receives its contributions in increasing j: the serial loop's exact bits,
 * identical to the CPU reference. Consecutive hits on one row are summed in
 * a register (the same additions, in the same order). The row ranges (R of
 * them, a function of the shape) exist only to give enough threads when the
 * destination has few columns; each range rescans the index list. With one
 * outer slice (the embedding gradient) the list is sorted by row first and
 * each row summed by its own threads, in the same order (the sorted plan,
 * below; docs/cuda.md).
 */
#include "kernel_util.cuh"

static int tt_index_esize(int dtype) {
  switch (dtype) {
    case TT_F64: case TT_I64: return 8;
    case TT_F32: case TT_I32: return 4;
    case TT_BF16: case TT_F16: return 2;
    case TT_U8: case TT_BOOL: case TT_F8E4M3: case TT_F8E5M2: return 1;
    default: return 0;
  }
}

/* ---- index_select: out[o, j, :] = src[o, idx[j], :] ------------------------- */

/* upr units of U per row; unit u of the output is row u / upr. */
template <typename U, typename Idx>
__global__ void tt_index_select_kernel(Idx rows, Idx upr, int64_t n_src, int64_t n_idx, const U *__restrict__ src,
                                       const int64_t *__restrict__ idx, U *__restrict__ out, tt_index_fault *fault,
                                       int op) {
  const Idx total = rows * upr;
  for (Idx u = (Idx)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (Idx)gridDim.x * blockDim.x) {
    Idx r = u / upr, c = u - r * upr;
    int64_t o = (int64_t)r / n_idx, j = (int64_t)r - o * n_idx;
    int64_t id = idx[j];
    TT_EMU_CHUNK(true, sizeof(U) == 16); /* a unit: a 16-byte chunk or a smaller piece of one */
    if (id >= 0 && id < n_src) {
      out[u] = src[(o * n_src + id) * (int64_t)upr + (int64_t)c];
    } else {
      out[u] = U();
      if (c == 0) tt_d_index_fault(fault, op, id, j, n_src); /* once per row, not per unit */
    }
  }
}

template <typename U>
static void tt_index_select_go(int64_t rows, int64_t upr, int64_t n_src, int64_t n_idx, const void *src,
                               const int64_t *idx, void *out, tt_index_fault *fault, int op, cudaStream_t s) {
  int64_t total = rows * upr;
  if (total <= INT32_MAX)
    tt_index_select_kernel<U, uint32_t><<<tt_cuda_blocks(total), TT_CUDA_THREADS, 0, s>>>(
        (uint32_t)rows, (uint32_t)upr, n_src, n_idx, (const U *)src, idx, (U *)out, fault, op);
  else
    tt_index_select_kernel<U, int64_t><<<tt_cuda_blocks(total), TT_CUDA_THREADS, 0, s>>>(
        rows, upr, n_src, n_idx, (const U *)src, idx, (U *)out, fault, op);
}

/* Shared with embed.cu (the lookup is a select with outer 1). */
tt_status tt_cuda_select_rows(int op, int esz, int64_t outer, int64_t n_src, int64_t inner, const void *src,
                              int64_t n_idx, const int64_t *idx, void *out) {
  int64_t rows = outer * n_idx;
  if (rows <= 0 || inner <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_index_fault *f = tt_cuda_fault(device);
  int64_t row_bytes = inner * esz;
  uintptr_t al = (uintptr_t)src | (uintptr_t)out | (uintptr_t)row_bytes;
  if ((al & 15) == 0) tt_index_select_go<uint4>(rows, row_bytes / 16, n_src, n_idx, src, idx, out, f, op, s);
  else if ((al & 7) == 0) tt_index_select_go<uint2>(rows, row_bytes / 8, n_src, n_idx, src, idx, out, f, op, s);
  else if ((al & 3) == 0) tt_index_select_go<uint32_t>(rows, row_bytes / 4, n_src, n_idx, src, idx, out, f, op, s);
  else if ((al & 1) == 0) tt_index_select_go<uint16_t>(rows, row_bytes / 2, n_src, n_idx, src, idx, out, f, op, s);
  else tt_index_select_go<uint8_t>(rows, row_bytes, n_src, n_idx, src, idx, out, f, op, s);
  TT_CUDA_CHECK_LAUNCH("tt_index_select_kernel");
  return TT_OK;
}

extern "C" tt_status tt_cuda_index_select(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src,
                                          int64_t n_idx, const int64_t *idx, void *out) {
  int esz = tt_index_esize(dtype);
  if (!esz) return tt_error_set(TT_ERR_DTYPE, "cuda index_select: dtype %d not supported", dtype);
  return tt_cuda_select_rows(TT_FAULT_INDEX_SELECT, esz, outer, n_src, inner, src, n_idx, idx, out);
}

/* ---- gather: out[o, j, i] = src[o, idx[o, j, i], i] -------------------------- */

template <typename T>
__global__ void tt_gather_kernel(int64_t total, int64_t n_src, int64_t inner, int64_t n_idx, const T *__restrict__ src,
                                 const int64_t *__restrict__ idx, T *__restrict__ out, tt_index_fault *fault) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = e / inner, i = e - r * inner, o = r / n_idx;
    int64_t id = idx[e];
    if (id >= 0 && id < n_src) {
      out[e] = src[(o * n_src + id) * inner + i];
    } else {
      out[e] = (T)0;
      tt_d_index_fault(fault, TT_FAULT_GATHER, id, e, n_src);
    }
  }
}

extern "C" tt_status tt_cuda_gather(int dtype, int64_t outer, int64_t n_src, int64_t inner, const void *src,
                                    int64_t n_idx, const int64_t *idx, void *out) {
  int esz = tt_index_esize(dtype);
  if (!esz) return tt_error_set(TT_ERR_DTYPE, "cuda gather: dtype %d not supported", dtype);
  int64_t total = outer * n_idx * inner;
  if (outer <= 0 || n_idx <= 0 || inner <= 0) return TT_OK;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_index_fault *f = tt_cuda_fault(device);
  unsigned int g = tt_cuda_blocks(total);
  switch (esz) {
    case 8: tt_gather_kernel<uint64_t><<<g, TT_CUDA_THREADS, 0, s>>>(total, n_src, inner, n_idx, (const uint64_t *)src, idx, (uint64_t *)out, f); break;
    case 4: tt_gather_kernel<uint32_t><<<g, TT_CUDA_THREADS, 0, s>>>(total, n_src, inner, n_idx, (const uint32_t *)src, idx, (uint32_t *)out, f); break;
    case 2: tt_gather_kernel<uint16_t><<<g, TT_CUDA_THREADS, 0, s>>>(total, n_src, inner, n_idx, (const uint16_t *)src, idx, (uint16_t *)out, f); break;
    default: tt_gather_kernel<uint8_t><<<g, TT_CUDA_THREADS, 0, s>>>(total, n_src, inner, n_idx, (const uint8_t *)src, idx, (uint8_t *)out, f); break;
  }
  TT_CUDA_CHECK_LAUNCH("tt_gather_kernel");
  return TT_OK;
}

/* ---- the adds -------------------------------------------------------------------- */

/* Running value A of one destination element: load, add one source element,
 * store. Integers wrap (through unsigned); bf16/f16 round after every add,
 * as an element-by-element loop in that dtype does. */
template <int DT> struct tt_acc;
template <> struct tt_acc<TT_F32> {
  typedef float S;
  typedef float A;
  static __device__ __forceinline__ A load(S d) { return d; }
  static __device__ __forceinline__ A add(A a, S s) { return __fadd_rn(a, s); }
  static __device__ __forceinline__ S store(A a) { return a; }
};
template <> struct tt_acc<TT_F64> {
  typedef double S;
  typedef double A;
  static __device__ __forceinline__ A load(S d) { return d; }
  static __device__ __forceinline__ A add(A a, S s) { return __dadd_rn(a, s); }
  static __device__ __forceinline__ S store(A a) { return a; }
};
template <> struct tt_acc<TT_I32> {
  typedef int32_t S;
  typedef uint32_t A;
  static __device__ __forceinline__ A load(S d) { return (uint32_t)d; }
  static __device__ __forceinline__ A add(A a, S s) { return a + (uint32_t)s; }
  static __device__ __forceinline__ S store(A a) { return (int32_t)a; }
};
template <> struct tt_acc<TT_I64> {
  typedef int64_t S;
  typedef uint64_t A;
  static __device__ __forceinline__ A load(S d) { return (uint64_t)d; }
  static __device__ __forceinline__ A add(A a, S s) { return a + (uint64_t)s; }
  static __device__ __forceinline__ S store(A a) { return (int64_t)a; }
};
template <> struct tt_acc<TT_BF16> { /* A is always a bf16 value held in f32 */
  typedef uint16_t S;
  typedef float A;
  static __device__ __forceinline__ A load(S d) { return tt_d_bf16_to_f32(d); }
  static __device__ __forceinline__ A add(A a, S s) {
    return tt_d_bf16_to_f32(tt_d_f32_to_bf16(__fadd_rn(a, tt_d_bf16_to_f32(s))));
  }
  static __device__ __forceinline__ S store(A a) { return tt_d_f32_to_bf16(a); }
};
template <> struct tt_acc<TT_F16> {
  typedef uint16_t S;
  typedef float A;
  static __device__ __forceinline__ A load(S d) { return tt_d_f16_to_f32(d); }
  static __device__ __forceinline__ A add(A a, S s) {
    return tt_d_f16_to_f32(tt_d_f32_to_f16(__fadd_rn(a, tt_d_f16_to_f32(s))));
  }
  static __device__ __forceinline__ S store(A a) { return tt_d_f32_to_f16(a); }
};

/* Ids staged in shared memory per block, CHUNK at a time. */
#define TT_ADD_CHUNK 1024
/* The sorted plan's scan block, and the most ids one placing block sorts
 * (in its shared memory, as int32: 48 KiB, the static limit). */
#define TT_SORT_SCAN_THREADS 1024
#define TT_SORT_MAX_CHUNK 12288

/* index_add: worker w = ((o * R + k) * inner + c) owns dst[o, r0:r1, c] for
 * the k-th of R row ranges. The whole block walks the loop over w together
 * (it shares the staged ids), so the bound is block-uniform. */
template <int DT>
__global__ void tt_index_add_kernel(int64_t outer, int64_t n_dst, int64_t inner, int64_t R,
                                    typename tt_acc<DT>::S *__restrict__ dst, int64_t n_idx,
                                    const int64_t *__restrict__ idx, const typename tt_acc<DT>::S *__restrict__ src,
                                    tt_index_fault *fault, int op) {
  typedef tt_acc<DT> Op;
  __shared__ int64_t sid[TT_ADD_CHUNK];
  const int64_t W = outer * R * inner;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < W; base += (int64_t)gridDim.x * blockDim.x) {
    const int64_t w = base + threadIdx.x;
    const bool active = w < W;
    int64_t c = 0, o = 0, r0 = 0, r1 = 0;
    if (active) {
      c = w % inner;
      int64_t q = w / inner, k = q % R;
      o = q / R;
      r0 = k * n_dst / R;
      r1 = (k + 1) * n_dst / R;
    }
    typename tt_acc<DT>::S *dcol = dst + o * n_dst * inner + c;
    const typename tt_acc<DT>::S *scol = src + o * n_idx * inner + c;
    int64_t cur = -1;
    typename Op::A val = 0;
    for (int64_t j0 = 0; j0 < n_idx; j0 += TT_ADD_CHUNK) {
      int cnt = n_idx - j0 < TT_ADD_CHUNK ? (int)(n_idx - j0) : TT_ADD_CHUNK;
      __syncthreads(); /* the previous chunk is consumed */
      for (int t = threadIdx.x; t < cnt; t += blockDim.x) {
        int64_t r = idx[j0 + t];
        sid[t] = r;
        /* Every block stages every id: block 0's first pass reports the bad
         * ones, once each. No worker's row range holds them. */
        if (base == 0 && (r < 0 || r >= n_dst)) tt_d_index_fault(fault, op, r, j0 + t, n_dst);
      }
      __syncthreads();
      if (!active) continue;
      for (int t = 0; t < cnt; t++) {
        int64_t r = sid[t];
        if (r < r0 || r >= r1) continue;
        if (r != cur) {
          if (cur >= 0) dcol[cur * inner] = Op::store(val);
          cur = r;
          val = Op::load(dcol[r * inner]);
        }
        val = Op::add(val, scol[(j0 + t) * inner]);
      }
    }
    if (active && cur >= 0) dcol[cur * inner] = Op::store(val);
  }
}

/* scatter_add: column c of slice o only touches column c of dst slice o, so
 * worker w = ((o * R + k) * inner + c) walks that column's indices in order. */
template <int DT>
__global__ void tt_scatter_add_kernel(int64_t outer, int64_t n_dst, int64_t inner, int64_t R,
                                      typename tt_acc<DT>::S *__restrict__ dst, int64_t n_idx,
                                      const int64_t *__restrict__ idx, const typename tt_acc<DT>::S *__restrict__ src,
                                      tt_index_fault *fault, int op) {
  typedef tt_acc<DT> Op;
  const int64_t W = outer * R * inner;
  for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < W; w += (int64_t)gridDim.x * blockDim.x) {
    int64_t c = w % inner, q = w / inner, k = q % R, o = q / R;
    int64_t r0 = k * n_dst / R, r1 = (k + 1) * n_dst / R;
    typename tt_acc<DT>::S *dcol = dst + o * n_dst * inner + c;
    const typename tt_acc<DT>::S *scol = src + o * n_idx * inner + c;
    const int64_t *icol = idx + o * n_idx * inner + c;
    int64_t cur = -1;
    typename Op::A val = 0;
    for (int64_t j = 0; j < n_idx; j++) {
      int64_t r = icol[j * inner];
      if (r < r0 || r >= r1) {
        /* Outside every range: the first range's worker reports it. */
        if (k == 0 && (r < 0 || r >= n_dst)) tt_d_index_fault(fault, op, r, (o * n_idx + j) * inner + c, n_dst);
        continue;
      }
      if (r != cur) {
        if (cur >= 0) dcol[cur * inner] = Op::store(val);
        cur = r;
        val = Op::load(dcol[r * inner]);
      }
      val = Op::add(val, scol[j * inner]);
    }
    if (cur >= 0) dcol[cur * inner] = Op::store(val);
  }
}

/* ---- index_add with outer 1 (the embedding gradient): sorted by row ------- */

/* The scan above has every range of rows rescan the whole index list, and
 * a range holding a frequent token's row (a BPE vocabulary's low ids) walk
 * thousands of hits one dependent load after another. With one outer
 * slice the list is sorted by destination row instead, stably (a counting
 * sort with integer counts, exact whatever the order of their atomic
 * adds), and each destination row that receives anything is then summed by
 * its own threads, a 16-byte unit of columns each, walking its hits in
 * increasing j: the same additions in the same order as the scan, so the
 * same bits (and the CPU's). In the device's scratch buffer, in chunks of
 * the list: per chunk and row the chunk's count of the row, turned into
 * where the chunk's hits of the row start; per row where its hits start;
 * the valid hits' count; the sorted positions and their rows. */

/* Counts chunk b's hits of each row into hist[b * n_dst + row]; records an
 * index outside [0, n_dst) (which adds nothing). */
__global__ void tt_add_sort_count(int64_t n_dst, int64_t n_idx, int64_t chunk, const int64_t *__restrict__ idx,
                                  int32_t *__restrict__ hist, tt_index_fault *fault, int op) {
  const int64_t j0 = (int64_t)blockIdx.x * chunk, j1 = j0 + chunk < n_idx ? j0 + chunk : n_idx;
  int32_t *h = hist + (int64_t)blockIdx.x * n_dst;
  for (int64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    const int64_t r = idx[j];
    if (r < 0 || r >= n_dst) tt_d_index_fault(fault, op, r, j, n_dst);
    else atomicAdd(&h[r], 1);
  }
}

/* Per row: each chunk's count becomes the number of the row's hits in the
 * chunks before it; start[row] = the row's total. */
__global__ void tt_add_sort_bases(int64_t n_dst, int64_t nb, int32_t *__restrict__ hist, int32_t *__restrict__ start) {
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < n_dst; v += (int64_t)gridDim.x * blockDim.x) {
    int32_t run = 0;
    for (int64_t b = 0; b < nb; b++) {
      const int32_t c = hist[b * n_dst + v];
      hist[b * n_dst + v] = run;
      run += c;
    }
    start[v] = run;
  }
}

/* One block: start[] (the rows' totals) becomes its exclusive prefix sum:
 * where each row's hits start in the sorted list; *nvalid the total. */
__global__ void tt_add_sort_scan(int64_t n_dst, int32_t *__restrict__ start, int32_t *__restrict__ nvalid) {
  __shared__ int32_t part[TT_SORT_SCAN_THREADS];
  const int64_t per = (n_dst + blockDim.x - 1) / blockDim.x;
  const int64_t a = threadIdx.x * per, e = a + per < n_dst ? a + per : n_dst;
  int32_t sum = 0;
  for (int64_t v = a; v < e; v++) sum += start[v];
  part[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (unsigned i = 0; i < blockDim.x; i++) {
      const int32_t c = part[i];
      part[i] = run;
      run += c;
    }
    *nvalid = run;
  }
  __syncthreads();
  int32_t run = part[threadIdx.x];
  for (int64_t v = a; v < e; v++) {
    const int32_t c = start[v];
    start[v] = run;
    run += c;
  }
}

/* Block b places its chunk's hits: a hit's slot is where its row starts,
 * plus the row's hits in earlier chunks, plus those earlier in this chunk
 * (counted in shared memory: the chunk's rows, -1 for an invalid index). */
__global__ void tt_add_sort_place(int64_t n_dst, int64_t n_idx, int64_t chunk, const int64_t *__restrict__ idx,
                                  const int32_t *__restrict__ hist, const int32_t *__restrict__ start,
                                  int32_t *__restrict__ order, int32_t *__restrict__ rows) {
  __shared__ int32_t sid[TT_SORT_MAX_CHUNK];
  const int64_t j0 = (int64_t)blockIdx.x * chunk;
  const int cnt = (int)(j0 + chunk < n_idx ? chunk : n_idx - j0);
  for (int t = threadIdx.x; t < cnt; t += blockDim.x) {
    const int64_t r = idx[j0 + t];
    sid[t] = r >= 0 && r < n_dst ? (int32_t)r : -1;
  }
  __syncthreads();
  const int32_t *base = hist + (int64_t)blockIdx.x * n_dst;
  for (int t = threadIdx.x; t < cnt; t += blockDim.x) {
    const int32_t r = sid[t];
    if (r < 0) continue;
    int32_t rank = 0;
    for (int q = 0; q < t; q++) rank += sid[q] == r;
    const int32_t slot = start[r] + base[r] + rank;
    order[slot] = (int32_t)(j0 + t);
    rows[slot] = r;
  }
}

/* V elements: one 16-byte access for V > 1 (16-byte aligned), else one. */
template <typename S, int V> __device__ __forceinline__ void tt_unit_load(const S *p, S *v) {
  if constexpr (V > 1) {
    static_assert(V * sizeof(S) == 16, "a unit is 16 bytes");
    const uint4 raw = *reinterpret_cast<const uint4 *>(p);
    memcpy(v, &raw, sizeof raw);
  } else {
    v[0] = p[0];
  }
}
template <typename S, int V> __device__ __forceinline__ void tt_unit_store(S *p, const S *v) {
  if constexpr (V > 1) {
    uint4 raw;
    memcpy(&raw, v, sizeof raw);
    *reinterpret_cast<uint4 *>(p) = raw;
  } else {
    p[0] = v[0];
  }
}

/* The first thread group of each row's run in the sorted list sums the
 * run into dst's row: worker w = k * units + u takes columns
 * [u * V, u * V + V) of slot k's row when slot k starts the run. V > 1:
 * rows of whole 16-byte units at 16-byte addresses. */
template <int DT, int V>
__global__ void tt_add_sorted_rows(int64_t inner, int64_t units, const int32_t *__restrict__ nvalid,
                                   const int32_t *__restrict__ order, const int32_t *__restrict__ rows,
                                   typename tt_acc<DT>::S *__restrict__ dst,
                                   const typename tt_acc<DT>::S *__restrict__ src) {
  typedef tt_acc<DT> Op;
  typedef typename Op::S S;
  const int64_t n = *nvalid, W = n * units;
  for (int64_t w = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; w < W; w += (int64_t)gridDim.x * blockDim.x) {
    const int64_t k = w / units, c0 = (w - k * units) * V;
    const int32_t r = rows[k];
    if (k > 0 && rows[k - 1] == r) continue;
    S *d = dst + (int64_t)r * inner + c0;
    typename Op::A acc[V];
    S v[V];
    tt_unit_load<S, V>(d, v);
#pragma unroll
    for (int e = 0; e < V; e++) acc[e] = Op::load(v[e]);
    for (int64_t q = k; q < n && rows[q] == r; q++) {
      const S *sp = src + (int64_t)order[q] * inner + c0;
      tt_unit_load<S, V>(sp, v);
#pragma unroll
      for (int e = 0; e < V; e++) acc[e] = Op::add(acc[e], v[e]);
    }
#pragma unroll
    for (int e = 0; e < V; e++) v[e] = Op::store(acc[e]);
    tt_unit_store<S, V>(d, v);
  }
}

/* Row ranges: enough workers to fill the GPU when columns alone do not
 * (a function of the shape only; results never depend on it anyway). */
static int64_t tt_add_ranges(int64_t outer, int64_t inner, int64_t n_dst, int64_t n_idx, int64_t cap) {
  const int64_t want = 65536;
  int64_t cols = outer * inner, R = 1;
  if (cols < want) R = (want + cols - 1) / cols;
  if (R > cap) R = cap;
  if (R > n_dst) R = n_dst;
  if (R > n_idx) R = n_idx; /* more ranges than contributions only rescans */
  return R < 1 ? 1 : R;
}

/* TITAN_CUDA_INDEX_ADD_PLAN: 1 sorted (unset, empty or "sorted"), 0 scan,
 * -1 anything else. */
static int tt_add_sorted_setting(void) {
  const char *e = getenv("TITAN_CUDA_INDEX_ADD_PLAN");
  if (!e || !*e || !strcmp(e, "sorted")) return 1;
  return !strcmp(e, "scan") ? 0 : -1;
}

static size_t tt_round256(size_t n) { return (n + 255) & ~(size_t)255; }

/* The sorted plan for outer == 1 (above): *done = false, and nothing
 * queued, where the scratch buffer cannot hold its tables (then the scan
 * runs). */
template <int DT>
static tt_status tt_add_sorted(int device, cudaStream_t s, int op, int64_t n_dst, int64_t inner, void *dst,
                               int64_t n_idx, const int64_t *idx, const void *src, bool *done) {
  typedef typename tt_acc<DT>::S S;
  *done = false;
  if (n_dst > INT32_MAX || n_idx > INT32_MAX) return TT_OK;
  /* As many chunks as the scratch holds a row of counts for, each at most
   * TT_SORT_MAX_CHUNK ids (its placing block's shared memory). */
  const size_t fixed = tt_round256((size_t)n_dst * 4 + 4) + 2 * tt_round256((size_t)n_idx * 4);
  if (fixed >= TT_CUDA_WORKSPACE) return TT_OK;
  const size_t hist_bytes = (size_t)n_dst * 4; /* a chunk's row of counts */
  const int64_t nb_max = (int64_t)((TT_CUDA_WORKSPACE - fixed) / tt_round256(hist_bytes));
  int64_t nb = (n_idx + 1023) / 1024;
  if (nb > nb_max) nb = nb_max;
  if (nb < 1) return TT_OK;
  const int64_t chunk = (n_idx + nb - 1) / nb;
  if (chunk > TT_SORT_MAX_CHUNK) return TT_OK;
  nb = (n_idx + chunk - 1) / chunk;
  void *ws;
  std::unique_lock<std::mutex> hold;
  tt_status st = tt_cuda_workspace(device, &ws, &hold);
  if (st != TT_OK) return st;
  char *p = (char *)ws;
  int32_t *hist = (int32_t *)p;
  p += tt_round256((size_t)nb * hist_bytes);
  int32_t *start = (int32_t *)p, *nvalid = start + n_dst;
  p += tt_round256((size_t)n_dst * 4 + 4);
  int32_t *order = (int32_t *)p;
  p += tt_round256((size_t)n_idx * 4);
  int32_t *rows = (int32_t *)p;
  tt_index_fault *f = tt_cuda_fault(device);
  TT_CUDA_CHECK(cudaMemsetAsync(hist, 0, (size_t)nb * hist_bytes, s));
  tt_add_sort_count<<<(unsigned)nb, TT_CUDA_THREADS, 0, s>>>(n_dst, n_idx, chunk, idx, hist, f, op);
  TT_CUDA_CHECK_LAUNCH("tt_add_sort_count");
  tt_add_sort_bases<<<tt_cuda_blocks(n_dst), TT_CUDA_THREADS, 0, s>>>(n_dst, nb, hist, start);
  TT_CUDA_CHECK_LAUNCH("tt_add_sort_bases");
  tt_add_sort_scan<<<1, TT_SORT_SCAN_THREADS, 0, s>>>(n_dst, start, nvalid);
  TT_CUDA_CHECK_LAUNCH("tt_add_sort_scan");
  tt_add_sort_place<<<(unsigned)nb, 1024, 0, s>>>(n_dst, n_idx, chunk, idx, hist, start, order, rows);
  TT_CUDA_CHECK_LAUNCH("tt_add_sort_place");
  constexpr int V = 16 / sizeof(S);
  if (((size_t)inner * sizeof(S)) % 16 == 0 && tt_al16(dst) && tt_al16(src)) {
    const int64_t units = inner / V;
    tt_add_sorted_rows<DT, V><<<tt_cuda_blocks(n_idx * units), TT_CUDA_THREADS, 0, s>>>(
        inner, units, nvalid, order, rows, (S *)dst, (const S *)src);
  } else {
    tt_add_sorted_rows<DT, 1><<<tt_cuda_blocks(n_idx * inner), TT_CUDA_THREADS, 0, s>>>(
        inner, inner, nvalid, order, rows, (S *)dst, (const S *)src);
  }
  TT_CUDA_CHECK_LAUNCH("tt_add_sorted_rows");
  *done = true;
  return TT_OK;
}

template <int DT>
static tt_status tt_add_launch(int op, int scatter, int64_t outer, int64_t n_dst, int64_t inner, void *dst,
                               int64_t n_idx, const int64_t *idx, const void *src) {
  typedef typename tt_acc<DT>::S S;
  int device;
  cudaStream_t s;
  tt_status st = tt_cuda_current(&device, &s);
  if (st != TT_OK) return st;
  tt_index_fault *f = tt_cuda_fault(device);
  if (!scatter) {
    const int plan = tt_add_sorted_setting(); /* read for every call, so a misspelt value never goes unnoticed */
    if (plan < 0)
      return tt_error_set(TT_ERR_INVALID, "cuda %s: TITAN_CUDA_INDEX_ADD_PLAN=%s: expected sorted or scan",
                          op == TT_FAULT_EMBEDDING_BACKWARD ? "embedding_backward" : "index_add",
                          getenv("TITAN_CUDA_INDEX_ADD_PLAN"));
    if (plan == 1 && outer == 1) {
      bool done;
      if ((st = tt_add_sorted<DT>(device, s, op, n_dst, inner, dst, n_idx, idx, src, &done)) != TT_OK) return st;
      if (done) return TT_OK;
    }
  }
  if (scatter) {
    int64_t R = tt_add_ranges(outer, inner, n_dst, n_idx, 64);
    tt_scatter_add_kernel<DT><<<tt_cuda_blocks(outer * R * inner), TT_CUDA_THREADS, 0, s>>>(
        outer, n_dst, inner, R, (S *)dst, n_idx, idx, (const S *)src, f, op);
    TT_CUDA_CHECK_LAUNCH("tt_scatter_add_kernel");
  } else {
    int64_t R = tt_add_ranges(outer, inner, n_dst, n_idx, 1024);
    tt_index_add_kernel<DT><<<tt_cuda_blocks(outer * R * inner), TT_CUDA_THREADS, 0, s>>>(
        outer, n_dst, inner, R, (S *)dst, n_idx, idx, (const S *)src, f, op);
    TT_CUDA_CHECK_LAUNCH("tt_index_add_kernel");
  }
  return TT_OK;
}

/* Shared with embed.cu (the embedding gradient is an index_add with outer 1). */
tt_status tt_cuda_add_rows(int op, const char *name, int scatter, int dtype, int64_t outer, int64_t n_dst,
                           int64_t inner, void *dst, int64_t n_idx, const int64_t *idx, const void *src) {
  if (dtype != TT_F32 && dtype != TT_F64 && dtype != TT_BF16 && dtype != TT_F16 && dtype != TT_I32 && dtype != TT_I64)
    return tt_error_set(TT_ERR_DTYPE, "cuda %s: dtype %d not supported (f32, f64, bf16, f16, i32, i64)", name, dtype);
  if (outer <= 0 || inner <= 0 || n_idx <= 0 || n_dst <= 0) return TT_OK;
  switch (dtype) {
    case TT_F32: return tt_add_launch<TT_F32>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
    case TT_F64: return tt_add_launch<TT_F64>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
    case TT_BF16: return tt_add_launch<TT_BF16>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
    case TT_F16: return tt_add_launch<TT_F16>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
    case TT_I32: return tt_add_launch<TT_I32>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
    default: return tt_add_launch<TT_I64>(op, scatter, outer, n_dst, inner, dst, n_idx, idx, src);
  }
}

extern "C" tt_status tt_cuda_index_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst,
                                       int64_t n_idx, const int64_t *idx, const void *src) {
  return tt_cuda_add_rows(TT_FAULT_INDEX_ADD, "index_add", 0, dtype, outer, n_dst, inner, dst, n_idx, idx, src);
}

extern "C" tt_status tt_cuda_scatter_add(int dtype, int64_t outer, int64_t n_dst, int64_t inner, void *dst,
                                         int64_t n_idx, const int64_t *idx, const void *src) {
  return tt_cuda_add_rows(TT_FAULT_SCATTER_ADD, "scatter_add", 1, dtype, outer, n_dst, inner, dst, n_idx, idx, src);
}
