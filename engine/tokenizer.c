/*
 * tokenizer.c — byte-level BPE: encode and decode.
 *
 * Text is first cut into pieces by a PCRE2 regex (the Llama 3 pattern unless
 * the file names another); each piece's bytes start as single-byte tokens and
 * adjacent pairs merge, lowest rank first and leftmost among equal ranks —
 * what tiktoken and HF `tokenizers` do — so ids match theirs.
 *
 * Parsing files (tokenizer.json, tiktoken ranks) is Lua's job
 * (lua/titan/tokenizer.lua); it hands this file flat arrays of token bytes,
 * ids and merges. A tokenizer never changes after tt_tokenizer_new, so any
 * number of threads may encode with one at once (each call has its own
 * scratch and PCRE2 match data).
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Meta's llama3 tokenizer.py, unchanged. */
static const char tt_llama3_pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Ids above this are refused: a vocabulary is dense, and a stray huge id in
 * a file would otherwise make us allocate gigabytes. */
#define TT_TOK_MAX_ID (1 << 26)

typedef struct {
  uint64_t key; /* left << 32 | right; TT_PAIR_EMPTY when free */
  int32_t rank;
  int32_t merged;
} tt_pair_slot;

#define TT_PAIR_EMPTY UINT64_MAX

struct tt_tokenizer {
  int32_t vocab_size; /* highest id + 1 (specials included) */
  int32_t n_tokens, n_specials, n_merges;
  int32_t bos_id, eos_id, ignore_merges, max_token_len;
  uint8_t *bytes;     /* every token's bytes, back to back */
  int64_t *offset;    /* [vocab_size] into bytes */
  int32_t *len;       /* [vocab_size]; -1: the id has no token */
  uint8_t *special;   /* [vocab_size]: 1 for special tokens */
  int32_t byte_id[256];
  int32_t *vocab;     /* open addressing over regular tokens' bytes: id or -1 */
  uint64_t vocab_mask;
  tt_pair_slot *pairs; /* (left, right) -> rank and merged id */
  uint64_t pair_mask;
  int32_t *merges;    /* [3 * n_merges]: left, right, merged, by rank */
  char *pattern;
  pcre2_code *re;
};

/* ---- hashing ------------------------------------------------------------ */

static uint64_t tt_hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix so low bits spread */
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

static uint64_t tt_hash_pair(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return key;
}

static uint64_t tt_pow2_at_least(uint64_t n) {
  uint64_t c = 16;
  while (c < n) c <<= 1;
  return c;
}

static int32_t tt_vocab_find(const tt_tokenizer *t, const uint8_t *p, size_t n) {
  for (uint64_t i = tt_hash_bytes(p, n) & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
    int32_t id = t->vocab[i];
    if (id < 0) return -1;
    if ((size_t)t->len[id] == n && memcmp(t->bytes + t->offset[id], p, n) == 0) return id;
  }
}

/* Insert id; returns the id already holding the same bytes, or -1. */
static int32_t tt_vocab_insert(tt_tokenizer *t, int32_t id) {
  const uint8_t *p = t->bytes + t->offset[id];
  size_t n = (size_t)t->len[id];
  uint64_t i = tt_hash_bytes(p, n) & t->vocab_mask;
  for (; t->vocab[i] >= 0; i = (i + 1) & t->vocab_mask) {
    int32_t o = t->vocab[i];
    if ((size_t)t->len[o] == n && memcmp(t->bytes + t->offset[o], p, n) == 0) return o;
  }
  t->vocab[i] = id;
  return -1;
}

static const tt_pair_slot *tt_pair_find(const tt_tokenizer *t, int32_t left, int32_t right) {
  uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
  for (uint64_t i = tt_hash_pair(key) & t->pair_mask;; i = (i + 1) & t->pair_mask) {
    const tt_pair_slot *s = &t->pairs[i];
    if (s->key == key) return s;
    if (s->key == TT_PAIR_EMPTY) return NULL;
  }
}

/* Keeps the first (lowest-rank) entry of a pair: returns 0 when it existed. */
static int tt_pair_insert(tt_tokenizer *t, int32_t left, int32_t right, int32_t rank, int32_t merged) {
  uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
  uint64_t i = tt_hash_pair(key) & t->pair_mask;
  for (; t->pairs[i].key != TT_PAIR_EMPTY; i = (i + 1) & t->pair_mask)
    if (t->pairs[i].key == key) return 0;
  t->pairs[i].key = key;
  t->pairs[i].rank = rank;
  t->pairs[i].merged = merged;
  return 1;
}

