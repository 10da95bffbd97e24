/* Matrix-vector products for decoding: out (N, OUT) = alpha * x (N, IN) W^T
 * + bias, for the few rows N of one decode step (1, or --batch N sequences
 * decoding together). A one-row sgemm packs the whole weight before using each
 * element once (the profile of a 0.5B decode step: 75% in OpenBLAS's
 * packing); here each weight element is read exactly once, in its stored
 * dtype, and the step runs at the memory bandwidth. bf16 and f16 weights are
 * read as 2 bytes and widened in registers (bf16: a 16-bit shift; f16: F16C's
 * vcvtph2ps), so a 2-byte model moves half the bytes of an f32 one; 4-bit
 * ones (QLoRA's base) as their packed codes, looked up in registers (rows_q4).
 *
 * Threads take chunks of output rows as they go (no reduction between
 * threads; on a shared machine a thread that is descheduled does not hold
 * the step up for its whole static half), even threads from the first row
 * up and odd ones from the last row down, so each reads its own end of the
 * matrix, and they meet in quarter pieces so they finish together; a small
 * product runs on the calling thread, where the fork would cost more than
 * the work. Several products of one input (a layer's q/k/v, its gate/up:
 * op_matvec_many) run as one job over their rows together, so a thread goes
 * on to the next product's rows without waiting at each product's end, and
 * small ones are shared out with the rest. Inside a decode step the threads
 * are the held team's (team.h: a job handed to threads spinning in one
 * region, not a region per product).
 * One input row runs a loop of its own (dot_one) with the tile's
 * operations. The kernel is a register tile of weight rows from both halves
 * of the thread's chunk (one of each for one input row, two adjacent of each
 * for more) x up to 4 input rows: each weight line is loaded (and widened)
 * once and multiplied into every input row, so N rows cost one read of W
 * from memory (more than 4 input rows re-read the tile's weight rows from
 * L1/L2, not from memory). Each (weight row, input row) dot product has its
 * own accumulators and a fixed order of operations, whatever the tile, the
 * chunk, the thread count or N, so a row's result is bit-identical whether
 * it decodes alone or in a batch. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/op_simd.h"
#include "backend/cpu/ops.h"
#include "core/quant4.h"

/* below this many bytes of W the product runs on the calling thread: waking
 * the team and splitting 2 threads' chunks cost more than they save (the
 * 0.5B shape's k/v products read faster on one thread, its q/o on two;
 * bench/RESULTS-decode.md) */
#define MATVEC_MIN_PARALLEL_BYTES ((size_t)512 << 10)
#define ROW_ALIGN 16
/* bytes of W a thread takes at a time: each chunk is read as two streams
 * that start cold, so larger chunks read faster, while several chunks per
 * thread let the other thread take a descheduled one's share (the sizes
 * measured: bench/RESULTS-decode.md) */
#define MATVEC_CHUNK ((size_t)1 << 20)
#define MATVEC_CHUNKS_PER_THREAD 2
/* The middle team x MATVEC_CHUNK bytes of a product (where the threads from
 * either end meet) are taken in pieces of 1 / MATVEC_TAIL_SPLIT of a chunk.
 * At each product's end the thread that finds nothing left waits for the
 * others' last piece; quarter pieces bring the threads' finishing times
 * closer than whole chunks, and closer than eighths gain
 * (bench/RESULTS-decode.md, "Quarter tails"). */
#define MATVEC_TAIL_SPLIT 4
/* Software prefetch distance in bytes of W, used with more than one input
 * row (and for one row's long rows in f32 and f16, below): with 4 or 8 rows
 * each line carries 8-16 FMAs, the loop fills the core's window, and without
 * the hint W is read markedly slower (bench/RESULTS-decode.md). */
#define MATVEC_AHEAD 8192
/* Rows of at least this many bytes are long rows: with one input row, a
 * long row (the 0.5B down projection's 4864 bf16, whose x is 19 KiB) reads
 * faster with a hint, while the 896-long rows of the other products lost a
 * little by it (2-byte ones split over threads take MATVEC_AHEAD_ONE's
 * now; bench/RESULTS-decode.md). */
#define MATVEC_LONG_ROW 4096
/* ... and for bf16 (the line-pair loop) the hint is non-temporal and nearer.
 * A long row's x no longer stays in L1 (32 KiB) on its own: a pass over two
 * rows of 4864 bf16 reads 19 KiB of weights between two uses of the same
 * line of x's 19 KiB, and with the weights brought into L1 as any line, x is
 * evicted every pass. The NTA hint brings the weights in as the first lines
 * to go. 2 KiB ahead was the best distance; for f16 (widened from half
 * lines) NTA lost and f32 was level, so they keep T0 (the figures:
 * bench/RESULTS-decode.md, "The down projection: x evicted from L1"). */
#define MATVEC_AHEAD_PAIRS 2048
/* One input row's shorter rows of 2-byte weights in a product split over
 * threads: a T0 hint 4 KiB ahead, which bench_matvec measured faster than
 * the hardware prefetcher alone for bf16 and f16 on 2 threads, and slower
 * where it is not used (1 thread, f32); through generate the gain is within
 * the noise (bench/RESULTS.md). */
