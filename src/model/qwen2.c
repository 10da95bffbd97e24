/* The Qwen2 / Qwen3 / original Qwen / Llama decoder, written once over the
 * ops of the backend interface (backend/backend.h; m->be, chosen at load). One decoder layer (HF Qwen2DecoderLayer):
 *
 *   ln1  = rmsnorm(x)                     q, k, v = q_proj(ln1), k_proj(ln1), v_proj(ln1)
 *   q, k = rope(q), rope(k)               att = causal GQA attention(q, k, v)
 *   xmid = x + o_proj(att)                ln2 = rmsnorm(xmid)
 *   h    = silu(gate_proj(ln2)) * up_proj(ln2)
 *   xout = xmid + down_proj(h)
 *
 * then the final norm and the fused lm_head + cross-entropy. Qwen3 adds
 * q_norm/k_norm (RMSNorm over each head's D) on q and k before RoPE; the
 * original Qwen's fused c_attn arrives as three row slices and its
 * w2/w1/c_proj as gate/up/down (model/qwen2_load.c), so it runs the same
 * steps. A Linear with a LoRA adapter adds scaling * B A dropout(x) (PEFT). The backward walks the
 * same steps in reverse; with gradient checkpointing each layer's forward is
 * recomputed from its saved input just before its backward.
 *
 * Every buffer here is device memory: this file never reads or writes one
 * itself. What crosses is explicit: the batch's ids, targets, positions and
 * doc_start go up (upload_batch), the per-token losses and decode logits come
 * down. */
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"
#include "model/model_internal.h"

/* ---- LoRA dropout: masks regenerated from (seed, micro step, layer, module)
 * by the backend's counter-based generator (backend.h qt_dropout_u24), so the
 * forward, the recompute and the backward all see the same mask without
 * storing it. dst = dropout(src); dst may be src. */
void qt_lora_dropout(const qt_model *m, int l, int j, float *dst, const float *src, size_t n) {
    qt_dropout_key key = {m->opts.seed, m->micro_step, (uint32_t)l, (uint32_t)j};
    float p = m->opts.lora_dropout;
    qt_be_dropout(m->be, dst, src, n, &key, qt_dropout_threshold(p), 1.0f / (1.0f - p));
}

/* ---- mixed precision: what the graph stores (activations saved for the
 * backward, activation gradients) takes the compute dtype's precision, as a
 * store to fp16/bf16 would; arithmetic stays fp32. In fp16 a value beyond
 * 65504 becomes inf, so a too-large loss scale overflows as on a GPU and the
 * loss scaler skips the step. No-op in f32. */
static inline void round_to_compute(const qt_model *m, float *x, size_t n) {
    if (m->opts.compute != QT_F32) qt_be_round_to_dtype(m->be, x, n, m->opts.compute);
}

/* An activation gradient rounded to the compute dtype, as the reference's
 * 16-bit autograd stores each one it hands from op to op. */
static inline void round_grad(const qt_model *m, float *dx, size_t n) { round_to_compute(m, dx, n); }

/* round_to_compute() for a value the backward reads again: with 2-byte
 * storage (f16/bf16 training, model_internal.h qt_acts16) the rounded values
 * are also written to the layer's 2-byte slot in the same pass; x itself is
 * the fp32 working set that the rest of this layer's forward reads. slot
 * NULL: plain round_to_compute(). */
static inline void round_and_save(const qt_model *m, float *x, size_t n, uint16_t *slot) {
    if (slot) qt_be_round_store(m->be, x, slot, n, m->opts.compute);
    else round_to_compute(m, x, n);
}

/* 2-byte storage: layer l's saved values back into the fp32 working set (an
 * exact conversion, so the backward reads what round_and_save() left), just before its
 * backward; with checkpointing only its input, from which it is recomputed. */
static void acts_load(qt_model *m, int l, int N) {
    const qt_act_ptrs *A = &m->acts;
    if (!A->x16) return;
    const qt_config *c = &m->cfg;
    const qt_dtype dt = m->opts.compute;
    qt_backend *be = m->be;
    size_t NC = (size_t)N * c->hidden_size, NI = (size_t)N * c->intermediate_size,
           NQ = (size_t)N * c->num_attention_heads * c->head_dim, NK = (size_t)N * c->num_key_value_heads * c->head_dim;
    qt_be_convert(be, A->x[l], QT_F32, A->x16[l], dt, NC);
    if (!A->layer16) return;
    const qt_acts16 *s = &A->layer16[l];
    const qt_acts *a = &A->layer[l];
    qt_be_convert(be, a->ln1, QT_F32, s->ln1, dt, NC);
    qt_be_convert(be, a->q, QT_F32, s->q, dt, NQ);
    qt_be_convert(be, a->k, QT_F32, s->k, dt, NK);
    qt_be_convert(be, a->v, QT_F32, s->v, dt, NK);
    if (s->qraw) qt_be_convert(be, a->qraw, QT_F32, s->qraw, dt, NQ);
    if (s->kraw) qt_be_convert(be, a->kraw, QT_F32, s->kraw, dt, NK);
    qt_be_convert(be, a->att, QT_F32, s->att, dt, NQ);
    qt_be_convert(be, a->xmid, QT_F32, s->xmid, dt, NC);
    qt_be_convert(be, a->ln2, QT_F32, s->ln2, dt, NC);
    qt_be_convert(be, a->gate, QT_F32, s->gate, dt, NI);
    qt_be_convert(be, a->up, QT_F32, s->up, dt, NI);
    qt_be_convert(be, a->h, QT_F32, s->h, dt, NI);
    for (int j = 0; j < LIN_COUNT; j++)
        if (s->lora_h[j]) qt_be_convert(be, a->lora_h[j], QT_F32, s->lora_h[j], dt, (size_t)N * m->opts.lora_r);
}

/* ---- Linear (+ LoRA) forward/backward ------------------------------------ */
/* Decoding (N one-token rows against the KV cache): the Linears run as
 * matrix-vector products, each weight read once for all N rows. */
static int decoding(const qt_model *m, int N) { return m->infer && (N == 1 || m->dec_rows); }

/* Inference on bf16-valued weights (m->infer16): x, the input of the
 * Linears (or of the lm_head) next, rounded to bf16 in place (read by
 * nothing else), so that a batched forward's products run on the bf16 GEMM. Decode steps (matvec)
 * round the same inputs, so a prompt's prefill and its token-by-token decode
 * compute the same thing up to the summation order. */
static void infer_round(const qt_model *m, float *x, size_t n) {
    if (m->infer16) qt_be_round_to_dtype(m->be, x, n, QT_BF16);
}

/* Decoding: out += B (s A x) for a LoRA target, through lora_h (N, R). */
static void lora_decode(qt_model *m, const qt_linear *q, float *out, const float *inp, float *lora_h, int N) {
    qt_backend *be = m->be;
    qt_be_matvec(be, lora_h, inp, q->la, QT_F32, NULL, N, q->in, m->opts.lora_r, m->lora_scaling, 0); /* s A x */
    qt_be_matvec(be, out, lora_h, q->lb, QT_F32, NULL, N, m->opts.lora_r, q->out, 1.0f, 1);          /* += B hs */
}

/* inp16: the same input as 2-byte values (its saved slot) or NULL. With
 * native 16-bit GEMMs (m->native16) a weight in the compute dtype times that
 * input runs on the backend's 16-bit GEMM (oneDNN's bf16 on the CPU, the
 * tensor cores on a GPU), else (and whenever it refuses) on fp32 sgemm. */
