/* UTF-8 helpers for the tokenizer: validation with "maximal subpart"
 * replacement (the rule Python's bytes.decode(errors="replace"), JS's
 * TextDecoder and Rust's String::from_utf8_lossy all follow), and decoding one
 * code point from text already known to be valid. */
#ifndef QT_TEXT_UTF8_H
#define QT_TEXT_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Length of the well-formed sequence at s[0..n) (1..4), or, when it is
 * ill-formed, minus the length of its maximal subpart (-1..-3): the bytes one
 * U+FFFD replaces. n must be > 0. */
/* Well-formed sequences, Unicode Table 3-7. The second byte's range depends
 * on the lead (E0, ED, F0, F4 are narrower), later bytes are 80..BF. */
static inline int utf8_seq(const uint8_t *s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return -1; /* 80..C1, F5..FF never start a sequence */
    }
    for (int k = 1; k < need; k++) {
        if ((size_t)k >= n) return -k;
        uint8_t b = s[k];
        if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return -k;
    }
    return need;
}


/* Offset of the first ill-formed byte of s[0..n), or n when s is valid. */
size_t utf8_valid_prefix(const char *s, size_t n);

/* Copies s[0..n) with every ill-formed subpart replaced by U+FFFD (EF BF BD)
 * into a NUL-terminated buffer (qt_free it). */
int utf8_sanitize(const char *s, size_t n, char **out, size_t *out_len);

/* Decodes the code point at s (valid UTF-8, at least one byte left); stores
 * its length in *len. */
static inline uint32_t utf8_decode(const uint8_t *s, int *len) {
    uint8_t c = s[0];
    if (c < 0x80) { *len = 1; return c; }
    if (c < 0xE0) { *len = 2; return ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3F); }
    if (c < 0xF0) { *len = 3; return ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F); }
    *len = 4;
    return ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) | ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

/* Writes cp as UTF-8 into out (4 bytes room); returns the byte count. */
int utf8_encode(uint32_t cp, char *out);

#endif
