#include "data/source.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "data/lines.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(sizeof(dl_cache_header) == 120, "the cache header layout is part of the file format");

#define DL_WARN_BAD_LINES 5 /* skipped lines named one by one before we only count */
#define DL_BUILD_CHUNK_BYTES ((size_t)8 << 20) /* a build thread gets at least this much of the file */
#define DL_MAX_BUILD_THREADS 64

int dl_cache_path(const char *data_path, const char *cache_dir, char *out, size_t cap) {
    return dl_cache_path_ext(data_path, cache_dir, "qtc", out, cap);
}

int dl_cache_path_ext(const char *data_path, const char *cache_dir, const char *ext, char *out, size_t cap) {
    char dir[4096];
    if (cache_dir && cache_dir[0]) {
        snprintf(dir, sizeof dir, "%s", cache_dir);
    } else {
        char parent[4096];
        qt_path_dirname(parent, sizeof parent, data_path);
        QT_TRY(qt_path_join(dir, sizeof dir, parent, ".qtune-cache"));
    }
    /* Keyed by the file's absolute path, so two data files with one name do not collide. */
    char abs[PATH_MAX];
    const char *key = realpath(data_path, abs) ? abs : data_path;
    const char *base = strrchr(data_path, '/');
    base = base ? base + 1 : data_path;
    char name[512];
    snprintf(name, sizeof name, "%.200s.%016llx.%.16s", base,
             (unsigned long long)dl_hash_bytes(key, strlen(key), 0x6361636865ull), ext);
    return qt_path_join(out, cap, dir, name);
}

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Byte layout of the sections after the header; 0 on overflow. */
static int cache_layout(uint64_t n_examples, uint64_t n_tokens, size_t *off_ids, size_t *off_mask, size_t *total) {
    size_t off_bytes, ids_bytes;
    if (n_examples >= SIZE_MAX / 8 - 1 || !qt_mul_ok((size_t)n_examples + 1, 8, &off_bytes)) return 0;
    if (n_tokens >= SIZE_MAX / 8 || !qt_mul_ok((size_t)n_tokens, 4, &ids_bytes)) return 0;
    *off_ids = align8(sizeof(dl_cache_header)) + off_bytes;
    *off_mask = *off_ids + ids_bytes;
    *total = *off_mask + (size_t)n_tokens;
    return *total >= *off_mask;
}

static uint64_t header_hash(const dl_cache_header *h) {
    return dl_hash_bytes(h, offsetof(dl_cache_header, header_hash), 0x686561646572ull);
}

static uint64_t data_hash(const uint64_t *offsets, const int32_t *ids, const uint8_t *mask, uint64_t n_ex, uint64_t n_tok) {
    uint64_t h = dl_hash_bytes(offsets, (size_t)(n_ex + 1) * 8, 0x64617461ull);
    h = dl_hash_bytes(ids, (size_t)n_tok * 4, h);
    return dl_hash_bytes(mask, (size_t)n_tok, h);
}

/* The fields a cache must match to be reused. */
static void header_key(const dl_source_opts *o, uint64_t src_size, uint64_t src_hash, dl_cache_header *h) {
    memset(h, 0, sizeof *h);
    memcpy(h->magic, DL_CACHE_MAGIC, 8);
    h->version = DL_CACHE_VERSION;
    h->header_bytes = sizeof *h;
    h->tokenizer_hash = o->tokenizer_hash;
    h->template_hash = dl_template_hash();
    h->source_size = src_size;
    h->source_hash = src_hash;
    h->format_requested = (uint32_t)o->format;
    h->mask_prompt = (uint32_t)(o->enc.mask_prompt != 0);
    h->skip_bad_lines = (uint32_t)(o->skip_bad_lines != 0);
    h->max_line_bytes = o->max_line_bytes ? o->max_line_bytes : DL_DEFAULT_MAX_LINE_BYTES;
    h->vocab_limit = o->enc.vocab_limit;
}

