/* The data loader: JSONL files -> token caches -> shuffled, sharded, packed
 * micro-batches (data/batch.h), filled ahead of the training step by
 * background threads.
 *
 * Order of an epoch: the examples of all files (after overlong handling, see
 * dl_overlong), permuted by a generator seeded from (seed, epoch) when
 * shuffling; rank r of `world` takes positions r, r+world, r+2*world, ... of
 * that order, so across ranks every example is seen exactly once per epoch and
 * ranks differ by at most one example (no example is repeated or dropped).
 * A rank's stream of examples runs on into the next epoch without a gap, except
 * in eval mode, which makes one pass and then reports DL_END.
 *
 * Rows: padding mode puts one example in a row. Packing plans each epoch's
 * rows from this rank's examples in epoch order: best-fit decreasing within
 * consecutive windows of pack_window examples (fuller rows; with shuffling
 * the rows of a window come in a random order), or greedy in order when
 * pack_window <= 1. Each row holds whole examples, at most T tokens.
 *
 * The position (epoch, index of the next row of this rank's plan for that
 * epoch) after the last batch handed out is dl_state_get(); a trainer saves it
 * in checkpoints and dl_state_set() restores it, so a resumed run sees exactly
 * the batches it would have seen. */
#ifndef QT_DATA_LOADER_H
#define QT_DATA_LOADER_H

#include <stddef.h>
#include <stdint.h>

#include "data/batch.h"
#include "data/format.h"
#include "text/tokenizer.h"

#define DL_END 1 /* dl_next: the eval pass is over (no batch) */

typedef enum {
    DL_OVERLONG_TRUNCATE = 0, /* keep the first seq_len tokens */
    DL_OVERLONG_SPLIT = 1,    /* cut into pieces of seq_len tokens overlapping by one, so no label is lost */
} dl_overlong;

/* How several files make one epoch (LLaMA-Factory's data.mix_strategy, on
 * Hugging Face's concatenate_datasets / interleave_datasets):
 *   concat            every example of every file once
 *   interleave_under  files interleaved by weight until the first runs out
 *                     (stopping_strategy "first_exhausted": the others undersampled)
 *   interleave_over   files interleaved by weight until the last runs out,
 *                     the others starting over ("all_exhausted": oversampled)
 * Where Hugging Face draws each next file at random with probability w_f, qtune
 * takes the expected counts: with S = min (under) or max (over) of n_f / w_f
 * over files, file f gives round(w_f * S) examples (its first ones, from the
 * start again when it runs out), spread evenly through the epoch's file order
 * before the shuffle. Equal weights when none are given. */
typedef enum { DL_MIX_CONCAT = 0, DL_MIX_INTERLEAVE_UNDER = 1, DL_MIX_INTERLEAVE_OVER = 2 } dl_mix;
int dl_mix_parse(const char *s, dl_mix *out); /* QT_EINVAL for an unknown name */
const char *dl_mix_name(dl_mix m);

/* Each slot holds a whole micro-batch (B x T ids, labels and masks); a deeper
 * queue only costs memory, and a job-file value like 1e9 would size it. */
#define DL_PREFETCH_MAX 1024

