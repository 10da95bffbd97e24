/* adapter_config.json on arbitrary text: PEFT's fields, then target_modules
 * resolved against a 4-layer model's module names (lists, regex strings
 * compiled and matched by PCRE2, "all-linear"). Must load or refuse with one
 * sentence, never crash or read outside a buffer. */
#include "core/error.h"
#include "fuzz_util.h"
#include "io/peft.h"
#include "model/lora_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write_temp(data, size, "adapter_config.json");
    const char *dir = fuzz_temp_dir();
    peft_config pc;
    unsigned mask;
    if (peft_config_load(dir, &pc) == QT_OK) qt_lora_targets_from_peft(&pc, 4, &mask, "fuzz/adapter_config.json");
    qt_error_clear();
    return 0;
}
