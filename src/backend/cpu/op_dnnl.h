/* oneDNN's GEMMs: its fp32 sgemm (op_sgemm_nn in ops.h uses it where it
 * beats OpenBLAS), and bf16 x bf16 -> fp32 GEMM through its matmul primitive
 * (C API), for
 * CPUs with native bf16 arithmetic (AVX512_BF16 / AMX). Built only with
 * QTUNE_HAVE_DNNL; without it, or where oneDNN has no native bf16 kernel
 * (it answers dnnl_unimplemented, or only its slow reference kernel), both
 * functions refuse and the caller keeps the fp32 sgemm path.
 *
 * Checked on AVX512_BF16 hardware against an fp64 product; without it only
 * the refusal is tested (docs/precision.md). */
#ifndef QT_BACKEND_CPU_OP_DNNL_H
#define QT_BACKEND_CPU_OP_DNNL_H

#include <stdint.h>

/* 1 when a native (non-reference) oneDNN bf16 matmul can be created on this
 * CPU; 0 otherwise (no oneDNN in the build, no bf16 kernel, or the
 * environment's QTUNE_BF16_GEMM=off, under which the GEMMs below refuse too).
 * The probe (one primitive-descriptor creation) runs once a process. */
int op_dnnl_bf16_available(void);

/* out (N, OUT) = alpha * inp (N, IN) @ W^T + bias, with inp and W (OUT, IN)
 * as bf16 bit patterns, bias (OUT) fp32 or NULL, products accumulated in
 * fp32. Returns QT_OK, or QT_EUNSUPPORTED with out untouched when oneDNN
 * cannot run it (the caller then uses op_matmul_forward); bias with
 * alpha != 1 is refused too (oneDNN would scale the bias). */
int op_dnnl_bf16_matmul(float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N, int IN,
                        int OUT, float alpha);

/* The general form: C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) [+ bias]
 * [+ C when acc], A and B bf16 bit patterns, C fp32 row-major. op(A) is A
 * stored (M, K) row-major, or with ta stored (K, M) and read transposed;
 * op(B) is B stored (K, N), or with tb stored (N, K). bias (N) only with
 * alpha 1 and no acc. QT_OK, or QT_EUNSUPPORTED with C untouched. */
int op_dnnl_bf16_gemm(float *C, const uint16_t *A, int ta, const uint16_t *B, int tb, const float *bias, int M,
                      int N, int K, float alpha, int acc);

/* The same with leading dimensions (elements between rows as stored): A
 * (M, K) row-major with lda, or with ta stored (K, M) with lda; B likewise
 * with ldb; C with ldc. Lets a product write a column block of C and read a
 * column block of A (the 4-bit weight's panels, op_matmul.c). */
int op_dnnl_bf16_gemm_ld(float *C, int ldc, const uint16_t *A, int lda, int ta, const uint16_t *B, int ldb, int tb,
                         const float *bias, int M, int N, int K, float alpha, int acc);

/* How many bf16 GEMMs have run (returned QT_OK) in this process: lets the
 * tests see which path a model took. */
long op_dnnl_bf16_runs(void);

/* oneDNN's fp32 sgemm, row-major (dnnl_sgemm): C (M, N) = alpha * op(A) @
 * op(B) + beta * C, ta/tb 'N' or 'T'. Inside an OpenMP parallel region it
 * runs single-threaded on the calling thread. _available: 1 when the library
 * loads (cheap after the first call). op_dnnl_sgemm returns QT_OK, or
 * QT_EUNSUPPORTED (oneDNN not there) or QT_EINVAL (arguments refused) with
 * C untouched and no error recorded, so it may run on worker threads. _runs: calls
 * that ran, for the tests. */
int op_dnnl_sgemm_available(void);
int op_dnnl_sgemm(char ta, char tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc);
long op_dnnl_sgemm_runs(void);

#endif
