/* BPE merges on one word, and the word cache in front of them.
 *
 * The merge loop is HF's: the word starts as one symbol per byte; the pair
 * with the lowest merge rank is merged first, the leftmost on ties, until no
 * adjacent pair has a merge. Candidate pairs sit in a min-heap keyed by
 * (rank, position); merging invalidates neighbours lazily (an entry whose two
 * symbols changed is dropped when popped), so a word of n bytes costs
 * O(n log n) rather than the O(n^2) rescans of the textbook loop - Chinese
 * text pre-tokenizes into long runs, where that matters. */
#include "text/bpe_impl.h"

#include "core/error.h"
#include "core/mem.h"

#include <string.h>

typedef struct {
    uint32_t rank;
    uint32_t pos;   /* symbol index of the left half */
    int32_t left, right;
} merge_cand;

static inline int cand_less(const merge_cand *a, const merge_cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(merge_cand *h, size_t *n, merge_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static merge_cand heap_pop(merge_cand *h, size_t *n) {
    merge_cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const merge_cand *best = &last;
        if (l < *n && cand_less(&h[l], best)) { m = l; best = &h[l]; }
        if (r < *n && cand_less(&h[r], best)) { m = r; best = &h[r]; }
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

int bpe_grow(int32_t **ids, bpe_span **spans, uint8_t **marks, size_t n, size_t *cap, size_t more) {
    size_t c = *cap < 64 ? 64 : *cap;
    while (c < n + more) c *= 2;
    int32_t *ni = qt_realloc(*ids, c * sizeof *ni, "token ids");
    if (!ni) return QT_ENOMEM;
    *ids = ni;
    if (spans) {
        bpe_span *ns = qt_realloc(*spans, c * sizeof *ns, "token spans");
        if (!ns) return QT_ENOMEM;
        *spans = ns;
    }
    if (marks) {
        uint8_t *nm = qt_realloc(*marks, c, "token marks");
        if (!nm) return QT_ENOMEM;
        *marks = nm;
    }
    *cap = c;
    return QT_OK;
}

/* Runs the merges on w[0..n) and writes the ids to out (room for n). */
static size_t bpe_merge_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, int32_t *sym, int32_t *next,
                             int32_t *prev, merge_cand *heap) {
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        sym[i] = t->byte_id[w[i]];
        next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
        prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t rank = t->byte_pair[w[i] * 256 + w[i + 1]];
        if (rank != BPE_NO_MERGE) {
            __builtin_prefetch(&t->merge_id[rank]);
            heap_push(heap, &hn, (merge_cand){rank, (uint32_t)i, sym[i], sym[i + 1]});
        }
    }
    while (hn) {
        merge_cand c = heap_pop(heap, &hn);
        int32_t p = (int32_t)c.pos, q = next[p];
        if (sym[p] != c.left || q < 0 || sym[q] != c.right) continue; /* stale */
        sym[p] = t->merge_id[c.rank];
        sym[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0) prev[next[q]] = p;
        int32_t l = prev[p], r = next[p];
        if (l >= 0) {
            uint32_t rank = bpe_merge_rank(t, sym[l], sym[p]);
            if (rank != BPE_NO_MERGE) {
                __builtin_prefetch(&t->merge_id[rank]);
                heap_push(heap, &hn, (merge_cand){rank, (uint32_t)l, sym[l], sym[p]});
            }
        }
        if (r >= 0) {
            uint32_t rank = bpe_merge_rank(t, sym[p], sym[r]);
            if (rank != BPE_NO_MERGE) {
                __builtin_prefetch(&t->merge_id[rank]);
                heap_push(heap, &hn, (merge_cand){rank, (uint32_t)p, sym[p], sym[r]});
            }
        }
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = next[i]) out[k++] = sym[i];
    return k;
}

/* The same merges for short words, without the heap: the pair ranks sit in
 * an array, each step merges the lowest (the leftmost of equals, by the
 * strict <), drops one slot and asks for the two new neighbour pairs. Same
 * order as the heap's (rank, position) pops; O(n^2) compares, fewer
 * instructions than the heap up to BPE_SMALL_WORD bytes. */
#define BPE_SMALL_WORD 24
static size_t bpe_merge_small(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out) {
    int32_t sym[BPE_SMALL_WORD];
    uint32_t rk[BPE_SMALL_WORD];
    for (size_t i = 0; i < n; i++) sym[i] = t->byte_id[w[i]];
    for (size_t i = 0; i + 1 < n; i++) rk[i] = t->byte_pair[w[i] * 256 + w[i + 1]];
    size_t m = n; /* symbols left; rk[0 .. m-1) ranks of adjacent pairs */
    while (m > 1) {
        uint32_t best = BPE_NO_MERGE;
        size_t b = 0;
        for (size_t i = 0; i + 1 < m; i++)
            if (rk[i] < best) {
                best = rk[i];
                b = i;
            }
        if (best == BPE_NO_MERGE) break;
        sym[b] = t->merge_id[best];
        for (size_t j = b + 1; j + 1 < m; j++) sym[j] = sym[j + 1];
        for (size_t j = b; j + 2 < m; j++) rk[j] = rk[j + 1];
        m--;
        if (b > 0) rk[b - 1] = bpe_merge_rank(t, sym[b - 1], sym[b]);
        if (b + 1 < m) rk[b] = bpe_merge_rank(t, sym[b], sym[b + 1]);
    }
    for (size_t i = 0; i < m; i++) out[i] = sym[i];
    return m;
}

/* Long words: the heap, with scratch on the stack or, past STACK_N bytes,
 * on the heap. Kept out of word_one so a cache hit has a small frame. */
__attribute__((noinline)) static int bpe_merge_long(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    enum { STACK_N = 256 };
    int32_t sbuf[3 * STACK_N];
    merge_cand hbuf[STACK_N * 3];
    int32_t *scratch = sbuf;
    merge_cand *heap = hbuf;
    if (n > STACK_N) {
        /* each merge pushes at most two candidates: n - 1 + 2(n - 1) < 3n */
        scratch = qt_malloc(3 * n * sizeof *scratch, "BPE scratch");
        heap = qt_malloc(3 * n * sizeof *heap, "BPE scratch");
        if (!scratch || !heap) {
            qt_free(scratch);
            qt_free(heap);
            return QT_ENOMEM;
        }
    }
    *k = bpe_merge_word(t, w, n, out, scratch, scratch + n, scratch + 2 * n, heap);
    if (n > STACK_N) {
        qt_free(scratch);
        qt_free(heap);
    }
    return QT_OK;
}

/* ---- the cache ---- */

static int vocab_words_init(bpe_tokenizer *t);

int bpe_cache_init(bpe_tokenizer *t) {
    _Static_assert(sizeof(bpe_cache_slot) == 64, "a cache slot is one cache line");
    t->pair_cache = qt_alloc_aligned(BPE_PAIR_CACHE * sizeof *t->pair_cache, "BPE pair cache");
    if (!t->pair_cache) return QT_ENOMEM;
    for (size_t i = 0; i < BPE_PAIR_CACHE; i++) atomic_init(&t->pair_cache[i], UINT64_MAX);
    _Static_assert(sizeof(bpe_lcache_slot) == 128, "a long-word slot is two cache lines");
    t->lcache.slots = qt_alloc_aligned(BPE_LCACHE_SLOTS * sizeof *t->lcache.slots, "tokenizer long-word cache");
    if (!t->lcache.slots) return QT_ENOMEM;
    memset(t->lcache.slots, 0, BPE_LCACHE_SLOTS * sizeof *t->lcache.slots);
    atomic_flag_clear(&t->lcache.busy);
    for (int s = 0; s < BPE_CACHE_SHARDS; s++) {
        bpe_cache_shard *sh = &t->cache[s];
        sh->slots = qt_alloc_aligned(BPE_CACHE_SLOTS * sizeof *sh->slots, "tokenizer word cache");
        if (!sh->slots) return QT_ENOMEM;
        memset(sh->slots, 0, BPE_CACHE_SLOTS * sizeof *sh->slots);
        atomic_flag_clear(&sh->busy);
    }
    return vocab_words_init(t);
}

void bpe_cache_free(bpe_tokenizer *t) {
    qt_free((void *)t->pair_cache);
    qt_free(t->span_bloom);
    qt_free((void *)t->span_memo);
    qt_free(t->lcache.slots);
    qt_free(t->vocab_words);
    for (int s = 0; s < BPE_CACHE_SHARDS; s++) {
        bpe_cache_shard *sh = &t->cache[s];
        qt_free(sh->slots);
    }
}

/* Short words, inline: the cache's keys are at most BPE_CACHE_MAX_WORD
 * bytes, where a libc memcmp/memcpy call and a byte-count loop cost more
 * than the work. Reads stay inside [0, n): 8-byte chunks with the last one
 * overlapping, 4-byte halves for 4..7 bytes, single bytes below. */
static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t word_hash(const uint8_t *w, size_t n) {
    uint64_t h = 0x243F6A8885A308D3ull ^ (n * 0x9E3779B97F4A7C15ull), tail;
    if (n >= 8) {
        for (size_t i = 0; i + 8 < n; i += 8) {
            h = (h ^ load64(w + i)) * 0xBF58476D1CE4E5B9ull;
            h ^= h >> 31;
        }
        tail = load64(w + n - 8);
    } else if (n >= 4) {
        tail = (uint64_t)load32(w) << 32 | load32(w + n - 4);
    } else {
        tail = (uint64_t)w[0] << 16 | (uint64_t)w[n / 2] << 8 | w[n - 1];
    }
    h = (h ^ tail) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return h;
}

static inline int word_eq(const uint8_t *a, const uint8_t *b, size_t n) {
    if (n >= 8) {
        for (size_t i = 0; i + 8 < n; i += 8)
            if (load64(a + i) != load64(b + i)) return 0;
        return load64(a + n - 8) == load64(b + n - 8);
    }
    if (n >= 4) return load32(a) == load32(b) && load32(a + n - 4) == load32(b + n - 4);
    return a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1]; /* n <= 3: every byte */
}

