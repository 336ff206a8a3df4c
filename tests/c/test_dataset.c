/*
 * test_dataset.c — binary token files (engine/dataset.c): writer/reader
 * round trips in both widths, window reads, the temporary-then-rename
 * write, and the errors a damaged file must produce.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "titan.h"
#include "tt_test.h"

static char dir[256];

static const char *path_in(const char *name) {
  static char buf[16][512]; /* callers hold several names at once */
  static int k = 0;
  k = (k + 1) % 16;
  snprintf(buf[k], sizeof buf[k], "%s/%s", dir, name);
  return buf[k];
}

static int exists(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0;
}

static long file_size(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

static int contains(const char *s, const char *part) { return s && strstr(s, part) != NULL; }

/* Writes n tokens tok[i] = (i * 7919 + 3) % vocab in chunks of `chunk`. */
static int32_t expected(int64_t i, uint32_t vocab) { return (int32_t)((i * 7919 + 3) % vocab); }

static tt_status write_file(const char *p, uint32_t vocab, uint32_t width, int64_t n, int64_t chunk) {
  tt_tokens_writer *w = NULL;
  tt_status st = tt_tokens_writer_open(p, vocab, width, &w);
  if (st != TT_OK) return st;
  int32_t *buf = malloc(sizeof(int32_t) * (size_t)chunk);
  for (int64_t at = 0; at < n; at += chunk) {
    int64_t m = n - at < chunk ? n - at : chunk;
    for (int64_t i = 0; i < m; i++) buf[i] = expected(at + i, vocab);
    st = tt_tokens_writer_append(w, buf, m, 1);
    if (st != TT_OK) {
      free(buf);
      tt_tokens_writer_abort(w);
      return st;
    }
  }
  free(buf);
  return tt_tokens_writer_finish(w);
}

static void round_trip(uint32_t vocab, uint32_t width_asked, uint32_t width_expected) {
  const char *p = path_in(width_expected == 2 ? "rt16.bin" : "rt32.bin");
  const int64_t n = 200003; /* more than one writer chunk, odd on purpose */
  tt_status st = write_file(p, vocab, width_asked, n, 70001);
  CHECK(st == TT_OK, "write: %s", tt_last_error());
  CHECK(file_size(p) == 64 + n * (long)width_expected, "size %ld", file_size(p));
  tt_tokens *t = NULL;
  st = tt_tokens_open(p, &t);
  CHECK(st == TT_OK, "open: %s", tt_last_error());
  if (!t) return;
  tt_tokens_header h;
  CHECK(tt_tokens_describe(t, &h) == TT_OK, "describe");
  CHECK(h.version == 1 && h.header_bytes == 64, "version %u header %u", h.version, h.header_bytes);
  CHECK(h.token_bytes == width_expected, "width %u, expected %u", h.token_bytes, width_expected);
  CHECK(h.num_tokens == (uint64_t)n && tt_tokens_len(t) == n, "count %llu", (unsigned long long)h.num_tokens);
  CHECK(h.num_docs == 3, "docs %llu (one per appended chunk)", (unsigned long long)h.num_docs);
  CHECK(h.vocab_size == vocab, "vocab %u", h.vocab_size);

  /* Every token, as i32 and as i64. */
  int32_t *a32 = malloc(sizeof(int32_t) * (size_t)n);
  int64_t *a64 = malloc(sizeof(int64_t) * (size_t)n);
  CHECK(tt_tokens_read(t, 0, n, TT_I32, a32) == TT_OK, "read i32: %s", tt_last_error());
  CHECK(tt_tokens_read(t, 0, n, TT_I64, a64) == TT_OK, "read i64: %s", tt_last_error());
  int bad = 0;
  for (int64_t i = 0; i < n; i++) bad += a32[i] != expected(i, vocab) || a64[i] != expected(i, vocab);
  CHECK(bad == 0, "%d tokens differ", bad);

  /* Windows of seq_len + 1 at odd places, the last one ending at the end. */
  int64_t starts[] = {0, 1, 65535, 70000, n - 9};
  for (size_t k = 0; k < sizeof starts / sizeof *starts; k++) {
    int64_t w[9];
    CHECK(tt_tokens_read(t, starts[k], 9, TT_I64, w) == TT_OK, "window at %lld", (long long)starts[k]);
    for (int i = 0; i < 9; i++) bad += w[i] != expected(starts[k] + i, vocab);
  }
  CHECK(bad == 0, "window tokens differ");

  /* Into a tensor row: [2, 5] i64, second row from window start 12345. */
  int64_t shape[2] = {2, 5};
  tt_device cpu = {TT_CPU, 0};
  tt_tensor *x = NULL;
  CHECK(tt_tensor_empty(2, shape, TT_I64, cpu, &x) == TT_OK, "empty");
  CHECK(tt_tokens_read_tensor(t, 12345, 5, x, 5) == TT_OK, "read_tensor: %s", tt_last_error());
  const int64_t *xd = tt_tensor_data(x);
  for (int i = 0; i < 5; i++) bad += xd[5 + i] != expected(12345 + i, vocab);
  CHECK(bad == 0, "tensor row differs");
  st = tt_tokens_read_tensor(t, 0, 6, x, 5);
  CHECK(st == TT_ERR_INDEX && contains(tt_last_error(), "do not fit"), "overflowing row: %s", tt_last_error());
  tt_tensor *f = NULL;
  CHECK(tt_tensor_empty(2, shape, TT_F32, cpu, &f) == TT_OK, "empty f32");
  st = tt_tokens_read_tensor(t, 0, 5, f, 0);
  CHECK(st == TT_ERR_DTYPE && contains(tt_last_error(), "expected int32 or int64"), "f32: %s", tt_last_error());
  tt_tensor_release(f);
  tt_tensor_release(x);

  /* Windows outside the file. */
  st = tt_tokens_read(t, n - 3, 4, TT_I32, a32);
  CHECK(st == TT_ERR_INDEX && contains(tt_last_error(), "outside the file's"), "past the end: %s", tt_last_error());
  st = tt_tokens_read(t, -1, 2, TT_I32, a32);
  CHECK(st == TT_ERR_INDEX, "negative start");
  CHECK(tt_tokens_read(t, n, 0, TT_I32, a32) == TT_OK, "an empty window at the end is fine");
  free(a32);
  free(a64);
  tt_tokens_close(t);
}

static void temp_then_rename(void) {
  const char *p = path_in("atomic.bin");
  /* An older complete file under the final name stays readable until finish. */
  CHECK(write_file(p, 300, 0, 10, 10) == TT_OK, "first write: %s", tt_last_error());
  tt_tokens_writer *w = NULL;
  CHECK(tt_tokens_writer_open(p, 300, 0, &w) == TT_OK, "open: %s", tt_last_error());
  const char *tmp = tt_tokens_writer_temp_path(w);
  char tmp_copy[600];
  snprintf(tmp_copy, sizeof tmp_copy, "%s", tmp);
  CHECK(contains(tmp, "atomic.bin.tmp."), "temporary name %s", tmp);
  int32_t toks[100];
  for (int i = 0; i < 100; i++) toks[i] = i;
  CHECK(tt_tokens_writer_append(w, toks, 100, 2) == TT_OK, "append");
  CHECK(exists(tmp_copy), "the temporary file exists while writing");
  /* A reader of the final name sees the old file, whole. */
  tt_tokens *t = NULL;
  CHECK(tt_tokens_open(p, &t) == TT_OK && tt_tokens_len(t) == 10, "old file intact while writing");
  tt_tokens_close(t);
  /* The temporary file is not a valid token file (no magic until finish;
   * buffered bytes may not even have reached it yet). */
  CHECK(tt_tokens_open(tmp_copy, &t) == TT_ERR_IO, "tmp rejected: %s", tt_last_error());
  CHECK(tt_tokens_writer_finish(w) == TT_OK, "finish: %s", tt_last_error());
  CHECK(!exists(tmp_copy), "temporary file gone after finish");
  CHECK(tt_tokens_open(p, &t) == TT_OK && tt_tokens_len(t) == 100, "new file in place");
  tt_tokens_header h;
  tt_tokens_describe(t, &h);
  CHECK(h.num_docs == 2, "docs %llu", (unsigned long long)h.num_docs);
  tt_tokens_close(t);

  /* Abort leaves nothing behind and the old file untouched. */
  CHECK(tt_tokens_writer_open(p, 300, 0, &w) == TT_OK, "open 2");
  snprintf(tmp_copy, sizeof tmp_copy, "%s", tt_tokens_writer_temp_path(w));
  CHECK(tt_tokens_writer_append(w, toks, 50, 1) == TT_OK, "append 2");
  tt_tokens_writer_abort(w);
  CHECK(!exists(tmp_copy), "abort removes the temporary file");
  CHECK(tt_tokens_open(p, &t) == TT_OK && tt_tokens_len(t) == 100, "old file survives an abort");
  tt_tokens_close(t);

  /* A token outside the vocabulary is refused, naming it and its position. */
  CHECK(tt_tokens_writer_open(path_in("oov.bin"), 50, 0, &w) == TT_OK, "open 3");
  tt_status st = tt_tokens_writer_append(w, toks, 60, 1);
  CHECK(st == TT_ERR_INDEX && contains(tt_last_error(), "token 50 at position 50") &&
            contains(tt_last_error(), "[0, 50)"),
        "out of vocab: %s", tt_last_error());
  tt_tokens_writer_abort(w);
  CHECK(!exists(path_in("oov.bin")), "nothing under the final name");

  st = tt_tokens_writer_open(path_in("x.bin"), 70000, 2, &w);
  CHECK(st == TT_ERR_INVALID && contains(tt_last_error(), "does not fit 2-byte"), "width: %s", tt_last_error());
  st = tt_tokens_writer_open("/nonexistent-dir/x.bin", 10, 0, &w);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "/nonexistent-dir/x.bin.tmp."), "bad dir: %s",
        tt_last_error());
}

