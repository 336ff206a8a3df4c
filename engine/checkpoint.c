/*
 * checkpoint.c — the byte side of checkpoints: CRC-32C, the per-rank data
 * file writer (inline or on a POSIX thread, from snapshots taken when a
 * tensor is queued: CUDA tensors copied asynchronously into pinned memory,
 * engine/pinned.c), the region reader that copies any box of a stored chunk
 * into any box of a tensor, the few file-system calls a crash-safe commit
 * needs, and the SIGTERM/SIGINT flag.
 *
 * Decisions (which chunks, which boxes, the metadata) are Lua's
 * (lua/titan/checkpoint/); this file only moves bytes. The format is
 * documented in docs/checkpoint_format.md.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/* ---- CRC-32C (Castagnoli), slicing by 8 --------------------------------- */

static uint32_t tt_crc_table[8][256];
static pthread_once_t tt_crc_once = PTHREAD_ONCE_INIT;

static void tt_crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    tt_crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++) tt_crc_table[t][i] = (tt_crc_table[t - 1][i] >> 8) ^ tt_crc_table[0][tt_crc_table[t - 1][i] & 0xff];
}

uint32_t tt_crc32c(uint32_t crc, const void *data, size_t n) {
  pthread_once(&tt_crc_once, tt_crc_init);
  const unsigned char *p = data;
  uint32_t c = ~crc;
  while (n && ((uintptr_t)p & 7)) {
    c = (c >> 8) ^ tt_crc_table[0][(c ^ *p++) & 0xff];
    n--;
  }
  while (n >= 8) { /* little-endian hosts only (the format is little-endian) */
    uint64_t w;
    memcpy(&w, p, 8);
    w ^= c;
    c = tt_crc_table[7][w & 0xff] ^ tt_crc_table[6][(w >> 8) & 0xff] ^ tt_crc_table[5][(w >> 16) & 0xff] ^
        tt_crc_table[4][(w >> 24) & 0xff] ^ tt_crc_table[3][(w >> 32) & 0xff] ^ tt_crc_table[2][(w >> 40) & 0xff] ^
        tt_crc_table[1][(w >> 48) & 0xff] ^ tt_crc_table[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tt_crc_table[0][(c ^ *p++) & 0xff];
  return ~c;
}

/* ---- whole reads and writes ------------------------------------------- */

static tt_status tt_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
  const char *p = buf;
  while (n) {
    size_t step = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    ssize_t w = pwrite(fd, p, step, (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return tt_error_set(TT_ERR_IO, "checkpoint: cannot write %s at byte %llu: %s", path, (unsigned long long)off,
                          strerror(errno));
    }
    p += w;
    off += (uint64_t)w;
    n -= (size_t)w;
  }
  return TT_OK;
}

/* Reads exactly n bytes or reports where the file ended. */
static tt_status tt_pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path, const char *what) {
  char *p = buf;
  uint64_t start = off, want_end = off + n;
  while (n) {
    size_t step = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    ssize_t r = pread(fd, p, step, (off_t)off);
    if (r < 0) {
      if (errno == EINTR) continue;
      return tt_error_set(TT_ERR_IO, "checkpoint: cannot read %s (tensor %s): %s", path, what, strerror(errno));
    }
    if (r == 0)
      return tt_error_set(TT_ERR_IO,
                          "checkpoint: %s is truncated: tensor %s needs bytes [%llu, %llu) but the file ends at %llu",
                          path, what, (unsigned long long)start, (unsigned long long)want_end, (unsigned long long)off);
    p += r;
    off += (uint64_t)r;
    n -= (size_t)r;
  }
  return TT_OK;
}

static tt_status tt_fsync_fd(int fd, const char *path) {
  while (fsync(fd) != 0) {
    if (errno == EINTR) continue;
    if (errno == EINVAL || errno == EROFS) return TT_OK; /* special files: nothing to flush */
    return tt_error_set(TT_ERR_IO, "checkpoint: cannot fsync %s: %s", path, strerror(errno));
  }
  return TT_OK;
}

/* ---- the data file writer ---------------------------------------------- */

#define TT_CKPT_MAGIC "TITANCKP"
#define TT_CKPT_VERSION 1u
#define TT_CKPT_HEADER 64u
#define TT_CKPT_ALIGN 64u

typedef struct {
  tt_tensor *t;          /* retained (or a host snapshot we own); NULL for a pinned snapshot */
  void *pinned;          /* a pinned snapshot: the stored bytes, packed (engine/pinned.c) */
  void *copied;          /* the copy into `pinned` still to be waited for (an event of be) */
  const tt_kernels *be;  /* the backend copying into `pinned` */
  int dtype;
  uint64_t offset, nbytes;
  uint32_t crc;
} tt_ckpt_item;

struct tt_ckpt_writer {
  char *path;
  int fd;
  uint32_t rank;
  tt_ckpt_item *items;
  int64_t n, cap;
  uint64_t size;
  int started, thread_live;
  pthread_t thread;
  int done; /* atomic */
  tt_status status;
  char err[1024];
};

static uint64_t tt_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

tt_status tt_ckpt_writer_open(const char *path, int rank, tt_ckpt_writer **out) {
  *out = NULL;
  tt_ckpt_writer *w = calloc(1, sizeof *w);
  if (!w || !(w->path = strdup(path))) {
    free(w);
    return tt_error_set(TT_ERR_OOM, "checkpoint: out of host memory opening %s", path);
  }
  /* O_EXCL: a writer never replaces an existing file. */
  w->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    tt_status st = tt_error_set(TT_ERR_IO, "checkpoint: cannot create %s: %s", path, strerror(errno));
    free(w->path);
    free(w);
    return st;
  }
  w->rank = (uint32_t)rank;
  w->size = TT_CKPT_HEADER;
  *out = w;
  return TT_OK;
}

