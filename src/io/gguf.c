/* GGUF v3 writer: metadata serialised as it is added, tensor data streamed
 * from producers at write time (see gguf.h for the layout). */
#include "io/gguf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" read as a little-endian u32 */
#define GGUF_VERSION 3u
/* metadata value types */
enum { KV_U32 = 4, KV_I32 = 5, KV_F32 = 6, KV_BOOL = 7, KV_STRING = 8, KV_ARRAY = 9 };
/* elements converted per chunk: 4 MiB of f32 */
#define CHUNK_ELEMS ((size_t)1 << 20)

typedef struct {
    char name[GGUF_MAX_NAME + 1];
    gguf_type type;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t numel, nbytes;
    uint64_t offset; /* in the data section */
    st_fill_fn fill;
    void *ctx;
} gguf_tensor;

typedef struct {
    unsigned char *p;
    size_t n, cap;
} bytes;

struct gguf_writer {
    bytes kv;          /* serialised metadata pairs */
    uint64_t n_kv;
    char **keys;       /* for the duplicate check */
    gguf_tensor *t;
    int n_t, cap_t;
    uint64_t data_bytes;
    volatile sig_atomic_t *stop;
    FILE *progress;
    int tty;
};

const char *gguf_type_name(gguf_type t) {
    switch (t) {
    case GGUF_F32: return "f32";
    case GGUF_F16: return "f16";
    case GGUF_Q8_0: return "q8_0";
    case GGUF_BF16: return "bf16";
    }
    return "?";
}

int gguf_type_parse(const char *s, gguf_type *out) {
    qt_dtype d;
    if (!strcmp(s, "q8_0") || !strcmp(s, "Q8_0")) {
        *out = GGUF_Q8_0;
        return QT_OK;
    }
    if (qt_dtype_parse(s, &d) != QT_OK) return QT_EINVAL;
    *out = d == QT_F32 ? GGUF_F32 : d == QT_F16 ? GGUF_F16 : GGUF_BF16;
    return QT_OK;
}

size_t gguf_type_bytes(gguf_type t, size_t n) {
    switch (t) {
    case GGUF_F32: return 4 * n;
    case GGUF_F16:
    case GGUF_BF16: return 2 * n;
    case GGUF_Q8_0: return n / GGUF_QK8_0 * (2 + GGUF_QK8_0);
    }
    return 0;
}

void gguf_quantize_q8_0(void *dst, const float *src, size_t n) {
    unsigned char *o = dst;
    for (size_t b = 0; b < n / GGUF_QK8_0; b++, src += GGUF_QK8_0, o += 2 + GGUF_QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < GGUF_QK8_0; j++) amax = fmaxf(amax, fabsf(src[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = qt_f32_to_f16(d);
        memcpy(o, &h, 2); /* little-endian host (x86-64, the only target) */
        for (int j = 0; j < GGUF_QK8_0; j++) o[2 + j] = (unsigned char)(int8_t)roundf(src[j] * id);
    }
}

/* ---- serialisation ------------------------------------------------------------ */
static int put(bytes *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *q = qt_realloc(b->p, cap, "GGUF metadata");
        if (!q) return QT_ENOMEM;
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
    return QT_OK;
}
static int put_u32(bytes *b, uint32_t v) { return put(b, &v, 4); }
static int put_u64(bytes *b, uint64_t v) { return put(b, &v, 8); }
static int put_str(bytes *b, const char *s) {
    size_t n = strlen(s);
    QT_TRY(put_u64(b, n));
    return put(b, s, n);
}

int gguf_writer_new(gguf_writer **out) {
    *out = qt_calloc(1, sizeof **out, "GGUF writer");
    return *out ? QT_OK : QT_ENOMEM;
}

void gguf_writer_free(gguf_writer *w) {
    if (!w) return;
    for (uint64_t i = 0; i < w->n_kv; i++) qt_free(w->keys[i]);
    qt_free(w->keys);
    qt_free(w->kv.p);
    qt_free(w->t);
    qt_free(w);
}

/* The key and the value type; checks the key is new. */
static int kv_begin(gguf_writer *w, const char *key, uint32_t type) {
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key)) return QT_ERR(QT_EINVAL, "GGUF metadata key %s set twice", key);
    char **k = qt_realloc(w->keys, sizeof *k * (size_t)(w->n_kv + 1), "GGUF keys");
    if (!k) return QT_ENOMEM;
    w->keys = k;
    if (!(k[w->n_kv] = qt_strdup(key))) return QT_ENOMEM;
    w->n_kv++;
    QT_TRY(put_str(&w->kv, key));
    return put_u32(&w->kv, type);
}

