/* Byte-level BPE as Hugging Face tokenizers runs it from tokenizer.json:
 * added/special tokens matched first, NFC normalisation (utf8proc), the Split
 * pre-tokenizer regex (PCRE2, UTF + UCP, the pattern exactly as the file has
 * it), the ByteLevel byte->unicode mapping, merges by rank, and the ByteLevel
 * decoder. docs/tokenizer.md has the exact rules (invalid UTF-8, flags).
 *
 * A loaded tokenizer is read-only and safe to share between threads: every
 * function here may be called concurrently on the same bpe_tokenizer. */
#ifndef QT_TEXT_TOKENIZER_H
#define QT_TEXT_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct bpe_tokenizer bpe_tokenizer;

/* path: a tokenizer.json, the original Qwen's qwen.tiktoken (a path ending in
 * .tiktoken), or a model folder that holds either (tokenizer.json first). */
int bpe_load(const char *path, bpe_tokenizer **out);
/* The tokenizer file a model folder holds: dir/tokenizer.json, else
 * dir/qwen.tiktoken (the original Qwen). 1 and path filled when there is one. */
int bpe_folder_file(const char *dir, char *path, size_t cap);
/* Whether a tokenizer file is a tiktoken vocabulary (its name ends in .tiktoken). */
int bpe_is_tiktoken_file(const char *path);
void bpe_free(bpe_tokenizer *t);
/* A qwen.tiktoken as the tokenizer.json tree (vocab, merges, added_tokens,
 * pre_tokenizer) with llama.cpp's merges: the one split per token that its
 * convert_hf_to_gguf.py writes, for GGUF export. cJSON_Delete it. */
struct cJSON;
int bpe_tiktoken_gguf_tree(const char *path, struct cJSON **out);

/* Appends the ids of text[0..len) to *ids (growing *cap with qt_realloc).
 * Special tokens written inside the text are matched, as HF does by default.
 * Invalid UTF-8 in text is first replaced with U+FFFD (maximal subparts, as
 * Python's bytes.decode(errors="replace") does before HF sees the str). */
int bpe_encode(const bpe_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n, size_t *cap);
/* Decodes ids into a NUL-terminated string (qt_free it). Invalid UTF-8 that the
 * bytes form is replaced with U+FFFD, as HF's decoder does. */
int bpe_decode(const bpe_tokenizer *t, const int32_t *ids, size_t n, char **out, size_t *len);
/* id of a token string (e.g. "<|im_end|>"), or -1. */
int32_t bpe_token_id(const bpe_tokenizer *t, const char *token);
const char *bpe_id_token(const bpe_tokenizer *t, int32_t id); /* NULL if out of range */
int32_t bpe_vocab_size(const bpe_tokenizer *t);  /* highest id + 1, added tokens included */
uint64_t bpe_hash(const bpe_tokenizer *t);       /* of the tokenizer.json bytes and the chat template: cache key */

/* --- additions (text owner) --- */

/* Byte range of one token in the text it was encoded from. */
typedef struct {
    size_t start, end;
} bpe_span;

/* bpe_encode that also appends, for each id, the byte range [start, end) of
 * text it came from. Exact when text is valid UTF-8 already in NFC (the
 * normaliser then changes nothing); where invalid bytes were replaced or NFC
 * changed a stretch, the tokens of that stretch all get the stretch's range. */
int bpe_encode_spans(const bpe_tokenizer *t, const char *text, size_t len, int32_t **ids, bpe_span **spans,
                     size_t *n, size_t *cap);

/* bpe_encode that also appends, for each id, marks[i] = 1 when the token's
 * byte range (bpe_encode_spans's) overlaps one of regions[0..n_regions)
 * (sorted and disjoint), else 0: labels by byte offset at one byte a token
 * instead of a span's 16. *ids and *marks share *cap. */
int bpe_encode_marked(const bpe_tokenizer *t, const char *text, size_t len, const bpe_span *regions, size_t n_regions,
                      int32_t **ids, uint8_t **marks, size_t *n, size_t *cap);

/* 1 when bpe_encode(a + b) is certainly bpe_encode(a) followed by
 * bpe_encode(b) as far as the added tokens go: b starts with an added
 * token that strips nothing, which the scan of a + b matches right at b
 * (no token that begins in a's last bytes reaches into b, no longer token
 * could begin there), so a's text ends a stretch. The rest of the text after
 * b's shown bytes must be b's own business (b holds the token whole). */
int bpe_cut_before_added(const bpe_tokenizer *t, const char *a, size_t na, const char *b, size_t nb);

/* 1 when bpe_normalize would return text[0..len) unchanged (valid UTF-8,
 * and nothing NFC alters), so a caller can skip the copy. */
int bpe_is_normal(const bpe_tokenizer *t, const char *text, size_t len);

/* Text as the encoder sees it before splitting: invalid UTF-8 replaced with
 * U+FFFD, then NFC when the tokenizer's normaliser is NFC (qt_free *out). */
int bpe_normalize(const bpe_tokenizer *t, const char *text, size_t len, char **out, size_t *out_len);

/* The default ChatML system prompt of the tokenizer's model family: the
 * original Qwen-Chat's "You are a helpful assistant." for a qwen.tiktoken,
 * Qwen2.5's otherwise (text/chat.h). */
const char *bpe_chat_system(const bpe_tokenizer *t);
/* The chat template of the tokenizer's folder (bpe_load reads it beside the
 * tokenizer file: text/chat_template.h), or NULL when the folder ships none
 * and chats render as qtune's ChatML. */
struct chat_template;
const struct chat_template *bpe_chat_template(const bpe_tokenizer *t);
struct chat_template *bpe_chat_template_mut(bpe_tokenizer *t);
/* Replaces it (--chat-template FILE); the tokenizer owns ct from here on. */
void bpe_set_chat_template(bpe_tokenizer *t, struct chat_template *ct);
/* 1 when the tokenizer was read from the original Qwen's qwen.tiktoken. */
int bpe_is_tiktoken(const bpe_tokenizer *t);

/* 1 if id is an added token (<|im_end|>, <think>, ...), else 0. */
int bpe_is_added(const bpe_tokenizer *t, int32_t id);

#endif