/* ---- whole-token words (see bpe_vocab_slot) ---- */

static inline size_t vocab_slot(const bpe_tokenizer *t, uint64_t h) { return (size_t)(h >> 40) & (t->vocab_words_cap - 1); }

/* The id of the token whose bytes are w[0..n) when those bytes merge into
 * it alone, else -1. n in 2..BPE_VOCAB_MAX_WORD; h = word_hash(w, n). */
static inline int32_t vocab_word(const bpe_tokenizer *t, uint64_t h, const uint8_t *w, size_t n) {
    uint32_t h32 = (uint32_t)h;
    for (size_t i = vocab_slot(t, h);; i = (i + 1) & (t->vocab_words_cap - 1)) {
        const bpe_vocab_slot *s = &t->vocab_words[i];
        if (s->id < 0) return -1;
        if (s->hash == h32 && s->wlen == n && word_eq(s->word, w, n)) return s->id;
    }
}

/* Every token of 2..BPE_VOCAB_MAX_WORD bytes is merged once, here, and
 * kept when the merges give it back alone: then a word with its bytes has
 * that one id, as the merge loop would find. Added tokens never reach the
 * merges and are left out. */
static int vocab_words_init(bpe_tokenizer *t) {
    size_t cap = 1024;
    while (cap < (size_t)t->n_ids + (size_t)t->n_ids / 2) cap *= 2; /* load under 2/3 */
    t->vocab_words = qt_alloc_aligned(cap * sizeof *t->vocab_words, "tokenizer vocabulary words");
    if (!t->vocab_words) return QT_ENOMEM;
    memset(t->vocab_words, 0, cap * sizeof *t->vocab_words);
    for (size_t i = 0; i < cap; i++) t->vocab_words[i].id = -1;
    t->vocab_words_cap = cap;
    t->n_vocab_words = 0;
    for (int32_t id = 0; id < t->n_ids; id++) {
        const uint8_t *b = t->bytes + t->tok_off[id];
        size_t n = t->tok_off[id + 1] - t->tok_off[id];
        if (n < 2 || n > BPE_VOCAB_MAX_WORD || t->is_added[id]) continue;
        int32_t out[BPE_VOCAB_MAX_WORD];
        if (bpe_merge_small(t, b, n, out) != 1 || out[0] != id) continue;
        uint64_t h = word_hash(b, n);
        size_t i = vocab_slot(t, h);
        while (t->vocab_words[i].id >= 0) {
            if (t->vocab_words[i].wlen == n && !memcmp(t->vocab_words[i].word, b, n)) break; /* same bytes twice */
            i = (i + 1) & (cap - 1);
        }
        if (t->vocab_words[i].id >= 0) continue;
        bpe_vocab_slot *s = &t->vocab_words[i];
        s->hash = (uint32_t)h;
        s->id = id;
        s->wlen = (uint8_t)n;
        memcpy(s->word, b, n);
        t->n_vocab_words++;
    }
    return QT_OK;
}

