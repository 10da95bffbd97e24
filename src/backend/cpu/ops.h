/* The CPU's kernels: forward/backward pairs over flat fp32 activations, on
 * OpenBLAS (cblas_sgemm) and OpenMP. backend_cpu.c's table calls them, one
 * op_<slot> per slot of backend.h's table; the contract each keeps (shapes,
 * `+=` gradients, (pointer, dtype) weights, workspaces) is backend_impl.h's,
 * and the guard backend runs these same kernels. What is said below is what
 * is particular to the CPU: its workspace constants and formulas, the held
 * thread team (team.h), the sgemm helpers. */
#ifndef QT_BACKEND_CPU_OPS_H
#define QT_BACKEND_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "backend/cpu/team.h"
#include "core/dtype.h"

/* ---- embedding ---------------------------------------------------------- */
/* out (N, C) = wte[ids[n]]; wte (V, C) in wdt. ids must be in [0, V). */
void op_embedding_forward(float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C);
/* dwte (V, C) += dout rows scattered by ids (f32 master only). */
void op_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int N, int C);

/* ---- rmsnorm (HF Qwen2RMSNorm: w * x / sqrt(mean(x^2) + eps)) ------------- */
/* out (N, C), rstd (N) saved for backward; weight (C). out may not alias inp. */
void op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps);
/* dinp (N, C) +=, dweight (C) += (NULL when frozen). */
void op_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         const float *rstd, int N, int C);

/* ---- matmul with bias: out (N, OUT) = inp (N, IN) @ W^T + bias ------------ */
/* W (OUT, IN) in wdt; bias (OUT) f32 or NULL. out = alpha*(inp@W^T) + bias,
 * or with accumulate != 0, out += alpha*(inp@W^T) + bias. */
#define OP_MATMUL_WS_CAP ((size_t)1 << 21) /* floats of converted weight panels a matmul uses at most */
size_t op_matmul_ws_floats(int IN, int OUT);
void op_matmul_forward(float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                       int OUT, float alpha, int accumulate, float *ws);
/* x (n) as bf16 into x16 when the bf16 GEMM runs here (AVX512_BF16, not
 * switched off) and every x[i] is a bf16 value: 1, else 0 (x16 untouched).
 * The operand test of the bf16 paths (op_matmul.c, op_lmhead_ce.c). */
int op_bf16_operand(const float *x, size_t n, uint16_t *x16);
/* dinp (N, IN) += alpha * dout @ W (NULL to skip); dweight (OUT, IN) += alpha * dout^T @ inp
 * (NULL when frozen; W must then be f32 master); dbias (OUT) += alpha * column sums of dout. */
void op_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const void *w,
                        qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws);

/* ---- matrix-vector product (decoding, op_matvec.c) ---------------------- */
/* out (N, OUT) = alpha * x (N, IN) @ W^T + bias, or out += that with
 * accumulate != 0, for a few rows N (one per sequence of a decode step). W
 * (OUT, IN) in wdt is read once for all N rows, in its stored dtype (f16/bf16
 * widened in registers); threads take chunks of output rows. Each output
 * element is bit-identical whatever N, the row's place among them and the
 * thread count. No workspace. */
void op_matvec(float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN, int OUT,
               float alpha, int accumulate);
/* ... on a held team's threads (team.h; NULL: op_matvec) */
void op_matvec_team(op_team *team, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
                    int IN, int OUT, float alpha, int accumulate);
/* backend.h's matvec_many: the products o[0 .. count-1] of x as one job,
 * whose chunks run across the products' boundaries (op_matvec.c) */
void op_matvec_many(op_team *team, const float *x, int N, int IN, int count, const qt_matvec_out *o);

/* ---- rotary embedding (HF rotate-half convention) ------------------------ */
/* x (N, NH, D) rotated in place by angle pos[n] * inv[i], i < D/2 (inv: the
 * model's table, qt_rope_inv_freq), cos and sin multiplied by scale:
 * x[i] <- x[i] cos - x[i+D/2] sin, x[i+D/2] <- x[i+D/2] cos + x[i] sin. */
