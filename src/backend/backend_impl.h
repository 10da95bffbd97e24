/* For implementers of a backend: what every entry of backend.h's table must
 * do, and how a backend declares its table. The model, the optimizer and
 * the rest include backend.h only; a backend's folder includes this too.
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
