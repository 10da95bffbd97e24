/* safetensors reader (mmap) and writer.
 *
 * Reading trusts nothing in the file: the 8-byte header length, the JSON, every
 * dtype, shape and offset is checked before a pointer into the mapping is
 * handed out (see st_parse_header). A model may be one file or the shards that
 * model.safetensors.index.json lists; tensors from every shard are kept in one
 * array sorted by name, so st_find is a binary search.
 *
 * Writing lays tensors out sorted by name, contiguous, after a header padded
 * with spaces to a multiple of 8 bytes (so every tensor starts 8-byte aligned
 * when the offsets are), and streams the data through qt_atomic_* in chunks:
 * a tensor added with st_writer_add_fn is produced chunk by chunk and never
 * held whole in memory. */
#include "io/safetensors.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "core/progress.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header larger than this is not a model header (a 72B model's is ~100 KB). */
#define ST_MAX_HEADER_BYTES ((uint64_t)100 << 20)
/* An index.json larger than this is not an index. */
#define ST_MAX_INDEX_BYTES ((size_t)64 << 20)
/* JSON integers are exact up to 2^53; larger values cannot be offsets or dims. */
#define ST_MAX_JSON_INT 9007199254740992.0

typedef struct {
    char *path;
    void *map;   /* whole file, read-only */
    size_t size; /* file size */
    cJSON *meta; /* a copy of the header's __metadata__ object, or NULL */
} st_shard;

struct st_file {
    st_shard *shards;
    int nshards;
    st_tensor *tensors; /* sorted by name */
    int n;
};

/* ---------------------------------------------------------------------------
 * Reading */

static int dtype_from_st(const char *s, qt_dtype *out) {
    if (!strcmp(s, "F32")) { *out = QT_F32; return 1; }
    if (!strcmp(s, "F16")) { *out = QT_F16; return 1; }
    if (!strcmp(s, "BF16")) { *out = QT_BF16; return 1; }
    if (!strcmp(s, "U8")) { *out = QT_U8; return 1; } /* a bitsandbytes 4-bit folder's packed weights */
    return 0;
}