void op_rope_forward(float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale);
/* The transpose rotation, in place on the gradient (dx = R^T dout). */
void op_rope_backward(float *dx, const int32_t *pos, int N, int NH, int D, const float *inv, float scale);

/* ---- causal grouped-query attention, blockwise with online softmax -------- */
/* q (B, T, H, D), k, v (B, T, KV, D), out (B, T, H, D), lse (B, H, T) saved
 * log-sum-exp of the scaled scores. Query t of row b attends to keys
 * [doc_start[b*T+t], t] (doc_start NULL: [0, t]). No T x T matrix is formed:
 * keys are visited in blocks with a running max and sum (flash-style). */
void op_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int B, int T, int H, int KV, int D);
/* dq (B,T,H,D) +=, dk, dv (B,T,KV,D) +=; recomputes probabilities from lse. */
void op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, const int32_t *doc_start, int B, int T,
                           int H, int KV, int D);
/* Decoding against a cache: n queries q (n, H, D) at positions pos0 .. pos0+n-1
 * attend to kc, vc (S, KV, D) rows [0, pos0+i] (the cache already holds them). */
void op_attention_forward_cached(float *out, const float *q, const float *kc, const float *vc, int n, int pos0,
                                 int H, int KV, int D);
/* ... on a held team's threads (team.h; NULL: op_attention_forward_cached) */
void op_attention_forward_cached_team(op_team *team, float *out, const float *q, const float *kc, const float *vc,
                                      int n, int pos0, int H, int KV, int D);

/* ---- SwiGLU: out = silu(gate) * up ------------------------------------------ */
void op_swiglu_forward(float *out, const float *gate, const float *up, int N, int I);
void op_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int I);

/* ---- fused lm_head + cross-entropy over vocabulary chunks ------------------ */
/* Logits (N, V) = x (N, C) @ W^T are never held whole: the vocabulary is
 * walked in chunks of OP_CE_CHUNK with an online log-sum-exp. For rows with
 * targets[n] != QT_IGNORE_INDEX: loss[n] = lse[n] - logit[n][target]; else
 * loss[n] = 0. lse (N) is saved for the backward. */
#define OP_CE_CHUNK 2048
size_t op_lmhead_ce_ws_floats(int N, int C);
void op_lmhead_ce_forward(float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                          const int32_t *targets, int N, int C, int V, float *ws);
/* Gradients of sum_n dscale * loss[n] (labelled rows): dx (N, C) +=,
 * dw (V, C) += (NULL when frozen). Logits are recomputed chunk by chunk. */
void op_lmhead_ce_backward(float *dx, float *dw, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
                           const float *lse, float dscale, int N, int C, int V, float *ws);

/* Kept logits (a trainable lm_head when the buffer fits, see memplan.c): the
 * forward stores each chunk's exp(logit - m) with m that chunk's running row
 * max, so the backward needs no logits GEMM and no exp pass: it scales each
 * (row, chunk) by dscale * exp(m - lse), subtracts the one-hot and runs the dx
 * and dw products. kept holds op_lmhead_ce_kept_floats(N, V) floats: chunk k's
 * (N, cv) block at N * k * OP_CE_CHUNK, then the (nchunks, N) maxima. The
 * backward consumes kept (it becomes dlogits). Same loss and lse as
 * op_lmhead_ce_forward; gradients equal op_lmhead_ce_backward's to fp32
 * rounding (exp(l - m) * exp(m - lse) for exp(l - lse)). */
size_t op_lmhead_ce_kept_floats(int N, int V);
void op_lmhead_ce_forward_keep(float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt,
                               const int32_t *targets, int N, int C, int V, float *ws);
void op_lmhead_ce_backward_kept(float *dx, float *dw, float *kept, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                float *ws);

/* Forward and dx together for a frozen lm_head (one walk over the vocabulary,
 * two sgemm per chunk instead of three over a forward + backward): loss, lse
 * as op_lmhead_ce_forward, and dx (N, C) += the gradient of sum_n dscale *
 * loss[n], as op_lmhead_ce_backward with dw = NULL would add. */