static void linear_forward(qt_model *m, int l, int j, float *out, const float *inp, const uint16_t *inp16, int N,
                           float *lora_h, int dropout) {
    const qt_linear *q = &m->layers[l].lin[j];
    qt_backend *be = m->be;
    if (decoding(m, N)) {
        qt_be_matvec(be, out, inp, q->w.p, q->w.dt, q->b, N, q->in, q->out, 1.0f, 0);
        if (q->la && !m->adapter_off) lora_decode(m, q, out, inp, lora_h, N);
        return;
    }
    if (!(m->native16 && inp16 && q->w.dt == m->opts.compute &&
          qt_be_half_matmul(be, q->w.dt, out, inp16, q->w.p, q->b, N, q->in, q->out, 1.0f) == QT_OK))
        qt_be_matmul_forward(be, out, inp, q->w.p, q->w.dt, q->b, N, q->in, q->out, 1.0f, 0, m->ws);
    if (!q->la || m->adapter_off) return;
    const float *xd = inp;
    if (dropout) {
        qt_lora_dropout(m, l, q->lora_id, m->gs.lx, inp, (size_t)N * q->in);
        xd = m->gs.lx;
    }
    int R = m->opts.lora_r;
    qt_be_matmul_forward(be, lora_h, xd, q->la, QT_F32, NULL, N, q->in, R, m->lora_scaling, 0, NULL); /* hs = s A xd */
    round_and_save(m, lora_h, (size_t)N * R, m->acts.layer16 ? m->acts.layer16[l].lora_h[j] : NULL);
    qt_be_matmul_forward(be, out, lora_h, q->lb, QT_F32, NULL, N, R, q->out, 1.0f, 1, NULL);         /* y += B hs */
}

/* Linears js[0 .. n-1] of one input (q/k/v, gate/up) into outs. Decoding,
 * the base products run as one matvec_many job (a CPU thread goes from one
 * product's rows to the next's without waiting at each product's end), then
 * each LoRA adds its B A x as linear_forward does: the same bits as n
 * linear_forward calls. Else n linear_forward calls. */
static void linears_forward(qt_model *m, int l, int n, const int *js, float *const *outs, const float *inp,
                            const uint16_t *inp16, int N, float *const *lora_h, int dropout) {
    if (!decoding(m, N)) {
        for (int i = 0; i < n; i++) linear_forward(m, l, js[i], outs[i], inp, inp16, N, lora_h[js[i]], dropout);
        return;
    }
    qt_matvec_out o[LIN_COUNT]; /* js are distinct Linears of layer l */
    for (int i = 0; i < n; i++) {
        const qt_linear *q = &m->layers[l].lin[js[i]];
        o[i] = (qt_matvec_out){.out = outs[i], .w = q->w.p, .wdt = q->w.dt, .bias = q->b, .OUT = q->out};
    }
    qt_be_matvec_many(m->be, inp, N, m->layers[l].lin[js[0]].in, n, o);
    for (int i = 0; i < n; i++) {
        const qt_linear *q = &m->layers[l].lin[js[i]];
        if (q->la) lora_decode(m, q, outs[i], inp, lora_h[js[i]], N);
    }
}

/* The base weight's backward. With native 16-bit GEMMs the products run on
 * the backend's GEMM for the compute dtype: dout in 2 bytes (round_grad() left it
 * rounded, so exact), dinp += dout W against the 2-byte weight, and in full
 * fine-tuning dW += dout^T inp16 against the saved 2-byte input, both
 * accumulated in fp32; each product the backend refuses runs on fp32 sgemm
 * instead, and the bias gradient always does. Else all of it on fp32 sgemm
 * (op_matmul_backward). */
static void base_backward(qt_model *m, const qt_linear *q, float *dinp, const float *dout, const float *inp,
                          const uint16_t *inp16, int N) {
    /* native16 implies every layer's 2-byte slots (so inp16) and the dout16 scratch (memplan.c) */
    uint16_t *d16 = m->gs.dout16;
    qt_backend *be = m->be;
    const qt_dtype dt = q->w.dt;
    if (!(m->native16 && dt == m->opts.compute)) {
        qt_be_matmul_backward(be, dinp, q->dw, q->db, dout, inp, q->w.p, q->w.dt, N, q->in, q->out, 1.0f, m->ws);
        return;
    }
    qt_be_convert(be, d16, dt, dout, QT_F32, (size_t)N * q->out);
    if (dinp && qt_be_half_gemm(be, dt, dinp, d16, 0, q->w.p, 0, NULL, N, q->in, q->out, 1.0f, 1) != QT_OK)
        qt_be_matmul_backward(be, dinp, NULL, NULL, dout, inp, q->w.p, q->w.dt, N, q->in, q->out, 1.0f, m->ws);
    int dw_native = q->dw && qt_be_half_gemm(be, dt, q->dw, d16, 1, inp16, 0, NULL, q->out, q->in, N, 1.0f, 1) == QT_OK;
    if ((q->dw && !dw_native) || q->db)
        qt_be_matmul_backward(be, NULL, dw_native ? NULL : q->dw, q->db, dout, inp, q->w.p, q->w.dt, N, q->in, q->out,
                            1.0f, m->ws);
}

/* dinp may be NULL when nothing below needs it (LoRA, layer 0); inp16: inp's
 * saved 2-byte slot or NULL. */
static void linear_grads(qt_model *m, int l, int j, float *dinp, const float *dout, const float *inp,
                         const uint16_t *inp16, const float *lora_h, int N, int dropout) {
    const qt_linear *q = &m->layers[l].lin[j];
    base_backward(m, q, dinp, dout, inp, inp16, N);
    if (!q->la) return;
    int R = m->opts.lora_r;
    float s = m->lora_scaling, *dhs = m->gs.dlora;
    qt_backend *be = m->be;
    qt_be_matmul_backward(be, NULL, q->dlb, NULL, dout, lora_h, q->lb, QT_F32, N, R, q->out, 1.0f, NULL); /* dB += dy^T hs */
    qt_be_zero(be, dhs, sizeof(float) * (size_t)N * R);
    qt_be_matmul_backward(be, dhs, NULL, NULL, dout, NULL, q->lb, QT_F32, N, R, q->out, 1.0f, NULL); /* dhs = dy B */
    if (!dropout) {
        /* dA += s dhs^T x,  dx += s dhs A */
        qt_be_matmul_backward(be, dinp, q->dla, NULL, dhs, inp, q->la, QT_F32, N, q->in, R, s, NULL);
        return;
    }
    size_t n = (size_t)N * q->in;
    float *lx = m->gs.lx;
    qt_lora_dropout(m, l, q->lora_id, lx, inp, n);
    qt_be_matmul_backward(be, NULL, q->dla, NULL, dhs, lx, q->la, QT_F32, N, q->in, R, s, NULL);
    if (!dinp) return;
    qt_be_zero(be, lx, sizeof(float) * n);
    qt_be_matmul_backward(be, lx, NULL, NULL, dhs, NULL, q->la, QT_F32, N, q->in, R, s, NULL);
    qt_lora_dropout(m, l, q->lora_id, lx, lx, n); /* the same mask: d dropout(x) / dx */
    qt_be_acc(be, dinp, lx, n);
}

/* Each Linear's weight gradients are one backward step (memplan.h QT_GU_*). */
static const int lin_unit[LIN_COUNT] = {QT_GU_Q, QT_GU_K, QT_GU_V, QT_GU_O, QT_GU_GATE, QT_GU_UP, QT_GU_DOWN};

/* Linear j's backward as one step of the gradient hand-over: with gradient
 * windows (grad_windows.h) the bucket its unit starts opens before, and the
 * bucket the step completes is handed over after. */