/* Why a cache header does not fit the current settings, or NULL when it does. */
static const char *header_mismatch(const dl_cache_header *got, const dl_cache_header *want) {
    if (memcmp(got->magic, DL_CACHE_MAGIC, 8)) return "it is not a qtune token cache";
    if (got->version != DL_CACHE_VERSION || got->header_bytes != sizeof *got) return "it was written by another qtune version";
    if (got->header_hash != header_hash(got)) return "its header is corrupt";
    if (got->source_size != want->source_size || got->source_hash != want->source_hash) return "the data file changed";
    if (got->tokenizer_hash != want->tokenizer_hash) return "the tokenizer changed";
    if (got->template_hash != want->template_hash) return "the chat template rules changed";
    if (got->format_requested != want->format_requested) return "data.format changed";
    if (got->mask_prompt != want->mask_prompt) return "mask_prompt changed";
    if (got->skip_bad_lines != want->skip_bad_lines || got->max_line_bytes != want->max_line_bytes)
        return "the bad-line settings changed";
    if (got->vocab_limit != want->vocab_limit) return "the vocabulary size changed";
    if (got->format_resolved < DL_FORMAT_TEXT || got->format_resolved > DL_FORMAT_LAST) return "its header is corrupt";
    return NULL;
}

/* 1: out holds the mapped cache; 0: no usable cache (reason logged). Never fails hard. */
static int cache_load(const dl_source_opts *o, const dl_cache_header *want, dl_source *out, int quiet) {
    int fd = open(out->cache_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0; /* first run: nothing to say */
    const char *why = NULL;
    struct stat st;
    dl_cache_header h;
    void *map = MAP_FAILED;
    size_t total = 0, off_ids, off_mask;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < sizeof h ||
        pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h) {
        why = "it is truncated";
    } else if ((why = header_mismatch(&h, want))) {
    } else if (!cache_layout(h.n_examples, h.n_tokens, &off_ids, &off_mask, &total) || total != (size_t)st.st_size) {
        why = "it is truncated or has the wrong size";
    } else if ((map = mmap(NULL, total, PROT_READ, MAP_PRIVATE, fd, 0)) == MAP_FAILED) {
        why = "it cannot be mapped";
    }
    close(fd);
    if (!why) {
        const char *base = map;
        const uint64_t *offsets = (const uint64_t *)(base + align8(sizeof h));
        const int32_t *ids = (const int32_t *)(base + off_ids);
        const uint8_t *mask = (const uint8_t *)(base + off_mask);
        if (data_hash(offsets, ids, mask, h.n_examples, h.n_tokens) != h.data_hash) why = "its data is corrupt";
        for (uint64_t i = 0; !why && i < h.n_examples; i++)
            if (offsets[i] >= offsets[i + 1]) why = "its example table is corrupt";
        if (!why && (h.n_examples == 0 || offsets[0] != 0 || offsets[h.n_examples] != h.n_tokens))
            why = "its example table is corrupt";
        /* ids index the embedding table: never trust them, even with a matching hash */
        uint32_t limit = o->enc.vocab_limit > 0 ? (uint32_t)o->enc.vocab_limit : 0x80000000u;
        for (uint64_t t = 0; !why && t < h.n_tokens; t++)
            if ((uint32_t)ids[t] >= limit || mask[t] > 1) why = "it holds token ids out of range";
        if (!why) {
            out->n_examples = h.n_examples;
            out->n_tokens = h.n_tokens;
            out->offsets = offsets;
            out->ids = ids;
            out->mask = mask;
            out->format = (dl_format)h.format_resolved;
            out->n_bad_lines = h.n_bad_lines;
            out->map = map;
            out->map_len = total;
            return 1;
        }
    }
    if (map != MAP_FAILED) munmap(map, total);
    /* a settings change is routine; a damaged file deserves a warning */
    if (quiet) return 0;
    if (strstr(why, "changed")) qt_info("rebuilding the token cache %s: %s", out->cache_path, why);
    else qt_warn("rebuilding the token cache %s: %s", out->cache_path, why);
    return 0;
}

