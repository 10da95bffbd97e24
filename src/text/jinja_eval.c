/* Renders a parsed template with Python's meanings, as Jinja2 in
 * transformers' sandbox gives them: values are Python's (str, int, float,
 * bool, None, list, dict, a namespace) plus Jinja2's Undefined (falsy, prints
 * as "", has length 0, raises when an attribute of it is read or it is added
 * to); a for loop's body is a scope of its own each iteration (a set inside
 * it does not leak, hence namespace()); strings are UTF-8, and length,
 * slicing and strip count code points as Python does. Every value lives in
 * the render's arena. */
#include "text/jinja_impl.h"

#include "core/error.h"
#include "core/mem.h"
#include "core/strbuf.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_NS, V_FUNC } vkind;

typedef struct jv jv;
struct jv {
    vkind k;
    long item;     /* index in the tracked list, or -1 */
    int64_t i;     /* V_BOOL, V_INT */
    double f;      /* V_FLOAT */
    const char *s; /* V_STR bytes; V_FUNC name; V_UNDEF the name that was missing */
    size_t n;
    jv **v;            /* list items, dict / namespace values */
    const char **keys; /* dict / namespace keys */
    size_t len, cap;
    jv *self; /* V_FUNC: the bound object (NULL for a global) */
};

typedef struct scope scope;
struct scope {
    const char **names;
    jv **vals;
    size_t n, cap;
    scope *up;
};

typedef struct {
    jarena a;
    qt_strbuf out;
    const jv *tracked;
    long cur_item; /* the tracked item whose loop iteration is running, or -1 */
    jinja_item_span *spans;
    size_t nspans, capspans;
    int brk, cont; /* a break / continue is unwinding the loop body */
} ctx;

#define OOM QT_ENOMEM
#define JINJA_MAX_OUTPUT (256 << 20) /* bytes one render may write */
static jv UNDEF_ = {.k = V_UNDEF, .item = -1, .s = "value"};

static jv *mk(ctx *c, vkind k) {
    jv *v = ja_alloc(&c->a, sizeof *v);
    if (v) {
        v->k = k;
        v->item = -1;
    }
    return v;
}
static jv *mk_str(ctx *c, const char *s, size_t n, int copy) {
    jv *v = mk(c, V_STR);
    if (!v) return NULL;
    v->s = copy ? ja_strdup(&c->a, s, n) : s;
    v->n = n;
    return v->s ? v : NULL;
}
static jv *mk_int(ctx *c, int64_t i) {
    jv *v = mk(c, V_INT);
    if (v) v->i = i;
    return v;
}
static jv *mk_bool(ctx *c, int b) {
    jv *v = mk(c, V_BOOL);
    if (v) v->i = !!b;
    return v;
}
static jv *mk_undef(ctx *c, const char *name) {
    jv *v = mk(c, V_UNDEF);
    if (v) v->s = name;
    return v;
}

static int push_item(ctx *c, jv *coll, const char *key, jv *val) {
    if (coll->len == coll->cap) {
        size_t cap = coll->cap ? coll->cap * 2 : 8;
        jv **nv = ja_alloc(&c->a, cap * sizeof *nv);
        const char **nk = ja_alloc(&c->a, cap * sizeof *nk);
        if (!nv || !nk) return OOM;
        if (coll->len) {
            memcpy(nv, coll->v, coll->len * sizeof *nv);
            if (coll->keys) memcpy(nk, coll->keys, coll->len * sizeof *nk);
        }
        coll->v = nv;
        coll->keys = nk;
        coll->cap = cap;
    }
    coll->keys[coll->len] = key;
    coll->v[coll->len++] = val;
    return QT_OK;
}

static jv *dict_get(const jv *d, const char *key, size_t kn) {
    for (size_t i = 0; i < d->len; i++)
        if (strlen(d->keys[i]) == kn && !memcmp(d->keys[i], key, kn)) return d->v[i];
    return NULL;
}

static int dict_set(ctx *c, jv *d, const char *key, jv *val) {
    for (size_t i = 0; i < d->len; i++)
        if (!strcmp(d->keys[i], key)) {
            d->v[i] = val;
            return QT_OK;
        }
    return push_item(c, d, key, val);
}

static const char *kind_name(const jv *v) {
    static const char *const names[] = {"undefined", "none", "bool", "int", "float", "str", "list", "dict", "namespace", "function"};
    return names[v->k];
}

/* ---- JSON in (the render's variables) ---- */
static jv *from_json(ctx *c, const cJSON *j) {
    jv *v;
    if (cJSON_IsNull(j)) return mk(c, V_NONE);
    if (cJSON_IsBool(j)) return mk_bool(c, cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0) return mk_int(c, (int64_t)d);
        if (!(v = mk(c, V_FLOAT))) return NULL;
        v->f = d;
        return v;
    }
    if (cJSON_IsString(j)) return mk_str(c, j->valuestring, strlen(j->valuestring), 0);
    int obj = cJSON_IsObject(j);
    if (!(v = mk(c, obj ? V_DICT : V_LIST))) return NULL;
    for (const cJSON *e = j->child; e; e = e->next) {
        jv *x = from_json(c, e);
        if (!x || push_item(c, v, obj ? e->string : NULL, x) != QT_OK) return NULL;
    }
    return v;
}