int gguf_set_str(gguf_writer *w, const char *key, const char *value) {
    QT_TRY(kv_begin(w, key, KV_STRING));
    return put_str(&w->kv, value);
}
int gguf_set_u32(gguf_writer *w, const char *key, uint32_t value) {
    QT_TRY(kv_begin(w, key, KV_U32));
    return put_u32(&w->kv, value);
}
int gguf_set_f32(gguf_writer *w, const char *key, float value) {
    QT_TRY(kv_begin(w, key, KV_F32));
    return put(&w->kv, &value, 4);
}
int gguf_set_bool(gguf_writer *w, const char *key, int value) {
    QT_TRY(kv_begin(w, key, KV_BOOL));
    unsigned char v = value ? 1 : 0;
    return put(&w->kv, &v, 1);
}
int gguf_set_str_array(gguf_writer *w, const char *key, const char *const *values, size_t n) {
    QT_TRY(kv_begin(w, key, KV_ARRAY));
    QT_TRY(put_u32(&w->kv, KV_STRING));
    QT_TRY(put_u64(&w->kv, n));
    for (size_t i = 0; i < n; i++) QT_TRY(put_str(&w->kv, values[i]));
    return QT_OK;
}
int gguf_set_i32_array(gguf_writer *w, const char *key, const int32_t *values, size_t n) {
    QT_TRY(kv_begin(w, key, KV_ARRAY));
    QT_TRY(put_u32(&w->kv, KV_I32));
    QT_TRY(put_u64(&w->kv, n));
    return put(&w->kv, values, n * sizeof *values);
}

static uint64_t pad_to(uint64_t x) { return (x + GGUF_ALIGNMENT - 1) / GGUF_ALIGNMENT * GGUF_ALIGNMENT; }

int gguf_add_tensor(gguf_writer *w, const char *name, gguf_type t, int ndim, const int64_t *shape, st_fill_fn fill,
                    void *ctx) {
    if (strlen(name) > GGUF_MAX_NAME)
        return QT_ERR(QT_EINVAL, "GGUF tensor name %s is longer than %d bytes", name, GGUF_MAX_NAME);
    if (ndim < 1 || ndim > 4) return QT_ERR(QT_EINVAL, "GGUF tensor %s: %d dimensions (1 to 4 allowed)", name, ndim);
    for (int i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name)) return QT_ERR(QT_EINVAL, "GGUF tensor %s added twice", name);
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 1) return QT_ERR(QT_EINVAL, "GGUF tensor %s: dimension %d is %lld", name, i, (long long)shape[i]);
        numel *= (size_t)shape[i];
    }
    if (t == GGUF_Q8_0 && shape[ndim - 1] % GGUF_QK8_0)
        return QT_ERR(QT_EINVAL, "GGUF tensor %s: q8_0 needs rows of a multiple of %d values, not %lld", name,
                      GGUF_QK8_0, (long long)shape[ndim - 1]);
    if (w->n_t == w->cap_t) {
        int cap = w->cap_t ? 2 * w->cap_t : 64;
        gguf_tensor *p = qt_realloc(w->t, sizeof *p * (size_t)cap, "GGUF tensor list");
        if (!p) return QT_ENOMEM;
        w->t = p;
        w->cap_t = cap;
    }
    gguf_tensor *g = &w->t[w->n_t++];
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", name);
    g->type = t;
    g->ndim = ndim;
    memcpy(g->shape, shape, sizeof(int64_t) * (size_t)ndim);
    g->numel = numel;
    g->nbytes = gguf_type_bytes(t, numel);
    g->offset = w->data_bytes;
    g->fill = fill;
    g->ctx = ctx;
    w->data_bytes = pad_to(w->data_bytes + g->nbytes);
    return QT_OK;
}