static int dtype_is_other_st(const char *s) {
    static const char *known[] = {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F64",
                                  "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                  "C64"};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(s, known[i])) return 1;
    return 0;
}

/* A JSON number that is a non-negative integer no larger than 2^53. */
static int json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > ST_MAX_JSON_INT || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int cmp_by_name(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

typedef struct {
    uint64_t begin, end;
    const char *name;
} st_span;

static int cmp_span(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

static int cmp_span_name(const void *a, const void *b) {
    return strcmp(((const st_span *)a)->name, ((const st_span *)b)->name);
}

static void free_tensors(st_tensor *t, int n) {
    if (!t) return;
    for (int i = 0; i < n; i++) qt_free(t[i].name);
    qt_free(t);
}

/* Validates one tensor entry of shard `sh` and fills *t (name not set). */
static int parse_entry(const st_shard *sh, const cJSON *e, const uint8_t *data, uint64_t data_len,
                       st_tensor *t, st_span *span) {
    const char *path = sh->path, *name = e->string;
    if (!cJSON_IsObject(e))
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' in the header is not a JSON object; the file is corrupt, re-download or re-export it", path, name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(jd))
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' has no string field 'dtype'; the file is corrupt, re-download or re-export it", path, name);
    if (!dtype_from_st(jd->valuestring, &t->dtype)) {
        if (dtype_is_other_st(jd->valuestring))
            return QT_ERR(QT_EUNSUPPORTED, "%s: tensor '%s' has dtype %s; qtune reads only F32, F16 and BF16, so convert the model to one of those", path, name, jd->valuestring);
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' has unknown dtype '%.32s'; the file is corrupt or not safetensors", path, name, jd->valuestring);
    }
    if (!cJSON_IsArray(js))
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' has no array field 'shape'; the file is corrupt, re-download or re-export it", path, name);
    int nd = cJSON_GetArraySize(js);
    if (nd > ST_MAX_DIMS)
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' has %d dimensions, more than the %d qtune accepts", path, name, nd, ST_MAX_DIMS);
    t->ndim = nd;
    size_t numel = 1;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, js) {
        uint64_t v;
        if (!json_uint(d, &v) || v > (uint64_t)INT64_MAX)
            return QT_ERR(QT_EFORMAT, "%s: tensor '%s' shape entry %d is not a non-negative integer; the file is corrupt", path, name, i);
        t->shape[i++] = (int64_t)v;
        if (v > SIZE_MAX || !qt_mul_ok(numel, (size_t)v, &numel))
            return QT_ERR(QT_EFORMAT, "%s: tensor '%s' shape overflows the address space; the file is corrupt", path, name);
    }
    for (; i < ST_MAX_DIMS; i++) t->shape[i] = 0;
    t->numel = numel;
    if (!qt_mul_ok(numel, qt_dtype_size(t->dtype), &t->nbytes))
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' byte size overflows; the file is corrupt", path, name);
    uint64_t b, en;
    if (!cJSON_IsArray(jo) || cJSON_GetArraySize(jo) != 2 || !json_uint(cJSON_GetArrayItem(jo, 0), &b) ||
        !json_uint(cJSON_GetArrayItem(jo, 1), &en))
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' field 'data_offsets' is not two non-negative integers [begin, end]; the file is corrupt", path, name);
    if (b > en)
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' data_offsets [%llu, %llu] end before they begin; the file is corrupt", path, name,
                      (unsigned long long)b, (unsigned long long)en);
    if (en > data_len)
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' data_offsets [%llu, %llu] run past the %llu bytes of data; the file is truncated or corrupt, re-download it",
                      path, name, (unsigned long long)b, (unsigned long long)en, (unsigned long long)data_len);
    if (en - b != (uint64_t)t->nbytes)
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' holds %llu bytes but its shape and dtype %s need %zu; the file is corrupt", path, name,
                      (unsigned long long)(en - b), jd->valuestring, t->nbytes);
    t->data = data + b;
    span->begin = b;
    span->end = en;
    span->name = name;
    return QT_OK;
}

/* Checks the header of shard sh (already mapped) and appends its tensors to
 * *tensors (sorted later). */
