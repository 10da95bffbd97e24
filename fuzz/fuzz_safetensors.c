/* The safetensors reader on arbitrary bytes: must return an error, never crash
 * or read outside the mapping; a file it accepts must read back fully. */
#include <stdlib.h>

#include "core/mem.h"
#include "fuzz_util.h"
#include "io/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write_temp(data, size, "model.safetensors");
    st_file *f = NULL;
    if (st_open(path, &f) != 0) return 0;
    for (int i = 0; i < st_count(f); i++) {
        const st_tensor *t = st_at(f, i);
        if (t->numel > (1u << 20)) continue;
        float *buf = qt_malloc(t->numel * sizeof(float) + 1, "fuzz");
        if (!buf) abort();
        st_read_f32(t, buf);
        qt_free(buf);
    }
    st_close(f);
    return 0;
}
