/* What format.c (the cJSON reader of the data formats) and format_fast.c
 * (the reader of long lines of the plain shapes) share: the line being
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

/* format_fast.c: a long line (FAST_MIN_LINE bytes or more) of the tokens
 * format, or of text / messages decoded in place in s (decode 0: the
 * checking pass, which writes nothing). QT_OK, an error of the line, or
 * FAST_NO: not the plain shape, take the cJSON path. */
enum { FAST_NO = 1 };
#define FAST_MIN_LINE ((size_t)64 << 10) /* shorter lines: cJSON, which is cheap there */
int dl_fmt_fast_tokens(const dl_encode_ctx *ctx, const char *s, size_t len, dl_tokbuf *out);
int dl_fmt_fast_text_pass(const enc_call *ec, char *s, size_t len, dl_format *fmt, dl_tokbuf *out, int decode);
int dl_fmt_fast_text(const enc_call *ec, char *s, size_t len, dl_format *fmt, dl_tokbuf *out);

#endif
