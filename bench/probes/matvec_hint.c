/* One-row bf16 matrix-vector kernel variants on one 1 GiB product (rows of
 * IN), each thread its half in chunks of about 1 MiB of rows read as two
 * streams (op_matvec.c's layout), against a plain read of the same buffer in
 * the same layout (variant 9). Session 15 used it to find where the kernel
 * lost to a plain read (bench/RESULTS-decode.md, "Session 15").
 *   gcc -O3 -march=native -fopenmp bench/probes/matvec_hint.c -o /tmp/matvec_hint
 *   R=8 OMP_NUM_THREADS=2 /tmp/matvec_hint IN V:D ...   (V:D pairs as pick() lists; GB/s per variant per round)
 * Variants (pick() lists the V:D pairs built): 0:0 the kernel (one
 * accumulator chain per row), 1:0 even and odd chains, 2:D chains + a T0 hint
 * D bytes ahead (2048, 4096, 8192), 3:2048 chains + NTA, 4:4096 one chain +
 * T0, 5:8192 chains + T1; loads and adds only: 6:0 (a store a row), 14:0 (a
 * 64-byte store a row), 15:0 (no store), 10:0 (IN fixed at 896, the row loop
 * unrolled); 11:0 the chains kernel so unrolled; 16:0-20:0 the kernel with its
 * row loop unrolled 4, 7 (IN fixed), 28 (IN fixed), 2, and not (IN fixed);
 * 21:0-25:0 its loads left to the compiler to fold into the ALU and FMA
 * operations (21 x, 22 w, 23 both, 24 x with a T0 hint 4 KiB ahead, 25
 * neither: the kernel's form); 9:0 the plain read. Session 16 added: 7:0
 * the widening and adds (no x, no FMA), 8:0 the widening and FMAs by
 * constants (no x loads); 26:D the kernel with a T1 hint D bytes ahead (4096
 * to 32768), 27:D with T2 (8192, 16384); and, where the compiler targets
 * AVX512_BF16, 30:0-32:0 vdpbf16ps against x split into 1, 2 or 3 bf16
 * parts (3 parts hold x exactly), one accumulator per part and row. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <sys/mman.h>
#include <immintrin.h>
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define IR(v) __asm__("" : "+v"(v))
static inline void pair(const uint16_t *w, __m512 *e, __m512 *o) {
    __m512i v = _mm512_loadu_si512(w); IR(v);
    *e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* V: 0 current (one chain per row), 1 split chains, 2 split + prefetch T0 D, 3 split + NTA D, 4 current + T0 D, 5 split + prefetcht1 D */