/* ---- text helpers: Python str semantics over UTF-8 ---- */
static size_t cp_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}
static size_t cp_off(const char *s, size_t n, size_t idx) { /* byte offset of code point idx */
    size_t k = 0, i = 0;
    for (; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80 && k++ == idx) return i;
    return n;
}
static unsigned cp_at(const char *s, size_t n, size_t i, size_t *len) {
    unsigned char b = (unsigned char)s[i];
    size_t l = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    if (i + l > n) l = 1;
    unsigned cp = l == 1 ? b : l == 2 ? b & 31 : l == 3 ? b & 15 : b & 7;
    for (size_t k = 1; k < l; k++) cp = (cp << 6) | ((unsigned char)s[i + k] & 63);
    *len = l;
    return cp;
}
/* str.isspace(), which str.strip() and str.split() use */
static int py_space(unsigned cp) {
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
static int in_chars(unsigned cp, const jv *chars) {
    for (size_t i = 0, l; i < chars->n; i += l)
        if (cp_at(chars->s, chars->n, i, &l) == cp) return 1;
    return 0;
}
/* str.strip / lstrip / rstrip; chars NULL: whitespace */
static void strip(const char *s, size_t n, const jv *chars, int left, int right, size_t *b, size_t *e) {
    size_t i = 0, j = n, l;
    while (left && i < j) {
        unsigned cp = cp_at(s, n, i, &l);
        if (chars ? !in_chars(cp, chars) : !py_space(cp)) break;
        i += l;
    }
    while (right && j > i) {
        size_t k = j - 1;
        while (k > i && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
        unsigned cp = cp_at(s, n, k, &l);
        if (chars ? !in_chars(cp, chars) : !py_space(cp)) break;
        j = k;
    }
    *b = i;
    *e = j;
}

/* ---- str(), repr(), truth, equality ---- */
static int put(ctx *c, qt_strbuf *b, const char *s, size_t n) {
    (void)c;
    return qt_strbuf_put(b, s, n);
}

static int py_float(qt_strbuf *b, double f) {
    if (isnan(f)) return qt_strbuf_put(b, "nan", 3);
    if (isinf(f)) return f > 0 ? qt_strbuf_put(b, "inf", 3) : qt_strbuf_put(b, "-inf", 4);
    if (f == floor(f) && fabs(f) < 1e16) { /* Python writes 2.0, json.dumps too */
        char t[40];
        int k = snprintf(t, sizeof t, "%.1f", f);
        return qt_strbuf_put(b, t, (size_t)k);
    }
    cJSON *num = cJSON_CreateNumber(f); /* jinja_tojson holds Python's float repr */
    if (!num) return OOM;
    int rc = jinja_tojson(num, b);
    cJSON_Delete(num);
    return rc;
}

static int to_str(ctx *c, const jv *v, qt_strbuf *b, int repr);

static int repr_str(qt_strbuf *b, const char *s, size_t n) {
    int dq = memchr(s, '\'', n) && !memchr(s, '"', n);
    char q = dq ? '"' : '\'';
    QT_TRY(qt_strbuf_put(b, &q, 1));
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char e[8];
        if (ch == '\\' || ch == (unsigned char)q) {
            e[0] = '\\';
            e[1] = (char)ch;
            QT_TRY(qt_strbuf_put(b, e, 2));
        } else if (ch == '\n') QT_TRY(qt_strbuf_put(b, "\\n", 2));
        else if (ch == '\r') QT_TRY(qt_strbuf_put(b, "\\r", 2));
        else if (ch == '\t') QT_TRY(qt_strbuf_put(b, "\\t", 2));
        else if (ch < 0x20 || ch == 0x7F) {
            snprintf(e, sizeof e, "\\x%02x", ch);
            QT_TRY(qt_strbuf_put(b, e, 4));
        } else QT_TRY(qt_strbuf_put(b, (const char *)&s[i], 1));
    }
    return qt_strbuf_put(b, &q, 1);
}

static int to_str(ctx *c, const jv *v, qt_strbuf *b, int repr) {
    char t[40];
    switch (v->k) {
    case V_UNDEF: return QT_OK;
    case V_NONE: return put(c, b, "None", 4);
    case V_BOOL: return v->i ? put(c, b, "True", 4) : put(c, b, "False", 5);
    case V_INT: return put(c, b, t, (size_t)snprintf(t, sizeof t, "%lld", (long long)v->i));
    case V_FLOAT: return py_float(b, v->f);
    case V_STR: return repr ? repr_str(b, v->s, v->n) : put(c, b, v->s, v->n);
    case V_LIST:
    case V_DICT:
        QT_TRY(put(c, b, v->k == V_LIST ? "[" : "{", 1));
        for (size_t i = 0; i < v->len; i++) {
            if (i) QT_TRY(put(c, b, ", ", 2));
            if (v->k == V_DICT) {
                QT_TRY(repr_str(b, v->keys[i], strlen(v->keys[i])));
                QT_TRY(put(c, b, ": ", 2));
            }
            QT_TRY(to_str(c, v->v[i], b, 1));
        }
        return put(c, b, v->k == V_LIST ? "]" : "}", 1);
    default: return QT_ERR(QT_EINVAL, "chat template: a %s cannot be written as text", kind_name(v));
    }
}

static int truthy(const jv *v) {
    switch (v->k) {
    case V_UNDEF:
    case V_NONE: return 0;
    case V_BOOL:
    case V_INT: return v->i != 0;
    case V_FLOAT: return v->f != 0;
    case V_STR: return v->n != 0;
    case V_LIST:
    case V_DICT: return v->len != 0;
    default: return 1;
    }
}

static int is_num(const jv *v) { return v->k == V_INT || v->k == V_BOOL || v->k == V_FLOAT; }
static double num(const jv *v) { return v->k == V_FLOAT ? v->f : (double)v->i; }

static int equal(const jv *a, const jv *b) {
    if (is_num(a) && is_num(b)) return num(a) == num(b);
    if (a->k != b->k) return 0;
    switch (a->k) {
    case V_UNDEF:
    case V_NONE: return 1;
    case V_STR: return a->n == b->n && !memcmp(a->s, b->s, a->n);
    case V_LIST:
    case V_DICT:
        if (a->len != b->len) return 0;
        for (size_t i = 0; i < a->len; i++) {
            if (a->k == V_DICT) {
                jv *o = dict_get(b, a->keys[i], strlen(a->keys[i]));
                if (!o || !equal(a->v[i], o)) return 0;
            } else if (!equal(a->v[i], b->v[i])) return 0;
        }
        return 1;
    default: return a == b;
    }
}

/* ---- JSON out: Python's json.dumps(v, ensure_ascii=False, indent=indent) ---- */
static int tojson(ctx *c, const jv *v, qt_strbuf *b, int indent, int depth) {
    if (depth > 64) return QT_ERR(QT_EINVAL, "chat template: tojson of a value nested deeper than 64 levels");
    switch (v->k) {
    case V_NONE: return put(c, b, "null", 4);
    case V_BOOL: return v->i ? put(c, b, "true", 4) : put(c, b, "false", 5);
    case V_INT:
    case V_FLOAT: {
        if (v->k == V_FLOAT && isnan(v->f)) return put(c, b, "NaN", 3);
        if (v->k == V_FLOAT && isinf(v->f)) return v->f > 0 ? put(c, b, "Infinity", 8) : put(c, b, "-Infinity", 9);
        if (v->k == V_FLOAT) return py_float(b, v->f);
        return to_str(c, v, b, 0);
    }
    case V_STR: {
        cJSON *s = cJSON_CreateString(ja_strdup(&c->a, v->s, v->n));
        if (!s) return OOM;
        int rc = jinja_tojson(s, b);
        cJSON_Delete(s);
        return rc;
    }
    case V_LIST:
    case V_DICT:
    case V_NS: {
        int obj = v->k != V_LIST;
        QT_TRY(put(c, b, obj ? "{" : "[", 1));
        for (size_t i = 0; i < v->len; i++) {
            if (i) QT_TRY(indent >= 0 ? put(c, b, ",", 1) : put(c, b, ", ", 2));
            if (indent >= 0) {
                QT_TRY(put(c, b, "\n", 1));
                for (int k = 0; k < indent * (depth + 1); k++) QT_TRY(put(c, b, " ", 1));
            }
            if (obj) {
                jv key = {.k = V_STR, .s = v->keys[i], .n = strlen(v->keys[i])};
                QT_TRY(tojson(c, &key, b, indent, depth + 1));
                QT_TRY(put(c, b, ": ", 2));
            }
            QT_TRY(tojson(c, v->v[i], b, indent, depth + 1));
        }
        if (indent >= 0 && v->len) {
            QT_TRY(put(c, b, "\n", 1));
            for (int k = 0; k < indent * depth; k++) QT_TRY(put(c, b, " ", 1));
        }
        return put(c, b, obj ? "}" : "]", 1);
    }
    default:
        return QT_ERR(QT_EINVAL, "chat template: tojson of a %s (Python's json.dumps raises: it is not JSON serializable)",
                      kind_name(v));
    }
}

/* ---- scopes ---- */
static jv *lookup(scope *s, const char *name) {
    for (; s; s = s->up)
        for (size_t i = s->n; i-- > 0;)
            if (!strcmp(s->names[i], name)) return s->vals[i];
    return NULL;
}

static int bind(ctx *c, scope *s, const char *name, jv *val) {
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) {
            s->vals[i] = val;
            return QT_OK;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 8;
        const char **nn = ja_alloc(&c->a, cap * sizeof *nn);
        jv **nv = ja_alloc(&c->a, cap * sizeof *nv);
        if (!nn || !nv) return OOM;
        if (s->n) {
            memcpy(nn, s->names, s->n * sizeof *nn);
            memcpy(nv, s->vals, s->n * sizeof *nv);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = val;
    return QT_OK;
}

/* ---- expressions ---- */
static int eval(ctx *c, scope *s, const jnode *e, jv **out);

static int arg(ctx *c, scope *s, const jnode *e, size_t pos, const char *kw, jv **out) {
    /* the pos-th positional argument, or the keyword kw; NULL when absent */
    size_t k = 0;
    *out = NULL;
    for (size_t i = 0; i < e->nargs; i++) {
        if (e->kw && e->kw[i]) {
            if (kw && !strcmp(e->kw[i], kw)) return eval(c, s, e->args[i], out);
        } else if (k++ == pos) {
            return eval(c, s, e->args[i], out);
        }
    }
    return QT_OK;
}

static int need_str(const jv *v, const char *what, int line) {
    if (v->k == V_STR) return QT_OK;
    if (v->k == V_UNDEF)
        return QT_ERR(QT_EINVAL, "chat template line %d: %s of an undefined value ('%s' is undefined)", line, what, v->s);
    return QT_ERR(QT_EINVAL, "chat template line %d: %s needs a string, not a %s", line, what, kind_name(v));
}

static int str_of(ctx *c, const jv *v, jv **out) {
    if (v->k == V_STR) {
        *out = (jv *)v;
        return QT_OK;
    }
    qt_strbuf b = {0};
    int rc = to_str(c, v, &b, 0);
    if (rc == QT_OK) *out = mk_str(c, b.p ? b.p : "", b.n, 1);
    qt_free(b.p);
    return rc != QT_OK ? rc : *out ? QT_OK : OOM;
}

static int get_attr(ctx *c, jv *o, const char *name, size_t nn, int line, jv **out) {
    static const char *const str_methods[] = {"startswith", "endswith", "strip", "lstrip", "rstrip", "split", "upper",
                                              "lower", "replace", "find", "join", "title", "capitalize", NULL};
    static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};
    const char *const *m = o->k == V_STR ? str_methods : o->k == V_DICT ? dict_methods : NULL;
    for (; m && *m; m++)
        if (strlen(*m) == nn && !memcmp(*m, name, nn)) {
            jv *f = mk(c, V_FUNC);
            if (!f) return OOM;
            f->s = *m;
            f->self = o;
            *out = f;
            return QT_OK;
        }
    if (o->k == V_UNDEF)
        return QT_ERR(QT_EINVAL, "chat template line %d: '%s' is undefined, so it has no attribute '%.*s'", line, o->s,
                      (int)nn, name);
    jv *r = o->k == V_DICT || o->k == V_NS ? dict_get(o, name, nn) : NULL;
    *out = r ? r : mk_undef(c, ja_strdup(&c->a, name, nn));
    return *out ? QT_OK : OOM;
}

static int get_item(ctx *c, jv *o, jv *key, int line, jv **out) {
    if (o->k == V_UNDEF) return QT_ERR(QT_EINVAL, "chat template line %d: '%s' is undefined, so it cannot be indexed", line, o->s);
    if (key->k == V_STR && (o->k == V_DICT || o->k == V_NS)) {
        jv *r = dict_get(o, key->s, key->n);
        *out = r ? r : mk_undef(c, ja_strdup(&c->a, key->s, key->n));
        return *out ? QT_OK : OOM;
    }
    if (key->k == V_STR) return get_attr(c, o, key->s, key->n, line, out); /* Jinja2 falls back to getattr */
    if ((key->k == V_INT || key->k == V_BOOL) && (o->k == V_LIST || o->k == V_STR)) {
        int64_t n = o->k == V_LIST ? (int64_t)o->len : (int64_t)cp_len(o->s, o->n), i = key->i;
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
            *out = mk_undef(c, "index out of range");
            return *out ? QT_OK : OOM;
        }
        if (o->k == V_LIST) *out = o->v[i];
        else {
            size_t b = cp_off(o->s, o->n, (size_t)i), e = cp_off(o->s, o->n, (size_t)i + 1);
            *out = mk_str(c, o->s + b, e - b, 0);
        }
        return *out ? QT_OK : OOM;
    }
    *out = mk_undef(c, "item");
    return *out ? QT_OK : OOM;
}

