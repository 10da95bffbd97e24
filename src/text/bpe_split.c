/* A hand-written matcher for Qwen's split regex, in front of PCRE2.
 *
 * Qwen2, Qwen2.5 and Qwen3 all split with
 *
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *
 * (\s widened to [\s\x{85}] as in tokenizer.c). PCRE2 stays the definition:
 * split_match answers only when it is certain to give PCRE2's match at the
 * given offset, and returns 0 ("ask PCRE2") otherwise. Certain means every
 * character it looks at is in the class table and the case-insensitive
 * contractions are followed by ASCII. The class table (letter, number,
 * space, for every code point below BPE_CLASS_N) is filled at load by
 * PCRE2 itself, with the same flags, so \p{L}, \p{N} and \s here are PCRE2's
 * to the code point.
 *
 * Each alternative, first success wins (what PCRE2's backtracking yields):
 *   1. ' followed by s t m d (either case): 2 bytes; re ve ll: 3 bytes.
 *   2. x? L+ : at a letter, the run of letters; else at one character that is
 *      not \r \n letter or number, followed by a letter: it and that run.
 *   3. one number.
 *   4. " "? O+ [\r\n]* (O: not space, letter, number): an optional U+0020
 *      before a run of O, then any \r and \n after it.
 *   5. \s* [\r\n]+ : in a run of spaces [i, j) that holds \r or \n, up to and
 *      including the last of them (\s* gives back until [\r\n]+ fits; the
 *      character after the last one is not \r \n, so the + stops there).
 *   6. \s+ (?!\S) : the run when it ends the text; else the run less its last
 *      character, when the run has two or more.
 *   7. \s+ : the run (one character). */
#include "text/bpe_impl.h"

#include "core/error.h"
#include "core/mem.h"

#include <string.h>

const char bpe_qwen_pattern[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

int bpe_split_init(bpe_tokenizer *t) {
    /* the three classes, asked of PCRE2 one code point at a time */
    int err;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) "(\\p{L})|(\\p{N})|([\\s\\x{85}])", PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &err, &erroff, NULL);
    if (!re) return QT_ERR(QT_EINVAL, "the tokenizer's character-class regex does not compile (PCRE2 error %d)", err);
    int jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    t->cp_class = qt_malloc(BPE_CLASS_N, "tokenizer character classes");
    if (!md || !t->cp_class) {
        if (md) pcre2_match_data_free(md);
        pcre2_code_free(re);
        return QT_ENOMEM;
    }
    int rc = QT_OK;
    for (uint32_t cp = 0; cp < BPE_CLASS_N && rc == QT_OK; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) { /* not characters: never in valid UTF-8 */
            t->cp_class[cp] = BPE_C_UNKNOWN;
            continue;
        }
        uint8_t u[4];
        size_t l = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        if (l == 1) u[0] = (uint8_t)cp;
        else if (l == 2) u[0] = (uint8_t)(0xC0 | cp >> 6), u[1] = (uint8_t)(0x80 | (cp & 0x3F));
        else if (l == 3) u[0] = (uint8_t)(0xE0 | cp >> 12), u[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)), u[2] = (uint8_t)(0x80 | (cp & 0x3F));
        else u[0] = (uint8_t)(0xF0 | cp >> 18), u[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F)), u[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)),
             u[3] = (uint8_t)(0x80 | (cp & 0x3F));
        int m = jit ? pcre2_jit_match(re, u, l, 0, 0, md, NULL) : pcre2_match(re, u, l, 0, 0, md, NULL);
        uint8_t c = 0;
        if (m > 1) { /* m - 1 is the highest group that took part: the alternative that matched */
            if (m == 2) c = BPE_C_L;
            else if (m == 3) c = BPE_C_N;
            else if (m == 4) c = BPE_C_S;
        } else if (m != PCRE2_ERROR_NOMATCH) {
            c = BPE_C_UNKNOWN; /* PCRE2 could not say: leave this character to PCRE2 */
        }
        t->cp_class[cp] = c;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    /* Lead bytes all of whose code points are letters: a run of letters
     * steps over such a character by its length without decoding it (Han
     * text is E4..E9 leads). Read off the table just filled, so it says
     * what PCRE2 says. Ranges that reach past the table stay 0. */
    memset(t->lead_l, 0, sizeof t->lead_l);
    for (uint32_t b = 0xC2; b <= 0xF4 && rc == QT_OK; b++) {
        uint32_t lo = b < 0xE0 ? (b & 0x1F) << 6 : b < 0xF0 ? (b & 0x0F) << 12 : (b & 0x07) << 18;
        uint32_t hi = lo + (b < 0xE0 ? 0x40u : b < 0xF0 ? 0x1000u : 0x40000u);
        if (b == 0xE0) lo = 0x800;     /* E0 80..9F would be overlong: never in valid UTF-8 */
        if (b == 0xF0) lo = 0x10000;
        if (hi > BPE_CLASS_N) continue;
        uint8_t all = 1;
        for (uint32_t cp = lo; cp < hi && all; cp++) all = t->cp_class[cp] == BPE_C_L;
        t->lead_l[b] = all;
    }
    return rc;
}

