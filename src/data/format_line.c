/* One line of a dataset to tokens (format.h's dl_encode_line): a long line
 * of a plain shape is read here without cJSON's per-element memory or string
 * copies; any other line, and a long one that is not of a plain shape
 * (FAST_NO), is parsed by cJSON and encoded by format.c's readers. What the
 * long-line readers accept, and every message, is what the cJSON path
 * gives. */
#include "data/format.h"
#include "data/format_internal.h"
#include "core/error.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"

#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------
 * long pre-tokenized lines without a cJSON node per id
 *
 * cJSON spends about 80 bytes of memory per array element: a 60 MB line of
 * input_ids cost a gigabyte. A long line of the tokens format is read here
 * instead, straight into the token buffer (5 bytes per id, plus 4 per label
 * while they are checked). Only the plain shape is taken: an object whose
 * "input_ids" and "labels" are arrays of plain integers (no fraction, no
 * exponent); its other values are parsed one at a time by cJSON. Anything
 * else (a duplicate key, an escaped key, another number spelling) returns
 * FAST_NO and the line takes the cJSON path, so what is accepted and every
 * message stay the same. */

enum { FAST_NO = 1 };
#define FAST_MIN_LINE ((size_t)64 << 10) /* shorter lines: cJSON, which is cheap there */

static const char *fast_ws(const char *p, const char *e) {
    while (p < e && (unsigned char)*p <= 32) p++; /* cJSON's rule for white space */
    return p;
}

/* A plain integer at p: '-'? digits. Returns its end, or NULL. */
static const char *fast_int(const char *p, const char *e, double *v) {
    const char *q = p;
    if (q < e && *q == '-') q++;
    const char *d = q;
    while (q < e && *q >= '0' && *q <= '9') q++;
    if (q == d || q - p > 24 || (q < e && (*q == '.' || *q == 'e' || *q == 'E' || *q == '+'))) return NULL;
    char buf[32];
    memcpy(buf, p, (size_t)(q - p));
    buf[q - p] = 0;
    *v = strtod(buf, NULL); /* as cJSON reads numbers */
    return q;
}

/* The first value of an array that check_id refuses: it is reported only
 * once the whole line is known to be valid JSON, in encode_tokens' order. */
typedef struct {
    size_t at; /* SIZE_MAX: none */
    double v;
} fast_bad;

/* "[" ints "]" at p into out (input_ids: ids and mask 1) or into *labs; values
 * are not checked here (a refused one is kept in *bad, stored as 0). */
static int fast_array(const char **pp, const char *e, double lo, double hi, dl_tokbuf *out, int32_t **labs,
                      size_t *nlabs, fast_bad *bad) {
    const char *p = *pp;
    bad->at = SIZE_MAX;
    if (p >= e || *p != '[') return FAST_NO;
    p = fast_ws(p + 1, e);
    size_t n = 0, cap = 0;
    int32_t *l = NULL;
    int rc = QT_OK;
    if (p < e && *p == ']') p++;
    else
        for (;;) {
            double v;
            const char *q = fast_int(p, e, &v);
            if (!q || n >= (size_t)INT32_MAX) { rc = FAST_NO; break; }
            int32_t x = 0;
            if (v >= lo && v < hi) x = (int32_t)v; /* plain integers: whole and finite */
            else if (bad->at == SIZE_MAX) bad->at = n, bad->v = v;
            if (!labs) {
                rc = dl_tokbuf_reserve(out, 1);
                if (rc != QT_OK) break;
                out->ids[out->n] = x; /* counted in out->n at once: reserve grows from it */
                out->mask[out->n] = 1;
                out->n++;
                n++;
            } else {
                if (n == cap) {
                    size_t c = cap ? cap * 2 : 1024;
                    int32_t *g = qt_realloc(l, c * sizeof *g, "a line's labels");
                    if (!g) { rc = QT_ENOMEM; break; }
                    l = g, cap = c;
                }
                l[n++] = x;
            }
            p = fast_ws(q, e);
            if (p < e && *p == ',') { p = fast_ws(p + 1, e); continue; }
            if (p < e && *p == ']') { p++; break; }
            rc = FAST_NO;
            break;
        }
    if (labs) {
        if (rc == QT_OK) *labs = l, *nlabs = n;
        else qt_free(l);
    }
    *pp = p;
    return rc;
}