/* Python's slice indices for a sequence of n */
static void slice_idx(int64_t n, const jv *a, const jv *b, const jv *st, int64_t *start, int64_t *stop, int64_t *step) {
    *step = st && st->k != V_NONE ? st->i : 1;
    int neg = *step < 0;
    int64_t lo = neg ? -1 : 0, hi = neg ? n - 1 : n;
    if (a && a->k != V_NONE) {
        *start = a->i < 0 ? a->i + n : a->i;
        if (*start < lo) *start = lo;
        if (*start > hi) *start = hi;
    } else *start = neg ? hi : lo;
    if (b && b->k != V_NONE) {
        *stop = b->i < 0 ? b->i + n : b->i;
        if (*stop < lo) *stop = lo;
        if (*stop > hi) *stop = hi;
    } else *stop = neg ? lo : hi;
}

static int do_slice(ctx *c, jv *o, jv *a, jv *b, jv *st, int line, jv **out) {
    jv *parts[3] = {a, b, st};
    for (int k = 0; k < 3; k++)
        if (parts[k] && parts[k]->k != V_NONE && parts[k]->k != V_INT)
            return QT_ERR(QT_EINVAL, "chat template line %d: slice indices must be integers", line);
    if (st && st->k == V_INT && st->i == 0) return QT_ERR(QT_EINVAL, "chat template line %d: slice step cannot be zero", line);
    if (o->k != V_LIST && o->k != V_STR)
        return QT_ERR(QT_EINVAL, "chat template line %d: a %s cannot be sliced", line, kind_name(o));
    int64_t n = o->k == V_LIST ? (int64_t)o->len : (int64_t)cp_len(o->s, o->n), i0, i1, step;
    slice_idx(n, a, b, st, &i0, &i1, &step);
    if (o->k == V_LIST) {
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        for (int64_t i = i0; step > 0 ? i < i1 : i > i1; i += step) QT_TRY(push_item(c, l, NULL, o->v[i]));
        *out = l;
        return QT_OK;
    }
    qt_strbuf buf = {0};
    int rc = QT_OK;
    for (int64_t i = i0; rc == QT_OK && (step > 0 ? i < i1 : i > i1); i += step) {
        size_t bo = cp_off(o->s, o->n, (size_t)i), eo = cp_off(o->s, o->n, (size_t)i + 1);
        rc = qt_strbuf_put(&buf, o->s + bo, eo - bo);
    }
    if (rc == QT_OK) *out = mk_str(c, buf.p ? buf.p : "", buf.n, 1);
    qt_free(buf.p);
    return rc != QT_OK ? rc : *out ? QT_OK : OOM;
}

