/* A JSONL dataset through the data module's reader (bounded lines, JSON,
 * format detection, ChatML rendering, pre-tokenized ids) with a small valid
 * tokenizer. Byte 0 picks the format, byte 1 whether bad lines are skipped;
 * the rest is the file. Lines are capped at 4 KiB so the over-long-line path
 * runs too. A file that is read must give ordered offsets and in-range ids. */
#include <stdio.h>
#include <stdlib.h>

#include "core/error.h"
#include "data/source.h"
#include "fuzz_util.h"
#include "text/tokenizer.h"

static bpe_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/fuzz/corpus/tokenizer/tiny.json", src ? src : ".");
    if (bpe_load(path, &tok) != QT_OK) {
        fprintf(stderr, "fuzz_jsonl: %s (set QTUNE_SOURCE_DIR or run from the repository root)\n", qt_error_message());
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    const char *path = fuzz_write_temp(data + 2, size - 2, "train.jsonl");
    dl_source_opts o = {0};
    o.path = path;
    o.no_cache = 1;
    o.format = (dl_format)(data[0] % 5);
    o.enc.tok = tok;
    o.enc.mask_prompt = data[0] & 0x80 ? 1 : 0;
    o.enc.vocab_limit = bpe_vocab_size(tok);
    o.tokenizer_hash = bpe_hash(tok);
    o.skip_bad_lines = data[1] & 1;
    o.max_line_bytes = 4096;
    o.n_threads = 1;
    dl_source s;
    if (dl_source_open(&o, &s) == QT_OK) {
        if (s.offsets[0] != 0 || s.offsets[s.n_examples] != s.n_tokens) abort();
        for (uint64_t e = 0; e < s.n_examples; e++)
            if (s.offsets[e] > s.offsets[e + 1]) abort();
        for (uint64_t i = 0; i < s.n_tokens; i++)
            if (s.ids[i] < 0 || s.ids[i] >= o.enc.vocab_limit || s.mask[i] > 1) abort();
        dl_source_close(&s);
    }
    qt_error_clear();
    return 0;
}
