/* ChatML rendering (Qwen2.5's template) and tokenization with labels.
 *
 * chat_encode renders the whole conversation and encodes it in one call, so
 * its ids are always those of the rendered string (as HF's
 * apply_chat_template + encode give); labels come from each token's byte span
 * against the assistant regions recorded while rendering (bpe_encode_marked:
 * a byte a token, no span array). Contents are cleaned (U+FFFD) and NFC'd
 * before rendering so that the encoder changes nothing and the spans are
 * exact byte offsets; a content that needs neither is used as it is, not
 * copied, so a conversation costs its rendered text plus its ids and marks. */
#include "text/chat.h"
#include "text/chat_template.h"
#include "text/jinja.h"

#include "core/error.h"
#include "core/mem.h"
#include "core/strbuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int puts_(qt_strbuf *b, const char *s) { return qt_strbuf_put(b, s, strlen(s)); }

typedef bpe_span region; /* a labelled byte range of the rendered text */

static const char TOOLS_HEAD[] = "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char TOOLS_TAIL[] = "\n</tools>\n\nFor each function call, return a json object with function name and "
                                 "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                                 "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

static int add_region(region **regs, size_t *nregs, size_t start, size_t end) {
    region *g = qt_realloc(*regs, (*nregs + 1) * sizeof *g, "chat label regions");
    if (!g) return QT_ENOMEM;
    *regs = g;
    g[(*nregs)++] = (region){start, end};
    return QT_OK;
}

/* An assistant turn with tool calls (the template's second branch): no "\n"
 * after the role when there is no content. Its label starts where a
 * generation prompt "<|im_start|>assistant\n" would leave off: at the
 * content, or at the first <tool_call>. */
static int render_tool_turn(const char *content, const char *calls, int label, qt_strbuf *b, region **regs,
                            size_t *nregs) {
    QT_TRY(puts_(b, "<|im_start|>assistant"));
    size_t start = b->n + 1;
    if (content && content[0]) {
        QT_TRY(puts_(b, "\n"));
        QT_TRY(puts_(b, content));
    }
    QT_TRY(puts_(b, calls));
    QT_TRY(puts_(b, "<|im_end|>"));
    if (regs && label) QT_TRY(add_region(regs, nregs, start, b->n));
    return puts_(b, "\n");
}

/* Renders; contents[i] / calls[i] / tools_clean override msgs[i].content,
 * msgs[i].tool_calls and tools when given (the cleaned text); sys is the
 * default system prompt (the model family's) when the first message is not
 * a system one. Labelled regions (assistant content + <|im_end|>) go to *regs. */
static int render(const chat_message *msgs, size_t n, const char *const *contents, const char *const *calls, const char *tools,
                  int gen, const char *sys, qt_strbuf *b, region **regs, size_t *nregs) {
    for (size_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")))
            return QT_ERR(QT_EINVAL, "message %zu has role \"%s\"; the ChatML template knows system, user, assistant and tool", i,
                          r ? r : "(none)");
        int has_calls = msgs[i].tool_calls && msgs[i].tool_calls[0] && !strcmp(r, "assistant");
        if (!msgs[i].content && !has_calls) return QT_ERR(QT_EINVAL, "message %zu (%s) has no content", i, r);
    }
#define C(i) (contents ? contents[i] : msgs[i].content)
#define K(i) (calls && calls[i] ? calls[i] : msgs[i].tool_calls)
    size_t first = 0;
    const int sys0 = n && !strcmp(msgs[0].role, "system");
    QT_TRY(puts_(b, "<|im_start|>system\n"));
    QT_TRY(puts_(b, sys0 ? C(0) : sys));
    first = sys0 ? 1 : 0;
    if (tools) {
        QT_TRY(puts_(b, TOOLS_HEAD));
        QT_TRY(puts_(b, tools));
        QT_TRY(puts_(b, TOOLS_TAIL));
    } else {
        QT_TRY(puts_(b, "<|im_end|>\n"));
    }
    for (size_t i = first; i < n; i++) {
        const char *r = msgs[i].role;
        if (!strcmp(r, "tool")) {
            if (i == 0 || strcmp(msgs[i - 1].role, "tool")) QT_TRY(puts_(b, "<|im_start|>user"));
            QT_TRY(puts_(b, "\n<tool_response>\n"));
            QT_TRY(puts_(b, C(i)));
            QT_TRY(puts_(b, "\n</tool_response>"));
            if (i + 1 == n || strcmp(msgs[i + 1].role, "tool")) QT_TRY(puts_(b, "<|im_end|>\n"));
            continue;
        }
        const int assistant = !strcmp(r, "assistant");
        if (assistant && K(i) && K(i)[0]) {
            QT_TRY(render_tool_turn(C(i), K(i), !msgs[i].no_label, b, regs, nregs));
            continue;
        }
        QT_TRY(puts_(b, "<|im_start|>"));
        QT_TRY(puts_(b, r));
        QT_TRY(puts_(b, "\n"));
        size_t start = b->n;
        QT_TRY(puts_(b, C(i)));
        QT_TRY(puts_(b, "<|im_end|>"));
        if (regs && assistant && !msgs[i].no_label) QT_TRY(add_region(regs, nregs, start, b->n));
        QT_TRY(puts_(b, "\n"));
    }
    if (gen) QT_TRY(puts_(b, "<|im_start|>assistant\n"));
#undef C
#undef K
    return QT_OK;
}

