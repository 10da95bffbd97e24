/* tokenizer.json loading on arbitrary bytes; a file that loads must encode
 * and decode a fixed text (plain, invalid UTF-8, special tokens) and give
 * every id it produced a token string. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "fuzz_util.h"
#include "text/tokenizer.h"

static const char text[] = "Hello the world <|im_start|>user\n\xff\xfe caf\xc3\xa9 \xe2\x82 123 <|im_end|>";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_write_temp(data, size, "tokenizer.json");
    bpe_tokenizer *t = NULL;
    if (bpe_load(path, &t) != QT_OK) { qt_error_clear(); return 0; }
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    if (bpe_encode(t, text, sizeof text - 1, &ids, &n, &cap) == QT_OK) {
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= bpe_vocab_size(t) || !bpe_id_token(t, ids[i])) abort();
        char *out = NULL;
        size_t len = 0;
        if (bpe_decode(t, ids, n, &out, &len) == QT_OK) qt_free(out);
    }
    qt_free(ids);
    bpe_free(t);
    qt_error_clear();
    return 0;
}