#define MATVEC_AHEAD_ONE 4096

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
 * f32), multiplied by x's even and odd elements: a load, two ALU ops and two
 * FMAs per 64 bytes, against two widening loads, two shifts and two FMAs.
 * x is de-interleaved once per call (pairs_of_x: each block of 32 becomes
 * its 16 even elements, then its 16 odd ones), not once per weight line:
 * with 8 input rows (--batch 8) the two permutes per line and input row
 * bound the step (bench/RESULTS.md, "Figures that stood in code comments").
 * x_pair does it in registers where the buffer cannot be had. */
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
#ifndef BF16_PAIRS
#define BF16_PAIRS 0 /* bf16 widened a vector at a time, as f16 */
#endif

/* input rows per tile: 4 weight rows x 4 input rows fill half of AVX-512's
 * 32 registers with accumulators; AVX2 has 16, so 2 input rows there */
#if LANES == 8
#define NB_MAX 2
#else
#define NB_MAX 4
#endif

static inline size_t es_of(qt_dtype dt) { return dt == QT_F32 ? 4 : 2; }

static inline float w_at(const void *w, qt_dtype dt, size_t i) {
    if (dt == QT_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return dt == QT_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
}

/* The tile: NR (1, 2 or 4) weight rows rows[0 .. NR-1] times input rows
 * x[0 .. NB-1] (row stride IN) into dot[j * NB_MAX + n]. Each (row, input
 * row) dot product is one f32 vector accumulator over IN (bf16 on AVX-512: a
 * line's even weights, then its odd ones, into it), its lanes summed in a
 * fixed order, then the scalar tail: the same operations for a row whatever
 * the tile, the chunk, the thread count or N, so a row's result is
 * bit-identical whether it decodes alone or in a batch. NR, NB and dt are
 * constants wherever it is inlined, so the accumulators live in registers
 * and the loads carry no branch. xd: x de-interleaved (XD, a constant: bf16
 * pairs read it). PF: prefetch the weight rows MATVEC_AHEAD bytes ahead. */
static inline __attribute__((always_inline)) void dot_tile(float *dot, const float *x, const float *xd, int XD,
                                                           const void *w, qt_dtype dt, size_t in, const int *rows,
                                                           int NR, int NB, int PF) {
    const size_t es = es_of(dt);
    size_t b[4];
    for (int j = 0; j < NR; j++) b[j] = (size_t)rows[j] * in;
    (void)xd, (void)XD; /* read by the AVX-512 bf16 pairs only */
#if LANES
    vf acc[4][NB_MAX];
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) acc[j][n] = vzero();
    size_t i0 = 0;
#if BF16_PAIRS
    if (dt == QT_BF16) { /* whole lines of 2 * LANES weights, then the loop below for what is left */
        const size_t pair_end = in / (2 * LANES) * (2 * LANES);
        for (size_t i = 0; i < pair_end; i += 2 * LANES) {
            if (PF)
                for (int j = 0; j < NR; j++)
                    _mm_prefetch((const char *)((const uint16_t *)w + b[j] + i) + MATVEC_AHEAD, _MM_HINT_T0);
            vf we[4], wo[4];
            for (int j = 0; j < NR; j++) bf16_pair(w, b[j] + i, &we[j], &wo[j]);
            for (int n = 0; n < NB; n++) {
                vf xe, xo;
                if (XD) {
                    xe = vload_x(xd + (size_t)n * in + i), xo = vload_x(xd + (size_t)n * in + i + LANES);
                    IN_REGISTER(xe);
                    IN_REGISTER(xo);
                } else x_pair(x + (size_t)n * in + i, &xe, &xo);
                for (int j = 0; j < NR; j++) acc[j][n] = vfma(wo[j], xo, vfma(we[j], xe, acc[j][n]));
            }
        }
        i0 = pair_end;
    }
#endif
    const size_t vec_end = in / LANES * LANES;
    for (size_t i = i0; i < vec_end; i += LANES) {
        if (PF && (i * es) % 64 == 0) /* once per 64-byte line: every f32 step of AVX-512, every other step else */
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)w + (b[j] + i) * es + MATVEC_AHEAD, _MM_HINT_T0);
        vf wv[4];
        for (int j = 0; j < NR; j++) wv[j] = vload_w(w, dt, b[j] + i);
        for (int n = 0; n < NB; n++) {
            vf xv = vload_x(x + (size_t)n * in + i);
            IN_REGISTER(xv);
            for (int j = 0; j < NR; j++) acc[j][n] = vfma(wv[j], xv, acc[j][n]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) {
            float s = vsum(acc[j][n]);
            for (size_t i = vec_end; i < in; i++) s = fmaf(w_at(w, dt, b[j] + i), x[(size_t)n * in + i], s);
            dot[j * NB_MAX + n] = s;
        }
#else
    (void)PF, (void)es;
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) {
            float s = 0.0f;
            for (size_t i = 0; i < in; i++) s = fmaf(w_at(w, dt, b[j] + i), x[(size_t)n * in + i], s);
            dot[j * NB_MAX + n] = s;
        }
#endif
}

