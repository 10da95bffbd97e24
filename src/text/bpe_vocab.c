/* The vocabulary's hash table: token string (as tokenizer.json spells it)
 * to id, open addressing over a power-of-two table of bpe_str_slot, and the
 * byte-string hash it and the other tables of this folder use. The loader
 * (tokenizer.c) fills it; the encoder (bpe_merge.c), tiktoken.c and the
 * chat templates read it. */
#include "text/bpe_impl.h"

#include <string.h>

uint64_t bpe_hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x243F6A8885A308D3ull ^ (n * 0x9E3779B97F4A7C15ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w ^ ((uint64_t)n << 59)) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return h;
}

size_t bpe_pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* ---- token string -> id ---- */

int32_t bpe_str_find(const bpe_tokenizer *t, const char *s, size_t n) {
    uint64_t h = bpe_hash_bytes(s, n);
    size_t mask = t->str_cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        const bpe_str_slot *e = &t->str_tab[i];
        if (e->id < 0) return -1;
        if (e->hash == h && t->str_len[e->id] == n && !memcmp(t->tok_str[e->id], s, n)) return e->id;
    }
}

int32_t bpe_vocab_find(const bpe_tokenizer *t, const char *s, size_t n) {
    const int32_t id = bpe_str_find(t, s, n);
    return id >= 0 && !t->is_added[id] ? id : -1;
}

/* Later entries win, as when HF builds its map: added tokens override vocab. */
void bpe_str_insert(bpe_tokenizer *t, const char *s, int32_t id) {
    size_t n = strlen(s);
    uint64_t h = bpe_hash_bytes(s, n);
    size_t mask = t->str_cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        bpe_str_slot *e = &t->str_tab[i];
        if (e->id < 0 || (e->hash == h && !strcmp(t->tok_str[e->id], s))) {
            e->hash = h;
            e->id = id;
            return;
        }
    }
}
