#include "data/format.h"
#include "data/format_internal.h"
#include "core/error.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/strbuf.h"
#include "data/batch.h"
#include "text/chat.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *dl_format_name(dl_format f) {
    switch (f) {
    case DL_FORMAT_AUTO: return "auto";
    case DL_FORMAT_TEXT: return "text";
    case DL_FORMAT_MESSAGES: return "messages";
    case DL_FORMAT_ALPACA: return "alpaca";
    case DL_FORMAT_TOKENS: return "tokens";
    case DL_FORMAT_SHAREGPT: return "sharegpt";
    case DL_FORMAT_PROMPT_COMPLETION: return "prompt_completion";
    }
    return "?";
}

int dl_format_parse(const char *s, dl_format *out) {
    static const struct { const char *name; dl_format f; } names[] = {
        {"auto", DL_FORMAT_AUTO},         {"text", DL_FORMAT_TEXT},
        {"messages", DL_FORMAT_MESSAGES}, {"chat", DL_FORMAT_MESSAGES},
        {"chatml", DL_FORMAT_MESSAGES},   {"alpaca", DL_FORMAT_ALPACA},
        {"tokens", DL_FORMAT_TOKENS},     {"input_ids", DL_FORMAT_TOKENS},
        {"pretokenized", DL_FORMAT_TOKENS}, {"sharegpt", DL_FORMAT_SHAREGPT},
        {"prompt_completion", DL_FORMAT_PROMPT_COMPLETION}, {"prompt-completion", DL_FORMAT_PROMPT_COMPLETION},
    };
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) { *out = names[i].f; return QT_OK; }
    return QT_ERR(QT_EINVAL,
                  "unknown data.format '%s'; use auto, text, messages, sharegpt, alpaca, prompt_completion or tokens",
                  s ? s : "(null)");
}

