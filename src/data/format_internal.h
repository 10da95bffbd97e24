/* What format.c (the data formats' readers over cJSON) and format_line.c
 * (one line to tokens: the long-line readers, then cJSON) share: the line being
 * encoded, a conversation being built, and the steps both take to put tokens
 * in the buffer. Private to src/data/. */
#ifndef QT_DATA_FORMAT_INTERNAL_H
#define QT_DATA_FORMAT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "data/format.h"
#include "text/chat.h"

/* One line being encoded: where it is, for the dropped-key warnings. */
typedef struct {
    const dl_encode_ctx *ctx;
    long long line; /* 0: unknown */
} enc_call;

/* ---- conversations: every chat-like shape becomes chat_message[] ---- */
typedef struct {
    chat_message *m;
    size_t n, cap;
    char *tools;  /* chat_tools_text, or NULL */
    char **owned; /* strings made here (joined parts, tool calls), freed with the conversation */
    size_t n_owned, cap_owned;
} convo;

/* format.c */
int dl_fmt_put_text(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *s, size_t len, uint8_t label);
int dl_fmt_put_special(const dl_encode_ctx *ctx, dl_tokbuf *out, const char *token, uint8_t label);
void dl_fmt_dropped(const enc_call *e, const char *where, const char *key, const char *fmt_name);
void dl_fmt_convo_free(convo *c);
int dl_fmt_convo_add(convo *c, const char *role, const char *content, const char *calls, int no_label);
int dl_fmt_put_chat(const dl_encode_ctx *ctx, dl_tokbuf *out, const convo *c, char *const *in_place);
int dl_fmt_check_id(double d, const char *key, int i, double lo, double hi, int32_t *out);
int dl_fmt_check_label(int32_t lab, int32_t id, int i, uint8_t *m);
int dl_fmt_encode_tokens(const dl_encode_ctx *ctx, const cJSON *obj, dl_tokbuf *out);
/* one parsed example in format fmt to tokens (dl_encode_example with the line for its warnings) */
int dl_fmt_encode_obj(const enc_call *e, dl_format fmt, const cJSON *obj, dl_tokbuf *out);

#endif