static int parse_header(st_shard *sh, int shard_index, st_tensor **tensors, int *n) {
    const uint8_t *base = sh->map;
    if (sh->size < 8)
        return QT_ERR(QT_EFORMAT, "%s is %zu bytes, too short for a safetensors file (it needs an 8-byte header length); the file is truncated, re-download it", sh->path, sh->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i]; /* little-endian */
    if (hlen > ST_MAX_HEADER_BYTES)
        return QT_ERR(QT_EFORMAT, "%s: header length %llu is more than the %llu bytes a safetensors header may have here; the file is corrupt or not safetensors",
                      sh->path, (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER_BYTES);
    if (hlen > sh->size - 8)
        return QT_ERR(QT_EFORMAT, "%s: header length %llu runs past the end of the %zu-byte file; the file is truncated or not safetensors, re-download it",
                      sh->path, (unsigned long long)hlen, sh->size);
    if (hlen < 2)
        return QT_ERR(QT_EFORMAT, "%s: header length %llu is too small for a JSON header; the file is corrupt", sh->path, (unsigned long long)hlen);
    const uint8_t *data = base + 8 + hlen;
    uint64_t data_len = sh->size - 8 - hlen;

    cJSON *root = cJSON_ParseWithLength((const char *)base + 8, (size_t)hlen);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s: the header is not a JSON object; the file is corrupt or not safetensors", sh->path);
    }
    int count = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (!e->string) continue;
        if (!strcmp(e->string, "__metadata__")) {
            if (!cJSON_IsObject(e)) {
                cJSON_Delete(root);
                return QT_ERR(QT_EFORMAT, "%s: '__metadata__' is not a JSON object; the file is corrupt", sh->path);
            }
            if (!sh->meta) sh->meta = cJSON_Duplicate(e, 1);
            if (!sh->meta) {
                cJSON_Delete(root);
                return QT_ERR(QT_ENOMEM, "out of memory reading the header of %s", sh->path);
            }
            continue;
        }
        count++;
    }
    int rc = QT_OK;
    st_span *spans = qt_calloc((size_t)count + 1, sizeof *spans, "safetensors offsets");
    st_tensor *grown = qt_realloc(*tensors, ((size_t)*n + (size_t)count + 1) * sizeof **tensors, "the safetensors tensor table");
    if (!spans || !grown) {
        qt_free(spans);
        cJSON_Delete(root);
        return QT_ENOMEM;
    }
    *tensors = grown;
    int k = 0;
    cJSON_ArrayForEach(e, root) {
        if (!e->string || !strcmp(e->string, "__metadata__")) continue;
        st_tensor *t = &grown[*n];
        memset(t, 0, sizeof *t);
        rc = parse_entry(sh, e, data, data_len, t, &spans[k]);
        if (rc != QT_OK) break;
        t->name = qt_strdup(e->string);
        if (!t->name) { rc = QT_ENOMEM; break; }
        t->shard = shard_index;
        (*n)++;
        k++;
    }
    if (rc == QT_OK) {
        /* Names are unique within a file (cJSON keeps a repeated key twice). */
        qsort(spans, (size_t)k, sizeof *spans, cmp_span_name);
        for (int i = 1; i < k && rc == QT_OK; i++)
            if (!strcmp(spans[i - 1].name, spans[i].name))
                rc = QT_ERR(QT_EFORMAT, "%s: tensor '%s' appears twice in the header; the file is corrupt, re-export it",
                            sh->path, spans[i].name);
    }
    if (rc == QT_OK) {
        /* No two tensors may share bytes: sort by begin, each must end before
         * the next begins (empty tensors overlap nothing). */
        qsort(spans, (size_t)k, sizeof *spans, cmp_span);
        uint64_t last_end = 0;
        const char *last = NULL;
        for (int i = 0; i < k; i++) {
            if (spans[i].begin == spans[i].end) continue;
            if (last && spans[i].begin < last_end) {
                rc = QT_ERR(QT_EFORMAT, "%s: tensors '%s' and '%s' overlap in the data section; the file is corrupt, re-download or re-export it",
                            sh->path, last, spans[i].name);
                break;
            }
            last_end = spans[i].end;
            last = spans[i].name;
        }
    }
    qt_free(spans);
    cJSON_Delete(root);
    return rc;
}

static int map_shard(st_shard *sh) {
    int fd;
    QT_TRY(qt_open_regular(sh->path, "the weight file", &fd)); /* a FIFO would block in open() */
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return QT_ERR(QT_EIO, "cannot read %s: %s", sh->path, strerror(e));
    }
    sh->size = (size_t)st.st_size;
    if (sh->size == 0) {
        close(fd);
        return QT_ERR(QT_EFORMAT, "%s is empty; the file is truncated, re-download it", sh->path);
    }
    sh->map = mmap(NULL, sh->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (sh->map == MAP_FAILED) {
        sh->map = NULL;
        return QT_ERR(QT_EIO, "cannot map %s (%zu bytes): %s", sh->path, sh->size, strerror(e));
    }
    return QT_OK;
}

static int add_shard(st_file *f, const char *path, st_shard **out) {
    st_shard *s = qt_realloc(f->shards, ((size_t)f->nshards + 1) * sizeof *s, "the safetensors shard table");
    if (!s) return QT_ENOMEM;
    f->shards = s;
    st_shard *sh = &s[f->nshards];
    memset(sh, 0, sizeof *sh);
    sh->path = qt_strdup(path);
    if (!sh->path) return QT_ENOMEM;
    f->nshards++;
    *out = sh;
    return QT_OK;
}

/* Shard names from an index must name a file inside the model folder. */
static int shard_name_ok(const char *s) {
    if (!s[0] || s[0] == '/' || strchr(s, '\\')) return 0;
    const char *p = s;
    while (*p) {
        const char *q = strchr(p, '/');
        size_t len = q ? (size_t)(q - p) : strlen(p);
        if (len == 0) return 0;                                /* "a//b" or trailing '/' */
        if (len == 2 && p[0] == '.' && p[1] == '.') return 0; /* ".." */
        if (!q) break;
        p = q + 1;
    }
    return 1;
}