dl_format dl_format_detect(const cJSON *obj) {
    if (!cJSON_IsObject(obj)) return DL_FORMAT_AUTO;
    if (cJSON_GetObjectItemCaseSensitive(obj, "input_ids")) return DL_FORMAT_TOKENS;
    if (cJSON_GetObjectItemCaseSensitive(obj, "messages")) return DL_FORMAT_MESSAGES;
    if (cJSON_GetObjectItemCaseSensitive(obj, "conversations")) return DL_FORMAT_SHAREGPT;
    if (cJSON_GetObjectItemCaseSensitive(obj, "instruction") && cJSON_GetObjectItemCaseSensitive(obj, "output"))
        return DL_FORMAT_ALPACA;
    if (cJSON_GetObjectItemCaseSensitive(obj, "prompt") && cJSON_GetObjectItemCaseSensitive(obj, "completion"))
        return DL_FORMAT_PROMPT_COMPLETION;
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
int dl_fmt_put_text(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *s, size_t len, uint8_t label) {
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

int dl_fmt_put_special(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *token, uint8_t label) {
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
    QT_TRY(dl_fmt_put_text(ctx, out, text, strlen(text), 1));
    return dl_fmt_put_special(ctx, out, "<|endoftext|>", 1);
}

/* ---- keys a format does not read: one warning per file and key ---- */

#define DL_SEEN_MAX 32

struct dl_seen_keys {
    pthread_mutex_t mu;
    int n;
    char key[DL_SEEN_MAX][64];
    char path[1024];
};

int dl_seen_keys_new(const char *path, dl_seen_keys **out) {
    dl_seen_keys *s = qt_calloc(1, sizeof *s, "the dropped-key list");
    if (!s) return QT_ENOMEM;
    pthread_mutex_init(&s->mu, NULL);
    snprintf(s->path, sizeof s->path, "%s", path ? path : "the data");
    *out = s;
    return QT_OK;
}

void dl_seen_keys_free(dl_seen_keys *s) {
    if (!s) return;
    pthread_mutex_destroy(&s->mu);
    qt_free(s);
}


void dl_fmt_dropped(const enc_call *e, const char *where, const char *key, const char *fmt_name) {
    dl_seen_keys *s = e->ctx->seen;
    if (!s) return;
    char name[64];
    snprintf(name, sizeof name, "%s%s", where, key);
    pthread_mutex_lock(&s->mu);
    int seen = 0;
    for (int i = 0; i < s->n && !seen; i++) seen = !strcmp(s->key[i], name);
    if (!seen && s->n < DL_SEEN_MAX) snprintf(s->key[s->n++], sizeof s->key[0], "%s", name);
    pthread_mutex_unlock(&s->mu);
    if (!seen)
        qt_warn("%s:%lld: key \"%s\" is not read by the %s format and is dropped (warned once per file; docs/data.md "
                "lists the keys each format reads)",
                s->path, e->line, name, fmt_name);
}

static void check_keys(const enc_call *e, const cJSON *obj, const char *where, const char *const *known,
                       dl_format f) {
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = it->string && !strcmp(it->string, known[i]);
        if (!ok) dl_fmt_dropped(e, where, it->string ? it->string : "?", dl_format_name(f));
    }
}

/* ---- conversations: every chat-like shape becomes chat_message[] ---- */


void dl_fmt_convo_free(convo *c) {
    for (size_t i = 0; i < c->n_owned; i++) qt_free(c->owned[i]);
    qt_free(c->owned);
    qt_free(c->m);
    qt_free(c->tools);
    memset(c, 0, sizeof *c);
}

/* Takes s into the conversation's keeping (frees it on failure). */
static int convo_own(convo *c, char *s) {
    if (c->n_owned == c->cap_owned) {
        size_t cap = c->cap_owned ? 2 * c->cap_owned : 8;
        char **o = qt_realloc(c->owned, cap * sizeof *o, "a conversation's strings");
        if (!o) { qt_free(s); return QT_ENOMEM; }
        c->owned = o;
        c->cap_owned = cap;
    }
    c->owned[c->n_owned++] = s;
    return QT_OK;
}

int dl_fmt_convo_add(convo *c, const char *role, const char *content, const char *calls, int no_label) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        chat_message *m = qt_realloc(c->m, cap * sizeof *m, "a conversation");
        if (!m) return QT_ENOMEM;
        c->m = m;
        c->cap = cap;
    }
    c->m[c->n++] = (chat_message){.role = role, .content = content, .tool_calls = calls, .no_label = no_label};
    return QT_OK;
}

/* content: a string, or OpenAI's list of parts whose text parts are joined
 * with "\n" (as vLLM joins them); null is NULL (an assistant turn with tool
 * calls may have none). */
static int content_text(convo *c, const cJSON *v, const char *what, const char **out) {
    *out = NULL;
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (cJSON_IsString(v)) { *out = v->valuestring; return QT_OK; }
    if (!cJSON_IsArray(v))
        return QT_ERR(QT_EFORMAT, "%s.content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
                      what);
    qt_strbuf b = {0};
    int rc = qt_strbuf_put(&b, "", 0), k = 0;
    for (const cJSON *p = v->child; p && rc == QT_OK; p = p->next, k++) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(p, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (cJSON_IsString(p)) text = p;
        else if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text))
            rc = QT_ERR(QT_EFORMAT, "%s.content[%d] is %s%s%s; qtune trains on text parts {\"type\": \"text\", "
                        "\"text\": ...} only",
                        what, k, cJSON_IsString(type) ? "a \"" : "not a text part", cJSON_IsString(type) ? type->valuestring : "",
                        cJSON_IsString(type) ? "\" part" : "");
        if (rc == QT_OK && k) rc = qt_strbuf_put(&b, "\n", 1);
        if (rc == QT_OK) rc = qt_strbuf_put(&b, text->valuestring, strlen(text->valuestring));
    }
    if (rc != QT_OK) { qt_free(b.p); return rc; }
    *out = b.p;
    return convo_own(c, b.p);
}

