/* Inside the tokenizer: the tables bpe_load builds and the pieces of the
 * encoder (tokenizer.c loads and decodes, bpe_merge.c runs merges and the
 * word cache, bpe_encode.c splits text and drives the rest). Not for other
 * modules: they use text/tokenizer.h. */
#ifndef QT_TEXT_BPE_IMPL_H
#define QT_TEXT_BPE_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"

/* One merge: the pair (left id, right id) -> (rank, merged id). Open
 * addressing on key = left << 32 | right; key UINT64_MAX marks an empty slot. */
typedef struct {
    uint64_t key;
    uint32_t rank;
    int32_t id;
} bpe_merge_slot;

/* Token string -> id (vocab and added tokens), open addressing; id -1 empty. */
typedef struct {
    uint64_t hash;
    int32_t id;
} bpe_str_slot;

typedef struct {
    char *content;   /* as in tokenizer.json */
    size_t len;
    int32_t id;
    int special, lstrip, rstrip, single_word, normalized;
} bpe_added;

/* The word cache: words (pre-tokenizer pieces) -> ids, split into shards each
 * behind its own mutex. A thread that finds a shard busy skips the cache
 * rather than wait, so encoding from many threads never serialises. A full
 * shard is emptied and refilled: memory stays bounded whatever the input. */
#define BPE_CACHE_SHARDS 16
#define BPE_CACHE_SLOTS 8192          /* per shard, power of two */
#define BPE_CACHE_ARENA (512u << 10)  /* bytes per shard for words and ids */
#define BPE_CACHE_MAX_WORD 64         /* longer words are not cached */
typedef struct {
    uint64_t hash;
    uint32_t off;   /* into arena: nids int32 ids, then the word's bytes */
    uint16_t wlen;
    uint16_t nids;  /* 0: empty slot */
} bpe_cache_slot;
typedef struct {
    pthread_mutex_t mu;
    bpe_cache_slot *slots;
    uint8_t *arena;
    uint32_t used, count;
} bpe_cache_shard;

struct bpe_tokenizer {
    int32_t n_ids;             /* highest id + 1 */
    char **tok_str;            /* (n_ids) token string as tokenizer.json spells it, NULL for a gap */
    uint32_t *tok_off;         /* (n_ids + 1) decoded bytes of id i are bytes[tok_off[i] .. tok_off[i+1]) */
    uint8_t *bytes;            /* decoded bytes of every token, back to back */
    char *str_arena;           /* storage of tok_str */

    bpe_str_slot *str_tab;     /* (str_cap) token string -> id */
    size_t str_cap;

    bpe_merge_slot *merges;    /* (merge_cap) pair -> rank, merged id */
    size_t merge_cap;
    int merge_shift;           /* 64 - log2(merge_cap) */
    size_t n_merges;

    int32_t byte_id[256];      /* id of the one-byte token for each byte */

    bpe_added *added;          /* (n_added) sorted longest first */
    size_t n_added;
    uint8_t added_first[256];  /* 1 where some added token starts with this byte */
    uint8_t *is_added;         /* (n_ids) 1 for added tokens */

    int nfc;                   /* the normalizer is NFC */
    pcre2_code *re;            /* the Split pre-tokenizer, NULL: none */
    int re_jit;                /* JIT compiled */

    bpe_cache_shard cache[BPE_CACHE_SHARDS];
    uint64_t hash;             /* of the tokenizer.json bytes */
};

/* A small, fast hash of a byte string (8 bytes a step). */
uint64_t bpe_hash_bytes(const void *p, size_t n);

/* Merged id of (left, right), or -1; rank in *rank. */
static inline int32_t bpe_merge_find(const bpe_tokenizer *t, int32_t left, int32_t right, uint32_t *rank) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t mask = t->merge_cap - 1;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> t->merge_shift);
    for (;;) {
        const bpe_merge_slot *s = &t->merges[i];
        if (s->key == key) { *rank = s->rank; return s->id; }
        if (s->key == UINT64_MAX) return -1;
        i = (i + 1) & mask;
    }
}

/* Appends the ids of one pre-tokenized word (raw bytes) to *ids. */
int bpe_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t **ids, size_t *nids, size_t *cap);
int bpe_cache_init(bpe_tokenizer *t);
void bpe_cache_free(bpe_tokenizer *t);

/* Grows *ids (and *spans when not NULL) so that `more` entries fit. */
int bpe_reserve(int32_t **ids, bpe_span **spans, size_t n, size_t *cap, size_t more);

#endif