typedef struct {
    const char *path;          /* one JSONL file, or: */
    const char *const *paths;  /* several, read in this order (n_paths > 0 wins over path) */
    int n_paths;
    dl_mix mix;                /* how several files mix (above); concat by default */
    const double *mix_weights; /* (n_paths) relative weights for the interleave strategies, > 0; NULL: equal */
    dl_format format;          /* DL_FORMAT_AUTO: per file, from its first valid line */
    int seq_len;               /* T, >= 2 */
    int micro_batch;           /* B, rows per batch */
    int packing;               /* several examples per row; else one example per row, padded */
    int pack_window;           /* packing: best-fit decreasing over windows of this many examples
                                  (dl_config_default: 1024); <= 1: greedy, in order */
    int shuffle;
    int mask_prompt;           /* chat/alpaca: only the assistant's tokens carry labels */
    const char *cache_dir;     /* NULL: <folder of each data file>/.qtune-cache */
    int no_cache;              /* 1: tokenize in memory, write no cache */
    int num_workers;           /* prefetch threads; 0 = auto: 80% of the cores, at least 1 */
    int prefetch;              /* batches filled ahead (queue depth), 0..DL_PREFETCH_MAX; 0 = 4 */
    uint64_t seed;
    int rank, world;           /* data-parallel shard; world 0 = 1 */
    int skip_bad_lines;        /* skip and count malformed lines instead of stopping */
    dl_overlong overlong;
    size_t max_line_bytes;     /* 0: 64 MiB; a longer line is a malformed line */
    int32_t vocab_size;        /* ids must be below; 0: the tokenizer's, or unchecked without one */
    int32_t pad_id;            /* -1: the tokenizer's <|endoftext|>, or 0 without one */
    int eval;                  /* one pass in file order, no shuffle, then DL_END */
} dl_config;

typedef struct {
    int64_t epoch;             /* 0-based */
    int64_t index;             /* next row of this rank's plan for the epoch (a row is one
                                  example in padding mode) */
} dl_state;

typedef struct {
    int64_t n_examples;        /* after overlong handling, all ranks */
    int64_t n_examples_rank;   /* this rank's share of an epoch */
    int64_t n_tokens;          /* tokens of all examples (after overlong handling) */
    int64_t n_labels;          /* tokens carrying a label (after overlong handling) */
    int64_t n_targets;         /* targets an epoch yields: labels of every example's tokens 1..len-1 */
    int64_t n_unlabelled;      /* examples with no target at all (warned about at open) */
    int64_t n_lines_skipped;   /* malformed lines skipped (skip_bad_lines) */
    int64_t n_truncated;       /* examples cut to seq_len (DL_OVERLONG_TRUNCATE) */
    int64_t n_split;           /* examples cut into pieces (DL_OVERLONG_SPLIT) */
    int64_t n_mix_dropped;     /* interleave_under: examples of the files left out of the epoch */
    int64_t n_mix_repeated;    /* interleave_over: examples repeated to fill the epoch */
    int64_t n_tokens_dropped;  /* tokens lost to truncation */
    int n_files, n_cache_hits, n_cache_written;
    int num_workers, prefetch;
    double open_s;             /* seconds dl_open took (cache build or load) */
    double wait_s;             /* seconds dl_next waited for a batch so far */
    int64_t n_batches;         /* batches handed out so far */
    int64_t n_pad;             /* padding positions in those batches (packing efficiency: 1 - n_pad / (n_batches*B*T)) */
} dl_stats;

typedef struct dl_loader dl_loader;

void dl_config_default(dl_config *c);
/* Reads (or builds the caches of) the data files and starts the prefetch
 * threads. tok may be NULL for pre-tokenized data. */
int dl_open(const dl_config *cfg, const bpe_tokenizer *tok, dl_loader **out);
void dl_close(dl_loader *l);

/* Batch buffers for dl_next: (B, T) each, for this loader's B and T. Several
 * may be held at once, e.g. the K micro-batches of an accumulation window. */
int dl_batch_alloc(const dl_loader *l, qt_batch *b);
void dl_batch_free(qt_batch *b);

/* Copies the next micro-batch into out (from dl_batch_alloc). QT_OK, DL_END
 * (eval mode, pass over; out untouched), or an error. */
int dl_next(dl_loader *l, qt_batch *out);

dl_state dl_state_get(const dl_loader *l);
/* Positions the loader so the next batch starts at s; drops batches filled ahead. */
int dl_state_set(dl_loader *l, dl_state s);

int64_t dl_num_examples(const dl_loader *l);     /* all ranks, after overlong handling */
int64_t dl_tokens_per_epoch(const dl_loader *l); /* all ranks */
void dl_get_stats(const dl_loader *l, dl_stats *out);

#endif
