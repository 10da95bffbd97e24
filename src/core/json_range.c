/* qt_json_check_range: a small scanner over JSON text cJSON has already
 * accepted, tracking the key path so the error can name the field. */
#define _GNU_SOURCE /* memmem */
#include "core/json_range.h"

#include "core/error.h"
#include "core/mem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Levels whose key or index the message names; deeper ones show as "...". */
#define JR_DEPTH 32

typedef struct {
    const char *key; /* the current key as written (escapes left as they are) */
    size_t klen;
    long index; /* arrays: the current element */
    int obj;
} jr_frame;

static void jr_path(char *out, size_t cap, const jr_frame *st, int depth) {
    size_t n = 0;
    out[0] = 0;
    for (int k = 0; k < depth && k < JR_DEPTH && n < cap; k++) {
        int w;
        if (st[k].obj) w = snprintf(out + n, cap - n, "%s%.*s", n ? "." : "", (int)(st[k].klen > 64 ? 64 : st[k].klen),
                                   st[k].key ? st[k].key : "?");
        else w = snprintf(out + n, cap - n, "[%ld]", st[k].index);
        if (w < 0) break;
        n += (size_t)w;
    }
    if (depth > JR_DEPTH && n < cap) snprintf(out + n, cap - n, "...");
    if (!out[0]) snprintf(out, cap, "the top-level value");
}

/* Checks one number token t[0, n). */
static int jr_number(const char *t, size_t n, const char *where, const jr_frame *st, int depth) {
    char small[128], *buf = small;
    if (n >= sizeof small) {
        buf = qt_malloc(n + 1, "a JSON number");
        if (!buf) return QT_ENOMEM;
    }
    memcpy(buf, t, n);
    buf[n] = 0;
    errno = 0;
    double d = strtod(buf, NULL);
    int range = errno == ERANGE;
    if (buf != small) qt_free(buf);
    if (!range) return QT_OK;
    char path[512];
    jr_path(path, sizeof path, st, depth);
    if (d == 0 || (d < 1 && d > -1))
        return QT_ERR(QT_EINVAL,
                      "%s: %s is %.*s, smaller in magnitude than any normal number (2.2e-308), so it would read as %g; "
                      "write 0 or a value of at least 2.2e-308",
                      where, path, n > 40 ? 40 : (int)n, t, d);
    return QT_ERR(QT_EINVAL,
                  "%s: %s is %.*s, larger than any number can be (1.8e308), so it would read as infinity; write a "
                  "finite value",
                  where, path, n > 40 ? 40 : (int)n, t);
}

/* Walks text[0, len) tracking the key path; with where, checks each number
 * (jr_number); with path, writes the key path of the value at len there. */