static int binop(ctx *c, const char *op, jv *a, jv *b, int line, jv **out) {
    if (!strcmp(op, "~")) {
        jv *sa, *sb;
        QT_TRY(str_of(c, a, &sa));
        QT_TRY(str_of(c, b, &sb));
        char *p = ja_alloc(&c->a, sa->n + sb->n + 1);
        if (!p) return OOM;
        memcpy(p, sa->s, sa->n);
        memcpy(p + sa->n, sb->s, sb->n);
        *out = mk_str(c, p, sa->n + sb->n, 0);
        return *out ? QT_OK : OOM;
    }
    if (!strcmp(op, "==") || !strcmp(op, "!=")) {
        *out = mk_bool(c, equal(a, b) == (op[0] == '='));
        return *out ? QT_OK : OOM;
    }
    if (!strcmp(op, "in") || !strcmp(op, "not in")) {
        int r = 0;
        if (b->k == V_STR) {
            QT_TRY(need_str(a, "\"in\" a string", line));
            r = a->n == 0;
            for (size_t i = 0; !r && a->n <= b->n && i + a->n <= b->n; i++) r = !memcmp(b->s + i, a->s, a->n);
        } else if (b->k == V_LIST) {
            for (size_t i = 0; !r && i < b->len; i++) r = equal(a, b->v[i]);
        } else if (b->k == V_DICT || b->k == V_NS) {
            r = a->k == V_STR && dict_get(b, a->s, a->n) != NULL;
        } else if (b->k != V_UNDEF) {
            return QT_ERR(QT_EINVAL, "chat template line %d: \"in\" a %s", line, kind_name(b));
        }
        *out = mk_bool(c, op[0] == 'i' ? r : !r);
        return *out ? QT_OK : OOM;
    }
    if (a->k == V_UNDEF || b->k == V_UNDEF)
        return QT_ERR(QT_EINVAL, "chat template line %d: '%s' is undefined (used with \"%s\")", line,
                      a->k == V_UNDEF ? a->s : b->s, op);
    if (op[0] == '<' || op[0] == '>') {
        int cmp;
        if (is_num(a) && is_num(b)) cmp = num(a) < num(b) ? -1 : num(a) > num(b);
        else if (a->k == V_STR && b->k == V_STR) {
            size_t m = a->n < b->n ? a->n : b->n;
            cmp = memcmp(a->s, b->s, m);
            if (!cmp) cmp = a->n < b->n ? -1 : a->n > b->n;
        } else return QT_ERR(QT_EINVAL, "chat template line %d: \"%s\" between a %s and a %s", line, op, kind_name(a), kind_name(b));
        int r = !strcmp(op, "<") ? cmp < 0 : !strcmp(op, ">") ? cmp > 0 : !strcmp(op, "<=") ? cmp <= 0 : cmp >= 0;
        *out = mk_bool(c, r);
        return *out ? QT_OK : OOM;
    }
    if (!strcmp(op, "+") && a->k == b->k && (a->k == V_STR || a->k == V_LIST)) {
        if (a->k == V_STR) {
            char *p = ja_alloc(&c->a, a->n + b->n + 1);
            if (!p) return OOM;
            memcpy(p, a->s, a->n);
            memcpy(p + a->n, b->s, b->n);
            *out = mk_str(c, p, a->n + b->n, 0);
            return *out ? QT_OK : OOM;
        }
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        for (size_t i = 0; i < a->len; i++) QT_TRY(push_item(c, l, NULL, a->v[i]));
        for (size_t i = 0; i < b->len; i++) QT_TRY(push_item(c, l, NULL, b->v[i]));
        *out = l;
        return QT_OK;
    }
    if (!strcmp(op, "*") && ((a->k == V_STR && b->k == V_INT) || (a->k == V_INT && b->k == V_STR))) {
        jv *sv = a->k == V_STR ? a : b;
        int64_t times = a->k == V_INT ? a->i : b->i;
        if (times > 0 && sv->n && (uint64_t)times > (uint64_t)JINJA_MAX_OUTPUT / sv->n)
            return QT_ERR(QT_EINVAL, "chat template line %d: a string repeated %lld times passes %d MiB", line,
                          (long long)times, JINJA_MAX_OUTPUT >> 20);
        qt_strbuf buf = {0};
        int rc = QT_OK;
        for (int64_t k = 0; rc == QT_OK && k < times; k++) rc = qt_strbuf_put(&buf, sv->s, sv->n);
        if (rc == QT_OK) *out = mk_str(c, buf.p ? buf.p : "", buf.n, 1);
        qt_free(buf.p);
        return rc != QT_OK ? rc : *out ? QT_OK : OOM;
    }
    if (!is_num(a) || !is_num(b))
        return QT_ERR(QT_EINVAL, "chat template line %d: \"%s\" between a %s and a %s (Python raises a TypeError)", line, op,
                      kind_name(a), kind_name(b));
    int ints = a->k != V_FLOAT && b->k != V_FLOAT;
    double x = num(a), y = num(b);
    if ((!strcmp(op, "/") || !strcmp(op, "//") || !strcmp(op, "%")) && y == 0)
        return QT_ERR(QT_EINVAL, "chat template line %d: division by zero", line);
    jv *r;
    if (ints && strcmp(op, "/") && strcmp(op, "**")) {
        int64_t p = a->i, q = b->i, v = 0;
        int over = 0;
        if (!strcmp(op, "+")) over = __builtin_add_overflow(p, q, &v);
        else if (!strcmp(op, "-")) over = __builtin_sub_overflow(p, q, &v);
        else if (!strcmp(op, "*")) over = __builtin_mul_overflow(p, q, &v);
        else if (q == -1) { /* INT64_MIN / -1 traps */
            if (!strcmp(op, "//")) over = __builtin_sub_overflow((int64_t)0, p, &v);
            else v = 0;
        } else if (!strcmp(op, "//")) v = (p / q) - ((p % q != 0) && ((p < 0) != (q < 0)));
        else v = p % q, v += (v != 0 && (v < 0) != (q < 0)) ? q : 0;
        if (over)
            return QT_ERR(QT_EINVAL, "chat template line %d: %lld %s %lld passes 64-bit integers (qtune's Jinja "
                                     "integers are 64-bit)", line, (long long)p, op, (long long)q);
        *out = mk_int(c, v);
        return *out ? QT_OK : OOM;
    }
    if (!(r = mk(c, V_FLOAT))) return OOM;
    if (!strcmp(op, "+")) r->f = x + y;
    else if (!strcmp(op, "-")) r->f = x - y;
    else if (!strcmp(op, "*")) r->f = x * y;
    else if (!strcmp(op, "/")) r->f = x / y;
    else if (!strcmp(op, "//")) r->f = floor(x / y);
    else if (!strcmp(op, "**")) r->f = pow(x, y);
    else r->f = x - y * floor(x / y);
    if (ints && !strcmp(op, "**") && y >= 0) {
        if (!(fabs(r->f) < 9223372036854775808.0))
            return QT_ERR(QT_EINVAL, "chat template line %d: %lld ** %lld passes 64-bit integers (qtune's Jinja "
                                     "integers are 64-bit)", line, (long long)a->i, (long long)b->i);
        r->k = V_INT;
        r->i = (int64_t)llround(r->f);
    }
    *out = r;
    return QT_OK;
}

static int apply_test(ctx *c, scope *s, const jnode *e, jv *v, int *res) {
    const char *t = e->s;
    jv *x = NULL;
    if (!strcmp(t, "defined")) *res = v->k != V_UNDEF;
    else if (!strcmp(t, "undefined")) *res = v->k == V_UNDEF;
    else if (!strcmp(t, "none")) *res = v->k == V_NONE;
    else if (!strcmp(t, "string")) *res = v->k == V_STR;
    else if (!strcmp(t, "number")) *res = is_num(v);
    else if (!strcmp(t, "integer")) *res = v->k == V_INT;
    else if (!strcmp(t, "float")) *res = v->k == V_FLOAT;
    else if (!strcmp(t, "boolean")) *res = v->k == V_BOOL;
    else if (!strcmp(t, "true")) *res = v->k == V_BOOL && v->i;
    else if (!strcmp(t, "false")) *res = v->k == V_BOOL && !v->i;
    else if (!strcmp(t, "mapping")) *res = v->k == V_DICT;
    else if (!strcmp(t, "iterable")) *res = v->k == V_LIST || v->k == V_DICT || v->k == V_STR;
    else if (!strcmp(t, "sequence")) *res = v->k == V_LIST || v->k == V_DICT || v->k == V_STR;
    else if (!strcmp(t, "callable")) *res = v->k == V_FUNC;
    else if (!strcmp(t, "odd") || !strcmp(t, "even")) {
        if (v->k != V_INT) return QT_ERR(QT_EINVAL, "chat template line %d: \"is %s\" of a %s", e->line, t, kind_name(v));
        *res = (v->i % 2 != 0) == (t[0] == 'o');
    } else { /* eq, equalto, ne */
        QT_TRY(arg(c, s, e, 0, NULL, &x));
        if (!x) return QT_ERR(QT_EINVAL, "chat template line %d: \"is %s\" needs a value to compare with", e->line, t);
        *res = equal(v, x) == (strcmp(t, "ne") != 0);
    }
    return QT_OK;
}

static int apply_filter(ctx *c, scope *s, const jnode *e, jv *v, jv **out);

