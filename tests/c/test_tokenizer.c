/*
 * test_tokenizer.c — byte-level BPE in C: merges applied in rank order on a
 * hand-made vocabulary (HF merge lists and tiktoken ranks), the Llama 3
 * pre-tokenizer against what Python's `regex` module gives for the same
 * pattern, exact round trips of random byte strings (invalid UTF-8, NULs,
 * long runs) through a trained tokenizer, trainer determinism, and errors.
 */
#include <pthread.h>
#include <string.h>

#include "titan.h"
#include "tt_test.h"

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint32_t next_u32(void) {
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return (uint32_t)((rng * 0x2545f4914f6cdd1dull) >> 32);
}

/* Bytes 0..255 (id = byte) plus `extra` tokens given as C strings. */
typedef struct {
  uint8_t bytes[4096];
  int32_t lens[512], ids[512];
  int32_t n;
  size_t at;
} vocab_t;

static void vocab_init(vocab_t *v) {
  memset(v, 0, sizeof *v);
  for (int b = 0; b < 256; b++) {
    v->bytes[v->at++] = (uint8_t)b;
    v->lens[b] = 1;
    v->ids[b] = b;
  }
  v->n = 256;
}

static int32_t vocab_add(vocab_t *v, const char *s) {
  size_t n = strlen(s);
  memcpy(v->bytes + v->at, s, n);
  v->at += n;
  v->lens[v->n] = (int32_t)n;
  v->ids[v->n] = v->n;
  return v->n++;
}

static tt_tokenizer_spec spec_of(const vocab_t *v) {
  tt_tokenizer_spec s;
  memset(&s, 0, sizeof s);
  s.source = "test";
  s.n_tokens = v->n;
  s.token_bytes = v->bytes;
  s.token_lens = v->lens;
  s.token_ids = v->ids;
  s.bos_id = s.eos_id = -1;
  return s;
}

/* Encode s and compare with the expected ids (-1 terminated). */
static void expect_ids(const tt_tokenizer *tok, const char *s, const int32_t *want, const char *what) {
  int32_t ids[64];
  int64_t n = 0;
  tt_status st = tt_tokenizer_encode(tok, s, strlen(s), 0, 0, ids, 64, &n);
  CHECK(st == TT_OK, "%s: encode failed: %s", what, tt_last_error());
  int64_t m = 0;
  while (want[m] >= 0) m++;
  int same = n == m;
  for (int64_t i = 0; same && i < n; i++) same = ids[i] == want[i];
  CHECK(same, "%s: '%s' gave %lld ids (first %d), expected %lld (first %d)", what, s, (long long)n, n ? ids[0] : -1,
        (long long)m, want[0]);
}