void gguf_writer_set_stop(gguf_writer *w, volatile sig_atomic_t *stop) { w->stop = stop; }
void gguf_writer_set_progress(gguf_writer *w, FILE *f, int tty) {
    w->progress = f;
    w->tty = tty;
}

/* Header, metadata and tensor infos, padded to the alignment. */
static int header(const gguf_writer *w, bytes *h) {
    QT_TRY(put_u32(h, GGUF_MAGIC));
    QT_TRY(put_u32(h, GGUF_VERSION));
    QT_TRY(put_u64(h, (uint64_t)w->n_t));
    QT_TRY(put_u64(h, w->n_kv));
    QT_TRY(put(h, w->kv.p, w->kv.n));
    for (int i = 0; i < w->n_t; i++) {
        const gguf_tensor *g = &w->t[i];
        QT_TRY(put_str(h, g->name));
        QT_TRY(put_u32(h, (uint32_t)g->ndim));
        for (int d = g->ndim - 1; d >= 0; d--) QT_TRY(put_u64(h, (uint64_t)g->shape[d])); /* innermost first */
        QT_TRY(put_u32(h, (uint32_t)g->type));
        QT_TRY(put_u64(h, g->offset));
    }
    static const unsigned char zeros[GGUF_ALIGNMENT];
    return put(h, zeros, pad_to(h->n) - h->n);
}

uint64_t gguf_writer_file_bytes(const gguf_writer *w) {
    bytes h = {0};
    uint64_t n = header(w, &h) == QT_OK ? h.n + w->data_bytes : 0;
    qt_free(h.p);
    return n;
}

typedef struct {
    double t0, last;
    uint64_t done, total;
} progress_state;

static void show_progress(const gguf_writer *w, progress_state *p, int final) {
    if (!w->progress || !w->tty) return;
    double now = qt_now_s();
    if (!final && now - p->last < 0.2) return;
    p->last = now;
    double frac = p->total ? (double)p->done / (double)p->total : 1.0, el = now - p->t0;
    fprintf(w->progress, "\rexport: %3.0f%% (%.0f / %.0f MiB)", 100.0 * frac, p->done / 1048576.0,
            p->total / 1048576.0);
    if (!final && frac > 0.01) fprintf(w->progress, ", %.0f s left   ", el / frac - el);
    else fprintf(w->progress, "%s", final ? ", done          \n" : "              ");
    fflush(w->progress);
}

/* One tensor: its values chunk by chunk (whole rows where they fit), converted
 * to its type and appended, then padding. */
