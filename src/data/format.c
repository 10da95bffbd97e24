#include "data/format.h"
#include "core/error.h"
#include "core/mem.h"
#include "data/batch.h"
#include "text/chat.h"

#include <ctype.h>
#include <math.h>
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

/* An integer-valued JSON number in [lo, hi), or an error naming key[i]. */
static int get_id(const cJSON *v, const char *key, int i, double lo, double hi, int32_t *out) {
    if (!cJSON_IsNumber(v)) return QT_ERR(QT_EFORMAT, "%s[%d] is not a number", key, i);
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d)) return QT_ERR(QT_EFORMAT, "%s[%d] = %g is not an integer", key, i, d);
    if (d < lo || d >= hi)
        return QT_ERR(QT_EFORMAT, "%s[%d] = %.0f is out of range [%.0f, %.0f); is the data for this model's vocabulary?",
                      key, i, d, lo, hi);
    *out = (int32_t)d;
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
        int32_t id, lab;
        QT_TRY(get_id(v, "input_ids", i, 0, hi, &id));
        uint8_t m = 1;
        if (l) {
            QT_TRY(get_id(l, "labels", i, -2147483648.0, 2147483648.0, &lab));
            if (lab == QT_IGNORE_INDEX) m = 0;
            else if (lab != id)
                return QT_ERR(QT_EFORMAT, "labels[%d] = %d is neither -100 nor input_ids[%d] = %d; qtune reads labels in "
                              "HF's unshifted sense (the label of token t is token t) and shifts them itself",
                              i, lab, i, id);
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

int dl_encode_line(const dl_encode_ctx *ctx, const char *path, long long line_no, const char *s, size_t len,
                   dl_format *fmt, dl_tokbuf *out) {
    if (memchr(s, 0, len))
        return QT_ERR(QT_EFORMAT, "%s:%lld: the line holds a NUL byte; a JSONL file is text: fix or remove that line",
                      path, line_no);
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
