/* Jinja2's lexer, as transformers configures it: trim_blocks (the newline
 * after a block or comment tag is dropped), lstrip_blocks (spaces and tabs
 * before a block or comment tag at the start of a line are dropped), "-"
 * on a tag strips all whitespace on that side, "+" keeps it, and one trailing
 * newline of the source is dropped (keep_trailing_newline is off). Also the
 * bump arena that tokens, nodes and values live in. */
#include "text/jinja_impl.h"

#include "core/error.h"
#include "core/mem.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

struct jarena_chunk {
    jarena_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *ja_alloc(jarena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    jarena_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->total + cap > JINJA_MAX_ARENA) {
            a->capped = 1;
            QT_ERR(QT_EINVAL, "a chat template needs more than %zu MiB to parse or render; a template that loops "
                   "without end?", JINJA_MAX_ARENA >> 20);
            return NULL;
        }
        a->total += cap;
        c = qt_malloc(sizeof *c + cap, "template memory");
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *ja_strdup(jarena *a, const char *s, size_t n) {
    char *p = ja_alloc(a, n + 1);
    if (p && n) memcpy(p, s, n);
    return p;
}

void ja_free(jarena *a) {
    for (jarena_chunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        qt_free(c);
    }
    a->head = NULL;
    a->total = 0;
}

typedef struct {
    jarena *a;
    jtok *t;
    size_t n, cap;
} toklist;

static int push(toklist *l, jtok k) {
    if (l->n == l->cap) {
        size_t c = l->cap ? 2 * l->cap : 256;
        jtok *g = qt_realloc(l->t, c * sizeof *g, "template tokens");
        if (!g) return QT_ENOMEM;
        l->t = g;
        l->cap = c;
    }
    l->t[l->n++] = k;
    return QT_OK;
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* A string literal at s (quote included): Python's unicode-escape meanings
 * for \n \t \r \\ \' \" \uXXXX \xXX; *end past the closing quote. */
static int lex_string(toklist *l, const char *s, const char *lim, int line, const char **end) {
    char q = *s++;
    char *buf = ja_alloc(l->a, (size_t)(lim - s) + 1);
    if (!buf) return QT_ENOMEM;
    size_t k = 0;
    while (s < lim && *s != q) {
        if (*s != '\\') {
            buf[k++] = *s++;
            continue;
        }
        if (++s >= lim) break;
        char e = *s++;
        unsigned long cp = 0;
        int hex = 0;
        switch (e) {
        case 'n': buf[k++] = '\n'; break;
        case 't': buf[k++] = '\t'; break;
        case 'r': buf[k++] = '\r'; break;
        case '0': buf[k++] = '\0'; break;
        case '\\': buf[k++] = '\\'; break;
        case '\'': buf[k++] = '\''; break;
        case '"': buf[k++] = '"'; break;
        case '\n': break;
        case 'x': hex = 2; break;
        case 'u': hex = 4; break;
        case 'U': hex = 8; break;
        default: buf[k++] = '\\'; buf[k++] = e; /* Python keeps an unknown escape as written */
        }
        if (hex) {
            for (int d = 0; d < hex; d++, s++) {
                if (s >= lim || !isxdigit((unsigned char)*s))
                    return QT_ERR(QT_EFORMAT, "chat template line %d: a \\%c escape needs %d hex digits", line, e, hex);
                cp = cp * 16 + (unsigned long)(isdigit((unsigned char)*s) ? *s - '0' : (tolower((unsigned char)*s) - 'a' + 10));
            }
            /* as UTF-8 */
            if (cp < 0x80) buf[k++] = (char)cp;
            else if (cp < 0x800) { buf[k++] = (char)(0xC0 | (cp >> 6)); buf[k++] = (char)(0x80 | (cp & 63)); }
            else if (cp < 0x10000) { buf[k++] = (char)(0xE0 | (cp >> 12)); buf[k++] = (char)(0x80 | ((cp >> 6) & 63)); buf[k++] = (char)(0x80 | (cp & 63)); }
            else { buf[k++] = (char)(0xF0 | (cp >> 18)); buf[k++] = (char)(0x80 | ((cp >> 12) & 63)); buf[k++] = (char)(0x80 | ((cp >> 6) & 63)); buf[k++] = (char)(0x80 | (cp & 63)); }
        }
    }
    if (s >= lim) return QT_ERR(QT_EFORMAT, "chat template line %d: a string literal is not closed", line);
    *end = s + 1;
    return push(l, (jtok){.kind = TK_STR, .line = line, .text = buf, .len = k});
}

static const char *const OPS[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "(", ")", "[",
                                  "]", "{", "}", ",", ".", ":", "|", "=", NULL};

/* The tokens of one tag's inside, s up to the closing delimiter close ("}}" or "%}"). */
static int lex_tag(toklist *l, const char *s, const char *lim, const char *close, int *line, const char **end) {
    for (;;) {
        while (s < lim && is_space(*s)) *line += *s++ == '\n';
        if (s >= lim) return QT_ERR(QT_EFORMAT, "chat template line %d: a tag is not closed with \"%s\"", *line, close);
        /* "-}}" / "+%}" close too */
        const char *c = s + ((*s == '-' || *s == '+') && s + 1 < lim && s[1] == close[0] ? 1 : 0);
        if (lim - c >= 2 && c[0] == close[0] && c[1] == close[1]) {
            *end = s;
            return QT_OK;
        }
        if (*s == '\'' || *s == '"') {
            QT_TRY(lex_string(l, s, lim, *line, &s));
            continue;
        }
        if (isdigit((unsigned char)*s)) {
            /* Jinja2's number: digits, then .digits and/or e[+-]digits for a float; scanned within
             * the source (it need not be NUL-terminated), then converted from a copy */
            const char *e = s;
            int is_float = 0;
            while (e < lim && isdigit((unsigned char)*e)) e++;
            if (e + 1 < lim && *e == '.' && isdigit((unsigned char)e[1])) {
                is_float = 1;
                for (e++; e < lim && isdigit((unsigned char)*e); e++) {
                }
            }
            if (e < lim && (*e == 'e' || *e == 'E')) {
                const char *x = e + 1;
                if (x < lim && (*x == '+' || *x == '-')) x++;
                if (x < lim && isdigit((unsigned char)*x)) {
                    is_float = 1;
                    for (e = x; e < lim && isdigit((unsigned char)*e); e++) {
                    }
                }
            }
            char num[64];
            size_t nl = (size_t)(e - s) < sizeof num - 1 ? (size_t)(e - s) : sizeof num - 1;
            memcpy(num, s, nl);
            num[nl] = 0;
            if (is_float) QT_TRY(push(l, (jtok){.kind = TK_FLOAT, .line = *line, .f = strtod(num, NULL)}));
            else QT_TRY(push(l, (jtok){.kind = TK_INT, .line = *line, .i = strtoll(num, NULL, 10)}));
            s = e;
            continue;
        }
        if (isalpha((unsigned char)*s) || *s == '_') {
            const char *b = s;
            while (s < lim && (isalnum((unsigned char)*s) || *s == '_')) s++;
            char *nm = ja_strdup(l->a, b, (size_t)(s - b));
            if (!nm) return QT_ENOMEM;
            QT_TRY(push(l, (jtok){.kind = TK_NAME, .line = *line, .text = nm, .len = (size_t)(s - b)}));
            continue;
        }
        const char *op = NULL;
        for (int k = 0; OPS[k]; k++)
            if ((size_t)(lim - s) >= strlen(OPS[k]) && !strncmp(s, OPS[k], strlen(OPS[k]))) {
                op = OPS[k];
                break;
            }
        if (!op) return QT_ERR(QT_EFORMAT, "chat template line %d: unexpected character '%c' in a tag", *line, *s);
        QT_TRY(push(l, (jtok){.kind = TK_OP, .line = *line, .text = op, .len = strlen(op)}));
        s += strlen(op);
    }
}

int jinja_lex(jarena *a, const char *src, size_t len, jtok **toks, size_t *ntoks) {
    toklist l = {a, NULL, 0, 0};
    if (len && src[len - 1] == '\n') len -= len >= 2 && src[len - 2] == '\r' ? 2 : 1; /* keep_trailing_newline off */
    const char *s = src, *lim = src + len;
    int line = 1, rc = QT_OK;
    int strip_next = 0; /* the previous tag ended with "-": strip leading whitespace of this text */
    int trim_next = 0;  /* the previous tag was a block or comment: drop one newline (trim_blocks) */
    while (rc == QT_OK && s < lim) {
        /* text up to the next tag */
        const char *t = s;
        while (t < lim && !(t[0] == '{' && t + 1 < lim && (t[1] == '{' || t[1] == '%' || t[1] == '#'))) t++;
        const char *tb = s, *te = t;
        if (strip_next) while (tb < te && is_space(*tb)) tb++;
        else if (trim_next && tb < te && *tb == '\n') tb++;
        else if (trim_next && te - tb >= 2 && tb[0] == '\r' && tb[1] == '\n') tb += 2;
        if (t < lim) {
            char kind = t[1], mod = t + 2 < lim ? t[2] : 0;
            if (mod == '-') {
                while (te > tb && is_space(te[-1])) te--;
            } else if (mod != '+' && kind != '{') {
                /* lstrip_blocks: only spaces/tabs between the line's start and the tag */
                const char *ls = te;
                while (ls > tb && (ls[-1] == ' ' || ls[-1] == '\t')) ls--;
                if ((ls > tb && ls[-1] == '\n') || (ls == tb && (ls == src || ls[-1] == '\n'))) te = ls;
            }
        }
        if (te > tb) {
            char *txt = ja_strdup(a, tb, (size_t)(te - tb));
            rc = txt ? push(&l, (jtok){.kind = TK_TEXT, .line = line, .text = txt, .len = (size_t)(te - tb)}) : QT_ENOMEM;
        }
        for (const char *p = s; p < t; p++) line += *p == '\n';
        strip_next = trim_next = 0;
        if (t >= lim || rc != QT_OK) break;
        char kind = t[1];
        s = t + 2;
        if (s < lim && (*s == '-' || *s == '+')) s++;
        if (kind == '#') {
            const char *e = s;
            while (e + 1 < lim && !(e[0] == '#' && e[1] == '}')) line += *e++ == '\n';
            if (e + 1 >= lim) {
                rc = QT_ERR(QT_EFORMAT, "chat template line %d: a comment is not closed with \"#}\"", line);
                break;
            }
            strip_next = e > s && e[-1] == '-';
            trim_next = !(e > s && (e[-1] == '-' || e[-1] == '+'));
            s = e + 2;
            continue;
        }
        const char *close = kind == '{' ? "}}" : "%}";
        rc = push(&l, (jtok){.kind = kind == '{' ? TK_VBEGIN : TK_BBEGIN, .line = line});
        const char *e = NULL;
        if (rc == QT_OK) rc = lex_tag(&l, s, lim, close, &line, &e);
        if (rc != QT_OK) break;
        strip_next = *e == '-';
        trim_next = kind == '%' && *e != '-' && *e != '+';
        if (*e == '-' || *e == '+') e++;
        rc = push(&l, (jtok){.kind = kind == '{' ? TK_VEND : TK_BEND, .line = line});
        s = e + 2;
    }
    if (rc == QT_OK) rc = push(&l, (jtok){.kind = TK_EOF, .line = line});
    if (rc != QT_OK) {
        qt_free(l.t);
        return rc;
    }
    /* the tokens move into the arena so the template owns them */
    *toks = ja_alloc(a, l.n * sizeof **toks);
    if (!*toks) {
        qt_free(l.t);
        return QT_ENOMEM;
    }
    memcpy(*toks, l.t, l.n * sizeof **toks);
    *ntoks = l.n;
    qt_free(l.t);
    return QT_OK;
}