/* Serialises the builders of one cache file across processes (the ranks of
 * a job on one host): the first builds, the others wait and then map its
 * result. -1 when no lock can be had (the build then just goes ahead). */
static int cache_lock(const char *cache_path) {
    char dir[4096], lock[4200];
    qt_path_dirname(dir, sizeof dir, cache_path);
    if (qt_mkdir_p(dir) != QT_OK) { qt_error_clear(); return -1; }
    snprintf(lock, sizeof lock, "%s.lock", cache_path);
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) { close(fd); return -1; }
    }
    return fd;
}

static void cache_unlock(int fd) {
    if (fd < 0) return;
    flock(fd, LOCK_UN);
    close(fd);
}

static int cache_write(const dl_cache_header *h, const dl_source *s) {
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, s->cache_path);
    QT_TRY(qt_mkdir_p(dir));
    qt_atomic_file af;
    QT_TRY(qt_atomic_open(&af, s->cache_path));
    size_t pad = align8(sizeof *h) - sizeof *h;
    static const char zeros[8];
    int rc = qt_atomic_write(&af, h, sizeof *h);
    if (!rc) rc = qt_atomic_write(&af, zeros, pad);
    if (!rc) rc = qt_atomic_write(&af, s->offsets, (size_t)(s->n_examples + 1) * 8);
    if (!rc) rc = qt_atomic_write(&af, s->ids, (size_t)s->n_tokens * 4);
    if (!rc) rc = qt_atomic_write(&af, s->mask, (size_t)s->n_tokens);
    if (rc) { qt_atomic_abort(&af); return rc; }
    return qt_atomic_commit(&af);
}

/* Parses one line into out; errors carry "path:line: " (line counted from
 * the start of the reader's range). */
static int build_line(const dl_source_opts *o, dl_lines *r, char *line, size_t len, dl_format *fmt,
                      dl_tokbuf *out) {
    return dl_encode_line_in_place(&o->enc, o->path, (long long)r->line_no, line, len, fmt, out);
}

static int push_offset(uint64_t **offsets, size_t *n, size_t *cap, uint64_t v) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 1024;
        uint64_t *p = qt_realloc(*offsets, c * sizeof **offsets, "the dataset's example table");
        if (!p) return QT_ENOMEM;
        *offsets = p;
        *cap = c;
    }
    (*offsets)[(*n)++] = v;
    return QT_OK;
}


/* A byte range of the data file, tokenized by one thread. Line numbers in its
 * messages count from the range start until merge_chunks relabels them. */
typedef struct {
    const dl_source_opts *o;
    dl_format fmt;
    uint64_t start, end;
    dl_tokbuf tb;
    uint64_t *off;            /* (n_off) example starts in tb, then tb.n */
    size_t n_off, cap_off;
    int64_t lines;            /* lines in the range */
    uint64_t n_bad;
    int rc;                   /* first error that stops loading */
    int64_t err_line;
    char err[1024];
    int n_warn;               /* skipped lines kept for the warning */
    int64_t warn_line[DL_WARN_BAD_LINES];
    char warn[DL_WARN_BAD_LINES][512];
} build_chunk;

/* Copies this thread's error message: the chunk outlives the thread. */
static void keep_message(char *dst, size_t cap) { snprintf(dst, cap, "%s", qt_error_message()); }