static int linear_backward(qt_model *m, int l, int j, float *dinp, const float *dout, const float *inp,
                           const uint16_t *inp16, const float *lora_h, int N, int dropout) {
    QT_TRY(qt_grad_win_begin(&m->grad_win, l, lin_unit[j]));
    linear_grads(m, l, j, dinp, dout, inp, inp16, lora_h, N, dropout);
    return qt_grad_win_end(&m->grad_win, l, lin_unit[j]);
}

/* ---- one decoder layer ---------------------------------------------------- */
/* What a decode call runs against the KV cache: N consecutive tokens of
 * sequence seq from position pos0 (seqs NULL), or one token of sequence
 * seqs[i] at position hpos[i] for each row i (host arrays). */
typedef struct {
    int seq, pos0;
    const int *seqs;
    const int32_t *hpos;
    int rope_per_row; /* the RoPE table depends on the position (dynamic NTK) and the rows' tables differ:
                       * each row is rotated with its own, as its one-token call would be */
} dec_rows;

/* RoPE of q (N, H, D) and k (N, KV, D) at positions pos (device) */
static void rope_rows(qt_model *m, float *q, float *k, const int32_t *pos, int N, const dec_rows *d) {
    const qt_config *c = &m->cfg;
    qt_backend *be = m->be;
    const int H = c->num_attention_heads, KV = c->num_key_value_heads, D = c->head_dim;
    if (!d || !d->rope_per_row) {
        qt_be_rope_forward(be, q, pos, N, H, D, m->rope_inv, m->rope_scale);
        qt_be_rope_forward(be, k, pos, N, KV, D, m->rope_inv, m->rope_scale);
        return;
    }
    float inv[QT_ROPE_MAX_HALF], scale;
    for (int i = 0; i < N; i++) {
        qt_rope_inv_freq(c, D, d->hpos[i], inv, &scale);
        qt_be_rope_forward(be, q + (size_t)i * H * D, pos + i, 1, H, D, inv, scale);
        qt_be_rope_forward(be, k + (size_t)i * KV * D, pos + i, 1, KV, D, inv, scale);
    }
}

/* K and V of this layer's rows into the cache, then their attention over it */
static void attend_cached(qt_model *m, int l, int N, qt_acts *a, const dec_rows *d) {
    const qt_config *c = &m->cfg;
    qt_backend *be = m->be;
    const int H = c->num_attention_heads, KV = c->num_key_value_heads, D = c->head_dim;
    const size_t row = (size_t)KV * D, seq = (size_t)m->opts.max_T * row, layer = (size_t)m->decode_seqs * seq;
    float *kc = m->kcache + (size_t)l * layer, *vc = m->vcache + (size_t)l * layer;
    if (!d->seqs) {
        float *ks = kc + (size_t)d->seq * seq, *vs = vc + (size_t)d->seq * seq;
        qt_be_copy(be, ks + (size_t)d->pos0 * row, a->k, sizeof(float) * (size_t)N * row);
        qt_be_copy(be, vs + (size_t)d->pos0 * row, a->v, sizeof(float) * (size_t)N * row);
        qt_be_attention_forward_cached(be, a->att, a->q, ks, vs, N, d->pos0, H, KV, D);
        return;
    }
    for (int i = 0; i < N; i++) { /* each row against its own sequence: the one-token call, row by row */
        float *ks = kc + (size_t)d->seqs[i] * seq, *vs = vc + (size_t)d->seqs[i] * seq;
        qt_be_copy(be, ks + (size_t)d->hpos[i] * row, a->k + (size_t)i * row, sizeof(float) * row);
        qt_be_copy(be, vs + (size_t)d->hpos[i] * row, a->v + (size_t)i * row, sizeof(float) * row);
        qt_be_attention_forward_cached(be, a->att + (size_t)i * H * D, a->q + (size_t)i * H * D, ks, vs, 1, d->hpos[i],
                                     H, KV, D);
    }
}

/* b == NULL: decoding N tokens against the KV cache, as d says. */
static void layer_forward(qt_model *m, int l, const qt_batch *b, int N, const float *x, float *xout, qt_acts *a,
                          int dropout, const int32_t *pos, const dec_rows *d) {
    const qt_config *c = &m->cfg;
    const qt_layer *L = &m->layers[l];
    qt_backend *be = m->be;
    int C = c->hidden_size, I = c->intermediate_size, H = c->num_attention_heads, KV = c->num_key_value_heads,
        D = c->head_dim;
    size_t NC = (size_t)N * C, NI = (size_t)N * I, NQ = (size_t)N * H * D, NK = (size_t)N * KV * D;
    /* 2-byte storage (else all NULL): this layer's slots, and where its output goes (the next layer's
     * input, as run_forward saves the embedding into x16[0]; the last output stays in fp32). With
     * checkpointing the recompute stores x16 again, the same values into a slot already read. */
    const qt_acts16 no_slots = {0}, *s = m->acts.layer16 ? &m->acts.layer16[l] : &no_slots;
    uint16_t *const *x16 = m->acts.x16;
    qt_be_rmsnorm_forward(be, a->ln1, a->rstd1, x, L->ln1, N, C, c->rms_norm_eps);
    round_and_save(m, a->ln1, NC, s->ln1);
    infer_round(m, a->ln1, NC);
    /* Qwen3: the projections go to qraw/kraw, and q_norm/k_norm (one RMSNorm over D per head: (N*H) rows
     * of D) write q and k, before RoPE */
    float *qp = a->qraw ? a->qraw : a->q, *kp = a->kraw ? a->kraw : a->k;
    const int qkv[3] = {LIN_Q, LIN_K, LIN_V}, gate_up[2] = {LIN_GATE, LIN_UP};
    float *qkv_out[3] = {qp, kp, a->v};
    float *gate_up_out[2] = {a->gate, a->up};
    linears_forward(m, l, 3, qkv, qkv_out, a->ln1, s->ln1, N, a->lora_h, dropout);
    if (a->qraw) {
        round_and_save(m, a->qraw, NQ, s->qraw);
        round_and_save(m, a->kraw, NK, s->kraw);
        qt_be_rmsnorm_forward(be, a->q, a->rstdq, a->qraw, L->qn, N * H, D, c->rms_norm_eps);
        qt_be_rmsnorm_forward(be, a->k, a->rstdk, a->kraw, L->kn, N * KV, D, c->rms_norm_eps);
    }
    rope_rows(m, a->q, a->k, pos, N, b ? NULL : d);
    round_and_save(m, a->q, NQ, s->q);
    round_and_save(m, a->k, NK, s->k);
    round_and_save(m, a->v, NK, s->v);
    if (b) {
        qt_be_attention_forward(be, a->att, a->lse, a->q, a->k, a->v, b->doc_start, b->B, b->T, H, KV, D);
    } else {
        attend_cached(m, l, N, a, d);
    }
    round_and_save(m, a->att, NQ, s->att);
    infer_round(m, a->att, NQ);
    linear_forward(m, l, LIN_O, a->xmid, a->att, s->att, N, a->lora_h[LIN_O], dropout);
    qt_be_acc(be, a->xmid, x, NC);
    round_and_save(m, a->xmid, NC, s->xmid);
    qt_be_rmsnorm_forward(be, a->ln2, a->rstd2, a->xmid, L->ln2, N, C, c->rms_norm_eps);
    round_and_save(m, a->ln2, NC, s->ln2);
    infer_round(m, a->ln2, NC);
    linears_forward(m, l, 2, gate_up, gate_up_out, a->ln2, s->ln2, N, a->lora_h, dropout);
    round_and_save(m, a->gate, NI, s->gate);
    round_and_save(m, a->up, NI, s->up);
    qt_be_swiglu_forward(be, a->h, a->gate, a->up, N, I);
    round_and_save(m, a->h, NI, s->h);
    infer_round(m, a->h, NI);
    linear_forward(m, l, LIN_DOWN, xout, a->h, s->h, N, a->lora_h[LIN_DOWN], dropout);
    qt_be_acc(be, xout, a->xmid, NC);
    round_and_save(m, xout, NC, x16 && l + 1 < c->num_hidden_layers ? x16[l + 1] : NULL);
}