static int fast_tokens(const dl_encode_ctx *ctx, const char *s, size_t len, dl_tokbuf *out) {
    const char *p = fast_ws(s, s + len), *e = s + len;
    if (p >= e || *p != '{') return FAST_NO;
    p = fast_ws(p + 1, e);
    const size_t n0 = out->n;
    const double hi = ctx->vocab_limit > 0 ? (double)ctx->vocab_limit : 2147483648.0;
    int32_t *labs = NULL;
    size_t nlabs = 0, nids = 0;
    fast_bad bad_id = {SIZE_MAX, 0}, bad_lab = {SIZE_MAX, 0};
    int have_ids = 0, have_labels = 0, rc = QT_OK;
    while (rc == QT_OK) {
        if (p < e && *p == '}' && !have_ids && !have_labels) { rc = FAST_NO; break; }
        if (p >= e || *p != '"') { rc = FAST_NO; break; }
        const char *k = ++p;
        while (p < e && *p != '"' && *p != '\\') p++;
        if (p >= e || *p != '"') { rc = FAST_NO; break; }
        size_t kl = (size_t)(p - k);
        p = fast_ws(p + 1, e);
        if (p >= e || *p != ':') { rc = FAST_NO; break; }
        p = fast_ws(p + 1, e);
        int is_ids = kl == 9 && !memcmp(k, "input_ids", 9), is_labels = kl == 6 && !memcmp(k, "labels", 6);
        if ((is_ids && have_ids) || (is_labels && have_labels)) { rc = FAST_NO; break; } /* cJSON takes the first */
        if (is_ids) {
            have_ids = 1;
            size_t before = out->n;
            rc = fast_array(&p, e, 0, hi, out, NULL, NULL, &bad_id);
            nids = out->n - before;
        } else if (is_labels && e - p >= 4 && !memcmp(p, "null", 4)) {
            have_labels = 1;
            p += 4;
        } else if (is_labels) {
            have_labels = 1;
            rc = fast_array(&p, e, -2147483648.0, 2147483648.0, out, &labs, &nlabs, &bad_lab);
            if (rc == QT_OK) have_labels = 2;
        } else {
            const char *end = NULL;
            cJSON *v = cJSON_ParseWithLengthOpts(p, (size_t)(e - p), &end, 0);
            if (!v || !end) rc = FAST_NO;
            else p = end;
            cJSON_Delete(v);
        }
        if (rc != QT_OK) break;
        p = fast_ws(p, e);
        if (p < e && *p == ',') { p = fast_ws(p + 1, e); continue; }
        if (p < e && *p == '}') { p = fast_ws(p + 1, e); break; }
        rc = FAST_NO;
    }
    /* valid JSON of the plain shape: now encode_tokens' checks, in its order */
    if (rc == QT_OK && (p != e || !have_ids)) rc = FAST_NO;
    if (rc == QT_OK && nids == 0) rc = QT_ERR(QT_EFORMAT, "\"input_ids\" is empty");
    if (rc == QT_OK && have_labels == 2 && nlabs != nids)
        rc = QT_ERR(QT_EFORMAT, "\"labels\" has %d entries but \"input_ids\" has %d; they must match", (int)nlabs,
                    (int)nids);
    size_t first_bad = bad_id.at;
    if (have_labels == 2 && bad_lab.at < first_bad) first_bad = bad_lab.at;
    for (size_t i = 0; rc == QT_OK && have_labels == 2 && i < nids && i < first_bad; i++)
        rc = dl_fmt_check_label(labs[i], out->ids[n0 + i], (int)i, &out->mask[n0 + i]);
    int32_t x;
    if (rc == QT_OK && first_bad != SIZE_MAX && first_bad == bad_id.at)
        rc = dl_fmt_check_id(bad_id.v, "input_ids", (int)first_bad, 0, hi, &x);
    else if (rc == QT_OK && first_bad != SIZE_MAX)
        rc = dl_fmt_check_id(bad_lab.v, "labels", (int)first_bad, -2147483648.0, 2147483648.0, &x);
    qt_free(labs);
    if (rc != QT_OK) out->n = n0;
    if (rc == FAST_NO) qt_error_clear();
    return rc;
}

