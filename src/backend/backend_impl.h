/* For implementers of a backend: the table (struct qt_backend, below), what
 * every slot must do, and how a backend declares its table. The model, the
 * optimizer and the rest include backend.h only and call qt_be_NAME, which
 * forwards to slot NAME (calls.c); a backend's folder includes this too.
 *
 * A backend is one read-only table, written once with a name beside every
 * slot (ggml's `static const struct ggml_backend_i` form):
 *
 *     const qt_backend qt_backend_cpu_i = {
 *         .desc = &qt_cpu_desc,
 *         .alloc = c_alloc,
 *         ...
 *     };
 *
 * and its open copies the table into the instance it returns (the instance's
 * impl is the backend's own state). No slot is optional: unit/test_backend
 * walks every backend's table (QT_BACKEND_SLOTS below) for an empty one.
 *
 * The ops' contract, stated once here for every backend:
 *  - Dimension letters: B batch, T sequence, N = B*T rows, C hidden, H heads,
 *    KV kv heads, D head dim, I intermediate, V vocab, IN/OUT a matmul's
 *    sides. Activations are flat fp32, row-major in the order the letters
 *    are written: q (B, T, H, D) is B*T*H*D floats.
 *  - Every backward ADDS into its gradient outputs (dinp, dweight, dbias ...)
 *    with `+=`; callers zero them. So the residual stream's gradient and
 *    accumulation across micro-batches come for free.
 *  - Weights that may be frozen (matmul matrices, the embedding table, the
 *    lm_head) are passed as (pointer, qt_dtype): f32, f16 or bf16 as stored in
 *    the file. A kernel converts what it reads (a panel of rows into ws), so
 *    a frozen base never needs an fp32 copy. Weight gradients exist only for
 *    f32 master weights (pass NULL otherwise).
 *  - Small vectors (norm weights, biases) are always f32.
 *  - ws arguments are caller-owned scratch of at least the size backend.h's
 *    formulas over the descriptor give (qt_be_matmul_ws_floats,
 *    qt_be_lmhead_ce_ws_floats); a backend sizes its own kernels' use of ws
 *    from the same descriptor fields.
 *  - All pointers an op receives are device pointers (the int32 ids, targets,
 *    positions and doc_start of a batch too) unless the entry says host.
 *  - Calls are ordered (one stream): each sees the effects of the calls before
 *    it; sync waits for all of them.
 *  - Deterministic: the same inputs give the same bits on every run (no
 *    atomics in a reduction that ends in a gradient).
 *
 * Each op, in backend.h's order (the shapes beside the entries there):
 *  embedding_forward   out (N, C) = wte[ids[n]]; wte (V, C); ids in [0, V).
 *  embedding_backward  dwte (V, C) += dout rows scattered by ids.
 *  rmsnorm_forward     HF Qwen2RMSNorm: out = w * x / sqrt(mean(x^2) + eps);
 *                      rstd (N) saved for the backward; out may not alias inp.
 *  rmsnorm_backward    dinp (N, C) +=, dweight (C) += (NULL when frozen).
 *  matmul_forward      out (N, OUT) = alpha * inp (N, IN) @ W^T + bias, W
 *                      (OUT, IN), bias (OUT) or NULL; accumulate: out += that.
 *  matmul_backward     dinp (N, IN) += alpha * dout @ W (NULL: skip); dweight
 *                      (OUT, IN) += alpha * dout^T @ inp (NULL when frozen);
 *                      dbias (OUT) += alpha * column sums of dout.
 *  rope_*              HF rotate-half on x (N, NH, D), see backend.h.
 *  attention_forward   causal grouped-query attention, q (B, T, H, D), k, v
 *                      (B, T, KV, D), out (B, T, H, D), lse (B, H, T) the
 *                      log-sum-exp of the scaled scores, saved. Query t of
 *                      row b attends to keys [doc_start[b*T+t], t]
 *                      (doc_start NULL: [0, t]); no T x T matrix is formed.
 *  attention_backward  dq (B, T, H, D) +=, dk, dv (B, T, KV, D) +=, the
 *                      probabilities recomputed from lse.
 *  attention_forward_cached  n queries q (n, H, D) at positions pos0 ..
 *                      pos0+n-1 attend to kc, vc (S, KV, D) rows [0, pos0+i]
 *                      (the cache already holds them).
 *  swiglu_*            out (N, I) = silu(gate) * up, and its gradients +=.
 *  lmhead_ce_forward   the fused lm_head + cross-entropy: logits (N, V) = x
 *                      (N, C) @ W^T are never held whole; the vocabulary is
 *                      walked in chunks of desc->ce_chunk with an online
 *                      log-sum-exp. Rows with targets[n] != QT_IGNORE_INDEX
 *                      (core/label.h): loss[n] = lse[n] - logit[n][target];
 *                      else loss[n] = 0. lse (N) is saved for the backward.
 *  lmhead_ce_backward  gradients of sum_n dscale * loss[n] over labelled
 *                      rows: dx (N, C) +=, dw (V, C) += (NULL when frozen),
 *                      the logits recomputed chunk by chunk.
 *  lmhead_ce_forward_keep / _backward_kept  the same with the chunks'
 *                      exp(logit - m) kept (m each chunk's running row max),
 *                      qt_be_lmhead_ce_kept_floats(N, V) floats: chunk k's
 *                      (N, cv) block at N * k * ce_chunk, then the (nchunks,
 *                      N) maxima. The backward consumes kept (it becomes
 *                      dlogits); gradients equal lmhead_ce_backward's to fp32
 *                      rounding.
 *  lmhead_ce_forward_dx  loss and lse as lmhead_ce_forward, and dx += what
 *                      lmhead_ce_backward with dw = NULL would add, in one
 *                      walk over the vocabulary (a frozen lm_head).
 *  round_to_dtype      x (n) rounded in place to the nearest value dt holds,
 *                      exactly as a store to f16/bf16 and a load back: f16
 *                      round to nearest even, |x| >= 65520 becomes +-inf (so
 *                      a too-large loss scale shows as inf gradients), tiny
 *                      values to subnormals / zero; bf16 round to nearest
 *                      even on the top 16 bits, NaN stays NaN; f32 nothing.
 *  round_store         the same rounding, and the values' 2-byte patterns
 *                      written to dst (n) in the same pass (dt f16 or bf16).
 *  convert             dst (n, ddt) = src (n, sdt), through f32; values
 *                      beyond fp16's range become inf; to f32 it is exact.
 *  half_matmul         out (N, OUT) = alpha * inp (N, IN) @ W^T + bias, inp
 *                      and W 16-bit patterns of dt, fp32 accumulation; bias
 *                      only with alpha 1.
 *  half_gemm           C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) [+ bias]
 *                      [+ C when acc]: A stored (M, K), or with ta (K, M) read
 *                      transposed; B stored (K, N), or with tb (N, K).
 *                      Both return QT_EUNSUPPORTED with the output untouched
 *                      where they cannot run it (the model then takes the
 *                      fp32 op).
 *  the rest            as their comments in backend.h say. */
