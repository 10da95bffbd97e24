/* Text -> ids, in HF's order:
 *   1. invalid UTF-8 -> U+FFFD (what Python's str hands HF),
 *   2. split on added tokens (leftmost, longest first), which become their ids,
 *   3. each stretch between them: NFC, then the Split regex (Isolated: every
 *      match and every gap is a piece),
 *   4. each piece: ByteLevel (we work on the raw bytes the alphabet stands
 *      for) and BPE merges (bpe_merge.c). */
#include "text/bpe_impl.h"
#include "text/utf8.h"

#include "core/error.h"
#include "core/mem.h"
#include "core/strbuf.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Code points NFC never alters and that never combine with what precedes
 * them (ccc 0, no canonical decomposition, not the second half of any
 * composition): ASCII and Latin-1 (< U+0300), general punctuation after the
 * two quad spaces (which decompose), CJK ideographs, CJK punctuation before
 * the tone marks, half/fullwidth forms, the emoji blocks. A text is
 * NFC-split at any of them: NFC(a + x + b) == NFC(a) + NFC(x + b). */
static inline int nfc_inert(uint32_t cp) {
    return cp < 0x300 || (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) || (cp >= 0x2002 && cp <= 0x206F) ||
           (cp >= 0x3000 && cp <= 0x3029) || (cp >= 0xFF00 && cp <= 0xFFEF) || (cp >= 0x1F300 && cp <= 0x1FAFF);
}

/* Lead bytes all of whose characters are inert, by nfc_inert's ranges:
 * C2..CB start U+0080..U+02FF (below U+0300), E5..E9 start U+5000..U+9FFF
 * (CJK ideographs). Such a character is stepped over without decoding. */
static inline int nfc_lead_inert(uint8_t b) { return (b >= 0xC2 && b <= 0xCB) || (b >= 0xE5 && b <= 0xE9); }

/* n when every code point of s[0..n) is inert (NFC changes nothing), else
 * where NFC work starts: the character before the first non-inert one. */
static size_t nfc_scan(const uint8_t *s, size_t n) {
    size_t i = 0, prev = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            /* ASCII: 8 bytes a step, then to the last ASCII byte of the run */
            size_t j = i + 1;
            while (j + 8 <= n) {
                uint64_t w;
                memcpy(&w, s + j, 8);
                w &= 0x8080808080808080ull;
                if (w) {
                    j += (size_t)__builtin_ctzll(w) / 8;
                    goto ascii_end;
                }
                j += 8;
            }
            while (j < n && s[j] < 0x80) j++;
        ascii_end:
            prev = j - 1;
            i = j;
            continue;
        }
        if (nfc_lead_inert(s[i])) {
            prev = i;
            i += s[i] >= 0xE0 ? 3 : 2;
            continue;
        }
        int l;
        uint32_t cp = utf8_decode(s + i, &l);
        if (!nfc_inert(cp)) return prev < i ? prev : i;
        prev = i;
        i += (size_t)l;
    }
    return n;
}

static int nfc_region(const char *s, size_t n, char **out, size_t *out_len) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (r < 0) return QT_ERR(QT_EINVAL, "NFC normalisation failed: %s", utf8proc_errmsg(r));
    *out = (char *)dst; /* malloc'd by utf8proc: release with free() */
    *out_len = (size_t)r;
    return QT_OK;
}


/* NFC of s[0..n) into a qt_malloc'd buffer. Only the runs of code points
 * that are not inert go through utf8proc, each with the inert character just
 * before it (which may compose with them); everything else is copied. */
