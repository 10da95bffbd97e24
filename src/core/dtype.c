#include "core/dtype.h"
#include "core/error.h"

#include <immintrin.h>
#include <strings.h>

size_t qt_dtype_size(qt_dtype t) { return t == QT_F32 ? 4 : t == QT_Q4 || t == QT_U8 ? 1 : 2; }

const char *qt_dtype_name(qt_dtype t) {
    return t == QT_F32 ? "f32" : t == QT_F16 ? "f16" : t == QT_Q4 ? "q4" : t == QT_U8 ? "u8" : "bf16";
}

const char *qt_dtype_st_name(qt_dtype t) {
    return t == QT_F32 ? "F32" : t == QT_F16 ? "F16" : t == QT_U8 ? "U8" : "BF16";
}

int qt_dtype_parse(const char *s, qt_dtype *out) {
    if (!strcasecmp(s, "f32") || !strcasecmp(s, "fp32") || !strcasecmp(s, "float32")) *out = QT_F32;
    else if (!strcasecmp(s, "f16") || !strcasecmp(s, "fp16") || !strcasecmp(s, "float16")) *out = QT_F16;
    else if (!strcasecmp(s, "bf16") || !strcasecmp(s, "bfloat16")) *out = QT_BF16;
    else return QT_ERR(QT_EINVAL, "unknown dtype '%s'; use f32, bf16 or f16", s);
    return QT_OK;
}

float qt_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
uint16_t qt_f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

void qt_convert_to_f32(float *dst, const void *src, qt_dtype t, size_t n) {
    size_t i = 0;
    if (t == QT_F32) {
        memmove(dst, src, n * 4);
    } else if (t == QT_U8) {
        const uint8_t *s = src;
        for (; i < n; i++) dst[i] = (float)s[i];
    } else if (t == QT_F16) {
        const uint16_t *s = src;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
        for (; i < n; i++) dst[i] = qt_f16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        for (; i < n; i++) dst[i] = qt_bf16_to_f32(s[i]);
    }
}

void qt_convert_from_f32(void *dst, qt_dtype t, const float *src, size_t n) {
    size_t i = 0;
    if (t == QT_F32) {
        memmove(dst, src, n * 4);
    } else if (t == QT_F16) {
        uint16_t *d = dst;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) d[i] = qt_f32_to_f16(src[i]);
    } else {
        uint16_t *d = dst;
        for (; i < n; i++) d[i] = qt_f32_to_bf16(src[i]);
    }
}

size_t qt_find_nonfinite(const void *p, qt_dtype t, size_t n, int *nan) {
    *nan = 0;
    if (t == QT_F32) {
        const uint32_t *u = p;
        uint32_t bad = 0;
        for (size_t i = 0; i < n; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
        if (!bad) return n;
        for (size_t i = 0; i < n; i++)
            if ((u[i] & 0x7f800000u) == 0x7f800000u) {
                *nan = (u[i] & 0x007fffffu) != 0;
                return i;
            }
        return n;
    }
    /* f16: exponent 5 bits, mantissa 10; bf16: exponent 8 bits, mantissa 7 */
    const uint16_t *h = p, e = t == QT_F16 ? 0x7c00u : 0x7f80u, m = t == QT_F16 ? 0x03ffu : 0x007fu;
    uint16_t bad = 0;
    for (size_t i = 0; i < n; i++) bad |= (h[i] & e) == e;
    if (!bad) return n;
    for (size_t i = 0; i < n; i++)
        if ((h[i] & e) == e) {
            *nan = (h[i] & m) != 0;
            return i;
        }
    return n;
}
