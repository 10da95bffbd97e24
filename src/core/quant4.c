/* bitsandbytes' 4-bit and 8-bit blockwise quantization (core/quant4.h says
 * which kernel each step follows). Built without -ffast-math: the NaN of an
 * all-zero block (0 * (1 / 0)) must fall through the threshold tree to code
 * 0 as it does in the kernel. */
#include "core/quant4.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

const float qt_q4_nf4_code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f,
    1.0f};

/* 0, 0.0625, 8, 12, 4, 6, 2, 3 (and their negatives) over 12: float32 x / 12,
 * the same floats as the kernel's fp4_dequantization_lut (the tests check) */
const float qt_q4_fp4_code[16] = {0.0f,         0.005208333333f, 0.66666667f,  1.0f,        0.33333333f, 0.5f,
                                  0.16666667f,  0.25f,           -0.0f,        -0.005208333333f, -0.66666667f,
                                  -1.0f,        -0.33333333f,    -0.5f,        -0.16666667f, -0.25f};

/* create_dynamic_map() as torch computes it (linspace and products in
 * float32), as bit patterns; tests/quant/test_quant4_ref.py recomputes it. */
static const union {
    uint32_t bits[256];
    float f[256];
} dynamic = {{
#include "core/quant4_dynamic.inc"
}};
const float *qt_q8_dynamic_map(void) { return dynamic.f; }

const char *qt_q4_type_name(qt_q4_type t) { return t == QT_Q4_FP4 ? "fp4" : "nf4"; }

/* dQuantizeNF4: the thresholds are the midpoints between neighbouring codes */
static uint8_t nf4_code(float x) {
    if (x > 0.03979014977812767f) {
        if (x > 0.3893125355243683f) {
            if (x > 0.6427869200706482f) return x > 0.8614784181118011f ? 15 : 14;
            return x > 0.5016634166240692f ? 13 : 12;
        }
        if (x > 0.2035212516784668f) return x > 0.2920137718319893f ? 11 : 10;
        return x > 0.1202552504837513f ? 9 : 8;
    }
    if (x > -0.33967943489551544f) {
        if (x > -0.13791173323988914f) return x > -0.045525018125772476f ? 7 : 6;
        return x > -0.23460740596055984f ? 5 : 4;
    }
    if (x > -0.6106329262256622f) return x > -0.4599952697753906f ? 3 : 2;
    return x > -0.8480964004993439f ? 1 : 0;
}

/* dQuantizeFP4: sign bit, then a tree over |x| */
static uint8_t fp4_code(float x) {
    uint8_t sign = x < 0 ? 8 : 0;
    x = fabsf(x);
    if (x > 0.29166667f) {
        if (x > 0.583333f) return (uint8_t)((x > 0.8333333f ? 3 : 2) + sign);
        return (uint8_t)((x > 0.4166667f ? 5 : 4) + sign);
    }
    if (x > 0.0859375f) return (uint8_t)((x > 0.20833333f ? 7 : 6) + sign);
    return (uint8_t)((x > 0.00260417f ? 1 : 0) + sign);
}

uint8_t qt_q4_code_of(qt_q4_type t, float x) { return t == QT_Q4_FP4 ? fp4_code(x) : nf4_code(x); }

/* dQuantize<0>: a binary search from the middle of the map, then the nearer
 * of the two neighbours by their float32 midpoint */
