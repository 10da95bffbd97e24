/* Dataset formats: one JSON object per line, turned into token ids plus a
 * label mask (1 where the token carries a label, HF's unshifted sense: the
 * label OF token t is ids[t]). See docs/data.md for each format's rules. */
#ifndef QT_DATA_FORMAT_H
#define QT_DATA_FORMAT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "text/tokenizer.h"

typedef enum {
    DL_FORMAT_AUTO = 0,     /* per file, from the first valid line's keys */
    DL_FORMAT_TEXT = 1,     /* {"text": ...} + <|endoftext|>, all labelled */
    DL_FORMAT_MESSAGES = 2, /* {"messages": [{"role", "content"}, ...]} in ChatML */
    DL_FORMAT_ALPACA = 3,   /* {"instruction", "input"?, "output"} as one user/assistant exchange */
    DL_FORMAT_TOKENS = 4,   /* {"input_ids": [...], "labels": [...]?} pre-tokenized */
    DL_FORMAT_SHAREGPT = 5, /* {"conversations": [{"from", "value"}, ...], "system"?, "tools"?} */
    DL_FORMAT_PROMPT_COMPLETION = 6, /* TRL: {"prompt", "completion"}, text or message lists */
    DL_FORMAT_LAST = DL_FORMAT_PROMPT_COMPLETION,
} dl_format;

const char *dl_format_name(dl_format f); /* "auto" "text" "messages" "alpaca" "tokens" "sharegpt" "prompt_completion" */
/* Accepts the names above, plus "chat"/"chatml" for messages and
 * "input_ids"/"pretokenized" for tokens. QT_EINVAL names the choices. */
int dl_format_parse(const char *s, dl_format *out);
/* The format a JSON object's keys say, or DL_FORMAT_AUTO when none fits.
 * Checked in this order: input_ids, messages, conversations (ShareGPT),
 * instruction+output (Alpaca), prompt+completion (TRL), text. */
dl_format dl_format_detect(const cJSON *obj);

/* Growing token buffer: ids and mask of every example appended so far. */
typedef struct {
    int32_t *ids;  /* (n) */
    uint8_t *mask; /* (n) 1: the token carries a label */
    size_t n, cap;
} dl_tokbuf;

int dl_tokbuf_reserve(dl_tokbuf *b, size_t extra);
void dl_tokbuf_free(dl_tokbuf *b);

/* The keys one file's lines held that its format does not read: each is
 * named in one warning per file (thread-safe; the cache build tokenizes a
 * file on several threads). */
typedef struct dl_seen_keys dl_seen_keys;
int dl_seen_keys_new(const char *path, dl_seen_keys **out);
void dl_seen_keys_free(dl_seen_keys *s);

typedef struct {
    const bpe_tokenizer *tok; /* NULL: only DL_FORMAT_TOKENS can be read */
    dl_seen_keys *seen;       /* NULL: dropped keys are not warned about */
    int mask_prompt;          /* chat/alpaca: label only the assistant's tokens */
    int32_t vocab_limit;      /* pre-tokenized ids must be < this; 0 = unchecked */
} dl_encode_ctx;

/* Appends one example (the JSON object of one line) to out. On failure out is
 * unchanged and the error says what is wrong without the file:line, which the
 * caller prefixes. */
int dl_encode_example(const dl_encode_ctx *ctx, dl_format fmt, const cJSON *obj, dl_tokbuf *out);

/* The format of a long line (64 KiB or more) that dl_encode_line reads
 * without cJSON (tokens; text and messages of the plain shape, in place),
 * or DL_FORMAT_AUTO: format detection uses it so as not to parse such a line
 * with cJSON (80 bytes per id, a copy of every string). s is not changed. */
dl_format dl_line_long_format(const dl_encode_ctx *ctx, const char *s, size_t len);

/* One line of a JSONL file, line_no of path, to one example appended to out:
 * the line must be exactly one JSON object (whitespace around it allowed, no
 * NUL byte), in *fmt's format (DL_FORMAT_AUTO: detected from this line and
 * stored in *fmt). Used by the training loader and by qtune eval alike.
 * QT_EFORMAT (a bad line) or another code, with a message that starts
 * "path:line: "; out unchanged then. */
int dl_encode_line(const dl_encode_ctx *ctx, const char *path, long long line_no, const char *s, size_t len,
                   dl_format *fmt, dl_tokbuf *out);
/* dl_encode_line for a line buffer the caller is done with: a long line
 * (64 KiB or more) of text or messages in the plain shape (docs/data.md) has
 * its strings decoded in place and tokenized from there, so the line costs no
 * copy of its text; s holds no JSON afterwards. Same examples, same
 * messages. The loaders call this one. */
int dl_encode_line_in_place(const dl_encode_ctx *ctx, const char *path, long long line_no, char *s, size_t len,
                            dl_format *fmt, dl_tokbuf *out);

/* A {"messages": [...], "tools": [...]?} object (OpenAI/HF shape: content
 * strings or text parts, tool_calls, weight) rendered with Qwen2.5's chat
 * template (*text, qt_free) and encoded with labels (chat_encode's rules;
 * *ids and *labels qt_free). What `qtune tokenize --chat` prints. */
int dl_chat_encode_json(const bpe_tokenizer *tok, const cJSON *obj, int add_generation_prompt, char **text,
                        size_t *text_len, int32_t **ids, int32_t **labels, size_t *n);

/* What the cache key must include so a template/masking change rebuilds it. */
uint64_t dl_template_hash(void);

#endif
