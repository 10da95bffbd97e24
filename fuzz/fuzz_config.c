/* config.json parsing on arbitrary text. */
#include <string.h>

#include "core/mem.h"
#include "io/hf_config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *s = qt_malloc(size + 1, "fuzz");
    memcpy(s, data, size);
    s[size] = 0;
    qt_config cfg;
    qt_config_parse(s, "fuzz/config.json", &cfg);
    qt_free(s);
    return 0;
}