/* A device tensor's snapshot into pinned host memory, without a host wait:
 * packed in the stored dtype on the device first when it is not already (a
 * kernel on the compute stream), then copied asynchronously (kernels.h,
 * copy_to_host_async: later kernels, such as the optimizer step, wait for
 * the copy on the device). The packed temporary goes back to the caching
 * allocator at once: whoever gets it next is queued after the copy too. */
static tt_status tt_ckpt_snapshot_pinned(tt_ckpt_item *it, tt_tensor *t, const tt_kernels *be) {
  tt_tensor *packed = NULL;
  const tt_tensor *src = t;
  if (!(t->dtype == it->dtype && tt_tensor_is_contiguous(t))) {
    TT_TRY(tt_tensor_empty(t->ndim, t->shape, it->dtype, t->device, &packed));
    src = packed;
  }
  tt_status st = packed ? tt_tensor_copy(packed, t) : TT_OK;
  if (st == TT_OK) st = tt_pinned_alloc(be, (size_t)it->nbytes, &it->pinned);
  if (st == TT_OK) {
    st = be->copy_to_host_async(t->device.index, it->pinned, tt_tensor_data(src), (size_t)it->nbytes, &it->copied);
    if (st == TT_OK) {
      it->be = be;
    } else {
      tt_pinned_free(it->pinned, (size_t)it->nbytes);
      it->pinned = NULL;
    }
  }
  tt_tensor_release(packed);
  return st;
}

/* Waits for an item's pinned snapshot to land (nothing to wait for otherwise). */
static tt_status tt_ckpt_item_landed(tt_ckpt_item *it) {
  if (!it->copied) return TT_OK;
  tt_status st = it->be->event_wait(it->copied);
  it->be->event_free(it->copied);
  it->copied = NULL;
  return st;
}

/* Gives an item's memory back; a pinned buffer only once its copy has
 * landed (until then the copy engine may still write into it). */
static void tt_ckpt_item_release(tt_ckpt_item *it) {
  (void)tt_ckpt_item_landed(it);
  tt_pinned_free(it->pinned, (size_t)it->nbytes);
  it->pinned = NULL;
  tt_tensor_release(it->t);
  it->t = NULL;
}