/* ---- ZeRO-3: the weights gathered at use (model.h qt_param_fetch) -------------- */
/* This rank's shard the gathers read, and the bytes of its elements. */
static const void *gather_mine(const qt_model *m) {
    if (m->pbase) return m->pbase;
    return m->wcopy ? (const void *)m->wcopy : (const void *)m->master;
}
static size_t gather_esize(const qt_model *m) { return qt_dtype_size(m->pbase ? m->bdt : m->opts.compute); }

/* Buffer `slot` gets flat [lo, hi) under `key` (a layer, or buffer 2 a flat
 * offset); nothing moves when it holds or is receiving that already. */
static int gather_start(qt_model *m, int slot, long long key, size_t lo, size_t hi) {
    if (m->gkey[slot] == key) return QT_OK;
    if (m->gpend[slot]) QT_TRY(m->pf.wait(m->pf.user, slot)); /* cannot happen: a buffer is read before reuse */
    if (!m->pf.start)
        return QT_ERR(QT_EINVAL, "this model's weights are partitioned (ZeRO-3) but no parameter fetch is set; call "
                                 "qt_model_set_param_fetch first");
    m->gkey[slot] = key;
    m->gpend[slot] = 1;
    return m->pf.start(m->pf.user, slot, gather_mine(m), gather_esize(m), lo, hi, m->gbuf[slot]);
}

static int gather_have(qt_model *m, int slot, long long key, size_t lo, size_t hi) {
    QT_TRY(gather_start(m, slot, key, lo, hi));
    if (!m->gpend[slot]) return QT_OK;
    m->gpend[slot] = 0;
    return m->pf.wait(m->pf.user, slot);
}

/* Layer l's weights before its forward or backward; with prefetch the gather
 * of layer `next` (the one after it in this pass, -1 for none) starts now,
 * into the other buffer, whose layer this pass is done with. */
static int layer_params(qt_model *m, int l, int next) {
    if (!m->pshard) return QT_OK;
    QT_TRY(gather_have(m, l & 1, l, m->glo[l], m->ghi[l]));
    if (m->pf.prefetch && next >= 0 && next < m->cfg.num_hidden_layers)
        QT_TRY(gather_start(m, next & 1, next, m->glo[next], m->ghi[next]));
    return QT_OK;
}

/* The embedding (off = gout[0]) or the lm_head (gout[1]) in buffer 2; -1:
 * not gathered (LoRA: modules_to_save's copy, whole in the master). A freed
 * buffer (outer_done) is allocated again here, and the graph's references
 * to it follow. */
static int outer_params(qt_model *m, size_t off) {
    if (!m->pshard || off == (size_t)-1) return QT_OK;
    const size_t n = (size_t)m->cfg.vocab_size * (size_t)m->cfg.hidden_size;
    if (!m->gbuf[2]) {
        m->gbuf[2] = qt_be_alloc(m->be, QT_MEM_DEVICE, n * gather_esize(m), "model: ZeRO-3 V x C gather buffer");
        if (!m->gbuf[2]) return QT_ENOMEM;
        if (m->gout[0] != (size_t)-1) m->wte.p = m->gbuf[2];
        if (m->gout[1] != (size_t)-1) m->lm_head.p = m->gbuf[2];
    }
    return gather_have(m, 2, (long long)off, off, off + n);
}

/* After the graph read buffer 2 for `off` (as outer_params): its memory goes
 * back when stage3_max_reuse_distance says so (memplan.h qt_model_outer_mode)
 * for what comes before its next read: `gap` QT_OUTER_FREED when that is the
 * layers, QT_OUTER_SLICED when nothing is. The next read gathers it again. */
static void outer_done(qt_model *m, size_t off, int gap) {
    if (!m->pshard || off == (size_t)-1 || m->gmode < gap || !m->gbuf[2]) return;
    qt_be_free(m->be, m->gbuf[2]);
    m->gbuf[2] = NULL;
    m->gkey[2] = -1;
}

/* QT_OUTER_SLICED: the lm_head's vocabulary rows [v0, v0 + sv) gathered into
 * the slice buffer for that slice's backward (*w), the V x C buffer freed. */
static int head_slice_params(qt_model *m, int v0, int sv, const void **w) {
    const size_t C = (size_t)m->cfg.hidden_size, lo = m->gout[1] + (size_t)v0 * C, es = gather_esize(m);
    if (!m->gslice) {
        m->gslice = qt_be_alloc(m->be, QT_MEM_DEVICE, (size_t)m->grad_win.plan.slice_rows * C * es,
                                 "model: ZeRO-3 lm_head slice buffer");
        if (!m->gslice) return QT_ENOMEM;
    }
    QT_TRY(m->pf.start(m->pf.user, 2, gather_mine(m), es, lo, lo + (size_t)sv * C, m->gslice));
    *w = m->gslice;
    return m->pf.wait(m->pf.user, 2);
}

/* ---- norms in the backward -------------------------------------------------- */
/* A layer's RMSNorm backward (weight gradient dweight, NULL when frozen) as
 * backward step `unit`, handed over as linear_backward is. */
static int norm_backward(qt_model *m, int l, int unit, float *dinp, float *dweight, const float *dout,
                         const float *inp, const float *weight, const float *rstd, int N, int C) {
    QT_TRY(qt_grad_win_begin(&m->grad_win, l, unit));
    qt_be_rmsnorm_backward(m->be, dinp, dweight, dout, inp, weight, rstd, N, C);
    return qt_grad_win_end(&m->grad_win, l, unit);
}

/* Qwen3's q_norm / k_norm (rows of D): d raw (into draw, zeroed here) from d
 * normed. Its weight's gradient belongs to the projection's step (Linear j's
 * unit): that bucket opens here, and linear_backward hands it over after the
 * projection's gradients. */
static int head_norm_backward(qt_model *m, int l, int j, float *draw, float *dweight, const float *dnormed,
                              const float *raw, const float *weight, const float *rstd, int rows) {
    const int D = m->cfg.head_dim;
    QT_TRY(qt_grad_win_begin(&m->grad_win, l, lin_unit[j]));
    qt_be_zero(m->be, draw, sizeof(float) * (size_t)rows * D);
    qt_be_rmsnorm_backward(m->be, draw, dweight, dnormed, raw, weight, rstd, rows, D);
    round_grad(m, draw, (size_t)rows * D);
    return QT_OK;
}

/* dres holds d loss / d xout on entry and d loss / d x on return. need_dx = 0
 * (LoRA, layer 0: nothing below is trainable) skips the work for dx. Each
 * linear_backward / norm_backward is one step of memplan.h's QT_GU order and
 * hands its gradient bucket over itself (grad_windows.h); round_grad stores
 * each activation gradient in the compute dtype. */
