/* One data file's tokens: read from its token cache when the cache matches,
 * otherwise tokenized line by line and written to the cache (atomically) for
 * next time. See docs/data.md for the cache layout and what invalidates it. */
#ifndef QT_DATA_SOURCE_H
#define QT_DATA_SOURCE_H

#include <stddef.h>
#include <stdint.h>

#include "data/format.h"

#define DL_CACHE_MAGIC "QTDCACHE"
#define DL_CACHE_VERSION 1u

/* The cache file's header, at offset 0, native (little-endian) byte order.
 * Then: offsets u64[n_examples+1], ids i32[n_tokens], mask u8[n_tokens]. */
typedef struct {
    char magic[8];            /* "QTDCACHE" */
    uint32_t version;         /* DL_CACHE_VERSION */
    uint32_t header_bytes;    /* sizeof(dl_cache_header) */
    uint64_t tokenizer_hash;  /* bpe_hash(), 0 without a tokenizer */
    uint64_t template_hash;   /* dl_template_hash(): ChatML rendering/masking rules */
    uint64_t source_size;     /* bytes of the data file */
    uint64_t source_hash;     /* dl_hash_file() of the data file */
    uint32_t format_requested;/* dl_format asked for (auto included) */
    uint32_t format_resolved; /* dl_format actually read */
    uint32_t mask_prompt;
    uint32_t skip_bad_lines;
    uint64_t max_line_bytes;
    int64_t vocab_limit;
    uint64_t n_examples;
    uint64_t n_tokens;
    uint64_t n_bad_lines;     /* lines skipped (skip_bad_lines) */
    uint64_t data_hash;       /* dl_hash_bytes over offsets, ids, mask */
    uint64_t header_hash;     /* dl_hash_bytes over every field above */
} dl_cache_header;

typedef struct {
    const char *path;         /* the JSONL file */
    const char *cache_dir;    /* NULL: <folder of path>/.qtune-cache; "" or no_cache: none */
    int no_cache;
    dl_format format;         /* DL_FORMAT_AUTO: detect from the first valid line */
    dl_encode_ctx enc;
    uint64_t tokenizer_hash;
    int skip_bad_lines;
    size_t max_line_bytes;    /* 0: DL_DEFAULT_MAX_LINE_BYTES */
    int n_threads;            /* threads for building the cache; <= 1: this thread only */
    size_t chunk_bytes;       /* 0: 8 MiB; a build thread gets at least this much of the file */
} dl_source_opts;

typedef struct {
    uint64_t n_examples, n_tokens;
    const uint64_t *offsets;  /* (n_examples+1) first token of each example; offsets[n_examples] = n_tokens */
    const int32_t *ids;       /* (n_tokens) */
    const uint8_t *mask;      /* (n_tokens) 1: the token carries a label */
    dl_format format;         /* as read */
    uint64_t n_bad_lines;
    int cache_hit;            /* 1: read from a valid cache file */
    int cache_written;        /* 1: a cache file was (re)built */
    int build_threads;        /* byte ranges tokenized in parallel (0 on a cache hit) */
    char cache_path[4096];    /* "" when no cache */
    /* storage: a read-only map of the cache, or owned buffers */
    void *map;
    size_t map_len;
    dl_tokbuf own;
    uint64_t *own_offsets;
} dl_source;

int dl_source_open(const dl_source_opts *o, dl_source *out);
/* 1 when the file is one JSON array of examples (its first non-blank byte is
 * '['), read whole; else it is JSONL, read line by line. */
int dl_source_is_array(const char *path);
void dl_source_close(dl_source *s);
/* Where the cache of a data file lives (no I/O). */
int dl_cache_path(const char *data_path, const char *cache_dir, char *out, size_t cap);
/* The same path with another extension: a file cached beside the token cache
 * under the same key (the preference reference's log-probs, "qref"). */
int dl_cache_path_ext(const char *data_path, const char *cache_dir, const char *ext, char *out, size_t cap);

#endif
