/* Jinja2's grammar, the subset chat templates use, with Jinja2's operator
 * precedence (lowest first): a if c else b; or; and; not; comparisons and
 * in / not in; + -; ~; * / // %; unary -; then postfix .attr [item] [a:b:c]
 * (call) and the filter and test chain (x|f(a), x is [not] t(a)).
 * Statements: if/elif/else, for (one or two targets, an if filter, else),
 * set (a name or namespace.attr), break, continue, generation. Anything
 * else is refused by name. */
#include "text/jinja_impl.h"

#include "core/error.h"
#include "core/mem.h"

#include <string.h>

typedef struct {
    jarena *a;
    jtok *t;
    size_t i, n;
    int depth; /* nesting of expressions and blocks: a hostile template must not overflow the stack */
} parser;

#define MAX_DEPTH 200

/* One more level of the expression tree: chains built in a loop (a.b.c, x|f|g,
 * a ~ b ~ c, not not x, a ** b ** c) nest as deep as recursion does, and the
 * evaluator recurses over them, so they count against the same limit. The
 * caller restores p->depth when its chain ends. */
static int deeper(parser *p) {
    if (++p->depth > MAX_DEPTH)
        return QT_ERR(QT_EFORMAT, "chat template line %d: expressions and blocks nested deeper than %d levels",
                      p->t[p->i].line, MAX_DEPTH);
    return QT_OK;
}

/* The names jinja_eval.c implements: a template using any other is refused
 * here, before anything renders. */
static const char *const FILTERS[] = {"tojson", "trim", "length", "count", "string", "lower", "upper", "first", "last",
                                      "join", "default", "d", "replace", "list", "items", "int", "float", "abs",
                                      "capitalize", "safe", "reverse", "selectattr", "rejectattr", "map", NULL};
static const char *const TESTS[] = {"defined", "undefined", "none", "string", "number", "integer", "float", "boolean",
                                    "true", "false", "mapping", "iterable", "sequence", "eq", "equalto", "ne", "odd",
                                    "even", "callable", NULL};
static const char *const GLOBALS[] = {"raise_exception", "namespace", "range", NULL};

static int in_list(const char *const *l, const char *s) {
    for (; *l; l++)
        if (!strcmp(*l, s)) return 1;
    return 0;
}

static jtok *peek(parser *p) { return &p->t[p->i]; }
static jtok *next(parser *p) { return p->i + 1 < p->n ? &p->t[p->i++] : &p->t[p->i]; }
static int is_op(parser *p, const char *op) { return peek(p)->kind == TK_OP && !strcmp(peek(p)->text, op); }
static int is_name(parser *p, const char *nm) { return peek(p)->kind == TK_NAME && !strcmp(peek(p)->text, nm); }

static jnode *node(parser *p, jnode_kind k) {
    jnode *n = ja_alloc(p->a, sizeof *n);
    if (n) {
        n->kind = k;
        n->line = peek(p)->line;
    }
    return n;
}

static int expect_op(parser *p, const char *op) {
    if (!is_op(p, op)) return QT_ERR(QT_EFORMAT, "chat template line %d: expected \"%s\"", peek(p)->line, op);
    next(p);
    return QT_OK;
}

static int parse_expr(parser *p, jnode **out);
static int parse_unary(parser *p, jnode **out, int with_filter);