/* one tile of NR rows with NB (1..NB_MAX) input rows, specialised on NB */
static inline __attribute__((always_inline)) void dot_tile_nb(float *dot, const float *x, const float *xd, int XD,
                                                              const void *w, qt_dtype dt, size_t in, const int *rows,
                                                              int NR, int nb, int PF) {
    switch (nb) {
    case 1: dot_tile(dot, x, xd, XD, w, dt, in, rows, NR, 1, PF); break;
    case 2: dot_tile(dot, x, xd, XD, w, dt, in, rows, NR, 2, PF); break;
#if NB_MAX == 4
    case 3: dot_tile(dot, x, xd, XD, w, dt, in, rows, NR, 3, PF); break;
    case 4: dot_tile(dot, x, xd, XD, w, dt, in, rows, NR, 4, PF); break;
#endif
    }
}

/* One input row (every decode step without --batch): weight rows ra and, when
 * NR is 2, rb, each into one accumulator, with the operations of dot_tile
 * for NB = 1 in the same order (so the results are the tile's, bit for bit),
 * in a loop of its own. The tile's general bookkeeping (row and input-group
 * arrays, the dot[] hand-over) cost the one-row step 5-10% of its speed at 2
 * threads (bench/RESULTS-decode.md, "One input row runs its own loop"). xd: x de-interleaved for
 * the bf16 pairs when XD (a constant, as in dot_tile), else the pairs are
 * made in registers. */
static inline __attribute__((always_inline)) void dot_one(float *sa, float *sb, const float *x, const float *xd,
                                                          int XD, const void *w, qt_dtype dt, size_t in, size_t ba,
                                                          size_t bb, int NR, int PF) {
    /* PF: 0 no hint, 1 a short row's (T0, MATVEC_AHEAD_ONE), 2 a long row's (bf16 NTA MATVEC_AHEAD_PAIRS, else
     * T0 MATVEC_AHEAD) */
#if LANES
    const size_t es = es_of(dt);
    vf a0 = vzero(), a1 = vzero();
    size_t i0 = 0;
#if BF16_PAIRS
    if (dt == QT_BF16) {
        const size_t pair_end = in / (2 * LANES) * (2 * LANES);
        for (size_t i = 0; i < pair_end; i += 2 * LANES) {
            const uint16_t *wa = (const uint16_t *)w + ba + i, *wb = (const uint16_t *)w + bb + i;
            if (PF == 2) {
                _mm_prefetch((const char *)wa + MATVEC_AHEAD_PAIRS, _MM_HINT_NTA);
                if (NR == 2) _mm_prefetch((const char *)wb + MATVEC_AHEAD_PAIRS, _MM_HINT_NTA);
            } else if (PF == 1) {
                _mm_prefetch((const char *)wa + MATVEC_AHEAD_ONE, _MM_HINT_T0);
                if (NR == 2) _mm_prefetch((const char *)wb + MATVEC_AHEAD_ONE, _MM_HINT_T0);
            }
            vf e0, o0, e1, o1;
            bf16_pair(w, ba + i, &e0, &o0);
            if (NR == 2) bf16_pair(w, bb + i, &e1, &o1);
            vf xe, xo;
            if (XD) {
                xe = vload_x(xd + i), xo = vload_x(xd + i + LANES);
                IN_REGISTER(xe);
                IN_REGISTER(xo);
            } else x_pair(x + i, &xe, &xo);
            a0 = vfma(o0, xo, vfma(e0, xe, a0));
            if (NR == 2) a1 = vfma(o1, xo, vfma(e1, xe, a1));
        }
        i0 = pair_end;
    }
#else
    (void)xd, (void)XD;
#endif
    const size_t vec_end = in / LANES * LANES;
    for (size_t i = i0; i < vec_end; i += LANES) {
        if (PF && (i * es) % 64 == 0) {
            const size_t ahead = PF == 2 ? MATVEC_AHEAD : MATVEC_AHEAD_ONE;
            _mm_prefetch((const char *)w + (ba + i) * es + ahead, _MM_HINT_T0);
            if (NR == 2) _mm_prefetch((const char *)w + (bb + i) * es + ahead, _MM_HINT_T0);
        }
        vf wa = vload_w(w, dt, ba + i), wb = wa;
        if (NR == 2) wb = vload_w(w, dt, bb + i);
        vf xv = vload_x(x + i);
        IN_REGISTER(xv);
        a0 = vfma(wa, xv, a0);
        if (NR == 2) a1 = vfma(wb, xv, a1);
    }
    float s0 = vsum(a0), s1 = NR == 2 ? vsum(a1) : 0.0f;
    for (size_t i = vec_end; i < in; i++) {
        s0 = fmaf(w_at(w, dt, ba + i), x[i], s0);
        if (NR == 2) s1 = fmaf(w_at(w, dt, bb + i), x[i], s1);
    }
    *sa = s0;
    if (NR == 2) *sb = s1;
#else
    (void)xd, (void)XD, (void)PF;
    float s0 = 0.0f, s1 = 0.0f;
    for (size_t i = 0; i < in; i++) s0 = fmaf(w_at(w, dt, ba + i), x[i], s0);
    if (NR == 2)
        for (size_t i = 0; i < in; i++) s1 = fmaf(w_at(w, dt, bb + i), x[i], s1);
    *sa = s0;
    if (NR == 2) *sb = s1;
#endif
}