/* ---- construction ------------------------------------------------------- */

void tt_tokenizer_free(tt_tokenizer *t) {
  if (!t) return;
  free(t->bytes);
  free(t->offset);
  free(t->len);
  free(t->special);
  free(t->vocab);
  free(t->pairs);
  free(t->merges);
  free(t->pattern);
  if (t->re) pcre2_code_free(t->re);
  free(t);
}

static const char *tt_src(const tt_tokenizer_spec *s) { return s->source && *s->source ? s->source : "(memory)"; }

/* Printable form of a token's bytes for error messages. */
static const char *tt_show_bytes(const uint8_t *p, int32_t n, char *buf, size_t cap) {
  size_t o = 0;
  for (int32_t i = 0; i < n && o + 8 < cap; i++) {
    if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\' && p[i] != '\'')
      buf[o++] = (char)p[i];
    else
      o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", p[i]);
  }
  buf[o] = 0;
  return buf;
}

static int tt_merge_cmp(const void *a, const void *b) {
  const int32_t *x = a, *y = b; /* (rank == merged id in tiktoken mode, left, right) */
  for (int k = 0; k < 3; k++)
    if (x[k] != y[k]) return x[k] < y[k] ? -1 : 1;
  return 0;
}

static tt_status tt_tokenizer_build_merges(tt_tokenizer *t, const tt_tokenizer_spec *s) {
  const char *src = tt_src(s);
  char b1[96], b2[96];
  if (s->tiktoken) {
    /* A tiktoken file has no merge list: the rank of a pair is the rank
     * (= id) of its concatenation. Listing every split of every token into
     * two tokens gives the same table, so encode has one code path. */
    int64_t bound = 0;
    for (int32_t i = 0; i < s->n_tokens; i++) bound += s->token_lens[i] - 1;
    t->pair_mask = tt_pow2_at_least((uint64_t)bound * 2 + 2) - 1;
    t->pairs = malloc((t->pair_mask + 1) * sizeof *t->pairs);
    t->merges = malloc((size_t)(bound + 1) * 3 * sizeof *t->merges);
    if (!t->pairs || !t->merges) return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory for the merge table", src);
    for (uint64_t i = 0; i <= t->pair_mask; i++) t->pairs[i].key = TT_PAIR_EMPTY;
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_tokens; i++) {
      int32_t id = s->token_ids[i], len = t->len[id];
      const uint8_t *p = t->bytes + t->offset[id];
      for (int32_t k = 1; k < len; k++) {
        int32_t l = tt_vocab_find(t, p, (size_t)k), r = l < 0 ? -1 : tt_vocab_find(t, p + k, (size_t)(len - k));
        if (r < 0) continue;
        tt_pair_insert(t, l, r, id, id);
        t->merges[3 * n] = id;
        t->merges[3 * n + 1] = l;
        t->merges[3 * n + 2] = r;
        n++;
      }
    }
    /* By rank, then by the pair's ids: a fixed order for tt_tokenizer_merge. */
    qsort(t->merges, (size_t)n, 3 * sizeof *t->merges, tt_merge_cmp);
    for (int32_t i = 0; i < n; i++) { /* store as (left, right, merged) */
      int32_t id = t->merges[3 * i], l = t->merges[3 * i + 1], r = t->merges[3 * i + 2];
      t->merges[3 * i] = l;
      t->merges[3 * i + 1] = r;
      t->merges[3 * i + 2] = id;
    }
    t->n_merges = n;
    return TT_OK;
  }
  if (s->n_merges < 0 || (s->n_merges > 0 && !s->merges))
    return tt_error_set(TT_ERR_INVALID, "tokenizer: %s: %d merges given without a merge array", src, s->n_merges);
  t->pair_mask = tt_pow2_at_least((uint64_t)s->n_merges * 2 + 2) - 1;
  t->pairs = malloc((t->pair_mask + 1) * sizeof *t->pairs);
  t->merges = malloc(((size_t)s->n_merges + 1) * 3 * sizeof *t->merges);
  if (!t->pairs || !t->merges) return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory for the merge table", src);
  for (uint64_t i = 0; i <= t->pair_mask; i++) t->pairs[i].key = TT_PAIR_EMPTY;
  size_t cap = 256;
  uint8_t *cat = malloc(cap);
  if (!cat) return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory", src);
  int32_t n = 0;
  for (int32_t i = 0; i < s->n_merges; i++) {
    int32_t l = s->merges[2 * i], r = s->merges[2 * i + 1];
    if (l < 0 || r < 0 || l >= t->vocab_size || r >= t->vocab_size || t->len[l] < 0 || t->len[r] < 0 ||
        t->special[l] || t->special[r]) {
      free(cat);
      return tt_error_set(TT_ERR_IO, "tokenizer: %s: merge %d names token ids (%d, %d); expected ids of the vocabulary",
                          src, i, l, r);
    }
    size_t ln = (size_t)t->len[l], rn = (size_t)t->len[r];
    if (ln + rn > cap) {
      cap = (ln + rn) * 2;
      uint8_t *c2 = realloc(cat, cap);
      if (!c2) {
        free(cat);
        return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory", src);
      }
      cat = c2;
    }
    memcpy(cat, t->bytes + t->offset[l], ln);
    memcpy(cat + ln, t->bytes + t->offset[r], rn);
    int32_t m = tt_vocab_find(t, cat, ln + rn);
    if (m < 0) {
      tt_show_bytes(t->bytes + t->offset[l], t->len[l], b1, sizeof b1);
      tt_show_bytes(t->bytes + t->offset[r], t->len[r], b2, sizeof b2);
      free(cat);
      return tt_error_set(TT_ERR_IO, "tokenizer: %s: merge %d ('%s' + '%s') makes a token that is not in the vocabulary",
                          src, i, b1, b2);
    }
    /* A repeated pair keeps its first (lowest) rank, as in HF tokenizers. */
    if (tt_pair_insert(t, l, r, i, m)) {
      t->merges[3 * n] = l;
      t->merges[3 * n + 1] = r;
      t->merges[3 * n + 2] = m;
      n++;
    }
  }
  free(cat);
  t->n_merges = n;
  return TT_OK;
}

