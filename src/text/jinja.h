/* The subset of Jinja2 that chat templates use, rendered as transformers'
 * apply_chat_template renders them: an ImmutableSandboxedEnvironment with
 * trim_blocks and lstrip_blocks, the loopcontrols extension, {% generation %}
 * blocks, raise_exception(), and a tojson filter that is Python's json.dumps
 * (ensure_ascii=False). docs/chat-templates.md lists the subset.
 *
 * A template that uses anything outside the subset is refused when it is
 * parsed (a statement, filter, test or global function) or rendered (a method)
 * with an error that names the construct and its line: never approximated.
 *
 * Debian packages no C or C++ Jinja implementation (apt-cache search jinja:
 * Python, Rust and R only), hence this one: jinja_lex.c cuts the source into
 * tokens, jinja_parse.c builds the tree, jinja_eval.c renders it. */
#ifndef QT_TEXT_JINJA_H
#define QT_TEXT_JINJA_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "core/strbuf.h"

typedef struct jinja_template jinja_template;

/* Parses a template (len bytes, need not be NUL-terminated). QT_EFORMAT with
 * the line and the construct when it is malformed or outside the subset. */
int jinja_parse(const char *src, size_t len, jinja_template **out);
void jinja_free(jinja_template *t);

/* The output bytes written while a for loop's item was one of the elements of
 * the context's tracked list (the innermost such loop wins): chat rendering
 * uses it to find each message's turn. */
typedef struct {
    size_t item;       /* index in the tracked list */
    size_t start, end; /* byte range of the output */
} jinja_item_span;

/* Renders with the variables of vars (a JSON object: messages, tools,
 * add_generation_prompt, bos_token, ...). track names a top-level list in vars
 * whose elements' spans go to *spans (NULL: none wanted). The output is
 * NUL-terminated (qt_free *out and *spans). A template's raise_exception(),
 * an undefined value used where Jinja2 would raise, or a type error returns
 * QT_EINVAL with Jinja2's meaning in words. */
int jinja_render(const jinja_template *t, const cJSON *vars, const char *track, char **out, size_t *len,
                 jinja_item_span **spans, size_t *nspans);

/* Python's json.dumps(v, ensure_ascii=False) of a cJSON value, appended to
 * *b: what the HF chat template's tojson filter writes (also chat.c's tool
 * texts). Whole numbers below 2^53 print as integers (cJSON does not keep 1.0
 * apart from 1). jinja_tojson.c. */
int jinja_tojson(const cJSON *v, qt_strbuf *b);

#endif