tt_status tt_ckpt_writer_add(tt_ckpt_writer *w, tt_tensor *t, int dtype, int snapshot, uint64_t *offset,
                             uint64_t *nbytes) {
  if (w->started) return tt_error_set(TT_ERR_INVALID, "checkpoint: %s: add after start", w->path);
  if (dtype < 0) dtype = t->dtype;
  if (dtype >= TT_NUM_DTYPES) return tt_error_set(TT_ERR_DTYPE, "checkpoint: invalid dtype %d", dtype);
  if (t->device.type == TT_META)
    return tt_error_set(TT_ERR_DEVICE, "checkpoint: cannot save a meta tensor (it has no data) into %s", w->path);
  if (w->n == w->cap) {
    int64_t cap = w->cap ? 2 * w->cap : 64;
    tt_ckpt_item *items = realloc(w->items, (size_t)cap * sizeof *items);
    if (!items) return tt_error_set(TT_ERR_OOM, "checkpoint: out of host memory queueing %s", w->path);
    w->items = items;
    w->cap = cap;
  }
  tt_ckpt_item *it = &w->items[w->n];
  memset(it, 0, sizeof *it);
  it->dtype = dtype;
  it->nbytes = (uint64_t)tt_tensor_numel(t) * tt_dtype_size(dtype);
  it->offset = tt_align_up(w->size, TT_CKPT_ALIGN);
  const tt_kernels *be = tt_backend(t->device);
  if (snapshot && t->device.type != TT_CPU && it->nbytes > 0 && be->copy_to_host_async) {
    TT_TRY(tt_ckpt_snapshot_pinned(it, t, be));
  } else if (snapshot) {
    /* A packed host copy in the stored dtype, made now: training may go on
     * changing t while the background thread writes. */
    tt_device cpu = {TT_CPU, 0};
    TT_TRY(tt_tensor_empty(t->ndim, t->shape, dtype, cpu, &it->t));
    tt_status st = tt_tensor_copy(it->t, t);
    if (st != TT_OK) {
      tt_tensor_release(it->t);
      it->t = NULL;
      return st;
    }
  } else {
    tt_tensor_retain(t);
    it->t = t;
  }
  w->size = it->offset + it->nbytes;
  w->n++;
  *offset = it->offset;
  *nbytes = it->nbytes;
  return TT_OK;
}

/* Write one item: straight from its memory when it is a pinned snapshot
 * (once landed) or a packed host tensor of the stored dtype, else through a
 * converted packed copy. */
static tt_status tt_ckpt_write_item(tt_ckpt_writer *w, tt_ckpt_item *it) {
  if (it->pinned) {
    TT_TRY(tt_ckpt_item_landed(it));
    it->crc = tt_crc32c(0, it->pinned, (size_t)it->nbytes);
    return tt_pwrite_all(w->fd, it->pinned, (size_t)it->nbytes, it->offset, w->path);
  }
  tt_tensor *src = it->t, *tmp = NULL;
  if (!(src->device.type == TT_CPU && src->dtype == it->dtype && tt_tensor_is_contiguous(src))) {
    tt_device cpu = {TT_CPU, 0};
    TT_TRY(tt_tensor_empty(src->ndim, src->shape, it->dtype, cpu, &tmp));
    tt_status st = tt_tensor_copy(tmp, src);
    if (st != TT_OK) {
      tt_tensor_release(tmp);
      return st;
    }
    src = tmp;
  }
  const void *p = it->nbytes ? tt_tensor_data(src) : "";
  it->crc = tt_crc32c(0, p, (size_t)it->nbytes);
  tt_status st = tt_pwrite_all(w->fd, p, (size_t)it->nbytes, it->offset, w->path);
  tt_tensor_release(tmp);
  return st;
}

static tt_status tt_ckpt_write_all(tt_ckpt_writer *w) {
  unsigned char hdr[TT_CKPT_HEADER];
  memset(hdr, 0, sizeof hdr);
  memcpy(hdr, TT_CKPT_MAGIC, 8);
  uint32_t version = TT_CKPT_VERSION;
  uint64_t n = (uint64_t)w->n;
  memcpy(hdr + 8, &version, 4);
  memcpy(hdr + 12, &w->rank, 4);
  memcpy(hdr + 16, &n, 8);
  memcpy(hdr + 24, &w->size, 8);
  TT_TRY(tt_pwrite_all(w->fd, hdr, sizeof hdr, 0, w->path));
  for (int64_t i = 0; i < w->n; i++) {
    TT_TRY(tt_ckpt_write_item(w, &w->items[i]));
    /* Snapshots go as soon as they are on disk: memory peaks once. */
    tt_ckpt_item_release(&w->items[i]);
  }
  /* Padding at the very end (none today) and holes stay zeros. */
  if (ftruncate(w->fd, (off_t)w->size) != 0)
    return tt_error_set(TT_ERR_IO, "checkpoint: cannot size %s: %s", w->path, strerror(errno));
  TT_TRY(tt_fsync_fd(w->fd, w->path));
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot close %s: %s", w->path, strerror(errno));
  return TT_OK;
}

static void tt_ckpt_run(tt_ckpt_writer *w) {
  w->status = tt_ckpt_write_all(w);
  if (w->status != TT_OK) snprintf(w->err, sizeof w->err, "%s", tt_last_error());
  __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
}

static void *tt_ckpt_thread(void *arg) {
  tt_ckpt_run(arg);
  return NULL;
}