static int nfc(const char *s, size_t n, size_t from, char **out, size_t *out_len) {
    /* sized once for the usual case (NFC rarely lengthens a text much): a
     * buffer doubled from 64 bytes for a megabyte stretch costs more in
     * realloc than the normalisation itself */
    qt_strbuf o = {qt_malloc(n + n / 8 + 64, "NFC text"), 0, n + n / 8 + 64};
    if (!o.p) return QT_ENOMEM;
    int rc = qt_strbuf_put(&o, "", 0);
    const uint8_t *u = (const uint8_t *)s;
    size_t copied = 0, i = from, last_inert = SIZE_MAX; /* s[0..from) is inert: nfc_scan */
    while (i < n && rc == QT_OK) {
        int l = 1;
        if (u[i] < 0x80) { /* ASCII: 8 bytes a step, as in nfc_scan */
            while (i + 9 <= n) {
                uint64_t w;
                memcpy(&w, u + i + 1, 8);
                if (w & 0x8080808080808080ull) break;
                i += 8;
            }
            last_inert = i++;
            continue;
        }
        uint32_t cp = utf8_decode(u + i, &l);
        if (nfc_inert(cp)) {
            last_inert = i;
            i += (size_t)l;
            continue;
        }
        size_t a = last_inert != SIZE_MAX && last_inert >= copied ? last_inert : i, b = i + (size_t)l;
        while (b < n) {
            int l2 = 1;
            uint32_t c2 = u[b] < 0x80 ? u[b] : utf8_decode(u + b, &l2);
            if (nfc_inert(c2)) break;
            b += (size_t)l2;
        }
        char *norm = NULL;
        size_t nn = 0;
        rc = qt_strbuf_put(&o, s + copied, a - copied);
        if (rc == QT_OK) rc = nfc_region(s + a, b - a, &norm, &nn);
        if (rc == QT_OK) {
            rc = qt_strbuf_put(&o, norm, nn);
            free(norm);
        }
        copied = i = b;
        last_inert = SIZE_MAX;
    }
    if (rc == QT_OK) rc = qt_strbuf_put(&o, s + copied, n - copied);
    if (rc != QT_OK) {
        qt_free(o.p);
        return rc;
    }
    *out = o.p;
    *out_len = o.n;
    return QT_OK;
}

static int is_space_cp(uint32_t cp) {
    if (cp == ' ' || (cp >= 9 && cp <= 13) || cp == 0x85) return 1;
    if (cp < 0x80) return 0;
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

static int is_word_cp(uint32_t cp) {
    if (cp < 0x80) return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

/* Code point that ends at s[end) (valid UTF-8, end > 0); *l its length. */
static uint32_t cp_before(const uint8_t *s, size_t end, int *l) {
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xC0) == 0x80 && end - i < 4) i--;
    return utf8_decode(s + i, l);
}

typedef struct {
    size_t start, end; /* what the match swallows, lstrip/rstrip spaces included */
    int32_t id;
} added_match;

/* The first added token in s[from..n), leftmost then longest. */
static int find_added(const bpe_tokenizer *t, const uint8_t *s, size_t n, size_t from, size_t floor, added_match *m) {
    for (size_t i = from; i < n; i++) {
        if (t->added_one_first >= 0) { /* Qwen's all start with '<': let memchr skip ahead */
            const uint8_t *q = memchr(s + i, t->added_one_first, n - i);
            if (!q) return 0;
            i = (size_t)(q - s);
        } else if (!t->added_first[s[i]]) {
            continue;
        }
        for (size_t k = 0; k < t->n_added; k++) {
            const bpe_added *a = &t->added[k];
            if (a->len > n - i || (uint8_t)a->content[0] != s[i] || memcmp(a->content, s + i, a->len)) continue;
            size_t st = i, en = i + a->len;
            int l;
            if (a->single_word && ((st > 0 && is_word_cp(cp_before(s, st, &l))) || (en < n && is_word_cp(utf8_decode(s + en, &l)))))
                continue;
            if (a->lstrip)
                while (st > floor) {
                    uint32_t cp = cp_before(s, st, &l);
                    if (!is_space_cp(cp)) break;
                    st -= (size_t)l;
                }
            if (a->rstrip)
                while (en < n) {
                    uint32_t cp = utf8_decode(s + en, &l);
                    if (!is_space_cp(cp)) break;
                    en += (size_t)l;
                }
            *m = (added_match){st, en, a->id};
            return 1;
        }
    }
    return 0;
}

typedef struct {
    const bpe_tokenizer *t;
    int32_t **ids;
    bpe_span **spans; /* NULL: not wanted */
    uint8_t **marks;  /* NULL: not wanted; else 1 where a token's span overlaps a region */
    size_t *n, *cap;
    int exact;        /* offsets in the work text equal offsets in the caller's */
    int want_spans;   /* spans or marks */
    size_t text_len;  /* of the caller's text */
    const bpe_span *regs; /* (nregs) sorted, disjoint: what marks are set for */
    size_t nregs, reg;    /* reg: the first region a later token may overlap */
    pcre2_match_data *md;
} enc_ctx;

