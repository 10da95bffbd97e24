/* ChatML rendering (Qwen2.5's template) and tokenization with labels.
 *
 * chat_encode renders the whole conversation and encodes it in one call, so
 * its ids are always those of the rendered string (as HF's
 * apply_chat_template + encode give); labels come from each token's byte span
 * against the assistant regions recorded while rendering. Contents are
 * cleaned (U+FFFD) and NFC'd before rendering so that the encoder changes
 * nothing and the spans are exact byte offsets. */
#include "text/chat.h"

#include "core/error.h"
#include "core/mem.h"
#include "core/strbuf.h"

#include <string.h>

static int puts_(qt_strbuf *b, const char *s) { return qt_strbuf_put(b, s, strlen(s)); }

typedef struct {
    size_t start, end;
} region;

/* Renders; contents[i] overrides msgs[i].content when given (the cleaned
 * text). Assistant regions (content + <|im_end|>) go to *regs. */
static int render(const chat_message *msgs, size_t n, char *const *contents, int gen, const char *sys, qt_strbuf *b,
                  region **regs, size_t *nregs) {
    for (size_t i = 0; i < n; i++) {
        const char *r = msgs[i].role;
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")))
            return QT_ERR(QT_EINVAL, "message %zu has role \"%s\"; the ChatML template knows system, user, assistant and tool", i,
                          r ? r : "(none)");
        if (!msgs[i].content) return QT_ERR(QT_EINVAL, "message %zu (%s) has no content", i, r);
    }
#define C(i) (contents ? contents[i] : msgs[i].content)
    size_t first = 0;
    QT_TRY(puts_(b, "<|im_start|>system\n"));
    if (n && !strcmp(msgs[0].role, "system")) {
        QT_TRY(puts_(b, C(0)));
        first = 1;
    } else {
        QT_TRY(puts_(b, sys));
    }
    QT_TRY(puts_(b, "<|im_end|>\n"));
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
        QT_TRY(puts_(b, "<|im_start|>"));
        QT_TRY(puts_(b, r));
        QT_TRY(puts_(b, "\n"));
        size_t start = b->n;
        QT_TRY(puts_(b, C(i)));
        QT_TRY(puts_(b, "<|im_end|>"));
        if (regs && !strcmp(r, "assistant")) {
            region *g = qt_realloc(*regs, (*nregs + 1) * sizeof *g, "chat label regions");
            if (!g) return QT_ENOMEM;
            *regs = g;
            g[(*nregs)++] = (region){start, b->n};
        }
        QT_TRY(puts_(b, "\n"));
    }
    if (gen) QT_TRY(puts_(b, "<|im_start|>assistant\n"));
#undef C
    return QT_OK;
}

static int render_text(const chat_message *msgs, size_t n, int add_generation_prompt, const char *sys, char **out,
                       size_t *len) {
    qt_strbuf b = {0};
    int rc = qt_strbuf_put(&b, "", 0);
    if (rc == QT_OK) rc = render(msgs, n, NULL, add_generation_prompt, sys, &b, NULL, NULL);
    if (rc != QT_OK) {
        qt_free(b.p);
        return rc;
    }
    *out = b.p;
    if (len) *len = b.n;
    return QT_OK;
}

int chat_render(const chat_message *msgs, size_t n, int add_generation_prompt, char **out, size_t *len) {
    return render_text(msgs, n, add_generation_prompt, CHAT_DEFAULT_SYSTEM, out, len);
}

int chat_render_tok(const bpe_tokenizer *t, const chat_message *msgs, size_t n, int add_generation_prompt, char **out,
                    size_t *len) {
    return render_text(msgs, n, add_generation_prompt, bpe_chat_system(t), out, len);
}

int chat_encode(const bpe_tokenizer *t, const chat_message *msgs, size_t n, int add_generation_prompt, int32_t **ids,
                int32_t **labels, size_t *n_ids, size_t *cap) {
    char **clean = n ? qt_calloc(n, sizeof *clean, "chat contents") : NULL;
    if (n && !clean) return QT_ENOMEM;
    qt_strbuf b = {0};
    region *regs = NULL;
    size_t nregs = 0, base = *n_ids, ncap = *cap, k = 0;
    bpe_span *spans = NULL;
    int rc = qt_strbuf_put(&b, "", 0);
    for (size_t i = 0; i < n && rc == QT_OK; i++) {
        size_t l;
        if (!msgs[i].content) break; /* render() names it */
        rc = bpe_normalize(t, msgs[i].content, strlen(msgs[i].content), &clean[i], &l);
    }
    if (rc == QT_OK) rc = render(msgs, n, clean, add_generation_prompt, bpe_chat_system(t), &b, &regs, &nregs);
    /* spans only for this conversation's tokens: encode into a fresh array,
     * then append; *labels follows *ids' capacity. */
    int32_t *new_ids = NULL;
    size_t nn = 0, ncap2 = 0;
    if (rc == QT_OK) rc = bpe_encode_spans(t, b.p, b.n, &new_ids, &spans, &nn, &ncap2);
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
        /* spans and regions both increase: one merge-like walk */
        size_t r = 0;
        for (k = 0; k < nn; k++) {
            while (r < nregs && regs[r].end <= spans[k].start) r++;
            int lab = r < nregs && spans[k].start < regs[r].end && spans[k].end > regs[r].start;
            (*ids)[base + k] = new_ids[k];
            (*labels)[base + k] = lab ? new_ids[k] : CHAT_IGNORE_INDEX;
        }
        *n_ids = base + nn;
    }
    qt_free(new_ids);
    qt_free(spans);
    qt_free(regs);
    qt_free(b.p);
    for (size_t i = 0; clean && i < n; i++) qt_free(clean[i]);
    qt_free(clean);
    return rc;
}