uint8_t qt_q8_code_of(const float code[256], float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f, val = code[pivot];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) lower_pivot = pivot, lower = val, pivot += i;
        else upper_pivot = pivot, upper = val, pivot -= i;
        val = code[pivot];
    }
    if (upper_pivot == 255) upper = code[upper_pivot];
    if (lower_pivot == 0) lower = code[lower_pivot];
    if (x > val) return (uint8_t)(x > (upper + val) * 0.5f ? upper_pivot : pivot);
    return (uint8_t)(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

static float block_absmax(const float *x, size_t n) {
    float m = -3.402823466e38f; /* the kernel starts from -FLT_MAX and takes fmaxf */
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

void qt_q4_quantize(qt_q4_type t, const float *x, size_t n, int blocksize, uint8_t *packed, float *absmax) {
    for (size_t b0 = 0; b0 < n; b0 += (size_t)blocksize) {
        size_t m = n - b0 < (size_t)blocksize ? n - b0 : (size_t)blocksize;
        float am = block_absmax(x + b0, m), inv = 1.0f / am;
        absmax[b0 / (size_t)blocksize] = am;
        for (size_t j = 0; j < m; j += 2) {
            /* past the end the kernel loads 0 and still stores its nibble */
            float lo = j + 1 < m ? x[b0 + j + 1] : 0.0f;
            packed[(b0 + j) / 2] = (uint8_t)(qt_q4_code_of(t, x[b0 + j] * inv) << 4 | qt_q4_code_of(t, lo * inv));
        }
    }
}

void qt_q8_quantize(const float code[256], const float *x, size_t n, int blocksize, uint8_t *q, float *absmax) {
    for (size_t b0 = 0; b0 < n; b0 += (size_t)blocksize) {
        size_t m = n - b0 < (size_t)blocksize ? n - b0 : (size_t)blocksize;
        float am = block_absmax(x + b0, m), inv = 1.0f / am;
        absmax[b0 / (size_t)blocksize] = am;
        for (size_t j = 0; j < m; j++) q[b0 + j] = qt_q8_code_of(code, x[b0 + j] * inv);
    }
}

float qt_q4_absmax_offset(const float *absmax, size_t nb) {
    double s = 0;
    for (size_t i = 0; i < nb; i++) s += absmax[i];
    return nb ? (float)(s / (double)nb) : 0.0f;
}

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

size_t qt_q4_bytes(uint64_t rows, uint64_t cols, int blocksize, int nested) {
    size_t n = (size_t)(rows * cols), nb = (n + (size_t)blocksize - 1) / (size_t)blocksize;
    size_t nb2 = (nb + QT_Q4_BLOCK2 - 1) / QT_Q4_BLOCK2;
    size_t b = align64(sizeof(qt_q4_weight)) + align64((n + 1) / 2);
    return nested ? b + align64(nb) + align64(nb2 * 4) : b + align64(nb * 4);
}

void qt_q4_init(qt_q4_weight *w, qt_q4_type t, qt_dtype dtype, uint64_t rows, uint64_t cols, int blocksize,
                int nested) {
    memset(w, 0, sizeof *w);
    size_t n = (size_t)(rows * cols);
    w->magic = QT_Q4_MAGIC;
    w->type = (uint32_t)t;
    w->dtype = (uint32_t)dtype;
    w->blocksize = (uint32_t)blocksize;
    w->nested = nested ? 1u : 0u;
    w->blocksize2 = QT_Q4_BLOCK2;
    w->rows = rows, w->cols = cols;
    w->nb = (n + (size_t)blocksize - 1) / (size_t)blocksize;
    w->nb2 = nested ? (w->nb + QT_Q4_BLOCK2 - 1) / QT_Q4_BLOCK2 : 0;
    w->packed_off = (int64_t)align64(sizeof *w);
    w->absmax_off = w->packed_off + (int64_t)align64((n + 1) / 2);
    w->absmax2_off = nested ? w->absmax_off + (int64_t)align64(w->nb) : 0;
    w->bytes = qt_q4_bytes(rows, cols, blocksize, nested);
    memcpy(w->code, t == QT_Q4_FP4 ? qt_q4_fp4_code : qt_q4_nf4_code, sizeof w->code);
    if (nested) memcpy(w->code2, dynamic.f, sizeof w->code2);
}

int qt_q4_quantize_weight(qt_q4_weight *w, const void *x, qt_dtype sdt) {
    size_t n = (size_t)(w->rows * w->cols), bs = w->blocksize, es = qt_dtype_size(sdt);
    float *am = w->nested ? malloc(w->nb * sizeof(float)) : qt_q4_absmax(w);
    if (!am) return QT_ERR(QT_ENOMEM, "out of memory quantizing a %zu-value weight", n);
    float blk[4096];
    uint8_t *packed = qt_q4_packed(w);
    for (size_t b0 = 0; b0 < n; b0 += bs) {
        size_t m = n - b0 < bs ? n - b0 : bs;
        qt_convert_to_f32(blk, (const char *)x + b0 * es, sdt, m);
        qt_q4_quantize((qt_q4_type)w->type, blk, m, (int)bs, packed + b0 / 2, am + b0 / bs);
    }
    if (w->nested) {
        w->offset = qt_q4_absmax_offset(am, w->nb);
        for (size_t b = 0; b < w->nb; b++) am[b] -= w->offset;
        qt_q8_quantize(w->code2, am, w->nb, (int)w->blocksize2, qt_q4_absmax(w), qt_q4_absmax2(w));
        free(am);
    }
    return QT_OK;
}

float qt_q4_block_absmax(const qt_q4_weight *w, size_t b) {
    if (!w->nested) return ((const float *)qt_q4_absmax(w))[b];
    const uint8_t *q = qt_q4_absmax(w);
    return w->code2[q[b]] * qt_q4_absmax2(w)[b / w->blocksize2] + w->offset;
}

/* qt_q4_block_absmax's arithmetic for a run of blocks (a decode step decodes
 * every row's: the nested block size a constant, not a division by the
 * header's field; qt_q4_check holds it at QT_Q4_BLOCK2) */
const float *qt_q4_absmax_run(const qt_q4_weight *w, size_t b0, size_t n, float *out) {
    if (!w->nested) return (const float *)qt_q4_absmax(w) + b0;
    const uint8_t *q = qt_q4_absmax(w);
    const float *a2 = qt_q4_absmax2(w), *code2 = w->code2;
    const float offset = w->offset;
    for (size_t b = b0; b < b0 + n; b++) out[b - b0] = code2[q[b]] * a2[b / QT_Q4_BLOCK2] + offset;
    return out;
}

static inline float round_dt(float v, qt_dtype dt) {
    if (dt == QT_BF16) return qt_bf16_to_f32(qt_f32_to_bf16(v));
    if (dt == QT_F16) return qt_f16_to_f32(qt_f32_to_f16(v));
    return v;
}

/* One whole block of 64 values from its 32 bytes: the nibbles looked up in
 * the 16-entry code table with one permute (AVX-512) or two and a blend
 * (AVX2), times the block's absmax, rounded to dt. */
#if defined(__AVX512F__)
/* v rounded to dt and back (bf16: to nearest even, as qt_f32_to_bf16 for the
 * finite values a code times an absmax is; f16: F16C's conversion) */
static inline __m512 round16_512(__m512 v, qt_dtype dt) {
    if (dt == QT_BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
    }
    if (dt == QT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}
static void block64_avx512(float *out, const uint8_t *p, const float *code, float am, qt_dtype dt) {
    __m512 tab = _mm512_loadu_ps(code), s = _mm512_set1_ps(am);
    for (int h = 0; h < 2; h++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 16 * h));
        __m512i v = _mm512_cvtepu8_epi32(b);
        __m512i hi = _mm512_srli_epi32(v, 4), lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
        __m512 a = _mm512_mul_ps(_mm512_permutexvar_ps(hi, tab), s); /* values 2i */
        __m512 c = _mm512_mul_ps(_mm512_permutexvar_ps(lo, tab), s); /* values 2i + 1 */
        /* interleave: out[2i] = a[i], out[2i+1] = c[i] */
        __m512i i0 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        __m512i i1 = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        __m512 r0 = _mm512_permutex2var_ps(a, i0, c), r1 = _mm512_permutex2var_ps(a, i1, c);
        _mm512_storeu_ps(out + 32 * h, round16_512(r0, dt));
        _mm512_storeu_ps(out + 32 * h + 16, round16_512(r1, dt));
    }
}
#endif
static inline __m256 round16_256(__m256 v, qt_dtype dt) {
    if (dt == QT_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (dt == QT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}
static void block64_avx2(float *out, const uint8_t *p, const float *code, float am, qt_dtype dt) {
    __m256 t0 = _mm256_loadu_ps(code), t1 = _mm256_loadu_ps(code + 8), s = _mm256_set1_ps(am);
    for (int k = 0; k < 4; k++) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * k)));
        __m256i hi = _mm256_srli_epi32(v, 4), lo = _mm256_and_si256(v, _mm256_set1_epi32(15));
        __m256 a = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, hi), _mm256_permutevar8x32_ps(t1, hi),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(hi, 28)));
        __m256 c = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, lo), _mm256_permutevar8x32_ps(t1, lo),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
        a = _mm256_mul_ps(a, s), c = _mm256_mul_ps(c, s);
        __m256 u0 = _mm256_unpacklo_ps(a, c), u1 = _mm256_unpackhi_ps(a, c);
        _mm256_storeu_ps(out + 16 * k, round16_256(_mm256_permute2f128_ps(u0, u1, 0x20), dt));
        _mm256_storeu_ps(out + 16 * k + 8, round16_256(_mm256_permute2f128_ps(u0, u1, 0x31), dt));
    }
}