/* Token k's span [start, end): stored, and/or its mark set. Spans come in
 * increasing order, so one cursor walks the regions. */
static inline void put_span(enc_ctx *c, size_t k, size_t start, size_t end) {
    if (c->spans) (*c->spans)[k] = (bpe_span){start, end};
    if (c->marks) {
        while (c->reg < c->nregs && c->regs[c->reg].end <= start) c->reg++;
        (*c->marks)[k] = c->reg < c->nregs && start < c->regs[c->reg].end && end > c->regs[c->reg].start;
    }
}

/* Spans of ids k0 .. *c->n: each token's bytes in turn from base when
 * exact, else the whole range [rs, re). */
static void piece_spans(enc_ctx *c, size_t k0, size_t base, int exact, size_t rs, size_t re) {
    size_t off = base;
    for (size_t k = k0; k < *c->n; k++) {
        int32_t id = (*c->ids)[k];
        size_t len = c->t->tok_off[id + 1] - c->t->tok_off[id];
        if (exact) put_span(c, k, off, off + len);
        else put_span(c, k, rs, re);
        off += len;
    }
}

/* Ids of one piece (and their spans when wanted). Inline: it runs once a
 * piece, some 180,000 times a megabyte. */
static inline __attribute__((always_inline)) int encode_piece(enc_ctx *c, const uint8_t *p, size_t n, size_t base, int exact,
                                                              size_t rs, size_t re) {
    size_t k0 = *c->n, nk;
    /* room: the caller's stretch_room */
    QT_TRY(bpe_word_ids(c->t, p, n, *c->ids + k0, &nk));
    *c->n += nk;
    if (c->want_spans) piece_spans(c, k0, base, exact, rs, re);
    return QT_OK;
}

/* Makes room for the ids of the stretch's bytes [off, e) and on, unless
 * already made (*room_to >= e). No piece has more ids than bytes, so room
 * for (to - off) ids + the ids a word-cache hit copies whole past the end
 * covers every piece that ends by `to`. Made in chunks of ROOM_CHUNK bytes:
 * one compare a piece, and arrays the size of the output, not the text
 * (spans are 16 bytes an id). */
#define ROOM_CHUNK ((size_t)1 << 16)
static inline int stretch_room(enc_ctx *c, size_t off, size_t e, size_t n, size_t *room_to) {
    if (e <= *room_to) return QT_OK;
    size_t to = n - e > ROOM_CHUNK ? e + ROOM_CHUNK : n;
    QT_TRY(bpe_reserve(c->ids, c->spans, c->marks, *c->n, c->cap, to - off + BPE_CACHE_MAX_IDS));
    *room_to = to;
    return QT_OK;
}