tt_status tt_ckpt_writer_start(tt_ckpt_writer *w, int async) {
  if (w->started) return tt_error_set(TT_ERR_INVALID, "checkpoint: %s: started twice", w->path);
  w->started = 1;
  if (!async) {
    tt_ckpt_run(w);
    return w->status == TT_OK ? TT_OK : tt_error_set(w->status, "%s", w->err);
  }
  int rc = pthread_create(&w->thread, NULL, tt_ckpt_thread, w);
  if (rc != 0) {
    w->started = 0;
    return tt_error_set(TT_ERR_INTERNAL, "checkpoint: cannot start the writer thread for %s: %s", w->path,
                        strerror(rc));
  }
  w->thread_live = 1;
  return TT_OK;
}

int tt_ckpt_writer_done(tt_ckpt_writer *w) { return __atomic_load_n(&w->done, __ATOMIC_ACQUIRE); }

tt_status tt_ckpt_writer_wait(tt_ckpt_writer *w) {
  if (!w->started) return tt_error_set(TT_ERR_INVALID, "checkpoint: %s: wait before start", w->path);
  if (w->thread_live) {
    pthread_join(w->thread, NULL);
    w->thread_live = 0;
  }
  return w->status == TT_OK ? TT_OK : tt_error_set(w->status, "%s", w->err);
}

uint32_t tt_ckpt_writer_crc(const tt_ckpt_writer *w, int64_t i) {
  return (i >= 0 && i < w->n) ? w->items[i].crc : 0;
}

uint64_t tt_ckpt_writer_size(const tt_ckpt_writer *w) { return w->size; }

void tt_ckpt_writer_free(tt_ckpt_writer *w) {
  if (!w) return;
  if (w->thread_live) pthread_join(w->thread, NULL);
  for (int64_t i = 0; i < w->n; i++) tt_ckpt_item_release(&w->items[i]);
  if (w->fd >= 0) close(w->fd);
  free(w->items);
  free(w->path);
  free(w);
}

tt_status tt_ckpt_file_header(const char *path, uint32_t *version, uint32_t *rank, uint64_t *nchunks,
                              uint64_t *size_field, uint64_t *actual_size) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  unsigned char hdr[TT_CKPT_HEADER];
  tt_status st = TT_OK;
  if (fstat(fd, &sb) != 0) {
    st = tt_error_set(TT_ERR_IO, "checkpoint: cannot stat %s: %s", path, strerror(errno));
  } else if ((uint64_t)sb.st_size < TT_CKPT_HEADER) {
    st = tt_error_set(TT_ERR_IO, "checkpoint: %s is truncated: %llu bytes, shorter than its %u-byte header", path,
                      (unsigned long long)sb.st_size, TT_CKPT_HEADER);
  } else if ((st = tt_pread_all(fd, hdr, sizeof hdr, 0, path, "(header)")) == TT_OK) {
    if (memcmp(hdr, TT_CKPT_MAGIC, 8) != 0) {
      st = tt_error_set(TT_ERR_IO, "checkpoint: %s is not a titan checkpoint data file (bad magic)", path);
    } else {
      memcpy(version, hdr + 8, 4);
      memcpy(rank, hdr + 12, 4);
      memcpy(nchunks, hdr + 16, 8);
      memcpy(size_field, hdr + 24, 8);
      *actual_size = (uint64_t)sb.st_size;
    }
  }
  close(fd);
  return st;
}

/* ---- the region reader ------------------------------------------------- */

#define TT_CKPT_SLAB ((uint64_t)64 << 20)

static const char *tt_box_str(int ndim, const int64_t *v, char *buf, size_t len) {
  size_t p = (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < ndim && p < len; i++) p += (size_t)snprintf(buf + p, len - p, i ? ", %lld" : "%lld", (long long)v[i]);
  if (p < len) snprintf(buf + p, len - p, "]");
  return buf;
}

/* Copy a packed-or-strided host source region into dst's box. */
static tt_status tt_ckpt_scatter(int ndim, const int64_t *count, int src_dtype, const void *src,
                                 const int64_t *src_strides, tt_tensor *dst, const int64_t *dst_at) {
  int64_t off = 0;
  for (int d = 0; d < ndim; d++) off += dst_at[d] * dst->strides[d];
  if (dst->device.type == TT_CPU) {
    char *base = (char *)tt_tensor_data(dst) + (size_t)off * tt_dtype_size(dst->dtype);
    return tt_kernels_cpu()->copy(ndim, count, src_dtype, src, src_strides, dst->dtype, base, dst->strides);
  }
  /* Another device: convert on the host, then one copy into a view of dst. */
  tt_tensor *host = NULL, *view = NULL;
  tt_device cpu = {TT_CPU, 0};
  TT_TRY(tt_tensor_empty(ndim, count, dst->dtype, cpu, &host));
  tt_status st = tt_kernels_cpu()->copy(ndim, count, src_dtype, src, src_strides, dst->dtype, tt_tensor_data(host),
                                        host->strides);
  if (st == TT_OK) st = tt_tensor_new_view(dst, ndim, count, dst->strides, dst->offset + off, &view);
  if (st == TT_OK) st = tt_tensor_copy(view, host);
  tt_tensor_release(view);
  tt_tensor_release(host);
  return st;
}