/* The word cache and the long-word cache are one scheme over two slot
 * sizes: open addressing in a table of SLOTS slots behind a test-and-set
 * flag (a busy table is skipped, never waited on), emptied when half full.
 * NAME_get looks w up (h = word_hash(w, n)); on a hit it copies the slot's
 * whole ids array to out (one fixed-size copy: out has room for that many
 * ids whatever the word's count) and returns 1. NAME_put stores a word of
 * at most MAXIDS ids. */
#define BPE_CACHE_OPS(NAME, TABLE, SLOT, SLOTS, MAXIDS)                                                             \
    static int NAME##_get(TABLE *sh, uint64_t h, const uint8_t *w, size_t n, int32_t *out, size_t *k) {             \
        int hit = 0;                                                                                                \
        uint32_t h32 = (uint32_t)h;                                                                                 \
        if (atomic_flag_test_and_set_explicit(&sh->busy, memory_order_acquire)) return 0;                          \
        for (size_t i = (h >> 32) & (SLOTS - 1); sh->slots[i].nids; i = (i + 1) & (SLOTS - 1)) {                    \
            const SLOT *s = &sh->slots[i];                                                                          \
            if (s->hash == h32 && s->wlen == n && word_eq(s->word, w, n)) {                                         \
                memcpy(out, s->ids, sizeof s->ids);                                                                 \
                *k = s->nids;                                                                                       \
                hit = 1;                                                                                            \
                break;                                                                                              \
            }                                                                                                       \
        }                                                                                                           \
        atomic_flag_clear_explicit(&sh->busy, memory_order_release);                                                \
        return hit;                                                                                                 \
    }                                                                                                               \
    static void NAME##_put(TABLE *sh, uint64_t h, const uint8_t *w, size_t n, const int32_t *ids, size_t k) {       \
        if (k > MAXIDS || atomic_flag_test_and_set_explicit(&sh->busy, memory_order_acquire)) return;               \
        if (sh->count >= SLOTS / 2) { /* full: start over */                                                        \
            memset(sh->slots, 0, SLOTS * sizeof *sh->slots);                                                        \
            sh->count = 0;                                                                                          \
        }                                                                                                           \
        uint32_t h32 = (uint32_t)h;                                                                                 \
        size_t i = (h >> 32) & (SLOTS - 1);                                                                         \
        for (; sh->slots[i].nids; i = (i + 1) & (SLOTS - 1)) {                                                      \
            const SLOT *s = &sh->slots[i];                                                                          \
            if (s->hash == h32 && s->wlen == n && !memcmp(s->word, w, n)) { /* another thread got here first */     \
                atomic_flag_clear_explicit(&sh->busy, memory_order_release);                                        \
                return;                                                                                             \
            }                                                                                                       \
        }                                                                                                           \
        SLOT *s = &sh->slots[i];                                                                                    \
        s->hash = h32;                                                                                              \
        s->wlen = (uint8_t)n;                                                                                       \
        s->nids = (uint8_t)k;                                                                                       \
        memcpy(s->word, w, n);                                                                                      \
        memcpy(s->ids, ids, k * sizeof *ids);                                                                       \
        sh->count++;                                                                                                \
        atomic_flag_clear_explicit(&sh->busy, memory_order_release);                                                \
    }