#ifndef QT_BACKEND_BACKEND_IMPL_H
#define QT_BACKEND_BACKEND_IMPL_H

#include <stddef.h>

#include "backend/backend.h"

/* The table: one slot for each qt_be_NAME of backend.h, the same parameters (the meaning of each is written
 * there, beside its prototype, and in the contract above). */
struct qt_backend {
    const qt_backend_desc *desc;
    void *impl; /* the backend's own state */

    /* memory */
    void *(*alloc)(qt_backend *be, qt_mem_place place, size_t bytes, const char *what);
    void (*free)(qt_backend *be, void *p);
    int (*import_mapped)(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what);
    void (*release_mapped)(qt_backend *be, const void *dev);
    void (*upload)(qt_backend *be, void *dev, const void *host, size_t bytes);
    void (*download)(qt_backend *be, void *host, const void *dev, size_t bytes);
    void (*copy)(qt_backend *be, void *dst, const void *src, size_t bytes);
    void (*zero)(qt_backend *be, void *dev, size_t bytes);
    void (*sync)(qt_backend *be);
    qt_event *(*event_record)(qt_backend *be);
    void (*event_wait)(qt_backend *be, qt_event *e);
    void (*event_free)(qt_backend *be, qt_event *e);

    /* the model's ops (each one's contract above) */
    void (*embedding_forward)(qt_backend *be, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N,
                              int C);
    void (*embedding_backward)(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C);
    void (*rmsnorm_forward)(qt_backend *be, float *out, float *rstd, const float *inp, const float *weight, int N,
                            int C, float eps);
    void (*rmsnorm_backward)(qt_backend *be, float *dinp, float *dweight, const float *dout, const float *inp,
                             const float *weight, const float *rstd, int N, int C);
    void (*matmul_forward)(qt_backend *be, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias,
                           int N, int IN, int OUT, float alpha, int accumulate, float *ws);
    void (*matmul_backward)(qt_backend *be, float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha,
                            float *ws);
    void (*matvec)(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
                   int IN, int OUT, float alpha, int accumulate);
    void (*matvec_many)(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o);
    void (*rope_forward)(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                         float scale);
    void (*rope_backward)(qt_backend *be, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                          float scale);
    void (*attention_forward)(qt_backend *be, float *out, float *lse, const float *q, const float *k, const float *v,
                              const int32_t *doc_start, int B, int T, int H, int KV, int D);
    void (*attention_backward)(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
                               const float *lse, const float *q, const float *k, const float *v,
                               const int32_t *doc_start, int B, int T, int H, int KV, int D);
    void (*attention_forward_cached)(qt_backend *be, float *out, const float *q, const float *kc, const float *vc,
                                     int n, int pos0, int H, int KV, int D);
    void (*swiglu_forward)(qt_backend *be, float *out, const float *gate, const float *up, int N, int I);
    void (*swiglu_backward)(qt_backend *be, float *dgate, float *dup, const float *dout, const float *gate,
                            const float *up, int N, int I);
    void (*lmhead_ce_forward)(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                              const int32_t *targets, int N, int C, int V, float *ws);
    void (*lmhead_ce_backward)(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                               const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws);
    void (*lmhead_ce_forward_keep)(qt_backend *be, float *loss, float *lse, float *kept, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws);
    void (*lmhead_ce_backward_kept)(qt_backend *be, float *dx, float *dw, float *kept, const float *x, const void *w,
                                    qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N, int C,
                                    int V, float *ws);
    void (*lmhead_ce_forward_dx)(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
                                 qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V, float *ws);
    void (*acc)(qt_backend *be, float *out, const float *a, size_t n);
    int (*hold_threads)(qt_backend *be, int (*fn)(void *arg), void *arg);