static int call_method(ctx *c, scope *s, const jnode *e, jv *f, jv **out) {
    jv *self = f->self, *a0 = NULL, *a1 = NULL;
    const char *m = f->s;
    QT_TRY(arg(c, s, e, 0, NULL, &a0));
    QT_TRY(arg(c, s, e, 1, NULL, &a1));
    if (!self) { /* a global */
        if (!strcmp(m, "raise_exception")) {
            jv *msg = a0 ? a0 : mk_undef(c, "message");
            QT_TRY(str_of(c, msg, &msg));
            return QT_ERR(QT_EINVAL, "the chat template refuses this conversation: %.*s", (int)msg->n, msg->s);
        }
        if (!strcmp(m, "namespace")) {
            jv *ns = mk(c, V_NS);
            if (!ns) return OOM;
            for (size_t i = 0; i < e->nargs; i++) {
                jv *x;
                QT_TRY(eval(c, s, e->args[i], &x));
                if (e->kw[i]) QT_TRY(dict_set(c, ns, e->kw[i], x));
                else if (x->k == V_DICT)
                    for (size_t k = 0; k < x->len; k++) QT_TRY(dict_set(c, ns, x->keys[k], x->v[k]));
                else return QT_ERR(QT_EINVAL, "chat template line %d: namespace() takes a dict or keywords", e->line);
            }
            *out = ns;
            return QT_OK;
        }
        /* range */
        jv *a2 = NULL;
        QT_TRY(arg(c, s, e, 2, NULL, &a2));
        if (!a0 || a0->k != V_INT || (a1 && a1->k != V_INT) || (a2 && a2->k != V_INT))
            return QT_ERR(QT_EINVAL, "chat template line %d: range() takes integers", e->line);
        int64_t lo = a1 ? a0->i : 0, hi = a1 ? a1->i : a0->i, st = a2 ? a2->i : 1;
        if (!st) return QT_ERR(QT_EINVAL, "chat template line %d: range() step must not be zero", e->line);
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        for (int64_t i = lo; st > 0 ? i < hi : i > hi;) {
            if (l->len > 1000000) return QT_ERR(QT_EINVAL, "chat template line %d: range() over a million items", e->line);
            jv *x = mk_int(c, i);
            if (!x) return OOM;
            QT_TRY(push_item(c, l, NULL, x));
            if (__builtin_add_overflow(i, st, &i)) break; /* past the 64-bit end: past hi too */
        }
        *out = l;
        return QT_OK;
    }
    if (self->k == V_DICT) {
        if (!strcmp(m, "get")) {
            if (!a0 || a0->k != V_STR) return QT_ERR(QT_EINVAL, "chat template line %d: dict.get() needs a string key", e->line);
            jv *r = dict_get(self, a0->s, a0->n);
            *out = r ? r : a1 ? a1 : mk(c, V_NONE);
            return *out ? QT_OK : OOM;
        }
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        for (size_t i = 0; i < self->len; i++) {
            jv *key = mk_str(c, self->keys[i], strlen(self->keys[i]), 0), *x = key;
            if (!key) return OOM;
            if (!strcmp(m, "values")) x = self->v[i];
            else if (!strcmp(m, "items")) {
                if (!(x = mk(c, V_LIST))) return OOM;
                QT_TRY(push_item(c, x, NULL, key));
                QT_TRY(push_item(c, x, NULL, self->v[i]));
            }
            QT_TRY(push_item(c, l, NULL, x));
        }
        *out = l;
        return QT_OK;
    }
    /* string methods */
    const char *p = self->s;
    size_t n = self->n;
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        int r = 0;
        size_t cnt = a0 && a0->k == V_LIST ? a0->len : 1;
        for (size_t k = 0; k < cnt && !r; k++) {
            jv *pre = a0 && a0->k == V_LIST ? a0->v[k] : a0;
            if (!pre) return QT_ERR(QT_EINVAL, "chat template line %d: str.%s() needs an argument", e->line, m);
            QT_TRY(need_str(pre, m, e->line));
            r = pre->n <= n && !memcmp(m[0] == 's' ? p : p + n - pre->n, pre->s, pre->n);
        }
        *out = mk_bool(c, r);
    } else if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        if (a0 && a0->k != V_NONE) QT_TRY(need_str(a0, m, e->line));
        size_t b, en;
        strip(p, n, a0 && a0->k == V_STR ? a0 : NULL, m[0] != 'r', m[0] != 'l', &b, &en);
        *out = mk_str(c, p + b, en - b, 0);
    } else if (!strcmp(m, "upper") || !strcmp(m, "lower") || !strcmp(m, "title") || !strcmp(m, "capitalize")) {
        char *q = ja_strdup(&c->a, p, n);
        if (!q) return OOM;
        int start = 1;
        for (size_t i = 0; i < n; i++) { /* ASCII letters: what chat templates apply these to */
            char ch = q[i];
            int up = m[0] == 'u' || ((m[0] == 't' || m[0] == 'c') && start);
            if (m[0] == 'c' && i > 0) up = 0;
            if (up && ch >= 'a' && ch <= 'z') q[i] = (char)(ch - 32);
            else if (!up && ch >= 'A' && ch <= 'Z') q[i] = (char)(ch + 32);
            start = !((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'));
        }
        *out = mk_str(c, q, n, 0);
    } else if (!strcmp(m, "split")) {
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        if (!a0 || a0->k == V_NONE) { /* on runs of whitespace, none empty */
            size_t i = 0, len;
            while (i < n) {
                while (i < n && py_space(cp_at(p, n, i, &len))) i += len;
                if (i >= n) break;
                size_t b = i;
                while (i < n && !py_space(cp_at(p, n, i, &len))) i += len;
                jv *x = mk_str(c, p + b, i - b, 0);
                if (!x) return OOM;
                QT_TRY(push_item(c, l, NULL, x));
            }
        } else {
            QT_TRY(need_str(a0, "str.split()", e->line));
            if (!a0->n) return QT_ERR(QT_EINVAL, "chat template line %d: str.split() with an empty separator", e->line);
            size_t b = 0;
            for (size_t i = 0; i + a0->n <= n;) {
                if (!memcmp(p + i, a0->s, a0->n)) {
                    jv *x = mk_str(c, p + b, i - b, 0);
                    if (!x) return OOM;
                    QT_TRY(push_item(c, l, NULL, x));
                    i += a0->n;
                    b = i;
                } else i++;
            }
            jv *x = mk_str(c, p + b, n - b, 0);
            if (!x) return OOM;
            QT_TRY(push_item(c, l, NULL, x));
        }
        *out = l;
    } else if (!strcmp(m, "replace") || !strcmp(m, "find")) {
        QT_TRY(need_str(a0 ? a0 : &UNDEF_, m, e->line));
        if (m[0] == 'f') {
            int64_t at = -1;
            for (size_t i = 0; at < 0 && i + a0->n <= n; i++)
                if (!memcmp(p + i, a0->s, a0->n)) at = (int64_t)cp_len(p, i);
            *out = mk_int(c, at);
        } else {
            jnode rf = *e; /* the replace filter with these arguments */
            rf.kind = N_FILTER;
            rf.s = "replace";
            return apply_filter(c, s, &rf, self, out);
        }
    } else if (!strcmp(m, "join")) {
        if (!a0 || a0->k != V_LIST) return QT_ERR(QT_EINVAL, "chat template line %d: str.join() needs a list", e->line);
        qt_strbuf b = {0};
        int rc = QT_OK;
        for (size_t i = 0; rc == QT_OK && i < a0->len; i++) {
            if (i) rc = qt_strbuf_put(&b, p, n);
            if (rc == QT_OK) rc = a0->v[i]->k == V_STR ? qt_strbuf_put(&b, a0->v[i]->s, a0->v[i]->n)
                                                        : QT_ERR(QT_EINVAL, "chat template line %d: str.join() of a %s",
                                                                 e->line, kind_name(a0->v[i]));
        }
        if (rc == QT_OK) *out = mk_str(c, b.p ? b.p : "", b.n, 1);
        qt_free(b.p);
        return rc != QT_OK ? rc : *out ? QT_OK : OOM;
    }
    return *out ? QT_OK : OOM;
}

static int apply_filter(ctx *c, scope *s, const jnode *e, jv *v, jv **out) {
    const char *f = e->s;
    jv *a0 = NULL, *a1 = NULL;
    *out = NULL;
    if (!strcmp(f, "tojson")) {
        QT_TRY(arg(c, s, e, 0, "indent", &a0));
        for (size_t i = 0; i < e->nargs; i++)
            if (e->kw[i] && strcmp(e->kw[i], "indent") && strcmp(e->kw[i], "ensure_ascii"))
                return QT_ERR(QT_EINVAL, "chat template line %d: tojson(%s=...) is outside qtune's Jinja subset", e->line, e->kw[i]);
        QT_TRY(arg(c, s, e, 99, "ensure_ascii", &a1));
        if (a1 && truthy(a1)) return QT_ERR(QT_EINVAL, "chat template line %d: tojson(ensure_ascii=true) is outside qtune's Jinja subset", e->line);
        qt_strbuf b = {0};
        int rc = tojson(c, v, &b, a0 && a0->k == V_INT ? (int)a0->i : -1, 0);
        if (rc == QT_OK) *out = mk_str(c, b.p ? b.p : "", b.n, 1);
        qt_free(b.p);
        return rc != QT_OK ? rc : *out ? QT_OK : OOM;
    }
    if (!strcmp(f, "trim")) {
        QT_TRY(arg(c, s, e, 0, "chars", &a0));
        jv *sv;
        QT_TRY(str_of(c, v, &sv));
        size_t b, en;
        strip(sv->s, sv->n, a0 && a0->k == V_STR ? a0 : NULL, 1, 1, &b, &en);
        *out = mk_str(c, sv->s + b, en - b, 0);
    } else if (!strcmp(f, "length") || !strcmp(f, "count")) {
        int64_t n = v->k == V_STR ? (int64_t)cp_len(v->s, v->n) : v->k == V_LIST || v->k == V_DICT ? (int64_t)v->len : 0;
        if (v->k != V_STR && v->k != V_LIST && v->k != V_DICT && v->k != V_UNDEF)
            return QT_ERR(QT_EINVAL, "chat template line %d: length of a %s", e->line, kind_name(v));
        *out = mk_int(c, n);
    } else if (!strcmp(f, "string")) {
        return str_of(c, v, out);
    } else if (!strcmp(f, "lower") || !strcmp(f, "upper") || !strcmp(f, "capitalize")) {
        jv *sv, fn = {.k = V_FUNC, .s = f};
        QT_TRY(str_of(c, v, &sv));
        fn.self = sv;
        jnode none = {.kind = N_CALL, .line = e->line};
        return call_method(c, s, &none, &fn, out);
    } else if (!strcmp(f, "first") || !strcmp(f, "last")) {
        jv idx = {.k = V_INT, .i = f[0] == 'f' ? 0 : -1};
        return get_item(c, v, &idx, e->line, out);
    } else if (!strcmp(f, "join")) {
        QT_TRY(arg(c, s, e, 0, "d", &a0));
        QT_TRY(arg(c, s, e, 1, "attribute", &a1));
        if (a1) return QT_ERR(QT_EINVAL, "chat template line %d: join(attribute=...) is outside qtune's Jinja subset", e->line);
        if (v->k != V_LIST) return QT_ERR(QT_EINVAL, "chat template line %d: join of a %s", e->line, kind_name(v));
        qt_strbuf b = {0};
        int rc = QT_OK;
        for (size_t i = 0; rc == QT_OK && i < v->len; i++) {
            if (i && a0) rc = to_str(c, a0, &b, 0);
            if (rc == QT_OK) rc = to_str(c, v->v[i], &b, 0);
        }
        if (rc == QT_OK) *out = mk_str(c, b.p ? b.p : "", b.n, 1);
        qt_free(b.p);
        return rc != QT_OK ? rc : *out ? QT_OK : OOM;
    } else if (!strcmp(f, "default") || !strcmp(f, "d")) {
        QT_TRY(arg(c, s, e, 0, "default_value", &a0));
        QT_TRY(arg(c, s, e, 1, "boolean", &a1));
        int use = v->k == V_UNDEF || (a1 && truthy(a1) && !truthy(v));
        *out = use ? (a0 ? a0 : mk_str(c, "", 0, 0)) : v;
    } else if (!strcmp(f, "replace")) {
        jv *a2 = NULL;
        QT_TRY(arg(c, s, e, 0, "old", &a0));
        QT_TRY(arg(c, s, e, 1, "new", &a1));
        QT_TRY(arg(c, s, e, 2, "count", &a2));
        jv *sv;
        QT_TRY(str_of(c, v, &sv));
        if (!a0 || !a1) return QT_ERR(QT_EINVAL, "chat template line %d: replace needs the old and the new text", e->line);
        QT_TRY(str_of(c, a0, &a0));
        QT_TRY(str_of(c, a1, &a1));
        int64_t left = a2 && a2->k == V_INT ? a2->i : -1;
        qt_strbuf b = {0};
        int rc = qt_strbuf_put(&b, "", 0);
        size_t i = 0;
        while (rc == QT_OK && i <= sv->n) {
            if (left != 0 && i + a0->n <= sv->n && !memcmp(sv->s + i, a0->s, a0->n)) {
                rc = qt_strbuf_put(&b, a1->s, a1->n);
                if (left > 0) left--;
                if (a0->n) {
                    i += a0->n;
                    continue;
                }
            }
            if (i < sv->n && rc == QT_OK) rc = qt_strbuf_put(&b, sv->s + i, 1);
            i++;
        }
        if (rc == QT_OK) *out = mk_str(c, b.p, b.n, 1);
        qt_free(b.p);
        return rc != QT_OK ? rc : *out ? QT_OK : OOM;
    } else if (!strcmp(f, "list") || !strcmp(f, "reverse")) {
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        if (v->k == V_LIST) {
            for (size_t i = 0; i < v->len; i++) QT_TRY(push_item(c, l, NULL, v->v[i]));
        } else if (v->k == V_DICT) {
            for (size_t i = 0; i < v->len; i++) {
                jv *k = mk_str(c, v->keys[i], strlen(v->keys[i]), 0);
                if (!k) return OOM;
                QT_TRY(push_item(c, l, NULL, k));
            }
        } else if (v->k == V_STR) {
            if (f[0] == 'r') {
                jv none = {.k = V_NONE}, step = {.k = V_INT, .i = -1};
                return do_slice(c, v, &none, &none, &step, e->line, out);
            }
            for (size_t i = 0, l2; i < v->n; i += l2) {
                cp_at(v->s, v->n, i, &l2);
                jv *ch = mk_str(c, v->s + i, l2, 0);
                if (!ch) return OOM;
                QT_TRY(push_item(c, l, NULL, ch));
            }
        } else if (v->k != V_UNDEF) {
            return QT_ERR(QT_EINVAL, "chat template line %d: %s of a %s", e->line, f, kind_name(v));
        }
        if (f[0] == 'r')
            for (size_t i = 0; i < l->len / 2; i++) {
                jv *t = l->v[i];
                l->v[i] = l->v[l->len - 1 - i];
                l->v[l->len - 1 - i] = t;
            }
        *out = l;
    } else if (!strcmp(f, "items")) {
        if (v->k != V_DICT) return QT_ERR(QT_EINVAL, "chat template line %d: items of a %s", e->line, kind_name(v));
        jv fn = {.k = V_FUNC, .s = "items", .self = v};
        jnode none = {.kind = N_CALL, .line = e->line};
        return call_method(c, s, &none, &fn, out);
    } else if (!strcmp(f, "int")) {
        if (v->k == V_FLOAT && !isnan(v->f) && !(fabs(v->f) < 9223372036854775808.0))
            return QT_ERR(QT_EINVAL, "chat template line %d: %g | int passes 64-bit integers (qtune's Jinja integers "
                                     "are 64-bit)", e->line, v->f);
        *out = mk_int(c, v->k == V_FLOAT ? (isnan(v->f) ? 0 : (int64_t)v->f) : v->k == V_INT || v->k == V_BOOL ? v->i
                                                        : v->k == V_STR ? strtoll(ja_strdup(&c->a, v->s, v->n), NULL, 10) : 0);
    } else if (!strcmp(f, "float")) {
        if (!(*out = mk(c, V_FLOAT))) return OOM;
        (*out)->f = is_num(v) ? num(v) : v->k == V_STR ? strtod(ja_strdup(&c->a, v->s, v->n), NULL) : 0;
    } else if (!strcmp(f, "abs")) {
        if (!is_num(v)) return QT_ERR(QT_EINVAL, "chat template line %d: abs of a %s", e->line, kind_name(v));
        if (v->k == V_FLOAT) {
            if (!(*out = mk(c, V_FLOAT))) return OOM;
            (*out)->f = fabs(v->f);
        } else *out = mk_int(c, v->i < 0 ? -v->i : v->i);
    } else if (!strcmp(f, "safe")) {
        *out = v;
    } else if (!strcmp(f, "map")) {
        QT_TRY(arg(c, s, e, 99, "attribute", &a0));
        if (!a0 || a0->k != V_STR || v->k != V_LIST)
            return QT_ERR(QT_EINVAL, "chat template line %d: only map(attribute=\"name\") over a list is in qtune's Jinja subset", e->line);
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        for (size_t i = 0; i < v->len; i++) {
            jv *x;
            QT_TRY(get_item(c, v->v[i], a0, e->line, &x));
            QT_TRY(push_item(c, l, NULL, x));
        }
        *out = l;
    } else { /* selectattr / rejectattr (attribute[, test[, argument]]) */
        QT_TRY(arg(c, s, e, 0, NULL, &a0));
        QT_TRY(arg(c, s, e, 1, NULL, &a1));
        jv *a2 = NULL;
        QT_TRY(arg(c, s, e, 2, NULL, &a2));
        if (!a0 || a0->k != V_STR || v->k != V_LIST || (a1 && a1->k != V_STR))
            return QT_ERR(QT_EINVAL, "chat template line %d: %s(\"attribute\"[, \"test\", value]) over a list", e->line, f);
        jnode tn = {.kind = N_TEST, .line = e->line, .s = a1 ? ja_strdup(&c->a, a1->s, a1->n) : NULL};
        jnode cst = {.kind = N_CONST_NONE}, argn = {.kind = N_NAME, .s = "__arg"};
        jnode *targ = &cst;
        const char *kwnull = NULL;
        static const char *const known[] = {"defined", "undefined", "none", "string", "number", "integer", "float",
                                            "boolean", "true", "false", "mapping", "eq", "equalto", "ne", "odd", "even", NULL};
        if (tn.s) {
            int ok = 0;
            for (int k = 0; known[k]; k++) ok |= !strcmp(known[k], tn.s);
            if (!ok) return QT_ERR(QT_EINVAL, "chat template line %d: the test \"%s\" is outside qtune's Jinja subset", e->line, tn.s);
        }
        jv *l = mk(c, V_LIST);
        if (!l) return OOM;
        scope tmp = {0};
        tmp.up = s;
        if (a2) {
            QT_TRY(bind(c, &tmp, "__arg", a2));
            targ = &argn;
        }
        tn.args = &targ;
        tn.kw = &kwnull;
        tn.nargs = a2 ? 1 : 0;
        for (size_t i = 0; i < v->len; i++) {
            jv *x;
            QT_TRY(get_item(c, v->v[i], a0, e->line, &x));
            int r = truthy(x);
            if (tn.s) QT_TRY(apply_test(c, &tmp, &tn, x, &r));
            if (r == (f[0] == 's')) QT_TRY(push_item(c, l, NULL, v->v[i]));
        }
        *out = l;
    }
    return *out ? QT_OK : OOM;
}

/* A chain of one operator, a + b + c + d (how templates write a turn:
 * '<|im_start|>' + role + '\n' + content + '<|im_end|>'), whose operands are
 * all strings: one allocation for the whole, where pairwise evaluation
 * leaves a copy of the growing string in the arena at every step (a 45 MB
 * message would be held four times until the render ends). Anything else
 * is evaluated pairwise, left to right, as Jinja does. */
#define CHAIN_MAX 16
static int concat_chain(ctx *c, scope *s, const jnode *e, jv **out) {
    const jnode *spine[CHAIN_MAX];
    size_t k = 0;
    const jnode *n = e;
    while (k < CHAIN_MAX - 1 && n->kind == N_BIN && !strcmp(n->s, e->s)) {
        spine[k++] = n;
        n = n->a;
    }
    jv *v[CHAIN_MAX];
    QT_TRY(eval(c, s, n, &v[0])); /* the leftmost operand, then each right operand going up */
    for (size_t i = 0; i < k; i++) QT_TRY(eval(c, s, spine[k - 1 - i]->b, &v[i + 1]));
    int strings = 1;
    for (size_t i = 0; i <= k; i++) {
        if (e->s[0] == '~') QT_TRY(str_of(c, v[i], &v[i]));
        strings &= v[i]->k == V_STR;
    }
    if (!strings) { /* numbers, lists, or an error to report with its operands */
        jv *acc = v[0];
        for (size_t i = 0; i < k; i++) QT_TRY(binop(c, e->s, acc, v[i + 1], spine[k - 1 - i]->line, &acc));
        *out = acc;
        return QT_OK;
    }
    size_t total = 0;
    for (size_t i = 0; i <= k; i++) total += v[i]->n;
    char *p = ja_alloc(&c->a, total + 1);
    if (!p) return OOM;
    for (size_t i = 0, at = 0; i <= k; at += v[i]->n, i++) memcpy(p + at, v[i]->s, v[i]->n);
    *out = mk_str(c, p, total, 0);
    return *out ? QT_OK : OOM;
}

static int eval(ctx *c, scope *s, const jnode *e, jv **out) {
    jv *a, *b;
    switch (e->kind) {
    case N_CONST_STR: *out = mk_str(c, e->s, e->n, 0); break;
    case N_CONST_INT: *out = mk_int(c, e->i); break;
    case N_CONST_FLOAT:
        if ((*out = mk(c, V_FLOAT))) (*out)->f = e->f;
        break;
    case N_CONST_BOOL: *out = mk_bool(c, (int)e->i); break;
    case N_CONST_NONE: *out = mk(c, V_NONE); break;
    case N_NAME: {
        jv *v = lookup(s, e->s);
        static const char *const globals[] = {"raise_exception", "namespace", "range", NULL};
        for (int k = 0; !v && globals[k]; k++)
            if (!strcmp(globals[k], e->s)) {
                if (!(v = mk(c, V_FUNC))) return OOM;
                v->s = globals[k];
            }
        *out = v ? v : mk_undef(c, e->s);
        break;
    }
    case N_ATTR:
        QT_TRY(eval(c, s, e->a, &a));
        return get_attr(c, a, e->s, strlen(e->s), e->line, out);
    case N_ITEM:
        QT_TRY(eval(c, s, e->a, &a));
        QT_TRY(eval(c, s, e->b, &b));
        return get_item(c, a, b, e->line, out);
    case N_SLICE: {
        jv *x = NULL, *y = NULL, *z = NULL;
        QT_TRY(eval(c, s, e->a, &a));
        if (e->b) QT_TRY(eval(c, s, e->b, &x));
        if (e->c) QT_TRY(eval(c, s, e->c, &y));
        if (e->d) QT_TRY(eval(c, s, e->d, &z));
        return do_slice(c, a, x, y, z, e->line, out);
    }
    case N_CALL:
        QT_TRY(eval(c, s, e->a, &a));
        if (a->k != V_FUNC) {
            if (a->k == V_UNDEF && e->a->kind == N_ATTR)
                return QT_ERR(QT_EINVAL, "chat template line %d: the method .%s() is outside qtune's Jinja subset (or the "
                              "value has no such method)", e->line, e->a->s);
            return QT_ERR(QT_EINVAL, "chat template line %d: a %s cannot be called", e->line, kind_name(a));
        }
        return call_method(c, s, e, a, out);
    case N_FILTER:
        QT_TRY(eval(c, s, e->a, &a));
        return apply_filter(c, s, e, a, out);
    case N_TEST: {
        int r;
        QT_TRY(eval(c, s, e->a, &a));
        QT_TRY(apply_test(c, s, e, a, &r));
        *out = mk_bool(c, e->i ? !r : r);
        break;
    }
    case N_NOT:
        QT_TRY(eval(c, s, e->a, &a));
        *out = mk_bool(c, !truthy(a));
        break;
    case N_NEG:
        QT_TRY(eval(c, s, e->a, &a));
        if (!is_num(a)) return QT_ERR(QT_EINVAL, "chat template line %d: unary minus of a %s", e->line, kind_name(a));
        if (a->k == V_FLOAT) {
            if ((*out = mk(c, V_FLOAT))) (*out)->f = -a->f;
        } else if (a->i == INT64_MIN) {
            return QT_ERR(QT_EINVAL, "chat template line %d: -(%lld) passes 64-bit integers (qtune's Jinja integers "
                                     "are 64-bit)", e->line, (long long)a->i);
        } else *out = mk_int(c, -a->i);
        break;
    case N_BIN:
        if (!strcmp(e->s, "+") || !strcmp(e->s, "~")) return concat_chain(c, s, e, out);
        QT_TRY(eval(c, s, e->a, &a));
        QT_TRY(eval(c, s, e->b, &b));
        return binop(c, e->s, a, b, e->line, out);
    case N_AND:
    case N_OR: /* Python's: the deciding operand itself */
        QT_TRY(eval(c, s, e->a, &a));
        if (truthy(a) == (e->kind == N_OR)) {
            *out = a;
            return QT_OK;
        }
        return eval(c, s, e->b, out);
    case N_COND:
        QT_TRY(eval(c, s, e->a, &a));
        if (truthy(a)) return eval(c, s, e->b, out);
        if (e->c) return eval(c, s, e->c, out);
        *out = mk_undef(c, "the else branch");
        break;
    case N_LIST:
    case N_DICT: {
        jv *v = mk(c, e->kind == N_LIST ? V_LIST : V_DICT);
        if (!v) return OOM;
        for (size_t i = 0; i < e->nargs; i += e->kind == N_LIST ? 1 : 2) {
            QT_TRY(eval(c, s, e->args[i], &a));
            if (e->kind == N_LIST) {
                QT_TRY(push_item(c, v, NULL, a));
                continue;
            }
            QT_TRY(eval(c, s, e->args[i + 1], &b));
            if (a->k != V_STR) return QT_ERR(QT_EINVAL, "chat template line %d: only string dict keys are in qtune's Jinja subset", e->line);
            QT_TRY(dict_set(c, v, ja_strdup(&c->a, a->s, a->n), b));
        }
        *out = v;
        break;
    }
    default: return QT_ERR(QT_EINVAL, "chat template line %d: a statement where an expression belongs", e->line);
    }
    return *out ? QT_OK : OOM;
}

/* ---- statements ---- */
static int exec_body(ctx *c, scope *s, const jnode *n);

static int loop_var(ctx *c, size_t i, size_t len, jv *items, jv **out) {
    jv *l = mk(c, V_DICT);
    if (!l) return OOM;
    struct {
        const char *k;
        int64_t v;
        int is_bool;
    } f[] = {{"index", (int64_t)i + 1, 0},       {"index0", (int64_t)i, 0}, {"revindex", (int64_t)(len - i), 0},
             {"revindex0", (int64_t)(len - i - 1), 0}, {"first", i == 0, 1}, {"last", i + 1 == len, 1},
             {"length", (int64_t)len, 0}};
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++) {
        jv *x = f[k].is_bool ? mk_bool(c, (int)f[k].v) : mk_int(c, f[k].v);
        if (!x) return OOM;
        QT_TRY(push_item(c, l, f[k].k, x));
    }
    QT_TRY(push_item(c, l, "previtem", i > 0 ? items->v[i - 1] : mk_undef(c, "loop.previtem")));
    QT_TRY(push_item(c, l, "nextitem", i + 1 < len ? items->v[i + 1] : mk_undef(c, "loop.nextitem")));
    *out = l;
    return QT_OK;
}

