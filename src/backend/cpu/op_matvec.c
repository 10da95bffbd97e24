/* Matrix-vector product for one-token decoding: out (OUT) = alpha * W (OUT, IN)
 * x (IN) + bias. A one-row sgemm packs the whole weight before using each
 * element once (the profile of a 0.5B decode step: 75% in OpenBLAS's
 * packing); here each weight element is read exactly once, in its stored
 * dtype, and the step runs at the memory bandwidth. bf16 and f16 weights are
 * read as 2 bytes and widened in registers (bf16: a 16-bit shift; f16: F16C's
 * vcvtph2ps), so a 2-byte model moves half the bytes of an f32 one.
 *
 * Threads own blocks of output rows (no reduction between threads); a small
 * product runs on the calling thread, where the fork would cost more than the
 * work. Each thread walks four rows at a time so x, which sits in L1, is
 * loaded once per four rows and four FMA chains are in flight. Accumulation is
 * in f32 lanes; the lane sums are added in a fixed order, so the result does
 * not depend on the thread count. */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "backend/cpu/ops.h"

/* below this many weight elements the product runs on one thread (about 64 KiB
 * of f32: a few microseconds, the cost of waking the team) */
#define MATVEC_MIN_PARALLEL ((size_t)1 << 15)
#define ROW_ALIGN 16
/* Software prefetch distance in elements (8 KiB of bf16, 16 KiB of f32). One
 * core keeps only as many lines in flight as its instruction window reaches,
 * and a 2-byte row brings half a line per load: without the hint a bf16 matvec
 * ran at about half the GB/s of an f32 one. Measured on op_matvec alone
 * (896 x 4864, 64 matrices, 1 thread, the shared 2-core VM, best of 20, three
 * alternating rounds): bf16 11-16.6 -> 21-23.8 GB/s, f32 unchanged at 25-30. */
#define MATVEC_AHEAD 4096

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload_x(const float *x) { return _mm512_loadu_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vload_w(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (dt == QT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload_x(const float *x) { return _mm256_loadu_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vload_w(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (dt == QT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
#define LANES 0 /* scalar only */
#endif

static inline float w_at(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return dt == QT_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
}

/* rows [r0, r1): dot products of W's rows with x into dot[] (r - r0 indexed).
 * Always inlined into a switch on the dtype, so each copy has its dtype as a
 * constant and the loads carry no branch. */
static inline __attribute__((always_inline)) void dot_rows(float *dot, const float *x, const void *w, qt_dtype dt, int IN, int r0, int r1) {
    const size_t in = (size_t)IN;
    int r = r0;
#if LANES
    const size_t vec_end = in / LANES * LANES;
    for (; r + 4 <= r1; r += 4) {
        const size_t b0 = (size_t)r * in, b1 = b0 + in, b2 = b1 + in, b3 = b2 + in;
        vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (size_t i = 0; i < vec_end; i += LANES) {
            /* the four rows are one contiguous stream; asking for it MATVEC_AHEAD elements ahead keeps
             * enough lines in flight (a hint: no fault past the end) */
            const char *ahead = (const char *)w + (b0 + i + MATVEC_AHEAD) * (dt == QT_F32 ? 4 : 2);
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + (b1 - b0) * (dt == QT_F32 ? 4 : 2), _MM_HINT_T0);
            _mm_prefetch(ahead + (b2 - b0) * (dt == QT_F32 ? 4 : 2), _MM_HINT_T0);
            _mm_prefetch(ahead + (b3 - b0) * (dt == QT_F32 ? 4 : 2), _MM_HINT_T0);
            vf xv = vload_x(x + i);
            a0 = vfma(vload_w(w, dt, b0 + i), xv, a0);
            a1 = vfma(vload_w(w, dt, b1 + i), xv, a1);
            a2 = vfma(vload_w(w, dt, b2 + i), xv, a2);
            a3 = vfma(vload_w(w, dt, b3 + i), xv, a3);
        }
        float s0 = vsum(a0), s1 = vsum(a1), s2 = vsum(a2), s3 = vsum(a3);
        for (size_t i = vec_end; i < in; i++) {
            s0 += w_at(w, dt, b0 + i) * x[i];
            s1 += w_at(w, dt, b1 + i) * x[i];
            s2 += w_at(w, dt, b2 + i) * x[i];
            s3 += w_at(w, dt, b3 + i) * x[i];
        }
        dot[r - r0] = s0, dot[r - r0 + 1] = s1, dot[r - r0 + 2] = s2, dot[r - r0 + 3] = s3;
    }
    for (; r < r1; r++) {
        const size_t b = (size_t)r * in;
        vf a = vzero();
        for (size_t i = 0; i < vec_end; i += LANES) a = vfma(vload_w(w, dt, b + i), vload_x(x + i), a);
        float s = vsum(a);
        for (size_t i = vec_end; i < in; i++) s += w_at(w, dt, b + i) * x[i];
        dot[r - r0] = s;
    }
#else
    for (; r < r1; r++) {
        const size_t b = (size_t)r * in;
        float s = 0.0f;
        for (size_t i = 0; i < in; i++) s += w_at(w, dt, b + i) * x[i];
        dot[r - r0] = s;
    }
#endif
}

/* rows [r0, r1) of the result, in blocks that fit a stack buffer */
static void matvec_rows(float *out, const float *x, const void *w, qt_dtype dt, const float *bias, int IN, float alpha,
                        int accumulate, int r0, int r1) {
    float dot[256];
    for (int a = r0; a < r1; a += 256) {
        int b = r1 - a < 256 ? r1 : a + 256;
        switch (dt) {
        case QT_F32: dot_rows(dot, x, w, QT_F32, IN, a, b); break;
        case QT_F16: dot_rows(dot, x, w, QT_F16, IN, a, b); break;
        case QT_BF16: dot_rows(dot, x, w, QT_BF16, IN, a, b); break;
        }
        for (int r = a; r < b; r++) {
            float v = alpha * dot[r - a] + (bias ? bias[r] : 0.0f);
            out[r] = accumulate ? out[r] + v : v;
        }
    }
}

void op_matvec(float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int IN, int OUT,
               float alpha, int accumulate) {
    if ((size_t)IN * (size_t)OUT < MATVEC_MIN_PARALLEL || omp_get_max_threads() == 1 || omp_in_parallel()) {
        matvec_rows(out, x, w, wdt, bias, IN, alpha, accumulate, 0, OUT);
        return;
    }
#pragma omp parallel
    {
        int r0, r1;
        op_split(OUT, omp_get_num_threads(), omp_get_thread_num(), ROW_ALIGN, &r0, &r1);
        if (r1 > r0) matvec_rows(out, x, w, wdt, bias, IN, alpha, accumulate, r0, r1);
    }
}
