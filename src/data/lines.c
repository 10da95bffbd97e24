#include "data/lines.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"

#include <ctype.h>
#include <errno.h>
#include <string.h>

#define DL_LINES_CHUNK ((size_t)1 << 20)

int dl_lines_open(dl_lines *r, const char *path, size_t max_line) {
    memset(r, 0, sizeof *r);
    r->path = path;
    r->max_line = max_line ? max_line : DL_DEFAULT_MAX_LINE_BYTES;
    r->f = qt_fopen_regular(path, "the data file");
    if (!r->f) return qt_error_code();
    r->in = qt_malloc(DL_LINES_CHUNK, "the data file read buffer");
    r->line_cap = 4096;
    r->line = qt_malloc(r->line_cap, "a data line");
    if (!r->in || !r->line) { dl_lines_close(r); return QT_ENOMEM; }
    r->limit = UINT64_MAX;
    return QT_OK;
}

int dl_lines_open_range(dl_lines *r, const char *path, size_t max_line, uint64_t start, uint64_t limit) {
    QT_TRY(dl_lines_open(r, path, max_line));
    if (start > 0) {
        /* from the byte before start: the rest of the line it ends (just its
         * newline when a line starts exactly at start) belongs to the range before */
        if (fseeko(r->f, (off_t)(start - 1), SEEK_SET) != 0) {
            int e = errno;
            dl_lines_close(r);
            return QT_ERR(QT_EIO, "cannot seek in the data file %s: %s", path, strerror(e));
        }
        r->pos = start - 1;
        char *line;
        size_t len;
        /* the straddling line is read past, never stored: with a cap of 0
         * nothing is kept (a range cut inside a 60 MB line would otherwise
         * hold a second copy of it, one per build thread) */
        size_t cap = r->max_line;
        r->max_line = 0;
        int rc = dl_lines_next(r, &line, &len);
        r->max_line = cap;
        if (rc < 0 && rc != QT_EFORMAT) { dl_lines_close(r); return rc; }
        qt_error_clear();
        r->line_no = 0;
    }
    r->limit = limit;
    return QT_OK;
}

void dl_lines_close(dl_lines *r) {
    if (r->f) fclose(r->f);
    qt_free(r->in);
    qt_free(r->line);
    memset(r, 0, sizeof *r);
}

static int lines_fill(dl_lines *r) {
    r->in_pos = 0;
    r->in_len = fread(r->in, 1, DL_LINES_CHUNK, r->f);
    if (r->in_len == 0) {
        if (ferror(r->f)) return QT_ERR(QT_EIO, "cannot read the data file %s: %s", r->path, strerror(errno));
        r->eof = 1;
    }
    return QT_OK;
}

/* Appends n bytes to the line unless it is already over the cap. */
static int lines_append(dl_lines *r, size_t *len, const char *p, size_t n, int *over) {
    if (*over || *len + n > r->max_line) { *over = 1; *len += n; return QT_OK; }
    if (*len + n + 1 > r->line_cap) {
        size_t cap = r->line_cap;
        while (cap < *len + n + 1) cap *= 2;
        if (cap > r->max_line + 1) cap = r->max_line + 1;
        char *q = qt_realloc(r->line, cap, "a data line");
        if (!q) return QT_ENOMEM;
        r->line = q;
        r->line_cap = cap;
    }
    memcpy(r->line + *len, p, n);
    *len += n;
    return QT_OK;
}

int dl_line_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isspace((unsigned char)s[i])) return 0;
    return 1;
}

int dl_lines_next(dl_lines *r, char **line, size_t *len) {
    size_t n = 0;
    int over = 0, any = 0;
    if (r->pos >= r->limit) return 0;
    for (;;) {
        if (r->in_pos == r->in_len) {
            if (r->eof) break;
            QT_TRY(lines_fill(r));
            if (r->eof) break;
        }
        const char *p = r->in + r->in_pos;
        size_t avail = r->in_len - r->in_pos;
        const char *nl = memchr(p, '\n', avail);
        size_t take = nl ? (size_t)(nl - p) : avail;
        any = 1;
        QT_TRY(lines_append(r, &n, p, take, &over));
        r->in_pos += take + (nl ? 1 : 0);
        r->pos += take + (nl ? 1 : 0);
        if (nl) break;
    }
    if (!any) return 0;
    r->line_no++;
    if (over)
        return QT_ERR(QT_EFORMAT, "%s:%lld: the line is %zu bytes, more than the limit of %zu; "
                      "split the example (or, for qtune train, raise data.max_line_bytes in the job file)",
                      r->path, (long long)r->line_no, n, r->max_line);
    if (n > 0 && r->line[n - 1] == '\r') n--;
    r->line[n] = 0;
    *line = r->line;
    *len = n;
    return 1;
}

/* 8 bytes a step, multiply-xorshift mixing (in the spirit of wyhash/murmur). */
static inline uint64_t hash_mix(uint64_t h, uint64_t v) {
    h ^= v * 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 29)) * 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 32);
}

uint64_t dl_hash_bytes(const void *data, size_t n, uint64_t h) {
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h = hash_mix(h, v);
    }
    uint64_t tail = 0;
    memcpy(&tail, p + i, n - i);
    return hash_mix(h, tail ^ ((uint64_t)(n - i) << 56));
}

int dl_hash_file(const char *path, uint64_t *hash, uint64_t *size) {
    FILE *f = qt_fopen_regular(path, "the data file");
    if (!f) return qt_error_code();
    char *buf = qt_malloc(DL_LINES_CHUNK, "the data file hash buffer");
    if (!buf) { fclose(f); return QT_ENOMEM; }
    uint64_t h = 0x51ed270b27a1f00dull, total = 0;
    size_t got;
    int stop = 0;
    while (!(stop = qt_cancel_requested()) && (got = fread(buf, 1, DL_LINES_CHUNK, f)) > 0) {
        h = dl_hash_bytes(buf, got, h);
        total += got;
    }
    int err = ferror(f);
    fclose(f);
    qt_free(buf);
    if (stop) return QT_ERR(QT_EINTERRUPTED, "stopped while reading the data file %s; nothing was written", path);
    if (err) return QT_ERR(QT_EIO, "cannot read the data file %s", path);
    *hash = hash_mix(h, total);
    *size = total;
    return QT_OK;
}