static int exec_for(ctx *c, scope *s, const jnode *n) {
    jv *it;
    QT_TRY(eval(c, s, n->a, &it));
    jv *items = it;
    if (it->k == V_DICT || it->k == V_STR) {
        jnode lf = {.kind = N_FILTER, .s = "list", .line = n->line};
        QT_TRY(apply_filter(c, s, &lf, it, &items));
    } else if (it->k == V_UNDEF) {
        items = mk(c, V_LIST);
        if (!items) return OOM;
    } else if (it->k != V_LIST) {
        return QT_ERR(QT_EINVAL, "chat template line %d: a %s cannot be looped over", n->line, kind_name(it));
    }
    if (n->d) { /* {% for x in xs if cond %}: the filter runs before loop.* is counted */
        jv *kept = mk(c, V_LIST);
        if (!kept) return OOM;
        for (size_t i = 0; i < items->len; i++) {
            scope f = {.up = s};
            QT_TRY(bind(c, &f, n->s, items->v[i]));
            jv *r;
            QT_TRY(eval(c, &f, n->d, &r));
            if (truthy(r)) QT_TRY(push_item(c, kept, NULL, items->v[i]));
        }
        items = kept;
    }
    for (size_t i = 0; i < items->len; i++) {
        scope body = {.up = s};
        jv *x = items->v[i], *lv;
        if (n->s2) {
            if (x->k != V_LIST || x->len != 2)
                return QT_ERR(QT_EINVAL, "chat template line %d: two loop variables need pairs", n->line);
            QT_TRY(bind(c, &body, n->s, x->v[0]));
            QT_TRY(bind(c, &body, n->s2, x->v[1]));
        } else QT_TRY(bind(c, &body, n->s, x));
        QT_TRY(loop_var(c, i, items->len, items, &lv));
        QT_TRY(bind(c, &body, "loop", lv));
        long outer = c->cur_item;
        int track = x->item >= 0 && outer < 0;
        size_t start = c->out.n;
        if (track) c->cur_item = x->item;
        int rc = exec_body(c, &body, n->b);
        c->cur_item = outer;
        if (rc != QT_OK) return rc;
        if (track && c->out.n > start) {
            if (c->nspans == c->capspans) {
                size_t cap = c->capspans ? 2 * c->capspans : 16;
                jinja_item_span *g = qt_realloc(c->spans, cap * sizeof *g, "template spans");
                if (!g) return OOM;
                c->spans = g;
                c->capspans = cap;
            }
            c->spans[c->nspans++] = (jinja_item_span){(size_t)x->item, start, c->out.n};
        }
        c->cont = 0;
        if (c->brk) {
            c->brk = 0;
            break;
        }
    }
    if (!items->len && n->c) return exec_body(c, s, n->c);
    return QT_OK;
}