/* (a, b, k=v) after the "(": positional and keyword arguments */
static int parse_args(parser *p, jnode *n) {
    jnode *args[32];
    const char *kw[32];
    size_t k = 0;
    while (!is_op(p, ")")) {
        if (k == 32) return QT_ERR(QT_EFORMAT, "chat template line %d: more than 32 arguments", peek(p)->line);
        kw[k] = NULL;
        if (peek(p)->kind == TK_NAME && p->t[p->i + 1].kind == TK_OP && !strcmp(p->t[p->i + 1].text, "=")) {
            kw[k] = next(p)->text;
            next(p);
        }
        QT_TRY(parse_expr(p, &args[k]));
        k++;
        if (!is_op(p, ",")) break;
        next(p);
    }
    QT_TRY(expect_op(p, ")"));
    n->args = ja_alloc(p->a, (k + 1) * sizeof *n->args);
    n->kw = ja_alloc(p->a, (k + 1) * sizeof *n->kw);
    if (!n->args || !n->kw) return QT_ENOMEM;
    memcpy(n->args, args, k * sizeof *args);
    memcpy(n->kw, kw, k * sizeof *kw);
    n->nargs = k;
    return QT_OK;
}

static int parse_list_items(parser *p, jnode *n, const char *close, int dict) {
    jnode *items[256];
    size_t k = 0;
    while (!is_op(p, close)) {
        if (k + 2 > 256) return QT_ERR(QT_EFORMAT, "chat template line %d: a literal of more than 128 items", peek(p)->line);
        QT_TRY(parse_expr(p, &items[k++]));
        if (dict) {
            QT_TRY(expect_op(p, ":"));
            QT_TRY(parse_expr(p, &items[k++]));
        }
        if (!is_op(p, ",")) break;
        next(p);
    }
    QT_TRY(expect_op(p, close));
    n->args = ja_alloc(p->a, (k + 1) * sizeof *n->args);
    if (!n->args) return QT_ENOMEM;
    memcpy(n->args, items, k * sizeof *items);
    n->nargs = k;
    return QT_OK;
}

static int parse_primary(parser *p, jnode **out) {
    jtok *t = peek(p);
    jnode *n = NULL;
    switch (t->kind) {
    case TK_STR: {
        /* adjacent literals concatenate, as in Python */
        n = node(p, N_CONST_STR);
        if (!n) return QT_ENOMEM;
        n->s = next(p)->text;
        n->n = t->len;
        while (peek(p)->kind == TK_STR) {
            jtok *u = next(p);
            char *c = ja_alloc(p->a, n->n + u->len + 1);
            if (!c) return QT_ENOMEM;
            memcpy(c, n->s, n->n);
            memcpy(c + n->n, u->text, u->len);
            n->s = c;
            n->n += u->len;
        }
        break;
    }
    case TK_INT:
        if (!(n = node(p, N_CONST_INT))) return QT_ENOMEM;
        n->i = next(p)->i;
        break;
    case TK_FLOAT:
        if (!(n = node(p, N_CONST_FLOAT))) return QT_ENOMEM;
        n->f = next(p)->f;
        break;
    case TK_NAME: {
        const char *nm = t->text;
        if (!strcmp(nm, "true") || !strcmp(nm, "True") || !strcmp(nm, "false") || !strcmp(nm, "False")) {
            if (!(n = node(p, N_CONST_BOOL))) return QT_ENOMEM;
            n->i = nm[0] == 't' || nm[0] == 'T';
        } else if (!strcmp(nm, "none") || !strcmp(nm, "None")) {
            if (!(n = node(p, N_CONST_NONE))) return QT_ENOMEM;
        } else {
            if (!(n = node(p, N_NAME))) return QT_ENOMEM;
            n->s = nm;
        }
        next(p);
        break;
    }
    case TK_OP:
        if (is_op(p, "(")) {
            next(p);
            if (is_op(p, ")")) { /* () : an empty tuple, a list here */
                if (!(n = node(p, N_LIST))) return QT_ENOMEM;
                next(p);
                break;
            }
            jnode *first;
            QT_TRY(parse_expr(p, &first));
            if (is_op(p, ",")) { /* a tuple: a list here (what the templates do with one is iterate or test it) */
                next(p);
                if (!(n = node(p, N_LIST))) return QT_ENOMEM;
                QT_TRY(parse_list_items(p, n, ")", 0));
                jnode **all = ja_alloc(p->a, (n->nargs + 2) * sizeof *all);
                if (!all) return QT_ENOMEM;
                all[0] = first;
                memcpy(all + 1, n->args, n->nargs * sizeof *all);
                n->args = all;
                n->nargs++;
            } else {
                n = first;
                QT_TRY(expect_op(p, ")"));
            }
        } else if (is_op(p, "[") || is_op(p, "{")) {
            int dict = is_op(p, "{");
            if (!(n = node(p, dict ? N_DICT : N_LIST))) return QT_ENOMEM;
            next(p);
            QT_TRY(parse_list_items(p, n, dict ? "}" : "]", dict));
        } else {
            return QT_ERR(QT_EFORMAT, "chat template line %d: unexpected \"%s\" in an expression", t->line, t->text);
        }
        break;
    default:
        return QT_ERR(QT_EFORMAT, "chat template line %d: an expression is missing", t->line);
    }
    *out = n;
    return QT_OK;
}

