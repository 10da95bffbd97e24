/* Matmul with bias, out (N, OUT) = inp (N, IN) @ W^T + bias, W (OUT, IN) as
 * nn.Linear stores it. Most of a step's time is spent here.
 *
 * Threading: OpenBLAS runs single-threaded (op_blas_init) and OpenMP splits
 * each product into independent blocks, one sgemm per thread. With OpenBLAS's
 * own pool and OpenMP's both spinning on the same cores, every switch between
 * a BLAS call and an OpenMP loop cost milliseconds (bench/RESULTS.md, "Figures
 * that stood in code comments"); one pool avoids that.
 *
 * f16/bf16 and 4-bit weights (a frozen base kept in its file dtype, or
 * quantized: QT_Q4, dequantized here) are converted to f32
 * a panel of rows at a time into the workspace, each thread converting only
 * the rows (or, in the backward, the columns) it multiplies, so no fp32 copy
 * of the base is ever made. bf16-valued weights times a bf16-exact operand
 * run on oneDNN's bf16 GEMM instead where the CPU has it (forward_bf16,
 * dinp_bf16 below; docs/precision.md).
 *
 * The input-gradient products (dout @ W, no operand transposed) go through
 * op_sgemm_nn and the weight gradients (dout^T @ inp) through op_sgemm_tn:
 * oneDNN's sgemm where it loads, which ran them faster than OpenBLAS on
 * AVX-512 (bench/RESULTS.md); the forward's products stay on OpenBLAS, which
 * was as fast or faster there. */
#include "backend/cpu/ops.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/op_dnnl.h"
#include "core/quant4.h"
#include "core/error.h"
#include "core/log.h"

/* The workspace holds up to 2M floats (8 MiB) of converted weights; each
 * thread gets at least 16 rows' worth, which caps the team for wide inputs. */
#define MATMUL_WS_FLOATS OP_MATMUL_WS_CAP
#define MATMUL_MIN_ROWS 16

/* Which library op_sgemm_nn / op_sgemm_tn use: -1 not chosen yet, 0 OpenBLAS, 1 oneDNN. */
static int use_onednn = -1;

void op_blas_init(void) {
    static int done;
    if (!done) openblas_set_num_threads(1), done = 1;
    if (use_onednn < 0) {
        const char *e = getenv("QTUNE_SGEMM");
        int want = 1;
        if (e && !strcmp(e, "openblas"))
            want = 0;
        else if (e && *e && strcmp(e, "auto") && strcmp(e, "onednn"))
            qt_warn("QTUNE_SGEMM=%s is not one of auto, onednn, openblas; using auto", e);
        use_onednn = want && op_dnnl_sgemm_available();
    }
}

void op_sgemm_use_onednn(int on) {
    op_blas_init();
    use_onednn = on && op_dnnl_sgemm_available();
}

int op_sgemm_onednn(void) {
    op_blas_init();
    return use_onednn;
}

/* Below these sizes (LoRA's rank-8 products, attention's 64-wide blocks)
 * OpenBLAS's small-matrix kernels are used either way. */
#define ONEDNN_MIN_DIM 128

/* op(A) @ B with op(A) = A (ta 0) or A^T (ta 1): on oneDNN when it is in use
 * and the product is wide enough (big), else, or if oneDNN refuses, OpenBLAS. */