static void *chunk_main(void *arg) {
    build_chunk *c = arg;
    const dl_source_opts *o = c->o;
    dl_lines r;
    c->rc = dl_lines_open_range(&r, o->path, o->max_line_bytes, c->start, c->end);
    if (c->rc != QT_OK) { keep_message(c->err, sizeof c->err); return NULL; }
    c->rc = push_offset(&c->off, &c->n_off, &c->cap_off, 0);
    char *line;
    size_t len;
    while (c->rc == QT_OK) {
        if (qt_cancel_requested()) {
            c->rc = QT_ERR(QT_EINTERRUPTED, "stopped while tokenizing the data file %s; no token cache was written",
                           o->path);
            keep_message(c->err, sizeof c->err);
            break;
        }
        int got = dl_lines_next(&r, &line, &len);
        if (got == 0) break;
        if (got == 1 && dl_line_blank(line, len)) continue;
        if (got == 1) got = build_line(o, &r, line, len, &c->fmt, &c->tb);
        if (got == QT_EFORMAT && o->skip_bad_lines) {
            if (c->n_warn < DL_WARN_BAD_LINES) {
                c->warn_line[c->n_warn] = r.line_no;
                keep_message(c->warn[c->n_warn], sizeof c->warn[0]);
                c->n_warn++;
            }
            c->n_bad++;
            qt_error_clear();
            continue;
        }
        if (got < 0) {
            c->rc = got;
            c->err_line = r.line_no;
            keep_message(c->err, sizeof c->err);
            break;
        }
        c->rc = push_offset(&c->off, &c->n_off, &c->cap_off, c->tb.n);
        if (c->rc != QT_OK) keep_message(c->err, sizeof c->err);
    }
    c->lines = r.line_no;
    dl_lines_close(&r);
    return NULL;
}

/* "path:LOCAL: rest" -> "path:GLOBAL: rest", in place into out. */
static void relabel(const char *path, const char *msg, int64_t local, int64_t global, char *out, size_t cap) {
    char prefix[4200];
    snprintf(prefix, sizeof prefix, "%s:%lld:", path, (long long)local);
    size_t n = strlen(prefix);
    if (local > 0 && !strncmp(msg, prefix, n)) snprintf(out, cap, "%s:%lld:%s", path, (long long)global, msg + n);
    else snprintf(out, cap, "%s", msg);
}

/* The format of the first line that says one, or AUTO when the first
 * non-blank line is bad and bad lines are not skipped (the serial path then
 * reports it) or none is found in the first lines. */
static dl_format detect_first(const dl_source_opts *o) {
    dl_lines r;
    if (dl_lines_open(&r, o->path, o->max_line_bytes) != QT_OK) { qt_error_clear(); return DL_FORMAT_AUTO; }
    dl_format fmt = DL_FORMAT_AUTO;
    char *line;
    size_t len;
    int got;
    while (fmt == DL_FORMAT_AUTO && r.line_no < 1000 && (got = dl_lines_next(&r, &line, &len)) != 0) {
        if (got == 1 && dl_line_blank(line, len)) continue;
        if (got == 1 && (fmt = dl_line_long_format(&o->enc, line, len)) != DL_FORMAT_AUTO) break;
        cJSON *obj = got == 1 ? cJSON_ParseWithLength(line, len) : NULL;
        fmt = dl_format_detect(obj);
        cJSON_Delete(obj);
        if (fmt == DL_FORMAT_AUTO && !o->skip_bad_lines) break;
    }
    qt_error_clear();
    dl_lines_close(&r);
    return fmt;
}

/* Joins the chunks' tokens into s, in file order; reports the first error
 * and the skipped lines with file-wide line numbers. */
