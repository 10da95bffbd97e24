/* A growable, always NUL-terminated byte string (text being rendered or
 * normalised). Zero-initialise, append with qt_strbuf_put, qt_free(b.p). */
#ifndef QT_CORE_STRBUF_H
#define QT_CORE_STRBUF_H

#include <stddef.h>

typedef struct {
    char *p;
    size_t n, cap;
} qt_strbuf;

int qt_strbuf_put(qt_strbuf *b, const char *s, size_t n); /* QT_OK or QT_ENOMEM */

#endif