static int exec_body(ctx *c, scope *s, const jnode *n) {
    for (; n && !c->brk && !c->cont; n = n->next) {
        jv *v;
        switch (n->kind) {
        case N_TEXT: QT_TRY(qt_strbuf_put(&c->out, n->s, n->n)); break;
        case N_OUT:
            QT_TRY(eval(c, s, n->a, &v));
            QT_TRY(to_str(c, v, &c->out, 0));
            break;
        default: break;
        }
        if (c->out.n > JINJA_MAX_OUTPUT)
            return QT_ERR(QT_EINVAL, "chat template line %d: the rendered text passed %d MiB; a template loops without end?",
                          n->line, JINJA_MAX_OUTPUT >> 20);
        switch (n->kind) {
        case N_TEXT:
        case N_OUT: break;
        case N_IF: {
            const jnode *br = n;
            while (br && br->kind == N_IF) {
                QT_TRY(eval(c, s, br->a, &v));
                if (truthy(v)) {
                    QT_TRY(exec_body(c, s, br->b));
                    break;
                }
                br = br->c;
                if (br && br->kind != N_IF) {
                    QT_TRY(exec_body(c, s, br));
                    break;
                }
            }
            break;
        }
        case N_FOR: QT_TRY(exec_for(c, s, n)); break;
        case N_SET:
            QT_TRY(eval(c, s, n->a, &v));
            if (n->s2) {
                jv *ns = lookup(s, n->s);
                if (!ns || ns->k != V_NS)
                    return QT_ERR(QT_EINVAL, "chat template line %d: \"set %s.%s\" needs %s to be a namespace()", n->line,
                                  n->s, n->s2, n->s);
                QT_TRY(dict_set(c, ns, n->s2, v));
            } else QT_TRY(bind(c, s, n->s, v));
            break;
        case N_BREAK: c->brk = 1; break;
        case N_CONTINUE: c->cont = 1; break;
        case N_BLOCK: QT_TRY(exec_body(c, s, n->b)); break;
        default: return QT_ERR(QT_EINVAL, "chat template line %d: an expression where a statement belongs", n->line);
        }
    }
    return QT_OK;
}

