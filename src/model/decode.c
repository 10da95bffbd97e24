/* The decode loop (decode.h): one reply through the KV cache, or a batch of
 * prompts in the cache's slots. */
#include "model/decode.h"

#include <math.h>
#include <string.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/mem.h"

int qt_decoder_init(qt_decoder *d, qt_model *m, int ctx, int max_ctx, int max_new, int v_sample) {
    memset(d, 0, sizeof *d);
    d->m = m;
    d->V = qt_model_config(m)->vocab_size;
    d->ctx = ctx, d->max_ctx = max_ctx, d->max_new = max_new;
    d->logits = qt_malloc((size_t)d->V * sizeof *d->logits, "the logits of one position");
    d->hist = qt_malloc((size_t)ctx * sizeof *d->hist, "the ids in the KV cache");
    if (!d->hist) return QT_ENOMEM;
    return d->logits ? qt_sampler_init(&d->sampler, v_sample) : QT_ENOMEM;
}

void qt_decoder_free(qt_decoder *d) {
    qt_sampler_free(&d->sampler);
    qt_free(d->logits);
    qt_free(d->hist);
    d->logits = NULL, d->hist = NULL;
}

int qt_decoder_is_stop(const qt_decoder *d, int32_t id) {
    for (int i = 0; i < d->n_stop; i++)
        if (d->stop[i] == id) return 1;
    return 0;
}

void qt_decoder_add_stop(qt_decoder *d, int32_t id) {
    if (id >= 0 && id < d->V && !qt_decoder_is_stop(d, id) && d->n_stop < QT_DECODE_MAX_STOP) d->stop[d->n_stop++] = id;
}

int qt_decode_check_prompt(int used, int n, int ctx, int max_ctx) {
    if (n < 1) return QT_ERR(QT_EINVAL, "the prompt is empty; give some text (or ids) to continue");
    if (used + n < ctx) return QT_OK;
    if (!used && n >= max_ctx) /* no --ctx can hold it */
        return QT_ERR(QT_EINVAL, "the prompt (%d tokens) leaves no room for a new token in the model's context of %d "
                      "(its max_position_embeddings); shorten the prompt to at most %d tokens", n, max_ctx,
                      max_ctx - 1);
    if (!used)
        return QT_ERR(QT_EINVAL, "the prompt (%d tokens) leaves no room for a new token in the context of %d; "
                      "raise --ctx above %d (the model takes up to %d) or shorten the prompt", n, ctx, n, max_ctx);
    if (ctx >= max_ctx)
        return QT_ERR(QT_EINVAL, "the chat so far (%d tokens) and this turn (%d) leave no room for a reply in the "
                      "model's context of %d; start a new chat", used, n, ctx);
    return QT_ERR(QT_EINVAL, "the chat so far (%d tokens) and this turn (%d) leave no room for a reply in the "
                  "context of %d; raise --ctx (the model takes up to %d) or start a new chat", used, n, ctx, max_ctx);
}

/* NaN or inf weights make every logit NaN or inf, and sampling from them
 * would print ids as if nothing were wrong (argmax of NaN is id 0). `at`:
 * the position of the token these logits follow. */
static int check_logits(const qt_decoder *d, const float *logits, int at) {
    /* a pass the compiler vectorises (an all-ones exponent is inf or NaN), then the loop below only to name one */
    uint32_t bad = 0;
    for (int i = 0; i < d->V; i++) {
        uint32_t u;
        memcpy(&u, logits + i, sizeof u);
        bad |= (u & 0x7F800000u) == 0x7F800000u;
    }
    if (!bad) return QT_OK;
    for (int i = 0; i < d->V; i++)
        if (!isfinite(logits[i]))
            return QT_ERR(QT_EINVAL, "the model in %s%s%s gives a non-finite logit (%s for id %d) at position %d; "
                          "check its weights for NaN or inf values", d->model_dir,
                          d->adapter ? " with the adapter in " : "", d->adapter ? d->adapter : "",
                          isnan(logits[i]) ? "NaN" : "inf", i, at);
    return QT_OK;
}

void qt_decode_result_free(qt_decode_result *r) {
    qt_free(r->out);
    r->out = NULL;
}

int qt_decode_reply(qt_decoder *d, const int32_t *ids, int n, qt_decode_token_fn on_token, void *user,
                    qt_decode_result *r) {
    memset(r, 0, sizeof *r);
    r->stop = "max_new";
    QT_TRY(qt_decode_check_prompt(d->pos, n, d->ctx, d->max_ctx));
    r->out = qt_malloc((size_t)d->max_new * sizeof *r->out + 1, "generated ids");
    if (!r->out) return QT_ENOMEM;
    const double t0 = qt_now_s();
    int rc = qt_model_decode(d->m, ids, n, d->pos, d->logits);
    memcpy(d->hist + d->pos, ids, (size_t)n * sizeof *ids);
    d->pos += n;
    const double t1 = qt_now_s();
    while (rc == QT_OK && r->n_out < d->max_new) {
        if ((rc = check_logits(d, d->logits, d->pos - 1)) != QT_OK) break;
        int32_t next = qt_sample(&d->sampler, d->logits, &d->so, &d->rng);
        if (qt_decoder_is_stop(d, next)) {
            r->stop = "eos";
            break;
        }
        r->out[r->n_out++] = next;
        if (on_token && (rc = on_token(user, next)) != QT_OK) break;
        if (r->n_out == d->max_new) break;
        if (d->pos + 1 >= d->ctx) { /* the cached ids and `next` fill the context */
            r->stop = "context";
            break;
        }
        rc = qt_model_decode(d->m, &next, 1, d->pos, d->logits);
        d->hist[d->pos++] = next;
        r->n_dec++;
    }
    const double t2 = qt_now_s();
    r->prefill_s = t1 - t0, r->decode_s = t2 - t1;
    d->prompt_tokens += n, d->prompt_s += t1 - t0;
    d->decode_tokens += r->n_dec, d->decode_s += t2 - t1;
    return rc;
}

