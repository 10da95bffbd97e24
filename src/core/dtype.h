/* Storage dtypes and conversions. fp16 uses F16C; bf16 rounds to nearest even
 * (as torch does) and keeps NaN a NaN. */
#ifndef QT_CORE_DTYPE_H
#define QT_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* QT_Q4: a frozen weight in bitsandbytes' 4-bit format (NF4 or FP4). Its
 * pointer is the core/quant4.h qt_q4_weight header of the block, not an
 * array of elements: only the matmul and matvec ops take it, and they
 * dequantize it (to the dtype in its header) as they go. */
/* QT_U8: bytes in a file (a pre-quantized folder's packed codes, 8-bit absmax
 * and quant_state); never a weight an op reads. */
typedef enum { QT_F32 = 0, QT_F16 = 1, QT_BF16 = 2, QT_Q4 = 3, QT_U8 = 4 } qt_dtype;

/* bytes an element (QT_Q4: 1, an upper bound; qt_q4_bytes sizes a block; QT_U8: 1) */
size_t qt_dtype_size(qt_dtype t);
const char *qt_dtype_name(qt_dtype t);      /* "f32" "f16" "bf16" "q4" "u8" */
const char *qt_dtype_st_name(qt_dtype t);   /* safetensors: "F32" "F16" "BF16" */
int qt_dtype_parse(const char *s, qt_dtype *out); /* accepts f32/fp32/float32, f16/fp16/float16, bf16/bfloat16; QT_OK or QT_EINVAL */

static inline float qt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t qt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float qt_f16_to_f32(uint16_t h);
uint16_t qt_f32_to_f16(float f);

/* Bulk conversions; n elements; vectorised with F16C/AVX2 where available. */
void qt_convert_to_f32(float *dst, const void *src, qt_dtype t, size_t n);
void qt_convert_from_f32(void *dst, qt_dtype t, const float *src, size_t n);

/* The index of the first NaN or inf among n elements of type t (an all-ones
 * exponent), n when there is none; *nan says which it is. One pass the
 * compiler vectorises, then a scan only when one is there. */
size_t qt_find_nonfinite(const void *p, qt_dtype t, size_t n, int *nan);

#endif
