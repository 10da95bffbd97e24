#include "data/format.h"
#include "core/error.h"
#include "core/mem.h"
#include "data/batch.h"
#include "text/chat.h"

#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *dl_format_name(dl_format f) {
    switch (f) {
    case DL_FORMAT_AUTO: return "auto";
    case DL_FORMAT_TEXT: return "text";
    case DL_FORMAT_MESSAGES: return "messages";
    case DL_FORMAT_ALPACA: return "alpaca";
    case DL_FORMAT_TOKENS: return "tokens";
    }
    return "?";
}

int dl_format_parse(const char *s, dl_format *out) {
    static const struct { const char *name; dl_format f; } names[] = {
        {"auto", DL_FORMAT_AUTO},         {"text", DL_FORMAT_TEXT},
        {"messages", DL_FORMAT_MESSAGES}, {"chat", DL_FORMAT_MESSAGES},
        {"chatml", DL_FORMAT_MESSAGES},   {"alpaca", DL_FORMAT_ALPACA},
        {"tokens", DL_FORMAT_TOKENS},     {"input_ids", DL_FORMAT_TOKENS},
        {"pretokenized", DL_FORMAT_TOKENS},
    };
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) { *out = names[i].f; return QT_OK; }
    return QT_ERR(QT_EINVAL, "unknown data.format '%s'; use auto, text, messages, alpaca or tokens", s ? s : "(null)");
}

dl_format dl_format_detect(const cJSON *obj) {
    if (!cJSON_IsObject(obj)) return DL_FORMAT_AUTO;
    if (cJSON_GetObjectItemCaseSensitive(obj, "input_ids")) return DL_FORMAT_TOKENS;
    if (cJSON_GetObjectItemCaseSensitive(obj, "messages")) return DL_FORMAT_MESSAGES;
    if (cJSON_GetObjectItemCaseSensitive(obj, "instruction") && cJSON_GetObjectItemCaseSensitive(obj, "output"))
        return DL_FORMAT_ALPACA;
    if (cJSON_GetObjectItemCaseSensitive(obj, "text")) return DL_FORMAT_TEXT;
    return DL_FORMAT_AUTO;
}

int dl_tokbuf_reserve(dl_tokbuf *b, size_t extra) {
    if (b->n + extra <= b->cap) return QT_OK;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + extra) {
        if (cap > SIZE_MAX / 8) return QT_ERR(QT_ENOMEM, "the dataset has too many tokens to hold");
        cap *= 2;
    }
    size_t ids_bytes;
    if (!qt_mul_ok(cap, sizeof(int32_t), &ids_bytes)) return QT_ERR(QT_ENOMEM, "the dataset has too many tokens to hold");
    int32_t *ids = qt_realloc(b->ids, ids_bytes, "the dataset's token ids");
    if (!ids) return QT_ENOMEM;
    b->ids = ids;
    uint8_t *mask = qt_realloc(b->mask, cap, "the dataset's label mask");
    if (!mask) return QT_ENOMEM;
    b->mask = mask;
    b->cap = cap;
    return QT_OK;
}

void dl_tokbuf_free(dl_tokbuf *b) {
    qt_free(b->ids);
    qt_free(b->mask);
    memset(b, 0, sizeof *b);
}

/* Appends the tokens of a string, all with the same label flag. */
static int put_text(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *s, size_t len, uint8_t label) {
    size_t n0 = out->n;
    /* bpe_encode grows ids with qt_realloc; the mask follows it. */
    size_t cap = out->cap;
    int rc = bpe_encode(ctx->tok, s, len, &out->ids, &out->n, &cap);
    if (rc != QT_OK) return rc;
    if (cap != out->cap) {
        uint8_t *mask = qt_realloc(out->mask, cap, "the dataset's label mask");
        if (!mask) return QT_ENOMEM;
        out->mask = mask;
        out->cap = cap;
    }
    if (out->n > n0) memset(out->mask + n0, label, out->n - n0); /* mask may still be NULL when nothing was added */
    return QT_OK;
}