static void test_rank_order(void) {
  vocab_t v;
  vocab_init(&v);
  int32_t ab = vocab_add(&v, "ab"), bc = vocab_add(&v, "bc"), abc = vocab_add(&v, "abc"), aa = vocab_add(&v, "aa");
  tt_tokenizer *tok = NULL;

  /* bc before ab: "abc" = a + bc, then (a, bc) -> abc. */
  int32_t m1[] = {'b', 'c', 'a', 'b', 'a', bc, 'a', 'a'};
  tt_tokenizer_spec s = spec_of(&v);
  s.n_merges = 4;
  s.merges = m1;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  expect_ids(tok, "abc", (int32_t[]){abc, -1}, "bc first");
  expect_ids(tok, "abcbc", (int32_t[]){abc, bc, -1}, "bc first, twice");
  expect_ids(tok, "abab", (int32_t[]){ab, ab, -1}, "ab alone");
  /* equal ranks: leftmost first, as tiktoken and HF do */
  expect_ids(tok, "aaa", (int32_t[]){aa, 'a', -1}, "leftmost");
  expect_ids(tok, "aaaaa", (int32_t[]){aa, aa, 'a', -1}, "leftmost, twice");
  tt_tokenizer_free(tok);

  /* ab before bc, and no (ab, c) merge: "abc" stops at ab + c. */
  int32_t m2[] = {'a', 'b', 'b', 'c', 'a', bc};
  s.n_merges = 3;
  s.merges = m2;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  expect_ids(tok, "abc", (int32_t[]){ab, 'c', -1}, "ab first");
  expect_ids(tok, "bcabc", (int32_t[]){bc, ab, 'c', -1}, "ab first, bc alone");
  int32_t l, r, m;
  CHECK(tt_tokenizer_merge(tok, 1, &l, &r, &m) == TT_OK && l == 'b' && r == 'c' && m == bc, "merge 1 is (b, c)");
  tt_tokenizer_free(tok);

  /* tiktoken: a pair's rank is the id of its concatenation. Here bc (257)
   * ranks after ab (256), and abc (258) is reachable from ab + c. */
  s = spec_of(&v);
  s.tiktoken = 1;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new tiktoken: %s", tt_last_error());
  expect_ids(tok, "abc", (int32_t[]){abc, -1}, "tiktoken abc");
  expect_ids(tok, "bcab", (int32_t[]){bc, ab, -1}, "tiktoken bcab");
  expect_ids(tok, "aaa", (int32_t[]){aa, 'a', -1}, "tiktoken leftmost");
  tt_tokenizer_desc d;
  /* every split into two tokens: ab, bc, a+bc, ab+c, aa */
  CHECK(tt_tokenizer_describe(tok, &d) == TT_OK && d.vocab_size == 260 && d.n_merges == 5,
        "tiktoken: 260 tokens and 5 derived merges, got %d and %d", d.vocab_size, d.n_merges);
  tt_tokenizer_free(tok);

  /* ignore_merges: a piece that is a token is taken whole even when the
   * merges would not reach it. */
  int32_t m3[] = {'a', 'b'};
  s = spec_of(&v);
  s.n_merges = 1;
  s.merges = m3;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  expect_ids(tok, "abc", (int32_t[]){ab, 'c', -1}, "merges only");
  tt_tokenizer_free(tok);
  s.ignore_merges = 1;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  expect_ids(tok, "abc", (int32_t[]){abc, -1}, "ignore_merges");
  tt_tokenizer_free(tok);
}

/* Pieces of s must be exactly `want` (NULL terminated). */
static void expect_split(const tt_tokenizer *tok, const char *s, const char *const *want) {
  int64_t ends[64], n = 0;
  size_t len = strlen(s);
  CHECK(tt_tokenizer_split(tok, s, len, ends, 64, &n) == TT_OK, "split: %s", tt_last_error());
  int64_t k = 0, start = 0;
  int same = 1;
  for (; want[k]; k++) {
    size_t wl = strlen(want[k]);
    if (k >= n || (size_t)(ends[k] - start) != wl || memcmp(s + start, want[k], wl) != 0) {
      same = 0;
      break;
    }
    start = ends[k];
  }
  CHECK(same && k == n, "split of '%s': piece %lld differs (expected '%s', got %lld pieces)", s, (long long)k,
        want[k] ? want[k] : "(end)", (long long)n);
}