/* Rewrites 4 bytes at `off` of a copy of src. */
static void patch_u32(const char *src, const char *dst, long off, uint32_t v) {
  FILE *in = fopen(src, "rb");
  FILE *out = fopen(dst, "wb");
  int c;
  long i = 0;
  while ((c = fgetc(in)) != EOF) {
    if (i >= off && i < off + 4) c = (int)((v >> (8 * (i - off))) & 0xff);
    fputc(c, out);
    i++;
  }
  fclose(in);
  fclose(out);
}

static void damaged_files(void) {
  const char *good = path_in("good.bin");
  CHECK(write_file(good, 1000, 0, 1000, 1000) == TT_OK, "write: %s", tt_last_error());
  tt_tokens *t = NULL;

  /* Truncated: the error names the file, what the header says and the size. */
  const char *cut = path_in("cut.bin");
  patch_u32(good, cut, 0, 0x4b4f5454u); /* a plain copy ("TTOK" unchanged) */
  CHECK(truncate(cut, 64 + 2 * 1000 - 7) == 0, "truncate");
  tt_status st = tt_tokens_open(cut, &t);
  const char *e = tt_last_error();
  CHECK(st == TT_ERR_IO && t == NULL, "truncated file refused");
  CHECK(contains(e, cut) && contains(e, "truncated") && contains(e, "1000 tokens of 2 bytes") &&
            contains(e, "2064 bytes") && contains(e, "the file has 2057 bytes"),
        "message: %s", e);

  /* Longer than the header says. */
  const char *longer = path_in("long.bin");
  patch_u32(good, longer, 16, 999); /* count 999, 1000 tokens present */
  st = tt_tokens_open(longer, &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "size does not match"), "long: %s", tt_last_error());

  /* Shorter than a header. */
  const char *tiny = path_in("tiny.bin");
  FILE *fp = fopen(tiny, "wb");
  fputs("TTOK", fp);
  fclose(fp);
  st = tt_tokens_open(tiny, &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "fewer than the 64-byte header"), "tiny: %s", tt_last_error());

  /* Bad magic. */
  const char *magic = path_in("magic.bin");
  patch_u32(good, magic, 0, 0x464c457fu); /* "\x7fELF" */
  st = tt_tokens_open(magic, &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "\\x7fELF") && contains(tt_last_error(), "TTOKENS1") &&
            contains(tt_last_error(), magic),
        "magic: %s", tt_last_error());

  /* Unknown version. */
  const char *ver = path_in("ver.bin");
  patch_u32(good, ver, 8, 2);
  st = tt_tokens_open(ver, &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "version 2") && contains(tt_last_error(), "reads version 1"),
        "version: %s", tt_last_error());

  /* Impossible width. */
  const char *wid = path_in("width.bin");
  patch_u32(good, wid, 12, 3);
  st = tt_tokens_open(wid, &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "3-byte tokens"), "width: %s", tt_last_error());

  /* Missing. */
  st = tt_tokens_open(path_in("missing.bin"), &t);
  CHECK(st == TT_ERR_IO && contains(tt_last_error(), "missing.bin") &&
            contains(tt_last_error(), "No such file"),
        "missing: %s", tt_last_error());

  /* An empty file is valid: 0 tokens. */
  const char *empty = path_in("empty.bin");
  CHECK(write_file(empty, 10, 0, 0, 1) == TT_OK, "empty write");
  CHECK(tt_tokens_open(empty, &t) == TT_OK && tt_tokens_len(t) == 0, "empty open: %s", tt_last_error());
  tt_tokens_close(t);
}

int main(void) {
  snprintf(dir, sizeof dir, "/tmp/titan_test_dataset_XXXXXX");
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  round_trip(300, 0, 2);      /* small vocab: uint16 chosen */
  round_trip(65536, 0, 2);    /* the largest uint16 vocab */
  round_trip(100000, 0, 4);   /* past uint16: uint32 chosen */
  round_trip(300, 4, 4);      /* uint32 asked for */
  temp_then_rename();
  damaged_files();
  int rc = tt_test_summary("test_dataset");
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  return rc;
}