    /* precision (the rounding each does: above) */
    void (*round_to_dtype)(qt_backend *be, float *x, size_t n, qt_dtype dt);
    void (*round_store)(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt);
    void (*convert)(qt_backend *be, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n);
    int (*half_available)(qt_backend *be, qt_dtype dt);
    int (*half_matmul)(qt_backend *be, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w,
                       const float *bias, int N, int IN, int OUT, float alpha);
    int (*half_gemm)(qt_backend *be, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                     const float *bias, int M, int N, int K, float alpha, int acc);

    /* LoRA dropout */
    void (*dropout)(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
                    uint32_t threshold, float keep_scale);

    /* optimizer, clipping, loss scaler */
    int (*adam)(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n);
    double (*sum_squares)(qt_backend *be, const float *x, size_t n);
    void (*scale)(qt_backend *be, float *x, size_t n, float s);

    /* facts only the running backend knows */
    size_t (*runtime_bytes)(qt_backend *be);
    size_t (*device_peak_bytes)(qt_backend *be);
    void (*close)(qt_backend *be);
};

/* Every function slot of qt_backend, in its order: X(name) each. A new slot
 * is added here too (test_backend checks the count against the struct). */
#define QT_BACKEND_SLOTS(X)                                                                                    \
    X(alloc) X(free) X(import_mapped) X(release_mapped) X(upload) X(download) X(copy) X(zero) X(sync)        \
    X(event_record) X(event_wait) X(event_free)                                                               \
    X(embedding_forward) X(embedding_backward) X(rmsnorm_forward) X(rmsnorm_backward) X(matmul_forward)       \
    X(matmul_backward) X(matvec) X(matvec_many) X(rope_forward) X(rope_backward) X(attention_forward)         \
    X(attention_backward) X(attention_forward_cached) X(swiglu_forward) X(swiglu_backward)                    \
    X(lmhead_ce_forward) X(lmhead_ce_backward) X(lmhead_ce_forward_keep) X(lmhead_ce_backward_kept)           \
    X(lmhead_ce_forward_dx) X(acc) X(hold_threads)                                                            \
    X(round_to_dtype) X(round_store) X(convert) X(half_available) X(half_matmul) X(half_gemm)                  \
    X(dropout) X(adam) X(sum_squares) X(scale) X(runtime_bytes) X(device_peak_bytes) X(close)

/* The name of the first empty slot of table t (desc counts as one), NULL
 * when every slot is filled. */
const char *qt_backend_empty_slot(const qt_backend *t);

/* QTUNE_PROFILE's decorator (profile.c): a table that times every op of in,
 * and closes in when it closes. */
int qt_backend_profile_wrap(qt_backend *in, qt_backend **out);

#endif