static __thread float scr[16 * 64] __attribute__((aligned(64)));
static inline __attribute__((always_inline)) void rows2(int V, int D, const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) {
    int half = (r1 - r0) / 2;
    __m512 tot = _mm512_setzero_ps();
    for (int k = 0; k < half; k++) {
        const uint16_t *wa = w + (size_t)(r0 + half + k) * in, *wb = w + (size_t)(r0 + k) * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < in; i += 32) {
            if (V == 2 || V == 4) { _mm_prefetch((const char *)(wa + i) + D, _MM_HINT_T0); _mm_prefetch((const char *)(wb + i) + D, _MM_HINT_T0); }
            if (V == 3) { _mm_prefetch((const char *)(wa + i) + D, _MM_HINT_NTA); _mm_prefetch((const char *)(wb + i) + D, _MM_HINT_NTA); }
            if (V == 26) { _mm_prefetch((const char *)(wa + i) + D, _MM_HINT_T1); _mm_prefetch((const char *)(wb + i) + D, _MM_HINT_T1); }
            if (V == 27) { _mm_prefetch((const char *)(wa + i) + D, _MM_HINT_T2); _mm_prefetch((const char *)(wb + i) + D, _MM_HINT_T2); }
            if (V == 5) { _mm_prefetch((const char *)(wa + i) + D, _MM_HINT_T1); _mm_prefetch((const char *)(wb + i) + D, _MM_HINT_T1); }
            if (V == 6 || V == 14 || V == 15) { a0 = _mm512_add_ps(a0, _mm512_loadu_ps((const float *)(wa + i))); a1 = _mm512_add_ps(a1, _mm512_loadu_ps((const float *)(wb + i))); continue; }
            __m512 e0, o0, e1, o1; pair(wa + i, &e0, &o0); pair(wb + i, &e1, &o1);
            if (V == 7) { a0 = _mm512_add_ps(a0, e0); a2 = _mm512_add_ps(a2, o0); a1 = _mm512_add_ps(a1, e1); a3 = _mm512_add_ps(a3, o1); continue; }
            if (V == 8) { const __m512 ce = _mm512_set1_ps(0.5f), co = _mm512_set1_ps(0.25f); a0 = _mm512_fmadd_ps(e0, ce, a0); a2 = _mm512_fmadd_ps(o0, co, a2); a1 = _mm512_fmadd_ps(e1, ce, a1); a3 = _mm512_fmadd_ps(o1, co, a3); continue; }
            __m512 xe = _mm512_loadu_ps(xd + i), xo = _mm512_loadu_ps(xd + i + 16); IR(xe); IR(xo);
            if (V == 0 || V == 4 || V == 26 || V == 27) { a0 = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, a0)); a1 = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, a1)); }
            else { a0 = _mm512_fmadd_ps(e0, xe, a0); a2 = _mm512_fmadd_ps(o0, xo, a2); a1 = _mm512_fmadd_ps(e1, xe, a1); a3 = _mm512_fmadd_ps(o1, xo, a3); }
        }
        if (V == 15) { tot = _mm512_add_ps(tot, _mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3))); continue; }
        if (V == 14) { _mm512_store_ps(scr + 16 * ((k * 2) & 63), _mm512_add_ps(a0, a2)); _mm512_store_ps(scr + 16 * ((k * 2 + 1) & 63), _mm512_add_ps(a1, a3)); continue; }
        out[r0 + half + k] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a2));
        out[r0 + k] = _mm512_reduce_add_ps(_mm512_add_ps(a1, a3));
    }
    if (V == 15) out[r0] = _mm512_reduce_add_ps(tot);
}
/* V 10: loads+adds with IN a constant 896 and the row loop fully unrolled; V 11: the full split kernel likewise */
static inline __attribute__((always_inline)) void rows2c(int V, const uint16_t *w, const float *xd, float *out, int r0, int r1) {
    enum { in = 896 };
    int half = (r1 - r0) / 2;
    for (int k = 0; k < half; k++) {
        const uint16_t *wa = w + (size_t)(r0 + half + k) * in, *wb = w + (size_t)(r0 + k) * in;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 28
        for (size_t i = 0; i < in; i += 32) {
            if (V == 10) { a0 = _mm512_add_ps(a0, _mm512_loadu_ps((const float *)(wa + i))); a1 = _mm512_add_ps(a1, _mm512_loadu_ps((const float *)(wb + i))); continue; }
            __m512 e0, o0, e1, o1; pair(wa + i, &e0, &o0); pair(wb + i, &e1, &o1);
            __m512 xe = _mm512_loadu_ps(xd + i), xo = _mm512_loadu_ps(xd + i + 16); IR(xe); IR(xo);
            a0 = _mm512_fmadd_ps(e0, xe, a0); a2 = _mm512_fmadd_ps(o0, xo, a2); a1 = _mm512_fmadd_ps(e1, xe, a1); a3 = _mm512_fmadd_ps(o1, xo, a3);
        }
        out[r0 + half + k] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a2));
        out[r0 + k] = _mm512_reduce_add_ps(_mm512_add_ps(a1, a3));
    }
}
#define VV(v, d) static __attribute__((noinline)) void r_##v##_##d(const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) { rows2(v, d, w, xd, out, in, r0, r1); }
VV(26,4096) VV(26,8192) VV(26,16384) VV(26,32768) VV(27,8192) VV(27,16384) VV(0,0) VV(1,0) VV(2,2048) VV(2,4096) VV(2,8192) VV(3,2048) VV(4,4096) VV(5,8192) VV(6,0) VV(14,0) VV(15,0) VV(7,0) VV(8,0)
static __attribute__((noinline)) void r_10_0(const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) { (void)in; rows2c(10, w, xd, out, r0, r1); }
static __attribute__((noinline)) void r_11_0(const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) { (void)in; rows2c(11, w, xd, out, r0, r1); }