static int merge_chunks(const dl_source_opts *o, build_chunk *ch, int K, dl_source *s) {
    int64_t lines_before = 0, lines = 0;
    int warned = 0;
    for (int k = 0; k < K; k++) {
        for (int w = 0; w < ch[k].n_warn && warned < DL_WARN_BAD_LINES; w++, warned++) {
            char msg[1024];
            relabel(o->path, ch[k].warn[w], ch[k].warn_line[w], lines_before + ch[k].warn_line[w], msg, sizeof msg);
            qt_warn("skipping a bad line: %s", msg);
        }
        if (ch[k].rc != QT_OK) {
            if (K == 1) return ch[k].rc; /* the message is still this thread's */
            char msg[1024];
            relabel(o->path, ch[k].err, ch[k].err_line, lines_before + ch[k].err_line, msg, sizeof msg);
            return QT_ERR(ch[k].rc, "%s", msg);
        }
        lines_before += ch[k].lines;
        s->n_bad_lines += ch[k].n_bad;
    }
    lines = lines_before;
    size_t n_tok = 0, n_ex = 0;
    for (int k = 0; k < K; k++) { n_tok += ch[k].tb.n; n_ex += ch[k].n_off - 1; }
    /* chunk 0's buffers grow to hold everything */
    dl_tokbuf *all = &ch[0].tb;
    QT_TRY(dl_tokbuf_reserve(all, n_tok - all->n + 1));
    uint64_t *off = qt_realloc(ch[0].off, (n_ex + 1) * sizeof *off, "the dataset's example table");
    if (!off) return QT_ENOMEM;
    ch[0].off = off;
    size_t e = ch[0].n_off - 1;
    for (int k = 1; k < K; k++) {
        uint64_t base = all->n;
        memcpy(all->ids + all->n, ch[k].tb.ids, ch[k].tb.n * sizeof(int32_t));
        memcpy(all->mask + all->n, ch[k].tb.mask, ch[k].tb.n);
        all->n += ch[k].tb.n;
        for (size_t i = 1; i < ch[k].n_off; i++) off[++e] = base + ch[k].off[i];
    }
    s->own = *all;
    memset(all, 0, sizeof *all);
    s->own_offsets = off;
    ch[0].off = NULL;
    s->n_examples = n_ex;
    s->n_tokens = n_tok;
    s->offsets = s->own_offsets;
    s->ids = s->own.ids;
    s->mask = s->own.mask;
    for (int k = 0; k < K; k++)
        if (ch[k].fmt != DL_FORMAT_AUTO) { s->format = ch[k].fmt; break; }
    if (s->n_bad_lines > DL_WARN_BAD_LINES)
        qt_warn("skipped %llu bad lines of %lld in %s", (unsigned long long)s->n_bad_lines, (long long)lines, o->path);
    if (s->n_examples == 0)
        return QT_ERR(QT_EFORMAT, "%s holds no examples (%lld lines, %llu skipped as bad); "
                      "give a JSONL file with one example per line", o->path, (long long)lines,
                      (unsigned long long)s->n_bad_lines);
    return QT_OK;
}

/* 1 when the file's first non-blank byte is '[': a JSON array of examples
 * (LLaMA-Factory's alpaca_zh_demo.json form) rather than JSONL. */
int dl_source_is_array(const char *path) {
    FILE *f = qt_fopen_regular(path, "the data file"); /* a FIFO would block here: the reader names it */
    if (!f) {
        qt_error_clear();
        return 0;
    }
    int c, n = 0;
    while ((c = fgetc(f)) != EOF && n < (1 << 20) && (c == ' ' || c == '\t' || c == '\r' || c == '\n' ||
                                                      c == 0xEF || c == 0xBB || c == 0xBF)) /* UTF-8 BOM too */
        n++;
    fclose(f);
    return c == '[';
}

/* A JSON array file, read whole: each element is encoded as a JSONL line
 * would be, its messages naming the line the element starts on; with
 * skip_bad_lines an element that is not an example is skipped and counted.
 * The array itself must parse (there is no next line to resume at). */