static int parse_postfix(parser *p, jnode **io) {
    const int d0 = p->depth;
    for (;;) {
        jnode *n;
        if (is_op(p, ".") || is_op(p, "[") || is_op(p, "(")) QT_TRY(deeper(p));
        if (is_op(p, ".")) {
            next(p);
            jtok *t = peek(p);
            if (t->kind != TK_NAME && t->kind != TK_INT)
                return QT_ERR(QT_EFORMAT, "chat template line %d: a name must follow \".\"", t->line);
            if (!(n = node(p, t->kind == TK_NAME ? N_ATTR : N_ITEM))) return QT_ENOMEM;
            n->a = *io;
            if (t->kind == TK_NAME) n->s = t->text;
            else {
                if (!(n->b = node(p, N_CONST_INT))) return QT_ENOMEM;
                n->b->i = t->i;
            }
            next(p);
        } else if (is_op(p, "[")) {
            next(p);
            jnode *parts[3] = {NULL, NULL, NULL};
            int k = 0, slice = 0;
            for (;;) {
                if (!is_op(p, ":") && !is_op(p, "]")) QT_TRY(parse_expr(p, &parts[k]));
                if (is_op(p, ":") && k < 2) {
                    next(p);
                    k++;
                    slice = 1;
                    continue;
                }
                break;
            }
            QT_TRY(expect_op(p, "]"));
            if (!(n = node(p, slice ? N_SLICE : N_ITEM))) return QT_ENOMEM;
            n->a = *io;
            n->b = parts[0];
            n->c = parts[1];
            n->d = parts[2];
            if (!slice && !n->b) return QT_ERR(QT_EFORMAT, "chat template line %d: an empty subscript", n->line);
        } else if (is_op(p, "(")) {
            next(p);
            if (!(n = node(p, N_CALL))) return QT_ENOMEM;
            n->a = *io;
            if ((*io)->kind == N_NAME && !in_list(GLOBALS, (*io)->s))
                return QT_ERR(QT_EFORMAT, "chat template line %d: the function %s() is outside qtune's Jinja subset "
                              "(it has raise_exception, namespace and range)", n->line, (*io)->s);
            QT_TRY(parse_args(p, n));
        } else {
            p->depth = d0;
            return QT_OK;
        }
        *io = n;
    }
}

