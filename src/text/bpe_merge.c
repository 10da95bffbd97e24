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

int bpe_reserve(int32_t **ids, bpe_span **spans, size_t n, size_t *cap, size_t more) {
    if (n + more <= *cap && *ids && (!spans || *spans)) return QT_OK;
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
        if (rank != BPE_NO_MERGE) heap_push(heap, &hn, (merge_cand){rank, (uint32_t)i, sym[i], sym[i + 1]});
    }
    while (hn) {
        merge_cand c = heap_pop(heap, &hn);
        int32_t p = (int32_t)c.pos, q = next[p];
        if (sym[p] != c.left || q < 0 || sym[q] != c.right) continue; /* stale */
        sym[p] = t->merge_id[c.rank];
        sym[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0) prev[next[q]] = p;
        if (prev[p] >= 0) {
            int32_t l = prev[p];
            uint32_t rank = bpe_merge_rank(t, sym[l], sym[p]);
            if (rank != BPE_NO_MERGE) heap_push(heap, &hn, (merge_cand){rank, (uint32_t)l, sym[l], sym[p]});
        }
        if (next[p] >= 0) {
            int32_t r = next[p];
            uint32_t rank = bpe_merge_rank(t, sym[p], sym[r]);
            if (rank != BPE_NO_MERGE) heap_push(heap, &hn, (merge_cand){rank, (uint32_t)p, sym[p], sym[r]});
        }
    }
    size_t k = 0;
    for (int32_t i = 0; i >= 0; i = next[i]) out[k++] = sym[i];
    return k;
}

/* ---- the cache ---- */

int bpe_cache_init(bpe_tokenizer *t) {
    for (int s = 0; s < BPE_CACHE_SHARDS; s++) {
        bpe_cache_shard *sh = &t->cache[s];
        if (pthread_mutex_init(&sh->mu, NULL)) return QT_ERR(QT_ENOMEM, "could not create the tokenizer cache's lock");
        sh->slots = qt_calloc(BPE_CACHE_SLOTS, sizeof *sh->slots, "tokenizer word cache");
        sh->arena = qt_malloc(BPE_CACHE_ARENA, "tokenizer word cache");
        if (!sh->slots || !sh->arena) return QT_ENOMEM;
    }
    return QT_OK;
}

void bpe_cache_free(bpe_tokenizer *t) {
    for (int s = 0; s < BPE_CACHE_SHARDS; s++) {
        bpe_cache_shard *sh = &t->cache[s];
        if (!sh->slots && !sh->arena) continue;
        pthread_mutex_destroy(&sh->mu);
        qt_free(sh->slots);
        qt_free(sh->arena);
    }
}

/* Looks w up; on a hit appends its ids and returns 1. */
static int cache_get(bpe_cache_shard *sh, uint64_t h, const uint8_t *w, size_t n, int32_t *out, size_t *k) {
    int hit = 0;
    if (pthread_mutex_trylock(&sh->mu)) return 0;
    for (size_t i = (h >> 20) & (BPE_CACHE_SLOTS - 1);; i = (i + 1) & (BPE_CACHE_SLOTS - 1)) {
        const bpe_cache_slot *s = &sh->slots[i];
        if (!s->nids) break;
        if (s->hash == h && s->wlen == n) {
            const uint8_t *e = sh->arena + s->off;
            if (!memcmp(e + s->nids * sizeof(int32_t), w, n)) {
                memcpy(out, e, s->nids * sizeof(int32_t));
                *k = s->nids;
                hit = 1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&sh->mu);
    return hit;
}

static void cache_put(bpe_cache_shard *sh, uint64_t h, const uint8_t *w, size_t n, const int32_t *ids, size_t k) {
    size_t need = k * sizeof(int32_t) + n;
    if (pthread_mutex_trylock(&sh->mu)) return;
    if (sh->used + need > BPE_CACHE_ARENA || sh->count >= BPE_CACHE_SLOTS / 2) { /* full: start over */
        memset(sh->slots, 0, BPE_CACHE_SLOTS * sizeof *sh->slots);
        sh->used = sh->count = 0;
    }
    size_t i = (h >> 20) & (BPE_CACHE_SLOTS - 1);
    while (sh->slots[i].nids) {
        if (sh->slots[i].hash == h && sh->slots[i].wlen == n &&
            !memcmp(sh->arena + sh->slots[i].off + sh->slots[i].nids * sizeof(int32_t), w, n)) {
            pthread_mutex_unlock(&sh->mu); /* another thread got here first */
            return;
        }
        i = (i + 1) & (BPE_CACHE_SLOTS - 1);
    }
    uint8_t *e = sh->arena + sh->used;
    memcpy(e, ids, k * sizeof(int32_t));
    memcpy(e + k * sizeof(int32_t), w, n);
    sh->slots[i] = (bpe_cache_slot){h, sh->used, (uint16_t)n, (uint16_t)k};
    sh->used += (uint32_t)need;
    sh->count++;
    pthread_mutex_unlock(&sh->mu);
}

int bpe_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t **ids, size_t *nids, size_t *cap) {
    if (!n) return QT_OK;
    QT_TRY(bpe_reserve(ids, NULL, *nids, cap, n));
    int32_t *out = *ids + *nids;
    if (n == 1) {
        out[0] = t->byte_id[w[0]];
        *nids += 1;
        return QT_OK;
    }
    uint64_t h = 0;
    bpe_cache_shard *sh = NULL;
    size_t k;
    if (n <= BPE_CACHE_MAX_WORD) {
        h = bpe_hash_bytes(w, n);
        sh = (bpe_cache_shard *)&t->cache[h % BPE_CACHE_SHARDS];
        if (cache_get(sh, h, w, n, out, &k)) {
            *nids += k;
            return QT_OK;
        }
    }
    /* Scratch for the merge loop: on the stack for ordinary words. */
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
    k = bpe_merge_word(t, w, n, out, scratch, scratch + n, scratch + 2 * n, heap);
    if (n > STACK_N) {
        qt_free(scratch);
        qt_free(heap);
    }
    if (sh) cache_put(sh, h, w, n, out, k);
    *nids += k;
    return QT_OK;
}