static void test_pretokenizer(void) {
  vocab_t v;
  vocab_init(&v);
  tt_tokenizer_spec s = spec_of(&v);
  tt_tokenizer *tok = NULL;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  /* Expectations from Python: regex.findall(<the Llama 3 pattern>, s). */
  expect_split(tok, "Hello world123456 don't", (const char *[]){"Hello", " world", "123", "456", " don", "'t", NULL});
  expect_split(tok, "I'M here, YOU'LL see", (const char *[]){"I", "'M", " here", ",", " YOU", "'LL", " see", NULL});
  expect_split(tok, "na\xc3\xafve caf\xc3\xa9", (const char *[]){"na\xc3\xafve", " caf\xc3\xa9", NULL});
  expect_split(tok, "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 \xd0\xbc\xd0\xb8\xd1\x80", /* Привет мир */
               (const char *[]){"\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82", " \xd0\xbc\xd0\xb8\xd1\x80", NULL});
  /* Arabic-Indic digits and ½² are \p{N}: three digits at most per piece. */
  expect_split(tok, "\xd9\xa3\xd9\xa4\xd9\xa5\xd9\xa6x\xc2\xbd\xc2\xb2",
               (const char *[]){"\xd9\xa3\xd9\xa4\xd9\xa5", "\xd9\xa6", "x", "\xc2\xbd\xc2\xb2", NULL});
  expect_split(tok, "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e", (const char *[]){"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e", NULL});
  expect_split(tok, "hello\n\nworld", (const char *[]){"hello", "\n\n", "world", NULL});
  expect_split(tok, "a  b", (const char *[]){"a", " ", " b", NULL});
  expect_split(tok, "!!!\n\nok", (const char *[]){"!!!\n\n", "ok", NULL});
  expect_split(tok, "  \n  x", (const char *[]){"  \n", " ", " x", NULL});
  expect_split(tok, "$12.50!", (const char *[]){"$", "12", ".", "50", "!", NULL});
  expect_split(tok, "\tTab", (const char *[]){"\tTab", NULL});
  /* Invalid UTF-8 matches nothing: it becomes a piece of its own. */
  expect_split(tok, "ab\xff\xfe cd", (const char *[]){"ab", "\xff\xfe", " cd", NULL});
  expect_split(tok, "x\xc3", (const char *[]){"x", "\xc3", NULL});
  /* Pieces always tile the text. */
  for (int trial = 0; trial < 200; trial++) {
    char buf[300];
    size_t len = next_u32() % sizeof buf;
    for (size_t i = 0; i < len; i++) buf[i] = (char)(next_u32() & 0xff);
    int64_t ends[300], n = 0;
    CHECK(tt_tokenizer_split(tok, buf, len, ends, 300, &n) == TT_OK, "split random: %s", tt_last_error());
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= ends[i] > (i ? ends[i - 1] : 0);
    CHECK(ok && (n ? ends[n - 1] == (int64_t)len : len == 0), "pieces tile random text of %zu bytes", len);
  }
  tt_tokenizer_free(tok);
}

static const char corpus[] =
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs!\n"
    "Il \xc3\xa9tait une fois, dans un ch\xc3\xa2teau tr\xc3\xa8s loin... 12345 67890\n"
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe6\x96\x87\xe7\xab\xa0 don't won't can't I'll we've\n"
    "    indented code() { return x + y * 2; }\n\n\n";

static tt_tokenizer *train(int32_t vocab) {
  tt_tokenizer_trainer *tr = NULL;
  CHECK(tt_tokenizer_trainer_new(NULL, &tr) == TT_OK, "trainer: %s", tt_last_error());
  for (int rep = 0; rep < 20; rep++) CHECK(tt_tokenizer_trainer_add(tr, corpus, sizeof corpus - 1) == TT_OK, "add");
  int32_t done = 0;
  tt_tokenizer_train_stats st;
  for (;;) {
    tt_tokenizer_trainer_stats(tr, &st);
    if (st.tokens >= vocab - 2) break;
    CHECK(tt_tokenizer_trainer_merge(tr, vocab - 2 - st.tokens, &done) == TT_OK, "merge: %s", tt_last_error());
    if (!done) break;
  }
  CHECK(st.unique_pieces > 10 && st.merges > 0, "trained %d merges over %lld unique pieces", st.merges,
        (long long)st.unique_pieces);
  const char specials[] = "<|begin_of_text|><|end_of_text|>";
  int32_t lens[] = {17, 15};
  tt_tokenizer *tok = NULL;
  CHECK(tt_tokenizer_trainer_finish(tr, 2, (const uint8_t *)specials, lens, 0, 1, &tok) == TT_OK, "finish: %s",
        tt_last_error());
  /* finish does not consume the trainer's state */
  tt_tokenizer *again = NULL;
  CHECK(tt_tokenizer_trainer_finish(tr, 2, (const uint8_t *)specials, lens, 0, 1, &again) == TT_OK, "finish twice");
  tt_tokenizer_free(again);
  tt_tokenizer_trainer_free(tr);
  return tok;
}