/* x|f(args) and x is [not] t(args) chains */
static int parse_filters(parser *p, jnode **io) {
    const int d0 = p->depth;
    for (;;) {
        if (is_op(p, "|") || is_name(p, "is")) QT_TRY(deeper(p));
        if (is_op(p, "|")) {
            next(p);
            jtok *t = peek(p);
            if (t->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: a filter name must follow \"|\"", t->line);
            if (!in_list(FILTERS, t->text))
                return QT_ERR(QT_EFORMAT, "chat template line %d: the filter \"%s\" is outside qtune's Jinja subset", t->line,
                              t->text);
            jnode *n = node(p, N_FILTER);
            if (!n) return QT_ENOMEM;
            n->s = t->text;
            n->a = *io;
            next(p);
            if (is_op(p, "(")) {
                next(p);
                QT_TRY(parse_args(p, n));
            }
            *io = n;
            QT_TRY(parse_postfix(p, io));
        } else if (is_name(p, "is")) {
            next(p);
            jnode *n = node(p, N_TEST);
            if (!n) return QT_ENOMEM;
            if (is_name(p, "not")) {
                n->i = 1;
                next(p);
            }
            jtok *t = peek(p);
            const char *nm = t->kind == TK_NAME ? t->text : t->kind == TK_OP && !strcmp(t->text, "==") ? "eq" : NULL;
            if (!nm) return QT_ERR(QT_EFORMAT, "chat template line %d: a test name must follow \"is\"", t->line);
            if (!in_list(TESTS, nm))
                return QT_ERR(QT_EFORMAT, "chat template line %d: the test \"%s\" is outside qtune's Jinja subset", t->line, nm);
            n->s = !strcmp(nm, "none") ? "none" : nm;
            n->a = *io;
            next(p);
            if (is_op(p, "(")) {
                next(p);
                QT_TRY(parse_args(p, n));
            } else if (peek(p)->kind == TK_STR || peek(p)->kind == TK_INT || peek(p)->kind == TK_FLOAT ||
                       (peek(p)->kind == TK_NAME && !is_name(p, "and") && !is_name(p, "or") && !is_name(p, "else") &&
                        !is_name(p, "if") && !is_name(p, "in") && !is_name(p, "is") && !is_name(p, "not"))) {
                /* "is equalto x": one argument without parentheses */
                n->args = ja_alloc(p->a, 2 * sizeof *n->args);
                n->kw = ja_alloc(p->a, 2 * sizeof *n->kw);
                if (!n->args || !n->kw) return QT_ENOMEM;
                QT_TRY(parse_unary(p, &n->args[0], 0));
                n->nargs = 1;
            }
            *io = n;
        } else {
            p->depth = d0;
            return QT_OK;
        }
    }
}

static int parse_unary(parser *p, jnode **out, int with_filter) {
    if (++p->depth > MAX_DEPTH) return QT_ERR(QT_EFORMAT, "chat template line %d: expressions and blocks nested deeper than %d levels", peek(p)->line, MAX_DEPTH);
    int rc = QT_OK;
    if (is_op(p, "-") || is_op(p, "+")) {
        int neg = is_op(p, "-");
        next(p);
        jnode *n = node(p, N_NEG);
        if (!n) return QT_ENOMEM;
        rc = parse_unary(p, &n->a, 0);
        if (!neg) *out = n->a;
        else *out = n;
    } else {
        rc = parse_primary(p, out);
        if (rc == QT_OK) rc = parse_postfix(p, out);
    }
    if (rc == QT_OK && with_filter) rc = parse_filters(p, out);
    p->depth--;
    return rc;
}

static int binary(parser *p, jnode **io, const char *op, int (*rhs)(parser *, jnode **)) {
    QT_TRY(deeper(p));
    jnode *n = node(p, N_BIN);
    if (!n) return QT_ENOMEM;
    n->s = op;
    n->a = *io;
    QT_TRY(rhs(p, &n->b));
    *io = n;
    return QT_OK;
}

static int parse_pow(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_unary(p, out, 1));
    while (is_op(p, "**")) {
        next(p);
        QT_TRY(binary(p, out, "**", parse_pow));
    }
    p->depth = d0;
    return QT_OK;
}

static int parse_math2(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_pow(p, out));
    while (is_op(p, "*") || is_op(p, "/") || is_op(p, "//") || is_op(p, "%")) {
        const char *op = next(p)->text;
        QT_TRY(binary(p, out, op, parse_pow));
    }
    p->depth = d0;
    return QT_OK;
}