static int layer_backward(qt_model *m, int l, const qt_batch *b, int N, const float *x, const qt_acts *a,
                          int dropout, int need_dx) {
    const qt_config *c = &m->cfg;
    const qt_layer *L = &m->layers[l];
    const qt_grad_scratch *g = &m->gs;
    qt_backend *be = m->be;
    int C = c->hidden_size, I = c->intermediate_size, H = c->num_attention_heads, KV = c->num_key_value_heads,
        D = c->head_dim;
    size_t NC = (size_t)N * C, NI = (size_t)N * I, NQ = (size_t)N * H * D, NK = (size_t)N * KV * D;
    /* 2-byte storage without checkpointing: the saved inputs, for the weight gradients' bf16 GEMMs */
    const qt_acts16 no_slots = {0}, *s = m->acts.layer16 ? &m->acts.layer16[l] : &no_slots;

    qt_be_zero(be, g->dh, sizeof(float) * NI);
    QT_TRY(linear_backward(m, l, LIN_DOWN, g->dh, g->dres, a->h, s->h, a->lora_h[LIN_DOWN], N, dropout));
    round_grad(m, g->dh, NI);
    qt_be_zero(be, g->dg, sizeof(float) * NI);
    qt_be_zero(be, g->du, sizeof(float) * NI);
    qt_be_swiglu_backward(be, g->dg, g->du, g->dh, a->gate, a->up, N, I);
    round_grad(m, g->dg, NI);
    round_grad(m, g->du, NI);
    qt_be_zero(be, g->dln, sizeof(float) * NC);
    QT_TRY(linear_backward(m, l, LIN_GATE, g->dln, g->dg, a->ln2, s->ln2, a->lora_h[LIN_GATE], N, dropout));
    QT_TRY(linear_backward(m, l, LIN_UP, g->dln, g->du, a->ln2, s->ln2, a->lora_h[LIN_UP], N, dropout));
    round_grad(m, g->dln, NC);
    QT_TRY(norm_backward(m, l, QT_GU_LN2, g->dres, L->dln2, g->dln, a->xmid, L->ln2, a->rstd2, N, C)); /* d xmid */
    round_grad(m, g->dres, NC);

    qt_be_zero(be, g->datt, sizeof(float) * NQ);
    QT_TRY(linear_backward(m, l, LIN_O, g->datt, g->dres, a->att, s->att, a->lora_h[LIN_O], N, dropout));
    round_grad(m, g->datt, NQ);
    qt_be_zero(be, g->dq, sizeof(float) * NQ);
    qt_be_zero(be, g->dk, sizeof(float) * NK);
    qt_be_zero(be, g->dv, sizeof(float) * NK);
    qt_be_attention_backward(be, g->dq, g->dk, g->dv, g->datt, a->att, a->lse, a->q, a->k, a->v, b->doc_start, b->B, b->T,
                          H, KV, D);
    qt_be_rope_backward(be, g->dq, b->positions, N, H, D, m->rope_inv, m->rope_scale);
    qt_be_rope_backward(be, g->dk, b->positions, N, KV, D, m->rope_inv, m->rope_scale);
    round_grad(m, g->dq, NQ);
    round_grad(m, g->dk, NK);
    round_grad(m, g->dv, NK);
    float *dln = need_dx ? g->dln : NULL;
    if (dln) qt_be_zero(be, dln, sizeof(float) * NC);
    /* Qwen3: back through q_norm/k_norm; datt is free once the attention's backward has run, and
     * holds the gradient of qraw, then of kraw (KV <= H) */
    const float *dqp = g->dq, *dkp = g->dk;
    if (a->qraw) {
        QT_TRY(head_norm_backward(m, l, LIN_Q, g->datt, L->dqn, g->dq, a->qraw, L->qn, a->rstdq, N * H));
        dqp = g->datt;
    }
    QT_TRY(linear_backward(m, l, LIN_Q, dln, dqp, a->ln1, s->ln1, a->lora_h[LIN_Q], N, dropout));
    if (a->kraw) {
        QT_TRY(head_norm_backward(m, l, LIN_K, g->datt, L->dkn, g->dk, a->kraw, L->kn, a->rstdk, N * KV));
        dkp = g->datt;
    }
    QT_TRY(linear_backward(m, l, LIN_K, dln, dkp, a->ln1, s->ln1, a->lora_h[LIN_K], N, dropout));
    QT_TRY(linear_backward(m, l, LIN_V, dln, g->dv, a->ln1, s->ln1, a->lora_h[LIN_V], N, dropout));
    /* need_dx = 0 only without a trainable embedding, where ln1 is frozen (LoRA): its unit is empty */
    if (!need_dx) return QT_OK;
    round_grad(m, g->dln, NC);
    QT_TRY(norm_backward(m, l, QT_GU_LN1, g->dres, L->dln1, g->dln, x, L->ln1, a->rstd1, N, C));
    round_grad(m, g->dres, NC);
    return QT_OK;
}

/* ---- batches ---------------------------------------------------------------- */
static int check_batch(const qt_model *m, const qt_batch *b) {
    size_t maxn = (size_t)m->opts.max_B * (size_t)m->opts.max_T;
    if (b->B < 1 || b->T < 1 || (size_t)b->B * (size_t)b->T > maxn)
        return QT_ERR(QT_EINVAL, "batch of %d x %d tokens exceeds the model's activation plan (%d x %d); raise "
                                 "micro-batch/seq_len in the model options",
                      b->B, b->T, m->opts.max_B, m->opts.max_T);
    int V = m->cfg.vocab_size;
    for (int r = 0; r < b->B; r++)
        for (int t = 0; t < b->T; t++) {
            size_t i = (size_t)r * b->T + t;
            if (b->inputs[i] < 0 || b->inputs[i] >= V)
                return QT_ERR(QT_EINVAL, "batch row %d position %d: token id %d is outside the vocabulary [0, %d)", r,
                              t, b->inputs[i], V);
            if (b->targets[i] != QT_IGNORE_INDEX && (b->targets[i] < 0 || b->targets[i] >= V))
                return QT_ERR(QT_EINVAL, "batch row %d position %d: label %d is outside the vocabulary [0, %d)", r, t,
                              b->targets[i], V);
            if (b->positions[i] < 0)
                return QT_ERR(QT_EINVAL, "batch row %d position %d: negative RoPE position %d", r, t, b->positions[i]);
            if (b->doc_start && (b->doc_start[i] < 0 || b->doc_start[i] > t))
                return QT_ERR(QT_EINVAL, "batch row %d position %d: doc_start %d is not in [0, %d]", r, t,
                              b->doc_start[i], t);
        }
    return QT_OK;
}

/* The batch's int32 arrays in device memory (m->ids), as the ops read them;
 * the host batch stays the caller's. */
static qt_batch upload_batch(qt_model *m, const qt_batch *b) {
    size_t N = (size_t)b->B * b->T, bytes = N * sizeof(int32_t);
    qt_batch d = *b;
    d.inputs = m->ids.inputs, d.targets = m->ids.targets, d.positions = m->ids.positions;
    d.doc_start = b->doc_start ? m->ids.doc_start : NULL;
    qt_be_upload(m->be, d.inputs, b->inputs, bytes);
    qt_be_upload(m->be, d.targets, b->targets, bytes);
    qt_be_upload(m->be, d.positions, b->positions, bytes);
    if (b->doc_start) qt_be_upload(m->be, d.doc_start, b->doc_start, bytes);
    /* the RoPE table of this forward (and its backward), from the host
     * positions: dynamic scaling looks at the largest one */
    int32_t mx = 0;
    for (size_t i = 0; i < N; i++) mx = b->positions[i] > mx ? b->positions[i] : mx;
    qt_model_rope_table(m, mx);
    return d;
}

/* ZeRO-3, after the lm_head's forward: what comes before the graph reads
 * buffer 2 again (outer_done's gap). The backward reads the lm_head next
 * (head_read), or the next forward's lookup follows (an eval: nothing in
 * between) unless the backward's layers come first (training) or the lookup
 * does not read it (modules_to_save's embedding). */