/* A tokenizer is read-only after creation: threads encoding at once must
 * each get what one thread alone gets. */
typedef struct {
  const tt_tokenizer *tok;
  const int32_t *want;
  int64_t n_want;
  int ok;
} thread_job;

static void *encode_many(void *arg) {
  thread_job *job = arg;
  int32_t ids[sizeof corpus + 2];
  job->ok = 1;
  for (int rep = 0; rep < 300 && job->ok; rep++) {
    int64_t n = 0;
    job->ok = tt_tokenizer_encode(job->tok, corpus, sizeof corpus - 1, 0, 0, ids, sizeof corpus + 1, &n) == TT_OK &&
              n == job->n_want && memcmp(ids, job->want, (size_t)n * sizeof *ids) == 0;
  }
  return NULL;
}

static void test_threads(const tt_tokenizer *tok) {
  int32_t want[sizeof corpus + 2];
  int64_t n = 0;
  CHECK(tt_tokenizer_encode(tok, corpus, sizeof corpus - 1, 0, 0, want, sizeof corpus + 1, &n) == TT_OK, "encode");
  thread_job jobs[4];
  pthread_t th[4];
  for (int i = 0; i < 4; i++) {
    jobs[i] = (thread_job){tok, want, n, 0};
    pthread_create(&th[i], NULL, encode_many, &jobs[i]);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    CHECK(jobs[i].ok, "thread %d encoded the corpus like a single thread", i);
  }
}

static void test_round_trip(void) {
  tt_tokenizer *tok = train(300);
  tt_tokenizer *tok2 = train(300);
  tt_tokenizer_desc d, d2;
  tt_tokenizer_describe(tok, &d);
  tt_tokenizer_describe(tok2, &d2);
  CHECK(d.vocab_size <= 300 && d.bos_id == d.vocab_size - 2 && d.eos_id == d.vocab_size - 1,
        "specials after the vocabulary: vocab %d bos %d eos %d", d.vocab_size, d.bos_id, d.eos_id);
  int same = d.n_merges == d2.n_merges;
  for (int32_t i = 0; same && i < d.n_merges; i++) {
    int32_t a[3], b[3];
    tt_tokenizer_merge(tok, i, &a[0], &a[1], &a[2]);
    tt_tokenizer_merge(tok2, i, &b[0], &b[1], &b[2]);
    same = !memcmp(a, b, sizeof a);
  }
  CHECK(same, "training twice gives the same merges");
  tt_tokenizer_free(tok2);
  test_threads(tok);

  /* Merges were learnt: the corpus encodes shorter than its bytes. */
  int32_t *ids = malloc((sizeof corpus + 2) * sizeof *ids);
  int64_t n = 0;
  CHECK(tt_tokenizer_encode(tok, corpus, sizeof corpus - 1, 1, 1, ids, sizeof corpus + 1, &n) == TT_OK, "encode");
  CHECK(n < (int64_t)sizeof corpus * 3 / 4 && ids[0] == d.bos_id && ids[n - 1] == d.eos_id,
        "corpus: %lld ids for %zu bytes, bos/eos at the ends", (long long)n, sizeof corpus - 1);
  free(ids);

  enum { MAXLEN = 2000 };
  char *text = malloc(MAXLEN), *back = malloc(MAXLEN);
  ids = malloc((MAXLEN + 2) * sizeof *ids);
  int bad = 0;
  for (int trial = 0; trial < 3000; trial++) {
    size_t len = next_u32() % (trial < 2900 ? 200 : MAXLEN);
    int kind = trial % 5;
    for (size_t i = 0; i < len; i++) {
      uint32_t r = next_u32();
      switch (kind) {
        case 0: text[i] = (char)(r & 0xff); break;                           /* any byte */
        case 1: text[i] = corpus[r % (sizeof corpus - 1)]; break;              /* text-like */
        case 2: text[i] = (char)"a \n\0\xc3\xa9\xff"[r % 7]; break;            /* NULs, broken UTF-8 */
        case 3: text[i] = (char)(i < len / 2 ? ' ' : (r & 1 ? 'e' : '\n')); break; /* long runs */
        default: text[i] = (char)(0x80 | (r & 0x3f)); break;                 /* stray continuations */
      }
    }
    n = 0;
    tt_status st = tt_tokenizer_encode(tok, text, len, 0, 0, ids, MAXLEN + 2, &n);
    size_t blen = 0;
    if (st == TT_OK) st = tt_tokenizer_decode(tok, ids, n, back, MAXLEN, &blen);
    int ok = st == TT_OK && blen == len && memcmp(text, back, len) == 0 && n <= (int64_t)len;
    for (int64_t i = 0; ok && i < n; i++) ok = ids[i] >= 0 && ids[i] < d.bos_id;
    if (!ok && bad++ < 5) CHECK(ok, "round trip of %zu random bytes (kind %d): %s", len, kind, tt_last_error());
  }
  CHECK(bad == 0, "%d of 3000 random byte strings did not round-trip", bad);
  free(text);
  free(back);
  free(ids);
  tt_tokenizer_free(tok);
}