static int render_text(const chat_message *msgs, size_t n, const char *tools, int add_generation_prompt, const char *sys,
                       char **out, size_t *len) {
    qt_strbuf b = {0};
    int rc = qt_strbuf_put(&b, "", 0);
    if (rc == QT_OK) rc = render(msgs, n, NULL, NULL, tools, add_generation_prompt, sys, &b, NULL, NULL);
    if (rc != QT_OK) {
        qt_free(b.p);
        return rc;
    }
    *out = b.p;
    if (len) *len = b.n;
    return QT_OK;
}

int chat_render(const chat_message *msgs, size_t n, int add_generation_prompt, char **out, size_t *len) {
    return render_text(msgs, n, NULL, add_generation_prompt, CHAT_DEFAULT_SYSTEM, out, len);
}

int chat_render_tools(const chat_message *msgs, size_t n, const char *tools, int add_generation_prompt, char **out,
                      size_t *len) {
    return render_text(msgs, n, tools, add_generation_prompt, CHAT_DEFAULT_SYSTEM, out, len);
}

int chat_render_tok(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                    int add_generation_prompt, char **out, size_t *len) {
    if (bpe_chat_template(t)) /* the folder's own template */
        return chat_template_render(bpe_chat_template(t), msgs, n, tools, add_generation_prompt, out, len, NULL, NULL);
    return render_text(msgs, n, tools, add_generation_prompt, bpe_chat_system(t), out, len);
}

int chat_encode(const bpe_tokenizer *t, const chat_message *msgs, size_t n, int add_generation_prompt, int32_t **ids,
                int32_t **labels, size_t *n_ids, size_t *cap) {
    return chat_encode_tools(t, msgs, n, NULL, add_generation_prompt, ids, labels, n_ids, cap);
}

/* s as the encoder would see it (bpe_normalize): *use is s itself when that
 * changes nothing (the usual case: no copy), else a copy in *owned. */
static int normal_text(const bpe_tokenizer *t, const char *s, char **owned, const char **use) {
    *owned = NULL;
    *use = s;
    if (!s) return QT_OK;
    size_t len = strlen(s), l;
    if (bpe_is_normal(t, s, len)) return QT_OK;
    QT_TRY(bpe_normalize(t, s, len, owned, &l));
    *use = *owned;
    return QT_OK;
}

int chat_encode_mask(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                     int add_generation_prompt, int32_t **ids, uint8_t **mask, size_t *n_ids, size_t *cap) {
    if (bpe_chat_template(t))
        return chat_template_encode_mask(t, bpe_chat_template(t), msgs, n, tools, add_generation_prompt, ids, mask, n_ids, cap);
    /* (2n) contents, then tool calls, as the encoder sees them; owned: the copies among them */
    const char **use = n ? qt_calloc(2 * n, sizeof *use, "chat contents") : NULL;
    char **owned = n ? qt_calloc(2 * n, sizeof *owned, "chat contents") : NULL;
    char *tools_owned = NULL;
    const char *tools_use = NULL;
    qt_strbuf b = {0};
    region *regs = NULL;
    size_t nregs = 0;
    int rc = n && (!use || !owned) ? QT_ENOMEM : qt_strbuf_put(&b, "", 0);
    /* a missing content stays missing (render names it, or renders a tool
     * call turn without one) */
    for (size_t i = 0; i < n && rc == QT_OK; i++) {
        rc = normal_text(t, msgs[i].content, &owned[i], &use[i]);
        if (rc == QT_OK) rc = normal_text(t, msgs[i].tool_calls, &owned[n + i], &use[n + i]);
    }
    if (rc == QT_OK) rc = normal_text(t, tools, &tools_owned, &tools_use);
    if (rc == QT_OK)
        rc = render(msgs, n, use, use + n, tools_use, add_generation_prompt, bpe_chat_system(t), &b, &regs, &nregs);
    /* the rendered text holds every content now: the copies can go before
     * the ids grow */
    for (size_t i = 0; owned && i < 2 * n; i++) qt_free(owned[i]);
    qt_free(owned);
    qt_free(use);
    qt_free(tools_owned);
    if (rc == QT_OK) rc = bpe_encode_marked(t, b.p, b.n, regs, nregs, ids, mask, n_ids, cap);
    qt_free(regs);
    qt_free(b.p);
    return rc;
}