static tt_status tt_tokenizer_compile(tt_tokenizer *t, const char *src, const char *pattern) {
  t->pattern = strdup(pattern);
  if (!t->pattern) return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory", src);
  int err = 0;
  PCRE2_SIZE at = 0;
  /* MATCH_INVALID_UTF: text is bytes, not necessarily UTF-8; invalid
   * sequences simply never match and end up in the gaps between matches. */
  t->re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF,
                        &err, &at, NULL);
  if (!t->re) {
    PCRE2_UCHAR msg[160];
    pcre2_get_error_message(err, msg, sizeof msg);
    return tt_error_set(TT_ERR_IO, "tokenizer: %s: pre-tokenizer regex does not compile at offset %zu: %s", src,
                        (size_t)at, (const char *)msg);
  }
  pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE); /* interpreted matching still works where JIT is absent */
  return TT_OK;
}

static tt_status tt_tokenizer_build(tt_tokenizer *t, const tt_tokenizer_spec *s) {
  const char *src = tt_src(s);
  char buf[96];
  if (s->n_tokens <= 0 || !s->token_bytes || !s->token_lens || !s->token_ids)
    return tt_error_set(TT_ERR_IO, "tokenizer: %s: no tokens; expected a vocabulary of at least the 256 bytes", src);
  if (s->n_specials < 0 || (s->n_specials > 0 && (!s->special_bytes || !s->special_lens || !s->special_ids)))
    return tt_error_set(TT_ERR_INVALID, "tokenizer: %s: %d special tokens given without their arrays", src,
                        s->n_specials);
  int64_t total = 0;
  int32_t max_id = -1;
  for (int pass = 0; pass < 2; pass++) {
    int32_t n = pass ? s->n_specials : s->n_tokens;
    const int32_t *ids = pass ? s->special_ids : s->token_ids, *lens = pass ? s->special_lens : s->token_lens;
    for (int32_t i = 0; i < n; i++) {
      if (ids[i] < 0 || ids[i] >= TT_TOK_MAX_ID)
        return tt_error_set(TT_ERR_IO, "tokenizer: %s: %s %d has id %d; expected 0 <= id < %d", src,
                            pass ? "special token" : "token", i, ids[i], TT_TOK_MAX_ID);
      if (lens[i] <= 0)
        return tt_error_set(TT_ERR_IO, "tokenizer: %s: %s with id %d is empty; expected at least one byte", src,
                            pass ? "special token" : "token", ids[i]);
      if (ids[i] > max_id) max_id = ids[i];
      total += lens[i];
    }
  }
  t->vocab_size = max_id + 1;
  t->n_tokens = s->n_tokens;
  t->n_specials = s->n_specials;
  t->bos_id = s->bos_id;
  t->eos_id = s->eos_id;
  t->ignore_merges = s->ignore_merges != 0;
  t->bytes = malloc((size_t)total + 1);
  t->offset = malloc((size_t)t->vocab_size * sizeof *t->offset);
  t->len = malloc((size_t)t->vocab_size * sizeof *t->len);
  t->special = calloc((size_t)t->vocab_size, 1);
  t->vocab_mask = tt_pow2_at_least((uint64_t)s->n_tokens * 2) - 1;
  t->vocab = malloc((t->vocab_mask + 1) * sizeof *t->vocab);
  if (!t->bytes || !t->offset || !t->len || !t->special || !t->vocab)
    return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory for %d tokens", src, t->vocab_size);
  for (int32_t i = 0; i < t->vocab_size; i++) t->len[i] = -1;
  for (uint64_t i = 0; i <= t->vocab_mask; i++) t->vocab[i] = -1;
  for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
  int64_t at = 0;
  for (int pass = 0; pass < 2; pass++) {
    int32_t n = pass ? s->n_specials : s->n_tokens;
    const int32_t *ids = pass ? s->special_ids : s->token_ids, *lens = pass ? s->special_lens : s->token_lens;
    const uint8_t *p = pass ? s->special_bytes : s->token_bytes;
    for (int32_t i = 0; i < n; i++) {
      int32_t id = ids[i];
      if (t->len[id] >= 0)
        return tt_error_set(TT_ERR_IO, "tokenizer: %s: id %d is given to two tokens; expected unique ids", src, id);
      memcpy(t->bytes + at, p, (size_t)lens[i]);
      t->offset[id] = at;
      t->len[id] = lens[i];
      t->special[id] = (uint8_t)pass;
      if (lens[i] > t->max_token_len) t->max_token_len = lens[i];
      if (!pass) {
        int32_t dup = tt_vocab_insert(t, id);
        if (dup >= 0)
          return tt_error_set(TT_ERR_IO, "tokenizer: %s: tokens %d and %d are the same bytes '%s'; expected unique tokens",
                              src, dup, id, tt_show_bytes(p, lens[i], buf, sizeof buf));
        if (lens[i] == 1) t->byte_id[p[0]] = id;
      }
      p += lens[i];
      at += lens[i];
    }
  }
  for (int b = 0; b < 256; b++)
    if (t->byte_id[b] < 0)
      return tt_error_set(TT_ERR_IO,
                          "tokenizer: %s: no token for the byte 0x%02x; expected all 256 single bytes in a byte-level "
                          "BPE vocabulary",
                          src, b);
  for (int pass = 0; pass < 2; pass++) {
    int32_t id = pass ? s->eos_id : s->bos_id;
    if (id != -1 && (id < 0 || id >= t->vocab_size || t->len[id] < 0))
      return tt_error_set(TT_ERR_IO, "tokenizer: %s: %s id %d is not a token; expected -1 or an id below %d", src,
                          pass ? "eos" : "bos", id, t->vocab_size);
  }
  TT_TRY(tt_tokenizer_build_merges(t, s));
  return tt_tokenizer_compile(t, src, s->pattern ? s->pattern : tt_llama3_pattern);
}