/* A stretch of text between added tokens: NFC, then the regex, then BPE. */
static int encode_stretch(enc_ctx *c, const char *s, size_t n, size_t base) {
    if (!n) return QT_OK;
    const bpe_tokenizer *t = c->t;
    char *norm = NULL;
    int exact = c->exact;
    size_t orig_n = n;
    size_t from = t->nfc ? nfc_scan((const uint8_t *)s, n) : n;
    if (from < n) {
        size_t nn = 0;
        QT_TRY(nfc(s, n, from, &norm, &nn));
        if (nn != n || memcmp(norm, s, n)) {
            s = norm;
            exact = 0;
        }
        n = nn;
    }
    /* the range every token gets when offsets are not exact */
    size_t rs = c->exact ? base : 0, re = c->exact ? base + orig_n : c->text_len;
    int rc = QT_OK;
    size_t room_to = 0; /* see stretch_room */
    if (!t->re) {
        rc = stretch_room(c, 0, n, n, &room_to);
        if (rc == QT_OK) rc = encode_piece(c, (const uint8_t *)s, n, base, exact, rs, re);
    } else {
        size_t off = 0;
        while (off < n && rc == QT_OK) {
            if (t->cp_class) { /* Qwen's regex: bpe_split.c answers for most offsets */
                size_t e = bpe_split_match(t, (const uint8_t *)s, n, off);
                if (e) {
                    rc = stretch_room(c, off, e, n, &room_to);
                    if (rc == QT_OK) rc = encode_piece(c, (const uint8_t *)s + off, e - off, base + off, exact, rs, re);
                    off = e;
                    continue;
                }
            }
            /* Try a match right at off first (the anchored copy skips the
             * search for a start); only when there is none, search on. The
             * leftmost match is the same either way. */
            int m = t->re_jit ? pcre2_jit_match(t->re_anchored, (PCRE2_SPTR)s, n, off, 0, c->md, NULL) : PCRE2_ERROR_JIT_STACKLIMIT;
            if (m == PCRE2_ERROR_JIT_STACKLIMIT || m == PCRE2_ERROR_NOMATCH) {
                m = t->re_jit ? pcre2_jit_match(t->re, (PCRE2_SPTR)s, n, off, 0, c->md, NULL) : PCRE2_ERROR_JIT_STACKLIMIT;
                if (m == PCRE2_ERROR_JIT_STACKLIMIT)
                    m = pcre2_match(t->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, c->md, NULL);
            }
            if (m == PCRE2_ERROR_NOMATCH) {
                rc = stretch_room(c, off, n, n, &room_to);
                if (rc == QT_OK) rc = encode_piece(c, (const uint8_t *)s + off, n - off, base + off, exact, rs, re);
                break;
            }
            if (m < 0) {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(m, msg, sizeof msg);
                rc = QT_ERR(QT_EINVAL, "the tokenizer's split regex failed on the text (%s)", (char *)msg);
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
            size_t ms = ov[0], me = ov[1];
            if (ms > off) {
                rc = stretch_room(c, off, ms, n, &room_to);
                if (rc == QT_OK) rc = encode_piece(c, (const uint8_t *)s + off, ms - off, base + off, exact, rs, re);
            }
            if (me == ms) { /* an empty match: step one character so the loop moves */
                int l;
                if (me >= n) break;
                utf8_decode((const uint8_t *)s + me, &l);
                me += (size_t)l;
            }
            if (rc == QT_OK) rc = stretch_room(c, ms, me, n, &room_to);
            if (rc == QT_OK) rc = encode_piece(c, (const uint8_t *)s + ms, me - ms, base + ms, exact, rs, re);
            off = me;
        }
    }
    qt_free(norm);
    return rc;
}

/* bpe_encode, bpe_encode_spans and bpe_encode_marked: spans and marks are
 * each NULL when not wanted. */
static int encode_text(const bpe_tokenizer *t, const char *text, size_t len, int32_t **ids, bpe_span **spans,
                       uint8_t **marks, const bpe_span *regs, size_t nregs, size_t *n, size_t *cap) {
    if (!text && len) return QT_ERR(QT_EINVAL, "bpe_encode: text is NULL");
    char *clean = NULL;
    const char *s = text;
    size_t sl = len;
    if (utf8_valid_prefix(text, len) != len) {
        QT_TRY(utf8_sanitize(text, len, &clean, &sl));
        s = clean;
    }
    enc_ctx c = {.t = t, .ids = ids, .spans = spans, .marks = marks, .n = n, .cap = cap, .exact = clean == NULL,
                 .want_spans = spans || marks, .text_len = len, .regs = regs, .nregs = nregs};
    {   /* Both arrays exist from here on (stretch_room then only compares
         * with *cap), sized for a token per 3 bytes, which most text does
         * not exceed (3.4-3.9 bytes a token in the benchmark texts): growing
         * by doubling copied the ids over and over. */
        int rc = bpe_reserve(ids, spans, marks, *n, cap, 16 + sl / 3);
        if (rc != QT_OK) {
            qt_free(clean);
            return rc;
        }
    }
    if (t->re) {
        c.md = pcre2_match_data_create(1, NULL);
        if (!c.md) {
            qt_free(clean);
            return QT_ERR(QT_ENOMEM, "out of memory for the tokenizer's regex match data");
        }
    }
    int rc = QT_OK;
    size_t pos = 0;
    while (rc == QT_OK && pos <= sl) {
        added_match m;
        if (!t->n_added || !find_added(t, (const uint8_t *)s, sl, pos, pos, &m)) {
            rc = encode_stretch(&c, s + pos, sl - pos, pos);
            break;
        }
        rc = encode_stretch(&c, s + pos, m.start - pos, pos);
        if (rc == QT_OK) rc = bpe_reserve(ids, spans, marks, *n, cap, 1);
        if (rc == QT_OK) {
            (*ids)[*n] = m.id;
            if (c.exact) put_span(&c, *n, m.start, m.end);
            else put_span(&c, *n, 0, len);
            (*n)++;
        }
        pos = m.end;
    }
    if (c.md) pcre2_match_data_free(c.md);
    qt_free(clean);
    return rc;
}

int bpe_encode_spans(const bpe_tokenizer *t, const char *text, size_t len, int32_t **ids, bpe_span **spans, size_t *n,
                     size_t *cap) {
    return encode_text(t, text, len, ids, spans, NULL, NULL, 0, n, cap);
}

int bpe_encode_marked(const bpe_tokenizer *t, const char *text, size_t len, const bpe_span *regions, size_t n_regions,
                      int32_t **ids, uint8_t **marks, size_t *n, size_t *cap) {
    return encode_text(t, text, len, ids, NULL, marks, regions, n_regions, n, cap);
}

int bpe_encode(const bpe_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n, size_t *cap) {
    return encode_text(t, text, len, ids, NULL, NULL, NULL, 0, n, cap);
}

int bpe_cut_before_added(const bpe_tokenizer *t, const char *a, size_t na, const char *b, size_t nb) {
    /* the token the scan matches at b: the first, longest, whose content b starts with */
    const bpe_added *at = NULL;
    for (size_t k = 0; k < t->n_added && !at; k++) {
        const bpe_added *x = &t->added[k];
        if (x->len > nb) {
            if (!memcmp(x->content, b, nb)) return 0; /* might match past what b shows */
        } else if (!memcmp(x->content, b, x->len)) {
            at = x;
        }
    }
    if (!at || at->lstrip || at->rstrip || at->single_word) return 0;
    /* no token that begins in a's last bytes reaches into b */
    for (size_t k = 0; k < t->n_added; k++) {
        const bpe_added *x = &t->added[k];
        for (size_t j = 1; j < x->len && j <= na; j++) {
            size_t rest = x->len - j;
            if (!memcmp(x->content, a + na - j, j) && !memcmp(x->content + j, b, rest < nb ? rest : nb)) return 0;
        }
    }
    return 1;
}

int bpe_is_normal(const bpe_tokenizer *t, const char *text, size_t len) {
    if (utf8_valid_prefix(text, len) != len) return 0;
    return !t->nfc || nfc_scan((const uint8_t *)text, len) == len; /* inert as a whole: every stretch is */
}

int bpe_normalize(const bpe_tokenizer *t, const char *text, size_t len, char **out, size_t *out_len) {
    char *clean = NULL;
    const char *s = text;
    size_t sl = len;
    if (utf8_valid_prefix(text, len) != len) {
        QT_TRY(utf8_sanitize(text, len, &clean, &sl));
        s = clean;
    }
    qt_strbuf o = {0};
    int rc = qt_strbuf_put(&o, "", 0);
    size_t pos = 0;
    /* as the encoder does: added tokens are split off first and kept as they are */
    while (rc == QT_OK && pos <= sl) {
        added_match m;
        int found = t->n_added && find_added(t, (const uint8_t *)s, sl, pos, pos, &m);
        size_t end = found ? m.start : sl;
        size_t from = t->nfc ? nfc_scan((const uint8_t *)s + pos, end - pos) : end - pos;
        if (from < end - pos) {
            char *norm = NULL;
            size_t nn = 0;
            rc = nfc(s + pos, end - pos, from, &norm, &nn);
            if (rc == QT_OK) rc = qt_strbuf_put(&o, norm, nn);
            qt_free(norm);
        } else {
            rc = qt_strbuf_put(&o, s + pos, end - pos);
        }
        if (!found) break;
        if (rc == QT_OK) rc = qt_strbuf_put(&o, s + m.start, m.end - m.start);
        pos = m.end;
    }
    qt_free(clean);
    if (rc != QT_OK) {
        qt_free(o.p);
        return rc;
    }
    *out = o.p;
    *out_len = o.n;
    return QT_OK;
}