/* "tools": a list of tool definitions, or (LLaMA-Factory) that list as a JSON string. */
static int convo_tools(convo *c, const cJSON *obj) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "tools");
    if (!t || cJSON_IsNull(t)) return QT_OK;
    cJSON *parsed = NULL;
    if (cJSON_IsString(t)) {
        if (!t->valuestring[0]) return QT_OK;
        parsed = cJSON_Parse(t->valuestring);
        if (!cJSON_IsArray(parsed)) {
            cJSON_Delete(parsed);
            return QT_ERR(QT_EFORMAT, "\"tools\" is a string that is not a JSON list of tool definitions");
        }
        t = parsed;
    }
    int rc = cJSON_GetArraySize(t) ? chat_tools_text(t, &c->tools) : QT_OK;
    cJSON_Delete(parsed);
    return rc;
}

static int convo_calls(convo *c, const cJSON *calls, const char **out) {
    *out = NULL;
    if (!calls || cJSON_IsNull(calls) || (cJSON_IsArray(calls) && !cJSON_GetArraySize(calls))) return QT_OK;
    char *t;
    QT_TRY(chat_tool_calls_text(calls, &t));
    QT_TRY(convo_own(c, t));
    *out = t;
    return QT_OK;
}

/* OpenAI / HF messages: role, content (string or parts), weight 0/1 on an
 * assistant turn, tool_calls on an assistant turn. no_label marks every
 * assistant turn as prompt (a TRL conversational prompt). */
static int read_messages(const enc_call *e, convo *c, const cJSON *arr, const char *key, int no_label) {
    static const char *const known[] = {"role", "content", "weight", "tool_calls", NULL};
    if (!cJSON_IsArray(arr))
        return QT_ERR(QT_EFORMAT, "\"%s\" must be an array of {\"role\", \"content\"} objects", key);
    int i = 0;
    for (const cJSON *m = arr->child; m; m = m->next, i++) {
        char what[64];
        snprintf(what, sizeof what, "%s[%d]", key, i);
        if (!cJSON_IsObject(m)) return QT_ERR(QT_EFORMAT, "%s must be an object with \"role\" and \"content\"", what);
        check_keys(e, m, "messages[].", known, DL_FORMAT_MESSAGES);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role)) return QT_ERR(QT_EFORMAT, "%s.role is missing or not a string", what);
        const char *r = role->valuestring;
        if (!strcmp(r, "developer")) r = "system"; /* OpenAI's name for the system turn (o1 on) */
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool"))
            return QT_ERR(QT_EFORMAT, "%s.role is \"%s\"; use system (or developer), user, assistant or tool", what, r);
        const int assistant = !strcmp(r, "assistant");
        const char *content, *calls = NULL;
        QT_TRY(content_text(c, cJSON_GetObjectItemCaseSensitive(m, "content"), what, &content));
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (tc && !cJSON_IsNull(tc) && !assistant)
            return QT_ERR(QT_EFORMAT, "%s has tool_calls but role \"%s\"; only an assistant turn calls tools", what, r);
        int rc = convo_calls(c, tc, &calls);
        if (rc != QT_OK) return qt_error_context(rc, "%s", what);
        if (!content && !calls) { /* null content is for a turn with tool_calls */
            const cJSON *cv = cJSON_GetObjectItemCaseSensitive(m, "content");
            if (cJSON_IsNull(cv))
                return QT_ERR(QT_EFORMAT, "%s: \"content\" is null; it must be a string (\"\" for an empty one)%s",
                              what, assistant ? ", or the turn must have tool_calls" : "");
            return QT_ERR(QT_EFORMAT, "%s: the \"content\" key is missing", what);
        }
        const cJSON *w = cJSON_GetObjectItemCaseSensitive(m, "weight");
        int weight = 1;
        if (w && !cJSON_IsNull(w)) {
            if (!cJSON_IsNumber(w) || (w->valuedouble != 0 && w->valuedouble != 1))
                return QT_ERR(QT_EFORMAT, "%s.weight must be 0 or 1 (0: the turn is not trained on)", what);
            weight = w->valuedouble == 1;
        }
        QT_TRY(dl_fmt_convo_add(c, r, content, calls, no_label || !weight));
    }
    return QT_OK;
}

