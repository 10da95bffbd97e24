/* A model folder's own chat template: loading, rendering with
 * apply_chat_template's variables, and the label ranges (chat_template.h
 * says the rule and why). */
#include "text/chat_template.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "core/strbuf.h"
#include "text/bpe_impl.h"
#include "text/jinja.h"

#include <stdio.h>
#include <string.h>

struct chat_template {
    char *text;
    char *source;
    jinja_template *tmpl; /* NULL when it did not parse */
    char *error;          /* why it cannot render, or NULL */
    cJSON *vars;          /* bos_token, eos_token, ... and chat_template_set_var's */
    char *gen;            /* the generation prompt (see chat_template.h), or NULL where none was found */
};

#define MAX_CONFIG (64u << 20)

/* The tokenizer's template (bpe_impl.h's tmpl, tokenizer.h's accessors): owned by the tokenizer, freed with
 * it (tokenizer_folder.c), replaced here. */
const struct chat_template *bpe_chat_template(const bpe_tokenizer *t) { return t ? t->tmpl : NULL; }
struct chat_template *bpe_chat_template_mut(bpe_tokenizer *t) { return t ? t->tmpl : NULL; }
void bpe_set_chat_template(bpe_tokenizer *t, struct chat_template *ct) {
    chat_template_free(t->tmpl);
    t->tmpl = ct;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *p = qt_malloc(n + 1, "chat template text");
    if (p) memcpy(p, s, n + 1);
    return p;
}

/* The special tokens apply_chat_template passes: tokenizer_config.json's
 * bos_token, eos_token, unk_token, pad_token (a string or {"content": ...}). */
static int special_tokens(const char *dir, cJSON *vars) {
    char path[4096];
    if (!dir || qt_path_join(path, sizeof path, dir, "tokenizer_config.json") != QT_OK || !qt_path_exists(path)) {
        qt_error_clear();
        return QT_OK;
    }
    char *buf;
    size_t len;
    QT_TRY(qt_read_file(path, MAX_CONFIG, &buf, &len));
    cJSON *cfg = cJSON_ParseWithLength(buf, len);
    qt_free(buf);
    if (!cfg) return QT_ERR(QT_EFORMAT, "%s is not valid JSON; re-download the model's tokenizer files", path);
    static const char *const names[] = {"bos_token", "eos_token", "unk_token", "pad_token", NULL};
    for (int i = 0; names[i]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, names[i]);
        if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(v) && !cJSON_AddStringToObject(vars, names[i], v->valuestring)) {
            cJSON_Delete(cfg);
            return QT_ENOMEM;
        }
    }
    cJSON_Delete(cfg);
    return QT_OK;
}

static int find_gen_prompt(chat_template *ct);

int chat_template_from_text(const char *text, size_t len, const char *source, const char *dir, chat_template **out) {
    *out = NULL;
    chat_template *ct = qt_calloc(1, sizeof *ct, "a chat template");
    if (!ct) return QT_ENOMEM;
    ct->text = qt_malloc(len + 1, "chat template text");
    ct->source = dup_str(source);
    ct->vars = cJSON_CreateObject();
    int rc = ct->text && ct->source && ct->vars ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) {
        memcpy(ct->text, text, len);
        ct->text[len] = 0;
        rc = special_tokens(dir, ct->vars);
    }
    if (rc == QT_OK && jinja_parse(text, len, &ct->tmpl) != QT_OK) {
        /* kept, not returned: a folder used for plain text must still load */
        if (qt_error_code() == QT_ENOMEM) rc = QT_ENOMEM;
        else {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s (%s) cannot be rendered by qtune: %s", source, dir ? dir : "given file",
                     qt_error_message());
            qt_error_clear();
            if (!(ct->error = dup_str(msg))) rc = QT_ENOMEM;
        }
    }
    if (rc == QT_OK && ct->tmpl) rc = find_gen_prompt(ct);
    if (rc != QT_OK) {
        chat_template_free(ct);
        return rc;
    }
    *out = ct;
    return QT_OK;
}

