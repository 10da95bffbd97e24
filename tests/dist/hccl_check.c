/* dist/transport.h's device collectives on the Ascend backend ("npu") under
 * real mpirun (tests/dist/test_hccl_mpi.py), with $QTUNE_ASCEND_LIB naming
 * the stand-in of CANN (acl_standin.c + hccl_standin.c): dist_set_backend
 * starts HCCL, and all-reduce, reduce to each root (in place at the root),
 * reduce-scatter, all-gather (out of place and in place) and broadcast run
 * on device buffers, blocking and several in flight, checked exactly on
 * every rank against the sums MPI gives (transport_check.c's values); then
 * gatherv/scatterv and the barrier, which stay on MPI; then ZeRO stage 2 on
 * the NPU's memory (zero.c: the gradients reduced to their owners in buckets,
 * the norm, the parameters all-gathered). Rank 0 prints
 * "transport HCCL" (or MPI under QTUNE_DIST_TRANSPORT=mpi), a checksum of
 * every result and "hccl ok", or the first wrong element and exits 1.
 * --hang-rank R: rank R sleeps instead of entering the first all-reduce, so
 * the others must end at the collective deadline naming it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/device.h"
#include "core/error.h"
#include "dist/dist.h"
#include "dist/transport.h"

static int N, me, bad;
static qt_backend *be;
static double checksum;

#define TRY(x)                                                                      \
    do {                                                                            \
        if ((x) != QT_OK) {                                                         \
            fprintf(stderr, "hccl_check: rank %d: %s\n", me, qt_error_message());   \
            return 1;                                                               \
        }                                                                           \
    } while (0)

static float *dev(const float *host, size_t n) {
    float *p = qt_be_alloc(be, QT_MEM_DEVICE, n * sizeof(float), "a check buffer");
    if (!p) exit(1);
    if (host) qt_be_upload(be, p, host, n * sizeof(float));
    return p;
}
/* the device buffer's n values against want(i) */
static void expect(const char *what, const float *d, size_t n, float (*want)(size_t i, int arg), int arg) {
    float *h = malloc(n * sizeof(float));
    qt_be_download(be, h, d, n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        checksum += h[i] * (double)((i % 7) + 1);
        if (h[i] != want(i, arg) && !bad++)
            fprintf(stderr, "hccl_check: rank %d: %s[%zu] = %g, expected %g\n", me, what, i, h[i], want(i, arg));
    }
    free(h);
}

enum { C = 1001 }; /* odd: no power-of-two luck */
static float s0(void) { return (float)N * (N - 1) / 2; }
static float w_ar_a(size_t i, int arg) { return (float)N * (N + 1) / 2 * i; }
static float w_ar_b(size_t i, int arg) { return s0(); }
static float w_red(size_t i, int r) { return 100.0f * s0() + (float)N * (r + (float)i); }
static float w_rs(size_t i, int arg) { return s0() + (float)N * (me * 1000 + (float)i); }
static float w_ag(size_t i, int arg) { return (float)((i / C) * 10000 + i % C); }
static float w_bc(size_t i, int arg) { return (float)(7 * i); }