/* LLaMA-Factory's ShareGPT: from human/gpt/system/function_call/observation. */
static int read_sharegpt(const enc_call *e, convo *c, const cJSON *obj) {
    static const char *const known[] = {"from", "value", NULL};
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(obj, "conversations");
    if (!cJSON_IsArray(arr))
        return QT_ERR(QT_EFORMAT, "\"conversations\" must be an array of {\"from\", \"value\"} objects");
    const cJSON *sys = cJSON_GetObjectItemCaseSensitive(obj, "system");
    if (sys && !cJSON_IsNull(sys) && !cJSON_IsString(sys)) return QT_ERR(QT_EFORMAT, "\"system\" must be a string");
    if (cJSON_IsString(sys) && sys->valuestring[0]) QT_TRY(dl_fmt_convo_add(c, "system", sys->valuestring, NULL, 0));
    int i = 0;
    for (const cJSON *t = arr->child; t; t = t->next, i++) {
        if (!cJSON_IsObject(t))
            return QT_ERR(QT_EFORMAT, "conversations[%d] must be an object with \"from\" and \"value\"", i);
        check_keys(e, t, "conversations[].", known, DL_FORMAT_SHAREGPT);
        const cJSON *from = cJSON_GetObjectItemCaseSensitive(t, "from");
        const cJSON *value = cJSON_GetObjectItemCaseSensitive(t, "value");
        if (!cJSON_IsString(from) || !cJSON_IsString(value))
            return QT_ERR(QT_EFORMAT, "conversations[%d] needs string \"from\" and \"value\"", i);
        const char *f = from->valuestring, *role = NULL;
        if (!strcmp(f, "human") || !strcmp(f, "user")) role = "user";
        else if (!strcmp(f, "gpt") || !strcmp(f, "assistant")) role = "assistant";
        else if (!strcmp(f, "system")) role = "system";
        else if (!strcmp(f, "observation") || !strcmp(f, "tool")) role = "tool";
        else if (!strcmp(f, "function_call")) {
            /* the value is the call as JSON: {"name", "arguments"} or a list of them */
            cJSON *call = cJSON_Parse(value->valuestring);
            if (cJSON_IsObject(call)) {
                cJSON *list = cJSON_CreateArray();
                if (list) cJSON_AddItemToArray(list, call);
                call = list;
            }
            const char *calls = NULL;
            int rc = cJSON_IsArray(call) ? convo_calls(c, call, &calls)
                                         : QT_ERR(QT_EFORMAT, "is not JSON {\"name\": ..., \"arguments\": {...}}");
            cJSON_Delete(call);
            if (rc == QT_OK && !calls) rc = QT_ERR(QT_EFORMAT, "holds no call");
            if (rc != QT_OK) return qt_error_context(rc, "conversations[%d] (function_call): value", i);
            QT_TRY(dl_fmt_convo_add(c, "assistant", NULL, calls, 0));
            continue;
        } else {
            return QT_ERR(QT_EFORMAT,
                          "conversations[%d].from is \"%s\"; use human, gpt, system, function_call or observation", i, f);
        }
        QT_TRY(dl_fmt_convo_add(c, role, value->valuestring, NULL, 0));
    }
    return QT_OK;
}