tt_status tt_tokenizer_new(const tt_tokenizer_spec *spec, tt_tokenizer **out) {
  if (!out) return tt_error_set(TT_ERR_INVALID, "tokenizer: new: out is NULL");
  *out = NULL;
  if (!spec) return tt_error_set(TT_ERR_INVALID, "tokenizer: new: spec is NULL");
  tt_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return tt_error_set(TT_ERR_OOM, "tokenizer: %s: out of memory", tt_src(spec));
  tt_status st = tt_tokenizer_build(t, spec);
  if (st != TT_OK) {
    tt_tokenizer_free(t);
    return st;
  }
  *out = t;
  return TT_OK;
}

/* ---- queries -------------------------------------------------------------- */

tt_status tt_tokenizer_describe(const tt_tokenizer *t, tt_tokenizer_desc *out) {
  if (!t || !out) return tt_error_set(TT_ERR_INVALID, "tokenizer: describe: NULL tokenizer or output");
  out->vocab_size = t->vocab_size;
  out->n_tokens = t->n_tokens;
  out->n_merges = t->n_merges;
  out->n_specials = t->n_specials;
  out->bos_id = t->bos_id;
  out->eos_id = t->eos_id;
  out->max_token_len = t->max_token_len;
  out->ignore_merges = t->ignore_merges;
  return TT_OK;
}