static int find_sorted(const st_file *f, const char *name) {
    int lo = 0, hi = f->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(f->tensors[mid].name, name);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

/* Sorts the table and refuses a name that appears twice (within one file, or
 * in two shards). */
static int finish_table(st_file *f, const char *where) {
    qsort(f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_by_name);
    for (int i = 1; i < f->n; i++) {
        const st_tensor *a = &f->tensors[i - 1], *b = &f->tensors[i];
        if (strcmp(a->name, b->name)) continue;
        if (a->shard == b->shard)
            return QT_ERR(QT_EFORMAT, "%s: tensor '%s' appears twice in the header; the file is corrupt, re-export it",
                          f->shards[a->shard].path, a->name);
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' is in two shards (%s and %s); fix the shards so each tensor is stored once",
                      where, a->name, f->shards[a->shard].path, f->shards[b->shard].path);
    }
    return QT_OK;
}

static int open_single(st_file *f, const char *path) {
    st_shard *sh;
    QT_TRY(add_shard(f, path, &sh));
    QT_TRY(map_shard(sh));
    QT_TRY(parse_header(sh, 0, &f->tensors, &f->n));
    return finish_table(f, path);
}

static int open_index(st_file *f, const char *index_path) {
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, index_path);
    char *text;
    QT_TRY(qt_read_file(index_path, ST_MAX_INDEX_BYTES, &text, NULL));
    cJSON *root = cJSON_ParseWithOpts(text, NULL, 1); /* 1: nothing but whitespace after the object */
    qt_free(text);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object; the index is corrupt, re-download it", index_path);
    }
    int rc = QT_OK;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        rc = QT_ERR(QT_EFORMAT, "%s has no object field 'weight_map'; the index is corrupt, re-download it", index_path);
        goto done;
    }
    /* Open each distinct shard once, in the order the index first names it. */
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e)) {
            rc = QT_ERR(QT_EFORMAT, "%s: weight_map entry '%s' is not a file name string; the index is corrupt", index_path, e->string);
            goto done;
        }
        const char *name = e->valuestring;
        if (!shard_name_ok(name)) {
            rc = QT_ERR(QT_EFORMAT, "%s: weight_map entry '%s' names shard '%.200s', which is not a plain relative path inside the model folder; fix the index",
                        index_path, e->string, name);
            goto done;
        }
        char full[4096];
        if ((rc = qt_path_join(full, sizeof full, dir, name)) != QT_OK) goto done;
        int seen = 0;
        for (int s = 0; s < f->nshards && !seen; s++) seen = !strcmp(f->shards[s].path, full);
        if (seen) continue;
        st_shard *sh;
        if ((rc = add_shard(f, full, &sh)) != QT_OK) goto done;
        if ((rc = map_shard(sh)) != QT_OK) goto done;
        if ((rc = parse_header(sh, f->nshards - 1, &f->tensors, &f->n)) != QT_OK) goto done;
    }
    if (f->nshards == 0) {
        rc = QT_ERR(QT_EFORMAT, "%s: weight_map is empty; the index lists no shards", index_path);
        goto done;
    }
    if ((rc = finish_table(f, index_path)) != QT_OK) goto done;
    /* Every tensor the index lists must be in the shard it names. */
    cJSON_ArrayForEach(e, wm) {
        int i = find_sorted(f, e->string);
        char full[4096];
        qt_path_join(full, sizeof full, dir, e->valuestring);
        if (i < 0 || strcmp(f->shards[f->tensors[i].shard].path, full)) {
            rc = QT_ERR(QT_EFORMAT, "%s: tensor '%s' is listed in shard %s but that file does not hold it; the index and shards disagree, re-download them",
                        index_path, e->string, e->valuestring);
            goto done;
        }
    }
done:
    cJSON_Delete(root);
    return rc;
}

