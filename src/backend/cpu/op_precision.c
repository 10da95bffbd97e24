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

static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = qt_bf16_to_f32(qt_f32_to_bf16(x[i]));
}

/* below this many elements a thread team costs more than the rounding */
#define ROUND_PAR_MIN ((size_t)1 << 15)

void op_round_to_dtype(float *x, size_t n, qt_dtype dt) {
    if (dt == QT_F32 || n == 0) return;
    if (n < ROUND_PAR_MIN) {
        if (dt == QT_F16) round_f16(x, n);
        else round_bf16(x, n);
        return;
    }
    /* blocks of 4096 floats: aligned to the 8-lane loop, large enough to amortise scheduling */
    const size_t blk = 4096, nb = (n + blk - 1) / blk;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t a = b * blk, e = a + blk < n ? a + blk : n;
        if (dt == QT_F16) round_f16(x + a, e - a);
        else round_bf16(x + a, e - a);
    }
}

int op_cpu_has_bf16(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}