/* Alpaca: [system], history pairs, then instruction (+ "\n\n" + input) and output. */
static int read_alpaca(convo *c, const cJSON *obj) {
    int rc = QT_OK;
    const char *instruction = get_string(obj, "instruction", 1, &rc);
    if (!instruction) return rc;
    const char *input = get_string(obj, "input", 0, &rc);
    if (rc != QT_OK) return rc;
    const char *output = get_string(obj, "output", 1, &rc);
    if (!output) return rc;
    const char *system = get_string(obj, "system", 0, &rc);
    if (rc != QT_OK) return rc;
    if (system && system[0]) QT_TRY(dl_fmt_convo_add(c, "system", system, NULL, 0));
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(obj, "history");
    if (h && !cJSON_IsNull(h)) {
        if (!cJSON_IsArray(h)) return QT_ERR(QT_EFORMAT, "\"history\" must be a list of [instruction, response] pairs");
        int i = 0;
        for (const cJSON *p = h->child; p; p = p->next, i++) {
            const cJSON *q = cJSON_GetArrayItem(p, 0), *a = cJSON_GetArrayItem(p, 1);
            if (!cJSON_IsArray(p) || cJSON_GetArraySize(p) != 2 || !cJSON_IsString(q) || !cJSON_IsString(a))
                return QT_ERR(QT_EFORMAT, "history[%d] must be a pair of strings [instruction, response]", i);
            QT_TRY(dl_fmt_convo_add(c, "user", q->valuestring, NULL, 0));
            QT_TRY(dl_fmt_convo_add(c, "assistant", a->valuestring, NULL, 0));
        }
    }
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
    QT_TRY(convo_own(c, prompt));
    QT_TRY(dl_fmt_convo_add(c, "user", prompt, NULL, 0));
    return dl_fmt_convo_add(c, "assistant", output, NULL, 0);
}

/* A conversation through the chat module (text/chat.h: Qwen2.5's ChatML
 * template, one encode of the rendered text, labels on each assistant
 * content and its <|im_end|>), appended to out as ids + label mask. On
 * failure out->n is put back by the caller (encode_obj). in_place: the
 * contents again, writable with room before each (a long line's own
 * buffer), so nothing need be rendered; or NULL. */
int dl_fmt_put_chat(const dl_encode_ctx *ctx, dl_tokbuf *out, const convo *c, char *const *in_place) {
    size_t n_label = 0;
    for (size_t i = 0; i < c->n; i++) n_label += !strcmp(c->m[i].role, "assistant") && !c->m[i].no_label;
    if (ctx->mask_prompt && n_label == 0)
        return QT_ERR(QT_EFORMAT, "the conversation has no assistant turn to train on (none, or each has weight 0 or "
                      "is part of the prompt), so with mask_prompt nothing would be learned");
    /* straight into out: ids and the mask, nothing per token besides */
    size_t n0 = out->n;
    if (in_place) QT_TRY(chat_encode_mask_in_place(ctx->tok, c->m, c->n, in_place, &out->ids, &out->mask, &out->n, &out->cap));
    else QT_TRY(chat_encode_mask(ctx->tok, c->m, c->n, c->tools, 0, &out->ids, &out->mask, &out->n, &out->cap));
    if (!ctx->mask_prompt) memset(out->mask + n0, 1, out->n - n0);
    return QT_OK;
}

int dl_chat_encode_json(const bpe_tokenizer *tok, const cJSON *obj, int add_generation_prompt, char **text,
                        size_t *text_len, int32_t **ids, int32_t **labels, size_t *n) {
    dl_encode_ctx ctx = {.tok = tok};
    enc_call e = {&ctx, 0};
    convo c = {0};
    *text = NULL;
    *ids = *labels = NULL;
    *n = 0;
    size_t cap = 0;
    int rc = cJSON_IsObject(obj) ? read_messages(&e, &c, cJSON_GetObjectItemCaseSensitive(obj, "messages"), "messages", 0)
                                 : QT_ERR(QT_EFORMAT, "not a JSON object");
    if (rc == QT_OK) rc = convo_tools(&c, obj);
    if (rc == QT_OK) rc = chat_render_tok(tok, c.m, c.n, c.tools, add_generation_prompt, text, text_len);
    if (rc == QT_OK) rc = chat_encode_tools(tok, c.m, c.n, c.tools, add_generation_prompt, ids, labels, n, &cap);
    dl_fmt_convo_free(&c);
    return rc;
}