static int put_special(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *token, uint8_t label) {
    int32_t id = bpe_token_id(ctx->tok, token);
    if (id < 0) return QT_ERR(QT_EFORMAT, "the tokenizer has no %s token, which this data format needs", token);
    QT_TRY(dl_tokbuf_reserve(out, 1));
    out->ids[out->n] = id;
    out->mask[out->n] = label;
    out->n++;
    return QT_OK;
}

static const char *get_string(const cJSON *obj, const char *key, int required, int *rc) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (required && cJSON_IsNull(v)) {
        *rc = QT_ERR(QT_EFORMAT, "\"%s\" is null; it must be a string (\"\" for an empty one)", key);
        return NULL;
    }
    if (!v || cJSON_IsNull(v)) {
        if (required) *rc = QT_ERR(QT_EFORMAT, "the \"%s\" key is missing", key);
        return NULL;
    }
    if (!cJSON_IsString(v)) {
        *rc = QT_ERR(QT_EFORMAT, "\"%s\" must be a string", key);
        return NULL;
    }
    return v->valuestring;
}

static int need_tokenizer(const dl_encode_ctx *ctx, dl_format fmt) {
    if (ctx->tok) return QT_OK;
    return QT_ERR(QT_EINVAL, "the %s format needs a tokenizer; give the model folder (with tokenizer.json) "
                  "or use pre-tokenized {\"input_ids\": [...]} lines", dl_format_name(fmt));
}

static int encode_text(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out) {
    int rc = QT_OK;
    const char *text = get_string(obj, "text", 1, &rc);
    if (!text) return rc;
    QT_TRY(put_text(ctx, out, text, strlen(text), 1));
    return put_special(ctx, out, "<|endoftext|>", 1);
}

/* A conversation through the chat module (text/chat.h: Qwen2.5's ChatML
 * template, one encode of the rendered text, labels on each assistant
 * content and its <|im_end|>), appended to out as ids + label mask. */
static int put_chat(const dl_encode_ctx *ctx, dl_tokbuf *out, const chat_message *msgs, size_t n) {
    int32_t *ids = NULL, *labels = NULL;
    size_t n_ids = 0, cap = 0;
    int rc = chat_encode(ctx->tok, msgs, n, 0, &ids, &labels, &n_ids, &cap);
    if (rc == QT_OK) rc = dl_tokbuf_reserve(out, n_ids);
    if (rc == QT_OK) {
        for (size_t i = 0; i < n_ids; i++) {
            out->ids[out->n + i] = ids[i];
            out->mask[out->n + i] = !ctx->mask_prompt || labels[i] != CHAT_IGNORE_INDEX;
        }
        out->n += n_ids;
    }
    qt_free(ids);
    qt_free(labels);
    return rc;
}

static int encode_messages(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out) {
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(obj, "messages");
    if (!cJSON_IsArray(arr)) return QT_ERR(QT_EFORMAT, "\"messages\" must be an array of {\"role\", \"content\"} objects");
    int n = cJSON_GetArraySize(arr), i = 0, n_assistant = 0;
    if (n == 0) return QT_ERR(QT_EFORMAT, "\"messages\" is empty");
    chat_message *msgs = qt_calloc((size_t)n, sizeof *msgs, "a conversation");
    if (!msgs) return QT_ENOMEM;
    int rc = QT_OK;
    const cJSON *m;
    cJSON_ArrayForEach(m, arr) {
        if (!cJSON_IsObject(m)) { rc = QT_ERR(QT_EFORMAT, "messages[%d] must be an object with \"role\" and \"content\"", i); break; }
        const char *role = get_string(m, "role", 1, &rc);
        const char *content = role ? get_string(m, "content", 1, &rc) : NULL;
        if (!role || !content) { rc = qt_error_context(rc, "messages[%d]", i); break; }
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "tool")) {
            rc = QT_ERR(QT_EFORMAT, "messages[%d].role is \"%s\"; use system, user, assistant or tool", i, role);
            break;
        }
        n_assistant += !strcmp(role, "assistant");
        msgs[i++] = (chat_message){.role = role, .content = content};
    }
    if (rc == QT_OK && ctx->mask_prompt && n_assistant == 0)
        rc = QT_ERR(QT_EFORMAT, "\"messages\" has no assistant turn, so with mask_prompt nothing would be learned");
    if (rc == QT_OK) rc = put_chat(ctx, out, msgs, (size_t)n);
    qt_free(msgs);
    return rc;
}

