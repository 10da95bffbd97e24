/* The CUDA backend's 4-bit weights (QT_Q4, core/quant4.h): one value of a
 * bitsandbytes NF4/FP4 block (double quantization included), and the kernel
 * that dequantizes a weight into a workspace for cuBLAS. Included by
 * op_matmul.cu and, run on the CPU by cuda_emu.h, by
 * tests/unit/backend_parity/emu_quant4.cpp, which holds it bit for bit
 * against the CPU's qt_q4_dequantize.
 *
 * The arithmetic is quant4.c's, step for step in float32 without fused
 * multiply-adds (nvcc contracts a * b + c into one FMA unless told; the CPU
 * file is built with -ffp-contract=off): the block's absmax (nested:
 * code2[q] * absmax2 + offset, a multiply then an add), then code[nibble] *
 * absmax, rounded to the weight's dtype (quant_state.dtype) as
 * dequantize_4bit returns it. The header lives on the device with the data it
 * points to (its offsets count from its own address), so a kernel reads both
 * through the one pointer the model hands the backend. */
#ifndef QT_BACKEND_CUDA_QUANT4_KERNELS_CUH
#define QT_BACKEND_CUDA_QUANT4_KERNELS_CUH

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "core/quant4.h"
}

#ifdef __CUDACC__
#include <cuda_fp16.h>
__device__ __forceinline__ float q4_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float q4_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float q4_round_f16(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ uint32_t q4_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ float q4_float(uint32_t u) { return __uint_as_float(u); }
#else /* cuda_emu.h: the host's float32 (volatile: never contracted into an FMA) */
#include <string.h>
inline float q4_mul(float a, float b) { volatile float r = a * b; return r; }
inline float q4_add(float a, float b) { volatile float r = a + b; return r; }
inline float q4_round_f16(float v) { return qt_f16_to_f32(qt_f32_to_f16(v)); }
inline uint32_t q4_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
inline float q4_float(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }
#endif

/* bf16 round to nearest even, as qt_f32_to_bf16 for the finite values a code times an absmax is */
__device__ __forceinline__ float q4_round_bf16(float v) {
    const uint32_t u = q4_bits(v);
    return q4_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* Value i of w in its own numbering (a view: from its first row), dequantized. */
__device__ __forceinline__ float q4_value(const qt_q4_weight *w, size_t i) {
    const uint8_t *base = (const uint8_t *)w;
    const size_t e = i + (size_t)w->e0, b = e / w->blocksize;
    float am;
    if (w->nested) {
        const uint8_t q = (base + w->absmax_off)[b];
        const float a2 = ((const float *)(base + w->absmax2_off))[b / w->blocksize2];
        am = q4_add(q4_mul(w->code2[q], a2), w->offset);
    } else {
        am = ((const float *)(base + w->absmax_off))[b];
    }
    const uint8_t byte = (base + w->packed_off)[e / 2];
    const float v = q4_mul(w->code[(e & 1) ? byte & 15 : byte >> 4], am);
    return w->dtype == QT_BF16 ? q4_round_bf16(v) : w->dtype == QT_F16 ? q4_round_f16(v) : v;
}

/* out[i] = value i of w for i in [0, n): a thread per value, grid-stride.
 * Bound by writing out (4 bytes a value against the half byte read). */
__global__ void k_q4_dequantize(float *out, const qt_q4_weight *w, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = q4_value(w, i);
}

#endif
