/* Every call of dist/transport.h under real mpirun (tests/dist/test_dist.py
 * runs it at 1, 2, 3 and 4 ranks): values that say where each element came
 * from, checked exactly on every rank, blocking and non-blocking (several in
 * flight, completed in another order than started). Prints "transport ok"
 * on rank 0, or the first wrong element and exits 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "dist/dist.h"
#include "dist/transport.h"

static int N, me, bad;

static void expect(const char *what, size_t i, float got, float want) {
    if (got != want && !bad++)
        fprintf(stderr, "transport_check: rank %d: %s[%zu] = %g, expected %g\n", me, what, i, got, want);
}

#define TRY(x)                                                                         \
    do {                                                                               \
        if ((x) != QT_OK) {                                                            \
            fprintf(stderr, "transport_check: rank %d: %s\n", me, qt_error_message()); \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

int main(int argc, char **argv) {
    dist_ctx *d;
    if (dist_init(&argc, &argv, &d) != QT_OK) return 1;
    N = dist_world(d);
    me = dist_rank(d);
    enum { C = 1001 }; /* odd: no power-of-two luck */
    float *a = malloc(sizeof(float) * C * 4), *b = malloc(sizeof(float) * C * 4), *big = malloc(sizeof(float) * C * N);
    float *rs = malloc(sizeof(float) * C * N), *ag = malloc(sizeof(float) * C * N);
    /* all-reduce (non-blocking, two in flight) */
    for (int i = 0; i < C; i++) a[i] = (float)(me + 1) * i, b[i] = (float)me;
    tp_req *q[4] = {0};
    TRY(tp_allreduce_f32(d, a, C, &q[0], "check a"));
    TRY(tp_allreduce_f32(d, b, C, &q[1], "check b"));
    TRY(tp_wait(d, &q[1], 1, "check b")); /* the second first */
    TRY(tp_wait(d, &q[0], 1, "check a"));
    float s1 = (float)N * (N + 1) / 2, s0 = (float)N * (N - 1) / 2;
    for (int i = 0; i < C; i++) expect("allreduce a", i, a[i], s1 * i), expect("allreduce b", i, b[i], s0);
    /* reduce to each root in turn, in place at the root, all in flight */
    float *red = malloc(sizeof(float) * C * N);
    for (int r = 0; r < N; r++) {
        float *x = red + (size_t)r * C;
        for (int i = 0; i < C; i++) x[i] = (float)(me * 100 + r + i);
    }
    tp_req **rq = calloc((size_t)N, sizeof *rq);
    for (int r = 0; r < N; r++) {
        float *x = red + (size_t)r * C;
        TRY(tp_reduce_f32(d, x, r == me ? x : NULL, C, r, &rq[r], "check reduce"));
    }
    TRY(tp_wait(d, rq, N, "check reduce"));
    for (int i = 0; i < C; i++) expect("reduce", i, red[(size_t)me * C + i], 100.0f * s0 + (float)N * (me + i));
    /* reduce-scatter of equal partitions: partition p of rank r holds r + p*1000 + i */
    for (int p = 0; p < N; p++)
        for (int i = 0; i < C; i++) big[(size_t)p * C + i] = (float)(me + p * 1000 + i);
    TRY(tp_reduce_scatter_f32(d, big, rs, C, NULL, "check reduce-scatter"));
    for (int i = 0; i < C; i++) expect("reduce-scatter", i, rs[i], s0 + (float)N * (me * 1000 + i));
    /* all-gather, out of place and in place */
    for (int i = 0; i < C; i++) a[i] = (float)(me * 10000 + i);
    TRY(tp_allgather_f32(d, a, ag, C, &q[2], "check all-gather"));
    TRY(tp_wait(d, &q[2], 1, "check all-gather"));
    for (int r = 0; r < N; r++)
        for (int i = 0; i < C; i++) expect("allgather", i, ag[(size_t)r * C + i], (float)(r * 10000 + i));
    memset(ag, 0, sizeof(float) * C * N);
    for (int i = 0; i < C; i++) ag[(size_t)me * C + i] = (float)(me * 10000 + i);
    TRY(tp_allgather_f32(d, ag + (size_t)me * C, ag, C, NULL, "check all-gather in place"));
    for (int r = 0; r < N; r++)
        for (int i = 0; i < C; i++) expect("allgather in place", i, ag[(size_t)r * C + i], (float)(r * 10000 + i));
    /* broadcast from the last rank */
    for (int i = 0; i < C; i++) a[i] = me == N - 1 ? (float)(7 * i) : -1.0f;
    TRY(tp_bcast(d, a, sizeof(float) * C, N - 1, NULL, "check bcast"));
    for (int i = 0; i < C; i++) expect("bcast", i, a[i], (float)(7 * i));
    /* gatherv / scatterv with unequal parts (rank r sends r + 1 values) */
    size_t *cnt = calloc((size_t)N, sizeof *cnt), *dsp = calloc((size_t)N, sizeof *dsp), tot = 0;
    for (int r = 0; r < N; r++) cnt[r] = (size_t)r + 1, dsp[r] = tot, tot += cnt[r];
    for (size_t i = 0; i < cnt[me]; i++) a[i] = (float)(me * 100 + (int)i);
    TRY(tp_gatherv_f32(d, a, cnt[me], b, cnt, dsp, NULL, "check gatherv"));
    if (me == 0)
        for (int r = 0; r < N; r++)
            for (size_t i = 0; i < cnt[r]; i++) expect("gatherv", dsp[r] + i, b[dsp[r] + i], (float)(r * 100 + (int)i));
    if (me == 0)
        for (size_t i = 0; i < tot; i++) b[i] = (float)(3 * i);
    TRY(tp_scatterv_f32(d, b, cnt, dsp, a, cnt[me], NULL, "check scatterv"));
    for (size_t i = 0; i < cnt[me]; i++) expect("scatterv", i, a[i], (float)(3 * (dsp[me] + i)));
    TRY(tp_barrier(d, 5.0, "check barrier"));
    /* one verdict for the job */
    int64_t nbad = bad;
    TRY(dist_allreduce_i64(d, &nbad, 1, DIST_SUM, "check verdict"));
    tp_stats st;
    tp_get_stats(d, &st);
    if (me == 0) {
        if (nbad) printf("transport FAILED on %lld elements\n", (long long)nbad);
        else printf("transport ok (%ld calls)\n", st.calls);
    }
    free(a), free(b), free(big), free(rs), free(ag), free(red), free(rq), free(cnt), free(dsp);
    dist_finalize(d);
    return nbad ? 1 : 0;
}