/* one result: *o = alpha * s + bias[r], or added to *o */
static inline void put(float *o, float s, float alpha, const float *bias, int r, int accumulate) {
    const float v = alpha * s + (bias ? bias[r] : 0.0f);
    *o = accumulate ? *o + v : v;
}

/* rows [r0, r1) of W against all N input rows, written to out (N, OUT). A
 * chunk is read as two sequential streams, its first half and its second
 * half side by side: one core then keeps more lines in flight than one
 * stream's prefetch gives it (0.5B shapes, 1 thread, means of 5 rounds: one
 * row at a time f32 32-35 GB/s, bf16 30-32; a row from each half 37-39 and
 * 36-39; a plain read of one stream 34-35, of two 39-40; in other runs 4
 * adjacent rows read side by side gave f32 25-32 and bf16 20-24). One input row: a tile is one row of each half
 * (two independent accumulator chains, enough to hide the FMA latency),
 * prefetched MATVEC_AHEAD_ONE ahead (a long row: MATVEC_AHEAD_PAIRS or
 * MATVEC_AHEAD). More input
 * rows: each weight line carries 2 x NB FMAs per row, the step is bound by
 * the arithmetic and the prefetch, so a tile is two adjacent rows of each
 * half (4 weight rows x 4 inputs, each x vector loaded once per 4 rows; with
 * 2 rows a tile, bf16 --batch 8 decoded 15-18% slower), prefetched. */
static inline __attribute__((always_inline)) void rows_dt(float *out, const float *x, const float *xd, int XD,
                                                          const void *w, qt_dtype dt, const float *bias, int N, int IN,
                                                          int OUT, float alpha, int accumulate, int r0, int r1,
                                                          int hint) {
    const size_t in = (size_t)IN;
    const int long_row = in * es_of(dt) >= MATVEC_LONG_ROW;
    const int G = N > 1 ? 2 : 1, half = (r1 - r0) / 2 / G * G, pf = N > 1 || long_row;
    if (N == 1) {
        for (int k = 0; k < r1 - r0 - half; k++) {
            const int ra = r0 + half + k, rb = r0 + k;
            float sa, sb = 0.0f;
            if (k >= half) dot_one(&sa, &sb, x, xd, XD, w, dt, in, (size_t)ra * in, 0, 1, 0);
            else if (long_row) dot_one(&sa, &sb, x, xd, XD, w, dt, in, (size_t)ra * in, (size_t)rb * in, 2, 2);
            else if (hint) dot_one(&sa, &sb, x, xd, XD, w, dt, in, (size_t)ra * in, (size_t)rb * in, 2, 1);
            else dot_one(&sa, &sb, x, xd, XD, w, dt, in, (size_t)ra * in, (size_t)rb * in, 2, 0);
            put(out + ra, sa, alpha, bias, ra, accumulate);
            if (k < half) put(out + rb, sb, alpha, bias, rb, accumulate);
        }
        return;
    }
    float dot[4 * NB_MAX];
    for (int k = 0; k < r1 - r0 - half; k += G) {
        int rows[4], nr = 0; /* 2G rows while the first half lasts (it is not longer than the second), then 1 or 2 */
        for (int g = 0; g < G && r0 + half + k + g < r1; g++) rows[nr++] = r0 + half + k + g;
        for (int g = 0; g < G && k + g < half; g++) rows[nr++] = r0 + k + g;
        for (int n0 = 0; n0 < N; n0 += NB_MAX) {
            const int nb = N - n0 < NB_MAX ? N - n0 : NB_MAX;
            const float *xn = x + (size_t)n0 * in, *xdn = XD ? xd + (size_t)n0 * in : NULL;
            /* the first input group prefetches; the others find the rows in cache */
            if (nr == 4 && n0 == 0) dot_tile_nb(dot, xn, xdn, XD, w, dt, in, rows, 4, nb, 1);
            else if (nr == 4) dot_tile_nb(dot, xn, xdn, XD, w, dt, in, rows, 4, nb, 0);
            else if (nr == 2 && pf && n0 == 0) dot_tile_nb(dot, xn, xdn, XD, w, dt, in, rows, 2, nb, 1);
            else if (nr == 2) dot_tile_nb(dot, xn, xdn, XD, w, dt, in, rows, 2, nb, 0);
            else dot_tile_nb(dot, xn, xdn, XD, w, dt, in, rows, 1, nb, 0);
            for (int j = 0; j < nr; j++)
                for (int n = 0; n < nb; n++) {
                    const int r = rows[j];
                    put(out + (size_t)(n0 + n) * OUT + r, dot[j * NB_MAX + n], alpha, bias, r, accumulate);
                }
        }
    }
}