static int parse_concat(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_math2(p, out));
    while (is_op(p, "~")) {
        next(p);
        QT_TRY(binary(p, out, "~", parse_math2));
    }
    p->depth = d0;
    return QT_OK;
}

static int parse_math1(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_concat(p, out));
    while (is_op(p, "+") || is_op(p, "-")) {
        const char *op = next(p)->text;
        QT_TRY(binary(p, out, op, parse_concat));
    }
    p->depth = d0;
    return QT_OK;
}

static int parse_compare(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_math1(p, out));
    for (;;) {
        const char *op = NULL;
        if (is_op(p, "==") || is_op(p, "!=") || is_op(p, "<") || is_op(p, ">") || is_op(p, "<=") || is_op(p, ">="))
            op = next(p)->text;
        else if (is_name(p, "in")) {
            next(p);
            op = "in";
        } else if (is_name(p, "not") && p->t[p->i + 1].kind == TK_NAME && !strcmp(p->t[p->i + 1].text, "in")) {
            next(p);
            next(p);
            op = "not in";
        } else {
            p->depth = d0;
            return QT_OK;
        }
        QT_TRY(binary(p, out, op, parse_math1));
    }
}

static int parse_not(parser *p, jnode **out) {
    if (is_name(p, "not")) {
        next(p);
        jnode *n = node(p, N_NOT);
        if (!n) return QT_ENOMEM;
        QT_TRY(deeper(p));
        QT_TRY(parse_not(p, &n->a));
        p->depth--;
        *out = n;
        return QT_OK;
    }
    return parse_compare(p, out);
}

static int parse_and(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_not(p, out));
    while (is_name(p, "and")) {
        next(p);
        QT_TRY(deeper(p));
        jnode *n = node(p, N_AND);
        if (!n) return QT_ENOMEM;
        n->a = *out;
        QT_TRY(parse_not(p, &n->b));
        *out = n;
    }
    p->depth = d0;
    return QT_OK;
}

static int parse_or(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_and(p, out));
    while (is_name(p, "or")) {
        next(p);
        QT_TRY(deeper(p));
        jnode *n = node(p, N_OR);
        if (!n) return QT_ENOMEM;
        n->a = *out;
        QT_TRY(parse_and(p, &n->b));
        *out = n;
    }
    p->depth = d0;
    return QT_OK;
}

/* a if cond else b (no else: undefined) */
static int parse_expr(parser *p, jnode **out) {
    const int d0 = p->depth;
    QT_TRY(parse_or(p, out));
    while (is_name(p, "if")) {
        QT_TRY(deeper(p));
        next(p);
        jnode *n = node(p, N_COND);
        if (!n) return QT_ENOMEM;
        n->b = *out;
        QT_TRY(parse_or(p, &n->a));
        if (is_name(p, "else")) {
            next(p);
            QT_TRY(parse_or(p, &n->c));
        }
        *out = n;
    }
    p->depth = d0;
    return QT_OK;
}

static int expect_bend(parser *p) {
    if (peek(p)->kind != TK_BEND) return QT_ERR(QT_EFORMAT, "chat template line %d: expected \"%%}\"", peek(p)->line);
    next(p);
    return QT_OK;
}

/* Statements until a block tag named in ends ("endif", "else", ...): *stop
 * is the tag's name (the parser sits after its name), or NULL at the end. */
static int parse_body(parser *p, jnode **out, const char *const *ends, const char **stop);
static int parse_body_in(parser *p, jnode *head, jnode **tailp, const char *const *ends, const char **stop);

