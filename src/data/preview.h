/* The first example of a data file as training sees it: encoded as the
 * loader encodes it (format, template, truncation aside), decoded back with
 * each labelled stretch between "[[" and "]]" (text/chat_template.h's
 * chat_show_labels), as LLaMA-Factory prints its first example. The trainer
 * prints it at the start of a run, `qtune doctor` with its checks. */
#ifndef QT_DATA_PREVIEW_H
#define QT_DATA_PREVIEW_H

#include <stddef.h>

#include "text/tokenizer.h"

/* *out (qt_free): the marked text, cut after max_bytes with a note of how
 * much was left out. format: the job's data.format ("auto", ...). An error
 * where the first line does not encode (its message names the line). */
int dl_preview_first(const bpe_tokenizer *tok, const char *path, const char *format, int mask_prompt, size_t max_bytes,
                     char **out);

#endif
