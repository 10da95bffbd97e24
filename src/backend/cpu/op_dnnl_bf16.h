/* bf16 x bf16 -> fp32 GEMM through oneDNN's matmul primitive (C API), for
 * CPUs with native bf16 arithmetic (AVX512_BF16 / AMX). Built only with
 * QTUNE_HAVE_DNNL; without it, or where oneDNN has no native bf16 kernel
 * (it answers dnnl_unimplemented, or only its slow reference kernel), both
 * functions refuse and the caller keeps the fp32 sgemm path.
 *
 * UNVERIFIED on real bf16 hardware: the development machine (AMD Zen 3) has
 * no AVX512_BF16, so only the refusal is tested there (docs/precision.md). */
#ifndef QT_BACKEND_CPU_OP_DNNL_BF16_H
#define QT_BACKEND_CPU_OP_DNNL_BF16_H

#include <stdint.h>

/* 1 when a native (non-reference) oneDNN bf16 matmul can be created on this
 * CPU; 0 otherwise (no oneDNN in the build, no bf16 kernel). Costs one
 * primitive-descriptor creation: call once, at model load. */
int op_dnnl_bf16_available(void);

/* out (N, OUT) = alpha * inp (N, IN) @ W^T + bias, with inp and W (OUT, IN)
 * as bf16 bit patterns, bias (OUT) fp32 or NULL, products accumulated in
 * fp32. Returns QT_OK, or QT_EUNSUPPORTED with out untouched when oneDNN
 * cannot run it (the caller then uses op_matmul_forward); bias with
 * alpha != 1 is refused too (oneDNN would scale the bias). */
int op_dnnl_bf16_matmul(float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N, int IN,
                        int OUT, float alpha);

#endif