static int write_tensor(gguf_writer *w, qt_atomic_file *af, const gguf_tensor *g, float *f32, void *buf,
                        progress_state *ps) {
    const size_t cols = (size_t)g->shape[g->ndim - 1];
    size_t chunk = cols <= CHUNK_ELEMS ? CHUNK_ELEMS / cols * cols : CHUNK_ELEMS; /* q8_0: cols | chunk or 32 | CHUNK */
    for (size_t off = 0; off < g->numel; off += chunk) {
        if (w->stop && *w->stop) return QT_EINTERRUPTED;
        size_t n = g->numel - off < chunk ? g->numel - off : chunk;
        QT_TRY(g->fill(g->ctx, f32, off, n));
        const void *out = buf;
        switch (g->type) {
        case GGUF_F32: out = f32; break;
        case GGUF_F16: qt_convert_from_f32(buf, QT_F16, f32, n); break;
        case GGUF_BF16: qt_convert_from_f32(buf, QT_BF16, f32, n); break;
        case GGUF_Q8_0: gguf_quantize_q8_0(buf, f32, n); break;
        }
        /* llama.cpp would load NaN or inf weights and print garbage: the values, and an f16 that overflowed */
        int nan;
        size_t at = qt_find_nonfinite(f32, QT_F32, n, &nan);
        if (at == n && g->type == GGUF_F16) at = qt_find_nonfinite(buf, QT_F16, n, &nan);
        if (at < n && isfinite(f32[at]))
            return QT_ERR(QT_ENUMERIC, "tensor %s holds %g at element %zu, past F16's range (written as inf); export "
                          "with --dtype bf16 or f32", g->name, (double)f32[at], off + at);
        if (at < n)
            return QT_ERR(QT_ENUMERIC, "tensor %s holds %s at element %zu", g->name, nan ? "NaN" : "an infinite value",
                          off + at);
        size_t nb = gguf_type_bytes(g->type, n);
        QT_TRY(qt_atomic_write(af, out, nb));
        ps->done += nb;
        show_progress(w, ps, 0);
    }
    static const unsigned char zeros[GGUF_ALIGNMENT];
    return qt_atomic_write(af, zeros, pad_to(g->nbytes) - g->nbytes);
}

int gguf_writer_write(gguf_writer *w, const char *path) {
    bytes h = {0};
    int rc = header(w, &h);
    if (rc != QT_OK) {
        qt_free(h.p);
        return rc;
    }
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, path);
    int64_t free_b = qt_free_disk_bytes(dir);
    uint64_t total = h.n + w->data_bytes;
    if (free_b >= 0 && (uint64_t)free_b < total) {
        qt_free(h.p);
        return QT_ERR(QT_EIO, "%s needs %.1f MiB but its filesystem has %.1f MiB free; free some space or write "
                      "elsewhere", path, total / 1048576.0, free_b / 1048576.0);
    }
    float *f32 = qt_malloc(CHUNK_ELEMS * sizeof(float), "GGUF conversion chunk");
    void *buf = qt_malloc(CHUNK_ELEMS * sizeof(float), "GGUF conversion chunk");
    qt_atomic_file af;
    if (!f32 || !buf) rc = QT_ENOMEM;
    /* what an export killed before its rename (kill -9) left beside path */
    int removed = 0;
    if (rc == QT_OK) rc = qt_remove_dead_tmps(path, &removed);
    if (removed) qt_info("removed %d temporary file(s) %s.tmp.PID that a killed export left", removed, path);
    if (rc == QT_OK) rc = qt_atomic_open(&af, path);
    if (rc == QT_OK) {
        progress_state ps = {qt_now_s(), 0.0, 0, w->data_bytes};
        rc = qt_atomic_write(&af, h.p, h.n);
        for (int i = 0; rc == QT_OK && i < w->n_t; i++) rc = write_tensor(w, &af, &w->t[i], f32, buf, &ps);
        if (rc == QT_OK && w->stop && *w->stop) rc = QT_EINTERRUPTED;
        if (rc == QT_OK) {
            rc = qt_atomic_commit(&af);
            if (rc == QT_OK) rc = qt_fsync_dir(dir); /* the rename itself survives a crash */
            show_progress(w, &ps, 1);
        } else {
            qt_atomic_abort(&af);
            if (w->progress && w->tty) fprintf(w->progress, "\n");
        }
    }
    if (rc == QT_EINTERRUPTED)
        QT_ERR(QT_EINTERRUPTED, "export interrupted; the partial %s was removed", path);
    qt_free(h.p);
    qt_free(f32);
    qt_free(buf);
    return rc;
}
