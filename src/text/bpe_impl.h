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

/* One merge: the pair (left id, right id) -> rank, packed in 64 bits as
 * rank << 40 | left << 20 | right (ids < 2^20, ranks < 2^24 - 1: every real
 * vocabulary fits), so the table is 8 bytes a slot and stays in cache; the
 * merged id is merge_id[rank]. Open addressing; UINT64_MAX marks an empty slot.
 * Pairs of two single bytes, the most frequent lookups by far (every word
 * starts as bytes), go to a dense 256x256 table instead. */
#define BPE_ID_BITS 20
#define BPE_KEY_MASK ((1ull << (2 * BPE_ID_BITS)) - 1)
#define BPE_MAX_RANK ((1u << 24) - 2)
#define BPE_NO_MERGE UINT32_MAX

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

    uint64_t *merges;          /* (merge_cap) packed pair and rank, see above */
    size_t merge_cap;
    int merge_shift;           /* 64 - log2(merge_cap) */
    size_t n_merges;           /* merges in the file (ranks 0 .. n_merges-1) */
    int32_t *merge_id;         /* (n_merges) rank -> merged id */
    uint32_t *byte_pair;       /* (256*256) rank of (byte_id[a], byte_id[b]), BPE_NO_MERGE if none */
    uint8_t *id_byte;          /* (n_ids) the byte a one-byte token stands for, else 0 */
    uint8_t *id_is_byte;       /* (n_ids) 1 for the 256 byte tokens */
    uint32_t *str_len;         /* (n_ids) strlen of tok_str */

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

/* Rank of the merge of (left, right), or BPE_NO_MERGE. */
static inline uint32_t bpe_merge_rank(const bpe_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << BPE_ID_BITS) | (uint32_t)right;
    size_t mask = t->merge_cap - 1;
    for (size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> t->merge_shift);; i = (i + 1) & mask) {
        uint64_t s = t->merges[i];
        if ((s & BPE_KEY_MASK) == key && s != UINT64_MAX) return (uint32_t)(s >> (2 * BPE_ID_BITS));
        if (s == UINT64_MAX) return BPE_NO_MERGE;
    }
}

/* Appends the ids of one pre-tokenized word (raw bytes) to *ids. */
int bpe_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t **ids, size_t *nids, size_t *cap);
int bpe_cache_init(bpe_tokenizer *t);
void bpe_cache_free(bpe_tokenizer *t);

/* Grows *ids (and *spans when not NULL) so that `more` entries fit. */
int bpe_reserve(int32_t **ids, bpe_span **spans, size_t n, size_t *cap, size_t more);

#endif