/* full kernel, one chain per row (current op), IN constant 896, unroll U */
#define FULLC(NAME, U, CONST_IN) static __attribute__((noinline)) void NAME(const uint16_t *w, const float *xd, float *out, size_t in_, int r0, int r1) { \
    const size_t in = CONST_IN ? 896 : in_; int half = (r1 - r0) / 2; \
    for (int k = 0; k < half; k++) { \
        const uint16_t *wa = w + (size_t)(r0 + half + k) * in, *wb = w + (size_t)(r0 + k) * in; \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0; \
        _Pragma(U) for (size_t i = 0; i < in; i += 32) { \
            __m512 e0, o0, e1, o1; pair(wa + i, &e0, &o0); pair(wb + i, &e1, &o1); \
            __m512 xe = _mm512_loadu_ps(xd + i), xo = _mm512_loadu_ps(xd + i + 16); IR(xe); IR(xo); \
            a0 = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, a0)); a1 = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, a1)); } \
        out[r0 + half + k] = _mm512_reduce_add_ps(a0); out[r0 + k] = _mm512_reduce_add_ps(a1); } }
FULLC(r_16_0, "GCC unroll 4", 0)
FULLC(r_17_0, "GCC unroll 7", 1)
FULLC(r_18_0, "GCC unroll 28", 1)
FULLC(r_19_0, "GCC unroll 2", 0)
FULLC(r_20_0, "GCC unroll 1", 1)

/* the kernel's ops with memory operands left to the compiler (no IN_REGISTER): FOLDW lets the w line fold, FOLDX the x loads */
static inline void pair_nr(const uint16_t *w, __m512 *e, __m512 *o) {
    __m512i v = _mm512_loadu_si512(w);
    *e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#define FOLD(NAME, FOLDW, FOLDX, PFD) static __attribute__((noinline)) void NAME(const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) { \
    int half = (r1 - r0) / 2; \
    for (int k = 0; k < half; k++) { \
        const uint16_t *wa = w + (size_t)(r0 + half + k) * in, *wb = w + (size_t)(r0 + k) * in; \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0; \
        for (size_t i = 0; i < in; i += 32) { \
            if (PFD) { _mm_prefetch((const char *)(wa + i) + PFD, _MM_HINT_T0); _mm_prefetch((const char *)(wb + i) + PFD, _MM_HINT_T0); } \
            __m512 e0, o0, e1, o1; \
            if (FOLDW) { pair_nr(wa + i, &e0, &o0); pair_nr(wb + i, &e1, &o1); } else { pair(wa + i, &e0, &o0); pair(wb + i, &e1, &o1); } \
            __m512 xe = _mm512_loadu_ps(xd + i), xo = _mm512_loadu_ps(xd + i + 16); if (!FOLDX) { IR(xe); IR(xo); } \
            a0 = _mm512_fmadd_ps(o0, xo, _mm512_fmadd_ps(e0, xe, a0)); a1 = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, a1)); } \
        out[r0 + half + k] = _mm512_reduce_add_ps(a0); out[r0 + k] = _mm512_reduce_add_ps(a1); } }
FOLD(r_21_0, 0, 1, 0)
FOLD(r_22_0, 1, 0, 0)
FOLD(r_23_0, 1, 1, 0)
FOLD(r_24_0, 0, 1, 4096)
FOLD(r_25_0, 0, 0, 0)

#if defined(__AVX512BF16__)
/* dpbf16 variants: x split into K bf16 parts (interleaved natural order), one accumulator per part per row */
static __m512bh xs[3][65536 / 32] __attribute__((aligned(64)));
static void split_x(const float *x, int in) {
    for (int i = 0; i < in; i += 32) {
        __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
        __m512bh h = _mm512_cvtne2ps_pbh(hi, lo);
        /* residuals */
        __m512 hlo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&h)), 16));
        __m512 hhi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&h + 1)), 16));
        __m512 rlo = _mm512_sub_ps(lo, hlo), rhi = _mm512_sub_ps(hi, hhi);
        __m512bh m = _mm512_cvtne2ps_pbh(rhi, rlo);
        __m512 mlo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&m)), 16));
        __m512 mhi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&m + 1)), 16));
        __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(rhi, mhi), _mm512_sub_ps(rlo, mlo));
        xs[0][i / 32] = h, xs[1][i / 32] = m, xs[2][i / 32] = l;
    }
}
#define DPV(NAME, K) static __attribute__((noinline)) void NAME(const uint16_t *w, const float *xd, float *out, size_t in, int r0, int r1) { \
    (void)xd; int half = (r1 - r0) / 2; \
    for (int k = 0; k < half; k++) { \
        const uint16_t *wa = w + (size_t)(r0 + half + k) * in, *wb = w + (size_t)(r0 + k) * in; \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0; \
        for (size_t i = 0; i < in; i += 32) { \
            __m512bh va = (__m512bh)_mm512_loadu_si512(wa + i), vb = (__m512bh)_mm512_loadu_si512(wb + i); \
            a0 = _mm512_dpbf16_ps(a0, va, xs[0][i / 32]); a1 = _mm512_dpbf16_ps(a1, vb, xs[0][i / 32]); \
            if (K > 1) { b0 = _mm512_dpbf16_ps(b0, va, xs[1][i / 32]); b1 = _mm512_dpbf16_ps(b1, vb, xs[1][i / 32]); } \
            if (K > 2) { c0 = _mm512_dpbf16_ps(c0, va, xs[2][i / 32]); c1 = _mm512_dpbf16_ps(c1, vb, xs[2][i / 32]); } } \
        out[r0 + half + k] = _mm512_reduce_add_ps(_mm512_add_ps(a0, _mm512_add_ps(b0, c0))); \
        out[r0 + k] = _mm512_reduce_add_ps(_mm512_add_ps(a1, _mm512_add_ps(b1, c1))); } }
