/* Inside the tokenizer: the tables bpe_load builds and the pieces of the
 * encoder (tokenizer.c loads and decodes, bpe_merge.c runs merges and the
 * word cache, bpe_encode.c splits text and drives the rest). Not for other
 * modules: they use text/tokenizer.h. */
#ifndef QT_TEXT_BPE_IMPL_H
#define QT_TEXT_BPE_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdatomic.h>
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
/* A direct-mapped cache of recent lookups, hits and misses alike, in front of
 * the merge table: key << 24 | rank (0xFFFFFF: no merge). Eight entries per
 * cache line instead of one, so the pairs a text keeps using stay in L2.
 * Shared by all threads: each 64-bit entry is written and read whole
 * (relaxed atomics) and carries its own key, so a race only costs a miss. */
#define BPE_PAIR_CACHE (1 << 15)
#define BPE_PAIR_NONE 0xFFFFFFu

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
 * behind its own test-and-set flag. A thread that finds a shard busy skips the cache
 * rather than wait, so encoding from many threads never serialises. A full
 * shard is emptied and refilled: memory stays bounded whatever the input. */
#define BPE_CACHE_SHARDS 16
#define BPE_CACHE_SLOTS 4096          /* per shard, power of two; half fill before a reset */
#define BPE_CACHE_MAX_WORD 26         /* longer words go to the long-word cache; words of more than 8 ids are not cached */
#define BPE_CACHE_MAX_IDS 8
/* One cache line a word: a hit reads nothing else. */
typedef struct {
    uint32_t hash;
    uint8_t wlen;
    uint8_t nids;                     /* 0: empty slot */
    uint8_t word[BPE_CACHE_MAX_WORD];
    int32_t ids[BPE_CACHE_MAX_IDS];
} bpe_cache_slot;
typedef struct {
    atomic_flag busy;                 /* taken with test-and-set, never waited on */
    bpe_cache_slot *slots;
    uint32_t count;
} bpe_cache_shard;

/* Words longer than a word-cache slot holds (in the zh-en text: runs of
 * 27-40 spaces of indented messages, and Chinese pieces no cut applies to)
 * go to a second cache of one shard with two-line slots; without it each
 * such word ran the heap merge again, about 15,000 instructions. */
#define BPE_LCACHE_SLOTS 2048         /* power of two; half fill before a reset */
#define BPE_LCACHE_MAX_WORD 58
#define BPE_LCACHE_MAX_IDS 16
typedef struct {
    uint32_t hash;
    uint8_t wlen;
    uint8_t nids;                     /* 0: empty slot */
    uint8_t word[BPE_LCACHE_MAX_WORD];
    int32_t ids[BPE_LCACHE_MAX_IDS];
} bpe_lcache_slot;
typedef struct {
    atomic_flag busy;                 /* as a shard's */
    bpe_lcache_slot *slots;
    uint32_t count;
} bpe_lcache;

/* Whole-token words, filled at load and read-only after: every token of 2 to
 * BPE_VOCAB_MAX_WORD bytes whose own bytes merge back into it alone (all of
 * Qwen3's do; a vocabulary may hold tokens whose bytes merge into others
 * first). A word is looked up here before the word cache: most English
 * words and many Chinese words are one token, and a word's first sighting
 * then costs a lookup instead of the merge loop. Open addressing, id -1
 * empty. */
#define BPE_VOCAB_MAX_WORD 23
typedef struct {
    uint32_t hash;
    int32_t id;
    uint8_t wlen;
    uint8_t word[BPE_VOCAB_MAX_WORD];
} bpe_vocab_slot;

struct bpe_tokenizer {
    struct chat_template *tmpl; /* the folder's chat template (text/chat_template.h), or NULL: ChatML */
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
    _Atomic uint64_t *pair_cache; /* (BPE_PAIR_CACHE) recent lookups, see bpe_merge_rank */
    uint64_t *span_bloom;      /* (BPE_SPAN_BLOOM / 64) see bpe_word's cuts */
    _Atomic uint64_t *span_memo; /* (1 << BPE_SPAN_MEMO_BITS) recent cut answers, see BPE_SPAN_MEMO_BITS */

    int32_t byte_id[256];      /* id of the one-byte token for each byte */

    bpe_added *added;          /* (n_added) sorted longest first */
    size_t n_added;
    uint8_t added_first[256];  /* 1 where some added token starts with this byte */
    int added_one_first;       /* the first byte when all added tokens share it, else -1 */
    uint8_t *is_added;         /* (n_ids) 1 for added tokens */

    int nfc;                   /* the normalizer is NFC */
    pcre2_code *re;            /* the Split pre-tokenizer, NULL: none */
    pcre2_code *re_anchored;   /* the same, PCRE2_ANCHORED: matches only at the start offset */
    int re_jit;                /* both JIT compiled */
    uint8_t *cp_class;         /* (BPE_CLASS_N) BPE_C_* of each code point when the regex is Qwen's, else NULL: bpe_split.c */
    uint8_t lead_l[256];       /* 1 for a lead byte whose every code point is BPE_C_L in cp_class (E5..E9: CJK) */