int chat_template_load_dir(const char *dir, chat_template **out) {
    *out = NULL;
    char path[4096];
    char *buf = NULL;
    size_t len;
    if (qt_path_join(path, sizeof path, dir, "chat_template.jinja") == QT_OK && qt_path_exists(path)) {
        QT_TRY(qt_read_file(path, MAX_CONFIG, &buf, &len));
        int rc = chat_template_from_text(buf, len, "chat_template.jinja", dir, out);
        qt_free(buf);
        return rc;
    }
    qt_error_clear();
    if (qt_path_join(path, sizeof path, dir, "tokenizer_config.json") != QT_OK || !qt_path_exists(path)) {
        qt_error_clear();
        return QT_OK;
    }
    QT_TRY(qt_read_file(path, MAX_CONFIG, &buf, &len));
    cJSON *cfg = cJSON_ParseWithLength(buf, len);
    qt_free(buf);
    if (!cfg) return QT_ERR(QT_EFORMAT, "%s is not valid JSON; re-download the model's tokenizer files", path);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    const char *source = "tokenizer_config.json's chat_template";
    if (cJSON_IsArray(t)) { /* [{name, template}]: apply_chat_template's default is the one named "default" */
        const cJSON *pick = NULL;
        for (const cJSON *e = t->child; e; e = e->next) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default")) pick = cJSON_GetObjectItemCaseSensitive(e, "template");
        }
        t = pick;
        source = "tokenizer_config.json's chat_template named \"default\"";
    }
    int rc = QT_OK;
    if (cJSON_IsString(t)) rc = chat_template_from_text(t->valuestring, strlen(t->valuestring), source, dir, out);
    else if (t && !cJSON_IsNull(t))
        rc = QT_ERR(QT_EFORMAT, "%s: \"chat_template\" must be a string or a list of {\"name\", \"template\"} with one named "
                    "\"default\"", path);
    cJSON_Delete(cfg);
    return rc;
}

int chat_template_override(bpe_tokenizer *t, const char *arg, const char *dir) {
    if (!strcmp(arg, "chatml")) {
        bpe_set_chat_template(t, NULL);
        return QT_OK;
    }
    char *buf;
    size_t len;
    chat_template *ct;
    QT_TRY(qt_error_context(qt_read_file(arg, MAX_CONFIG, &buf, &len), "--chat-template"));
    char source[4200];
    snprintf(source, sizeof source, "the chat template %s", arg);
    int rc = chat_template_from_text(buf, len, source, dir, &ct);
    qt_free(buf);
    if (rc == QT_OK) bpe_set_chat_template(t, ct);
    return rc;
}

void chat_template_free(chat_template *ct) {
    if (!ct) return;
    jinja_free(ct->tmpl);
    cJSON_Delete(ct->vars);
    qt_free(ct->text);
    qt_free(ct->source);
    qt_free(ct->error);
    qt_free(ct->gen);
    qt_free(ct);
}

uint64_t chat_template_hash(const chat_template *ct) {
    char *v = cJSON_PrintUnformatted(ct->vars);
    uint64_t h = bpe_hash_bytes(ct->text, strlen(ct->text)) ^ (v ? bpe_hash_bytes(v, strlen(v)) * 31 : 0);
    cJSON_free(v);
    return h;
}

const char *chat_template_source(const chat_template *ct) { return ct->source; }
const char *chat_template_error(const chat_template *ct) { return ct->error; }
const char *chat_template_text(const chat_template *ct) { return ct->text; }

int chat_template_set_var(chat_template *ct, const char *name, const cJSON *value) {
    cJSON *v = cJSON_Duplicate(value, 1);
    if (!v) return QT_ENOMEM;
    if (cJSON_HasObjectItem(ct->vars, name)) cJSON_ReplaceItemInObjectCaseSensitive(ct->vars, name, v);
    else cJSON_AddItemToObject(ct->vars, name, v);
    return ct->tmpl ? find_gen_prompt(ct) : QT_OK;
}

/* ---- rendering ---- */

/* tools / tool calls come as the ChatML path's text (chat_tools_text,
 * chat_tool_calls_text): json.dumps output, so reading it back gives the
 * values again */