/* Code point at s[i] (valid UTF-8) and its class; *l its length. */
static inline uint8_t cls_at(const uint8_t *cc, const uint8_t *s, size_t i, size_t *l) {
    uint32_t b = s[i];
    if (b < 0x80) {
        *l = 1;
        return cc[b];
    }
    uint32_t cp;
    if (b < 0xE0) {
        cp = (b & 0x1F) << 6 | (s[i + 1] & 0x3F);
        *l = 2;
    } else if (b < 0xF0) {
        cp = (b & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3F);
        *l = 3;
    } else {
        cp = (b & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 | (uint32_t)(s[i + 2] & 0x3F) << 6 | (s[i + 3] & 0x3F);
        *l = 4;
    }
    return cp < BPE_CLASS_N ? cc[cp] : BPE_C_UNKNOWN;
}

/* End of the run of characters of class `want` from i (0: "other", neither
 * letter, number nor space); 0 when an unknown character is met. */
static inline size_t run_end(const bpe_tokenizer *t, const uint8_t *s, size_t n, size_t i, uint8_t want) {
    const uint8_t *cc = t->cp_class;
    while (i < n) {
        uint8_t b = s[i];
        if (b < 0x80) {
            if (cc[b] != want) return i;
            i++;
            continue;
        }
        if (want == BPE_C_L && t->lead_l[b]) { /* a letter whatever follows the lead */
            i += 2 + (b >= 0xE0) + (b >= 0xF0);
            continue;
        }
        size_t l;
        uint8_t c = cls_at(cc, s, i, &l);
        if (c == BPE_C_UNKNOWN) return 0;
        if (c != want) return i;
        i += l;
    }
    return n;
}

size_t bpe_split_match(const bpe_tokenizer *t, const uint8_t *s, size_t n, size_t i) {
    const uint8_t *cc = t->cp_class;
    uint8_t b = s[i];
    /* 1. contractions */
    if (b == '\'' && i + 1 < n) {
        uint8_t c1 = s[i + 1];
        if (c1 >= 0x80) return 0; /* (?i) folds some non-ASCII letters (U+017F is an s) */
        c1 |= 0x20;
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
        if (c1 == 'r' || c1 == 'v' || c1 == 'l') {
            if (i + 2 >= n) goto not_contraction;
            uint8_t c2 = s[i + 2];
            if (c2 >= 0x80) return 0;
            if ((c2 | 0x20) == (c1 == 'l' ? 'l' : 'e')) return i + 3;
        }
    }
not_contraction:;
    size_t l0;
    uint8_t c0 = cls_at(cc, s, i, &l0);
    if (c0 == BPE_C_UNKNOWN) return 0;
    /* 2. x? L+ */
    if (c0 == BPE_C_L) return run_end(t, s, n, i, BPE_C_L);
    if (c0 != BPE_C_N && b != '\r' && b != '\n' && i + l0 < n) {
        size_t l1;
        uint8_t c1 = cls_at(cc, s, i + l0, &l1);
        if (c1 == BPE_C_UNKNOWN) return 0;
        if (c1 == BPE_C_L) return run_end(t, s, n, i + l0, BPE_C_L);
    }
    /* 3. \p{N} */
    if (c0 == BPE_C_N) return i + l0;
    /* 4. " "? O+ [\r\n]* */
    size_t o = i;
    if (b == ' ' && i + 1 < n) {
        size_t l1;
        uint8_t c1 = cls_at(cc, s, i + 1, &l1);
        if (c1 == BPE_C_UNKNOWN) return 0;
        if (c1 == 0) o = i + 1;
    }
    if (o > i || c0 == 0) {
        size_t e = run_end(t, s, n, o, 0);
        if (!e) return 0;
        while (e < n && (s[e] == '\r' || s[e] == '\n')) e++;
        return e;
    }
    /* 5-7: c0 is a space; the run of spaces [i, j), its last character at lastc */
    size_t j = i, lastc = i, last_nl = SIZE_MAX;
    while (j < n) {
        size_t l;
        uint8_t c = cls_at(cc, s, j, &l);
        if (c == BPE_C_UNKNOWN) return 0;
        if (c != BPE_C_S) break;
        if (s[j] == '\r' || s[j] == '\n') last_nl = j;
        lastc = j;
        j += l;
    }
    if (last_nl != SIZE_MAX) return last_nl + 1;   /* 5 */
    if (j == n) return n;                          /* 6, at the end */
    if (lastc > i) return lastc;                   /* 6, the last space given back */
    return j;                                      /* 7 */
}

int bpe_split_check(const bpe_tokenizer *t, const char *s, size_t n, size_t *checked) {
    *checked = 0;
    if (!t->cp_class || !t->re_anchored) return QT_OK;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return QT_ENOMEM;
    int rc = QT_OK;
    for (size_t i = 0; i < n && rc == QT_OK; i++) {
        if (((const uint8_t *)s)[i] >= 0x80 && ((const uint8_t *)s)[i] < 0xC0) continue; /* not a character start */
        size_t fast = bpe_split_match(t, (const uint8_t *)s, n, i);
        if (!fast) continue;
        int m = pcre2_match(t->re_anchored, (PCRE2_SPTR)s, n, i, PCRE2_NO_UTF_CHECK, md, NULL);
        size_t want = m > 0 ? pcre2_get_ovector_pointer(md)[1] : 0;
        if (m <= 0 || want != fast)
            rc = QT_ERR(QT_EINVAL, "split fast path disagrees with PCRE2 at byte %zu: %zu vs %zu", i, fast, want);
        (*checked)++;
    }
    pcre2_match_data_free(md);
    return rc;
}
