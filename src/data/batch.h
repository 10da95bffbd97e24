/* What the loader hands the training step: one micro-batch of B rows of T
 * tokens. With packing, several examples share a row; doc_start/positions let
 * attention stay inside each example (positions restart at 0 per example). */
#ifndef QT_DATA_BATCH_H
#define QT_DATA_BATCH_H

#include <stdint.h>

#include "core/label.h" /* QT_IGNORE_INDEX */

typedef struct {
    int B, T;
    int32_t *inputs;    /* (B, T) token ids; padding uses the pad id */
    int32_t *targets;   /* (B, T) next-token label for each position, QT_IGNORE_INDEX where none */
    int32_t *positions; /* (B, T) RoPE positions: restart at 0 at each packed example */
    int32_t *doc_start; /* (B, T) index in the row where this position's example starts:
                           position t attends to [doc_start[t], t] */
    int64_t n_target;   /* labelled positions in this micro-batch */
} qt_batch;

#endif