static int tools_json(const char *tools, cJSON *arr) {
    for (const char *p = tools; p && *p;) {
        if (*p == '\n') {
            p++;
            continue;
        }
        const char *end = NULL;
        cJSON *t = cJSON_ParseWithOpts(p, &end, 0);
        if (!t) return QT_ERR(QT_EFORMAT, "a tool definition is not JSON");
        cJSON_AddItemToArray(arr, t);
        p = end;
    }
    return QT_OK;
}

static int calls_json(const char *calls, cJSON *arr) {
    static const char open[] = "<tool_call>\n";
    for (const char *p = calls ? strstr(calls, open) : NULL; p; p = strstr(p, open)) {
        p += sizeof open - 1;
        const char *end = NULL;
        cJSON *call = cJSON_ParseWithOpts(p, &end, 0);
        if (!call) return QT_ERR(QT_EFORMAT, "a tool call is not JSON");
        cJSON *wrap = cJSON_CreateObject();
        if (!wrap || !cJSON_AddStringToObject(wrap, "type", "function")) {
            cJSON_Delete(call);
            cJSON_Delete(wrap);
            return QT_ENOMEM;
        }
        cJSON_AddItemToObject(wrap, "function", call);
        cJSON_AddItemToArray(arr, wrap);
        p = end;
    }
    return QT_OK;
}

static int build_vars(const chat_template *ct, const chat_message *msgs, size_t n, const char *const *contents,
                      const char *tools, int gen, cJSON **out) {
    cJSON *v = cJSON_Duplicate(ct->vars, 1), *arr = cJSON_CreateArray();
    int rc = v && arr ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) cJSON_AddItemToObject(v, "messages", arr);
    else cJSON_Delete(arr);
    for (size_t i = 0; rc == QT_OK && i < n; i++) {
        const char *r = msgs[i].role, *content = contents ? contents[i] : msgs[i].content;
        cJSON *m = cJSON_CreateObject();
        if (!m) rc = QT_ENOMEM;
        else {
            cJSON_AddItemToArray(arr, m);
            /* the content is referenced, not copied: a message may be the whole of a 45 MB line, which the
             * caller keeps until the render ends */
            cJSON *c = cJSON_AddStringToObject(m, "role", r ? r : "") ? cJSON_CreateStringReference(content ? content : "")
                                                                       : NULL;
            if (!c) rc = QT_ENOMEM;
            else cJSON_AddItemToObject(m, "content", c);
        }
        if (rc == QT_OK && msgs[i].tool_calls && msgs[i].tool_calls[0]) {
            cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls");
            rc = calls ? calls_json(msgs[i].tool_calls, calls) : QT_ENOMEM;
        }
    }
    if (rc == QT_OK && tools && tools[0]) {
        cJSON *t = cJSON_AddArrayToObject(v, "tools");
        rc = t ? tools_json(tools, t) : QT_ENOMEM;
    }
    if (rc == QT_OK && !cJSON_AddBoolToObject(v, "add_generation_prompt", gen)) rc = QT_ENOMEM;
    if (rc != QT_OK) {
        cJSON_Delete(v);
        return rc;
    }
    *out = v;
    return QT_OK;
}

static int render_raw(const chat_template *ct, const chat_message *msgs, size_t n, const char *const *contents,
                      const char *tools, int gen, char **out, size_t *len, jinja_item_span **spans, size_t *nspans) {
    if (ct->error) return QT_ERR(QT_EUNSUPPORTED, "%s", ct->error);
    for (size_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r) return QT_ERR(QT_EINVAL, "message %zu has no role", i);
        int has_calls = msgs[i].tool_calls && msgs[i].tool_calls[0];
        if (!msgs[i].content && !has_calls) return QT_ERR(QT_EINVAL, "message %zu (%s) has no content", i, r);
    }
    cJSON *vars;
    QT_TRY(build_vars(ct, msgs, n, contents, tools, gen, &vars));
    int rc = jinja_render(ct->tmpl, vars, "messages", out, len, spans, nspans);
    cJSON_Delete(vars);
    if (rc != QT_OK) rc = qt_error_context(rc, "rendering %s", ct->source);
    return rc;
}

/* The generation prompt: what add_generation_prompt appends to a one-user-
 * message conversation. NULL (no labels can be placed) where the render with
 * it does not extend the one without. */
