/* Mixed precision for the model (docs/precision.md). The compute dtype
 * (qt_model_opts.compute) decides three things:
 *  - frozen LoRA base matrices are held in it (converted once at load when the
 *    file's dtype differs);
 *  - full fine-tuning keeps a 2-byte compute copy of the trainable block,
 *    refreshed by qt_model_weights_updated(), that every matmul reads;
 *  - activations saved for backward and activation gradients are rounded to
 *    it where they are stored (fp16 saturates to inf beyond 65504).
 * Master weights, gradients and optimizer state stay fp32. */
#ifndef QT_MODEL_PRECISION_H
#define QT_MODEL_PRECISION_H

#include <stddef.h>

#include "core/dtype.h"

/* QT_OK when backend (a backend/backend.h name; NULL: the default) can train
 * in `compute`. bf16 on the CPU needs AVX512_BF16; without it this returns
 * QT_EUNSUPPORTED with a sentence saying so, unless the environment sets
 * QTUNE_BF16_EMULATE=1 (bf16 storage, fp32 arithmetic: for tests on machines
 * without it). The GPU's bf16 does not depend on the host CPU. */
int qt_precision_check(qt_dtype compute, const char *backend);

/* 1 when bf16 runs emulated on backend (storage bf16, arithmetic fp32): the
 * CPU has no AVX512_BF16, or QTUNE_BF16_EMULATE=1 asks for it on one that
 * has (the tests compare the two paths there). */
int qt_precision_bf16_emulated(const char *backend);

#endif
