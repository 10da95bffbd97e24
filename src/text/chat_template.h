/* The chat template a model folder ships, rendered as transformers'
 * apply_chat_template renders it (text/jinja.h), and the label mask of the
 * rendered conversation. docs/chat-templates.md states the rules.
 *
 * Where the template comes from (transformers' order): the folder's
 * chat_template.jinja, else tokenizer_config.json's "chat_template" (a string,
 * or a list of {name, template}: the one named "default"). A folder with
 * neither renders with qtune's ChatML (text/chat.h): Qwen2.5's system prompt,
 * or the original Qwen's for a qwen.tiktoken.
 *
 * Labels keep the ChatML path's meaning, "the assistant's reply and the token
 * that ends it": each assistant message's turn is the output written while
 * the template's loop over messages sat on that message (jinja_item_span);
 * its label starts after the generation prompt (what add_generation_prompt
 * appends, found by rendering a one-message probe with and without it) where
 * that prompt occurs in the turn, else after the prompt's first line (the
 * role's header: Qwen3's turn with reasoning where the prompt of
 * enable_thinking=false holds an empty think block), and ends at the turn's last non-whitespace byte (the <|im_end|>
 * or <|eot_id|>, not the newline after it). */
#ifndef QT_TEXT_CHAT_TEMPLATE_H
#define QT_TEXT_CHAT_TEMPLATE_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "text/chat.h"
#include "text/tokenizer.h"

typedef struct chat_template chat_template;

/* The template of a model folder (dir), or *out = NULL when it ships none.
 * A template outside qtune's Jinja subset still loads: chat_template_error
 * says why, and every render returns that error (a folder used for plain
 * text must not fail over it). Unreadable files return an error. */
int chat_template_load_dir(const char *dir, chat_template **out);
/* A template from text (a --chat-template file); source names it in messages.
 * Special tokens (bos_token, ...) are taken from dir's tokenizer_config.json
 * when dir is not NULL. */
int chat_template_from_text(const char *text, size_t len, const char *source, const char *dir, chat_template **out);
void chat_template_free(chat_template *ct);

/* --chat-template ARG: a template file used instead of the folder's (its
 * special tokens still from the folder dir), or "chatml" for qtune's ChatML
 * default. */
int chat_template_override(bpe_tokenizer *t, const char *arg, const char *dir);

/* Of the template's text and variables (a part of the token cache's key). */
uint64_t chat_template_hash(const chat_template *ct);

/* Where it came from ("tokenizer_config.json's chat_template", ...). */
const char *chat_template_source(const chat_template *ct);
/* NULL when it renders; else why not (the construct outside the subset). */
const char *chat_template_error(const chat_template *ct);
/* The template's text, as the folder has it (what GGUF export writes). */
const char *chat_template_text(const chat_template *ct);

/* A variable every render passes (transformers' chat_template_kwargs, e.g.
 * "enable_thinking": false). The value is copied. */
int chat_template_set_var(chat_template *ct, const char *name, const cJSON *value);

/* Renders msgs (tools: chat_tools_text's text or NULL) to *out (qt_free);
 * when regs is not NULL, the labelled byte ranges to *regs (qt_free). */
int chat_template_render(const chat_template *ct, const chat_message *msgs, size_t n, const char *tools,
                         int add_generation_prompt, char **out, size_t *len, bpe_span **regs, size_t *nregs);

/* chat_template_render, then one encode of the text with the mask of
 * chat_encode_mask (contents are normalised first, so the byte ranges are
 * exact). */
int chat_template_encode_mask(const bpe_tokenizer *t, const chat_template *ct, const chat_message *msgs, size_t n,
                              const char *tools, int add_generation_prompt, int32_t **ids, uint8_t **mask,
                              size_t *n_ids, size_t *cap);

/* One line for the run line and doctor: which template renders chats for
 * this tokenizer ("tokenizer_config.json's chat_template (Jinja)", or the
 * ChatML default and its system prompt when the folder ships none). */
void chat_template_describe(const bpe_tokenizer *t, char *buf, size_t cap);

/* The first example of a run as LLaMA-Factory prints it: the rendered text
 * with each labelled stretch between "[[" and "]]", and the counts
 * (qt_free *out). ids/mask are the example's tokens and label mask. */
int chat_show_labels(const bpe_tokenizer *t, const int32_t *ids, const uint8_t *mask, size_t n, char **out);

#endif