int st_open(const char *path, st_file **out) {
    *out = NULL;
    st_file *f = qt_calloc(1, sizeof *f, "a safetensors handle");
    if (!f) return QT_ENOMEM;
    int rc;
    if (qt_is_dir(path)) {
        char single[4096], index[4096];
        if ((rc = qt_path_join(single, sizeof single, path, "model.safetensors")) != QT_OK ||
            (rc = qt_path_join(index, sizeof index, path, "model.safetensors.index.json")) != QT_OK) {
            st_close(f);
            return rc;
        }
        if (qt_path_exists(single)) rc = open_single(f, single);
        else if (qt_path_exists(index)) rc = open_index(f, index);
        else rc = QT_ERR(QT_EIO, "%s holds neither model.safetensors nor model.safetensors.index.json; point at a Hugging Face model folder", path);
    } else {
        size_t n = strlen(path);
        if (n >= 5 && !strcmp(path + n - 5, ".json")) rc = open_index(f, path);
        else rc = open_single(f, path);
    }
    if (rc != QT_OK) {
        st_close(f);
        return rc;
    }
    *out = f;
    return QT_OK;
}

void st_close(st_file *f) {
    if (!f) return;
    free_tensors(f->tensors, f->n);
    for (int i = 0; i < f->nshards; i++) {
        if (f->shards[i].map) munmap(f->shards[i].map, f->shards[i].size);
        cJSON_Delete(f->shards[i].meta);
        qt_free(f->shards[i].path);
    }
    qt_free(f->shards);
    qt_free(f);
}

int st_count(const st_file *f) { return f->n; }

const st_tensor *st_at(const st_file *f, int i) {
    return (i >= 0 && i < f->n) ? &f->tensors[i] : NULL;
}

const st_tensor *st_find(const st_file *f, const char *name) {
    int i = find_sorted(f, name);
    if (i < 0) return NULL;
    f->tensors[i].used = 1; /* the table, not the handle: a reader's mark */
    return &f->tensors[i];
}

const st_tensor *st_first_unused(const st_file *f) {
    for (int i = 0; i < f->n; i++)
        if (!f->tensors[i].used) return &f->tensors[i];
    return NULL;
}

const char *st_shard_path(const st_file *f, int shard) {
    return (shard >= 0 && shard < f->nshards) ? f->shards[shard].path : "";
}

static void shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "(");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, ")");
}

int st_expect(const st_file *f, const char *name, int ndim, const int64_t *shape, const st_tensor **out) {
    *out = NULL;
    const st_tensor *t = st_find(f, name);
    const char *where = f->nshards == 1 ? f->shards[0].path : "the model's shards";
    if (!t)
        return QT_ERR(QT_EFORMAT, "%s has no tensor '%s'; the weights do not match config.json (wrong folder or architecture?)", where, name);
    int same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char want[160], got[160];
        shape_str(want, sizeof want, ndim, shape);
        shape_str(got, sizeof got, t->ndim, t->shape);
        return QT_ERR(QT_EFORMAT, "%s: tensor '%s' has shape %s but config.json implies %s; the weights and config.json disagree",
                      f->shards[t->shard].path, name, got, want);
    }
    *out = t;
    return QT_OK;
}

int st_read_f32(const st_tensor *t, float *dst) {
    size_t es = qt_dtype_size(t->dtype);
    if (t->dtype == QT_F32 || ((uintptr_t)t->data % es) == 0) {
        if (t->dtype == QT_F32) memcpy(dst, t->data, t->nbytes);
        else qt_convert_to_f32(dst, t->data, t->dtype, t->numel);
        return QT_OK;
    }
    /* A file whose header length is odd leaves 16-bit data misaligned: copy
     * through an aligned bounce buffer rather than load unaligned halves. */
    uint16_t tmp[4096];
    const uint8_t *src = t->data;
    for (size_t i = 0; i < t->numel; i += 4096) {
        size_t n = t->numel - i < 4096 ? t->numel - i : 4096;
        memcpy(tmp, src + i * 2, n * 2);
        qt_convert_to_f32(dst + i, tmp, t->dtype, n);
    }
    return QT_OK;
}