#if defined(__AVX512F__)
static int simd_level = 2;
#else
static int simd_level = 1;
#endif
int qt_q4_set_simd(int level) {
    int was = simd_level;
#if defined(__AVX512F__)
    simd_level = level < 0 ? 0 : level > 2 ? 2 : level;
#else
    simd_level = level < 0 ? 0 : level > 1 ? 1 : level;
#endif
    return was;
}

int qt_q4_simd(void) { return simd_level; }

void qt_q4_view(const qt_q4_weight *w, const void *w_at, const void *view_at, uint64_t row0, uint64_t rows,
                qt_q4_weight *view) {
    *view = *w;
    const int64_t d = (int64_t)((intptr_t)w_at - (intptr_t)view_at);
    view->packed_off += d, view->absmax_off += d;
    if (w->nested) view->absmax2_off += d;
    view->e0 = w->e0 + row0 * w->cols;
    view->rows = rows;
    view->bytes = sizeof *view;
}

void qt_q4_dequantize(const qt_q4_weight *w, size_t e0, size_t e1, float *out) {
    const uint8_t *p = qt_q4_packed(w);
    size_t bs = w->blocksize;
    qt_dtype dt = (qt_dtype)w->dtype;
    /* e counts in the data's numbering; out[0] is its value base */
    const size_t base = e0 + w->e0;
    e1 += w->e0;
    size_t e = base;
    while (e < e1) {
        size_t b = e / bs, end = (b + 1) * bs < e1 ? (b + 1) * bs : e1;
        float am = qt_q4_block_absmax(w, b);
        if (simd_level && bs == 64 && e == b * bs && end == e + 64) {
#if defined(__AVX512F__)
            if (simd_level == 2) block64_avx512(out + (e - base), p + e / 2, w->code, am, dt);
            else
#endif
                block64_avx2(out + (e - base), p + e / 2, w->code, am, dt);
            e = end;
            continue;
        }
        for (; e < end; e++) {
            uint8_t byte = p[e / 2];
            out[e - base] = round_dt(w->code[(e & 1) ? byte & 15 : byte >> 4] * am, dt);
        }
    }
}

int qt_q4_check(const qt_q4_weight *w, size_t bytes, const char *what) {
    if (bytes < sizeof *w || w->magic != QT_Q4_MAGIC)
        return QT_ERR(QT_EINVAL, "%s is not a 4-bit weight block", what);
    if (w->bytes == sizeof *w) return QT_OK; /* a view: its data was checked with the block it points into */
    if (w->type > QT_Q4_FP4 || w->blocksize < 2 || (w->blocksize & (w->blocksize - 1)) || w->blocksize > 4096 ||
        (w->nested && w->blocksize2 != QT_Q4_BLOCK2) || w->bytes != bytes ||
        w->bytes != qt_q4_bytes(w->rows, w->cols, (int)w->blocksize, (int)w->nested))
        return QT_ERR(QT_EINVAL, "%s: its 4-bit block's header does not match its %zu bytes", what, bytes);
    return QT_OK;
}