    bpe_cache_shard cache[BPE_CACHE_SHARDS];
    bpe_lcache lcache;         /* words of BPE_CACHE_MAX_WORD+1 .. BPE_LCACHE_MAX_WORD bytes */
    bpe_vocab_slot *vocab_words; /* (vocab_words_cap) see bpe_vocab_slot */
    size_t vocab_words_cap;    /* power of two */
    size_t n_vocab_words;      /* tokens in it */
    uint64_t hash;             /* of the tokenizer.json bytes */
    int tiktoken;              /* read from a qwen.tiktoken (tiktoken.c) */
    int ignore_merges;         /* model.ignore_merges: a word that is a vocabulary token is that token, unmerged */
    uint32_t byte_cp[256];     /* GPT-2's byte alphabet: the code point each byte is spelt with */
    size_t max_word_bytes;     /* the longest vocabulary token, in bytes (ignore_merges' lookups) */
};

/* The original Qwen's qwen.tiktoken (buf, len bytes) as the tokenizer.json
 * tree it stands for: vocab = ranks, merges = every split of a token into two
 * tokens by the token's rank, NFC, Qwen's split regex, ByteLevel, and the
 * special tokens after the ranks (tiktoken.c says why this is tiktoken's
 * rank rule). byte_to_cp: GPT-2's byte alphabet. converter_merges: instead of every
 * split, the one merge per token that llama.cpp's converter writes (GGUF export). */
struct cJSON;
int bpe_tiktoken_tree(const char *path, const char *buf, size_t len, const uint32_t byte_to_cp[256],
                      int converter_merges, struct cJSON **out);

/* Bytes p[0, n) in the ByteLevel alphabet byte_to_cp (GPT-2's), as
 * tokenizer.json spells tokens: at most 2 UTF-8 bytes each (every code point
 * is below U+0800), NUL-terminated in out. Returns the length. */
size_t bpe_spell_bytes(const uint8_t *p, size_t n, const uint32_t byte_to_cp[256], char *out);

/* A small, fast hash of a byte string (8 bytes a step; bpe_vocab.c). */
uint64_t bpe_hash_bytes(const void *p, size_t n);

static inline uint64_t bpe_merge_key(int32_t left, int32_t right) {
    return ((uint64_t)(uint32_t)left << BPE_ID_BITS) | (uint32_t)right;
}
static inline size_t bpe_merge_slot(const bpe_tokenizer *t, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> t->merge_shift);
}

/* Rank of the merge with this key, probing from slot i, or BPE_NO_MERGE.
 * The table is too big for L2, so callers that know two lookups ahead
 * prefetch both slots first and let the misses overlap. */
static inline uint32_t bpe_merge_probe(const bpe_tokenizer *t, uint64_t key, size_t i) {
    size_t mask = t->merge_cap - 1;
    for (;; i = (i + 1) & mask) {
        uint64_t s = t->merges[i];
        if ((s & BPE_KEY_MASK) == key && s != UINT64_MAX) return (uint32_t)(s >> (2 * BPE_ID_BITS));
        if (s == UINT64_MAX) return BPE_NO_MERGE;
    }
}

/* Rank of the merge of (left, right), or BPE_NO_MERGE. */
static inline uint32_t bpe_merge_rank(const bpe_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = bpe_merge_key(left, right);
    size_t c = (size_t)((key * 0xD6E8FEB86659FD93ull) >> (64 - 15));
    uint64_t e = atomic_load_explicit(&t->pair_cache[c], memory_order_relaxed);
    if ((e >> 24) == key) {
        uint32_t r = (uint32_t)(e & 0xFFFFFF);
        return r == BPE_PAIR_NONE ? BPE_NO_MERGE : r;
    }
    uint32_t r = bpe_merge_probe(t, key, bpe_merge_slot(t, key));
    atomic_store_explicit(&t->pair_cache[c], key << 24 | (r == BPE_NO_MERGE ? BPE_PAIR_NONE : r), memory_order_relaxed);
    return r;
}

/* Cutting long words. BPE never merges across a position p that no vocab
 * token spans (every merge makes a vocab token), so the word's ids are the
 * ids of the two sides, each merged on its own - and the sides are short and
 * hit the word cache. A Chinese run of 20 characters is one pre-tokenizer
 * piece; cut where no token spans, it is a handful of cached words.
 * Only boundaries between two non-ASCII characters are tried. For every
 * token and every such boundary inside it, the up-to-3 bytes either side go
 * into a Bloom filter; a boundary of the text whose every (1..3, 1..3)-byte
 * neighbourhood misses the filter is spanned by no token, certainly. */
#define BPE_SPAN_BLOOM (1u << 21) /* bits: 256 KiB */
/* The Bloom answer for a boundary is a function of the (up to) 3 bytes
 * either side; a direct-mapped memo of recent answers, entry key << 1 |
 * answer (key: lmax << 50 | rmax << 48 | left << 24 | right; UINT64_MAX
 * empty, never a key since 0xFF is no UTF-8 byte), shared by all threads
 * through relaxed atomics like the pair cache, spares the up-to-9 probes
 * for the character pairs a text keeps repeating. */
