#include "core/strbuf.h"
#include "core/error.h"
#include "core/mem.h"

#include <string.h>

int qt_strbuf_put(qt_strbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < b->n + n + 1) c *= 2; /* doubling: appends are amortised O(1) */
        char *g = qt_realloc(b->p, c, "a text buffer");
        if (!g) return QT_ENOMEM;
        b->p = g;
        b->cap = c;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return QT_OK;
}
