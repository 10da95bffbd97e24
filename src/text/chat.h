/* ChatML conversations as Qwen2.5's tokenizer_config.json chat_template
 * renders them (tools, tool calls and tool turns included), and their tokenization with a label mask for
 * supervised fine-tuning. docs/tokenizer.md states the exact rules.
 *
 *   <|im_start|>system\n{system or the default}<|im_end|>\n
 *   <|im_start|>user\n{content}<|im_end|>\n
 *   <|im_start|>assistant\n{content}<|im_end|>\n          <- content and <|im_end|> labelled
 *   <|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n   (role "tool";
 *        consecutive tool messages share one user turn)
 *   <|im_start|>assistant[\n{content}]\n<tool_call>\n{"name": "N", "arguments": {json}}\n</tool_call>...<|im_end|>\n
 *        (an assistant turn with tool calls; labelled from the content, or
 *        from the first <tool_call> when there is none, to <|im_end|>)
 *   [<|im_start|>assistant\n]                               (add_generation_prompt)
 * With tools the system turn is the system content (or the default) followed
 * by the template's "# Tools" block listing each tool as JSON. JSON inside
 * the text is written as the HF template's `tojson` filter writes it
 * (Python's json.dumps: ", " and ": " separators, non-ASCII kept).
 */
#ifndef QT_TEXT_CHAT_H
#define QT_TEXT_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/label.h"
#include "core/strbuf.h"
#include "text/tokenizer.h"

/* Qwen2.5's system prompt when the first message is not a system message. */
#define CHAT_DEFAULT_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
/* The original Qwen-Chat's (qwen_generation_utils.make_context's default): the
 * same ChatML with this system prompt, for a qwen.tiktoken tokenizer
 * (bpe_chat_system). */
#define CHAT_QWEN1_SYSTEM "You are a helpful assistant."
#define CHAT_IGNORE_INDEX QT_IGNORE_INDEX /* label of a token the loss skips (core/label.h) */

typedef struct {
    const char *role;       /* "system", "user", "assistant" or "tool" */
    const char *content;    /* NUL-terminated UTF-8; may be NULL or "" on an assistant turn with tool_calls */
    const char *tool_calls; /* NULL, or an assistant turn's calls as chat_tool_calls_text renders them */
    int no_label;           /* an assistant turn that carries no label (OpenAI's "weight": 0, a TRL prompt) */
} chat_message;

/* The template's text for an assistant turn's tool_calls, a JSON array of
 * {"function": {"name", "arguments"}} (OpenAI) or {"name", "arguments"}
 * objects: "\n<tool_call>\n{\"name\": \"N\", \"arguments\": JSON}\n</tool_call>"
 * each (qt_free *out). QT_EFORMAT names a call without a string name or
 * without arguments. */
int chat_tool_calls_text(const cJSON *tool_calls, char **out);

/* "\n" + tojson(tool) for each tool of a JSON array (the template's <tools>
 * block body; qt_free *out). */
int chat_tools_text(const cJSON *tools, char **out);

/* The rendered conversation, NUL-terminated (qt_free *out). QT_EINVAL names a
 * message with an unknown role or no content. */
int chat_render(const chat_message *msgs, size_t n, int add_generation_prompt, char **out, size_t *len);
/* The same with tools: the text of chat_tools_text, or NULL for none. */
int chat_render_tools(const chat_message *msgs, size_t n, const char *tools, int add_generation_prompt, char **out,
                      size_t *len);
/* chat_render_tools with the tokenizer's model family's default system prompt
 * (bpe_chat_system: the original Qwen's for qwen.tiktoken); tools may be NULL.
 * chat_encode uses it too. */
int chat_render_tok(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                    int add_generation_prompt, char **out, size_t *len);

/* Tokenizes the rendered conversation and appends to *ids and *labels (both
 * grown together with qt_realloc; *cap is their shared capacity). labels[i]
 * is ids[i] where the token carries a label, CHAT_IGNORE_INDEX elsewhere (not
 * shifted: the loss pairs position i's logits with labels[i + 1]).
 * A token carries a label when any of its bytes lies in an assistant
 * message's content or in the <|im_end|> that closes it. The ids are exactly
 * bpe_encode of chat_render's text. */
int chat_encode(const bpe_tokenizer *t, const chat_message *msgs, size_t n, int add_generation_prompt, int32_t **ids,
                int32_t **labels, size_t *n_ids, size_t *cap);
/* The same with tools (chat_tools_text's text, or NULL). */
int chat_encode_tools(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                      int add_generation_prompt, int32_t **ids, int32_t **labels, size_t *n_ids, size_t *cap);
/* chat_encode_tools with a label mask instead of labels: appends the ids and
 * mask[i] = 1 where chat_encode_tools's label is the id (0 where it is
 * CHAT_IGNORE_INDEX) to *ids and *mask, which share *cap (grown with
 * qt_realloc). No array per token beyond these two: the data loader's path. */
int chat_encode_mask(const bpe_tokenizer *t, const chat_message *msgs, size_t n, const char *tools,
                     int add_generation_prompt, int32_t **ids, uint8_t **mask, size_t *n_ids, size_t *cap);
/* chat_encode_mask (no tools, no generation prompt) of a conversation whose
 * contents lie in a buffer the caller is done with: contents[i] is
 * msgs[i].content, with CHAT_HEAD_ROOM writable bytes before it (the data
 * loader's in-place line: the "content": key is there). Nothing is rendered:
 * each turn's header is written before its content and the turn encoded
 * where it lies, so a conversation costs its ids and mask only. It does so
 * when that gives the rendered text's ids and labels (system, user and
 * assistant turns without tool calls, contents already clean, ChatML
 * tokens that strip nothing and that no other added token runs into: see
 * bpe_cut_before_added), else it renders (chat_encode_mask). */
#define CHAT_HEAD_ROOM 11 /* strlen("\"content\":\""), the least JSON spells before a content */
int chat_encode_mask_in_place(const bpe_tokenizer *t, const chat_message *msgs, size_t n, char *const *contents,
                              int32_t **ids, uint8_t **mask, size_t *n_ids, size_t *cap);

#endif