static int find_gen_prompt(chat_template *ct) {
    /* a user turn alone, else after a system turn (for a template that insists on one) */
    const chat_message probes[2][2] = {{{.role = "user", .content = "Hi"}},
                                       {{.role = "system", .content = "S"}, {.role = "user", .content = "Hi"}}};
    qt_free(ct->gen);
    ct->gen = NULL;
    int rc = QT_OK;
    for (int k = 0; k < 2 && !ct->gen; k++) {
        char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        rc = render_raw(ct, probes[k], (size_t)k + 1, NULL, NULL, 0, &a, &na, NULL, NULL);
        if (rc == QT_OK) rc = render_raw(ct, probes[k], (size_t)k + 1, NULL, NULL, 1, &b, &nb, NULL, NULL);
        if (rc == QT_OK && nb > na && !memcmp(a, b, na)) {
            ct->gen = qt_malloc(nb - na + 1, "generation prompt");
            if (!ct->gen) rc = QT_ENOMEM;
            else {
                memcpy(ct->gen, b + na, nb - na);
                ct->gen[nb - na] = 0;
            }
        }
        qt_free(a);
        qt_free(b);
        if (rc == QT_ENOMEM) return rc;
    }
    qt_error_clear(); /* a template that refuses the probes still loads; a real render reports its own error */
    return QT_OK;
}