BPE_CACHE_OPS(cache, bpe_cache_shard, bpe_cache_slot, BPE_CACHE_SLOTS, BPE_CACHE_MAX_IDS)
/* A long word has more than BPE_CACHE_MAX_WORD bytes, so out (sized for n +
 * BPE_CACHE_MAX_IDS ids) holds a whole long slot's ids. */
_Static_assert(BPE_LCACHE_MAX_IDS <= BPE_CACHE_MAX_WORD + 1 + BPE_CACHE_MAX_IDS, "long-word cache ids fit out");
BPE_CACHE_OPS(lcache, bpe_lcache, bpe_lcache_slot, BPE_LCACHE_SLOTS, BPE_LCACHE_MAX_IDS)

/* Words past the word cache's slots: the long-word cache, then the heap. */
__attribute__((noinline)) static int word_long(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    if (n > BPE_LCACHE_MAX_WORD) return bpe_merge_long(t, w, n, out, k);
    uint64_t h = word_hash(w, n);
    bpe_lcache *lc = (bpe_lcache *)&t->lcache;
    if (lcache_get(lc, h, w, n, out, k)) return QT_OK;
    QT_TRY(bpe_merge_long(t, w, n, out, k));
    lcache_put(lc, h, w, n, out, *k);
    return QT_OK;
}