int st_read_f32_range(const st_tensor *t, size_t offset, size_t n, float *dst) {
    if (offset > t->numel || n > t->numel - offset)
        return QT_ERR(QT_EINVAL, "safetensors: elements [%zu, %zu) of tensor '%s' are outside its %zu elements",
                      offset, offset + n, t->name, t->numel);
    st_tensor part = *t;
    size_t es = qt_dtype_size(t->dtype);
    part.data = (const uint8_t *)t->data + offset * es;
    part.numel = n;
    part.nbytes = n * es;
    /* only the pages of the slice are touched: the file stays mapped, not read */
    return st_read_f32(&part, dst);
}

const char *st_metadata(const st_file *f, const char *key) {
    for (int i = 0; i < f->nshards; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(f->shards[i].meta, key);
        if (cJSON_IsString(v)) return v->valuestring;
    }
    return NULL;
}

/* ---------------------------------------------------------------------------
 * Writing */

typedef struct {
    char *name;
    qt_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t numel;
    const void *data; /* either data (in src_dtype) ... */
    qt_dtype src_dtype;
    st_fill_fn fill; /* ... or a producer of f32 chunks */
    void *ctx;
} st_wentry;

struct st_writer {
    st_wentry *e;
    int n, cap;
    char **meta; /* key, value pairs */
    int nmeta;
    volatile sig_atomic_t *stop;
    qt_progress *prog; /* MB written, after each tensor */
    int finite;        /* st_writer_refuse_nonfinite */
};

void st_writer_set_stop(st_writer *w, volatile sig_atomic_t *stop) { w->stop = stop; }
void st_writer_refuse_nonfinite(st_writer *w) { w->finite = 1; }

/* QT_ENUMERIC naming the tensor when p (n elements of t, starting at element
 * off of e) holds a NaN or inf. src: the f32 values p was converted from, to
 * tell an overflow in the conversion, or NULL. */
static int check_finite(const st_wentry *e, const void *p, qt_dtype t, size_t n, size_t off, const float *src) {
    int nan;
    size_t at = qt_find_nonfinite(p, t, n, &nan);
    if (at == n) return QT_OK;
    if (src && isfinite(src[at]))
        return QT_ERR(QT_ENUMERIC, "tensor %s holds %g at element %zu, past %s's range (written as inf); write it "
                      "as f32%s", e->name, (double)src[at], off + at, qt_dtype_st_name(t), t == QT_F16 ? " or bf16" : "");
    return QT_ERR(QT_ENUMERIC, "tensor %s holds %s at element %zu", e->name, nan ? "NaN" : "an infinite value", off + at);
}
void st_writer_set_progress(st_writer *w, qt_progress *p) { w->prog = p; }

double st_writer_bytes(const st_writer *w) {
    double b = 0;
    for (int i = 0; i < w->n; i++) b += (double)w->e[i].numel * (double)qt_dtype_size(w->e[i].dtype);
    return b;
}

int st_writer_new(st_writer **out) {
    *out = qt_calloc(1, sizeof **out, "a safetensors writer");
    if (!*out) return QT_ENOMEM;
    return st_writer_set_metadata(*out, "format", "pt");
}

static int writer_push(st_writer *w, const char *name, qt_dtype dtype, int ndim, const int64_t *shape, st_wentry **out) {
    if (!name || !name[0] || !strcmp(name, "__metadata__"))
        return QT_ERR(QT_EINVAL, "safetensors writer: tensor name '%s' is not allowed", name ? name : "(null)");
    if (ndim < 0 || ndim > ST_MAX_DIMS)
        return QT_ERR(QT_EINVAL, "safetensors writer: tensor '%s' has %d dimensions (at most %d)", name, ndim, ST_MAX_DIMS);
    if (dtype != QT_F32 && dtype != QT_F16 && dtype != QT_BF16)
        return QT_ERR(QT_EINVAL, "safetensors writer: tensor '%s' has an unknown dtype", name);
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->e[i].name, name))
            return QT_ERR(QT_EINVAL, "safetensors writer: tensor '%s' was added twice", name);
    size_t numel = 1;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || !qt_mul_ok(numel, (size_t)shape[i], &numel))
            return QT_ERR(QT_EINVAL, "safetensors writer: tensor '%s' has a bad shape", name);
    if (w->n == w->cap) {
        int cap = w->cap ? w->cap * 2 : 64;
        st_wentry *e = qt_realloc(w->e, (size_t)cap * sizeof *e, "the safetensors writer table");
        if (!e) return QT_ENOMEM;
        w->e = e;
        w->cap = cap;
    }
    st_wentry *e = &w->e[w->n];
    memset(e, 0, sizeof *e);
    e->name = qt_strdup(name);
    if (!e->name) return QT_ENOMEM;
    e->dtype = dtype;
    e->ndim = ndim;
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
    e->numel = numel;
    w->n++;
    *out = e;
    return QT_OK;
}