static const char *find_in(const char *hay, size_t n, const char *needle, size_t nn) {
    if (!nn || nn > n) return NULL;
    for (size_t i = 0; i + nn <= n; i++)
        if (!memcmp(hay + i, needle, nn)) return hay + i;
    return NULL;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The labelled range of one assistant turn text[s, e), or none (*from == *to). */
static int turn_label(const chat_template *ct, const char *text, size_t s, size_t e, size_t msg, size_t *from, size_t *to) {
    const char *g = ct->gen;
    size_t ng = g ? strlen(g) : 0;
    const char *at = NULL;
    size_t used = ng;
    /* the whole prompt, else its first line (the role's header: a turn that
     * does not begin as the prompt does, e.g. Qwen3's reasoning where the
     * prompt holds an empty think block) */
    if (used && !(at = find_in(text + s, e - s, g, used))) {
        const char *nl = memchr(g, '\n', ng);
        used = nl && (size_t)(nl - g) + 1 < ng ? (size_t)(nl - g) + 1 : 0;
        if (used) at = find_in(text + s, e - s, g, used);
    }
    if (!at)
        return QT_ERR(QT_EUNSUPPORTED, "%s: qtune cannot tell where the assistant's reply starts in message %zu's turn (the "
                      "template's generation prompt %s); such a template cannot mask the prompt", ct->source, msg,
                      g ? "does not occur in it" : "could not be found");
    size_t b = (size_t)(at - text) + used, en = e;
    while (en > b && is_ws(text[en - 1])) en--;
    *from = b;
    *to = en > b ? en : b;
    return QT_OK;
}

static int label_regions(const chat_template *ct, const chat_message *msgs, size_t n, const char *text,
                         const jinja_item_span *spans, size_t nspans, bpe_span **regs, size_t *nregs) {
    *regs = NULL;
    *nregs = 0;
    for (size_t k = 0; k < nspans; k++) {
        size_t i = spans[k].item;
        if (i >= n || strcmp(msgs[i].role, "assistant") || msgs[i].no_label) continue;
        size_t from = 0, to = 0;
        QT_TRY(turn_label(ct, text, spans[k].start, spans[k].end, i, &from, &to));
        if (from == to) continue;
        bpe_span *g = qt_realloc(*regs, (*nregs + 1) * sizeof *g, "chat label regions");
        if (!g) return QT_ENOMEM;
        *regs = g;
        g[(*nregs)++] = (bpe_span){from, to};
    }
    return QT_OK;
}

static int render_labelled(const chat_template *ct, const chat_message *msgs, size_t n, const char *const *contents,
                           const char *tools, int gen, char **out, size_t *len, bpe_span **regs, size_t *nregs) {
    jinja_item_span *spans = NULL;
    size_t nspans = 0;
    QT_TRY(render_raw(ct, msgs, n, contents, tools, gen, out, len, regs ? &spans : NULL, regs ? &nspans : NULL));
    int rc = regs ? label_regions(ct, msgs, n, *out, spans, nspans, regs, nregs) : QT_OK;
    qt_free(spans);
    if (rc != QT_OK) {
        qt_free(*out);
        *out = NULL;
        qt_free(regs ? *regs : NULL);
        if (regs) *regs = NULL;
    }
    return rc;
}

int chat_template_render(const chat_template *ct, const chat_message *msgs, size_t n, const char *tools,
                         int add_generation_prompt, char **out, size_t *len, bpe_span **regs, size_t *nregs) {
    return render_labelled(ct, msgs, n, NULL, tools, add_generation_prompt, out, len, regs, nregs);
}

int chat_template_encode_mask(const bpe_tokenizer *t, const chat_template *ct, const chat_message *msgs, size_t n,
                              const char *tools, int add_generation_prompt, int32_t **ids, uint8_t **mask,
                              size_t *n_ids, size_t *cap) {
    /* contents as the encoder sees them, so the ranges found in the text are the encoder's byte offsets */
    const char **use = n ? qt_calloc(n, sizeof *use, "chat contents") : NULL;
    char **owned = n ? qt_calloc(n, sizeof *owned, "chat contents") : NULL;
    int rc = n && (!use || !owned) ? QT_ENOMEM : QT_OK;
    for (size_t i = 0; i < n && rc == QT_OK; i++) {
        use[i] = msgs[i].content;
        const char *s = msgs[i].content;
        size_t l;
        if (s && !bpe_is_normal(t, s, strlen(s))) {
            rc = bpe_normalize(t, s, strlen(s), &owned[i], &l);
            use[i] = owned[i];
        }
    }
    char *text = NULL;
    size_t len = 0, nregs = 0;
    bpe_span *regs = NULL;
    if (rc == QT_OK) rc = render_labelled(ct, msgs, n, use, tools, add_generation_prompt, &text, &len, &regs, &nregs);
    for (size_t i = 0; owned && i < n; i++) qt_free(owned[i]);
    qt_free(owned);
    qt_free(use);
    if (rc == QT_OK) rc = bpe_encode_marked(t, text, len, regs, nregs, ids, mask, n_ids, cap);
    qt_free(regs);
    qt_free(text);
    return rc;
}

void chat_template_describe(const bpe_tokenizer *t, char *buf, size_t cap) {
    const chat_template *ct = bpe_chat_template(t);
    if (ct && ct->error) snprintf(buf, cap, "%s, which qtune cannot render (chat data is refused)", ct->source);
    else if (ct) snprintf(buf, cap, "the model's own: %s", ct->source);
    else
        snprintf(buf, cap, "ChatML with %s default system prompt \"%s\" (the model folder ships no chat template)",
                 bpe_is_tiktoken(t) ? "the original Qwen-Chat's" : "Qwen2.5's", bpe_chat_system(t));
}

int chat_show_labels(const bpe_tokenizer *t, const int32_t *ids, const uint8_t *mask, size_t n, char **out) {
    qt_strbuf b = {0};
    size_t labelled = 0;
    int rc = qt_strbuf_put(&b, "", 0);
    /* a run of tokens with the same mark decodes at once, so a character split over tokens prints whole */
    for (size_t i = 0, j; i < n && rc == QT_OK; i = j) {
        for (j = i; j < n && !mask[j] == !mask[i]; j++) labelled += mask[j] != 0;
        char *piece = NULL;
        size_t pl = 0;
        if (mask[i]) rc = qt_strbuf_put(&b, "[[", 2);
        if (rc == QT_OK) rc = bpe_decode(t, &ids[i], j - i, &piece, &pl);
        if (rc == QT_OK) rc = qt_strbuf_put(&b, piece, pl);
        qt_free(piece);
        if (rc == QT_OK && mask[i]) rc = qt_strbuf_put(&b, "]]", 2);
    }
    char tail[160];
    snprintf(tail, sizeof tail, "\n(%zu tokens, %zu labelled: the text between [[ and ]] carries labels)", n, labelled);
    if (rc == QT_OK) rc = qt_strbuf_put(&b, tail, strlen(tail));
    if (rc != QT_OK) {
        qt_free(b.p);
        return rc;
    }
    *out = b.p;
    return QT_OK;
}
