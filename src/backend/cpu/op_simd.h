/* AVX2/FMA helpers shared by the CPU ops: a vectorised expf and the row
 * reductions of the softmax (the compiler does not vectorise float
 * reductions without -ffast-math, and glibc's expf is one lane at a time).
 *
 * op_exp8: exp of 8 floats, Cephes' method: x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by a degree-6 polynomial, 2^n through the exponent bits. Relative
 * error about 2 ulp on [-87.3, 88.7]; below -87.3 the result is 0 (expf's
 * result there is denormal or 0), above 88.7 it saturates at exp(88.7); NaN
 * gives NaN. */
#ifndef QT_BACKEND_CPU_OP_SIMD_H
#define QT_BACKEND_CPU_OP_SIMD_H

#include <immintrin.h>
#include <math.h>

/* Keeps a loaded vector in its register. Without it GCC folds the load into
 * every instruction that uses the value, and the loads, not the FMAs, then
 * bound the loop: in op_matvec.c x into each of the tile rows' FMAs and a bf16
 * line into both its shift and its mask (in L2, 4 rows of bf16 ran at 48 GB/s
 * against 70 with one load of x per 4 rows); in op_attention.c a key or value
 * line into both heads' FMAs (1500 keys, 0.5B heads: 124 -> 107 us a call). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

static inline __m256 op_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365478515625f), hi = _mm256_set1_ps(88.72283172607421875f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    /* A lane below lo (a masked score at -inf) is worked from 0 and zeroed at
     * the end: clamped to lo, its 2^n factors made a denormal product first,
     * and each such instruction took a microcode assist on Intel cores (the
     * causal mask's -inf entries made the attention forward 1.5x slower at
     * head dim 16; bench/RESULTS.md). The other lanes' bits are unchanged. */
    x = _mm256_andnot_ps(under, x);
    /* max/min return their second operand when one is NaN: x goes second, so
     * a NaN stays NaN (a NaN logit must make the loss NaN, not exp(-87)) */
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n in [-126, 128]: 2^n as two factors so n = 128 does not overflow the exponent field */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
}

static inline float op_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* max(m, l[0..n)) */
static inline float op_row_max(const float *l, int n, float m) {
    int j = 0;
    if (n >= 8) {
        __m256 v = _mm256_set1_ps(m);
        for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(l + j));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        m = _mm_cvtss_f32(s);
    }
    for (; j < n; j++) m = l[j] > m ? l[j] : m;
    return m;
}

/* l[j] = scale * exp(l[j] - sub) in place; returns the sum of exp(l[j] - sub),
 * accumulated in double lanes. */
static inline double op_row_exp(float *l, int n, float sub, float scale) {
    __m256 vs = _mm256_set1_ps(sub), vk = _mm256_set1_ps(scale);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = op_exp8(_mm256_sub_ps(_mm256_loadu_ps(l + j), vs));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        _mm256_storeu_ps(l + j, _mm256_mul_ps(e, vk));
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(a0, a1));
    double s = (t[0] + t[1]) + (t[2] + t[3]);
    for (; j < n; j++) {
        float e = expf(l[j] - sub);
        s += e;
        l[j] = e * scale;
    }
    return s;
}

#endif