static int encode_alpaca(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out) {
    int rc = QT_OK;
    const char *instruction = get_string(obj, "instruction", 1, &rc);
    if (!instruction) return rc;
    const char *input = get_string(obj, "input", 0, &rc);
    if (rc != QT_OK) return rc;
    const char *output = get_string(obj, "output", 1, &rc);
    if (!output) return rc;
    /* prompt = instruction + "\n\n" + input (when input is non-empty) */
    size_t ni = strlen(instruction), nin = input ? strlen(input) : 0;
    char *prompt = qt_malloc(ni + nin + 3, "an Alpaca prompt");
    if (!prompt) return QT_ENOMEM;
    memcpy(prompt, instruction, ni);
    size_t n = ni;
    if (nin) {
        memcpy(prompt + n, "\n\n", 2);
        memcpy(prompt + n + 2, input, nin);
        n += 2 + nin;
    }
    prompt[n] = 0;
    chat_message msgs[2] = {{.role = "user", .content = prompt}, {.role = "assistant", .content = output}};
    rc = put_chat(ctx, out, msgs, 2);
    qt_free(prompt);
    return rc;
}

/* An integer-valued number in [lo, hi), or an error naming key[i]. */
static int check_id(double d, const char *key, int i, double lo, double hi, int32_t *out) {
    *out = 0;
    if (!isfinite(d) || d != floor(d)) return QT_ERR(QT_EFORMAT, "%s[%d] = %g is not an integer", key, i, d);
    if (d < lo || d >= hi)
        return QT_ERR(QT_EFORMAT, "%s[%d] = %.0f is out of range [%.0f, %.0f); is the data for this model's vocabulary?",
                      key, i, d, lo, hi);
    *out = (int32_t)d;
    return QT_OK;
}

static int get_id(const cJSON *v, const char *key, int i, double lo, double hi, int32_t *out) {
    if (!cJSON_IsNumber(v)) return QT_ERR(QT_EFORMAT, "%s[%d] is not a number", key, i);
    return check_id(v->valuedouble, key, i, lo, hi, out);
}

/* The label rule of the tokens format: -100 or the id itself. */
static int check_label(int32_t lab, int32_t id, int i, uint8_t *m) {
    *m = 1;
    if (lab == QT_IGNORE_INDEX) *m = 0;
    else if (lab != id)
        return QT_ERR(QT_EFORMAT, "labels[%d] = %d is neither -100 nor input_ids[%d] = %d; qtune reads labels in "
                      "HF's unshifted sense (the label of token t is token t) and shifts them itself",
                      i, lab, i, id);
    return QT_OK;
}

static int encode_tokens(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out) {
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(obj, "input_ids");
    const cJSON *labels = cJSON_GetObjectItemCaseSensitive(obj, "labels");
    if (!cJSON_IsArray(ids)) return QT_ERR(QT_EFORMAT, "\"input_ids\" must be an array of integers");
    if (labels && cJSON_IsNull(labels)) labels = NULL;
    if (labels && !cJSON_IsArray(labels)) return QT_ERR(QT_EFORMAT, "\"labels\" must be an array of integers");
    int n = cJSON_GetArraySize(ids);
    if (n == 0) return QT_ERR(QT_EFORMAT, "\"input_ids\" is empty");
    if (labels && cJSON_GetArraySize(labels) != n)
        return QT_ERR(QT_EFORMAT, "\"labels\" has %d entries but \"input_ids\" has %d; they must match",
                      cJSON_GetArraySize(labels), n);
    QT_TRY(dl_tokbuf_reserve(out, (size_t)n));
    double hi = ctx->vocab_limit > 0 ? (double)ctx->vocab_limit : 2147483648.0;
    const cJSON *v = ids->child, *l = labels ? labels->child : NULL;
    for (int i = 0; i < n; i++, v = v->next) {
        int32_t id = 0, lab = 0;
        QT_TRY(get_id(v, "input_ids", i, 0, hi, &id));
        uint8_t m = 1;
        if (l) {
            QT_TRY(get_id(l, "labels", i, -2147483648.0, 2147483648.0, &lab));
            QT_TRY(check_label(lab, id, i, &m));
            l = l->next;
        }
        out->ids[out->n + (size_t)i] = id;
        out->mask[out->n + (size_t)i] = m;
    }
    out->n += (size_t)n;
    return QT_OK;
}