/* The in-place encoding: each turn is "<|im_start|>", then "ROLE\n" +
 * content where the content lies (the header written into its room), then
 * "<|im_end|>\n"; each a text of its own. That is the rendered text's
 * encoding when every cut falls right before a ChatML token that the
 * rendered text's scan matches there (bpe_cut_before_added), and the
 * contents need no cleaning: checked first, else 0 (render instead). */
static const char *head_of(const char *role) {
    return !strcmp(role, "system") ? "system\n" : !strcmp(role, "user") ? "user\n" : !strcmp(role, "assistant") ? "assistant\n" : NULL;
}

static int turns_separable(const bpe_tokenizer *t, const chat_message *msgs, size_t n, char *const *contents) {
    char next[64];
    for (size_t i = 0; i < n; i++) {
        const char *h = head_of(msgs[i].role);
        if (!h || msgs[i].tool_calls || contents[i] != msgs[i].content || strlen(h) > CHAT_HEAD_ROOM) return 0;
        size_t cl = strlen(contents[i]);
        if (!bpe_is_normal(t, contents[i], cl)) return 0;
        /* before this turn's <|im_start|>: after "<|im_end|>\n" (the scan is past the <|im_end|>) */
        snprintf(next, sizeof next, "<|im_start|>%s", h);
        if (!bpe_cut_before_added(t, "\n", 1, next, strlen(next))) return 0;
        /* before its <|im_end|>: after the header and the content (the header is written by then) */
        size_t hl = strlen(h);
        memcpy(contents[i] - hl, h, hl);
        snprintf(next, sizeof next, "<|im_end|>\n%s%s", i + 1 < n ? "<|im_start|>" : "",
                 i + 1 < n && head_of(msgs[i + 1].role) ? head_of(msgs[i + 1].role) : "");
        if (!bpe_cut_before_added(t, contents[i] - hl, hl + cl, next, strlen(next))) return 0;
    }
    return 1;
}

static int put_text_marked(const bpe_tokenizer *t, const char *s, size_t len, size_t label_from, size_t label_to,
                           int32_t **ids, uint8_t **mask, size_t *n_ids, size_t *cap) {
    const bpe_span r = {label_from, label_to};
    return bpe_encode_marked(t, s, len, &r, label_from < label_to, ids, mask, n_ids, cap);
}

int chat_encode_mask_in_place(const bpe_tokenizer *t, const chat_message *msgs, size_t n, char *const *contents,
                              int32_t **ids, uint8_t **mask, size_t *n_ids, size_t *cap) {
    if (!n || bpe_chat_template(t) || !turns_separable(t, msgs, n, contents))
        return chat_encode_mask(t, msgs, n, NULL, 0, ids, mask, n_ids, cap);
    if (strcmp(msgs[0].role, "system")) { /* the default system turn, as render writes it */
        qt_strbuf b = {0};
        int rc = qt_strbuf_put(&b, "<|im_start|>system\n", 19);
        if (rc == QT_OK) rc = puts_(&b, bpe_chat_system(t));
        if (rc == QT_OK) rc = puts_(&b, "<|im_end|>\n");
        if (rc == QT_OK) rc = put_text_marked(t, b.p, b.n, 0, 0, ids, mask, n_ids, cap);
        qt_free(b.p);
        QT_TRY(rc);
    }
    for (size_t i = 0; i < n; i++) {
        const int label = !strcmp(msgs[i].role, "assistant") && !msgs[i].no_label;
        size_t hl = strlen(head_of(msgs[i].role)), cl = strlen(contents[i]);
        QT_TRY(put_text_marked(t, "<|im_start|>", 12, 0, 0, ids, mask, n_ids, cap));
        QT_TRY(put_text_marked(t, contents[i] - hl, hl + cl, label ? hl : 0, label ? SIZE_MAX : 0, ids, mask, n_ids, cap));
        QT_TRY(put_text_marked(t, "<|im_end|>\n", 11, 0, label ? 10 : 0, ids, mask, n_ids, cap));
    }
    return QT_OK;
}