tt_status tt_tokenizer_pattern(const tt_tokenizer *t, const char **out) {
  if (!out) return tt_error_set(TT_ERR_INVALID, "tokenizer: pattern: out is NULL");
  *out = t ? t->pattern : tt_llama3_pattern;
  return TT_OK;
}

tt_status tt_tokenizer_token(const tt_tokenizer *t, int32_t id, const uint8_t **bytes, int32_t *len,
                             int32_t *is_special) {
  if (!t || !bytes || !len) return tt_error_set(TT_ERR_INVALID, "tokenizer: token: NULL tokenizer or output");
  if (id < 0 || id >= t->vocab_size || t->len[id] < 0)
    return tt_error_set(TT_ERR_INDEX, "tokenizer: token id %d is not in the vocabulary (size %d)", id, t->vocab_size);
  *bytes = t->bytes + t->offset[id];
  *len = t->len[id];
  if (is_special) *is_special = t->special[id];
  return TT_OK;
}

tt_status tt_tokenizer_merge(const tt_tokenizer *t, int32_t rank, int32_t *left, int32_t *right, int32_t *merged) {
  if (!t || !left || !right || !merged) return tt_error_set(TT_ERR_INVALID, "tokenizer: merge: NULL argument");
  if (rank < 0 || rank >= t->n_merges)
    return tt_error_set(TT_ERR_INDEX, "tokenizer: merge %d is out of range [0, %d)", rank, t->n_merges);
  *left = t->merges[3 * rank];
  *right = t->merges[3 * rank + 1];
  *merged = t->merges[3 * rank + 2];
  return TT_OK;
}

/* ---- pre-tokenization ------------------------------------------------------ */

/* Walks the text as consecutive pieces covering every byte: regex matches,
 * and between them whatever the regex could not match (invalid UTF-8), so
 * that every byte is encoded and decode gives the text back exactly. */
typedef struct {
  const tt_tokenizer *t;
  pcre2_match_data *md;
  const uint8_t *text;
  size_t len, pos;
  size_t mstart, mend; /* the next regex match, once found */
  int have_match, done;
} tt_splitter;

/* 1: [*start, *end) is the next piece; 0: the text is done; -1: error (set). */
static int tt_splitter_next(tt_splitter *s, size_t *start, size_t *end) {
  if (s->pos >= s->len) return 0;
  if (!s->have_match && !s->done) {
    int rc = pcre2_match(s->t->re, s->text, s->len, s->pos, 0, s->md, NULL);
    /* The JIT's default stack is small; the interpreter keeps its
     * backtracking on the heap, so a pathological piece still matches. */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) rc = pcre2_match(s->t->re, s->text, s->len, s->pos, PCRE2_NO_JIT, s->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) {
      s->done = 1;
    } else if (rc < 0) {
      PCRE2_UCHAR msg[160];
      pcre2_get_error_message(rc, msg, sizeof msg);
      tt_error_set(TT_ERR_INTERNAL, "tokenizer: pre-tokenizer regex failed at byte %zu: %s", s->pos,
                   (const char *)msg);
      return -1;
    } else {
      PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
      s->mstart = ov[0];
      s->mend = ov[1];
      s->have_match = 1;
    }
  }
  *start = s->pos;
  if (!s->have_match) { /* the rest is unmatchable */
    *end = s->len;
  } else if (s->mstart > s->pos) { /* a gap before the match */
    *end = s->mstart;
  } else if (s->mend > s->mstart) {
    *end = s->mend;
    s->have_match = 0;
  } else { /* an empty match (only a custom pattern can do this): take one byte */
    *end = s->pos + 1;
    s->have_match = 0;
  }
  s->pos = *end;
  return 1;
}

