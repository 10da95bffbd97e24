/* The trainable parameters read and written by name: the one place where the
 * flat master block (device memory, see model.h) meets files. Reads go
 * through a host staging buffer and upload; writes are producers
 * (st_fill_fn) that download a chunk at a time while the safetensors writer
 * streams, so no host copy of the whole block is ever made. */
#ifndef QT_MODEL_PARAMS_IO_H
#define QT_MODEL_PARAMS_IO_H

#include "io/peft.h"
#include "io/safetensors.h"
#include "model/model.h"

/* Parameter i's values from the file tensor t (any dtype, converted to f32;
 * the caller checked the shape). */
int qt_model_read_param(qt_model *m, int i, const st_tensor *t);
/* Adds every parameter to w by name, stored as dtype, produced from the
 * master block at write time (the model must outlive st_writer_write). */
int qt_model_write_params(const qt_model *m, st_writer *w, qt_dtype dtype);
/* The producer for parameter i, for writers of their own (peft_save). */
void qt_model_param_source(const qt_model *m, int i, st_fill_fn *fill, void **ctx);
/* out[n_params]: the adapter tensors (names, shapes, producers) for peft_save. */
void qt_model_peft_tensors(const qt_model *m, peft_tensor *out);

#endif