static int encode_convo(const enc_call *e, dl_format fmt, const cJSON *obj, dl_tokbuf *out) {
    static const char *const k_messages[] = {"messages", "tools", NULL};
    static const char *const k_sharegpt[] = {"conversations", "system", "tools", NULL};
    static const char *const k_alpaca[] = {"instruction", "input", "output", "system", "history", NULL};
    convo c = {0};
    int rc = QT_OK;
    if (fmt == DL_FORMAT_MESSAGES) {
        check_keys(e, obj, "", k_messages, fmt);
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(obj, "messages");
        if (cJSON_IsArray(arr) && cJSON_GetArraySize(arr) == 0) rc = QT_ERR(QT_EFORMAT, "\"messages\" is empty");
        if (rc == QT_OK) rc = read_messages(e, &c, arr, "messages", 0);
        if (rc == QT_OK) rc = convo_tools(&c, obj);
    } else if (fmt == DL_FORMAT_SHAREGPT) {
        check_keys(e, obj, "", k_sharegpt, fmt);
        rc = read_sharegpt(e, &c, obj);
        if (rc == QT_OK && c.n == 0) rc = QT_ERR(QT_EFORMAT, "\"conversations\" is empty");
        if (rc == QT_OK) rc = convo_tools(&c, obj);
    } else {
        check_keys(e, obj, "", k_alpaca, fmt);
        rc = read_alpaca(&c, obj);
    }
    if (rc == QT_OK) rc = dl_fmt_put_chat(e->ctx, out, &c, NULL);
    dl_fmt_convo_free(&c);
    return rc;
}

/* TRL's prompt/completion. Both strings: plain text, the completion (and an
 * <|endoftext|> after it, TRL's appended EOS) labelled, encoded in one call
 * as TRL tokenizes prompt + completion. Message lists (TRL's conversational
 * form): the chat template over prompt + completion, labels on the
 * completion's assistant turns only. */
static int encode_prompt_completion(const enc_call *e, const cJSON *obj, dl_tokbuf *out) {
    static const char *const known[] = {"prompt", "completion", NULL};
    check_keys(e, obj, "", known, DL_FORMAT_PROMPT_COMPLETION);
    const dl_encode_ctx *ctx = e->ctx;
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(obj, "prompt");
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(obj, "completion");
    if (cJSON_IsArray(p)) {
        convo c = {0};
        int rc = read_messages(e, &c, p, "prompt", 1);
        if (rc == QT_OK && cJSON_IsArray(q)) rc = read_messages(e, &c, q, "completion", 0);
        else if (rc == QT_OK && cJSON_IsString(q)) rc = dl_fmt_convo_add(&c, "assistant", q->valuestring, NULL, 0);
        else if (rc == QT_OK) rc = QT_ERR(QT_EFORMAT, "\"completion\" must be a string or a list of messages");
        if (rc == QT_OK) rc = dl_fmt_put_chat(ctx, out, &c, NULL);
        dl_fmt_convo_free(&c);
        return rc;
    }
    if (!cJSON_IsString(p) || !cJSON_IsString(q))
        return QT_ERR(QT_EFORMAT, "\"prompt\" and \"completion\" must both be strings, or both lists of messages");
    /* each part as the encoder sees it (copied only when that changes it),
     * joined; the completion's bytes are the labelled region */
    char *cp = NULL, *cq = NULL;
    const char *sp = p->valuestring, *sq = q->valuestring;
    size_t np = strlen(sp), nq = strlen(sq), n0 = out->n;
    int rc = QT_OK;
    if (!bpe_is_normal(ctx->tok, sp, np) && (rc = bpe_normalize(ctx->tok, sp, np, &cp, &np)) == QT_OK) sp = cp;
    if (rc == QT_OK && !bpe_is_normal(ctx->tok, sq, nq) && (rc = bpe_normalize(ctx->tok, sq, nq, &cq, &nq)) == QT_OK)
        sq = cq;
    char *all = rc == QT_OK ? qt_malloc(np + nq + 1, "a prompt and completion") : NULL;
    if (rc == QT_OK && !all) rc = QT_ENOMEM;
    if (rc == QT_OK) {
        memcpy(all, sp, np);
        memcpy(all + np, sq, nq);
        all[np + nq] = 0;
        qt_free(cp);
        qt_free(cq);
        cp = cq = NULL;
        const bpe_span completion = {np, SIZE_MAX};
        rc = bpe_encode_marked(ctx->tok, all, np + nq, &completion, 1, &out->ids, &out->mask, &out->n, &out->cap);
    }
    if (rc == QT_OK && !ctx->mask_prompt) memset(out->mask + n0, 1, out->n - n0);
    if (rc == QT_OK) rc = dl_fmt_put_special(ctx, out, "<|endoftext|>", 1);
    qt_free(all);
    qt_free(cp);
    qt_free(cq);
    return rc;
}