tt_status tt_ckpt_read(const char *path, uint64_t offset, int dtype, int ndim, const int64_t *shape,
                       const int64_t *start, const int64_t *count, tt_tensor *dst, const int64_t *dst_start,
                       int verify, uint32_t crc, const char *what) {
  char b1[160], b2[160], b3[160];
  if (!what) what = "?";
  if (dtype < 0 || dtype >= TT_NUM_DTYPES)
    return tt_error_set(TT_ERR_DTYPE, "checkpoint: %s: tensor %s has an invalid dtype %d", path, what, dtype);
  if (ndim != dst->ndim)
    return tt_error_set(TT_ERR_SHAPE, "checkpoint: %s: tensor %s is stored with %d dims but the destination has %d",
                        path, what, ndim, dst->ndim);
  if (dst->device.type == TT_META)
    return tt_error_set(TT_ERR_DEVICE, "checkpoint: cannot load tensor %s into a meta tensor (materialize it first)",
                        what);
  int64_t one = 1, zero = 0, nstart[TT_MAX_DIMS], ncount[TT_MAX_DIMS], nshape[TT_MAX_DIMS], nat[TT_MAX_DIMS];
  int nd = ndim;
  if (ndim == 0) { /* a scalar reads as one element of a 1-d chunk */
    nd = 1;
    shape = &one;
    start = &zero;
    count = &one;
    dst_start = &zero;
  }
  int64_t numel = 1, chunk_numel = 1;
  int whole = 1;
  for (int d = 0; d < nd; d++) {
    if (start[d] < 0 || count[d] < 0 || start[d] + count[d] > shape[d])
      return tt_error_set(TT_ERR_SHAPE, "checkpoint: %s: tensor %s: box at %s of size %s is outside the stored chunk %s",
                          path, what, tt_box_str(nd, start, b1, sizeof b1), tt_box_str(nd, count, b2, sizeof b2),
                          tt_box_str(nd, shape, b3, sizeof b3));
    int64_t dlen = ndim ? dst->shape[d] : 1;
    if (dst_start[d] < 0 || dst_start[d] + count[d] > dlen)
      return tt_error_set(TT_ERR_SHAPE, "checkpoint: tensor %s: box at %s of size %s is outside the destination %s",
                          what, tt_box_str(nd, dst_start, b1, sizeof b1), tt_box_str(nd, count, b2, sizeof b2),
                          tt_tensor_shape_str(dst, b3, sizeof b3));
    numel *= count[d];
    chunk_numel *= shape[d];
    if (start[d] != 0 || count[d] != shape[d]) whole = 0;
    nstart[d] = start[d];
    ncount[d] = count[d];
    nshape[d] = shape[d];
    nat[d] = dst_start[d];
  }
  if (verify && !whole)
    return tt_error_set(TT_ERR_INVALID, "checkpoint: tensor %s: a checksum covers the whole chunk; verify a partial "
                        "read with tt_ckpt_verify", what);
  if (numel == 0) return TT_OK;
  size_t es = tt_dtype_size(dtype);
  /* Row-major strides of the chunk; k: the outermost dim of a contiguous run
   * (every dim after it is read whole). */
  int64_t cs[TT_MAX_DIMS];
  cs[nd - 1] = 1;
  for (int d = nd - 2; d >= 0; d--) cs[d] = cs[d + 1] * nshape[d + 1];
  int k = nd - 1;
  while (k > 0 && ncount[k] == nshape[k]) k--;
  int64_t run = ncount[k] * cs[k]; /* elements per run */
  uint64_t row_bytes = (uint64_t)cs[0] * es;
  int64_t slab_rows = (int64_t)(TT_CKPT_SLAB / (row_bytes ? row_bytes : 1));
  if (slab_rows < 1) slab_rows = 1;
  if (slab_rows > ncount[0]) slab_rows = ncount[0];
  uint64_t inner = (uint64_t)numel / (uint64_t)ncount[0]; /* region elements per row */
  uint64_t cap = (uint64_t)slab_rows * row_bytes;
  char *buf = malloc(cap ? cap : 1);
  if (!buf) return tt_error_set(TT_ERR_OOM, "checkpoint: out of host memory reading tensor %s", what);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    free(buf);
    return tt_error_set(TT_ERR_IO, "checkpoint: cannot open %s (tensor %s): %s", path, what, strerror(errno));
  }
  tt_status st = TT_OK;
  uint32_t c = 0;
  int64_t packed[TT_MAX_DIMS];
  for (int64_t r0 = 0; r0 < ncount[0] && st == TT_OK; r0 += slab_rows) {
    int64_t rows = ncount[0] - r0 < slab_rows ? ncount[0] - r0 : slab_rows;
    int64_t scount[TT_MAX_DIMS], sat[TT_MAX_DIMS], sfirst[TT_MAX_DIMS];
    memcpy(scount, ncount, sizeof(int64_t) * nd);
    memcpy(sat, nat, sizeof(int64_t) * nd);
    memcpy(sfirst, nstart, sizeof(int64_t) * nd);
    scount[0] = rows;
    sat[0] += r0;
    sfirst[0] += r0;
    /* The bytes from the slab's first element to its last. */
    uint64_t lo = 0, hi = 0, needed = (uint64_t)rows * inner * es;
    for (int d = 0; d < nd; d++) {
      lo += (uint64_t)(sfirst[d] * cs[d]);
      hi += (uint64_t)((sfirst[d] + scount[d] - 1) * cs[d]);
    }
    uint64_t span = (hi + 1 - lo) * es;
    if (span <= 2 * needed || span <= ((uint64_t)1 << 20)) {
      /* Dense enough: one read of the span, then a strided copy from it. */
      st = tt_pread_all(fd, buf, (size_t)span, offset + lo * es, path, what);
      if (st == TT_OK && verify) c = tt_crc32c(c, buf, (size_t)span);
      if (st == TT_OK) st = tt_ckpt_scatter(nd, scount, dtype, buf, cs, dst, sat);
    } else {
      /* Sparse (e.g. a column shard of a row-major chunk): one pread per
       * contiguous run, packed into buf. */
      if (k == 0) run = rows * cs[0];
      int64_t nruns = rows * (int64_t)inner / run, idx[TT_MAX_DIMS] = {0};
      char *p = buf;
      for (int64_t q = 0; q < nruns && st == TT_OK; q++) {
        uint64_t e = 0;
        for (int d = 0; d <= k; d++) e += (uint64_t)((sfirst[d] + idx[d]) * cs[d]);
        st = tt_pread_all(fd, p, (size_t)run * es, offset + e * es, path, what);
        p += (size_t)run * es;
        for (int d = k - 1; d >= 0; d--) { /* next run: odometer over dims < k */
          if (++idx[d] < scount[d]) break;
          idx[d] = 0;
        }
      }
      packed[nd - 1] = 1;
      for (int d = nd - 2; d >= 0; d--) packed[d] = packed[d + 1] * scount[d + 1];
      if (st == TT_OK) st = tt_ckpt_scatter(nd, scount, dtype, buf, packed, dst, sat);
    }
  }
  close(fd);
  free(buf);
  if (st == TT_OK && verify && c != crc)
    st = tt_error_set(TT_ERR_IO,
                      "checkpoint: %s is corrupt: tensor %s (bytes [%llu, %llu)) has crc32c %08x, metadata says %08x",
                      path, what, (unsigned long long)offset, (unsigned long long)(offset + (uint64_t)chunk_numel * es),
                      c, crc);
  return st;
}

