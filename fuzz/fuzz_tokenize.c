/* Encoding and decoding arbitrary bytes with a small valid tokenizer
 * (fuzz/corpus/tokenizer/tiny.json): invalid UTF-8, special tokens, NFC.
 * Checks that every id is in range, that spans are ordered within the text,
 * and that decoding arbitrary ids (the input read as int32s) never crashes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "text/tokenizer.h"

static bpe_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/fuzz/corpus/tokenizer/tiny.json", src ? src : ".");
    if (bpe_load(path, &tok) != QT_OK) {
        fprintf(stderr, "fuzz_tokenize: %s (set QTUNE_SOURCE_DIR or run from the repository root)\n",
                qt_error_message());
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int32_t *ids = NULL;
    bpe_span *spans = NULL;
    size_t n = 0, cap = 0;
    int32_t V = bpe_vocab_size(tok);
    if (bpe_encode_spans(tok, (const char *)data, size, &ids, &spans, &n, &cap) == QT_OK) {
        for (size_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= V) abort();
            if (spans[i].start > spans[i].end || spans[i].end > size) abort();
        }
        char *out = NULL;
        size_t len = 0;
        if (bpe_decode(tok, ids, n, &out, &len) == QT_OK) qt_free(out);
    }
    qt_free(ids);
    qt_free(spans);
    /* the same bytes as ids (out-of-range ones must be refused, not read) */
    size_t k = size / 4;
    int32_t *raw = qt_malloc(k * sizeof *raw + 1, "fuzz ids");
    memcpy(raw, data, k * sizeof *raw);
    char *out = NULL;
    size_t len = 0;
    if (bpe_decode(tok, raw, k, &out, &len) == QT_OK) qt_free(out);
    qt_free(raw);
    char *norm = NULL;
    if (bpe_normalize(tok, (const char *)data, size, &norm, &len) == QT_OK) qt_free(norm);
    qt_error_clear();
    return 0;
}