/* ---- cutting long words (see bpe_impl.h) ---- */

/* key of (the ls bytes before a boundary, the rs bytes after it), ls, rs in 1..3 */
uint64_t bpe_span_key(const uint8_t *left, int ls, const uint8_t *right, int rs) {
    uint64_t l = 0, r = 0;
    for (int i = 0; i < ls; i++) l |= (uint64_t)left[ls - 1 - i] << (8 * i); /* nearest byte lowest */
    for (int i = 0; i < rs; i++) r |= (uint64_t)right[i] << (8 * i);
    return (uint64_t)ls << 60 | (uint64_t)rs << 56 | l << 24 | r;
}

static inline int is_cut_point(const uint8_t *w, size_t p) { return w[p] >= 0xC0 && w[p - 1] >= 0x80; }

int bpe_span_init(bpe_tokenizer *t) {
    t->span_bloom = qt_calloc(BPE_SPAN_BLOOM / 64, sizeof *t->span_bloom, "BPE span filter");
    if (!t->span_bloom) return QT_ENOMEM;
    t->span_memo = qt_alloc_aligned(((size_t)1 << BPE_SPAN_MEMO_BITS) * sizeof *t->span_memo, "BPE span memo");
    if (!t->span_memo) return QT_ENOMEM;
    for (size_t i = 0; i < (size_t)1 << BPE_SPAN_MEMO_BITS; i++) atomic_init(&t->span_memo[i], UINT64_MAX);
    for (int32_t id = 0; id < t->n_ids; id++) {
        const uint8_t *b = t->bytes + t->tok_off[id];
        size_t len = t->tok_off[id + 1] - t->tok_off[id];
        for (size_t i = 1; i < len; i++) {
            if (!is_cut_point(b, i)) continue;
            int ls = i < 3 ? (int)i : 3, rs = len - i < 3 ? (int)(len - i) : 3;
            bpe_span_bloom_add(t->span_bloom, bpe_span_key(b + i - ls, ls, b + i, rs));
        }
    }
    return QT_OK;
}

static int spanned_bloom(const bpe_tokenizer *t, uint64_t l, uint64_t r, int lmax, int rmax);

/* 1 when some token may span position p of w[0..n) (a cut point). The
 * bytes around p are gathered once; each (ls, rs) key is a masked copy. */
static int spanned(const bpe_tokenizer *t, const uint8_t *w, size_t n, size_t p) {
    int lmax = p < 3 ? (int)p : 3, rmax = n - p < 3 ? (int)(n - p) : 3;
    uint64_t l = 0, r = 0;
    if (p >= 4) { /* nearest byte lowest: w[p-4..p) big-endian, less w[p-4] */
        l = __builtin_bswap32(load32(w + p - 4)) & 0xFFFFFF;
    } else {
        for (int i = 0; i < lmax; i++) l |= (uint64_t)w[p - 1 - i] << (8 * i);
    }
    if (n - p >= 4) { /* w[p] lowest: a little-endian load */
        r = load32(w + p) & 0xFFFFFF;
    } else {
        for (int i = 0; i < rmax; i++) r |= (uint64_t)w[p + i] << (8 * i);
    }
    /* The answer depends on (l, r, lmax, rmax) alone, and the same pairs of
     * characters keep meeting: remember recent answers (see BPE_SPAN_MEMO). */
    uint64_t key = (uint64_t)lmax << 50 | (uint64_t)rmax << 48 | l << 24 | r;
    size_t slot = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - BPE_SPAN_MEMO_BITS));
    uint64_t e = atomic_load_explicit(&t->span_memo[slot], memory_order_relaxed);
    if (e >> 1 == key) return (int)(e & 1);
    int res = spanned_bloom(t, l, r, lmax, rmax);
    atomic_store_explicit(&t->span_memo[slot], key << 1 | (uint64_t)res, memory_order_relaxed);
    return res;
}

