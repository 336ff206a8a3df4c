/*
 * safetensors.c — Hugging Face's safetensors container: an 8-byte
 * little-endian header length N, N bytes of JSON (name -> dtype, shape,
 * data_offsets relative to the end of the header), then the raw tensors.
 *
 * The JSON header is built and parsed in Lua (lua/titan/checkpoint/
 * safetensors.lua, with cjson); C writes the bytes and hands the header
 * back. Reading a tensor's bytes goes through tt_ckpt_read (a stored
 * tensor is a packed row-major chunk at a byte offset), so a safetensors
 * tensor loads into any box of any dtype like a checkpoint chunk.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

static tt_status tt_st_write(int fd, const void *buf, size_t n, const char *path) {
  const char *p = buf;
  while (n) {
    ssize_t w = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return tt_error_set(TT_ERR_IO, "safetensors: cannot write %s: %s", path, strerror(errno));
    }
    p += w;
    n -= (size_t)w;
  }
  return TT_OK;
}

/* A tensor's elements, packed, in its own dtype. */
static tt_status tt_st_write_tensor(int fd, const tt_tensor *t, const char *path) {
  if (t->device.type == TT_META)
    return tt_error_set(TT_ERR_DEVICE, "safetensors: cannot write a meta tensor (it has no data) into %s", path);
  size_t nbytes = (size_t)tt_tensor_numel(t) * tt_dtype_size(t->dtype);
  if (nbytes == 0) return TT_OK;
  if (t->device.type == TT_CPU && tt_tensor_is_contiguous(t)) return tt_st_write(fd, tt_tensor_data(t), nbytes, path);
  tt_tensor *host = NULL;
  tt_device cpu = {TT_CPU, 0};
  TT_TRY(tt_tensor_empty(t->ndim, t->shape, t->dtype, cpu, &host));
  tt_status st = tt_tensor_copy(host, t);
  if (st == TT_OK) st = tt_st_write(fd, tt_tensor_data(host), nbytes, path);
  tt_tensor_release(host);
  return st;
}

tt_status tt_safetensors_write(const char *path, const char *header, size_t header_len, int n,
                               tt_tensor *const *ts) {
  /* O_EXCL: an export never replaces an existing file. */
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "safetensors: cannot create %s: %s", path, strerror(errno));
  /* Pad the header with spaces so the data starts 8-byte aligned. */
  uint64_t padded = (header_len + 7) / 8 * 8;
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(padded >> (8 * i));
  tt_status st = tt_st_write(fd, len8, 8, path);
  if (st == TT_OK) st = tt_st_write(fd, header, header_len, path);
  if (st == TT_OK && padded > header_len) st = tt_st_write(fd, "       ", (size_t)(padded - header_len), path);
  for (int i = 0; i < n && st == TT_OK; i++) st = tt_st_write_tensor(fd, ts[i], path);
  while (st == TT_OK && fsync(fd) != 0) {
    if (errno == EINTR) continue;
    st = tt_error_set(TT_ERR_IO, "safetensors: cannot fsync %s: %s", path, strerror(errno));
  }
  if (close(fd) != 0 && st == TT_OK) st = tt_error_set(TT_ERR_IO, "safetensors: cannot close %s: %s", path, strerror(errno));
  return st;
}

tt_status tt_safetensors_header(const char *path, char *buf, size_t cap, size_t *len, uint64_t *data_start) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tt_error_set(TT_ERR_IO, "safetensors: cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  unsigned char len8[8];
  tt_status st = TT_OK;
  if (fstat(fd, &sb) != 0) {
    st = tt_error_set(TT_ERR_IO, "safetensors: cannot stat %s: %s", path, strerror(errno));
  } else if (sb.st_size < 8 || pread(fd, len8, 8, 0) != 8) {
    st = tt_error_set(TT_ERR_IO, "safetensors: %s is truncated (%lld bytes, no header length)", path,
                      (long long)sb.st_size);
  } else {
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)len8[i] << (8 * i);
    if (n > (uint64_t)sb.st_size - 8 || n > ((uint64_t)100 << 20)) {
      st = tt_error_set(TT_ERR_IO, "safetensors: %s: header length %llu does not fit a %lld-byte file "
                        "(not a safetensors file?)", path, (unsigned long long)n, (long long)sb.st_size);
    } else {
      *len = (size_t)n;
      *data_start = 8 + n;
      if (buf) {
        if (cap < n + 1) {
          st = tt_error_set(TT_ERR_INVALID, "safetensors: header of %s needs %llu bytes, buffer has %zu", path,
                            (unsigned long long)n + 1, cap);
        } else {
          size_t got = 0;
          while (got < n) {
            ssize_t r = pread(fd, buf + got, (size_t)n - got, (off_t)(8 + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
              st = tt_error_set(TT_ERR_IO, "safetensors: cannot read the header of %s", path);
              break;
            }
            got += (size_t)r;
          }
          buf[n] = 0;
        }
      }
    }
  }
  close(fd);
  return st;
}