DPV(r_30_0, 1)
DPV(r_31_0, 2)
DPV(r_32_0, 3)
#define HAVE_DP 1
#else
#define HAVE_DP 0
static void split_x(const float *x, int in) { (void)x, (void)in; }
#endif
typedef void (*rf)(const uint16_t *, const float *, float *, size_t, int, int);
static rf pick(int V, int D) {
#define P(v, d) if (V == v && D == d) return r_##v##_##d;
    P(26,4096) P(26,8192) P(26,16384) P(26,32768) P(27,8192) P(27,16384) P(0,0) P(1,0) P(2,2048) P(2,4096) P(2,8192) P(3,2048) P(4,4096) P(5,8192) P(6,0) P(14,0) P(15,0) P(7,0) P(8,0) P(10,0) P(11,0) P(21,0) P(22,0) P(23,0) P(24,0) P(25,0) P(16,0) P(17,0) P(18,0) P(19,0) P(20,0)
#if HAVE_DP
    P(30,0) P(31,0) P(32,0)
#endif
    return NULL;
}
int main(int argc, char **argv) {
    int IN = argc > 1 ? atoi(argv[1]) : 896; size_t bytes = (size_t)1 << 30; int OUT = (int)(bytes / 2 / IN) / 16 * 16;
    bytes = (size_t)OUT * IN * 2;
    char *wm = mmap(0, bytes + (4 << 21), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint16_t *w = (uint16_t *)(((size_t)wm + (1 << 21) - 1) & ~((size_t)(1 << 21) - 1)); madvise(w, bytes, MADV_HUGEPAGE);
#pragma omp parallel for
    for (size_t i = 0; i < bytes / 2; i++) w[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24));
    float *x = aligned_alloc(64, 4 * 65536), *out = aligned_alloc(64, 4 * (size_t)OUT);
    for (int i = 0; i < 65536; i++) x[i] = (i % 13) * 0.1f - 0.6f;
    split_x(x, IN); int nv = argc - 2; 
    for (int r = 0; r < (getenv("R") ? atoi(getenv("R")) : 3); r++) {
        printf("IN %d", IN);
        for (int a = 0; a < nv; a++) {
            int V, D; sscanf(argv[2 + a], "%d:%d", &V, &D);
            double t0 = now_s();
            if (V == 9) { float z = 0;
#pragma omp parallel reduction(+:z)
                { int t = omp_get_thread_num(), T = omp_get_num_threads(); size_t per = bytes / T, b = t * per, cf = 1 << 20, ps = cf / 2;
                  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
                  for (size_t c0 = 0; c0 + cf <= per; c0 += cf) { const char *p = (const char *)w + b + c0;
                    for (size_t i = 0; i < ps; i += 64) { s0 = _mm512_add_ps(s0, _mm512_load_ps((const float *)(p + i))); s1 = _mm512_add_ps(s1, _mm512_load_ps((const float *)(p + ps + i))); } }
                  z += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)); }
                if (z < 0) puts("");
            } else { rf f = pick(V, D); if (!f) return 1;
#pragma omp parallel
                { int t = omp_get_thread_num(), T = omp_get_num_threads(); int per = OUT / T / 16 * 16, b = t * per, e = t == T - 1 ? OUT : b + per;
                  int rows = (int)((1 << 20) / ((size_t)IN * 2)) / 16 * 16;
                  for (int c = b; c < e; c += rows) f(w, x, out, IN, c, c + rows < e ? c + rows : e); }
            }
            double t1 = now_s() - t0;
            printf("  %s %.1f", argv[2 + a], bytes / t1 / 1e9);
        }
        printf("\n");
    }
}