/* A sequence has new logits (after its prefill or a step), its next token at
 * position pos: sample it and decide, by qt_decode_reply's rules, whether it
 * goes on (*more = 1: feed p->out[n_out - 1] at pos) or is done. */
static int take_token(qt_decoder *d, qt_decode_seq *p, const float *logits, int pos, int *more) {
    *more = 0;
    QT_TRY(check_logits(d, logits, pos - 1));
    int32_t next = qt_sample(&d->sampler, logits, &d->so, &p->rng);
    if (qt_decoder_is_stop(d, next)) p->stop = "eos";
    else if ((p->out[p->n_out++] = next), p->n_out == d->max_new) p->stop = "max_new";
    else if (pos + 1 >= d->ctx) p->stop = "context";
    else *more = 1;
    return QT_OK;
}

int qt_decode_batch(qt_decoder *d, qt_decode_seq *p, int count, int batch, qt_decode_done_fn done, void *user) {
    int *slot_of = qt_malloc(sizeof(int) * (size_t)batch, "batch slots"); /* prompt in each slot, -1 free */
    int *seqs = qt_malloc(sizeof(int) * (size_t)batch, "batch rows");
    int *who = qt_malloc(sizeof(int) * (size_t)batch, "batch rows");
    int32_t *tok = qt_malloc(sizeof(int32_t) * (size_t)batch, "batch rows");
    int32_t *pos = qt_malloc(sizeof(int32_t) * (size_t)batch, "batch rows");
    int *at = qt_malloc(sizeof(int) * (size_t)batch, "batch positions"); /* next position of each slot */
    float *logits = qt_malloc(sizeof(float) * (size_t)batch * (size_t)d->V, "the logits of a batch step");
    int rc = slot_of && seqs && who && tok && pos && at && logits ? QT_OK : QT_ENOMEM;
    int next = 0, printed = 0, running = 0;
    for (int s = 0; rc == QT_OK && s < batch; s++) slot_of[s] = -1;
    for (int i = 0; rc == QT_OK && i < count; i++) {
        p[i].out = qt_malloc((size_t)d->max_new * sizeof *p[i].out, "generated ids");
        if (!p[i].out) rc = QT_ENOMEM;
        p[i].stop = "max_new";
    }
    while (rc == QT_OK && (next < count || running)) {
        for (int s = 0; rc == QT_OK && s < batch && next < count; s++) { /* free slots take the next prompts */
            if (slot_of[s] >= 0) continue;
            qt_decode_seq *q = &p[next];
            qt_rng_seed(&q->rng, d->seed);
            q->t_start = qt_now_s();
            rc = qt_model_decode_seq(d->m, s, q->ids, q->n, 0, logits);
            const double t1 = qt_now_s();
            q->prefill_s = t1 - q->t_start;
            d->prompt_tokens += q->n, d->prompt_s += q->prefill_s;
            int more = 0;
            if (rc == QT_OK) rc = take_token(d, q, logits, q->n, &more);
            q->decode_s = qt_now_s() - t1;
            if (more) slot_of[s] = next, at[s] = q->n, running++;
            else q->done = 1;
            next++;
        }
        int n = 0;
        for (int s = 0; s < batch; s++)
            if (slot_of[s] >= 0) {
                qt_decode_seq *q = &p[slot_of[s]];
                who[n] = slot_of[s], seqs[n] = s, pos[n] = at[s], tok[n] = q->out[q->n_out - 1];
                n++;
            }
        if (rc == QT_OK && n) {
            const double t0 = qt_now_s();
            rc = qt_model_decode_rows(d->m, n, seqs, tok, pos, logits);
            for (int i = 0; rc == QT_OK && i < n; i++) {
                qt_decode_seq *q = &p[who[i]];
                int more;
                q->n_dec++;
                rc = take_token(d, q, logits + (size_t)i * d->V, pos[i] + 1, &more);
                at[seqs[i]] = pos[i] + 1;
                q->decode_s = qt_now_s() - q->t_start - q->prefill_s;
                if (!more) q->done = 1, slot_of[seqs[i]] = -1, running--;
            }
            d->decode_tokens += n, d->decode_s += qt_now_s() - t0;
        }
        while (rc == QT_OK && printed < next && p[printed].done) rc = done(user, &p[printed], printed), printed++;
    }
    qt_free(slot_of), qt_free(seqs), qt_free(who), qt_free(tok), qt_free(pos), qt_free(at), qt_free(logits);
    return rc;
}