static int head_gap(const qt_model *m, int training, int head_read) {
    if (head_read || (!training && m->gout[0] != (size_t)-1)) return QT_OUTER_SLICED;
    return QT_OUTER_FREED;
}

/* dx_lm != NULL (training with a frozen lm_head): the lm_head's dx, scaled by
 * grad_scale, is added into dx_lm in the same walk as the loss. kept != NULL
 * (training a kept-logits model): the logits stay there for the backward.
 * gap: head_gap, for ZeRO-3's buffer 2 after the lm_head. */
static int run_forward(qt_model *m, const qt_batch *b, int dropout, float *dx_lm, float grad_scale, float *kept,
                       int gap) {
    const qt_config *c = &m->cfg;
    qt_backend *be = m->be;
    int N = b->B * b->T, C = c->hidden_size, L = c->num_hidden_layers;
    qt_act_ptrs *A = &m->acts;
    QT_TRY(outer_params(m, m->gout[0]));
    qt_be_embedding_forward(be, A->x[0], b->inputs, m->wte.p, m->wte.dt, N, C);
    outer_done(m, m->gout[0], QT_OUTER_FREED); /* the layers come before its next read */
    round_and_save(m, A->x[0], (size_t)N * C, A->x16 ? A->x16[0] : NULL);
    for (int l = 0; l < L; l++) {
        QT_TRY(layer_params(m, l, l + 1));
        layer_forward(m, l, b, N, A->x[l], A->x[l + 1], &A->layer[l], dropout, b->positions, NULL);
    }
    QT_TRY(outer_params(m, m->gout[1]));
    qt_be_rmsnorm_forward(be, A->lnf, A->rstdf, A->x[L], m->lnf_w, N, C, c->rms_norm_eps);
    round_to_compute(m, A->lnf, (size_t)N * C);
    infer_round(m, A->lnf, (size_t)N * C);
    if (dx_lm)
        qt_be_lmhead_ce_forward_dx(be, A->loss, A->lse, dx_lm, A->lnf, m->lm_head.p, m->lm_head.dt, b->targets, grad_scale, N,
                                C, c->vocab_size, m->ws);
    else if (kept)
        qt_be_lmhead_ce_forward_keep(be, A->loss, A->lse, kept, A->lnf, m->lm_head.p, m->lm_head.dt, b->targets, N, C,
                                  c->vocab_size, m->ws);
    else
        qt_be_lmhead_ce_forward(be, A->loss, A->lse, A->lnf, m->lm_head.p, m->lm_head.dt, b->targets, N, C, c->vocab_size,
                             m->ws);
    outer_done(m, m->gout[1], gap);
    return QT_OK;
}

int qt_model_forward_idle(qt_model *m) { /* an eval forward's gathers and frees, in its order */
    if (!m->pshard) return QT_OK;
    QT_TRY(outer_params(m, m->gout[0]));
    outer_done(m, m->gout[0], QT_OUTER_FREED);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) QT_TRY(layer_params(m, l, l + 1));
    QT_TRY(outer_params(m, m->gout[1]));
    outer_done(m, m->gout[1], head_gap(m, 0, 0));
    return QT_OK;
}

/* The per-token losses come down (N floats) and are summed on the host in
 * token order, against the host batch's targets. */
static void sum_loss(const qt_model *m, const qt_batch *b, double *loss_sum, int64_t *n_tokens, float *logp) {
    size_t N = (size_t)b->B * b->T;
    float *loss_host = m->loss_host;
    qt_be_download(m->be, loss_host, m->acts.loss, N * sizeof(float));
    double s = 0;
    int64_t n = 0;
    for (size_t i = 0; i < N; i++) {
        int lab = b->targets[i] != QT_IGNORE_INDEX;
        if (lab) s += loss_host[i], n++;
        if (logp) logp[i] = lab ? -loss_host[i] : 0.0f;
    }
    if (loss_sum) *loss_sum = s;
    if (n_tokens) *n_tokens = n;
}

int qt_model_forward(qt_model *m, const qt_batch *b, double *loss_sum, int64_t *n_tokens, float *logp) {
    QT_TRY(check_batch(m, b));
    qt_batch db = upload_batch(m, b);
    QT_TRY(run_forward(m, &db, 0, NULL, 0.0f, NULL, head_gap(m, 0, 0)));
    sum_loss(m, b, loss_sum, n_tokens, logp);
    return QT_OK;
}

/* The lm_head's backward one vocabulary slice at a time, each slice's weight
 * gradient handed over before the next is computed. A slice sees the targets
 * shifted into its rows, -1 where the target lies in another slice (that row
 * still gets its softmax gradient; the ignored rows keep QT_IGNORE_INDEX).
 * dx accumulates over the slices as over the op's own chunks. The shifted
 * targets are built from the host batch (hb) in pos_buf (host staging, the
 * decode's positions otherwise) and uploaded into the window block's targets. */
static int lmhead_backward_sliced(qt_model *m, const qt_batch *hb, float *dln, float grad_scale,
                                  const float *row_scale) {
    const qt_config *c = &m->cfg;
    qt_backend *be = m->be;
    qt_grad_win_state *gw = &m->grad_win;
    int N = hb->B * hb->T, T = hb->T, C = c->hidden_size, V = c->vocab_size, S = gw->plan.slice_rows;
    size_t base = m->lm_head_off; /* untied or modules_to_save: the last tensor; tied: the embedding, at 0 */
    size_t esz = qt_dtype_size(m->lm_head.dt);
    int32_t *ht = m->pos_buf;
    const int slices = m->pshard && m->gout[1] != (size_t)-1 && m->gkey[2] != (long long)m->gout[1];
    for (int v0 = 0, k = 0; v0 < V; v0 += S, k++) {
        int sv = V - v0 < S ? V - v0 : S;
        float *g = gw->slice[k % gw->plan.nwin];
        int32_t *tslice = gw->at.targets;
        QT_TRY(qt_grad_win_open(gw, g, (size_t)sv * C));
        for (int i = 0; i < N; i++) {
            int t = hb->targets[i];
            ht[i] = t == QT_IGNORE_INDEX ? t : (t >= v0 && t < v0 + sv) ? t - v0 : -1;
        }
        qt_be_upload(be, tslice, ht, sizeof(int32_t) * (size_t)N);
        const void *w = (const char *)m->lm_head.p + (size_t)v0 * C * esz;
        if (slices) QT_TRY(head_slice_params(m, v0, sv, &w)); /* ZeRO-3: the V x C buffer was freed */
        if (!row_scale)
            qt_be_lmhead_ce_backward(be, dln, g, m->acts.lnf, w, m->lm_head.dt, tslice, m->acts.lse, grad_scale, N,
                                   C, sv, m->ws);
        else /* one call per row, each with its sequence's weight (the slice's dW sums over them) */
            for (int r = 0; r < hb->B; r++)
                if (row_scale[r] != 0.0f)
                    qt_be_lmhead_ce_backward(be, dln + (size_t)r * T * C, g, m->acts.lnf + (size_t)r * T * C, w,
                                           m->lm_head.dt, tslice + (size_t)r * T, m->acts.lse + (size_t)r * T,
                                           row_scale[r], T, C, sv, m->ws);
        QT_TRY(qt_grad_win_ready(gw, base + (size_t)v0 * C, base + (size_t)(v0 + sv) * C, g));
    }
    if (slices) { /* transient: the plan never counts it beside the V x C buffer */
        qt_be_free(be, m->gslice);
        m->gslice = NULL;
    }
    return QT_OK;
}