static int spanned_bloom(const bpe_tokenizer *t, uint64_t l, uint64_t r, int lmax, int rmax) {
    for (int ls = lmax; ls >= 1; ls--) {
        uint64_t lk = (uint64_t)ls << 60 | (l & ((1ull << (8 * ls)) - 1)) << 24;
        for (int rs = rmax; rs >= 1; rs--)
            if (bpe_span_bloom_has(t->span_bloom, lk | (uint64_t)rs << 56 | (r & ((1ull << (8 * rs)) - 1)))) return 1;
    }
    return 0;
}

/* A word of at most BPE_CACHE_MAX_WORD bytes that missed the cache: merged,
 * then remembered. Out of line so that a hit has a small frame. */
__attribute__((noinline)) static int word_miss(const bpe_tokenizer *t, bpe_cache_shard *sh, uint64_t h, const uint8_t *w,
                                               size_t n, int32_t *out, size_t *kout) {
    size_t k;
    if (n <= BPE_SMALL_WORD) {
        k = bpe_merge_small(t, w, n, out);
    } else {
        QT_TRY(bpe_merge_long(t, w, n, out, &k));
    }
    cache_put(sh, h, w, n, out, k);
    *kout = k;
    return QT_OK;
}

/* Ids of a word that is not cut further, into out (room for n +
 * BPE_CACHE_MAX_IDS ids: a hit copies its slot's ids whole). */
static inline int word_one(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    if (n == 1) {
        out[0] = t->byte_id[w[0]];
        *k = 1;
        return QT_OK;
    }
    if (n > BPE_CACHE_MAX_WORD) return word_long(t, w, n, out, k);
    uint64_t h = word_hash(w, n);
    if (n <= BPE_VOCAB_MAX_WORD) {
        int32_t id = vocab_word(t, h, w, n);
        if (id >= 0) {
            out[0] = id;
            *k = 1;
            return QT_OK;
        }
    }
    bpe_cache_shard *sh = (bpe_cache_shard *)&t->cache[(h >> 16) % BPE_CACHE_SHARDS];
    if (cache_get(sh, h, w, n, out, k)) return QT_OK;
    return word_miss(t, sh, h, w, n, out, k);
}

/* A word that may be cut (see bpe_impl.h): out of line, so that the common
 * uncut word does not pay for this loop's registers. */
__attribute__((noinline)) static int word_cut(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    /* a cut point is the start of a non-ASCII character after another one:
     * step from character to character (valid UTF-8: the lead byte gives
     * the length) */
    size_t start = 0, total = 0, m;
    for (size_t p = 1 + (w[0] >= 0xC0) + (w[0] >= 0xE0) + (w[0] >= 0xF0); p < n;) {
        uint8_t b = w[p];
        size_t l = 1 + (b >= 0xC0) + (b >= 0xE0) + (b >= 0xF0);
        if (b >= 0xC0 && w[p - 1] >= 0x80 && !spanned(t, w, n, p)) {
            QT_TRY(word_one(t, w + start, p - start, out + total, &m));
            total += m;
            start = p;
        }
        p += l;
    }
    QT_TRY(word_one(t, w + start, n - start, out + total, &m));
    *k = total + m;
    return QT_OK;
}

/* ignore_merges: the id of the vocabulary token whose bytes are w[0, n), else
 * -1. HF looks the word up spelt in the byte alphabet, as the vocabulary is. */
static int32_t whole_word(const bpe_tokenizer *t, const uint8_t *w, size_t n) {
    char s[2 * BPE_WHOLE_WORD_MAX + 1];
    if (n > t->max_word_bytes || n > BPE_WHOLE_WORD_MAX) return -1;
    return bpe_vocab_find(t, s, bpe_spell_bytes(w, n, t->byte_cp, s));
}

int bpe_word_ids(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    if (t->ignore_merges) {
        const int32_t id = whole_word(t, w, n);
        if (id >= 0) {
            out[0] = id;
            *k = 1;
            return QT_OK;
        }
    }
    if (n <= 8 || w[n - 1] < 0x80) return word_one(t, w, n, out, k); /* ASCII words end in ASCII */
    return word_cut(t, w, n, out, k);
}

int bpe_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t **ids, size_t *nids, size_t *cap) {
    if (!n) return QT_OK; /* bpe_word_ids wants a byte at least */
    QT_TRY(bpe_reserve(ids, NULL, NULL, *nids, cap, n + BPE_CACHE_MAX_IDS)); /* + what a cache hit copies */
    size_t k;
    QT_TRY(bpe_word_ids(t, w, n, *ids + *nids, &k));
    *nids += k;
    return QT_OK;
}