int st_writer_add(st_writer *w, const char *name, qt_dtype dtype, int ndim, const int64_t *shape,
                  const void *data, qt_dtype src_dtype) {
    st_wentry *e;
    QT_TRY(writer_push(w, name, dtype, ndim, shape, &e));
    e->data = data;
    e->src_dtype = src_dtype;
    return QT_OK;
}

int st_writer_add_fn(st_writer *w, const char *name, qt_dtype dtype, int ndim, const int64_t *shape,
                     st_fill_fn fill, void *ctx) {
    st_wentry *e;
    QT_TRY(writer_push(w, name, dtype, ndim, shape, &e));
    e->fill = fill;
    e->ctx = ctx;
    return QT_OK;
}

int st_writer_set_metadata(st_writer *w, const char *key, const char *value) {
    for (int i = 0; i < w->nmeta; i++) {
        if (strcmp(w->meta[2 * i], key)) continue;
        char *v = qt_strdup(value);
        if (!v) return QT_ENOMEM;
        qt_free(w->meta[2 * i + 1]);
        w->meta[2 * i + 1] = v;
        return QT_OK;
    }
    char **m = qt_realloc(w->meta, (size_t)(w->nmeta + 1) * 2 * sizeof *m, "safetensors metadata");
    if (!m) return QT_ENOMEM;
    w->meta = m;
    m[2 * w->nmeta] = qt_strdup(key);
    m[2 * w->nmeta + 1] = qt_strdup(value);
    if (!m[2 * w->nmeta] || !m[2 * w->nmeta + 1]) {
        qt_free(m[2 * w->nmeta]);
        qt_free(m[2 * w->nmeta + 1]);
        return QT_ENOMEM;
    }
    w->nmeta++;
    return QT_OK;
}

void st_writer_free(st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) qt_free(w->e[i].name);
    for (int i = 0; i < 2 * w->nmeta; i++) qt_free(w->meta[i]);
    qt_free(w->meta);
    qt_free(w->e);
    qt_free(w);
}

/* A growing string for the header. */
typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->n + n + 1 > cap) cap *= 2;
        char *p = qt_realloc(b->s, cap, "the safetensors header");
        if (!p) { b->oom = 1; return; }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_string(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') { esc[0] = '\\'; esc[1] = (char)*p; sb_put(b, esc, 2); }
        else if (*p < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", *p); sb_put(b, esc, 6); }
        else sb_put(b, (const char *)p, 1);
    }
    sb_put(b, "\"", 1);
}

static int cmp_wentry(const void *a, const void *b) {
    return strcmp(((const st_wentry *)a)->name, ((const st_wentry *)b)->name);
}

/* Writes one tensor's bytes: converted (or produced) in chunks so neither a
 * converted copy nor a produced tensor is ever whole in memory. */