int jinja_render(const jinja_template *t, const cJSON *vars, const char *track, char **out, size_t *len,
                 jinja_item_span **spans, size_t *nspans) {
    ctx c = {.cur_item = -1};
    scope top = {0};
    *out = NULL;
    if (spans) *spans = NULL;
    if (nspans) *nspans = 0;
    int rc = qt_strbuf_put(&c.out, "", 0);
    for (const cJSON *v = vars ? vars->child : NULL; rc == QT_OK && v; v = v->next) {
        jv *x = from_json(&c, v);
        if (!x) rc = OOM;
        else if (track && !strcmp(v->string, track) && x->k == V_LIST)
            for (size_t i = 0; i < x->len; i++) x->v[i]->item = (long)i;
        if (rc == QT_OK) rc = bind(&c, &top, v->string, x);
    }
    if (rc == QT_OK) rc = exec_body(&c, &top, t->body);
    if (rc != QT_OK && c.a.capped) rc = QT_EINVAL; /* the message says why */
    ja_free(&c.a);
    if (rc != QT_OK) {
        qt_free(c.out.p);
        qt_free(c.spans);
        return rc;
    }
    *out = c.out.p;
    if (len) *len = c.out.n;
    if (spans) *spans = c.spans;
    else qt_free(c.spans);
    if (nspans) *nspans = c.nspans;
    return QT_OK;
}
