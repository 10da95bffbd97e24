/* bitsandbytes 4-bit weights in the layout transformers saves Linear4bit
 * (unsloth's "-bnb-4bit" folders): for a quantized NAME (U8, the packed
 * codes) the tensors NAME.absmax, NAME.quant_map, with double quantization
 * NAME.nested_absmax and NAME.nested_quant_map, and
 * NAME.quant_state.bitsandbytes__nf4|fp4 (U8: JSON of quant_type, blocksize,
 * dtype, shape, nested_blocksize, nested_offset). Read by the loader (a
 * 4-bit base), merge and export (merged into, or written as, 16-bit weights). */
#ifndef QT_IO_BNB4_H
#define QT_IO_BNB4_H

#include <stddef.h>
#include <stdint.h>

#include "core/quant4.h"
#include "io/safetensors.h"

/* 1 when t (of st) is a packed 4-bit weight: U8 with a quant_state beside it. */
int bnb4_is_weight(st_file *st, const st_tensor *t);
/* 1 when name is one of the parts beside a 4-bit weight (absmax, quant_map,
 * nested_*, quant_state.*), which a 16-bit model folder does not have. */
int bnb4_is_part(const char *name);

/* Reads the 4-bit weight name (t: its packed codes) of the folder dir into
 * one qt_q4_weight block (qt_malloc'ed into *out, bytes into *bytes): every
 * size checked against its quant_state and, when d0 >= 0, the shape
 * [d0, d1] the model expects (else the quant_state's shape is taken). A
 * folder that lies is refused in one sentence naming the tensor. */
int bnb4_read(st_file *st, const char *dir, const st_tensor *t, int64_t d0, int64_t d1, qt_q4_weight **out,
              size_t *bytes);

#endif
