/*
 * dataset.c — pre-tokenized binary token files (docs/data.md).
 *
 * A file is a fixed 64-byte little-endian header followed by the tokens as
 * uint16 or uint32 (llm.c's layout, with a magic string and a version so a
 * stray file is rejected instead of being read as tokens):
 *
 *   0  magic "TTOKENS1"      8 bytes
 *   8  version (1)           u32
 *  12  token bytes (2 | 4)   u32
 *  16  token count           u64
 *  24  document count        u64
 *  32  vocab size            u32
 *  36  header bytes (64)     u32
 *  40  reserved, zero        24 bytes
 *
 * The writer fills a temporary file next to the destination and renames it
 * into place only after the header holds the final counts and the data is on
 * disk, so a crash never leaves a file under the final name that looks whole.
 * The reader maps the file and checks its size against the header before any
 * token is read: a truncated copy fails at open, not mid-run.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define TT_TOKENS_MAGIC "TTOKENS1"
#define TT_TOKENS_VERSION 1u
#define TT_TOKENS_HEADER_BYTES 64u
/* Tokens converted per write: bounds the writer's staging buffer. */
#define TT_TOKENS_CHUNK 65536

struct tt_tokens {
  char *path;
  unsigned char *map; /* whole file, read-only */
  size_t map_bytes;
  const unsigned char *data; /* first token */
  tt_tokens_header header;
};

struct tt_tokens_writer {
  char *path; /* final name */
  char *tmp;  /* where the bytes go until finish */
  FILE *fp;
  uint32_t token_bytes;
  uint32_t vocab_size;
  uint64_t num_tokens;
  uint64_t num_docs;
  unsigned char buf[TT_TOKENS_CHUNK * 4];
};

/* ---- little-endian encoding (explicit, so the format does not depend on
 * the host's byte order; compilers turn these into plain loads/stores) ---- */