void op_lmhead_ce_forward_dx(float *loss, float *lse, float *dx, const float *x, const void *w, qt_dtype wdt,
                             const int32_t *targets, float dscale, int N, int C, int V, float *ws);

/* ---- ops too small to share out ---------------------------------------------
 * A training step on a tiny shape (the test preset: 1024 rows of 64) is a few
 * hundred ops of tens of microseconds each. Shared between 2 threads such a
 * product runs no faster than on one (QTUNE_PROFILE; bench/RESULTS.md has the
 * figures), while every region adds its fork and join and a spinning second
 * thread, so 2 threads were slower than 1. Products below
 * OP_SERIAL_FLOPS, and the rmsnorm backward and the bf16 operand passes below
 * OP_SERIAL_ELEMS, run on the calling thread. Of the bench-tiny and 0.5B
 * shapes only the LoRA rank-8 products fall below (a few MFLOP each).
 * At 1 thread nothing changes. At 2 such a product is one OpenBLAS call
 * instead of one per half (unit/test_ops: the same bits as 1 thread on the
 * tiny shapes); whole tiny runs at 2 threads can end in other last bits than
 * with every product shared, as 1 and 2 threads already did. */
#define OP_SERIAL_FLOPS ((double)(1 << 25)) /* 2 * N * IN * OUT */
#define OP_SERIAL_ELEMS ((size_t)1 << 17) /* the 0.5B shape's 256 x 896 rows stay shared */
static inline int op_product_team(int N, int IN, int OUT, int team) {
    return 2.0 * (double)N * (double)IN * (double)OUT < OP_SERIAL_FLOPS ? 1 : team;
}

/* ---- small helpers --------------------------------------------------------- */
void op_add(float *out, const float *a, const float *b, size_t n); /* out = a + b (out may alias) */
void op_acc(float *out, const float *a, size_t n);                  /* out += a */
/* Converts rows [r0, r1) of a (rows, cols) matrix in dtype to f32 dst
 * (OpenMP-parallel; the _serial form for use inside a parallel region). */
void op_convert_rows(float *dst, const void *src, qt_dtype dt, size_t r0, size_t r1, size_t cols);
void op_convert_rows_serial(float *dst, const void *src, qt_dtype dt, size_t r0, size_t r1, size_t cols);
/* OpenBLAS single-threaded: every op parallelises with OpenMP and calls one
 * sgemm per thread (see op_matmul.c). Idempotent; the matmul and lm_head ops
 * call it themselves. */
void op_blas_init(void);
/* C (M, N) = alpha * A (M, K) @ B (K, N) + beta * C, row-major, neither
 * operand transposed (_nn: the input-gradient products of the linear layers
 * and the lm_head), or with A stored (K, M) and read transposed (_tn: the
 * linear layers' weight gradients). oneDNN's sgemm where the library loads
 * and the product is not small, OpenBLAS's otherwise; single-threaded inside
 * an OpenMP region, like every sgemm here. The lm_head's weight gradient
 * calls OpenBLAS itself: oneDNN ran its shape at 60% of OpenBLAS's rate.
 * QTUNE_SGEMM=openblas in the environment (read at the first op) keeps both
 * on OpenBLAS; op_sgemm_use_onednn switches them (tests, benchmarks),
 * op_sgemm_onednn says which is in use. */
void op_sgemm_nn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc);
void op_sgemm_tn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc);
void op_sgemm_use_onednn(int on);
int op_sgemm_onednn(void);
/* ---- whole-block passes (op_optim.c), behind backend.h's adam / sum_squares
 * / scale / dropout ------------------------------------------------------ */
int op_adam(const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n); /* 1: every p finite */
double op_sum_squares(const float *x, size_t n); /* same bits for any thread count */
void op_scale(float *x, size_t n, float s);
void op_dropout(float *dst, const float *src, size_t n, const qt_dropout_key *key, uint32_t threshold,
                float keep_scale);

/* [a, b): part id of n items split into `parts` blocks, aligned to `align`. */
void op_split(int n, int parts, int id, int align, int *a, int *b);

#endif
