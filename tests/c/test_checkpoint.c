/*
 * test_checkpoint.c — the byte side of checkpoints: CRC-32C, the data file
 * writer (inline and on a thread, with snapshots), the region reader (dense
 * and sparse boxes, dtype conversion, checksums, truncation), safetensors
 * and the file-system calls of a commit, and the signal flag.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "titan.h"
#include "tt_test.h"

static const tt_device CPU = {TT_CPU, 0};
static char dir[256];

static tt_tensor *make(int ndim, const int64_t *shape, int dtype) {
  tt_tensor *t = NULL;
  if (tt_tensor_empty(ndim, shape, dtype, CPU, &t) != TT_OK) {
    fprintf(stderr, "empty: %s\n", tt_last_error());
    exit(1);
  }
  return t;
}

/* t[i] = i * scale + bias in contiguous order. */
static tt_tensor *ramp(int ndim, const int64_t *shape, int dtype, double scale, double bias) {
  tt_tensor *t = make(ndim, shape, dtype);
  tt_tensor_arange(t, bias, scale);
  return t;
}

static void path_of(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", dir, name); }

static void test_crc(void) {
  CHECK(tt_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value: %08x", tt_crc32c(0, "123456789", 9));
  CHECK(tt_crc32c(0, "", 0) == 0, "empty crc");
  unsigned char buf[1000];
  for (int i = 0; i < 1000; i++) buf[i] = (unsigned char)(i * 7 + 3);
  uint32_t whole = tt_crc32c(0, buf, sizeof buf);
  uint32_t parts = tt_crc32c(tt_crc32c(tt_crc32c(0, buf, 3), buf + 3, 500), buf + 503, 497);
  CHECK(whole == parts, "crc32c streams: %08x vs %08x", whole, parts);
}

/* Write [7, 5] f32 (stored f32 and bf16) and [3] i64; read them back. */
static void test_writer_and_reader(int async) {
  char path[512];
  path_of(path, sizeof path, async ? "async.bin" : "sync.bin");
  int64_t s75[2] = {7, 5}, s3[1] = {3};
  tt_tensor *a = ramp(2, s75, TT_F32, 0.5, -3.0), *b = ramp(1, s3, TT_I64, 1, 40);
  tt_ckpt_writer *w = NULL;
  CHECK(tt_ckpt_writer_open(path, 2, &w) == TT_OK, "open: %s", tt_last_error());
  uint64_t off[3], nb[3];
  CHECK(tt_ckpt_writer_add(w, a, -1, async, &off[0], &nb[0]) == TT_OK, "add a: %s", tt_last_error());
  CHECK(tt_ckpt_writer_add(w, a, TT_BF16, async, &off[1], &nb[1]) == TT_OK, "add a bf16");
  CHECK(tt_ckpt_writer_add(w, b, -1, async, &off[2], &nb[2]) == TT_OK, "add b");
  CHECK(off[0] == 64 && nb[0] == 140 && off[1] % 64 == 0 && off[1] >= 204 && nb[1] == 70 && nb[2] == 24,
        "layout: %llu %llu %llu %llu", (unsigned long long)off[0], (unsigned long long)nb[0], (unsigned long long)off[1],
        (unsigned long long)nb[1]);
  if (async) {
    /* The snapshot was taken at add: changing a now must not reach the file. */
    tt_tensor_fill(a, 99.0);
  }
  CHECK(tt_ckpt_writer_start(w, async) == TT_OK, "start: %s", tt_last_error());
  CHECK(tt_ckpt_writer_wait(w) == TT_OK, "wait: %s", tt_last_error());
  CHECK(tt_ckpt_writer_done(w) == 1, "done");
  uint32_t crc0 = tt_ckpt_writer_crc(w, 0), crc1 = tt_ckpt_writer_crc(w, 1);
  uint64_t size = tt_ckpt_writer_size(w);
  tt_ckpt_writer_free(w);
  if (async) { /* restore the values the file holds, for the comparisons below */
    tt_tensor_release(a);
    a = ramp(2, s75, TT_F32, 0.5, -3.0);
  }

  uint32_t version, rank;
  uint64_t nchunks, size_field, actual;
  CHECK(tt_ckpt_file_header(path, &version, &rank, &nchunks, &size_field, &actual) == TT_OK, "header: %s",
        tt_last_error());
  CHECK(version == 1 && rank == 2 && nchunks == 3 && size_field == size && actual == size, "header fields");

  /* Whole read with the checksum. */
  tt_tensor *back = make(2, s75, TT_F32);
  int64_t z[2] = {0, 0};
  CHECK(tt_ckpt_read(path, off[0], TT_F32, 2, s75, z, s75, back, z, 1, crc0, "a") == TT_OK, "read a: %s",
        tt_last_error());
  CHECK(memcmp(tt_tensor_data(back), tt_tensor_data(a), 140) == 0, "a round-trips");
  /* The bf16 copy, read into f32: within bf16 rounding. */
  CHECK(tt_ckpt_read(path, off[1], TT_BF16, 2, s75, z, s75, back, z, 1, crc1, "a16") == TT_OK, "read a16: %s",
        tt_last_error());
  double err = tt_test_rel_err_f32(tt_tensor_data(back), tt_tensor_data(a), 35);
  CHECK(err < 1.0 / 128, "bf16 rounding %g", err);
  /* A wrong checksum is an error naming the file and the tensor. */
  tt_status st = tt_ckpt_read(path, off[0], TT_F32, 2, s75, z, s75, back, z, 1, crc0 ^ 1, "layers.0.w");
  CHECK(st == TT_ERR_IO && strstr(tt_last_error(), "layers.0.w") && strstr(tt_last_error(), "corrupt") &&
            strstr(tt_last_error(), path),
        "bad crc: %s", tt_last_error());
  /* A box: rows [2, 5), cols [1, 4) of a into a [3, 3] bf16 tensor. */
  int64_t start[2] = {2, 1}, count[2] = {3, 3}, s33[2] = {3, 3};
  tt_tensor *box = make(2, s33, TT_BF16);
  CHECK(tt_ckpt_read(path, off[0], TT_F32, 2, s75, start, count, box, z, 0, 0, "a") == TT_OK, "box: %s",
        tt_last_error());
  double vals[9];
  tt_tensor_to_f64(box, vals, 9);
  int ok = 1;
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 3; j++) ok &= vals[i * 3 + j] == -3.0 + 0.5 * ((i + 2) * 5 + (j + 1));
  CHECK(ok, "box values");
  /* i64 into a strided destination: column 0 of a [3, 2] tensor, the
   * stored [3] read as [3, 1]. */
  int64_t s32[2] = {3, 2}, s31[2] = {3, 1};
  tt_tensor *six = make(2, s32, TT_I64), *col = NULL;
  tt_tensor_fill(six, -1);
  CHECK(tt_view_narrow(six, 1, 0, 1, &col) == TT_OK, "narrow");
  CHECK(tt_ckpt_read(path, off[2], TT_I64, 2, s31, z, s31, col, z, 0, 0, "b") == TT_OK, "strided: %s",
        tt_last_error());
  double v6[6];
  tt_tensor_to_f64(six, v6, 6);
  CHECK(v6[0] == 40 && v6[1] == -1 && v6[2] == 41 && v6[4] == 42 && v6[5] == -1, "strided values");
  tt_tensor_release(col);
  tt_tensor_release(six);
  tt_tensor_release(box);
  tt_tensor_release(back);
  tt_tensor_release(a);
  tt_tensor_release(b);
  /* O_EXCL: a second writer on the same path fails, the file is untouched. */
  CHECK(tt_ckpt_writer_open(path, 0, &w) == TT_ERR_IO, "writer never replaces a file");
}

/* A chunk big enough for the sparse path: a column box of [1024, 512] f32. */
static void test_sparse_box(void) {
  char path[512];
  path_of(path, sizeof path, "big.bin");
  int64_t shape[2] = {1024, 512};
  tt_tensor *a = ramp(2, shape, TT_F32, 1, 0);
  tt_ckpt_writer *w = NULL;
  uint64_t off, nb;
  tt_ckpt_writer_open(path, 0, &w);
  tt_ckpt_writer_add(w, a, -1, 0, &off, &nb);
  CHECK(tt_ckpt_writer_start(w, 0) == TT_OK, "start");
  uint32_t crc = tt_ckpt_writer_crc(w, 0);
  tt_ckpt_writer_free(w);
  int64_t start[2] = {3, 200}, count[2] = {1000, 100}, dshape[2] = {1002, 101}, at[2] = {1, 1};
  tt_tensor *d = make(2, dshape, TT_F32);
  tt_tensor_fill(d, -7);
  CHECK(tt_ckpt_read(path, off, TT_F32, 2, shape, start, count, d, at, 0, 0, "big") == TT_OK, "sparse: %s",
        tt_last_error());
  const float *p = tt_tensor_data(d);
  int ok = p[0] == -7 && p[1001 * 101 + 100] == -7;
  for (int i = 0; i < 1000 && ok; i++)
    for (int j = 0; j < 100; j++) ok &= p[(i + 1) * 101 + j + 1] == (float)((i + 3) * 512 + j + 200);
  CHECK(ok, "sparse values");
  CHECK(tt_ckpt_verify(path, off, nb, crc, "big") == TT_OK, "verify: %s", tt_last_error());
  /* Flip one byte inside the chunk: verify fails, naming the tensor. */
  FILE *f = fopen(path, "r+b");
  fseek(f, (long)(off + 12345), SEEK_SET);
  int c = fgetc(f);
  fseek(f, (long)(off + 12345), SEEK_SET);
  fputc(c ^ 0x40, f);
  fclose(f);
  CHECK(tt_ckpt_verify(path, off, nb, crc, "big.w") == TT_ERR_IO && strstr(tt_last_error(), "big.w"),
        "corrupt: %s", tt_last_error());
  /* Truncate: a read past the end says so. */
  CHECK(truncate(path, (off_t)(off + nb / 2)) == 0, "truncate");
  int64_t z[2] = {0, 0};
  tt_tensor *whole = make(2, shape, TT_F32);
  tt_status st = tt_ckpt_read(path, off, TT_F32, 2, shape, z, shape, whole, z, 1, crc, "big.w");
  CHECK(st == TT_ERR_IO && strstr(tt_last_error(), "truncated") && strstr(tt_last_error(), "big.w"), "truncated: %s",
        tt_last_error());
  uint32_t v, r;
  uint64_t n, sf, actual;
  CHECK(tt_ckpt_file_header(path, &v, &r, &n, &sf, &actual) == TT_OK && actual < sf, "header shows truncation");
  tt_tensor_release(whole);
  tt_tensor_release(d);
  tt_tensor_release(a);
}

static void test_bad_boxes(void) {
  char path[512];
  path_of(path, sizeof path, "sync.bin");
  int64_t s75[2] = {7, 5}, start[2] = {5, 0}, count[2] = {3, 5}, z[2] = {0, 0};
  tt_tensor *d = make(2, count, TT_F32);
  CHECK(tt_ckpt_read(path, 64, TT_F32, 2, s75, start, count, d, z, 0, 0, "w") == TT_ERR_SHAPE, "box outside chunk");
  int64_t ok_start[2] = {0, 0}, at[2] = {1, 0};
  CHECK(tt_ckpt_read(path, 64, TT_F32, 2, s75, ok_start, count, d, at, 0, 0, "w") == TT_ERR_SHAPE, "box outside dst");
  CHECK(tt_ckpt_read(path, 64, TT_F32, 2, s75, ok_start, count, d, z, 1, 0, "w") == TT_ERR_INVALID,
        "verify needs the whole chunk");
  tt_tensor_release(d);
}

static void test_safetensors(void) {
  char path[512];
  path_of(path, sizeof path, "t.safetensors");
  int64_t s23[2] = {2, 3};
  tt_tensor *a = ramp(2, s23, TT_F32, 1, 0);
  const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}";
  tt_tensor *ts[1] = {a};
  CHECK(tt_safetensors_write(path, hdr, strlen(hdr), 1, ts) == TT_OK, "st write: %s", tt_last_error());
  size_t len;
  uint64_t start;
  CHECK(tt_safetensors_header(path, NULL, 0, &len, &start) == TT_OK && len % 8 == 0 && start == 8 + len,
        "st header len %zu", len);
  char buf[256];
  CHECK(tt_safetensors_header(path, buf, sizeof buf, &len, &start) == TT_OK && !strncmp(buf, hdr, strlen(hdr)),
        "st header text");
  CHECK(tt_fs_size(path) == (int64_t)(start + 24), "st size");
  tt_tensor *b = make(2, s23, TT_F32);
  int64_t z[2] = {0, 0};
  CHECK(tt_ckpt_read(path, start, TT_F32, 2, s23, z, s23, b, z, 0, 0, "a") == TT_OK, "st read");
  CHECK(memcmp(tt_tensor_data(a), tt_tensor_data(b), 24) == 0, "st values");
  CHECK(tt_safetensors_write(path, hdr, strlen(hdr), 1, ts) == TT_ERR_IO, "st never replaces");
  tt_tensor_release(a);
  tt_tensor_release(b);
}

