/* The decode loop: a prompt's ids run through the KV cache (qt_model_decode),
 * then one sampled token at a time is fed back until a stop id, max_new
 * tokens or a full context; or many prompts decode together, one KV cache
 * slot each (qt_model_decode_rows). `qtune generate`, the C API
 * (qtune_generate) and any other caller share it. It samples, checks and
 * times; what becomes of each token (streamed text, printed ids, a JSON
 * line) is the caller's, through the callbacks. */
#ifndef QT_MODEL_DECODE_H
#define QT_MODEL_DECODE_H

#include <stdint.h>

#include "core/rng.h"
#include "model/model.h"
#include "model/sample.h"

#define QT_DECODE_MAX_STOP 16 /* <|im_end|>, <|endoftext|> and the model's eos ids */

typedef struct {
    qt_model *m;          /* loaded for inference (opts.infer), max_T >= ctx */
    qt_sampler sampler;   /* over the ids that may be sampled */
    qt_sample_opts so;
    qt_rng rng;           /* qt_decode_reply's stream, seeded by the caller */
    uint64_t seed;        /* qt_decode_batch: each prompt's stream starts from it, as its own run's would */
    float *logits;        /* (V) */
    int V, ctx, max_new;
    int max_ctx;          /* the model's positions: the largest ctx */
    int32_t stop[QT_DECODE_MAX_STOP];
    int n_stop;
    int pos;              /* positions in the KV cache (qt_decode_reply) */
    int32_t *hist;        /* (ctx) the ids in the KV cache, in order */
    long prompt_tokens, decode_tokens; /* over all replies */
    double prompt_s, decode_s;
    const char *model_dir, *adapter; /* for messages; adapter may be NULL */
} qt_decoder;

/* d for model m: ctx positions (0 < ctx <= max_ctx), at most max_new new
 * tokens a reply, sampling among the first v_sample ids (a model may pad its
 * embedding past the tokenizer). The caller sets so, seed / rng and the stop
 * ids (qt_decoder_add_stop). */
int qt_decoder_init(qt_decoder *d, qt_model *m, int ctx, int max_ctx, int max_new, int v_sample);
void qt_decoder_free(qt_decoder *d);
/* id ends a reply: added once, when it is a model id and there is room. */
void qt_decoder_add_stop(qt_decoder *d, int32_t id);
int qt_decoder_is_stop(const qt_decoder *d, int32_t id);

/* The context rule: the sequence (what is in the KV cache, the prompt, the
 * reply) holds at most ctx tokens, so the last one has position ctx - 1. A
 * reply needs room for at least one new token after `used` + n. */
int qt_decode_check_prompt(int used, int n, int ctx, int max_ctx);

/* Each sampled token as it comes (not a stop id); non-zero stops the reply
 * with that status. */
typedef int (*qt_decode_token_fn)(void *user, int32_t id);

/* One reply: its ids (max_new), why it ended ("eos", "max_new" or
 * "context"), its prefill and decode wall time, one-position decode calls. */
typedef struct {
    int32_t *out;
    int n_out, n_dec;
    const char *stop;
    double prefill_s, decode_s;
} qt_decode_result;
void qt_decode_result_free(qt_decode_result *r);

/* Feeds n prompt ids after the d->pos cached positions, then samples up to
 * max_new tokens with d->rng, calling on_token (may be NULL) for each. The
 * sampled token is fed back only while the sequence is shorter than ctx: the
 * last token of a full context is returned but never needs a KV slot. *r
 * gets the reply (qt_decode_result_free) whatever the status. */
int qt_decode_reply(qt_decoder *d, const int32_t *ids, int n, qt_decode_token_fn on_token, void *user,
                    qt_decode_result *r);

/* One prompt of a batch: its ids, and once done its reply. */
typedef struct {
    int32_t *ids;
    int n;
    int32_t *out; /* (max_new), allocated by qt_decode_batch, the caller's to free */
    int n_out, n_dec, done;
    const char *stop;
    double t_start, prefill_s, decode_s; /* its prefill's start; its own prefill and decode wall time */
    qt_rng rng;                          /* seeded with d->seed, as its own run's would be */
} qt_decode_seq;

/* A finished prompt, in the prompts' order; non-zero stops the batch. */
typedef int (*qt_decode_done_fn)(void *user, const qt_decode_seq *p, int index);

/* Up to `batch` prompts at a time (the model's decode_seqs), each in its own
 * slot of the KV cache: a free slot takes the next prompt (prefilled alone,
 * the batched forward), then every running sequence advances one token per
 * step in one qt_model_decode_rows call, so each weight is read once per
 * step for all of them. done is called in the prompts' order as they finish. */
int qt_decode_batch(qt_decoder *d, qt_decode_seq *p, int count, int batch, qt_decode_done_fn done, void *user);

#endif
