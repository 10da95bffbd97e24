/* Rounding fp32 buffers to the compute dtype (see op_precision.h). */
#include "backend/cpu/op_precision.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Rounds x[0..n) through fp16 with F16C, 8 lanes at a time. */
static void round_f16(float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) x[i] = qt_f16_to_f32(qt_f32_to_f16(x[i]));
}

/* bf16 round to nearest even on the top 16 bits, 8 lanes with AVX2 integer
 * ops; bit-identical to qt_f32_to_bf16 (NaN stays a quiet NaN). Returns the
 * 8 bf16 patterns zero-extended in 32-bit lanes. */
static inline __m256i bf16_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_srli_epi32(r, 16);
}

/* 8 zero-extended 32-bit lanes (values <= 0xffff) to 8 packed uint16 */
static inline __m128i pack8_u16(__m256i h) {
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8));
}

static void round_bf16(float *x, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_slli_epi32(bf16_round8(_mm256_loadu_ps(x + i)), 16));
    for (; i < n; i++) x[i] = qt_bf16_to_f32(qt_f32_to_bf16(x[i]));
}

static void round_store_f16(float *x, uint16_t *d, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) d[i] = qt_f32_to_f16(x[i]), x[i] = qt_f16_to_f32(d[i]);
}

static void round_store_bf16(float *x, uint16_t *d, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i h = bf16_round8(_mm256_loadu_ps(x + i));
        _mm_storeu_si128((__m128i *)(d + i), pack8_u16(h));
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_slli_epi32(h, 16));
    }
    for (; i < n; i++) d[i] = qt_f32_to_bf16(x[i]), x[i] = qt_bf16_to_f32(d[i]);
}

/* below this many elements a thread team costs more than the rounding */
#define ROUND_PAR_MIN ((size_t)1 << 15)
/* blocks of 4096 floats: aligned to the 8-lane loops, large enough to amortise scheduling */
#define ROUND_BLK ((size_t)4096)

void op_round_to_dtype(float *x, size_t n, qt_dtype dt) {
    if (dt == QT_F32 || n == 0) return;
    if (n < ROUND_PAR_MIN) {
        if (dt == QT_F16) round_f16(x, n);
        else round_bf16(x, n);
        return;
    }
    const size_t nb = (n + ROUND_BLK - 1) / ROUND_BLK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t a = b * ROUND_BLK, e = a + ROUND_BLK < n ? a + ROUND_BLK : n;
        if (dt == QT_F16) round_f16(x + a, e - a);
        else round_bf16(x + a, e - a);
    }
}

void op_round_store(float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    if (n < ROUND_PAR_MIN) {
        if (dt == QT_F16) round_store_f16(x, dst, n);
        else round_store_bf16(x, dst, n);
        return;
    }
    const size_t nb = (n + ROUND_BLK - 1) / ROUND_BLK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t a = b * ROUND_BLK, e = a + ROUND_BLK < n ? a + ROUND_BLK : n;
        if (dt == QT_F16) round_store_f16(x + a, dst + a, e - a);
        else round_store_bf16(x + a, dst + a, e - a);
    }
}

void op_convert(void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    const size_t ds = qt_dtype_size(ddt), ss = qt_dtype_size(sdt), nb = (n + ROUND_BLK - 1) / ROUND_BLK;
#pragma omp parallel for schedule(static) if (n >= ROUND_PAR_MIN)
    for (size_t b = 0; b < nb; b++) {
        float tmp[ROUND_BLK];
        size_t a = b * ROUND_BLK, k = a + ROUND_BLK < n ? ROUND_BLK : n - a;
        const char *s = (const char *)src + a * ss;
        char *d = (char *)dst + a * ds;
        if (sdt == QT_F32) {
            qt_convert_from_f32(d, ddt, (const float *)s, k);
        } else if (ddt == QT_F32) {
            qt_convert_to_f32((float *)d, s, sdt, k);
        } else {
            qt_convert_to_f32(tmp, s, sdt, k);
            qt_convert_from_f32(d, ddt, tmp, k);
        }
    }
}

int op_cpu_has_bf16(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}
