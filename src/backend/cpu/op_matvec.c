/* Matrix-vector products for decoding: out (N, OUT) = alpha * x (N, IN) W^T
 * + bias, for the few rows N of one decode step (1, or --batch N sequences
 * decoding together). A one-row sgemm packs the whole weight before using each
 * element once (the profile of a 0.5B decode step: 75% in OpenBLAS's
 * packing); here each weight element is read exactly once, in its stored
 * dtype, and the step runs at the memory bandwidth. bf16 and f16 weights are
 * read as 2 bytes and widened in registers (bf16: a 16-bit shift; f16: F16C's
 * vcvtph2ps), so a 2-byte model moves half the bytes of an f32 one.
 *
 * Threads take chunks of output rows from a shared counter (no reduction
 * between threads; on a shared machine a thread that is descheduled does not
 * hold the step up for its whole static half); a small product runs on the
 * calling thread, where the fork would cost more than the work. The kernel
 * is a register tile of 4 weight rows x up to 4 input rows: the weight chunk
 * is loaded (and widened) once and multiplied into every input row, so N
 * rows cost one read of W from memory (more than 4 input rows re-read the 4
 * weight rows from L1/L2, not from memory). Each (weight row, input row)
 * dot product is one f32 vector accumulator over IN, its lanes summed in a
 * fixed order, then the tail: the same operations whatever the tile, the
 * chunk, the thread count or N, so a row's result is bit-identical whether
 * it decodes alone or in a batch. */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "backend/cpu/ops.h"

/* below this many weight elements the product runs on one thread (about 64 KiB
 * of f32: a few microseconds, the cost of waking the team) */
#define MATVEC_MIN_PARALLEL ((size_t)1 << 15)
#define ROW_ALIGN 16
/* bytes of W a thread takes at a time (a few times the prefetch distance) */
#define MATVEC_CHUNK ((size_t)256 << 10)
/* Software prefetch distance in bytes of W. One core keeps only as many lines
 * in flight as its instruction window reaches, and a 2-byte row brings half a
 * line per load: without the hint a bf16 matvec ran at about half the GB/s of
 * an f32 one. Measured on op_matvec alone (896 x 4864, 64 matrices, 1 thread,
 * the shared 2-core VM, best of 20, three alternating rounds): bf16 11-16.6 ->
 * 21-23.8 GB/s, f32 unchanged at 25-30. */
#ifndef MATVEC_AHEAD
#define MATVEC_AHEAD 8192
#endif

/* Keeps a loaded vector in its register: without it GCC folds the load into
 * every instruction that uses the value (x into each of the 4 rows' FMAs, a
 * bf16 line into both its shift and its mask), and the loads, not the FMAs,
 * then bound the loop: in L2, 4 rows of bf16 ran at 48 GB/s against 70 for
 * one load of x per 4 rows. */
