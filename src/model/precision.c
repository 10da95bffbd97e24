/* Mixed precision: the bf16 hardware rule, the compute copy of the trainable
 * block, and where the graph's stored values are rounded (see precision.h). */
#include "model/precision.h"

#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/log.h"

static int env_emulate(void) {
    const char *e = getenv("QTUNE_BF16_EMULATE");
    return e && !strcmp(e, "1");
}

int qt_precision_bf16_emulated(const char *backend) { return !qt_backend_bf16_arith(backend) || env_emulate(); }

int qt_precision_check(qt_dtype compute, const char *backend) {
    if (compute != QT_BF16 || qt_backend_bf16_arith(backend)) return QT_OK;
    if (env_emulate()) {
        qt_warn("bf16 is emulated (QTUNE_BF16_EMULATE=1): values are stored in bf16 and computed in fp32, slower "
                "than fp32; this CPU has no AVX512_BF16");
        return QT_OK;
    }
    return QT_ERR(QT_EUNSUPPORTED,
                  "bf16 is enabled in the deepspeed config but this CPU has no AVX512_BF16 (bf16 arithmetic); "
                  "use fp16 (\"fp16\": {\"enabled\": true}) or fp32 instead, or run on a machine with AVX512_BF16");
}