static int parse_if(parser *p, jnode **out) {
    jnode *n = node(p, N_IF);
    if (!n) return QT_ENOMEM;
    QT_TRY(parse_expr(p, &n->a));
    QT_TRY(expect_bend(p));
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    const char *stop;
    QT_TRY(parse_body(p, &n->b, ends, &stop));
    if (!stop) return QT_ERR(QT_EFORMAT, "chat template line %d: \"if\" is not closed with \"endif\"", n->line);
    if (!strcmp(stop, "elif")) {
        QT_TRY(parse_if(p, &n->c));
    } else if (!strcmp(stop, "else")) {
        QT_TRY(expect_bend(p));
        static const char *const end_only[] = {"endif", NULL};
        QT_TRY(parse_body(p, &n->c, end_only, &stop));
        if (!stop) return QT_ERR(QT_EFORMAT, "chat template line %d: \"if\" is not closed with \"endif\"", n->line);
        QT_TRY(expect_bend(p));
    } else {
        QT_TRY(expect_bend(p));
    }
    *out = n;
    return QT_OK;
}

static int parse_for(parser *p, jnode **out) {
    jnode *n = node(p, N_FOR);
    if (!n) return QT_ENOMEM;
    if (peek(p)->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: \"for\" needs a loop variable", n->line);
    n->s = next(p)->text;
    if (is_op(p, ",")) {
        next(p);
        if (peek(p)->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: a second loop variable is missing", n->line);
        n->s2 = next(p)->text;
    }
    if (!is_name(p, "in")) return QT_ERR(QT_EFORMAT, "chat template line %d: \"for\" needs \"in\"", n->line);
    next(p);
    QT_TRY(parse_or(p, &n->a)); /* "if" after the iterable filters items */
    if (is_name(p, "if")) {
        next(p);
        QT_TRY(parse_expr(p, &n->d));
    }
    if (is_name(p, "recursive"))
        return QT_ERR(QT_EFORMAT, "chat template line %d: recursive loops are outside qtune's Jinja subset", n->line);
    QT_TRY(expect_bend(p));
    static const char *const ends[] = {"else", "endfor", NULL};
    const char *stop;
    QT_TRY(parse_body(p, &n->b, ends, &stop));
    if (!stop) return QT_ERR(QT_EFORMAT, "chat template line %d: \"for\" is not closed with \"endfor\"", n->line);
    if (!strcmp(stop, "else")) {
        QT_TRY(expect_bend(p));
        static const char *const end_only[] = {"endfor", NULL};
        QT_TRY(parse_body(p, &n->c, end_only, &stop));
        if (!stop) return QT_ERR(QT_EFORMAT, "chat template line %d: \"for\" is not closed with \"endfor\"", n->line);
    }
    QT_TRY(expect_bend(p));
    *out = n;
    return QT_OK;
}

static int parse_set(parser *p, jnode **out) {
    jnode *n = node(p, N_SET);
    if (!n) return QT_ENOMEM;
    if (peek(p)->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: \"set\" needs a name", n->line);
    n->s = next(p)->text;
    if (is_op(p, ".")) {
        next(p);
        if (peek(p)->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: a name must follow \".\"", n->line);
        n->s2 = next(p)->text;
    }
    if (is_op(p, ","))
        return QT_ERR(QT_EFORMAT, "chat template line %d: \"set\" of several names is outside qtune's Jinja subset", n->line);
    if (!is_op(p, "="))
        return QT_ERR(QT_EFORMAT, "chat template line %d: block \"set\" (without \"=\") is outside qtune's Jinja subset", n->line);
    next(p);
    QT_TRY(parse_expr(p, &n->a));
    QT_TRY(expect_bend(p));
    *out = n;
    return QT_OK;
}

static int parse_body(parser *p, jnode **out, const char *const *ends, const char **stop) {
    jnode head = {0}, *tail = &head;
    *stop = NULL;
    if (p->depth > MAX_DEPTH) return QT_ERR(QT_EFORMAT, "chat template line %d: expressions and blocks nested deeper than %d levels", peek(p)->line, MAX_DEPTH);
    p->depth++;
    int rc = parse_body_in(p, &head, &tail, ends, stop);
    p->depth--;
    *out = head.next; /* with ends and no *stop: the caller names the missing end */
    return rc;
}

static int parse_body_in(parser *p, jnode *head, jnode **tailp, const char *const *ends, const char **stop) {
    (void)head;
    jnode *tail = *tailp;
    for (;;) {
        jtok *t = peek(p);
        jnode *n = NULL;
        if (t->kind == TK_EOF) break;
        if (t->kind == TK_TEXT) {
            if (!(n = node(p, N_TEXT))) return QT_ENOMEM;
            n->s = t->text;
            n->n = t->len;
            next(p);
        } else if (t->kind == TK_VBEGIN) {
            next(p);
            if (!(n = node(p, N_OUT))) return QT_ENOMEM;
            QT_TRY(parse_expr(p, &n->a));
            if (peek(p)->kind != TK_VEND) return QT_ERR(QT_EFORMAT, "chat template line %d: expected \"}}\"", peek(p)->line);
            next(p);
        } else if (t->kind == TK_BBEGIN) {
            next(p);
            jtok *k = peek(p);
            if (k->kind != TK_NAME) return QT_ERR(QT_EFORMAT, "chat template line %d: a block tag needs a name", k->line);
            const char *nm = k->text;
            if (ends && in_list(ends, nm)) {
                next(p);
                *stop = nm;
                break;
            }
            next(p);
            if (!strcmp(nm, "if")) QT_TRY(parse_if(p, &n));
            else if (!strcmp(nm, "for")) QT_TRY(parse_for(p, &n));
            else if (!strcmp(nm, "set")) QT_TRY(parse_set(p, &n));
            else if (!strcmp(nm, "break") || !strcmp(nm, "continue")) {
                if (!(n = node(p, nm[0] == 'b' ? N_BREAK : N_CONTINUE))) return QT_ENOMEM;
                QT_TRY(expect_bend(p));
            } else if (!strcmp(nm, "generation")) {
                /* transformers' AssistantTracker: a marker around assistant text, rendered as its body */
                if (!(n = node(p, N_BLOCK))) return QT_ENOMEM;
                QT_TRY(expect_bend(p));
                static const char *const end_gen[] = {"endgeneration", NULL};
                const char *s;
                QT_TRY(parse_body(p, &n->b, end_gen, &s));
                if (!s) return QT_ERR(QT_EFORMAT, "chat template line %d: \"generation\" is not closed", n->line);
                QT_TRY(expect_bend(p));
            } else if (!strncmp(nm, "end", 3) || !strcmp(nm, "else") || !strcmp(nm, "elif")) {
                return QT_ERR(QT_EFORMAT, "chat template line %d: \"%s\" without the statement it closes", k->line, nm);
            } else {
                return QT_ERR(QT_EFORMAT, "chat template line %d: the \"%s\" statement is outside qtune's Jinja subset "
                              "(it has if, for, set, break, continue and generation)", k->line, nm);
            }
        } else {
            return QT_ERR(QT_EFORMAT, "chat template line %d: unexpected token", t->line);
        }
        tail->next = n;
        tail = n;
    }
    *tailp = tail;
    return QT_OK;
}

int jinja_parse(const char *src, size_t len, jinja_template **out) {
    *out = NULL;
    jinja_template *t = qt_calloc(1, sizeof *t, "a chat template");
    if (!t) return QT_ENOMEM;
    jtok *toks;
    size_t ntoks;
    int rc = jinja_lex(&t->arena, src, len, &toks, &ntoks);
    if (rc == QT_OK) {
        parser p = {&t->arena, toks, 0, ntoks, 0};
        const char *stop;
        rc = parse_body(&p, &t->body, NULL, &stop);
    }
    if (rc != QT_OK) {
        if (t->arena.capped) rc = QT_EINVAL;
        jinja_free(t);
        return rc;
    }
    *out = t;
    return QT_OK;
}

void jinja_free(jinja_template *t) {
    if (!t) return;
    ja_free(&t->arena);
    qt_free(t);
}