static int one_line(const char *msg) { return msg[0] && !strchr(msg, '\n'); }

static void test_errors(void) {
  vocab_t v;
  vocab_init(&v);
  tt_tokenizer *tok = NULL;
  tt_tokenizer_spec s = spec_of(&v);
  s.n_tokens = 200; /* bytes 200..255 missing */
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && !tok && strstr(tt_last_error(), "0xc8") &&
            strstr(tt_last_error(), "test") && one_line(tt_last_error()),
        "missing byte token: %s", tt_last_error());
  vocab_add(&v, "ab");
  vocab_add(&v, "ab");
  s = spec_of(&v);
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && strstr(tt_last_error(), "same bytes"), "duplicate: %s",
        tt_last_error());
  vocab_init(&v);
  vocab_add(&v, "ab");
  s = spec_of(&v);
  int32_t bad_merge[] = {'a', 'b', 'b', 'c'};
  s.n_merges = 2;
  s.merges = bad_merge;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && strstr(tt_last_error(), "merge 1"), "merge to nowhere: %s",
        tt_last_error());
  int32_t out_of_range[] = {'a', 9999};
  s.n_merges = 1;
  s.merges = out_of_range;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && strstr(tt_last_error(), "9999"), "merge id: %s", tt_last_error());
  s = spec_of(&v);
  s.pattern = "(unclosed";
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && strstr(tt_last_error(), "regex"), "bad regex: %s",
        tt_last_error());
  s = spec_of(&v);
  s.bos_id = 5000;
  CHECK(tt_tokenizer_new(&s, &tok) == TT_ERR_IO && strstr(tt_last_error(), "bos"), "bad bos: %s", tt_last_error());

  s = spec_of(&v);
  CHECK(tt_tokenizer_new(&s, &tok) == TT_OK, "new: %s", tt_last_error());
  int32_t ids[4] = {1, 2, 257, 3};
  size_t len = 0;
  CHECK(tt_tokenizer_decode_length(tok, ids, 4, &len) == TT_ERR_INDEX && strstr(tt_last_error(), "257"),
        "decode of an unknown id: %s", tt_last_error());
  int32_t small[2];
  int64_t n = 0;
  CHECK(tt_tokenizer_encode(tok, "a b c", 5, 0, 0, small, 2, &n) == TT_ERR_INVALID && n == 5,
        "small buffer reports the count needed (%lld)", (long long)n);
  CHECK(tt_tokenizer_encode(tok, "a", 1, 1, 0, small, 2, &n) == TT_ERR_INVALID && strstr(tt_last_error(), "bos"),
        "bos without a bos token: %s", tt_last_error());
  CHECK(tt_tokenizer_encode(tok, "", 0, 0, 0, small, 2, &n) == TT_OK && n == 0, "empty text gives no ids");
  tt_tokenizer_free(tok);
}

int main(void) {
  test_rank_order();
  test_pretokenizer();
  test_round_trip();
  test_errors();
  return tt_test_summary("test_tokenizer");
}
