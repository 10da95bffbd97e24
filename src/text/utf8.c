#include "text/utf8.h"

#include "core/error.h"
#include "core/mem.h"

#include <string.h>

/* Well-formed sequences, Unicode Table 3-7. The second byte's range depends
 * on the lead (E0, ED, F0, F4 are narrower), later bytes are 80..BF. */
int utf8_seq(const uint8_t *s, size_t n) {
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

size_t utf8_valid_prefix(const char *text, size_t n) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < n) {
        /* ASCII runs are most text: skip them 8 bytes at a time. */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ull) break;
            i += 8;
        }
        if (i >= n) break;
        if (s[i] < 0x80) { i++; continue; }
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
        int k = utf8_seq(s + i, n - i);
        if (k > 0) {
            memcpy(o + j, s + i, (size_t)k);
            j += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(o + j, "\xEF\xBF\xBD", 3);
            j += 3;
            i += (size_t)(-k);
        }
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