static int jr_walk(const char *text, size_t len, const char *where, char *path, size_t cap) {
    jr_frame st[JR_DEPTH];
    int depth = 0, expect_key = 0;
    size_t i = 0;
    while (i < len) {
        const char ch = text[i];
        if (ch == '"') {
            size_t j = i + 1;
            while (j < len && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
            if (j > len) j = len;
            if (expect_key && depth > 0 && depth <= JR_DEPTH) {
                st[depth - 1].key = text + i + 1;
                st[depth - 1].klen = j - (i + 1);
            }
            expect_key = 0;
            i = j + 1;
            continue;
        }
        if (ch == '-' || (ch >= '0' && ch <= '9')) {
            size_t j = i;
            while (j < len && strchr("+-.eE0123456789", text[j]) && text[j]) j++;
            if (where) QT_TRY(jr_number(text + i, j - i, where, st, depth));
            i = j;
            continue;
        }
        switch (ch) {
        case '{':
        case '[':
            if (depth < JR_DEPTH) st[depth] = (jr_frame){.obj = ch == '{'};
            depth++;
            expect_key = ch == '{';
            break;
        case '}':
        case ']':
            if (depth > 0) depth--;
            break;
        case ',':
            if (depth > 0 && depth <= JR_DEPTH) {
                if (st[depth - 1].obj) expect_key = 1;
                else st[depth - 1].index++;
            }
            break;
        default: break; /* ':', white space, true/false/null */
        }
        i++;
    }
    if (path) jr_path(path, cap, st, depth);
    return QT_OK;
}

int qt_json_check_range(const char *text, size_t len, const char *where) {
    return jr_walk(text, len, where, NULL, 0);
}

int qt_json_parse_error(const char *text, const char *err, const char *where, const char *hint) {
    size_t off = err && err >= text ? (size_t)(err - text) : 0;
    int line = 1;
    for (size_t i = 0; i < off && text[i]; i++) line += text[i] == '\n';
    /* what Python's json.dump writes for a float that is NaN or infinite */
    static const char *const words[] = {"NaN", "Infinity", "-Infinity", "nan", "inf", "-inf", "-NaN", NULL};
    const char *word = NULL;
    for (int k = 0; err && words[k] && !word; k++) {
        size_t n = strlen(words[k]);
        if (!strncmp(err, words[k], n) && !((err[n] >= 'a' && err[n] <= 'z') || (err[n] >= 'A' && err[n] <= 'Z')))
            word = words[k];
    }
    if (!word) return QT_ERR(QT_EFORMAT, "%s: line %d is not valid JSON; %s", where, line, hint);
    char path[512];
    jr_walk(text, off, NULL, path, sizeof path);
    return QT_ERR(QT_EFORMAT, "%s: line %d: %s is %s, which JSON has no value for (Python's json.dump writes it for a "
                  "float that is not finite); %s", where, line, path, word, hint);
}

/* ---------------------------------------------------------------------------
 * duplicate keys: cJSON keeps the first of two equal keys, Python's json (and
 * so DeepSpeed and the Hugging Face tools) the last, so the same file would
 * train differently here and there. */

#include <cjson/cJSON.h>

static int cmp_item_name(const void *a, const void *b) {
    const cJSON *x = *(const cJSON *const *)a, *y = *(const cJSON *const *)b;
    return strcmp(x->string ? x->string : "", y->string ? y->string : "");
}

static int dup_walk(const cJSON *v, const char *where, char *path, size_t len, size_t cap, int depth) {
    if (depth > 1000 || !(cJSON_IsObject(v) || cJSON_IsArray(v))) return QT_OK;
    size_t n = 0;
    for (const cJSON *c = v->child; c; c = c->next) n++;
    if (cJSON_IsObject(v) && n > 1) {
        /* sorted pointers: O(n log n), so a hostile object of a million keys stays cheap */
        const cJSON **items = qt_malloc(n * sizeof *items, "JSON key check");
        if (!items) return QT_ENOMEM;
        size_t i = 0;
        for (const cJSON *c = v->child; c; c = c->next) items[i++] = c;
        qsort(items, n, sizeof *items, cmp_item_name);
        const char *dup = NULL;
        for (i = 1; i < n && !dup; i++)
            if (!cmp_item_name(&items[i - 1], &items[i])) dup = items[i]->string ? items[i]->string : "";
        int rc = QT_OK;
        if (dup)
            rc = QT_ERR(QT_EINVAL,
                        "%s: the key \"%s%s%.64s\" appears more than once; keep one (this reader would take the first, "
                        "Python's json takes the last)",
                        where, path, len ? "." : "", dup);
        qt_free(items);
        if (rc != QT_OK) return rc;
    }
    long k = 0;
    for (const cJSON *c = v->child; c; c = c->next, k++) {
        const char *key = c->string ? c->string : "";
        int w = cJSON_IsObject(v) ? snprintf(path + len, cap - len, "%s%.64s", len ? "." : "", key)
                                  : snprintf(path + len, cap - len, "[%ld]", k);
        size_t nl = w < 0 || (size_t)w >= cap - len ? len : len + (size_t)w;
        int rc = dup_walk(c, where, path, nl, cap, depth + 1);
        path[len] = 0;
        if (rc != QT_OK) return rc;
    }
    return QT_OK;
}

int qt_json_check_duplicate_keys(const cJSON *root, const char *where) {
    char path[512] = "";
    return dup_walk(root, where, path, 0, sizeof path, 0);
}

int qt_json_has_nul_escape(const char *s, size_t len) {
    const char *end = s + len;
    for (const char *p = s; (p = memmem(p, (size_t)(end - p), "\\u0000", 6)); p++) {
        size_t k = 0;
        while (p - k > s && p[-1 - (ptrdiff_t)k] == '\\') k++;
        if (k % 2 == 0) return 1;
    }
    return 0;
}
