/* qt_json_check_range: a small scanner over JSON text cJSON has already
 * accepted, tracking the key path so the error can name the field. */
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

int qt_json_check_range(const char *text, size_t len, const char *where) {
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
            QT_TRY(jr_number(text + i, j - i, where, st, depth));
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
    return QT_OK;
}
