/* GGUF (version 3) writing, the file format llama.cpp and ggml read.
 *
 * Layout, all little-endian (ggml/docs/gguf.md):
 *   u32 magic "GGUF", u32 version 3, u64 tensor count, u64 metadata count,
 *   metadata: (string key, u32 value type, value) ...
 *   tensor infos: (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type,
 *                  u64 offset into the data section) ...
 *   padding to general.alignment (32), then each tensor's data, each padded
 *   to 32 bytes.
 * A string is a u64 byte length and the bytes (no NUL). ne[] lists the
 * dimensions innermost first: a PyTorch (out, in) weight is ne = {in, out}.
 *
 * Tensors are streamed: each is added with a producer of its f32 values
 * (st_fill_fn, as for safetensors), called chunk by chunk while the file is
 * written and converted to the tensor's type on the way, so memory stays a few
 * MiB whatever the model size. The file is written under a temporary name,
 * fsync'd and renamed (core/fs.h). */
#ifndef QT_IO_GGUF_H
#define QT_IO_GGUF_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "io/safetensors.h"

/* ggml's type ids for the tensor types qtune writes. */
typedef enum { GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q8_0 = 8, GGUF_BF16 = 30 } gguf_type;

#define GGUF_ALIGNMENT 32
#define GGUF_MAX_NAME 63  /* ggml's GGML_MAX_NAME is 64 with the NUL */
#define GGUF_QK8_0 32     /* q8_0: blocks of 32 values, one fp16 scale d and 32 int8 q, x = d * q */

const char *gguf_type_name(gguf_type t); /* "f32", "f16", "q8_0", "bf16" */
/* Parses f32/f16/bf16/q8_0 (and the qt_dtype spellings); QT_OK or QT_EINVAL. */
int gguf_type_parse(const char *s, gguf_type *out);
/* Bytes of n elements; for q8_0 n must be a multiple of 32 (34 bytes a block). */
size_t gguf_type_bytes(gguf_type t, size_t n);
/* q8_0 as ggml's quantize_row_q8_0_ref: per block d = max|x| / 127,
 * q = round(x / d) (halves away from zero), d stored as fp16. n % 32 == 0. */
void gguf_quantize_q8_0(void *dst, const float *src, size_t n);

typedef struct gguf_writer gguf_writer;
int gguf_writer_new(gguf_writer **out);
void gguf_writer_free(gguf_writer *w);

/* Metadata, written in the order added. Keys are unique. */
int gguf_set_str(gguf_writer *w, const char *key, const char *value);
int gguf_set_u32(gguf_writer *w, const char *key, uint32_t value);
int gguf_set_f32(gguf_writer *w, const char *key, float value);
int gguf_set_bool(gguf_writer *w, const char *key, int value);
int gguf_set_str_array(gguf_writer *w, const char *key, const char *const *values, size_t n);
int gguf_set_i32_array(gguf_writer *w, const char *key, const int32_t *values, size_t n);

/* A tensor of type t and PyTorch shape (outermost first), its f32 values
 * produced by fill in row-major order (calls in increasing offset order, each
 * a whole number of rows of the innermost dimension when that fits in a
 * chunk). Refused by name: a name longer than 63 bytes or already added, and
 * q8_0 with an innermost dimension that is not a multiple of 32. */
int gguf_add_tensor(gguf_writer *w, const char *name, gguf_type t, int ndim, const int64_t *shape, st_fill_fn fill,
                    void *ctx);

/* Once *stop is set (the CLI's signal flag), the write stops between chunks,
 * removes its temporary file and returns QT_EINTERRUPTED. */
void gguf_writer_set_stop(gguf_writer *w, volatile sig_atomic_t *stop);
/* Progress on f: with tty set, a line rewritten in place (percent, MiB, the
 * estimated time left) at most five times a second. NULL: none. */
void gguf_writer_set_progress(gguf_writer *w, FILE *f, int tty);
/* Total bytes the file will have. */
uint64_t gguf_writer_file_bytes(const gguf_writer *w);
/* Writes path atomically; on any error nothing is left at path's temporary name
 * and an existing file at path is untouched. */
int gguf_writer_write(gguf_writer *w, const char *path);

#endif