int dl_encode_example(const dl_encode_ctx *ctx, dl_format fmt, const cJSON *obj, dl_tokbuf *out) {
    if (!cJSON_IsObject(obj)) return QT_ERR(QT_EFORMAT, "the line is not a JSON object");
    size_t n0 = out->n;
    int rc;
    switch (fmt) {
    case DL_FORMAT_TEXT: rc = need_tokenizer(ctx, fmt); if (!rc) rc = encode_text(ctx, obj, out); break;
    case DL_FORMAT_MESSAGES: rc = need_tokenizer(ctx, fmt); if (!rc) rc = encode_messages(ctx, obj, out); break;
    case DL_FORMAT_ALPACA: rc = need_tokenizer(ctx, fmt); if (!rc) rc = encode_alpaca(ctx, obj, out); break;
    case DL_FORMAT_TOKENS: rc = encode_tokens(ctx, obj, out); break;
    default: rc = QT_ERR(QT_EINVAL, "no data format chosen"); break;
    }
    if (rc != QT_OK) out->n = n0; /* drop a half-written example */
    return rc;
}

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
        rc = check_label(labs[i], out->ids[n0 + i], (int)i, &out->mask[n0 + i]);
    int32_t x;
    if (rc == QT_OK && first_bad != SIZE_MAX && first_bad == bad_id.at)
        rc = check_id(bad_id.v, "input_ids", (int)first_bad, 0, hi, &x);
    else if (rc == QT_OK && first_bad != SIZE_MAX)
        rc = check_id(bad_lab.v, "labels", (int)first_bad, -2147483648.0, 2147483648.0, &x);
    qt_free(labs);
    if (rc != QT_OK) out->n = n0;
    if (rc == FAST_NO) qt_error_clear();
    return rc;
}

int dl_line_is_long_tokens(const dl_encode_ctx *ctx, const char *s, size_t len) {
    if (len < FAST_MIN_LINE || memchr(s, 0, len)) return 0;
    dl_tokbuf tb = {0};
    int rc = fast_tokens(ctx, s, len, &tb);
    dl_tokbuf_free(&tb);
    qt_error_clear();
    return rc == QT_OK;
}

int dl_encode_line(const dl_encode_ctx *ctx, const char *path, long long line_no, const char *s, size_t len,
                   dl_format *fmt, dl_tokbuf *out) {
    if (memchr(s, 0, len))
        return QT_ERR(QT_EFORMAT, "%s:%lld: the line holds a NUL byte; a JSONL file is text: fix or remove that line",
                      path, line_no);
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
                    "\"instruction\"+\"output\" or \"input_ids\" key; or set the format",
                    path, line_no);
    } else if ((rc = dl_encode_example(ctx, *fmt, obj, out)) != QT_OK) {
        rc = qt_error_context(rc, "%s:%lld", path, line_no);
    }
    cJSON_Delete(obj);
    return rc;
}

uint64_t dl_template_hash(void) {
    /* Bump the string when the rendering or masking rules here or in
     * text/chat.c change; the default system prompt is hashed with it. */
    static const char rules[] = "v2: chat_encode (Qwen2.5 ChatML, whole-text encode, span labels: assistant "
                                "content + <|im_end|>); text + <|endoftext|>; alpaca: instruction\\n\\ninput as user; "
                                "default system: " CHAT_DEFAULT_SYSTEM;
    uint64_t h = 1469598103934665603ull;
    for (const char *p = rules; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}
