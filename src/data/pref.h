/* Preference data (docs/preference.md): one (prompt, chosen, rejected)
 * example per JSONL line, in the shapes users have it:
 *   TRL        {"prompt", "chosen", "rejected"}: strings, or message lists
 *              (then "prompt" may be left out: the messages chosen and
 *              rejected share at the start are the prompt, TRL's implicit
 *              prompt)
 *   LLaMA-Factory  {"conversations": [{"from", "value"}...], "system"?,
 *              "chosen": {"from", "value"}, "rejected": {...}} (ShareGPT),
 *              {"instruction", "input"?, "chosen", "rejected"} (Alpaca)
 * Each side is encoded as the prompt_completion format (data/format.h) with
 * the prompt masked: the model's chat template over message lists, the
 * completion's assistant turn(s) labelled; strings joined, the completion and
 * TRL's appended <|endoftext|> labelled. A side longer than seq_len keeps its
 * first seq_len tokens.
 *
 * A micro-batch of P pairs is 2P rows, one sequence per row, never packed:
 * rows 0..P-1 the chosen sides, P..2P-1 the rejected sides in the same order
 * (train/objective.h). */
#ifndef QT_DATA_PREF_H
#define QT_DATA_PREF_H

#include <stdint.h>

#include "data/batch.h"
#include "text/tokenizer.h"

typedef struct {
    int32_t *ids;     /* every side's tokens, side after side */
    uint8_t *mask;    /* 1: the token carries a label */
    int64_t *start;   /* (2 n_pairs + 1): side s is [start[s], start[s+1]); side 2i chosen, 2i+1 rejected */
    int64_t n_pairs;
    int64_t n_truncated; /* sides cut to seq_len */
    int32_t pad_id;
} dl_pref_set;

/* Reads path (tok: the model's tokenizer) into set; an error names
 * path:line and what to write. */
int dl_pref_load(const char *path, const bpe_tokenizer *tok, int seq_len, dl_pref_set *set);
void dl_pref_free(dl_pref_set *set);
/* Fills b (2P rows of T, from dl_batch-sized buffers of at least 2P rows)
 * with the pairs idx[0..P). */
void dl_pref_batch(const dl_pref_set *set, const int64_t *idx, int P, int T, qt_batch *b);
/* 1 when a JSON object's keys say it is a preference example. */
struct cJSON;
int dl_pref_detect(const struct cJSON *obj);

#endif
