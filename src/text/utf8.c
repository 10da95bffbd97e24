#include "text/utf8.h"

#include "core/error.h"
#include "core/mem.h"

#include <string.h>

size_t utf8_valid_prefix(const char *text, size_t n) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < n) {
        /* ASCII runs are most text: skip them 8 bytes at a time. */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            w &= 0x8080808080808080ull;
            if (w) { /* to the first non-ASCII byte (little-endian: the lowest set bit) */
                i += (size_t)__builtin_ctzll(w) / 8;
                break;
            }
            i += 8;
        }
        if (i >= n) break;
        if (s[i] < 0x80) { i++; continue; }
        /* three-byte sequences without the E0/ED range limits (CJK) */
        if (s[i] >= 0xE1 && s[i] != 0xED && s[i] <= 0xEF && i + 3 <= n) {
            uint16_t v; /* both continuation bytes at once */
            memcpy(&v, s + i + 1, 2);
            if ((v & 0xC0C0) == 0x8080) {
                i += 3;
                continue;
            }
        }
        int k = utf8_seq(s + i, n - i);
        if (k < 0) return i;
        i += (size_t)k;
    }
    return n;
}

int utf8_sanitize(const char *text, size_t n, char **out, size_t *out_len) {
    /* Worst case: every byte becomes a 3-byte U+FFFD. */
    size_t cap;
    if (!qt_mul_ok(n, 3, &cap) || cap + 1 < cap) return QT_ERR(QT_ENOMEM, "text of %zu bytes is too large to clean up", n);
    char *o = qt_malloc(cap + 1, "UTF-8 cleaned text");
    if (!o) return QT_ENOMEM;
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0, j = 0;
    while (i < n) {
        /* the valid run up to the next ill-formed byte in one copy */
        size_t v = utf8_valid_prefix(text + i, n - i);
        memcpy(o + j, s + i, v);
        i += v;
        j += v;
        if (i >= n) break;
        int k = utf8_seq(s + i, n - i); /* < 0: the maximal subpart's length */
        memcpy(o + j, "\xEF\xBF\xBD", 3);
        j += 3;
        i += (size_t)(k < 0 ? -k : k);
    }
    o[j] = 0;
    *out = o;
    *out_len = j;
    return QT_OK;
}

int utf8_encode(uint32_t cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}