static void tt_put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void tt_put_u64(unsigned char *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t tt_get_u32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t tt_get_u64(const unsigned char *p) {
  return (uint64_t)tt_get_u32(p) | (uint64_t)tt_get_u32(p + 4) << 32;
}

static char *tt_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

static void tt_encode_header(unsigned char h[TT_TOKENS_HEADER_BYTES], uint32_t token_bytes, uint64_t num_tokens,
                             uint64_t num_docs, uint32_t vocab_size) {
  memset(h, 0, TT_TOKENS_HEADER_BYTES);
  memcpy(h, TT_TOKENS_MAGIC, 8);
  tt_put_u32(h + 8, TT_TOKENS_VERSION);
  tt_put_u32(h + 12, token_bytes);
  tt_put_u64(h + 16, num_tokens);
  tt_put_u64(h + 24, num_docs);
  tt_put_u32(h + 32, vocab_size);
  tt_put_u32(h + 36, TT_TOKENS_HEADER_BYTES);
}

/* ---- writer ------------------------------------------------------------- */

static void tt_writer_free(tt_tokens_writer *w) {
  if (!w) return;
  if (w->fp) fclose(w->fp);
  free(w->path);
  free(w->tmp);
  free(w);
}

tt_status tt_tokens_writer_open(const char *path, uint32_t vocab_size, uint32_t token_bytes,
                                tt_tokens_writer **out) {
  *out = NULL;
  if (!path || !*path) return tt_error_set(TT_ERR_INVALID, "tokens writer: empty output path");
  if (vocab_size == 0)
    return tt_error_set(TT_ERR_INVALID, "tokens writer '%s': vocab size must be at least 1", path);
  if (token_bytes == 0) token_bytes = vocab_size <= 65536u ? 2u : 4u;
  if (token_bytes != 2 && token_bytes != 4)
    return tt_error_set(TT_ERR_INVALID, "tokens writer '%s': token width %u bytes (expected 2 or 4)", path,
                        token_bytes);
  if (token_bytes == 2 && vocab_size > 65536u)
    return tt_error_set(TT_ERR_INVALID,
                        "tokens writer '%s': vocab size %u does not fit 2-byte tokens (at most 65536; use 4)",
                        path, vocab_size);
  tt_tokens_writer *w = calloc(1, sizeof *w);
  if (!w) return tt_error_set(TT_ERR_OOM, "tokens writer '%s': out of host memory", path);
  w->path = tt_strdup(path);
  size_t n = strlen(path) + 32;
  w->tmp = malloc(n);
  if (!w->path || !w->tmp) {
    tt_writer_free(w);
    return tt_error_set(TT_ERR_OOM, "tokens writer '%s': out of host memory", path);
  }
  /* The pid keeps two writers of the same destination (two ranks, two
   * shells) from writing into one temporary file. */
  snprintf(w->tmp, n, "%s.tmp.%ld", path, (long)getpid());
  w->fp = fopen(w->tmp, "wb");
  if (!w->fp) {
    int e = errno;
    tt_status st = tt_error_set(TT_ERR_IO, "tokens writer: cannot create '%s': %s", w->tmp, strerror(e));
    tt_writer_free(w);
    return st;
  }
  w->token_bytes = token_bytes;
  w->vocab_size = vocab_size;
  /* A zeroed header (no magic) until finish: even a temporary file renamed
   * by hand is rejected rather than read with wrong counts. */
  unsigned char zero[TT_TOKENS_HEADER_BYTES] = {0};
  if (fwrite(zero, 1, sizeof zero, w->fp) != sizeof zero) {
    int e = errno;
    tt_status st = tt_error_set(TT_ERR_IO, "tokens writer: cannot write '%s': %s", w->tmp, strerror(e));
    tt_tokens_writer_abort(w);
    return st;
  }
  *out = w;
  return TT_OK;
}

const char *tt_tokens_writer_temp_path(const tt_tokens_writer *w) { return w ? w->tmp : NULL; }

tt_status tt_tokens_writer_append(tt_tokens_writer *w, const int32_t *tokens, int64_t n, int64_t num_docs) {
  if (!w || !w->fp) return tt_error_set(TT_ERR_INVALID, "tokens writer: append after finish or abort");
  if (n < 0 || num_docs < 0)
    return tt_error_set(TT_ERR_INVALID, "tokens writer '%s': negative count (%lld tokens, %lld documents)",
                        w->path, (long long)n, (long long)num_docs);
  if (n > 0 && !tokens) return tt_error_set(TT_ERR_INVALID, "tokens writer '%s': NULL tokens", w->path);
  for (int64_t done = 0; done < n;) {
    int64_t m = n - done < TT_TOKENS_CHUNK ? n - done : TT_TOKENS_CHUNK;
    const int32_t *src = tokens + done;
    for (int64_t i = 0; i < m; i++) {
      /* Checked here, once, so readers can trust every stored id. */
      if (src[i] < 0 || (uint32_t)src[i] >= w->vocab_size)
        return tt_error_set(TT_ERR_INDEX,
                            "tokens writer '%s': token %d at position %llu is outside the vocabulary [0, %u)",
                            w->path, src[i], (unsigned long long)(w->num_tokens + (uint64_t)(done + i)),
                            w->vocab_size);
    }
    if (w->token_bytes == 2) {
      for (int64_t i = 0; i < m; i++) {
        w->buf[2 * i] = (unsigned char)src[i];
        w->buf[2 * i + 1] = (unsigned char)(src[i] >> 8);
      }
    } else {
      for (int64_t i = 0; i < m; i++) tt_put_u32(w->buf + 4 * i, (uint32_t)src[i]);
    }
    size_t bytes = (size_t)m * w->token_bytes;
    if (fwrite(w->buf, 1, bytes, w->fp) != bytes) {
      int e = errno;
      return tt_error_set(TT_ERR_IO, "tokens writer: cannot write '%s': %s", w->tmp, strerror(e));
    }
    done += m;
  }
  w->num_tokens += (uint64_t)n;
  w->num_docs += (uint64_t)num_docs;
  return TT_OK;
}

/* fsync the directory so the rename itself survives a power cut. */
static void tt_sync_dir(const char *path) {
  char *copy = tt_strdup(path);
  if (!copy) return;
  int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  free(copy);
}

tt_status tt_tokens_writer_finish(tt_tokens_writer *w) {
  if (!w || !w->fp) {
    tt_writer_free(w);
    return tt_error_set(TT_ERR_INVALID, "tokens writer: finish after finish or abort");
  }
  unsigned char h[TT_TOKENS_HEADER_BYTES];
  tt_encode_header(h, w->token_bytes, w->num_tokens, w->num_docs, w->vocab_size);
  const char *step = "write";
  int ok = fflush(w->fp) == 0;
  if (ok) ok = fseek(w->fp, 0, SEEK_SET) == 0;
  if (ok) ok = fwrite(h, 1, sizeof h, w->fp) == sizeof h;
  if (ok) ok = fflush(w->fp) == 0;
  if (ok) {
    step = "sync";
    ok = fsync(fileno(w->fp)) == 0;
  }
  int e = errno;
  if (fclose(w->fp) != 0 && ok) {
    ok = 0;
    e = errno;
  }
  w->fp = NULL;
  if (ok && rename(w->tmp, w->path) != 0) {
    step = "rename into place";
    ok = 0;
    e = errno;
  }
  tt_status st = TT_OK;
  if (!ok) {
    st = tt_error_set(TT_ERR_IO, "tokens writer: cannot %s '%s' (for '%s'): %s", step, w->tmp, w->path,
                      strerror(e));
    remove(w->tmp);
  } else {
    tt_sync_dir(w->path);
  }
  tt_writer_free(w);
  return st;
}

void tt_tokens_writer_abort(tt_tokens_writer *w) {
  if (!w) return;
  if (w->fp) {
    fclose(w->fp);
    w->fp = NULL;
    remove(w->tmp);
  }
  tt_writer_free(w);
}

/* ---- reader --------------------------------------------------------------- */

static tt_status tt_tokens_fail(tt_tokens *t, int fd, tt_status st) {
  if (fd >= 0) close(fd);
  if (t) {
    free(t->path);
    free(t);
  }
  return st;
}

tt_status tt_tokens_open(const char *path, tt_tokens **out) {
  *out = NULL;
  if (!path || !*path) return tt_error_set(TT_ERR_INVALID, "tokens: empty path");
  int fd = open(path, O_RDONLY);
  if (fd < 0) {
    int e = errno;
    return tt_error_set(TT_ERR_IO, "tokens: cannot open '%s': %s", path, strerror(e));
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    return tt_tokens_fail(NULL, fd, tt_error_set(TT_ERR_IO, "tokens: cannot stat '%s': %s", path, strerror(e)));
  }
  if (!S_ISREG(sb.st_mode))
    return tt_tokens_fail(NULL, fd, tt_error_set(TT_ERR_IO, "tokens: '%s' is not a regular file", path));
  uint64_t size = (uint64_t)sb.st_size;
  unsigned char h[TT_TOKENS_HEADER_BYTES];
  if (size < TT_TOKENS_HEADER_BYTES)
    return tt_tokens_fail(NULL, fd,
                          tt_error_set(TT_ERR_IO,
                                       "tokens: '%s' has %llu bytes, fewer than the %u-byte header of a titan "
                                       "token file (truncated, or not a token file)",
                                       path, (unsigned long long)size, TT_TOKENS_HEADER_BYTES));
  ssize_t got = pread(fd, h, sizeof h, 0);
  if (got != (ssize_t)sizeof h) {
    int e = got < 0 ? errno : EIO;
    return tt_tokens_fail(NULL, fd, tt_error_set(TT_ERR_IO, "tokens: cannot read the header of '%s': %s", path,
                                                 strerror(e)));
  }
  if (memcmp(h, TT_TOKENS_MAGIC, 8) != 0) {
    char shown[8 * 4 + 1];
    size_t k = 0;
    for (int i = 0; i < 8; i++) {
      if (h[i] >= 32 && h[i] < 127) shown[k++] = (char)h[i];
      else k += (size_t)snprintf(shown + k, sizeof shown - k, "\\x%02x", h[i]);
    }
    shown[k] = 0;
    return tt_tokens_fail(NULL, fd,
                          tt_error_set(TT_ERR_IO,
                                       "tokens: '%s' starts with \"%s\", not the magic \"" TT_TOKENS_MAGIC
                                       "\" (not a titan token file; make one with `titan data prepare`)",
                                       path, shown));
  }
  tt_tokens_header hd;
  hd.version = tt_get_u32(h + 8);
  hd.token_bytes = tt_get_u32(h + 12);
  hd.num_tokens = tt_get_u64(h + 16);
  hd.num_docs = tt_get_u64(h + 24);
  hd.vocab_size = tt_get_u32(h + 32);
  hd.header_bytes = tt_get_u32(h + 36);
  if (hd.version != TT_TOKENS_VERSION)
    return tt_tokens_fail(NULL, fd,
                          tt_error_set(TT_ERR_IO,
                                       "tokens: '%s' is format version %u; this build reads version %u",
                                       path, hd.version, TT_TOKENS_VERSION));
  if (hd.token_bytes != 2 && hd.token_bytes != 4)
    return tt_tokens_fail(NULL, fd,
                          tt_error_set(TT_ERR_IO, "tokens: '%s' header says %u-byte tokens (expected 2 or 4)",
                                       path, hd.token_bytes));
  if (hd.header_bytes != TT_TOKENS_HEADER_BYTES)
    return tt_tokens_fail(NULL, fd,
                          tt_error_set(TT_ERR_IO, "tokens: '%s' header says %u header bytes (version 1 has %u)",
                                       path, hd.header_bytes, TT_TOKENS_HEADER_BYTES));
  /* Overflow-safe: a corrupt count must not wrap into a matching size. */
  uint64_t body = size - TT_TOKENS_HEADER_BYTES;
  if (hd.num_tokens > UINT64_MAX / hd.token_bytes || hd.num_tokens * hd.token_bytes != body) {
    unsigned long long want_body =
        hd.num_tokens > UINT64_MAX / hd.token_bytes ? 0ull : (unsigned long long)(hd.num_tokens * hd.token_bytes);
    return tt_tokens_fail(
        NULL, fd,
        tt_error_set(TT_ERR_IO,
                     "tokens: '%s' is %s: the header says %llu tokens of %u bytes (%u + %llu = %llu bytes) but "
                     "the file has %llu bytes",
                     path, body < want_body ? "truncated" : "corrupt (size does not match its header)",
                     (unsigned long long)hd.num_tokens, hd.token_bytes, TT_TOKENS_HEADER_BYTES, want_body,
                     want_body + TT_TOKENS_HEADER_BYTES, (unsigned long long)size));
  }
  tt_tokens *t = calloc(1, sizeof *t);
  if (!t) return tt_tokens_fail(NULL, fd, tt_error_set(TT_ERR_OOM, "tokens '%s': out of host memory", path));
  t->path = tt_strdup(path);
  if (!t->path) return tt_tokens_fail(t, fd, tt_error_set(TT_ERR_OOM, "tokens '%s': out of host memory", path));
  void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    int e = errno;
    return tt_tokens_fail(t, fd, tt_error_set(TT_ERR_IO, "tokens: cannot map '%s': %s", path, strerror(e)));
  }
  close(fd); /* the mapping keeps the file alive */
  t->map = map;
  t->map_bytes = (size_t)size;
  t->data = t->map + TT_TOKENS_HEADER_BYTES;
  t->header = hd;
  *out = t;
  return TT_OK;
}