/* row_fn NULL: every labelled token's loss weighs grad_scale. Else the
 * forward's per-token log-probs go to row_fn, which returns one weight per
 * row (preference objectives: one sequence per row); the lm_head's backward
 * then runs row by row with that weight as its scale (no fused forward + dx,
 * no kept logits: the weights are known only after the forward). */
static int forward_backward(qt_model *m, const qt_batch *b, float grad_scale, qt_row_weights_fn row_fn, void *user,
                            double *loss_sum, int64_t *n_tokens) {
    if (m->infer)
        return QT_ERR(QT_EINVAL, "this model was loaded for inference (no gradient buffers); load it with infer = 0 "
                                 "to train");
    QT_TRY(check_batch(m, b));
    qt_grad_win_state *gw = &m->grad_win;
    const int win = gw->block != NULL;
    if (win && !gw->hook.ready)
        return QT_ERR(QT_EINVAL, "this model was loaded with gradient windows (ZeRO-2) but no gradient hook is set; "
                                 "call qt_model_set_grad_hook first");
    const qt_batch *hb = b, db = upload_batch(m, hb);
    b = &db; /* the ops read the device copy; sum_loss the host's targets */
    qt_backend *be = m->be;
    const qt_config *c = &m->cfg;
    int N = b->B * b->T, C = c->hidden_size, L = c->num_hidden_layers;
    int dropout = m->opts.lora && m->opts.lora_dropout > 0.0f;
    qt_act_ptrs *A = &m->acts;
    float *dres = m->gs.dres, *dln = m->gs.dln;
    qt_be_zero(be, dln, sizeof(float) * (size_t)N * C); /* the forward does not use dln */
    /* frozen lm_head: dx comes out of the forward's walk (two (N, V) products, not three) */
    int fused = m->dlm_head == NULL && !row_fn;
    /* trainable lm_head: the logits kept from the forward when the plan has room */
    float *kept = !fused && !row_fn && qt_model_keeps_logits(c, &m->opts)
                      ? m->ws + qt_model_kept_logits_offset(c, &m->opts) : NULL;
    QT_TRY(run_forward(m, b, dropout, fused ? dln : NULL, grad_scale, kept, head_gap(m, 1, !fused)));
    float *row_scale = NULL, *logp = NULL;
    if (row_fn) {
        logp = qt_malloc(sizeof(float) * ((size_t)N + (size_t)b->B), "per-token log-probs");
        if (!logp) return QT_ENOMEM;
        row_scale = logp + N;
    }
    sum_loss(m, hb, loss_sum, n_tokens, logp);
    if (row_fn) {
        int rc = row_fn(user, logp, b->B, b->T, row_scale);
        if (rc != QT_OK) {
            qt_free(logp);
            return rc;
        }
    }

    qt_be_zero(be, dres, sizeof(float) * (size_t)N * C);
    /* ZeRO-3: the lm_head gathered again where its forward freed it, whole unless the sliced backward reads it a
     * slice at a time */
    int rc = fused || (win && m->dlm_head) ? QT_OK : outer_params(m, m->gout[1]);
    if (rc != QT_OK) {
        qt_free(logp);
        return rc;
    }
    if (win && m->dlm_head) {
        rc = lmhead_backward_sliced(m, hb, dln, grad_scale, row_scale);
        if (rc != QT_OK) {
            qt_free(logp);
            return rc;
        }
    } else if (row_fn) {
        for (int r = 0; r < b->B; r++)
            if (row_scale[r] != 0.0f)
                qt_be_lmhead_ce_backward(be, dln + (size_t)r * b->T * C, m->dlm_head, A->lnf + (size_t)r * b->T * C,
                                       m->lm_head.p, m->lm_head.dt, b->targets + (size_t)r * b->T,
                                       A->lse + (size_t)r * b->T, row_scale[r], b->T, C, c->vocab_size, m->ws);
    } else if (kept)
        qt_be_lmhead_ce_backward_kept(be, dln, m->dlm_head, kept, A->lnf, m->lm_head.p, m->lm_head.dt, b->targets, A->lse,
                                   grad_scale, N, C, c->vocab_size, m->ws);
    else if (!fused)
        qt_be_lmhead_ce_backward(be, dln, m->dlm_head, A->lnf, m->lm_head.p, m->lm_head.dt, b->targets, A->lse, grad_scale, N,
                              C, c->vocab_size, m->ws);
    qt_free(logp); /* row_scale with it: the lm_head's backward was their last use */
    if (!fused) outer_done(m, m->gout[1], QT_OUTER_FREED); /* the layers come before its next read */
    round_grad(m, dln, (size_t)N * C); /* in fp16 the first place a too-large loss scale overflows */
    size_t units = 0; /* layers with trainable tensors */
    for (int l = 0; l < L; l++) units += qt_model_layer_unit(&m->opts, l) >= 0;
    const size_t norm_lo = gw->plan.layer0 + units * gw->plan.layer; /* gradient windows: the final norm's place */
    if (win && m->dlnf_w) QT_TRY(qt_grad_win_open(gw, gw->at.norm, (size_t)C));
    qt_be_rmsnorm_backward(be, dres, m->dlnf_w, dln, A->x[L], m->lnf_w, A->rstdf, N, C);
    round_grad(m, dres, (size_t)N * C);
    if (win && m->dlnf_w) QT_TRY(qt_grad_win_ready(gw, norm_lo, norm_lo + (size_t)C, gw->at.norm));
    /* layers_to_transform: below the lowest adapted layer nothing is trainable (unless the embedding
     * is), so the backward stops there */
    int low = 0;
    while (!m->dwte && low < L - 1 && qt_model_layer_unit(&m->opts, low) < 0) low++;
    qt_grad_win_start(gw); /* no bucket of this backward opened yet */
    for (int l = L - 1; l >= low; l--) {
        QT_TRY(layer_params(m, l, l - 1 >= low ? l - 1 : -1)); /* ZeRO-3: gathered again (or still there) */
        acts_load(m, l, N); /* 2-byte storage: layer l's saved values back to fp32 */
        /* recompute: x[l+1] was consumed by layer l+1's backward, so it may be overwritten */
        if (m->opts.grad_checkpointing)
            layer_forward(m, l, b, N, A->x[l], A->x[l + 1], &A->layer[l], dropout, b->positions, NULL);
        /* each bucket is handed over as its last step is done, reduced while the backward goes on (a layer
         * layers_to_transform leaves out is in no bucket) */
        QT_TRY(layer_backward(m, l, b, N, A->x[l], &A->layer[l], dropout, l > low || m->dwte != NULL));
    }
    /* the hook reads the token ids on the host (hb), the row gradients (dres) on the device */
    if (m->dwte && win) QT_TRY(gw->hook.rows(gw->hook.user, 0, C, hb->inputs, dres, N));
    else if (m->dwte) qt_be_embedding_backward(be, m->dwte, dres, b->inputs, N, C);
    m->micro_step++;
    return QT_OK;
}

int qt_model_forward_backward(qt_model *m, const qt_batch *b, float grad_scale, double *loss_sum,
                              int64_t *n_tokens) {
    return forward_backward(m, b, grad_scale, NULL, NULL, loss_sum, n_tokens);
}

int qt_model_forward_backward_rows(qt_model *m, const qt_batch *b, qt_row_weights_fn fn, void *user,
                                   double *loss_sum, int64_t *n_tokens) {
    return forward_backward(m, b, 0.0f, fn, user, loss_sum, n_tokens);
}

void qt_model_set_adapter(qt_model *m, int on) { m->adapter_off = !on; }