/* NaN and inf elements of a buffer of `dtype`, by their exponent bits (the
 * float8 e4m3 format has no infinity: its all-ones mantissa is NaN). */
static int64_t tt_count_nonfinite(int dtype, const void *buf, size_t nbytes) {
  int64_t k = 0;
  switch (dtype) {
    case TT_F32: {
      const uint32_t *x = buf;
      for (size_t i = 0; i < nbytes / 4; i++) k += (x[i] & 0x7f800000u) == 0x7f800000u;
      break;
    }
    case TT_F64: {
      const uint64_t *x = buf;
      for (size_t i = 0; i < nbytes / 8; i++) k += (x[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
      break;
    }
    case TT_BF16: {
      const uint16_t *x = buf;
      for (size_t i = 0; i < nbytes / 2; i++) k += (x[i] & 0x7f80u) == 0x7f80u;
      break;
    }
    case TT_F16: {
      const uint16_t *x = buf;
      for (size_t i = 0; i < nbytes / 2; i++) k += (x[i] & 0x7c00u) == 0x7c00u;
      break;
    }
    case TT_F8E4M3: {
      const uint8_t *x = buf;
      for (size_t i = 0; i < nbytes; i++) k += (x[i] & 0x7fu) == 0x7fu;
      break;
    }
    case TT_F8E5M2: {
      const uint8_t *x = buf;
      for (size_t i = 0; i < nbytes; i++) k += (x[i] & 0x7cu) == 0x7cu;
      break;
    }
    default: break;
  }
  return k;
}

tt_status tt_ckpt_verify(const char *path, uint64_t offset, uint64_t nbytes, uint32_t crc, const char *what) {
  return tt_ckpt_verify_values(path, offset, nbytes, crc, -1, NULL, what);
}

tt_status tt_ckpt_verify_values(const char *path, uint64_t offset, uint64_t nbytes, uint32_t crc, int dtype,
                                int64_t *nonfinite, const char *what) {
  if (!what) what = "?";
  if (nonfinite) *nonfinite = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot open %s (tensor %s): %s", path, what, strerror(errno));
  size_t cap = 4u << 20;
  char *buf = malloc(cap);
  tt_status st = buf ? TT_OK : tt_error_set(TT_ERR_OOM, "checkpoint: out of host memory verifying %s", path);
  uint32_t c = 0;
  for (uint64_t done = 0; st == TT_OK && done < nbytes;) {
    size_t step = nbytes - done < cap ? (size_t)(nbytes - done) : cap;
    st = tt_pread_all(fd, buf, step, offset + done, path, what);
    if (st == TT_OK) c = tt_crc32c(c, buf, step);
    if (st == TT_OK && nonfinite) *nonfinite += tt_count_nonfinite(dtype, buf, step);
    done += step;
  }
  free(buf);
  close(fd);
  if (st == TT_OK && c != crc)
    st = tt_error_set(TT_ERR_IO,
                      "checkpoint: %s is corrupt: tensor %s (bytes [%llu, %llu)) has crc32c %08x, metadata says %08x",
                      path, what, (unsigned long long)offset, (unsigned long long)(offset + nbytes), c, crc);
  return st;
}

/* ---- file system ------------------------------------------------------- */

tt_status tt_fs_mkdirs(const char *path) {
  char buf[4096];
  if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
    return tt_error_set(TT_ERR_INVALID, "checkpoint: path too long: %s", path);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == 0) {
      char c = *p;
      *p = 0;
      if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return tt_error_set(TT_ERR_IO, "checkpoint: cannot create folder %s: %s", buf, strerror(errno));
      *p = c;
      if (!c) break;
    }
  }
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return tt_error_set(TT_ERR_IO, "checkpoint: %s exists and is not a folder", path);
  return TT_OK;
}