static tt_status tt_splitter_init(tt_splitter *s, const tt_tokenizer *t, const char *text, size_t len) {
  memset(s, 0, sizeof *s);
  s->t = t;
  s->text = (const uint8_t *)text;
  s->len = len;
  s->md = pcre2_match_data_create_from_pattern(t->re, NULL);
  if (!s->md) return tt_error_set(TT_ERR_OOM, "tokenizer: out of memory for regex match data");
  return TT_OK;
}

tt_status tt_tokenizer_split(const tt_tokenizer *t, const char *text, size_t len, int64_t *ends, int64_t cap,
                             int64_t *n) {
  if (!t || !n || (!text && len)) return tt_error_set(TT_ERR_INVALID, "tokenizer: split: NULL argument");
  tt_splitter sp;
  TT_TRY(tt_splitter_init(&sp, t, text, len));
  int64_t count = 0;
  size_t a, b;
  int more;
  while ((more = tt_splitter_next(&sp, &a, &b)) > 0) {
    if (count < cap && ends) ends[count] = (int64_t)b;
    count++;
  }
  pcre2_match_data_free(sp.md);
  if (more < 0) return TT_ERR_INTERNAL;
  *n = count;
  if (count > cap)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: split: %lld pieces do not fit a buffer of %lld", (long long)count,
                        (long long)cap);
  return TT_OK;
}

/* ---- BPE on one piece -------------------------------------------------------- */

typedef struct {
  int32_t rank, pos, left, right;
} tt_cand;

typedef struct {
  int32_t *sym, *next, *prev;
  tt_cand *heap;
  size_t cap; /* piece length the arrays hold */
} tt_scratch;