static void test_fs(void) {
  char a[512], b[512], f[512];
  path_of(a, sizeof a, "x/y/z");
  CHECK(tt_fs_mkdirs(a) == TT_OK && tt_fs_mkdirs(a) == TT_OK && tt_fs_size(a) == -2, "mkdirs");
  path_of(f, sizeof f, "x/y/z/file");
  CHECK(tt_fs_write_file(f, "hello", 5) == TT_OK && tt_fs_size(f) == 5, "write_file");
  CHECK(tt_fs_write_file(f, "bye", 3) == TT_ERR_IO && tt_fs_size(f) == 5, "write_file never replaces");
  path_of(b, sizeof b, "x/w");
  CHECK(tt_fs_mkdirs(b) == TT_OK, "mkdirs w");
  path_of(a, sizeof a, "x/y");
  CHECK(tt_fs_rename(a, b, 0) == TT_ERR_IO, "rename onto an existing folder fails");
  CHECK(tt_fs_rename(a, b, 1) == TT_OK, "exchange");
  path_of(f, sizeof f, "x/w/z/file");
  CHECK(tt_fs_size(f) == 5, "exchanged");
  path_of(a, sizeof a, "x");
  char names[256];
  size_t len;
  CHECK(tt_fs_list(a, names, sizeof names, &len) == TT_OK && len == 4 && strstr(names, "w\n") && strstr(names, "y\n"),
        "list: %s", names);
  CHECK(tt_fs_sync_dir(a) == TT_OK, "sync_dir");
  CHECK(tt_fs_remove_all(a) == TT_OK && tt_fs_size(a) == -1, "remove_all");
  CHECK(tt_fs_size("/nonexistent/x") == -1 && tt_process_id() == getpid(), "size of missing, pid");
}

static void test_signals(void) {
  CHECK(tt_signal_install() == TT_OK, "install");
  CHECK(tt_signal_pending() == 0, "nothing pending");
  raise(SIGTERM);
  CHECK(tt_signal_pending() == SIGTERM, "SIGTERM pending: %d", tt_signal_pending());
  tt_signal_clear();
  raise(SIGINT);
  CHECK(tt_signal_pending() == SIGINT, "SIGINT pending");
  tt_signal_clear();
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/tt_test_checkpoint.XXXXXX");
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  test_crc();
  test_writer_and_reader(0);
  test_writer_and_reader(1);
  test_sparse_box();
  test_bad_boxes();
  test_safetensors();
  test_fs();
  test_signals();
  tt_fs_remove_all(dir);
  return tt_test_summary("test_checkpoint");
}