#define BPE_SPAN_MEMO_BITS 13
uint64_t bpe_span_key(const uint8_t *left, int ls, const uint8_t *right, int rs);
static inline int bpe_span_bloom_has(const uint64_t *bloom, uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    uint32_t a = (uint32_t)(h >> 43), b = (uint32_t)(h >> 22) & (BPE_SPAN_BLOOM - 1);
    return (bloom[a >> 6] >> (a & 63) & 1) && (bloom[b >> 6] >> (b & 63) & 1);
}
static inline void bpe_span_bloom_add(uint64_t *bloom, uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    uint32_t a = (uint32_t)(h >> 43), b = (uint32_t)(h >> 22) & (BPE_SPAN_BLOOM - 1);
    bloom[a >> 6] |= 1ull << (a & 63);
    bloom[b >> 6] |= 1ull << (b & 63);
}
int bpe_span_init(bpe_tokenizer *t);

/* Qwen's split regex without PCRE2 (bpe_split.c). Character classes of the
 * code points below BPE_CLASS_N, as PCRE2 sees them: */
#define BPE_CLASS_N 0x20000u
#define BPE_C_OTHER 0    /* none of the three */
#define BPE_C_L 1        /* \p{L} */
#define BPE_C_N 2        /* \p{N} */
#define BPE_C_S 3        /* [\s\x{85}] */
#define BPE_C_UNKNOWN 0xFF
extern const char bpe_qwen_pattern[]; /* the regex bpe_split_match stands for, as tokenizer.json spells it */
/* Fills t->cp_class (PCRE2 asked once per code point). */
int bpe_split_init(bpe_tokenizer *t);
/* End of the regex's match at offset i of s[0..n) (valid UTF-8, i < n, i at
 * a character), or 0 when only PCRE2 can tell. */
size_t bpe_split_match(const bpe_tokenizer *t, const uint8_t *s, size_t n, size_t i);
/* Compares bpe_split_match with PCRE2 (anchored) at every character of s:
 * QT_OK when they agree wherever the fast path answers; *checked counts
 * those offsets. For tests. */
int bpe_split_check(const bpe_tokenizer *t, const char *s, size_t n, size_t *checked);

/* Appends the ids of one pre-tokenized word (raw bytes) to *ids. */
int bpe_word(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t **ids, size_t *nids, size_t *cap);
/* The same for n >= 1 into out, which the caller has sized for n + BPE_CACHE_MAX_IDS
 * ids (a word never has more ids than bytes; a cache hit copies a slot's
 * ids whole); *k the count. The encoder grows its arrays before each piece
 * (an inline compare) and calls this. */
int bpe_word_ids(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out, size_t *k);
int bpe_cache_init(bpe_tokenizer *t);

/* Words longer than this are never looked up whole (ignore_merges): no real
 * vocabulary has a token this long. */
#define BPE_WHOLE_WORD_MAX 1024

/* The vocabulary's table (bpe_vocab.c). bpe_vocab_find: the id of the
 * vocabulary token (not an added one) whose string is s[0, n) as
 * tokenizer.json spells it, else -1; bpe_str_find the same over added tokens
 * too; bpe_str_insert adds s (later entries win, as when HF builds its map)
 * to a table of t->str_cap (bpe_pow2_at_least: a power of two >= n, from 16)
 * slots. */
int32_t bpe_vocab_find(const bpe_tokenizer *t, const char *s, size_t n);
int32_t bpe_str_find(const bpe_tokenizer *t, const char *s, size_t n);
void bpe_str_insert(bpe_tokenizer *t, const char *s, int32_t id);
size_t bpe_pow2_at_least(size_t n);
void bpe_cache_free(bpe_tokenizer *t);

/* The tokenizer's own half of bpe_load and bpe_free (tokenizer.c): the
 * vocabulary, merges and pre-tokenizer of path (a tokenizer file or the
 * folder that holds one), and the folder the tokenizer file is in (dir, cap
 * bytes), where tokenizer_folder.c then looks for the chat template; and
 * everything but the template freed. */
int bpe_load_vocab(const char *path, bpe_tokenizer **out, char *dir, size_t cap);
void bpe_free_vocab(bpe_tokenizer *t);

/* Grows *ids (and *spans, *marks when not NULL: they share *cap) so that
 * `more` entries fit. */
int bpe_grow(int32_t **ids, bpe_span **spans, uint8_t **marks, size_t n, size_t *cap, size_t more);
static inline int bpe_reserve(int32_t **ids, bpe_span **spans, uint8_t **marks, size_t n, size_t *cap, size_t more) {
    if (n + more <= *cap && *ids && (!spans || *spans) && (!marks || *marks)) return 0;
    return bpe_grow(ids, spans, marks, n, cap, more);
}

#endif