int main(int argc, char **argv) {
    dist_ctx *d;
    int hang = -1;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--hang-rank")) hang = atoi(argv[++i]);
    if (dist_init(&argc, &argv, &d) != QT_OK) return 1;
    N = dist_world(d);
    me = dist_rank(d);
    /* "npu" without a number: the card of this rank's local rank (one host here: its rank), as HCCL wants */
    qt_device card;
    TRY(qt_device_resolve("npu", "hccl_check", &card));
    if (N > 1 && card.index != me) {
        fprintf(stderr, "hccl_check: rank %d: \"npu\" resolved to card %d, not its local rank's\n", me, card.index);
        return 1;
    }
    TRY(qt_backend_open_index("npu", card.index, &be));
    TRY(dist_set_backend(d, be));
    if (me == 0) printf("transport %s\n", dist_transport_name(d));
    float *h = malloc(sizeof(float) * C * N), *g = malloc(sizeof(float) * C * N);

    /* all-reduce: two in flight, completed in the other order */
    if (me == hang) sleep(600);
    for (int i = 0; i < C; i++) h[i] = (float)(me + 1) * i, g[i] = (float)me;
    float *a = dev(h, C), *b = dev(g, C);
    tp_req *q[2] = {0};
    TRY(tp_allreduce_f32(d, a, C, &q[0], "check a"));
    TRY(tp_allreduce_f32(d, b, C, &q[1], "check b"));
    TRY(tp_wait(d, &q[1], 1, "check b"));
    TRY(tp_wait(d, &q[0], 1, "check a"));
    expect("allreduce a", a, C, w_ar_a, 0);
    expect("allreduce b", b, C, w_ar_b, 0);

    /* reduce to each root in turn, in place at the root, all in flight */
    float **red = calloc((size_t)N, sizeof *red);
    tp_req **rq = calloc((size_t)N, sizeof *rq);
    for (int r = 0; r < N; r++) {
        for (int i = 0; i < C; i++) h[i] = (float)(me * 100 + r + i);
        red[r] = dev(h, C);
        TRY(tp_reduce_f32(d, red[r], r == me ? red[r] : NULL, C, r, &rq[r], "check reduce"));
    }
    TRY(tp_wait(d, rq, N, "check reduce"));
    expect("reduce", red[me], C, w_red, me);

    /* reduce-scatter: partition p of rank r holds r + p*1000 + i */
    for (int p = 0; p < N; p++)
        for (int i = 0; i < C; i++) h[(size_t)p * C + i] = (float)(me + p * 1000 + i);
    float *big = dev(h, (size_t)C * N), *rs = dev(NULL, C);
    TRY(tp_reduce_scatter_f32(d, big, rs, C, NULL, "check reduce-scatter"));
    expect("reduce-scatter", rs, C, w_rs, 0);

    /* all-gather, out of place, then in place */
    for (int i = 0; i < C; i++) h[i] = (float)(me * 10000 + i);
    float *mine = dev(h, C), *ag = dev(NULL, (size_t)C * N);
    TRY(tp_allgather_f32(d, mine, ag, C, NULL, "check all-gather"));
    expect("allgather", ag, (size_t)C * N, w_ag, 0);
    for (size_t i = 0; i < (size_t)C * N; i++) g[i] = i / C == (size_t)me ? (float)(me * 10000 + i % C) : -1.0f;
    qt_be_upload(be, ag, g, sizeof(float) * C * N);
    TRY(tp_allgather_f32(d, ag + (size_t)me * C, ag, C, NULL, "check all-gather in place"));
    expect("allgather in place", ag, (size_t)C * N, w_ag, 0);

    /* broadcast from the last rank */
    for (int i = 0; i < C; i++) h[i] = me == N - 1 ? (float)(7 * i) : -1.0f;
    float *bc = dev(h, C);
    TRY(tp_bcast(d, bc, sizeof(float) * C, N - 1, NULL, "check bcast"));
    expect("bcast", bc, C, w_bc, 0);

    /* gatherv / scatterv (MPI, through host copies) and the barrier */
    size_t *cnt = calloc((size_t)N, sizeof *cnt), *dsp = calloc((size_t)N, sizeof *dsp), tot = 0;
    for (int r = 0; r < N; r++) cnt[r] = (size_t)r + 1, dsp[r] = tot, tot += cnt[r];
    for (size_t i = 0; i < cnt[me]; i++) h[i] = (float)(me * 100 + (int)i);
    float *part = dev(h, cnt[me]);
    TRY(tp_gatherv_f32(d, part, cnt[me], g, cnt, dsp, NULL, "check gatherv"));
    if (me == 0)
        for (int r = 0; r < N; r++)
            for (size_t i = 0; i < cnt[r]; i++)
                if (g[dsp[r] + i] != (float)(r * 100 + (int)i) && !bad++)
                    fprintf(stderr, "hccl_check: gatherv[%zu] = %g\n", dsp[r] + i, g[dsp[r] + i]);
    if (me == 0)
        for (size_t i = 0; i < tot; i++) g[i] = (float)(3 * i);
    TRY(tp_scatterv_f32(d, g, cnt, dsp, part, cnt[me], NULL, "check scatterv"));
    qt_be_download(be, h, part, cnt[me] * sizeof(float));
    for (size_t i = 0; i < cnt[me]; i++)
        if (h[i] != (float)(3 * (dsp[me] + i)) && !bad++) fprintf(stderr, "hccl_check: scatterv[%zu] = %g\n", i, h[i]);
    TRY(tp_barrier(d, 5.0, "check barrier"));

    /* HCCL takes device memory only: a host buffer is refused when queued (HCCL_E_PARA from the stand-in, as
     * hccl.h's "data address of the operator" is the card's), on every rank, before anything moves */
    if (!strcmp(dist_transport_name(d), "HCCL")) {
        float host[4] = {0};
        if (tp_allreduce_f32(d, host, 4, NULL, "a host buffer") != QT_EDIST || !strstr(qt_error_message(), "HCCL_E_PARA")) {
            if (!bad++) fprintf(stderr, "hccl_check: rank %d: a host buffer was not refused (%s)\n", me, qt_error_message());
        }
        qt_error_clear();
    }

    /* ZeRO stage 2 on the NPU's memory: the gradient block reduced to its owners in buckets (HcclReduce, several
     * in flight), the norm over the shards, then the parameters all-gathered in place (HcclAllGather) */
    {
        const size_t n = 5003; /* odd, 3 buckets: shards and buckets cut each other */
        zero_opts zo = {.stage = 2, .bucket_elems = 2000, .be = be};
        zero_plan *plan = NULL;
        TRY(zero_plan_create(d, n, &zo, &plan));
        float *hg = malloc(n * sizeof(float)), *hp = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) hg[i] = (float)((me + 1) * (int)(i % 1000));
        float *grads = dev(hg, n), *params = dev(NULL, n);
        double sq;
        int overflow;
        TRY(dist_step_gradients(d, plan, grads, &sq, &overflow));
        size_t lo, hi;
        zero_opt_range(plan, &lo, &hi);
        qt_be_download(be, hg, grads, n * sizeof(float));
        double want_sq = 0;
        for (size_t i = 0; i < n; i++) {
            const double g = (double)N * (N + 1) / 2 * (double)(i % 1000);
            want_sq += g * g;
            if (i >= lo && i < hi && hg[i] != (float)g && !bad++)
                fprintf(stderr, "hccl_check: rank %d: zero-2 gradient[%zu] = %g, expected %g\n", me, i, hg[i], g);
        }
        if ((sq != want_sq || overflow) && !bad++)
            fprintf(stderr, "hccl_check: rank %d: zero-2 norm^2 %.17g (overflow %d), expected %.17g\n", me, sq,
                    overflow, want_sq);
        checksum += sq;
        for (size_t i = 0; i < n; i++) hp[i] = i >= lo && i < hi ? (float)i + 0.5f : -1.0f;
        qt_be_upload(be, params, hp, n * sizeof(float));
        TRY(dist_allgather_params(d, plan, params));
        qt_be_download(be, hp, params, n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            if (hp[i] != (float)i + 0.5f && !bad++)
                fprintf(stderr, "hccl_check: rank %d: zero-2 parameter[%zu] = %g after the all-gather\n", me, i, hp[i]);
        zero_plan_free(plan);
        free(hg), free(hp);
    }

    int64_t nbad = bad;
    TRY(dist_allreduce_i64(d, &nbad, 1, DIST_SUM, "check verdict"));
    double sums[1] = {checksum};
    TRY(dist_allreduce_f64(d, sums, 1, DIST_SUM, "check checksum"));
    if (me == 0) {
        printf("checksum %.17g\n", sums[0]);
        if (nbad) printf("hccl FAILED on %lld elements\n", (long long)nbad);
        else printf("hccl ok\n");
    }
    dist_set_backend(d, NULL);
    qt_backend_close(be);
    free(h), free(g), free(red), free(rq), free(cnt), free(dsp);
    dist_finalize(d);
    return nbad ? 1 : 0;
}
