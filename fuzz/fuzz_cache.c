/* The data module's token cache (.qtc) as an arbitrary file: dl_source_open
 * must reuse it only when it is whole and every id is in range, and rebuild it
 * otherwise, never crash or read outside the mapping (docs/data.md).
 *
 * Input: byte 0 holds flags, the rest is the cache file. So that the fuzzer
 * gets past the checks it cannot forge, the harness stamps the fields the key
 * must match (tokenizer, template, source size/hash, settings) from a genuine
 * cache, and then, by flag:
 *   bit 0: n_tokens is set so that the counts match the file size exactly
 *          (the input is cut to that size);
 *   bit 1: data_hash is recomputed over the fuzzed sections;
 * header_hash is always recomputed. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "data/lines.h"
#include "data/source.h"
#include "fuzz_util.h"

static dl_source_opts opts;
static dl_cache_header genuine;
static char data_path[256], cache_dir[256], cache_path[4096];

#define HDR_BYTES ((sizeof(dl_cache_header) + 7) & ~(size_t)7)

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    static const char rows[] = "{\"input_ids\": [1, 2, 3, 4, 5]}\n{\"input_ids\": [6, 7], \"labels\": [-100, 7]}\n"
                               "{\"input_ids\": [8, 9, 10]}\n";
    snprintf(data_path, sizeof data_path, "%s", fuzz_write_temp((const uint8_t *)rows, sizeof rows - 1, "data.jsonl"));
    snprintf(cache_dir, sizeof cache_dir, "%s/cache", fuzz_temp_dir());
    opts.path = data_path;
    opts.cache_dir = cache_dir;
    opts.format = DL_FORMAT_AUTO;
    opts.enc.vocab_limit = 64;
    opts.n_threads = 1;
    dl_source s;
    if (dl_source_open(&opts, &s) != QT_OK || !s.cache_written) {
        fprintf(stderr, "fuzz_cache: cannot build the genuine cache: %s\n", qt_error_message());
        abort();
    }
    snprintf(cache_path, sizeof cache_path, "%s", s.cache_path);
    dl_source_close(&s);
    FILE *f = fopen(cache_path, "rb");
    if (!f || fread(&genuine, sizeof genuine, 1, f) != 1) abort();
    fclose(f);
    return 0;
}

static uint64_t rehash_data(const uint8_t *file, uint64_t n_ex, uint64_t n_tok) {
    const uint8_t *off = file + HDR_BYTES, *ids = off + (n_ex + 1) * 8, *mask = ids + n_tok * 4;
    uint64_t h = dl_hash_bytes(off, (size_t)(n_ex + 1) * 8, 0x64617461ull);
    h = dl_hash_bytes(ids, (size_t)n_tok * 4, h);
    return dl_hash_bytes(mask, (size_t)n_tok, h);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int flags = data[0];
    size_t n = size - 1;
    uint8_t *file = qt_malloc(n + HDR_BYTES + 1, "fuzz cache");
    memcpy(file, data + 1, n);
    if (n >= sizeof(dl_cache_header)) {
        dl_cache_header h;
        memcpy(&h, file, sizeof h);
        memcpy(h.magic, genuine.magic, 8);
        h.version = genuine.version;
        h.header_bytes = genuine.header_bytes;
        h.tokenizer_hash = genuine.tokenizer_hash;
        h.template_hash = genuine.template_hash;
        h.source_size = genuine.source_size;
        h.source_hash = genuine.source_hash;
        h.format_requested = genuine.format_requested;
        h.mask_prompt = genuine.mask_prompt;
        h.skip_bad_lines = genuine.skip_bad_lines;
        h.max_line_bytes = genuine.max_line_bytes;
        h.vocab_limit = genuine.vocab_limit;
        int fits = 0;
        if ((flags & 1) && n >= HDR_BYTES) {
            h.n_examples %= 64;
            uint64_t fixed = HDR_BYTES + (h.n_examples + 1) * 8;
            if (n >= fixed) {
                h.n_tokens = (n - fixed) / 5;
                n = (size_t)(fixed + h.n_tokens * 5);
                fits = 1;
            }
        }
        if ((flags & 2) && fits) h.data_hash = rehash_data(file, h.n_examples, h.n_tokens);
        h.header_hash = dl_hash_bytes(&h, offsetof(dl_cache_header, header_hash), 0x686561646572ull);
        memcpy(file, &h, sizeof h);
    }
    FILE *f = fopen(cache_path, "wb");
    if (!f) abort();
    if (n && fwrite(file, 1, n, f) != n) abort();
    fclose(f);
    qt_free(file);
    dl_source s;
    if (dl_source_open(&opts, &s) == QT_OK) {
        if (s.offsets[0] != 0 || s.offsets[s.n_examples] != s.n_tokens) abort();
        for (uint64_t e = 0; e < s.n_examples; e++)
            if (s.offsets[e] >= s.offsets[e + 1]) abort();
        for (uint64_t i = 0; i < s.n_tokens; i++)
            if (s.ids[i] < 0 || s.ids[i] >= opts.enc.vocab_limit || s.mask[i] > 1) abort();
        dl_source_close(&s);
    }
    qt_error_clear();
    return 0;
}