static int tt_cand_less(const tt_cand *a, const tt_cand *b) {
  return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void tt_heap_push(tt_cand *h, int32_t *n, tt_cand c) {
  int32_t i = (*n)++;
  while (i > 0) {
    int32_t p = (i - 1) / 2;
    if (!tt_cand_less(&c, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = c;
}

static tt_cand tt_heap_pop(tt_cand *h, int32_t *n) {
  tt_cand top = h[0], last = h[--(*n)];
  int32_t i = 0;
  for (;;) {
    int32_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && tt_cand_less(&h[c + 1], &h[c])) c++;
    if (!tt_cand_less(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = last;
  return top;
}

static void tt_try_push(const tt_tokenizer *t, tt_scratch *s, int32_t *nh, int32_t pos) {
  if (pos < 0 || s->next[pos] < 0) return;
  int32_t r = s->next[pos];
  const tt_pair_slot *p = tt_pair_find(t, s->sym[pos], s->sym[r]);
  if (p) tt_heap_push(s->heap, nh, (tt_cand){p->rank, pos, s->sym[pos], s->sym[r]});
}

typedef struct {
  int32_t *ids;
  int64_t cap, n;
} tt_out;

static inline void tt_emit(tt_out *o, int32_t id) {
  if (o->n < o->cap) o->ids[o->n] = id;
  o->n++;
}

static tt_status tt_bpe_piece(const tt_tokenizer *t, tt_scratch *s, const uint8_t *p, size_t m, tt_out *o) {
  if (m == 1) {
    tt_emit(o, t->byte_id[p[0]]);
    return TT_OK;
  }
  if (t->ignore_merges) {
    int32_t id = tt_vocab_find(t, p, m);
    if (id >= 0) {
      tt_emit(o, id);
      return TT_OK;
    }
  }
  if (m > (size_t)INT32_MAX / 4)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: encode: a single piece of %zu bytes; expected under %d", m,
                        INT32_MAX / 4);
  if (m > s->cap) {
    size_t cap = m > 2 * s->cap ? m : 2 * s->cap;
    free(s->sym);
    free(s->next);
    free(s->prev);
    free(s->heap);
    s->sym = malloc(cap * sizeof *s->sym);
    s->next = malloc(cap * sizeof *s->next);
    s->prev = malloc(cap * sizeof *s->prev);
    /* m - 1 initial candidates plus at most two per merge (< m merges). */
    s->heap = malloc(3 * cap * sizeof *s->heap);
    s->cap = cap;
    if (!s->sym || !s->next || !s->prev || !s->heap) {
      s->cap = 0;
      return tt_error_set(TT_ERR_OOM, "tokenizer: encode: out of memory for a piece of %zu bytes", m);
    }
  }
  int32_t n = (int32_t)m, nh = 0;
  for (int32_t i = 0; i < n; i++) {
    s->sym[i] = t->byte_id[p[i]];
    s->next[i] = i + 1 < n ? i + 1 : -1;
    s->prev[i] = i - 1;
  }
  for (int32_t i = 0; i + 1 < n; i++) tt_try_push(t, s, &nh, i);
  /* Lowest rank first, leftmost on ties. A candidate is stale when either
   * of its nodes has merged since (a merged token is longer, so its id
   * differs from the one recorded). */
  while (nh > 0) {
    tt_cand c = tt_heap_pop(s->heap, &nh);
    int32_t r = s->next[c.pos];
    if (s->sym[c.pos] != c.left || r < 0 || s->sym[r] != c.right) continue;
    const tt_pair_slot *ps = tt_pair_find(t, c.left, c.right);
    s->sym[c.pos] = ps->merged;
    s->sym[r] = -1;
    s->next[c.pos] = s->next[r];
    if (s->next[r] >= 0) s->prev[s->next[r]] = c.pos;
    if (s->prev[c.pos] >= 0) tt_try_push(t, s, &nh, s->prev[c.pos]);
    tt_try_push(t, s, &nh, c.pos);
  }
  for (int32_t i = 0; i >= 0; i = s->next[i]) tt_emit(o, s->sym[i]);
  return TT_OK;
}

tt_status tt_tokenizer_encode(const tt_tokenizer *t, const char *text, size_t len, int32_t bos, int32_t eos,
                              int32_t *ids, int64_t cap, int64_t *n) {
  if (!t || !n || (!text && len) || (!ids && cap > 0))
    return tt_error_set(TT_ERR_INVALID, "tokenizer: encode: NULL argument");
  if ((bos && t->bos_id < 0) || (eos && t->eos_id < 0))
    return tt_error_set(TT_ERR_INVALID, "tokenizer: encode: %s requested but this tokenizer has no %s token",
                        bos && t->bos_id < 0 ? "bos" : "eos", bos && t->bos_id < 0 ? "<|begin_of_text|>" : "<|end_of_text|>");
  tt_out o = {ids, cap, 0};
  if (bos) tt_emit(&o, t->bos_id);
  tt_splitter sp;
  TT_TRY(tt_splitter_init(&sp, t, text, len));
  tt_scratch s = {0};
  size_t a, b;
  tt_status st = TT_OK;
  int more;
  while ((more = tt_splitter_next(&sp, &a, &b)) > 0)
    if ((st = tt_bpe_piece(t, &s, (const uint8_t *)text + a, b - a, &o)) != TT_OK) break;
  pcre2_match_data_free(sp.md);
  free(s.sym);
  free(s.next);
  free(s.prev);
  free(s.heap);
  if (st != TT_OK) return st;
  if (more < 0) return TT_ERR_INTERNAL;
  if (eos) tt_emit(&o, t->eos_id);
  *n = o.n;
  if (o.n > cap)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: encode: %lld ids do not fit a buffer of %lld (len + 2 always fits)",
                        (long long)o.n, (long long)cap);
  return TT_OK;
}

/* ---- decode -------------------------------------------------------------------- */

tt_status tt_tokenizer_decode_length(const tt_tokenizer *t, const int32_t *ids, int64_t n, size_t *len) {
  if (!t || !len || (!ids && n > 0) || n < 0) return tt_error_set(TT_ERR_INVALID, "tokenizer: decode: bad argument");
  size_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (id < 0 || id >= t->vocab_size || t->len[id] < 0)
      return tt_error_set(TT_ERR_INDEX, "tokenizer: decode: id %d at position %lld is not in the vocabulary (size %d)",
                          id, (long long)i, t->vocab_size);
    total += (size_t)t->len[id];
  }
  *len = total;
  return TT_OK;
}

tt_status tt_tokenizer_decode(const tt_tokenizer *t, const int32_t *ids, int64_t n, char *out, size_t cap,
                              size_t *len) {
  size_t need;
  TT_TRY(tt_tokenizer_decode_length(t, ids, n, &need));
  *len = need;
  if (need > cap)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: decode: %zu bytes do not fit a buffer of %zu", need, cap);
  size_t at = 0;
  for (int64_t i = 0; i < n; i++) {
    memcpy(out + at, t->bytes + t->offset[ids[i]], (size_t)t->len[ids[i]]);
    at += (size_t)t->len[ids[i]];
  }
  return TT_OK;
}