/* A 4-bit weight (QT_Q4; core/quant4.h), read as stored: the dot products
 * are taken from the packed codes with no row buffer. Each byte's two codes
 * are looked up in the 16-entry code table held in one register (AVX-512:
 * one vpermps a 16 values, which reads only an index's low 4 bits, so the
 * low nibble needs no mask; AVX2: the table's two halves, a vpermps on each
 * and a blend on the index's bit 3). The high nibbles are the even values of
 * the row and the low ones the odd values, so x comes de-interleaved
 * (pairs_of_x: each 32 values' 16 even ones, then the 16 odd ones), made once
 * per product as for bf16.
 *
 * Summation order: a (row, input row) pair sums each block of 64 code x x
 * products into a block accumulator (the codes exactly as the table holds
 * them), and that vector is scaled by the block's float32 absmax into the
 * row's accumulator (one FMA a block, not a multiply a value): sum_b absmax_b
 * * (sum_i code_i x_i), where dequantize-then-dot sums (code_i x absmax_b,
 * rounded to the weight's dtype) x x_i. It is a different order of the same
 * products, and it skips the rounding of each dequantized value to the
 * weight's 16-bit dtype (2^-9 of the value at most for bf16, 2^-12 for f16;
 * none for f32): dequantize_4bit's values are not kept bit for bit. Each
 * pair has its own accumulators and a fixed order whatever the tile, N or
 * the thread count, so a row's result is bit-identical alone or in a batch;
 * the AVX-512, AVX2 and scalar paths differ in their lanes, so they agree to
 * rounding only. unit/test_matvec_q4 holds all three against an fp64 sum.
 *
 * A tile is a row from each half of the thread's chunk (two streams, as
 * rows_dt reads them) x up to Q4_NB input rows, the first input group
 * prefetching the rows Q4_AHEAD bytes ahead. Rows whose blocks do not start
 * and end on the row (IN not a multiple of 64, another blocksize) take
 * rows_q4_rowbuf. */
#define Q4_NB 4
#define Q4_AHEAD 2048

#if defined(__AVX512F__)
/* NR (1 or 2) weight rows, p[j] their packed codes and am[j] their blocks'
 * absmax, x NB (1..Q4_NB) input rows of xd (row stride in) into
 * dot[j * Q4_NB + n]; NR, NB and PF are constants where it is inlined */
static inline __attribute__((always_inline)) void q4_tile_512(float *dot, const float *xd, size_t in,
                                                              const uint8_t *const *p, const float *const *am,
                                                              const float *code, int NR, int NB, int PF) {
    const __m512 tab = _mm512_loadu_ps(code);
    __m512 acc[2][Q4_NB];
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) acc[j][n] = _mm512_setzero_ps();
    for (size_t k = 0; k < in / 64; k++) {
        if (PF && !(k & 1)) /* a 64-byte line of codes is two blocks */
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)p[j] + 32 * k + Q4_AHEAD, _MM_HINT_T0);
        __m512 bacc[2][Q4_NB];
        for (int h = 0; h < 2; h++) { /* the block's two halves of 32 values (16 bytes) */
            __m512 we[2], wo[2];
            for (int j = 0; j < NR; j++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p[j] + 32 * k + 16 * h)));
                we[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tab); /* high nibbles: values 2i */
                wo[j] = _mm512_permutexvar_ps(v, tab);                       /* low nibbles: values 2i + 1 */
            }
            for (int n = 0; n < NB; n++) {
                const float *xk = xd + (size_t)n * in + 64 * k + 32 * h;
                __m512 xe = _mm512_loadu_ps(xk), xo = _mm512_loadu_ps(xk + 16);
                IN_REGISTER(xe);
                IN_REGISTER(xo);
                for (int j = 0; j < NR; j++) {
                    bacc[j][n] = h ? _mm512_fmadd_ps(we[j], xe, bacc[j][n]) : _mm512_mul_ps(we[j], xe);
                    bacc[j][n] = _mm512_fmadd_ps(wo[j], xo, bacc[j][n]);
                }
            }
        }
        for (int j = 0; j < NR; j++) {
            const __m512 s = _mm512_set1_ps(am[j][k]);
            for (int n = 0; n < NB; n++) acc[j][n] = _mm512_fmadd_ps(bacc[j][n], s, acc[j][n]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) dot[j * Q4_NB + n] = _mm512_reduce_add_ps(acc[j][n]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define Q4_NB_256 2 /* 16 registers: 2 rows x 2 inputs of block and row accumulators, the table's halves */
static inline __m256 q4_look_256(__m256 t0, __m256 t1, __m256i i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, i), _mm256_permutevar8x32_ps(t1, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline float q4_hsum_256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* q4_tile_512's tile in 8 lanes, NB up to Q4_NB_256 (the same xd layout: 8
 * bytes give 8 even and 8 odd values of a half's 32) */
static inline __attribute__((always_inline)) void q4_tile_256(float *dot, const float *xd, size_t in,
                                                              const uint8_t *const *p, const float *const *am,
                                                              const float *code, int NR, int NB, int PF) {
    const __m256 t0 = _mm256_loadu_ps(code), t1 = _mm256_loadu_ps(code + 8);
    __m256 acc[2][Q4_NB_256];
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) acc[j][n] = _mm256_setzero_ps();
    for (size_t k = 0; k < in / 64; k++) {
        if (PF && !(k & 1))
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)p[j] + 32 * k + Q4_AHEAD, _MM_HINT_T0);
        __m256 bacc[2][Q4_NB_256];
        for (int g = 0; g < 4; g++) { /* 8 bytes: 16 values */
            /* x: the half's evens from 8 (g & 1) on, its odds 16 further */
            const size_t off = 64 * k + 32 * (g >> 1) + 8 * (g & 1);
            __m256 we[2], wo[2];
            for (int j = 0; j < NR; j++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p[j] + 32 * k + 8 * g)));
                we[j] = q4_look_256(t0, t1, _mm256_srli_epi32(v, 4));
                wo[j] = q4_look_256(t0, t1, v);
            }
            for (int n = 0; n < NB; n++) {
                const float *xk = xd + (size_t)n * in + off;
                __m256 xe = _mm256_loadu_ps(xk), xo = _mm256_loadu_ps(xk + 16);
                IN_REGISTER(xe);
                IN_REGISTER(xo);
                for (int j = 0; j < NR; j++) {
                    bacc[j][n] = g ? _mm256_fmadd_ps(we[j], xe, bacc[j][n]) : _mm256_mul_ps(we[j], xe);
                    bacc[j][n] = _mm256_fmadd_ps(wo[j], xo, bacc[j][n]);
                }
            }
        }
        for (int j = 0; j < NR; j++) {
            const __m256 s = _mm256_set1_ps(am[j][k]);
            for (int n = 0; n < NB; n++) acc[j][n] = _mm256_fmadd_ps(bacc[j][n], s, acc[j][n]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < NB; n++) dot[j * Q4_NB + n] = q4_hsum_256(acc[j][n]);
}
#endif