/* ---- decoding with the KV cache ------------------------------------------------ */
void qt_model_decode_reset(qt_model *m) {
    for (int s = 0; m->kv_len && s < m->decode_seqs; s++) m->kv_len[s] = 0;
}

static int check_decode(const qt_model *m) {
    if (!m->infer || !m->kcache)
        return QT_ERR(QT_EINVAL, "decoding needs a model loaded for inference (opts.infer = 1) with a KV cache");
    return QT_OK;
}

static int check_position(const qt_model *m, int seq, int pos, int n) {
    if (pos < 0 || pos > m->kv_len[seq])
        return QT_ERR(QT_EINVAL, "decode: position %d of sequence %d is past its %d cached positions; decode in order "
                      "or start at 0", pos, seq, m->kv_len[seq]);
    if (pos + n > m->opts.max_T)
        return QT_ERR(QT_EINVAL, "decode: positions up to %d exceed the KV cache of %d; load with a larger max_T",
                      pos + n, m->opts.max_T);
    return QT_OK;
}

/* The n rows' ids and positions (m->pos_buf) go up, then the layers run. */
static void decode_layers(qt_model *m, const int32_t *ids, int n, int maxpos, const dec_rows *d) {
    const qt_config *c = &m->cfg;
    qt_backend *be = m->be;
    int32_t *dids = m->ids.inputs, *dpos = m->ids.positions;
    qt_be_upload(be, dids, ids, sizeof(int32_t) * (size_t)n);
    qt_be_upload(be, dpos, m->pos_buf, sizeof(int32_t) * (size_t)n);
    qt_model_rope_table(m, maxpos); /* the largest position of this call */
    qt_act_ptrs *A = &m->acts;
    qt_be_embedding_forward(be, A->x[0], dids, m->wte.p, m->wte.dt, n, c->hidden_size);
    for (int l = 0; l < c->num_hidden_layers; l++)
        layer_forward(m, l, NULL, n, A->x[l], A->x[l + 1], &A->layer[l], 0, dpos, d);
}

/* One decode call's layers and logits (decode_call), run with the backend's
 * threads held between its ops (qt_be_hold_threads) when it is a step of few
 * rows on the matrix-vector path: ~170 ops of tens of microseconds each,
 * where starting the threads for every op costs a few percent of the step
 * (docs/generate.md).
 * More rows (or a prompt, on the batched path) run as plain calls: their ops
 * are larger, and the backend's other ops would run on one thread while
 * the team is held (backend/cpu/team.h). */
#define DECODE_HOLD_MAX_ROWS 8
typedef struct {
    qt_model *m;
    const int32_t *ids;
    int n, maxpos;
    const dec_rows *d;
} decode_call;

static int decode_run(void *arg) {
    const decode_call *k = arg;
    qt_model *m = k->m;
    const qt_config *c = &m->cfg;
    /* one sequence's call: the logits of its last position; one row per sequence (dec_rows): every row's */
    const int C = c->hidden_size, L = c->num_hidden_layers, V = c->vocab_size, rows = m->dec_rows ? k->n : 1;
    qt_backend *be = m->be;
    qt_act_ptrs *A = &m->acts;
    decode_layers(m, k->ids, k->n, k->maxpos, k->d);
    qt_be_rmsnorm_forward(be, A->lnf, A->rstdf, A->x[L] + (size_t)(k->n - rows) * C, m->lnf_w, rows, C,
                        c->rms_norm_eps);
    infer_round(m, A->lnf, (size_t)rows * C);
    qt_be_matvec(be, m->logits, A->lnf, m->lm_head.p, m->lm_head.dt, NULL, rows, C, V, 1.0f, 0); /* V x C read once */
    return QT_OK;
}

static void decode_call_run(qt_model *m, const decode_call *k) {
    if (decoding(m, k->n) && k->n <= DECODE_HOLD_MAX_ROWS) qt_be_hold_threads(m->be, decode_run, (void *)k);
    else decode_run((void *)k);
}

int qt_model_decode_seq(qt_model *m, int seq, const int32_t *ids, int n, int pos0, float *logits_out) {
    const qt_config *c = &m->cfg;
    const int V = c->vocab_size;
    QT_TRY(check_decode(m));
    if (seq < 0 || seq >= m->decode_seqs)
        return QT_ERR(QT_EINVAL, "decode: sequence %d is outside the KV cache's [0, %d)", seq, m->decode_seqs);
    if (n < 1 || (size_t)n > (size_t)m->opts.max_B * m->opts.max_T)
        return QT_ERR(QT_EINVAL, "decode: %d tokens at once is outside [1, %d]", n, m->opts.max_B * m->opts.max_T);
    QT_TRY(check_position(m, seq, pos0, n));
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= V)
            return QT_ERR(QT_EINVAL, "decode: token id %d is outside the vocabulary [0, %d)", ids[i], V);
        m->pos_buf[i] = pos0 + i;
    }
    const dec_rows d = {seq, pos0, NULL, NULL, 0};
    const decode_call k = {m, ids, n, pos0 + n - 1, &d};
    decode_call_run(m, &k);
    qt_be_download(m->be, logits_out, m->logits, sizeof(float) * (size_t)V);
    m->kv_len[seq] = pos0 + n;
    return QT_OK;
}

int qt_model_decode(qt_model *m, const int32_t *ids, int n, int pos0, float *logits_out) {
    return qt_model_decode_seq(m, 0, ids, n, pos0, logits_out);
}

int qt_model_decode_rows(qt_model *m, int n, const int *seqs, const int32_t *ids, const int32_t *pos,
                         float *logits_out) {
    const qt_config *c = &m->cfg;
    const int V = c->vocab_size;
    QT_TRY(check_decode(m));
    if (n < 1 || n > m->decode_seqs)
        return QT_ERR(QT_EINVAL, "decode: %d sequences in one step is outside [1, %d] (the model's decode_seqs)", n,
                      m->decode_seqs);
    int maxpos = 0;
    for (int i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= m->decode_seqs)
            return QT_ERR(QT_EINVAL, "decode: sequence %d is outside the KV cache's [0, %d)", seqs[i], m->decode_seqs);
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i])
                return QT_ERR(QT_EINVAL, "decode: sequence %d appears twice in one step; give each once", seqs[i]);
        QT_TRY(check_position(m, seqs[i], pos[i], 1));
        if (ids[i] < 0 || ids[i] >= V)
            return QT_ERR(QT_EINVAL, "decode: token id %d is outside the vocabulary [0, %d)", ids[i], V);
        m->pos_buf[i] = pos[i];
        if (pos[i] > maxpos) maxpos = pos[i];
    }
    dec_rows d = {0, 0, seqs, pos, 0};
    int minpos = maxpos;
    for (int i = 0; i < n; i++) minpos = pos[i] < minpos ? pos[i] : minpos;
    if (minpos < maxpos) { /* one table serves every row only when the lowest and highest positions share it */
        float lo[QT_ROPE_MAX_HALF], hi[QT_ROPE_MAX_HALF], slo, shi;
        qt_rope_inv_freq(c, c->head_dim, minpos, lo, &slo);
        qt_rope_inv_freq(c, c->head_dim, maxpos, hi, &shi);
        d.rope_per_row = slo != shi || memcmp(lo, hi, sizeof(float) * (size_t)(c->head_dim / 2));
    }
    m->dec_rows = 1;
    const decode_call k = {m, ids, n, maxpos, &d};
    decode_call_run(m, &k);
    m->dec_rows = 0;
    qt_be_download(m->be, logits_out, m->logits, sizeof(float) * (size_t)n * V);
    for (int i = 0; i < n; i++) m->kv_len[seqs[i]] = pos[i] + 1;
    return QT_OK;
}