/* An integer-valued number in [lo, hi), or an error naming key[i]. */
int dl_fmt_check_id(double d, const char *key, int i, double lo, double hi, int32_t *out) {
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
    return dl_fmt_check_id(v->valuedouble, key, i, lo, hi, out);
}

/* The label rule of the tokens format: -100 or the id itself. */
int dl_fmt_check_label(int32_t lab, int32_t id, int i, uint8_t *m) {
    *m = 1;
    if (lab == QT_IGNORE_INDEX) *m = 0;
    else if (lab != id)
        return QT_ERR(QT_EFORMAT, "labels[%d] = %d is neither -100 nor input_ids[%d] = %d; qtune reads labels in "
                      "HF's unshifted sense (the label of token t is token t) and shifts them itself",
                      i, lab, i, id);
    return QT_OK;
}

int dl_fmt_encode_tokens(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out) {
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
            QT_TRY(dl_fmt_check_label(lab, id, i, &m));
            l = l->next;
        }
        out->ids[out->n + (size_t)i] = id;
        out->mask[out->n + (size_t)i] = m;
    }
    out->n += (size_t)n;
    return QT_OK;
}

int dl_fmt_encode_obj(const enc_call *e, dl_format fmt, const cJSON *obj, dl_tokbuf *out) {
    static const char *const k_text[] = {"text", NULL};
    static const char *const k_tokens[] = {"input_ids", "labels", NULL};
    const dl_encode_ctx *ctx = e->ctx;
    if (!cJSON_IsObject(obj)) return QT_ERR(QT_EFORMAT, "the line is not a JSON object");
    size_t n0 = out->n;
    int rc = fmt == DL_FORMAT_TOKENS ? QT_OK : need_tokenizer(ctx, fmt);
    if (rc == QT_OK) {
        switch (fmt) {
        case DL_FORMAT_TEXT:
            check_keys(e, obj, "", k_text, fmt);
            rc = encode_text(ctx, obj, out);
            break;
        case DL_FORMAT_MESSAGES:
        case DL_FORMAT_SHAREGPT:
        case DL_FORMAT_ALPACA: rc = encode_convo(e, fmt, obj, out); break;
        case DL_FORMAT_PROMPT_COMPLETION: rc = encode_prompt_completion(e, obj, out); break;
        case DL_FORMAT_TOKENS:
            check_keys(e, obj, "", k_tokens, fmt);
            rc = dl_fmt_encode_tokens(ctx, obj, out);
            break;
        default: rc = QT_ERR(QT_EINVAL, "no data format chosen"); break;
        }
    }
    if (rc != QT_OK) out->n = n0; /* drop a half-written example */
    return rc;
}

int dl_encode_example(const dl_encode_ctx *ctx, dl_format fmt, const cJSON *obj, dl_tokbuf *out) {
    enc_call e = {ctx, 0};
    return dl_fmt_encode_obj(&e, fmt, obj, out);
}

uint64_t dl_template_hash(void) {
    /* Bump the string when the rendering or masking rules here or in
     * text/chat.c change; the default system prompt is hashed with it. */
    static const char rules[] = "v4 (tools, tool_calls, weight 0, sharegpt, prompt_completion, alpaca system and "
                                "history; \\u0000 refused): chat_encode (Qwen2.5 ChatML, whole-text encode, span "
                                "labels: assistant content + <|im_end|>); text + <|endoftext|>; alpaca: "
                                "instruction\\n\\ninput as user; default system: " CHAT_DEFAULT_SYSTEM;
    uint64_t h = 1469598103934665603ull;
    for (const char *p = rules; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}