static void sgemm_xn(int ta, int big, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
    if (use_onednn > 0 && big &&
        op_dnnl_sgemm(ta ? 'T' : 'N', 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == QT_OK)
        return;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
}

void op_sgemm_nn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    sgemm_xn(0, N >= ONEDNN_MIN_DIM && K >= ONEDNN_MIN_DIM, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void op_sgemm_tn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    sgemm_xn(1, M >= ONEDNN_MIN_DIM && N >= ONEDNN_MIN_DIM, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

size_t op_matmul_ws_floats(int IN, int OUT) {
    size_t full = (size_t)IN * (size_t)OUT, ws = full < MATMUL_WS_FLOATS ? full : MATMUL_WS_FLOATS;
    return ws > (size_t)IN ? ws : (size_t)IN;
}

/* Threads that may share the workspace of a converted (IN, OUT) weight. */
static int half_team(int IN, int OUT) {
    size_t t = op_matmul_ws_floats(IN, OUT) / ((size_t)MATMUL_MIN_ROWS * (size_t)IN);
    size_t mx = (size_t)omp_get_max_threads();
    return (int)(t < 1 ? 1 : t > mx ? mx : t);
}

void op_split(int n, int parts, int id, int align, int *a, int *b) {
    int per = (n + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    *a = id * per < n ? id * per : n;
    *b = *a + per < n ? *a + per : n;
}

/* ---- bf16 weights on oneDNN's bf16 GEMM ------------------------------------
 * A bf16 weight, or a 4-bit one whose values dequantize to bf16, times an
 * fp32 operand (the input forward, dout in the backward's dinp) whose every
 * value is a bf16 value (its low 16 bits zero: bf16 training rounded it with
 * keep(), inference rounded it before the product, qwen2.c) runs on the bf16
 * GEMM: the products of two bf16 values are exact in fp32, so only the
 * summation order differs from sgemm on the same values (the PyTorch
 * reference's bf16 matmul: bf16 inputs, fp32 accumulation). Any other operand
 * keeps the fp32 path below, as does a CPU without AVX512_BF16, and
 * QTUNE_BF16_GEMM=off or QTUNE_BF16_EMULATE=1 (op_dnnl.h). The operand is
 * converted to bf16 in row blocks and a 4-bit weight dequantized to bf16 a
 * panel of rows at a time, both into the workspace. */
static int bf16_gemm_on(void) {
    const char *e = getenv("QTUNE_BF16_EMULATE");
    return !(e && !strcmp(e, "1")) && op_dnnl_bf16_available();
}

static int bf16_weight(const void *w, qt_dtype wdt) {
    return wdt == QT_BF16 || (wdt == QT_Q4 && ((const qt_q4_weight *)w)->dtype == QT_BF16);
}

/* 1 when every x[i] is a bf16 value */
static int bf16_exact(const float *x, size_t n) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t low = 0;
#pragma omp parallel for reduction(| : low) schedule(static) if (n >= OP_SERIAL_ELEMS)
    for (size_t i = 0; i < n; i++) low |= u[i] & 0xffffu;
    return low == 0;
}

/* the top halves of n bf16-exact floats */
static void to_bf16(uint16_t *d, const float *x, size_t n) {
    const uint32_t *u = (const uint32_t *)x;
#pragma omp parallel for schedule(static) if (n >= OP_SERIAL_ELEMS)
    for (size_t i = 0; i < n; i++) d[i] = (uint16_t)(u[i] >> 16);
}

int op_bf16_operand(const float *x, size_t n, uint16_t *x16) {
    if (!bf16_gemm_on() || !bf16_exact(x, n)) return 0;
    to_bf16(x16, x, n);
    return 1;
}

/* rows [o0, o0 + p) of a 4-bit weight (bf16-valued) as bf16, (p, IN) */
static void q4_rows_bf16(uint16_t *d, const void *w, int o0, int p, int IN) {
    enum { CH = 1024 };
    const size_t e0 = (size_t)o0 * IN, n = (size_t)p * IN, nch = (n + CH - 1) / CH;
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nch; c++) {
        float buf[CH];
        size_t a = c * CH, b = a + CH < n ? a + CH : n;
        qt_q4_dequantize(w, e0 + a, e0 + b, buf);
        const uint32_t *u = (const uint32_t *)buf;
        for (size_t i = a; i < b; i++) d[i] = (uint16_t)(u[i - a] >> 16);
    }
}

/* A block the GEMM refused after others ran (not seen: oneDNN refuses by
 * CPU, not by shape), in fp32 a chunk of one weight row at a time. fwd:
 * C (M, p) (ldc) = / += alpha * A (M, IN) (lda) @ rows [o0, o0 + p) of W^T;
 * else (dinp): C (M, IN) += alpha * A (M, p) @ those rows. */
static void f32_block(float *C, int ldc, const float *A, int lda, const void *w, qt_dtype wdt, int o0, int p, int M,
                      int IN, float alpha, int acc, int fwd) {
    enum { CH = 4096 };
    float buf[CH];
    for (int j = 0; j < p; j++)
        for (int k0 = 0; k0 < IN; k0 += CH) {
            int kl = IN - k0 < CH ? IN - k0 : CH;
            size_t e = (size_t)(o0 + j) * IN + k0;
            if (wdt == QT_Q4) qt_q4_dequantize(w, e, e + (size_t)kl, buf);
            else qt_convert_to_f32(buf, (const uint16_t *)w + e, wdt, (size_t)kl);
            if (fwd)
                cblas_sgemv(CblasRowMajor, CblasNoTrans, M, kl, alpha, A + k0, lda, buf, 1,
                            k0 || acc ? 1.0f : 0.0f, C + j, ldc);
            else
                cblas_sger(CblasRowMajor, M, kl, alpha, A + j, lda, buf, 1, C + k0, ldc);
        }
}

/* The workspace as bf16 slots: a 4-bit weight's dequantized panel of P rows (half the slots at most; P 0
 * for a bf16 weight, read in place) first, the rest for the converted activations. */
static int q4_panel_rows(qt_dtype wdt, size_t slots, int IN, int OUT) {
    if (wdt != QT_Q4) return 0;
    size_t pr = slots / 2 / (size_t)IN;
    return pr < (size_t)OUT ? (int)pr : OUT;
}

/* The forward on the bf16 GEMM: 1 when done, 0 when it did not apply (out untouched). */
static int forward_bf16(float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                        int OUT, float alpha, int accumulate, float *ws) {
    if (!ws || !bf16_weight(w, wdt) || !bf16_gemm_on() || !bf16_exact(inp, (size_t)N * IN)) return 0;
    const size_t slots = 2 * op_matmul_ws_floats(IN, OUT); /* bf16 values the workspace holds */
    uint16_t *panel = (uint16_t *)ws;
    const int P = q4_panel_rows(wdt, slots, IN, OUT);
    uint16_t *x16 = panel + (size_t)P * IN;
    size_t rr = (slots - (size_t)P * IN) / (size_t)IN;
    int R = rr < (size_t)N ? (int)rr : N;
    const float *b = alpha == 1.0f && !accumulate ? bias : NULL; /* else added below */
    int ran = 0;
    for (int n0 = 0; n0 < N; n0 += R) {
        int nb = N - n0 < R ? N - n0 : R;
        to_bf16(x16, inp + (size_t)n0 * IN, (size_t)nb * IN);
        float *o = out + (size_t)n0 * OUT;
        for (int o0 = 0; o0 < OUT; o0 += wdt == QT_Q4 ? P : OUT) {
            int p = wdt == QT_Q4 ? (OUT - o0 < P ? OUT - o0 : P) : OUT;
            const uint16_t *wp = (const uint16_t *)w;
            if (wdt == QT_Q4) q4_rows_bf16(panel, w, o0, p, IN), wp = panel;
            if (op_dnnl_bf16_gemm_ld(o + o0, OUT, x16, IN, 0, wp, IN, 1, b ? b + o0 : NULL, nb, p, IN, alpha,
                                     accumulate) == QT_OK) {
                ran = 1;
                continue;
            }
            if (!ran) return 0; /* refused at once: the fp32 path does it all */
            f32_block(o + o0, OUT, inp + (size_t)n0 * IN, IN, w, wdt, o0, p, nb, IN, alpha, accumulate, 1);
            if (b)
                for (int n = 0; n < nb; n++)
                    for (int j = 0; j < p; j++) o[(size_t)n * OUT + o0 + j] += b[o0 + j];
        }
    }
    if (bias && !(alpha == 1.0f && !accumulate))
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OUT; o++) out[(size_t)n * OUT + o] += bias[o];
    return 1;
}

/* dinp (N, IN) += alpha * dout (N, OUT) @ W on the bf16 GEMM: 1 when done, 0 when it did not apply. */
static int dinp_bf16(float *dinp, const float *dout, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha,
                     float *ws) {
    if (!ws || !bf16_weight(w, wdt) || !bf16_gemm_on() || !bf16_exact(dout, (size_t)N * OUT)) return 0;
    const size_t slots = 2 * op_matmul_ws_floats(IN, OUT); /* bf16 values the workspace holds */
    uint16_t *panel = (uint16_t *)ws;
    const int P = q4_panel_rows(wdt, slots, IN, OUT);
    uint16_t *d16 = panel + (size_t)P * IN;
    size_t rr = (slots - (size_t)P * IN) / (size_t)OUT;
    int R = rr < (size_t)N ? (int)rr : N;
    if (R < 1) return 0;
    int ran = 0;
    for (int n0 = 0; n0 < N; n0 += R) {
        int nb = N - n0 < R ? N - n0 : R;
        to_bf16(d16, dout + (size_t)n0 * OUT, (size_t)nb * OUT);
        float *di = dinp + (size_t)n0 * IN;
        for (int o0 = 0; o0 < OUT; o0 += wdt == QT_Q4 ? P : OUT) {
            int p = wdt == QT_Q4 ? (OUT - o0 < P ? OUT - o0 : P) : OUT;
            const uint16_t *wp = (const uint16_t *)w + (wdt == QT_Q4 ? 0 : (size_t)o0 * IN);
            if (wdt == QT_Q4) q4_rows_bf16(panel, w, o0, p, IN), wp = panel;
            if (op_dnnl_bf16_gemm_ld(di, IN, d16 + o0, OUT, 0, wp, IN, 0, NULL, nb, IN, p, alpha, 1) == QT_OK) {
                ran = 1;
                continue;
            }
            if (!ran) return 0;
            f32_block(di, IN, dout + (size_t)n0 * OUT + o0, OUT, w, wdt, o0, p, nb, IN, alpha, 1, 0);
        }
    }
    return 1;
}

void op_matmul_forward(float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                       int OUT, float alpha, int accumulate, float *ws) {
    op_blas_init();
    if (forward_bf16(out, inp, w, wdt, bias, N, IN, OUT, alpha, accumulate, ws)) return;
    float beta = accumulate ? 1.0f : 0.0f;
    int team = op_product_team(N, IN, OUT, wdt == QT_F32 ? omp_get_max_threads() : half_team(IN, OUT));
    size_t share = wdt == QT_F32 ? 0 : op_matmul_ws_floats(IN, OUT) / (size_t)team;
#pragma omp parallel num_threads(team)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num(), o0, o1;
        op_split(OUT, nt, id, MATMUL_MIN_ROWS, &o0, &o1);
        if (o1 > o0 && wdt == QT_F32) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, o1 - o0, IN, alpha, inp, IN,
                        (const float *)w + (size_t)o0 * IN, IN, beta, out + o0, OUT);
        } else if (o1 > o0) {
            float *my = ws + (size_t)id * share;
            int P = (int)(share / (size_t)IN);
            for (int o = o0; o < o1; o += P) {
                int p = o1 - o < P ? o1 - o : P;
                op_convert_rows_serial(my, w, wdt, (size_t)o, (size_t)(o + p), (size_t)IN);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, p, IN, alpha, inp, IN, my, IN, beta, out + o,
                            OUT);
            }
        }
        if (bias)
            for (int n = 0; n < N; n++)
                for (int o = o0; o < o1; o++) out[(size_t)n * OUT + o] += bias[o];
    }
}