int chat_encode_tools(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                      int add_generation_prompt, int32_t **ids, int32_t **labels, size_t *n_ids, size_t *cap) {
    /* this conversation's ids and marks in arrays of their own, then
     * appended; *labels follows *ids' capacity */
    int32_t *new_ids = NULL;
    uint8_t *marks = NULL;
    size_t base = *n_ids, ncap = *cap, nn = 0, ncap2 = 0;
    int rc = chat_encode_mask(t, msgs, n, tools, add_generation_prompt, &new_ids, &marks, &nn, &ncap2);
    if (rc == QT_OK && base + nn > ncap) {
        size_t c = ncap ? ncap : 64;
        while (c < base + nn) c *= 2;
        int32_t *gi = qt_realloc(*ids, c * sizeof *gi, "token ids");
        if (gi) *ids = gi;
        int32_t *gl = gi ? qt_realloc(*labels, c * sizeof *gl, "token labels") : NULL;
        if (gl) *labels = gl;
        if (!gi || !gl) rc = QT_ENOMEM;
        else *cap = c;
    } else if (rc == QT_OK && !*labels && ncap) {
        *labels = qt_malloc(ncap * sizeof **labels, "token labels");
        if (!*labels) rc = QT_ENOMEM;
    }
    if (rc == QT_OK) {
        for (size_t k = 0; k < nn; k++) {
            (*ids)[base + k] = new_ids[k];
            (*labels)[base + k] = marks[k] ? new_ids[k] : CHAT_IGNORE_INDEX;
        }
        *n_ids = base + nn;
    }
    qt_free(new_ids);
    qt_free(marks);
    return rc;
}


static int finish_text(qt_strbuf *b, int rc, char **out) {
    if (rc == QT_OK) rc = qt_strbuf_put(b, "", 0);
    if (rc != QT_OK) {
        qt_free(b->p);
        return rc;
    }
    *out = b->p;
    return QT_OK;
}

int chat_tool_calls_text(const cJSON *tool_calls, char **out) {
    *out = NULL;
    if (!cJSON_IsArray(tool_calls)) return QT_ERR(QT_EFORMAT, "\"tool_calls\" must be an array of calls");
    qt_strbuf b = {0};
    int rc = QT_OK, i = 0;
    for (const cJSON *call = tool_calls->child; call && rc == QT_OK; call = call->next, i++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(call, "function");
        const cJSON *c = cJSON_IsObject(f) ? f : call; /* the template: tool_call.function when defined */
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(c, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(c, "arguments");
        if (!cJSON_IsString(name)) rc = QT_ERR(QT_EFORMAT, "tool_calls[%d] has no string \"name\"", i);
        else if (!args) rc = QT_ERR(QT_EFORMAT, "tool_calls[%d] (%s) has no \"arguments\"", i, name->valuestring);
        if (rc == QT_OK) rc = puts_(&b, "\n<tool_call>\n{\"name\": \"");
        if (rc == QT_OK) rc = puts_(&b, name->valuestring);
        if (rc == QT_OK) rc = puts_(&b, "\", \"arguments\": ");
        if (rc == QT_OK) rc = jinja_tojson(args, &b);
        if (rc == QT_OK) rc = puts_(&b, "}\n</tool_call>");
    }
    return finish_text(&b, rc, out);
}

int chat_tools_text(const cJSON *tools, char **out) {
    *out = NULL;
    if (!cJSON_IsArray(tools)) return QT_ERR(QT_EFORMAT, "\"tools\" must be an array of tool definitions");
    qt_strbuf b = {0};
    int rc = QT_OK;
    for (const cJSON *t = tools->child; t && rc == QT_OK; t = t->next) {
        rc = puts_(&b, "\n");
        if (rc == QT_OK) rc = jinja_tojson(t, &b);
    }
    return finish_text(&b, rc, out);
}
