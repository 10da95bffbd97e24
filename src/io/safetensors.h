/* safetensors: read over mmap (one file, or the shards a
 * model.safetensors.index.json lists) and write atomically.
 *
 * File layout: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32"|"F16"|"BF16", "shape": [...], "data_offsets": [a, b]},
 *  "__metadata__": {str: str}}, then the data; offsets are relative to the end
 * of the header. Every field is validated before use (see st_open). */
#ifndef QT_IO_SAFETENSORS_H
#define QT_IO_SAFETENSORS_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/progress.h"

#define ST_MAX_DIMS 8

typedef struct {
    char *name;
    qt_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t numel;
    size_t nbytes;
    const void *data; /* points into the mapping: read-only, valid until st_close; aligned to
                       * the element size only when the file keeps it so (writers pad
                       * the header to 8 bytes); st_read_f32 copes either way */
    int shard;        /* which file it came from */
    int used;         /* set by st_find / st_expect: a reader consumed it (see st_first_unused) */
} st_tensor;

typedef struct st_file st_file; /* one model's tensors, over one or more mapped files */

/* Opens path: a .safetensors file, or a folder holding model.safetensors or
 * model.safetensors.index.json (shard paths must stay inside the folder). */
int st_open(const char *path, st_file **out);
void st_close(st_file *f);
int st_count(const st_file *f);
const st_tensor *st_at(const st_file *f, int i);
const st_tensor *st_find(const st_file *f, const char *name); /* NULL if absent */
/* The first tensor (by name) that no st_find / st_expect asked for, NULL when
 * the reader consumed them all: a loader calls it last to refuse tensors its
 * architecture does not use instead of ignoring them. */
const st_tensor *st_first_unused(const st_file *f);
/* Finds name and checks its shape; a clear error names the tensor, the file
 * and both shapes when it differs. */
int st_expect(const st_file *f, const char *name, int ndim, const int64_t *shape, const st_tensor **out);
/* Copies a tensor into dst as f32 (any stored dtype). */
int st_read_f32(const st_tensor *t, float *dst);
/* Copies elements [offset, offset + n) of a tensor (its flat row-major order)
 * into dst as f32; reads only those bytes of the mapping, so each rank of a
 * resumed run takes its slice of a large file without a full-size buffer. */
int st_read_f32_range(const st_tensor *t, size_t offset, size_t n, float *dst);
/* A string value of the header's "__metadata__" (the first shard that has the
 * key); NULL when absent or not a string. Valid until st_close. */
const char *st_metadata(const st_file *f, const char *key);
/* Path of shard i (st_tensor.shard), for messages; "" when out of range. */
const char *st_shard_path(const st_file *f, int shard);

/* Writing: collect tensors (data is copied at st_writer_write time from the
 * pointers given, which must stay valid until then), then write atomically. */
typedef struct st_writer st_writer;
int st_writer_new(st_writer **out);
/* data is in src_dtype; it is stored as dtype (converted when they differ). */
int st_writer_add(st_writer *w, const char *name, qt_dtype dtype, int ndim, const int64_t *shape,
                  const void *data, qt_dtype src_dtype);
/* Streaming add: instead of a pointer, a producer that fills dst with the f32
 * values of elements [offset, offset + n) (called in increasing offset order
 * during st_writer_write, chunk by chunk), so a tensor larger than memory can
 * be written. Returns QT_OK or an error code (which aborts the write). */
typedef int (*st_fill_fn)(void *ctx, float *dst, size_t offset, size_t n);
int st_writer_add_fn(st_writer *w, const char *name, qt_dtype dtype, int ndim, const int64_t *shape,
                     st_fill_fn fill, void *ctx);
int st_writer_set_metadata(st_writer *w, const char *key, const char *value);
/* Reports MB written into p after each tensor (core/progress.h); p's total
 * is the caller's to set (st_writer_bytes). */
void st_writer_set_progress(st_writer *w, qt_progress *p);
/* Bytes of tensor data the writer holds (the file less its header). */
double st_writer_bytes(const st_writer *w);
/* A flag (set by the CLI's SIGINT handler) st_writer_write polls between
 * chunks of at most a few MiB: once set, the write stops, its temporary file
 * is removed and it returns QT_EINTERRUPTED. NULL (the default): never. */
void st_writer_set_stop(st_writer *w, volatile sig_atomic_t *stop);
/* A tensor that would be written with a NaN or inf (read or produced so, or
 * past the range of its output dtype) fails the write with QT_ENUMERIC naming
 * it and the element, before that chunk reaches the file. */
void st_writer_refuse_nonfinite(st_writer *w);
int st_writer_write(st_writer *w, const char *path); /* tensors sorted by name, atomic */
void st_writer_free(st_writer *w);

#endif
