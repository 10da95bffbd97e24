/* Internals shared by jinja_lex.c, jinja_parse.c and jinja_eval.c: tokens,
 * the syntax tree and the arena both live in. */
#ifndef QT_TEXT_JINJA_IMPL_H
#define QT_TEXT_JINJA_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "text/jinja.h"

/* ---- arena: every token, node and value of one parse or one render ---- */
typedef struct jarena_chunk jarena_chunk;
typedef struct {
    jarena_chunk *head;
    size_t total; /* bytes held: capped, so a hostile template cannot take the host's memory */
    int capped;   /* the cap was hit: the failure is the template's (QT_EINVAL), not the host's */
} jarena;
#define JINJA_MAX_ARENA ((size_t)1 << 30)
void *ja_alloc(jarena *a, size_t n); /* zeroed; NULL when out of memory */
char *ja_strdup(jarena *a, const char *s, size_t n);
void ja_free(jarena *a);

/* ---- tokens (jinja_lex.c) ---- */
typedef enum {
    TK_EOF,
    TK_TEXT,   /* template text between tags, whitespace control applied */
    TK_VBEGIN, /* {{ */
    TK_VEND,   /* }} */
    TK_BBEGIN, /* {% */
    TK_BEND,   /* %} */
    TK_NAME,
    TK_STR,    /* a string literal, unescaped */
    TK_INT,
    TK_FLOAT,
    TK_OP      /* an operator or punctuation: text holds it */
} jtok_kind;

typedef struct {
    jtok_kind kind;
    int line;
    const char *text; /* arena copy for TK_TEXT / TK_STR / TK_NAME / TK_OP */
    size_t len;
    int64_t i;
    double f;
} jtok;

/* Cuts src into tokens (*toks ends with TK_EOF), in arena a. */
int jinja_lex(jarena *a, const char *src, size_t len, jtok **toks, size_t *ntoks);

/* ---- the tree (jinja_parse.c) ---- */
typedef enum {
    /* statements */
    N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_BREAK, N_CONTINUE, N_BLOCK,
    /* expressions */
    N_CONST_STR, N_CONST_INT, N_CONST_FLOAT, N_CONST_BOOL, N_CONST_NONE,
    N_NAME, N_ATTR, N_ITEM, N_SLICE, N_CALL, N_FILTER, N_TEST, N_NOT, N_NEG, N_BIN, N_AND, N_OR, N_COND, N_LIST, N_DICT
} jnode_kind;

typedef struct jnode jnode;
struct jnode {
    jnode_kind kind;
    int line;
    const char *s; /* text, name, attribute, filter/test name, operator */
    size_t n;
    int64_t i;     /* N_CONST_INT / BOOL; N_TEST: negated; N_FOR: a second target name in s2 */
    double f;
    const char *s2; /* N_SET: attribute of a namespace; N_FOR: second target */
    jnode *a, *b, *c, *d; /* operands / condition, body, else, filter */
    jnode **args;         /* call, filter, test, list, dict (key, value pairs) arguments */
    const char **kw;      /* keyword names of args (NULL entry: positional) */
    size_t nargs;
    jnode *next;          /* the next statement of a body */
};

struct jinja_template {
    jarena arena;
    jnode *body;
};

#endif