tt_status tt_fs_write_file(const char *path, const void *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot create %s: %s", path, strerror(errno));
  tt_status st = tt_pwrite_all(fd, data, n, 0, path);
  if (st == TT_OK) st = tt_fsync_fd(fd, path);
  if (close(fd) != 0 && st == TT_OK)
    st = tt_error_set(TT_ERR_IO, "checkpoint: cannot close %s: %s", path, strerror(errno));
  return st;
}

tt_status tt_fs_append(const char *path, const void *data, size_t n) {
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  off_t before = fstat(fd, &sb) == 0 ? sb.st_size : -1;
  const char *p = data;
  size_t left = n;
  tt_status st = TT_OK;
  while (left) {
    ssize_t w = write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int e = w < 0 ? errno : ENOSPC;
      /* (a line half written would be a torn record: cut back to the last whole one) */
      if (before >= 0 && ftruncate(fd, before) != 0)
        st = tt_error_set(TT_ERR_IO, "cannot write %s: %s (and cannot cut its partial record off: %s)", path,
                          strerror(e), strerror(errno));
      else
        st = tt_error_set(TT_ERR_IO, "cannot write %s: %s", path, strerror(e));
      break;
    }
    p += w;
    left -= (size_t)w;
  }
  if (close(fd) != 0 && st == TT_OK) st = tt_error_set(TT_ERR_IO, "cannot close %s: %s", path, strerror(errno));
  return st;
}