/* ---------------------------------------------------------------------------
 * long text and messages lines without a copy of their strings
 *
 * cJSON copies every string it parses: a 54 MB "text" or "content" costs the
 * line plus that copy before a token is made. A long line of the plain shape
 * is checked here first, as cJSON would read it, and only then are its
 * strings decoded in place, inside the caller's line buffer (a JSON string
 * never decodes longer than it is spelt), and tokenized from there. The plain
 * shape: one object holding "text" (a string) or "messages" (a non-empty
 * list of objects with exactly the keys "role", one of system, user,
 * assistant, tool, and "content", strings), plus keys no format reads, whose
 * values cJSON checks one at a time. Anything else (another key a format
 * reads, an escaped or duplicate key, a \u escape that is not four hex
 * digits of a code point other than U+0000) returns FAST_NO and the line
 * takes the cJSON path: what is accepted and every message stay the same. */

#define FAST_MAX_OTHER 32 /* keys no format reads, kept for their warnings */

static int hex4(const char *p, unsigned *v) {
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        unsigned d = c >= '0' && c <= '9' ? (unsigned)(c - '0') : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
                   : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10) : 16u;
        if (d == 16) return 0;
        *v = *v << 4 | d;
    }
    return 1;
}

/* The JSON string whose opening quote is at p: its end (past the closing
 * quote), or NULL when cJSON might read it otherwise (FAST_NO). With dst
 * (p + 1, in place) it is decoded there as cJSON decodes it and
 * NUL-terminated; *n its length. Bytes other than escapes are kept as they
 * are, as cJSON keeps them (invalid UTF-8 and control characters too). */