#define IN_REGISTER(v) __asm__("" : "+v"(v))

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload_x(const float *x) { return _mm512_loadu_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vload_w(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (dt == QT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* bf16 a whole cache line at a time: 32 weights in one load, the even ones
 * widened by a shift and the odd ones by a mask (bf16 is the top half of an
 * f32), multiplied by x's even and odd elements (x de-interleaved once per
 * 4 weight rows): a load, two ALU ops and two FMAs per 64 bytes, against
 * two widening loads, two shifts and two FMAs. */
#define BF16_PAIRS 1
static inline void bf16_pair(const void *w, size_t i, vf *even, vf *odd) {
    __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)w + i));
    IN_REGISTER(v);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline void x_pair(const float *x, vf *even, vf *odd) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    vf lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    IN_REGISTER(lo);
    IN_REGISTER(hi);
    *even = _mm512_permutex2var_ps(lo, ie, hi);
    *odd = _mm512_permutex2var_ps(lo, io, hi);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LANES 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload_x(const float *x) { return _mm256_loadu_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
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

/* input rows per tile: 4 x 2 accumulators, 2 x vectors and 2 weight vectors
 * fit AVX2's 16 registers */
#define NB_MAX 4

static inline float w_at(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return dt == QT_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
}

/* The tile: weight row r times input rows x[0 .. NB-1] (row stride IN) into
 * dot[0 .. NB-1]. One weight row at a time: the rows of a chunk are then one
 * sequential stream, which the hardware prefetcher follows at the full read
 * bandwidth; a tile of 4 weight rows read side by side (4 streams 4 row
 * lengths apart) ran at 70-80% of it on this machine (f32 25-32 against 27-35
 * GB/s, bf16 17-24 against 25-34, same run). Each (row, input row) dot product
 * keeps two vector accumulators, so the FMAs of consecutive vectors do not
 * wait for each other (one accumulator bounds a bf16 line to two dependent
 * FMA latencies, about 8 bytes a cycle, below what memory delivers): f32, f16
 * and the AVX2 path send vector k of the row to accumulator k % 2; bf16 on
 * AVX-512 sends a line's even weights to the first and its odd ones to the
 * second. The accumulators are added, their lanes summed in a fixed order,
 * then the scalar tail. NB and dt are constants wherever it is inlined, so the
 * accumulators live in registers and the loads carry no branch. pf: prefetch
 * the weight stream (the first input group; the others find the row in
 * cache). */
static inline __attribute__((always_inline)) void dot_tile(float *dot, const float *x, const void *w, qt_dtype dt,
                                                           size_t in, int r, int NB, int pf) {
    const size_t es = dt == QT_F32 ? 4 : 2;
    const size_t b = (size_t)r * in;
    const char *wrow = (const char *)w + b * es;
#if LANES
    vf acc0[NB_MAX], acc1[NB_MAX];
    for (int n = 0; n < NB; n++) acc0[n] = vzero(), acc1[n] = vzero();
    size_t i0 = 0;
#ifdef BF16_PAIRS
    if (dt == QT_BF16) { /* whole lines of 2 * LANES weights, then the loops below for what is left */
        const size_t pair_end = in / (2 * LANES) * (2 * LANES);
        for (size_t i = 0; i < pair_end; i += 2 * LANES) {
            if (pf) _mm_prefetch(wrow + i * 2 + MATVEC_AHEAD, _MM_HINT_T0);
            vf we, wo;
            bf16_pair(w, b + i, &we, &wo);
            for (int n = 0; n < NB; n++) {
                vf xe, xo;
                x_pair(x + (size_t)n * in + i, &xe, &xo);
                acc0[n] = vfma(we, xe, acc0[n]);
                acc1[n] = vfma(wo, xo, acc1[n]);
            }
        }
        i0 = pair_end;
    }
#endif
    const size_t two_end = i0 + (in - i0) / (2 * LANES) * (2 * LANES);
    for (size_t i = i0; i < two_end; i += 2 * LANES) {
        if (pf) /* a hint: no fault past the end */
            for (size_t off = 0; off < 2 * LANES * es; off += 64) _mm_prefetch(wrow + i * es + MATVEC_AHEAD + off, _MM_HINT_T0);
        vf w0 = vload_w(w, dt, b + i), w1 = vload_w(w, dt, b + i + LANES);
        for (int n = 0; n < NB; n++) {
            vf x0 = vload_x(x + (size_t)n * in + i), x1 = vload_x(x + (size_t)n * in + i + LANES);
            acc0[n] = vfma(w0, x0, acc0[n]);
            acc1[n] = vfma(w1, x1, acc1[n]);
        }
    }
    const size_t vec_end = two_end + (in - two_end) / LANES * LANES; /* at most one more vector */
    if (vec_end > two_end) {
        vf w0 = vload_w(w, dt, b + two_end);
        for (int n = 0; n < NB; n++) acc0[n] = vfma(w0, vload_x(x + (size_t)n * in + two_end), acc0[n]);
    }
    for (int n = 0; n < NB; n++) {
        float s = vsum(vadd(acc0[n], acc1[n]));
        for (size_t i = vec_end; i < in; i++) s += w_at(w, dt, b + i) * x[(size_t)n * in + i];
        dot[n] = s;
    }
#else
    (void)pf, (void)wrow;
    for (int n = 0; n < NB; n++) {
        float s = 0.0f;
        for (size_t i = 0; i < in; i++) s += w_at(w, dt, b + i) * x[(size_t)n * in + i];
        dot[n] = s;
    }
#endif
}

/* one tile with NB (1..NB_MAX) input rows, specialised on it */
static inline __attribute__((always_inline)) void dot_tile_nb(float *dot, const float *x, const void *w, qt_dtype dt,
                                                              size_t in, int r, int nb, int pf) {
    switch (nb) {
    case 1: dot_tile(dot, x, w, dt, in, r, 1, pf); break;
    case 2: dot_tile(dot, x, w, dt, in, r, 2, pf); break;
    case 3: dot_tile(dot, x, w, dt, in, r, 3, pf); break;
    case 4: dot_tile(dot, x, w, dt, in, r, 4, pf); break;
    }
}

/* rows [r0, r1) of W against all N input rows, written to out (N, OUT) */
static inline __attribute__((always_inline)) void rows_dt(float *out, const float *x, const void *w, qt_dtype dt,
                                                          const float *bias, int N, int IN, int OUT, float alpha,
                                                          int accumulate, int r0, int r1) {
    const size_t in = (size_t)IN;
    float dot[NB_MAX];
    for (int r = r0; r < r1; r++)
        for (int n0 = 0; n0 < N; n0 += NB_MAX) {
            const int nb = N - n0 < NB_MAX ? N - n0 : NB_MAX;
            if (n0 == 0) dot_tile_nb(dot, x, w, dt, in, r, nb, 1); /* pf a constant in each copy */
            else dot_tile_nb(dot, x + (size_t)n0 * in, w, dt, in, r, nb, 0);
            for (int n = 0; n < nb; n++) {
                float *o = out + (size_t)(n0 + n) * OUT + r;
                float v = alpha * dot[n] + (bias ? bias[r] : 0.0f);
                *o = accumulate ? *o + v : v;
            }
        }
}

static void matvec_rows(float *out, const float *x, const void *w, qt_dtype dt, const float *bias, int N, int IN,
                        int OUT, float alpha, int accumulate, int r0, int r1) {
    switch (dt) {
    case QT_F32: rows_dt(out, x, w, QT_F32, bias, N, IN, OUT, alpha, accumulate, r0, r1); break;
    case QT_F16: rows_dt(out, x, w, QT_F16, bias, N, IN, OUT, alpha, accumulate, r0, r1); break;
    case QT_BF16: rows_dt(out, x, w, QT_BF16, bias, N, IN, OUT, alpha, accumulate, r0, r1); break;
    }
}

void op_matvec(float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN, int OUT,
               float alpha, int accumulate) {
    if (N < 1 || OUT < 1) return;
    const int team = omp_get_max_threads();
    const size_t elems = (size_t)IN * (size_t)OUT;
    if (elems < MATVEC_MIN_PARALLEL || team == 1 || omp_in_parallel()) {
        matvec_rows(out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate, 0, OUT);
        return;
    }
    /* chunks of about MATVEC_CHUNK bytes of W, at least 4 per thread so a late thread's share is taken by the
     * others, in whole multiples of ROW_ALIGN rows (with OUT a multiple of 16, threads never write the same cache line) */
    size_t chunks = elems * qt_dtype_size(wdt) / MATVEC_CHUNK;
    if (chunks < (size_t)team * 4) chunks = (size_t)team * 4;
    size_t rows = ((size_t)OUT + chunks - 1) / chunks;
    rows = (rows + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int per = (int)rows, n_chunks = (int)(((size_t)OUT + rows - 1) / rows);
#pragma omp parallel for schedule(dynamic, 1)
    for (int c = 0; c < n_chunks; c++) {
        const int r0 = c * per, r1 = OUT - r0 < per ? OUT : r0 + per;
        matvec_rows(out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate, r0, r1);
    }
}