static int write_tensor(qt_atomic_file *af, const st_wentry *e, float *f32, void *out, size_t chunk,
                        volatile sig_atomic_t *stop, int finite) {
    size_t es = qt_dtype_size(e->dtype);
    if (!e->fill && e->src_dtype == e->dtype) {
        if (e->numel && !e->data)
            return QT_ERR(QT_EINVAL, "safetensors writer: tensor '%s' has no data", e->name);
        /* in slices, so a stop request is seen within a few MiB */
        const size_t slice = (size_t)16 << 20, bytes = e->numel * es;
        for (size_t off = 0; off < bytes; off += slice) {
            if (stop && *stop) return QT_ERR(QT_EINTERRUPTED, "interrupted while writing tensor %s", e->name);
            const size_t nb = bytes - off < slice ? bytes - off : slice;
            if (finite) QT_TRY(check_finite(e, (const char *)e->data + off, e->dtype, nb / es, off / es, NULL));
            QT_TRY(qt_atomic_write(af, (const char *)e->data + off, nb));
        }
        return QT_OK;
    }
    for (size_t i = 0; i < e->numel; i += chunk) {
        if (stop && *stop) return QT_ERR(QT_EINTERRUPTED, "interrupted while writing tensor %s", e->name);
        size_t n = e->numel - i < chunk ? e->numel - i : chunk;
        if (e->fill) {
            QT_TRY(e->fill(e->ctx, f32, i, n));
        } else if (e->src_dtype == QT_F32) {
            memcpy(f32, (const float *)e->data + i, n * sizeof(float));
        } else {
            qt_convert_to_f32(f32, (const uint16_t *)e->data + i, e->src_dtype, n);
        }
        if (e->dtype == QT_F32) {
            if (finite) QT_TRY(check_finite(e, f32, QT_F32, n, i, NULL));
            QT_TRY(qt_atomic_write(af, f32, n * sizeof(float)));
        } else {
            qt_convert_from_f32(out, e->dtype, f32, n);
            if (finite) QT_TRY(check_finite(e, out, e->dtype, n, i, f32));
            QT_TRY(qt_atomic_write(af, out, n * es));
        }
    }
    return QT_OK;
}

int st_writer_write(st_writer *w, const char *path) {
    qsort(w->e, (size_t)w->n, sizeof *w->e, cmp_wentry);
    sbuf h = {0};
    sb_str(&h, "{\"__metadata__\":{");
    for (int i = 0; i < w->nmeta; i++) {
        if (i) sb_str(&h, ",");
        sb_json_string(&h, w->meta[2 * i]);
        sb_str(&h, ":");
        sb_json_string(&h, w->meta[2 * i + 1]);
    }
    sb_str(&h, "}");
    uint64_t off = 0;
    for (int i = 0; i < w->n; i++) {
        const st_wentry *e = &w->e[i];
        char num[64];
        sb_str(&h, ",");
        sb_json_string(&h, e->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, qt_dtype_st_name(e->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < e->ndim; d++) {
            snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)e->shape[d]);
            sb_str(&h, num);
        }
        uint64_t end = off + (uint64_t)e->numel * qt_dtype_size(e->dtype);
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)end);
        sb_str(&h, num);
        off = end;
    }
    sb_str(&h, "}");
    while (!h.oom && h.n % 8) sb_str(&h, " "); /* the spec allows trailing spaces; data starts 8-aligned */
    if (h.oom) {
        qt_free(h.s);
        return QT_ENOMEM;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));

    const size_t chunk = 1 << 16;
    float *f32 = qt_malloc(chunk * sizeof(float), "a safetensors write buffer");
    uint16_t *half = qt_malloc(chunk * sizeof(uint16_t), "a safetensors write buffer");
    if (!f32 || !half) {
        qt_free(f32);
        qt_free(half);
        qt_free(h.s);
        return QT_ENOMEM;
    }
    qt_atomic_file af;
    int rc = qt_atomic_open(&af, path);
    if (rc == QT_OK) {
        rc = qt_atomic_write(&af, len8, 8);
        if (rc == QT_OK) rc = qt_atomic_write(&af, h.s, h.n);
        double mb = 0;
        for (int i = 0; i < w->n && rc == QT_OK; i++) {
            rc = write_tensor(&af, &w->e[i], f32, half, chunk, w->stop, w->finite);
            mb += (double)w->e[i].numel * (double)qt_dtype_size(w->e[i].dtype) / 1e6;
            if (w->prog) qt_progress_set(w->prog, mb);
        }
        if (rc == QT_OK) rc = qt_atomic_commit(&af);
        else qt_atomic_abort(&af);
    }
    qt_free(f32);
    qt_free(half);
    qt_free(h.s);
    return rc;
}