void op_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const void *w,
                        qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    op_blas_init();
    if (dinp && !dinp_bf16(dinp, dout, w, wdt, N, IN, OUT, alpha, ws)) {
        /* dinp (N, IN) += alpha * dout (N, OUT) @ W (OUT, IN): threads own column blocks of dinp */
        int team = op_product_team(N, IN, OUT, wdt == QT_F32 ? omp_get_max_threads() : half_team(IN, OUT));
        size_t share = wdt == QT_F32 ? 0 : op_matmul_ws_floats(IN, OUT) / (size_t)team;
#pragma omp parallel num_threads(team)
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num(), i0, i1;
            op_split(IN, nt, id, MATMUL_MIN_ROWS, &i0, &i1);
            int ib = i1 - i0;
            if (ib > 0 && wdt == QT_F32) {
                op_sgemm_nn(N, ib, OUT, alpha, dout, OUT, (const float *)w + i0, IN, 1.0f, dinp + i0, IN);
            } else if (ib > 0) {
                float *my = ws + (size_t)id * share;
                int P = (int)(share / (size_t)ib);
                size_t es = qt_dtype_size(wdt);
                for (int o = 0; o < OUT; o += P) {
                    int p = OUT - o < P ? OUT - o : P;
                    for (int r = 0; r < p; r++) {
                        const size_t e = (size_t)(o + r) * IN + i0;
                        if (wdt == QT_Q4) qt_q4_dequantize(w, e, e + (size_t)ib, my + (size_t)r * ib);
                        else qt_convert_to_f32(my + (size_t)r * ib, (const char *)w + e * es, wdt, (size_t)ib);
                    }
                    op_sgemm_nn(N, ib, p, alpha, dout + o, OUT, my, ib, 1.0f, dinp + i0, IN);
                }
            }
        }
    }
    if (dweight || dbias) {
        /* dweight (OUT, IN) += alpha * dout^T @ inp; dbias += alpha * column sums: threads own rows of W */
#pragma omp parallel num_threads(op_product_team(N, IN, OUT, omp_get_max_threads()))
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num(), o0, o1;
            op_split(OUT, nt, id, MATMUL_MIN_ROWS, &o0, &o1);
            if (o1 > o0 && dweight)
                op_sgemm_tn(o1 - o0, IN, N, alpha, dout + o0, OUT, inp, IN, 1.0f, dweight + (size_t)o0 * IN, IN);
            if (dbias)
                for (int o = o0; o < o1; o++) {
                    float acc = 0.0f;
                    for (int n = 0; n < N; n++) acc += dout[(size_t)n * OUT + o];
                    dbias[o] += alpha * acc;
                }
        }
    }
}