void tt_tokens_close(tt_tokens *t) {
  if (!t) return;
  if (t->map) munmap(t->map, t->map_bytes);
  free(t->path);
  free(t);
}

int64_t tt_tokens_len(const tt_tokens *t) { return t ? (int64_t)t->header.num_tokens : 0; }

tt_status tt_tokens_describe(const tt_tokens *t, tt_tokens_header *out) {
  if (!t) return tt_error_set(TT_ERR_INVALID, "tokens: closed file");
  *out = t->header;
  return TT_OK;
}

static tt_status tt_tokens_check_window(const tt_tokens *t, int64_t start, int64_t len) {
  if (!t) return tt_error_set(TT_ERR_INVALID, "tokens: read from a closed file");
  if (start < 0 || len < 0 || (uint64_t)start > t->header.num_tokens ||
      (uint64_t)len > t->header.num_tokens - (uint64_t)start)
    return tt_error_set(TT_ERR_INDEX, "tokens '%s': window [%lld, %lld) is outside the file's %llu tokens", t->path,
                        (long long)start, (long long)start + (long long)len,
                        (unsigned long long)t->header.num_tokens);
  return TT_OK;
}

/* The one copy loop: widen stored tokens to i32 or i64. */
static void tt_tokens_decode(const tt_tokens *t, int64_t start, int64_t len, int dtype, void *dst) {
  const unsigned char *p = t->data + (size_t)start * t->header.token_bytes;
  if (t->header.token_bytes == 2) {
    if (dtype == TT_I64) {
      int64_t *d = dst;
      for (int64_t i = 0; i < len; i++) d[i] = (int64_t)((uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8);
    } else {
      int32_t *d = dst;
      for (int64_t i = 0; i < len; i++) d[i] = (int32_t)((uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8);
    }
  } else {
    if (dtype == TT_I64) {
      int64_t *d = dst;
      for (int64_t i = 0; i < len; i++) d[i] = (int64_t)tt_get_u32(p + 4 * i);
    } else {
      /* Ids at or above 2^31 cannot be i32; the writer's vocab check keeps
       * real files far below that. */
      int32_t *d = dst;
      for (int64_t i = 0; i < len; i++) d[i] = (int32_t)tt_get_u32(p + 4 * i);
    }
  }
}

tt_status tt_tokens_read(const tt_tokens *t, int64_t start, int64_t len, int dtype, void *dst) {
  TT_TRY(tt_tokens_check_window(t, start, len));
  if (dtype != TT_I32 && dtype != TT_I64)
    return tt_error_set(TT_ERR_DTYPE, "tokens '%s': read into %s (expected int32 or int64)", t->path,
                        tt_dtype_name(dtype));
  if (len > 0 && !dst) return tt_error_set(TT_ERR_INVALID, "tokens '%s': read into a NULL buffer", t->path);
  tt_tokens_decode(t, start, len, dtype, dst);
  return TT_OK;
}

tt_status tt_tokens_read_tensor(const tt_tokens *t, int64_t start, int64_t len, tt_tensor *dst, int64_t dst_offset) {
  TT_TRY(tt_tokens_check_window(t, start, len));
  char sa[128];
  if (!dst) return tt_error_set(TT_ERR_INVALID, "tokens '%s': read into a NULL tensor", t->path);
  if (dst->dtype != TT_I32 && dst->dtype != TT_I64)
    return tt_error_set(TT_ERR_DTYPE, "tokens '%s': read into a %s tensor (expected int32 or int64)", t->path,
                        tt_dtype_name(dst->dtype));
  if (dst->device.type != TT_CPU)
    return tt_error_set(TT_ERR_DEVICE, "tokens '%s': read into a tensor on %s (expected cpu; copy it after)",
                        t->path, tt_device_name(dst->device, sa, sizeof sa));
  if (!tt_tensor_is_contiguous(dst))
    return tt_error_set(TT_ERR_LAYOUT, "tokens '%s': read into a non-contiguous tensor of shape %s", t->path,
                        tt_tensor_shape_str(dst, sa, sizeof sa));
  int64_t numel = tt_tensor_numel(dst);
  if (dst_offset < 0 || dst_offset > numel || len > numel - dst_offset)
    return tt_error_set(TT_ERR_INDEX, "tokens '%s': %lld tokens at element %lld do not fit a tensor of shape %s",
                        t->path, (long long)len, (long long)dst_offset, tt_tensor_shape_str(dst, sa, sizeof sa));
  tt_tokens_decode(t, start, len, dst->dtype, (char *)tt_tensor_data(dst) + (size_t)dst_offset * tt_dtype_size(dst->dtype));
  return TT_OK;
}
