/*
 * tokenizer_train.c — byte-level BPE training.
 *
 * Text is cut by the same pre-tokenizer as encoding (a bytes-only tokenizer
 * holds the regex), and only unique pieces with their counts are kept: a
 * corpus of megabytes becomes tens of thousands of short "words". Merging
 * then follows HF tokenizers' trainer: pair counts are built once, each
 * merge rewrites only the words that hold the pair (an index pair -> words)
 * and adjusts the counts of the neighbouring pairs, and a max-heap with lazy
 * invalidation finds the next pair. Ties go to the smaller (left, right) ids,
 * so the result depends only on the text, never on hash or file order.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- interned byte strings (pieces; tokens) -------------------------------- */

typedef struct {
  uint8_t *pool;
  size_t pool_len, pool_cap;
  int64_t *off;
  int32_t *len;
  int32_t n, cap;
  int32_t *slots; /* index or -1 */
  uint64_t mask;
} tt_strtab;

static uint64_t tt_train_hash(const uint8_t *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

static void tt_strtab_free(tt_strtab *s) {
  free(s->pool);
  free(s->off);
  free(s->len);
  free(s->slots);
  memset(s, 0, sizeof *s);
}

static int32_t tt_strtab_find(const tt_strtab *s, const uint8_t *p, size_t n) {
  if (!s->slots) return -1;
  for (uint64_t i = tt_train_hash(p, n) & s->mask;; i = (i + 1) & s->mask) {
    int32_t k = s->slots[i];
    if (k < 0) return -1;
    if ((size_t)s->len[k] == n && memcmp(s->pool + s->off[k], p, n) == 0) return k;
  }
}

static int tt_strtab_rehash(tt_strtab *s, uint64_t size) {
  int32_t *slots = malloc(size * sizeof *slots);
  if (!slots) return 0;
  for (uint64_t i = 0; i < size; i++) slots[i] = -1;
  for (int32_t k = 0; k < s->n; k++) {
    uint64_t i = tt_train_hash(s->pool + s->off[k], (size_t)s->len[k]) & (size - 1);
    while (slots[i] >= 0) i = (i + 1) & (size - 1);
    slots[i] = k;
  }
  free(s->slots);
  s->slots = slots;
  s->mask = size - 1;
  return 1;
}

/* Index of the string, adding it when new (*created = 1); -1: out of memory. */
static int32_t tt_strtab_intern(tt_strtab *s, const uint8_t *p, size_t n, int *created) {
  *created = 0;
  int32_t k = tt_strtab_find(s, p, n);
  if (k >= 0) return k;
  if (s->n == s->cap) {
    int32_t cap = s->cap ? s->cap * 2 : 1024;
    int64_t *off = realloc(s->off, (size_t)cap * sizeof *off);
    if (off) s->off = off;
    int32_t *len = realloc(s->len, (size_t)cap * sizeof *len);
    if (len) s->len = len;
    if (!off || !len) return -1;
    s->cap = cap;
  }
  if (s->pool_len + n > s->pool_cap) {
    size_t cap = s->pool_cap ? s->pool_cap * 2 : 65536;
    while (cap < s->pool_len + n) cap *= 2;
    uint8_t *pool = realloc(s->pool, cap);
    if (!pool) return -1;
    s->pool = pool;
    s->pool_cap = cap;
  }
  if (!s->slots || (uint64_t)(s->n + 1) * 2 > s->mask + 1)
    if (!tt_strtab_rehash(s, s->slots ? (s->mask + 1) * 2 : 4096)) return -1;
  memcpy(s->pool + s->pool_len, p, n);
  k = s->n++;
  s->off[k] = (int64_t)s->pool_len;
  s->len[k] = (int32_t)n;
  s->pool_len += n;
  uint64_t i = tt_train_hash(p, n) & s->mask;
  while (s->slots[i] >= 0) i = (i + 1) & s->mask;
  s->slots[i] = k;
  *created = 1;
  return k;
}

/* ---- pairs and the heap ------------------------------------------------------- */

typedef struct {
  int32_t left, right;
  int64_t count;     /* weighted by the counts of the words holding it */
  int32_t *words;    /* words that held it when it gained count (may repeat or be stale) */
  int32_t n_words, cap_words;
  int32_t stamp;     /* last merge that raised its count */
} tt_tpair;

typedef struct {
  int64_t count;
  int32_t left, right;
} tt_tentry;

struct tt_tokenizer_trainer {
  tt_tokenizer *base; /* bytes only: owns the pre-tokenizer */
  tt_strtab pieces;
  int64_t *piece_count; /* [count_cap] */
  int32_t count_cap;
  int64_t bytes, n_pieces;
  int64_t *ends;
  int64_t ends_cap;
  /* merging (words are the unique pieces) */
  int started;
  int32_t *sym;       /* the words' current tokens, at pieces.off */
  int32_t *word_len;
  int32_t *word_stamp;
  tt_tpair *pairs;
  int32_t n_pairs, cap_pairs;
  int32_t *pair_slots;
  uint64_t pair_mask;
  tt_tentry *heap;
  int64_t n_heap, cap_heap;
  int32_t *changed;
  int32_t n_changed, cap_changed;
  int32_t stamp;
  tt_strtab tokens; /* id -> bytes; 0..255 are the bytes */
  int32_t *merge_lr; /* [2 * cap_merges] */
  int32_t n_merges, cap_merges;
  int64_t last_count;
  int oom;
};

static tt_status tt_trainer_oom(const char *what) {
  return tt_error_set(TT_ERR_OOM, "tokenizer: trainer: out of memory (%s)", what);
}

static uint64_t tt_train_pair_hash(int32_t l, int32_t r) {
  uint64_t k = (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  k ^= k >> 33;
  return k;
}

static int tt_pairs_rehash(tt_tokenizer_trainer *tr, uint64_t size) {
  int32_t *slots = malloc(size * sizeof *slots);
  if (!slots) return 0;
  for (uint64_t i = 0; i < size; i++) slots[i] = -1;
  for (int32_t k = 0; k < tr->n_pairs; k++) {
    uint64_t i = tt_train_pair_hash(tr->pairs[k].left, tr->pairs[k].right) & (size - 1);
    while (slots[i] >= 0) i = (i + 1) & (size - 1);
    slots[i] = k;
  }
  free(tr->pair_slots);
  tr->pair_slots = slots;
  tr->pair_mask = size - 1;
  return 1;
}

static int32_t tt_pair_index(tt_tokenizer_trainer *tr, int32_t l, int32_t r, int create) {
  uint64_t i = tt_train_pair_hash(l, r) & tr->pair_mask;
  for (; tr->pair_slots[i] >= 0; i = (i + 1) & tr->pair_mask) {
    tt_tpair *p = &tr->pairs[tr->pair_slots[i]];
    if (p->left == l && p->right == r) return tr->pair_slots[i];
  }
  if (!create) return -1;
  if (tr->n_pairs == tr->cap_pairs) {
    int32_t cap = tr->cap_pairs ? tr->cap_pairs * 2 : 4096;
    tt_tpair *pairs = realloc(tr->pairs, (size_t)cap * sizeof *pairs);
    if (!pairs) return -1;
    tr->pairs = pairs;
    tr->cap_pairs = cap;
  }
  int32_t k = tr->n_pairs++;
  tr->pairs[k] = (tt_tpair){l, r, 0, NULL, 0, 0, -1};
  tr->pair_slots[i] = k;
  if ((uint64_t)tr->n_pairs * 2 > tr->pair_mask + 1 && !tt_pairs_rehash(tr, (tr->pair_mask + 1) * 2)) return -1;
  return k;
}

/* count(l, r) += delta; a rise records the word and marks the pair for the heap. */
static void tt_pair_add(tt_tokenizer_trainer *tr, int32_t l, int32_t r, int64_t delta, int32_t word) {
  int32_t k = tt_pair_index(tr, l, r, 1);
  if (k < 0) {
    tr->oom = 1;
    return;
  }
  tt_tpair *p = &tr->pairs[k];
  p->count += delta;
  if (delta <= 0) return;
  if (p->n_words == 0 || p->words[p->n_words - 1] != word) {
    if (p->n_words == p->cap_words) {
      int32_t cap = p->cap_words ? p->cap_words * 2 : 4;
      int32_t *w = realloc(p->words, (size_t)cap * sizeof *w);
      if (!w) {
        tr->oom = 1;
        return;
      }
      p->words = w;
      p->cap_words = cap;
    }
    p->words[p->n_words++] = word;
  }
  if (p->stamp != tr->stamp) {
    p->stamp = tr->stamp;
    if (tr->n_changed == tr->cap_changed) {
      int32_t cap = tr->cap_changed ? tr->cap_changed * 2 : 1024;
      int32_t *c = realloc(tr->changed, (size_t)cap * sizeof *c);
      if (!c) {
        tr->oom = 1;
        return;
      }
      tr->changed = c;
      tr->cap_changed = cap;
    }
    tr->changed[tr->n_changed++] = k;
  }
}

/* Max-heap order: higher count first, then the smaller (left, right). */
static int tt_entry_before(const tt_tentry *a, const tt_tentry *b) {
  if (a->count != b->count) return a->count > b->count;
  if (a->left != b->left) return a->left < b->left;
  return a->right < b->right;
}

static int tt_theap_push(tt_tokenizer_trainer *tr, tt_tentry e) {
  if (tr->n_heap == tr->cap_heap) {
    int64_t cap = tr->cap_heap ? tr->cap_heap * 2 : 4096;
    tt_tentry *h = realloc(tr->heap, (size_t)cap * sizeof *h);
    if (!h) return 0;
    tr->heap = h;
    tr->cap_heap = cap;
  }
  int64_t i = tr->n_heap++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!tt_entry_before(&e, &tr->heap[p])) break;
    tr->heap[i] = tr->heap[p];
    i = p;
  }
  tr->heap[i] = e;
  return 1;
}

