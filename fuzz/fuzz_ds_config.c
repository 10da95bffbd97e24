/* The DeepSpeed JSON config on arbitrary text. The first byte picks the world
 * size (1..8) and the second the run length handed to finalize, so the batch
 * identity and "auto" paths see several worlds. */
#include <string.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "core/mem.h"
#include "train/ds_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int world = 1 + data[0] % 8;
    int64_t max_steps = data[1] == 0xFF ? -1 : data[1];
    char *s = qt_malloc(size - 1, "fuzz");
    memcpy(s, data + 2, size - 2);
    s[size - 2] = 0;
    cJSON *j = cJSON_Parse(s);
    if (j) {
        qt_ds_config c;
        if (qt_ds_config_parse(j, "fuzz/ds_config.json", world, &c) == QT_OK) qt_ds_config_finalize(&c, max_steps);
        cJSON_Delete(j);
    }
    qt_error_clear();
    qt_free(s);
    return 0;
}