/* the portable path: one row, one input row (x as given), the same block sums */
static float q4_dot_scalar(const float *x, size_t in, const uint8_t *p, const float *am, const float *code) {
    float acc = 0.0f;
    for (size_t k = 0; k < in / 64; k++) {
        float b = 0.0f;
        for (size_t i = 0; i < 64; i++) {
            const uint8_t byte = p[32 * k + i / 2];
            b = fmaf(code[(i & 1) ? byte & 15 : byte >> 4], x[64 * k + i], b);
        }
        acc = fmaf(b, am[k], acc);
    }
    return acc;
}

/* one tile of NR rows and nb input rows through the path of level (qt_q4_simd) */
static inline __attribute__((always_inline)) void q4_tile(float *dot, const float *x, const float *xd, size_t in,
                                                          const uint8_t *const *p, const float *const *am,
                                                          const float *code, int NR, int nb, int PF, int level) {
#if defined(__AVX512F__)
    if (level == 2) {
        switch (nb) {
        case 1: q4_tile_512(dot, xd, in, p, am, code, NR, 1, PF); return;
        case 2: q4_tile_512(dot, xd, in, p, am, code, NR, 2, PF); return;
        case 3: q4_tile_512(dot, xd, in, p, am, code, NR, 3, PF); return;
        default: q4_tile_512(dot, xd, in, p, am, code, NR, 4, PF); return;
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (level >= 1) {
        for (int n0 = 0; n0 < nb; n0 += Q4_NB_256) {
            const float *xn = xd + (size_t)n0 * in;
            if (nb - n0 == 1) q4_tile_256(dot + n0, xn, in, p, am, code, NR, 1, PF && !n0);
            else q4_tile_256(dot + n0, xn, in, p, am, code, NR, 2, PF && !n0);
        }
        return;
    }
#endif
    (void)xd, (void)PF, (void)level;
    for (int j = 0; j < NR; j++)
        for (int n = 0; n < nb; n++) dot[j * Q4_NB + n] = q4_dot_scalar(x + (size_t)n * in, in, p[j], am[j], code);
}

/* The row-buffer path for the rows the fused one does not take: each row
 * dequantized once into this thread's buffer (qt_q4_dequantize's values),
 * then dotted with the N inputs in fp32. */
static void rows_q4_rowbuf(float *out, const float *x, const qt_q4_weight *q, const float *bias, int N, int IN,
                           int OUT, float alpha, int accumulate, int r0, int r1) {
    static __thread float *buf;
    static __thread size_t cap;
    if (cap < (size_t)IN) {
        free(buf);
        buf = malloc((size_t)IN * sizeof(float));
        cap = buf ? (size_t)IN : 0;
        if (!buf) abort(); /* a row of floats; the op has no way to report, and continuing would be wrong */
    }
    for (int r = r0; r < r1; r++) {
        qt_q4_dequantize(q, (size_t)r * IN, (size_t)(r + 1) * IN, buf);
        for (int n = 0; n < N; n++) {
            const float *xn = x + (size_t)n * IN;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < IN; i++) acc += xn[i] * buf[i];
            put(out + (size_t)n * OUT + r, acc, alpha, bias, r, accumulate);
        }
    }
}

/* rows [r0, r1) of a 4-bit W against the N input rows (xd: x de-interleaved, NULL where it could not be made) */
static void rows_q4(float *out, const float *x, const float *xd, const void *w, const float *bias, int N, int IN,
                    int OUT, float alpha, int accumulate, int r0, int r1) {
    const qt_q4_weight *q = w;
    const size_t in = (size_t)IN, nb = in / 64;
    const int level = qt_q4_simd();
    if (q->blocksize != 64 || in % 64 || q->e0 % 64 || (level && !xd)) {
        rows_q4_rowbuf(out, x, q, bias, N, IN, OUT, alpha, accumulate, r0, r1);
        return;
    }
    static __thread float *abuf; /* nested: two rows' absmax decoded */
    static __thread size_t acap;
    if (q->nested && acap < 2 * nb) {
        free(abuf);
        abuf = malloc(2 * nb * sizeof(float));
        acap = abuf ? 2 * nb : 0;
        if (!abuf) abort(); /* as rows_q4_rowbuf's buffer */
    }
    const uint8_t *packed = qt_q4_packed(q);
    const int half = (r1 - r0) / 2;
    float dot[2 * Q4_NB];
    for (int k = 0; k < r1 - r0 - half; k++) {
        const int rows[2] = {r0 + half + k, r0 + k}, nr = k < half ? 2 : 1;
        const uint8_t *p[2] = {NULL, NULL};
        const float *am[2] = {NULL, NULL};
        for (int j = 0; j < nr; j++) {
            const size_t e = q->e0 + (size_t)rows[j] * in;
            p[j] = packed + e / 2;
            am[j] = qt_q4_absmax_run(q, e / 64, nb, q->nested ? abuf + (size_t)j * nb : NULL);
        }
        for (int n0 = 0; n0 < N; n0 += Q4_NB) {
            const int nbk = N - n0 < Q4_NB ? N - n0 : Q4_NB;
            const float *xn = x + (size_t)n0 * in, *xdn = xd ? xd + (size_t)n0 * in : NULL;
            if (nr == 2 && !n0) q4_tile(dot, xn, xdn, in, p, am, q->code, 2, nbk, 1, level);
            else if (nr == 2) q4_tile(dot, xn, xdn, in, p, am, q->code, 2, nbk, 0, level);
            else q4_tile(dot, xn, xdn, in, p, am, q->code, 1, nbk, !n0, level);
            for (int j = 0; j < nr; j++)
                for (int n = 0; n < nbk; n++)
                    put(out + (size_t)(n0 + n) * OUT + rows[j], dot[j * Q4_NB + n], alpha, bias, rows[j], accumulate);
        }
    }
}

/* hint: one input row's short rows take MATVEC_AHEAD_ONE's hint (2-byte
 * weights, a product split over threads; see there) */
static void matvec_rows(float *out, const float *x, const float *xd, const void *w, qt_dtype dt, const float *bias,
                        int N, int IN, int OUT, float alpha, int accumulate, int r0, int r1, int hint) {
    switch (dt) {
    case QT_F32: rows_dt(out, x, NULL, 0, w, QT_F32, bias, N, IN, OUT, alpha, accumulate, r0, r1, 0); break;
    case QT_F16: rows_dt(out, x, NULL, 0, w, QT_F16, bias, N, IN, OUT, alpha, accumulate, r0, r1, hint); break;
    case QT_BF16:
        if (xd && BF16_PAIRS) rows_dt(out, x, xd, 1, w, QT_BF16, bias, N, IN, OUT, alpha, accumulate, r0, r1, hint);
        else rows_dt(out, x, NULL, 0, w, QT_BF16, bias, N, IN, OUT, alpha, accumulate, r0, r1, hint);
        break;
    case QT_Q4: rows_q4(out, x, xd, w, bias, N, IN, OUT, alpha, accumulate, r0, r1); break;
    case QT_U8: break; /* file bytes, never a weight */
    }
}

/* x (N, IN) with each whole block of 32 de-interleaved (evens, then odds:
 * the layout of the AVX-512 bf16 pairs and of the 4-bit rows), in this
 * thread's buffer, kept between calls (a decode step makes ~170 calls); NULL
 * where there is no such block or no memory for it (the bf16 kernel then
 * de-interleaves in registers, same values, same results; 4-bit rows take
 * the row buffer). */
static const float *pairs_of_x(const float *x, int N, int IN) {
    static __thread float *buf;
    static __thread size_t cap;
    const size_t pair_end = (size_t)IN / 32 * 32, need = (size_t)N * (size_t)IN;
    if (!pair_end) return NULL;
    if (need > cap) {
        size_t bytes = (need * sizeof(float) + 63) / 64 * 64;
        float *nb = aligned_alloc(64, bytes);
        if (!nb) return NULL;
        free(buf);
        buf = nb, cap = bytes / sizeof(float);
    }
    for (int n = 0; n < N; n++)
        for (size_t i = 0; i < pair_end; i += 32) {
            float *b = buf + (size_t)n * IN + i;
            const float *xi = x + (size_t)n * IN + i;
#if BF16_PAIRS
            vf e, o;
            x_pair(xi, &e, &o);
            _mm512_storeu_ps(b, e);
            _mm512_storeu_ps(b + 16, o);
#else
            for (int k = 0; k < 16; k++) b[k] = xi[2 * k], b[16 + k] = xi[2 * k + 1];
#endif
        }
    return buf;
}

/* A job's products (one input, one IN) as one matrix of OUT rows, the sum of
 * theirs: row v is product k's row v - (the rows before product k). Its
 * chunks are claimed by the threads of the job (op_team_job); a chunk that
 * spans two products runs as a piece of each. */
typedef struct {
    const qt_matvec_out *o;
    int count;
    const float *x, *xd;
    int N, IN, OUT, accumulate;
    float alpha;
    int per, tper, nf, mid0, mid1, n_mid, n; /* the chunk layout (mv_run) */
    int taken, up, down;                     /* claims so far: in all, from the first row, from the last */
} mv_job;

/* rows [r0, r1) of the job's matrix */
static void mv_rows(const mv_job *j, int r0, int r1, int hint) {
    int first = 0;
    for (int k = 0; k < j->count && first < r1; first += j->o[k].OUT, k++) {
        const qt_matvec_out *o = &j->o[k];
        const int a = r0 > first ? r0 - first : 0, b = r1 - first < o->OUT ? r1 - first : o->OUT;
        if (a < b)
            matvec_rows(o->out, j->x, j->xd, o->w, o->wdt, o->bias, j->N, j->IN, o->OUT, j->alpha, j->accumulate, a, b,
                        hint);
    }
}

static void mv_chunks(void *arg, int tid, int nth) {
    mv_job *j = arg;
    const int from_top = tid & 1;
    for (;;) {
        int t, c;
#pragma omp atomic capture
        t = j->taken++;
        if (t >= j->n) break;
        if (from_top) {
#pragma omp atomic capture
            c = j->down++;
            c = j->n - 1 - c;
        } else {
#pragma omp atomic capture
            c = j->up++;
        }
        int r0, r1;
        if (c < j->nf) r0 = c * j->per, r1 = r0 + j->per;
        else if (c < j->nf + j->n_mid)
            r0 = j->mid0 + (c - j->nf) * j->tper, r1 = r0 + j->tper < j->mid1 ? r0 + j->tper : j->mid1;
        else r0 = j->mid1 + (c - j->nf - j->n_mid) * j->per, r1 = r0 + j->per < j->OUT ? r0 + j->per : j->OUT;
        mv_rows(j, r0, r1, nth > 1);
    }
}

static void mv_run(op_team *team, const float *x, int N, int IN, int count, const qt_matvec_out *o, float alpha,
                   int accumulate) {
    int OUT = 0, pairs = 0;
    size_t bytes = 0;
    for (int k = 0; k < count; k++) {
        OUT += o[k].OUT;
        bytes += (size_t)IN * (size_t)o[k].OUT * qt_dtype_size(o[k].wdt); /* 4-bit: counted a byte a value */
        pairs |= (BF16_PAIRS && o[k].wdt == QT_BF16) || o[k].wdt == QT_Q4;
    }
    if (N < 1 || OUT < 1) return;
    const int nth = op_team_size(team);
    mv_job j = {.o = o, .count = count, .x = x, .xd = pairs ? pairs_of_x(x, N, IN) : NULL, .N = N, .IN = IN,
                .OUT = OUT, .accumulate = accumulate, .alpha = alpha};
    if (bytes < MATVEC_MIN_PARALLEL_BYTES || nth == 1 || (!team && omp_in_parallel())) {
        mv_rows(&j, 0, OUT, 0);
        return;
    }
    /* chunks of about MATVEC_CHUNK bytes of W, at least MATVEC_CHUNKS_PER_THREAD per thread so a late thread's
     * share is taken by the others, in whole multiples of ROW_ALIGN rows (with OUT a multiple of 16, threads never
     * write the same cache line) */
    size_t chunks = bytes / MATVEC_CHUNK;
    if (chunks < (size_t)nth * MATVEC_CHUNKS_PER_THREAD) chunks = (size_t)nth * MATVEC_CHUNKS_PER_THREAD;
    size_t rows = ((size_t)OUT + chunks - 1) / chunks;
    rows = (rows + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int per = (int)rows;
    /* Chunk c in row order: nf whole chunks from row 0, then rows [mid0, mid1) in pieces of a quarter chunk, then
     * whole chunks to OUT. Even threads take them from the first up, odd ones from the last down; a claim on the
     * shared count comes first, so the two ends never take the same chunk. The threads meet in the quarters: a
     * thread that finds nothing left waits at the job's end for the other's last piece, a quarter of a chunk.
     * Each thread reads its own end of the matrix, not every other chunk of it: faster on two threads
     * (bench/RESULTS-decode.md, bench_matvec). */
    int n_whole = (int)(((size_t)OUT + rows - 1) / rows) - nth;
    if (n_whole < 0) n_whole = 0;
    const int nf = n_whole / 2, nb = n_whole - nf, mid0 = nf * per;
    const int mid1 = OUT - nb * per > mid0 ? OUT - nb * per : mid0;
    const int tper = (per / MATVEC_TAIL_SPLIT + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    const int n_mid = (mid1 - mid0 + tper - 1) / tper;
    j.per = per, j.tper = tper, j.nf = nf, j.mid0 = mid0, j.mid1 = mid1, j.n_mid = n_mid;
    j.n = nf + n_mid + (OUT - mid1 + per - 1) / per;
    op_team_run(team, mv_chunks, &j);
}

void op_matvec(float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN, int OUT,
               float alpha, int accumulate) {
    op_matvec_team(NULL, out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate);
}

void op_matvec_team(op_team *team, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
                    int IN, int OUT, float alpha, int accumulate) {
    const qt_matvec_out o = {.out = out, .w = w, .wdt = wdt, .bias = bias, .OUT = OUT};
    mv_run(team, x, N, IN, 1, &o, alpha, accumulate);
}

void op_matvec_many(op_team *team, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    mv_run(team, x, N, IN, count, o, 1.0f, 0);
}