static tt_tentry tt_theap_pop(tt_tokenizer_trainer *tr) {
  tt_tentry *h = tr->heap, top = h[0], last = h[--tr->n_heap];
  int64_t i = 0, n = tr->n_heap;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && tt_entry_before(&h[c + 1], &h[c])) c++;
    if (!tt_entry_before(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = last;
  return top;
}

static int tt_push_changed(tt_tokenizer_trainer *tr) {
  for (int32_t i = 0; i < tr->n_changed; i++) {
    tt_tpair *p = &tr->pairs[tr->changed[i]];
    if (p->count > 0 && !tt_theap_push(tr, (tt_tentry){p->count, p->left, p->right})) return 0;
  }
  tr->n_changed = 0;
  return 1;
}

/* ---- life cycle ---------------------------------------------------------------- */

void tt_tokenizer_trainer_free(tt_tokenizer_trainer *tr) {
  if (!tr) return;
  tt_tokenizer_free(tr->base);
  tt_strtab_free(&tr->pieces);
  tt_strtab_free(&tr->tokens);
  free(tr->piece_count);
  free(tr->ends);
  free(tr->sym);
  free(tr->word_len);
  free(tr->word_stamp);
  for (int32_t k = 0; k < tr->n_pairs; k++) free(tr->pairs[k].words);
  free(tr->pairs);
  free(tr->pair_slots);
  free(tr->heap);
  free(tr->changed);
  free(tr->merge_lr);
  free(tr);
}

tt_status tt_tokenizer_trainer_new(const char *pattern, tt_tokenizer_trainer **out) {
  if (!out) return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: out is NULL");
  *out = NULL;
  tt_tokenizer_trainer *tr = calloc(1, sizeof *tr);
  if (!tr) return tt_trainer_oom("trainer");
  uint8_t bytes[256];
  int32_t lens[256], ids[256];
  for (int i = 0; i < 256; i++) {
    bytes[i] = (uint8_t)i;
    lens[i] = 1;
    ids[i] = i;
  }
  tt_tokenizer_spec spec = {0};
  spec.source = "trainer";
  spec.pattern = pattern;
  spec.n_tokens = 256;
  spec.token_bytes = bytes;
  spec.token_lens = lens;
  spec.token_ids = ids;
  spec.bos_id = spec.eos_id = -1;
  tt_status st = tt_tokenizer_new(&spec, &tr->base);
  if (st != TT_OK) {
    tt_tokenizer_trainer_free(tr);
    return st;
  }
  *out = tr;
  return TT_OK;
}

tt_status tt_tokenizer_trainer_add(tt_tokenizer_trainer *tr, const char *text, size_t len) {
  if (!tr || (!text && len)) return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: add: NULL argument");
  if (tr->started)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: text added after merging started; add all text first");
  if ((int64_t)len + 1 > tr->ends_cap) {
    free(tr->ends);
    tr->ends_cap = (int64_t)len + 1;
    tr->ends = malloc((size_t)tr->ends_cap * sizeof *tr->ends);
    if (!tr->ends) {
      tr->ends_cap = 0;
      return tt_trainer_oom("piece offsets");
    }
  }
  int64_t n = 0;
  TT_TRY(tt_tokenizer_split(tr->base, text, len, tr->ends, tr->ends_cap, &n));
  int64_t start = 0;
  for (int64_t i = 0; i < n; i++) {
    int created;
    int32_t k = tt_strtab_intern(&tr->pieces, (const uint8_t *)text + start, (size_t)(tr->ends[i] - start), &created);
    if (k < 0) return tt_trainer_oom("pieces");
    if (created) {
      if (k >= tr->count_cap) { /* counts follow the table's capacity */
        int64_t *pc = realloc(tr->piece_count, (size_t)tr->pieces.cap * sizeof *pc);
        if (!pc) return tt_trainer_oom("piece counts");
        tr->piece_count = pc;
        tr->count_cap = tr->pieces.cap;
      }
      tr->piece_count[k] = 0;
    }
    tr->piece_count[k]++;
    start = tr->ends[i];
  }
  tr->bytes += (int64_t)len;
  tr->n_pieces += n;
  return TT_OK;
}

/* Words from pieces, the byte tokens, and every adjacent pair's count. */
static tt_status tt_trainer_start(tt_tokenizer_trainer *tr) {
  int32_t nw = tr->pieces.n;
  tr->sym = malloc((tr->pieces.pool_len + 1) * sizeof *tr->sym);
  tr->word_len = malloc(((size_t)nw + 1) * sizeof *tr->word_len);
  tr->word_stamp = malloc(((size_t)nw + 1) * sizeof *tr->word_stamp);
  if (!tr->sym || !tr->word_len || !tr->word_stamp || !tt_pairs_rehash(tr, 1 << 16)) return tt_trainer_oom("words");
  for (size_t i = 0; i < tr->pieces.pool_len; i++) tr->sym[i] = tr->pieces.pool[i];
  for (int32_t w = 0; w < nw; w++) {
    tr->word_len[w] = tr->pieces.len[w];
    tr->word_stamp[w] = -1;
  }
  for (int b = 0; b < 256; b++) {
    uint8_t c = (uint8_t)b;
    int created;
    if (tt_strtab_intern(&tr->tokens, &c, 1, &created) != b) return tt_trainer_oom("tokens");
  }
  tr->stamp = 0;
  for (int32_t w = 0; w < nw; w++) {
    const int32_t *s = tr->sym + tr->pieces.off[w];
    for (int32_t i = 0; i + 1 < tr->word_len[w]; i++) tt_pair_add(tr, s[i], s[i + 1], tr->piece_count[w], w);
  }
  if (tr->oom || !tt_push_changed(tr)) return tt_trainer_oom("pairs");
  tr->started = 1;
  return TT_OK;
}

/* Replace (l, r) by id in word w, moving the counts of the pairs around it. */
static void tt_trainer_merge_word(tt_tokenizer_trainer *tr, int32_t w, int32_t l, int32_t r, int32_t id) {
  int32_t *s = tr->sym + tr->pieces.off[w];
  int32_t n = tr->word_len[w], i = 0, j = 0;
  int64_t c = tr->piece_count[w];
  while (i < n) {
    if (i + 1 < n && s[i] == l && s[i + 1] == r) {
      if (j > 0) {
        tt_pair_add(tr, s[j - 1], l, -c, w);
        tt_pair_add(tr, s[j - 1], id, c, w);
      }
      tt_pair_add(tr, l, r, -c, w);
      if (i + 2 < n) {
        tt_pair_add(tr, r, s[i + 2], -c, w);
        tt_pair_add(tr, id, s[i + 2], c, w);
      }
      s[j++] = id;
      i += 2;
    } else {
      s[j++] = s[i++];
    }
  }
  tr->word_len[w] = j;
}

tt_status tt_tokenizer_trainer_merge(tt_tokenizer_trainer *tr, int32_t max_merges, int32_t *done) {
  if (!tr || !done) return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: merge: NULL argument");
  *done = 0;
  if (!tr->started) TT_TRY(tt_trainer_start(tr));
  uint8_t *cat = NULL;
  size_t cat_cap = 0;
  while (*done < max_merges && tr->n_heap > 0) {
    tt_tentry top = tt_theap_pop(tr);
    int32_t k = tt_pair_index(tr, top.left, top.right, 0);
    int64_t cur = k >= 0 ? tr->pairs[k].count : 0;
    if (cur != top.count) { /* stale entry: the pair's count fell since */
      if (cur > 0 && !tt_theap_push(tr, (tt_tentry){cur, top.left, top.right})) break;
      continue;
    }
    /* The new token; a merge may remake bytes some earlier merge made
     * (e.g. "ab"+"c" and "a"+"bc"): it then reuses that id, as HF does. */
    int32_t l = top.left, r = top.right;
    size_t ln = (size_t)tr->tokens.len[l], rn = (size_t)tr->tokens.len[r];
    if (ln + rn > cat_cap) {
      cat_cap = 2 * (ln + rn);
      uint8_t *c2 = realloc(cat, cat_cap);
      if (!c2) {
        tr->oom = 1;
        break;
      }
      cat = c2;
    }
    memcpy(cat, tr->tokens.pool + tr->tokens.off[l], ln);
    memcpy(cat + ln, tr->tokens.pool + tr->tokens.off[r], rn);
    int created;
    int32_t id = tt_strtab_intern(&tr->tokens, cat, ln + rn, &created);
    if (id < 0) {
      tr->oom = 1;
      break;
    }
    if (tr->n_merges == tr->cap_merges) {
      int32_t cap = tr->cap_merges ? tr->cap_merges * 2 : 1024;
      int32_t *m = realloc(tr->merge_lr, (size_t)cap * 2 * sizeof *m);
      if (!m) {
        tr->oom = 1;
        break;
      }
      tr->merge_lr = m;
      tr->cap_merges = cap;
    }
    tr->merge_lr[2 * tr->n_merges] = l;
    tr->merge_lr[2 * tr->n_merges + 1] = r;
    tr->n_merges++;
    tr->last_count = cur;
    tr->stamp++;
    /* Detach the word list: tt_pair_add may move the pairs array. */
    int32_t *words = tr->pairs[k].words, nw = tr->pairs[k].n_words;
    tr->pairs[k].words = NULL;
    tr->pairs[k].n_words = tr->pairs[k].cap_words = 0;
    for (int32_t i = 0; i < nw; i++) {
      int32_t w = words[i];
      if (tr->word_stamp[w] == tr->stamp) continue;
      tr->word_stamp[w] = tr->stamp;
      tt_trainer_merge_word(tr, w, l, r, id);
    }
    free(words);
    if (tr->oom || !tt_push_changed(tr)) {
      tr->oom = 1;
      break;
    }
    (*done)++;
  }
  free(cat);
  if (tr->oom) return tt_trainer_oom("merges");
  return TT_OK;
}

tt_status tt_tokenizer_trainer_stats(const tt_tokenizer_trainer *tr, tt_tokenizer_train_stats *out) {
  if (!tr || !out) return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: stats: NULL argument");
  out->bytes = tr->bytes;
  out->pieces = tr->n_pieces;
  out->unique_pieces = tr->pieces.n;
  out->pairs = tr->n_pairs;
  out->merges = tr->n_merges;
  out->tokens = tr->started ? tr->tokens.n : 256;
  out->last_count = tr->last_count;
  return TT_OK;
}

tt_status tt_tokenizer_trainer_finish(const tt_tokenizer_trainer *tr, int32_t n_specials, const uint8_t *special_bytes,
                                      const int32_t *special_lens, int32_t bos_special, int32_t eos_special,
                                      tt_tokenizer **out) {
  if (!tr || !out || n_specials < 0 || (n_specials && (!special_bytes || !special_lens)))
    return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: finish: bad argument");
  *out = NULL;
  if (bos_special >= n_specials || eos_special >= n_specials)
    return tt_error_set(TT_ERR_INVALID, "tokenizer: trainer: finish: bos/eos index (%d, %d) beyond the %d specials",
                        bos_special, eos_special, n_specials);
  int32_t nt = tr->started ? tr->tokens.n : 256;
  int32_t *ids = malloc(((size_t)nt + (size_t)n_specials + 1) * sizeof *ids);
  if (!ids) return tt_trainer_oom("finish");
  for (int32_t i = 0; i < nt + n_specials; i++) ids[i] = i;
  uint8_t bytes[256];
  int32_t lens[256];
  for (int i = 0; i < 256; i++) {
    bytes[i] = (uint8_t)i;
    lens[i] = 1;
  }
  tt_tokenizer_spec spec = {0};
  spec.source = "trainer";
  TT_TRY(tt_tokenizer_pattern(tr->base, &spec.pattern));
  spec.n_tokens = nt;
  spec.token_bytes = tr->started ? tr->tokens.pool : bytes;
  spec.token_lens = tr->started ? tr->tokens.len : lens;
  spec.token_ids = ids;
  spec.n_merges = tr->n_merges;
  spec.merges = tr->merge_lr;
  spec.n_specials = n_specials;
  spec.special_bytes = special_bytes;
  spec.special_lens = special_lens;
  spec.special_ids = ids + nt;
  spec.bos_id = bos_special >= 0 ? nt + bos_special : -1;
  spec.eos_id = eos_special >= 0 ? nt + eos_special : -1;
  tt_status st = tt_tokenizer_new(&spec, out);
  free(ids);
  return st;
}