static int array_build(const dl_source_opts *o, const char *text, size_t n, build_chunk *c) {
    size_t pos = 0;
    long long line = 1;
#define ADVANCE_TO(p)                                            \
    for (; pos < (p); pos++) line += text[pos] == '\n';
#define SKIP_SPACE()                                                                                          \
    while (pos < n && (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\r' || text[pos] == '\n')) {       \
        line += text[pos] == '\n';                                                                                \
        pos++;                                                                                                    \
    }
    if (n >= 3 && !memcmp(text, "\xEF\xBB\xBF", 3)) pos = 3; /* a UTF-8 byte order mark */
    SKIP_SPACE();
    pos++; /* '[' */
    QT_TRY(push_offset(&c->off, &c->n_off, &c->cap_off, 0));
    for (long long k = 0;; k++) {
        SKIP_SPACE();
        if (pos < n && text[pos] == ']' && k == 0) { pos++; break; }
        const char *end = NULL;
        cJSON *el = pos < n ? cJSON_ParseWithLengthOpts(text + pos, n - pos, &end, 0) : NULL;
        if (!el) {
            if (end && end > text + pos) ADVANCE_TO((size_t)(end - text));
            return QT_ERR(QT_EFORMAT, "%s:%lld: not valid JSON inside the file's top-level array (element %lld); a file "
                          "that starts with '[' is read as one JSON array of examples: fix the file or write it as "
                          "JSONL, one example per line", o->path, line, k + 1);
        }
        cJSON_Delete(el);
        const size_t el_end = (size_t)(end - text);
        int got = dl_encode_line(&o->enc, o->path, line, text + pos, el_end - pos, &c->fmt, &c->tb);
        if (got == QT_EFORMAT && o->skip_bad_lines) {
            if (c->n_warn < DL_WARN_BAD_LINES) {
                c->warn_line[c->n_warn] = line;
                keep_message(c->warn[c->n_warn], sizeof c->warn[0]);
                c->n_warn++;
            }
            c->n_bad++;
            qt_error_clear();
        } else {
            QT_TRY(got);
            QT_TRY(push_offset(&c->off, &c->n_off, &c->cap_off, c->tb.n));
        }
        ADVANCE_TO(el_end);
        SKIP_SPACE();
        if (pos < n && text[pos] == ',') { pos++; continue; }
        if (pos < n && text[pos] == ']') { pos++; break; }
        return QT_ERR(QT_EFORMAT, "%s:%lld: expected ',' or ']' after element %lld of the file's top-level array",
                      o->path, line, k + 1);
    }
    SKIP_SPACE();
    if (pos < n)
        return QT_ERR(QT_EFORMAT, "%s:%lld: text after the closing ']' of the file's top-level array; a JSON array file "
                      "holds one array", o->path, line);
    c->lines = line;
#undef ADVANCE_TO
#undef SKIP_SPACE
    return QT_OK;
}

static int source_build_array(const dl_source_opts *o, dl_source *s) {
    char *text = NULL;
    size_t n = 0;
    QT_TRY(qt_read_file(o->path, SIZE_MAX, &text, &n));
    build_chunk c = {.o = o, .fmt = o->format};
    int rc = array_build(o, text, n, &c);
    qt_free(text);
    if (rc == QT_OK && c.n_off == 1)
        rc = QT_ERR(QT_EFORMAT, "%s holds no examples: its top-level JSON array is empty%s", o->path,
                    c.n_bad ? " once the bad elements are skipped" : "");
    if (rc == QT_OK) {
        rc = merge_chunks(o, &c, 1, s);
        s->build_threads = 1;
    } else {
        for (int w = 0; w < c.n_warn; w++) qt_warn("skipping a bad element: %s", c.warn[w]);
    }
    dl_tokbuf_free(&c.tb);
    qt_free(c.off);
    return rc;
}

/* Tokenizes the file: in K byte ranges on K threads when it is large and
 * threads are allowed (the format is settled first, from the first line),
 * else in one pass on this thread. Same result either way. */
static int source_build(const dl_source_opts *o, uint64_t size, dl_source *s) {
    if (dl_source_is_array(o->path)) return source_build_array(o, s);
    size_t chunk_bytes = o->chunk_bytes ? o->chunk_bytes : DL_BUILD_CHUNK_BYTES;
    int K = o->n_threads > 1 ? o->n_threads : 1;
    if ((uint64_t)K > size / chunk_bytes) K = (int)(size / chunk_bytes);
    if (K < 1) K = 1;
    if (K > DL_MAX_BUILD_THREADS) K = DL_MAX_BUILD_THREADS;
    dl_format fmt = o->format;
    if (K > 1 && fmt == DL_FORMAT_AUTO && (fmt = detect_first(o)) == DL_FORMAT_AUTO) K = 1;
    build_chunk *ch = qt_calloc((size_t)K, sizeof *ch, "the cache build ranges");
    if (!ch) return QT_ENOMEM;
    for (int k = 0; k < K; k++) {
        ch[k].o = o;
        ch[k].fmt = fmt;
        ch[k].start = K == 1 ? 0 : size * (uint64_t)k / (uint64_t)K;
        ch[k].end = K == 1 ? UINT64_MAX : size * (uint64_t)(k + 1) / (uint64_t)K;
    }
    int rc = QT_OK, started = 0;
    pthread_t th[DL_MAX_BUILD_THREADS];
    if (K == 1) {
        chunk_main(&ch[0]);
    } else {
        for (; started < K; started++)
            if (pthread_create(&th[started], NULL, chunk_main, &ch[started]) != 0) break;
        for (int k = started; k < K; k++) chunk_main(&ch[k]); /* threads ran out: do the rest here */
        for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    }
    rc = merge_chunks(o, ch, K, s);
    s->build_threads = K;
    for (int k = 0; k < K; k++) {
        dl_tokbuf_free(&ch[k].tb);
        qt_free(ch[k].off);
    }
    qt_free(ch);
    return rc;
}

int dl_source_open(const dl_source_opts *o, dl_source *out) {
    memset(out, 0, sizeof *out);
    uint64_t size, hash;
    QT_TRY(dl_hash_file(o->path, &hash, &size));
    dl_cache_header want;
    header_key(o, size, hash, &want);
    int use_cache = !o->no_cache && !(o->cache_dir && !o->cache_dir[0]);
    if (use_cache && dl_cache_path(o->path, o->cache_dir, out->cache_path, sizeof out->cache_path) != QT_OK) {
        qt_warn("no token cache for %s: %s", o->path, qt_error_message());
        use_cache = 0;
        out->cache_path[0] = 0;
    }
    int lock = -1, hit = 0;
    if (use_cache) {
        hit = cache_load(o, &want, out, 0);
        if (!hit) {
            /* another process (a rank on this host) may be building it: wait, then look again */
            lock = cache_lock(out->cache_path);
            if (lock >= 0) hit = cache_load(o, &want, out, 1);
        }
    }
    if (hit) {
        out->cache_hit = 1;
        cache_unlock(lock);
        if (out->n_bad_lines) qt_warn("%s: %llu bad lines were skipped when its cache was built", o->path, (unsigned long long)out->n_bad_lines);
        return QT_OK;
    }
    int rc = source_build(o, size, out);
    if (rc == QT_OK && use_cache) {
        dl_cache_header h = want;
        h.format_resolved = (uint32_t)out->format;
        h.n_examples = out->n_examples;
        h.n_tokens = out->n_tokens;
        h.n_bad_lines = out->n_bad_lines;
        h.data_hash = data_hash(out->offsets, out->ids, out->mask, out->n_examples, out->n_tokens);
        h.header_hash = header_hash(&h);
        if (cache_write(&h, out) == QT_OK) {
            out->cache_written = 1;
        } else {
            /* A cache is an optimisation: training goes on without it. */
            qt_warn("cannot write the token cache for %s (%s); continuing without it; set data.cache_dir to a writable folder",
                    o->path, qt_error_message());
            qt_error_clear();
        }
    }
    cache_unlock(lock);
    if (rc != QT_OK) dl_source_close(out);
    return rc;
}

void dl_source_close(dl_source *s) {
    if (s->map) munmap(s->map, s->map_len);
    dl_tokbuf_free(&s->own);
    qt_free(s->own_offsets);
    memset(s, 0, sizeof *s);
}