tt_status tt_fs_lock(const char *path, const char *note, int *fd_out, char *holder, size_t cap) {
  if (holder && cap) holder[0] = 0;
  *fd_out = -1;
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    if (holder && cap) {
      ssize_t n = pread(fd, holder, cap - 1, 0);
      holder[n > 0 ? n : 0] = 0;
    }
    close(fd);
    return tt_error_set(TT_ERR_IO, "%s is locked%s%s", path, e == EWOULDBLOCK ? "" : ": ",
                        e == EWOULDBLOCK ? "" : strerror(e));
  }
  /* (the holder's note, for the next job that finds it locked) */
  size_t n = note ? strlen(note) : 0;
  if (ftruncate(fd, 0) != 0 || (n && pwrite(fd, note, n, 0) != (ssize_t)n)) {
    int e = errno;
    close(fd);
    return tt_error_set(TT_ERR_IO, "cannot write %s: %s", path, strerror(e));
  }
  *fd_out = fd;
  return TT_OK;
}

void tt_fs_unlock(int fd) {
  if (fd >= 0) close(fd);
}

tt_status tt_fs_sync_dir(const char *path) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot open folder %s: %s", path, strerror(errno));
  tt_status st = tt_fsync_fd(fd, path);
  close(fd);
  return st;
}

tt_status tt_fs_rename(const char *from, const char *to, int exchange) {
  int rc = exchange ? renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_EXCHANGE)
                    : renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE);
  if (rc != 0 && errno == EINVAL && !exchange) { /* file systems without RENAME_NOREPLACE */
    struct stat sb;
    if (lstat(to, &sb) == 0) errno = EEXIST;
    else rc = rename(from, to);
  }
  if (rc != 0)
    return tt_error_set(TT_ERR_IO, "checkpoint: cannot %s %s and %s: %s", exchange ? "exchange" : "rename", from, to,
                        strerror(errno));
  return TT_OK;
}

static tt_status tt_fs_remove_at(const char *path) {
  struct stat sb;
  if (lstat(path, &sb) != 0) return errno == ENOENT ? TT_OK : tt_error_set(TT_ERR_IO, "checkpoint: cannot stat %s: %s", path, strerror(errno));
  if (S_ISDIR(sb.st_mode)) {
    DIR *d = opendir(path);
    if (!d) return tt_error_set(TT_ERR_IO, "checkpoint: cannot open folder %s: %s", path, strerror(errno));
    struct dirent *e;
    tt_status st = TT_OK;
    char child[4096];
    while (st == TT_OK && (e = readdir(d))) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      snprintf(child, sizeof child, "%s/%s", path, e->d_name);
      st = tt_fs_remove_at(child);
    }
    closedir(d);
    if (st != TT_OK) return st;
    if (rmdir(path) != 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot remove %s: %s", path, strerror(errno));
    return TT_OK;
  }
  if (unlink(path) != 0) return tt_error_set(TT_ERR_IO, "checkpoint: cannot remove %s: %s", path, strerror(errno));
  return TT_OK;
}

tt_status tt_fs_remove_all(const char *path) { return tt_fs_remove_at(path); }

tt_status tt_fs_list(const char *dir, char *buf, size_t cap, size_t *len) {
  DIR *d = opendir(dir);
  if (!d) return tt_error_set(TT_ERR_IO, "checkpoint: cannot list folder %s: %s", dir, strerror(errno));
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    size_t l = strlen(e->d_name);
    if (buf && n + l + 1 < cap) {
      memcpy(buf + n, e->d_name, l);
      buf[n + l] = '\n';
    }
    n += l + 1;
  }
  closedir(d);
  if (buf && cap) buf[n < cap ? n : cap - 1] = 0;
  *len = n;
  return TT_OK;
}

int64_t tt_fs_size(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) return -1;
  return S_ISDIR(sb.st_mode) ? -2 : (int64_t)sb.st_size;
}

int64_t tt_process_id(void) { return (int64_t)getpid(); }

/* ---- SIGTERM / SIGINT: a flag the trainer polls at step boundaries ---- */

static volatile sig_atomic_t tt_signal_seen = 0;

static void tt_signal_handler(int sig) {
  if (tt_signal_seen) {
    /* A second signal while the first is still pending: the user insists. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(sig, &dfl, NULL);
    raise(sig);
    return;
  }
  tt_signal_seen = sig;
}

tt_status tt_signal_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = tt_signal_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGINT, &sa, NULL) != 0)
    return tt_error_set(TT_ERR_INTERNAL, "signal: cannot install the SIGTERM/SIGINT handlers: %s", strerror(errno));
  return TT_OK;
}

int tt_signal_pending(void) { return (int)tt_signal_seen; }

void tt_signal_clear(void) { tt_signal_seen = 0; }