static char *fast_string(char *p, const char *e, char *dst, size_t *n) {
    char *q = p + 1, *o = dst;
    for (;;) {
        /* plain bytes up to the next quote or backslash */
        char *r = q;
        while (r < e && *r != '"' && *r != '\\') r++;
        if (o && o != q) memmove(o, q, (size_t)(r - q));
        if (o) o += r - q;
        if (r >= e) return NULL;
        if (*r == '"') {
            if (o) {
                *o = 0;
                *n = (size_t)(o - dst);
            }
            return r + 1;
        }
        if (r + 1 >= e) return NULL;
        char c = r[1], out = 0;
        q = r + 2;
        switch (c) {
        case 'b': out = '\b'; break;
        case 'f': out = '\f'; break;
        case 'n': out = '\n'; break;
        case 'r': out = '\r'; break;
        case 't': out = '\t'; break;
        case '"': case '\\': case '/': out = c; break;
        case 'u': {
            unsigned cp, lo;
            if (e - r < 6 || !hex4(r + 2, &cp) || cp == 0 || (cp >= 0xDC00 && cp <= 0xDFFF)) return NULL;
            q = r + 6;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (e - q < 6 || q[0] != '\\' || q[1] != 'u' || !hex4(q + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return NULL;
                cp = 0x10000 + ((cp & 0x3FF) << 10 | (lo & 0x3FF));
                q += 6;
            }
            if (o) {
                if (cp < 0x80) *o++ = (char)cp;
                else if (cp < 0x800) *o++ = (char)(0xC0 | cp >> 6), *o++ = (char)(0x80 | (cp & 0x3F));
                else if (cp < 0x10000)
                    *o++ = (char)(0xE0 | cp >> 12), *o++ = (char)(0x80 | (cp >> 6 & 0x3F)), *o++ = (char)(0x80 | (cp & 0x3F));
                else
                    *o++ = (char)(0xF0 | cp >> 18), *o++ = (char)(0x80 | (cp >> 12 & 0x3F)),
                    *o++ = (char)(0x80 | (cp >> 6 & 0x3F)), *o++ = (char)(0x80 | (cp & 0x3F));
            }
            continue;
        }
        default: return NULL;
        }
        if (o) *o++ = out;
    }
}

/* A key at p (at its quote), unescaped: *k and *kl; the position after its
 * ':' and the white space after it, or NULL. */
static char *fast_key(char *p, const char *e, const char **k, size_t *kl) {
    if (p >= e || *p != '"') return NULL;
    char *q = p + 1;
    while (q < e && *q != '"' && *q != '\\') q++;
    if (q >= e || *q != '"') return NULL;
    *k = p + 1;
    *kl = (size_t)(q - p - 1);
    q = (char *)fast_ws(q + 1, e);
    if (q >= e || *q != ':') return NULL;
    return (char *)fast_ws(q + 1, e);
}

static int key_is(const char *k, size_t kl, const char *name) { return kl == strlen(name) && !memcmp(k, name, kl); }

static const char *fast_role(const char *s, size_t n) {
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    for (int i = 0; i < 4; i++)
        if (key_is(s, n, roles[i])) return roles[i];
    return NULL;
}

/* The "messages" list at p ('['): checked (c NULL), or decoded in place into
 * c. Its end, or NULL. */
static char *fast_messages(char *p, const char *e, convo *c, int *rc) {
    if (p >= e || *p != '[') return NULL;
    p = (char *)fast_ws(p + 1, e);
    if (p < e && *p == ']') return NULL; /* empty: cJSON's path says so */
    for (;;) {
        if (p >= e || *p != '{') return NULL;
        p = (char *)fast_ws(p + 1, e);
        const char *role = NULL, *content = NULL;
        int have_role = 0, have_content = 0;
        for (;;) {
            const char *k;
            size_t kl, vl = 0;
            char *v = fast_key(p, e, &k, &kl);
            if (!v || *v != '"') return NULL;
            int is_role = key_is(k, kl, "role"), is_content = key_is(k, kl, "content");
            if ((!is_role && !is_content) || (is_role && have_role) || (is_content && have_content)) return NULL;
            p = fast_string(v, e, c ? v + 1 : NULL, &vl);
            if (!p) return NULL;
            if (is_role) {
                have_role = 1;
                if (c) role = fast_role(v + 1, vl);
                else if (!fast_role(v + 1, (size_t)(p - v - 2))) return NULL; /* spelt plainly or not at all */
            } else {
                have_content = 1;
                content = v + 1;
            }
            p = (char *)fast_ws(p, e);
            if (p < e && *p == ',') { p = (char *)fast_ws(p + 1, e); continue; }
            if (p < e && *p == '}') { p = (char *)fast_ws(p + 1, e); break; }
            return NULL;
        }
        if (!have_role || !have_content) return NULL;
        if (c && (*rc = dl_fmt_convo_add(c, role, content, NULL, 0)) != QT_OK) return NULL;
        if (p < e && *p == ',') { p = (char *)fast_ws(p + 1, e); continue; }
        if (p < e && *p == ']') return p + 1;
        return NULL;
    }
}

/* Keys a format reads: a line that holds one besides "text" or "messages"
 * takes the cJSON path (detection and warnings depend on them). */
static int format_key(const char *k, size_t kl) {
    static const char *const keys[] = {"text", "messages", "input_ids", "labels", "conversations", "instruction",
                                       "input", "output", "system", "history", "prompt", "completion", "tools", NULL};
    for (int i = 0; keys[i]; i++)
        if (key_is(k, kl, keys[i])) return 1;
    return 0;
}

/* One pass over the object: checks it (decode 0), or decodes its text or
 * messages in place and encodes them (decode 1, after a checking pass). */
static int fast_text_pass(const enc_call *ec, char *s, size_t len, dl_format *fmt, dl_tokbuf *out, int decode) {
    const char *e = s + len;
    char *p = (char *)fast_ws(s, e);
    if (p >= e || *p != '{') return FAST_NO;
    p = (char *)fast_ws(p + 1, e);
    char *text = NULL, *msgs = NULL;
    const char *other[FAST_MAX_OTHER];
    size_t other_len[FAST_MAX_OTHER], n_other = 0;
    for (;;) {
        const char *k;
        size_t kl;
        char *v = fast_key(p, e, &k, &kl);
        if (!v) return FAST_NO;
        if (key_is(k, kl, "text") && !text) {
            text = v;
            p = v < e && *v == '"' ? fast_string(v, e, NULL, NULL) : NULL;
        } else if (key_is(k, kl, "messages") && !msgs) {
            msgs = v;
            int rc = QT_OK;
            p = fast_messages(v, e, NULL, &rc);
        } else if (format_key(k, kl) || n_other == FAST_MAX_OTHER) {
            return FAST_NO;
        } else {
            other[n_other] = k, other_len[n_other++] = kl;
            const char *end = NULL;
            cJSON *val = cJSON_ParseWithLengthOpts(v, (size_t)(e - v), &end, 0);
            p = val && end ? (char *)end : NULL;
            cJSON_Delete(val);
        }
        if (!p) return FAST_NO;
        p = (char *)fast_ws(p, e);
        if (p < e && *p == ',') { p = (char *)fast_ws(p + 1, e); continue; }
        if (p < e && *p == '}') { p++; break; }
        return FAST_NO;
    }
    while (p < e && isspace((unsigned char)*p)) p++; /* dl_encode_line's rule after the object */
    dl_format f = text ? DL_FORMAT_TEXT : DL_FORMAT_MESSAGES;
    if (p != e || !text == !msgs || (*fmt != DL_FORMAT_AUTO && *fmt != f) || !ec->ctx->tok) return FAST_NO;
    *fmt = f;
    if (!decode) return QT_OK;
    /* valid, and what the cJSON path would read: its warnings, then its encoding */
    for (size_t i = 0; i < n_other; i++) {
        char key[64];
        snprintf(key, sizeof key, "%.*s", (int)(other_len[i] < 63 ? other_len[i] : 63), other[i]);
        dl_fmt_dropped(ec, "", key, dl_format_name(f));
    }
    if (text) {
        size_t n = 0;
        fast_string(text, e, text + 1, &n);
        QT_TRY(dl_fmt_put_text(ec->ctx, out, text + 1, n, 1));
        return dl_fmt_put_special(ec->ctx, out, "<|endoftext|>", 1);
    }
    convo c = {0};
    int rc = QT_OK;
    if (!fast_messages(msgs, e, &c, &rc) && rc == QT_OK) rc = QT_ERR(QT_EINVAL, "a checked messages line read otherwise");
    /* the contents lie in s, each after its "content": key (CHAT_HEAD_ROOM bytes) */
    char **in_place = rc == QT_OK ? qt_malloc(c.n * sizeof *in_place, "a conversation") : NULL;
    if (rc == QT_OK && !in_place) rc = QT_ENOMEM;
    for (size_t i = 0; rc == QT_OK && i < c.n; i++) in_place[i] = s + (c.m[i].content - s);
    if (rc == QT_OK) rc = dl_fmt_put_chat(ec->ctx, out, &c, in_place);
    qt_free(in_place);
    dl_fmt_convo_free(&c);
    return rc;
}

/* A long text or messages line of the plain shape, encoded from its own
 * buffer (s is no longer the line afterwards); FAST_NO, s untouched, when
 * the line is anything else. */
static int fast_text(const enc_call *ec, char *s, size_t len, dl_format *fmt, dl_tokbuf *out) {
    int rc = fast_text_pass(ec, s, len, fmt, out, 0);
    if (rc != QT_OK) return rc;
    const size_t n0 = out->n;
    rc = fast_text_pass(ec, s, len, fmt, out, 1);
    if (rc != QT_OK) out->n = n0;
    return rc;
}

dl_format dl_line_long_format(const dl_encode_ctx *ctx, const char *s, size_t len) {
    if (len < FAST_MIN_LINE || memchr(s, 0, len)) return DL_FORMAT_AUTO;
    dl_format f = DL_FORMAT_AUTO;
    enc_call ec = {ctx, 0};
    /* the checking pass writes nothing (s stays the caller's) */
    if (fast_text_pass(&ec, (char *)s, len, &f, NULL, 0) == QT_OK) return f;
    dl_tokbuf tb = {0};
    int rc = fast_tokens(ctx, s, len, &tb);
    dl_tokbuf_free(&tb);
    qt_error_clear();
    return rc == QT_OK ? DL_FORMAT_TOKENS : DL_FORMAT_AUTO;
}

/* dl_encode_line; w: the line again, writable (dl_encode_line_in_place), or NULL */
static int encode_line(const dl_encode_ctx *ctx, const char *path, long long line_no, const char *s, char *w,
                       size_t len, dl_format *fmt, dl_tokbuf *out) {
    if (memchr(s, 0, len))
        return QT_ERR(QT_EFORMAT, "%s:%lld: the line holds a NUL byte; a JSONL file is text: fix or remove that line",
                      path, line_no);
    if (w && len >= FAST_MIN_LINE && (*fmt == DL_FORMAT_TEXT || *fmt == DL_FORMAT_MESSAGES || *fmt == DL_FORMAT_AUTO)) {
        int rc = fast_text(&(enc_call){ctx, line_no}, w, len, fmt, out);
        if (rc != FAST_NO) return rc == QT_OK ? QT_OK : qt_error_context(rc, "%s:%lld", path, line_no);
        qt_error_clear();
    }
    if (len >= FAST_MIN_LINE && (*fmt == DL_FORMAT_TOKENS || *fmt == DL_FORMAT_AUTO)) {
        int rc = fast_tokens(ctx, s, len, out);
        if (rc != FAST_NO) {
            if (rc == QT_OK) *fmt = DL_FORMAT_TOKENS;
            return rc == QT_OK ? QT_OK : qt_error_context(rc, "%s:%lld", path, line_no);
        }
    }
    const char *end = NULL;
    cJSON *obj = cJSON_ParseWithLengthOpts(s, len, &end, 0);
    if (!obj) {
        size_t at = end && end >= s ? (size_t)(end - s) : 0;
        return QT_ERR(QT_EFORMAT, "%s:%lld: not valid JSON (near byte %zu); each line must be one JSON object", path,
                      line_no, at);
    }
    /* cJSON stops after the value: what follows it would be dropped unseen */
    while (end && end < s + len && isspace((unsigned char)*end)) end++;
    int rc = QT_OK;
    if (end && end < s + len) {
        rc = QT_ERR(QT_EFORMAT, "%s:%lld: text after the JSON object (byte %zu); put one object per line", path,
                    line_no, (size_t)(end - s));
    } else if (!cJSON_IsObject(obj)) {
        rc = QT_ERR(QT_EFORMAT, "%s:%lld: the line is not a JSON object", path, line_no);
    } else if (*fmt == DL_FORMAT_AUTO && (*fmt = dl_format_detect(obj)) == DL_FORMAT_AUTO) {
        rc = QT_ERR(QT_EFORMAT, "%s:%lld: cannot tell the data format: expected a \"text\", \"messages\", "
                    "\"conversations\", \"instruction\"+\"output\", \"prompt\"+\"completion\" or \"input_ids\" "
                    "key; or set data.format",
                    path, line_no);
    } else if (*fmt != DL_FORMAT_TOKENS && qt_json_has_nul_escape(s, len)) {
        /* cJSON decodes it to a NUL byte, where the text would end: the rest of the example dropped unseen */
        rc = QT_ERR(QT_EFORMAT, "%s:%lld: a string holds \\u0000 (U+0000), where its text would be cut short; remove "
                    "it", path, line_no);
    } else if ((rc = dl_fmt_encode_obj(&(enc_call){ctx, line_no}, *fmt, obj, out)) != QT_OK) {
        rc = qt_error_context(rc, "%s:%lld", path, line_no);
    }
    cJSON_Delete(obj);
    return rc;
}

int dl_encode_line(const dl_encode_ctx *ctx, const char *path, long long line_no, const char *s, size_t len,
                   dl_format *fmt, dl_tokbuf *out) {
    return encode_line(ctx, path, line_no, s, NULL, len, fmt, out);
}

int dl_encode_line_in_place(const dl_encode_ctx *ctx, const char *path, long long line_no, char *s, size_t len,
                            dl_format *fmt, dl_tokbuf *out) {
    return encode_line(ctx, path, line_no, s, s, len, fmt, out);
}
