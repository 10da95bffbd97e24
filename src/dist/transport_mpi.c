/* transport.h over MPI (OpenMPI's non-blocking collectives), and the
 * single-process path (one rank, or a build without MPI) as local copies.
 *
 * The all-reduce is MPI_Iallreduce: libnbc's schedules (binomial reduce +
 * broadcast, ring, reduce-scatter + all-gather) compute each sum once and
 * send it to every rank, so every rank receives the same bits and replicated
 * weights never drift apart.
 * One MPI request per collective: several in flight start and match in the
 * same order on every rank, whatever order they complete in.
 *
 * Staged (dist_set_backend with a backend whose device memory the host cannot
 * read): each collective downloads its device input into a host copy, MPI
 * works on that, and once the request completes (note_done) the result is
 * uploaded to the device buffer; the gathers' and scatters' rank-0 buffer is
 * host memory already.
 *
 * HCCL (transport_hccl.c, ranks on Ascend NPUs): once dist_set_backend has
 * started it, the device collectives (all-reduce, reduce, reduce-scatter,
 * all-gather, broadcast) are queued there instead, and their requests are
 * polled through it; the deadline and the rest stay here. */
#include "dist/dist_internal.h"
#include "dist/transport.h"

#include "backend/backend.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/mem.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define TP_POLL_BURST 256 /* MPI_Test rounds per deadline tick in tp_wait */

struct tp_req {
    double t0;
    double bytes;
    int done;
#if QT_DIST_MPI
    MPI_Request r;
    int *counts, *displs; /* (N) each, gatherv/scatterv */
#endif
    /* staged: the host copy MPI works on, and what of it goes back to the device once done */
    qt_backend *be;
    void *host;
    void *up_dst;
    const void *up_src;
    size_t up_bytes;
    int64_t hccl_seq; /* > 0: a collective queued on HCCL's stream, done once the stream passed it */
    void *hccl_tmp;   /* a device buffer of that collective's, freed with the request */
};

int dist_set_backend(dist_ctx *d, qt_backend *be) {
    d->stage_be = be && !qt_be_desc(be)->host_reads_device ? be : NULL;
    if (d->hccl && (!be || be != d->stage_be)) dist_hccl_close(d);
    /* QTUNE_DIST_TRANSPORT=mpi keeps NPU ranks on MPI through host copies (slow: for a comparison, or a
     * machine whose HCCL does not start) */
    const char *tr = getenv("QTUNE_DIST_TRANSPORT");
    if (be && d->world > 1 && !d->hccl && !strcmp(qt_be_desc(be)->name, "npu") && !(tr && !strcmp(tr, "mpi")))
        return dist_hccl_open(d, be);
    return QT_OK;
}

size_t tp_runtime_bytes(int world) { return world > 1 ? (size_t)8 << 20 : 0; }

size_t tp_allreduce_temp_bytes(int world, int rank, size_t bytes) {
    if (world < 2) return 0;
    int receives = world == 2 || rank == 0 || (rank % 2 == 0 && rank + 1 < world);
    return receives ? bytes : 0;
}

size_t tp_reduce_temp_bytes(int world, size_t piece_bytes, int in_flight) {
    if (world < 2) return 0;
    if (world == 2) return piece_bytes; /* no tree: the root's receive buffer, in flight or not */
    return (in_flight ? 3 : 2) * piece_bytes;
}

void tp_get_stats(const dist_ctx *d, tp_stats *out) {
    memset(out, 0, sizeof *out);
    if (d) *out = d->tp;
}

static int check_count(size_t count, const char *what) {
    if (count > TP_MAX_COUNT)
        return QT_ERR(QT_EINVAL, "dist: %zu elements in one %s; the transport takes at most %zu, cut it into "
                                 "buckets", count, what, TP_MAX_COUNT);
    return QT_OK;
}

static void req_free(tp_req *q) {
    if (!q) return;
#if QT_DIST_MPI
    qt_free(q->counts);
#endif
    if (q->host) qt_be_free(q->be, q->host);
    if (q->hccl_tmp) qt_be_free(q->be, q->hccl_tmp);
    qt_free(q);
}

static void note_done(dist_ctx *d, tp_req *q) {
    if (q->done) return;
    q->done = 1;
    d->tp.busy_s += qt_now_s() - q->t0;
    if (q->up_dst) qt_be_upload(q->be, q->up_dst, q->up_src, q->up_bytes); /* a staged result */
}

/* Single process: the result is already in place (or one copy away). */
static int local_done(dist_ctx *d, tp_req **rq) {
    (void)d;
    if (rq) *rq = NULL;
    return QT_OK;
}

/* One rank (or nothing to move): the collective is recv = send, done at once. */
static int local_copy(dist_ctx *d, const float *send, float *recv, size_t count, tp_req **rq) {
    if (count && recv != send) {
        if (d->stage_be) qt_be_copy(d->stage_be, recv, send, count * sizeof(float));
        else memcpy(recv, send, count * sizeof(float));
    }
    return local_done(d, rq);
}

#if QT_DIST_MPI
static int req_new(dist_ctx *d, double bytes, tp_req **out) {
    tp_req *q = qt_calloc(1, sizeof *q, "a collective request");
    if (!q) return QT_ENOMEM;
    q->r = MPI_REQUEST_NULL;
    q->t0 = qt_now_s();
    q->bytes = bytes;
    d->tp.calls++;
    d->tp.bytes += bytes;
    *out = q;
    return QT_OK;
}

/* rq == NULL: the caller wants the blocking form. */
static int finish(dist_ctx *d, tp_req *q, tp_req **rq, const char *what) {
    if (rq) {
        *rq = q;
        return QT_OK;
    }
    return tp_wait(d, &q, 1, what);
}

/* Staged: q's host copy of bytes (freed with q), NULL when out of memory (q freed). */
static void *stage(dist_ctx *d, tp_req *q, size_t bytes) {
    q->be = d->stage_be;
    q->host = qt_be_alloc(q->be, QT_MEM_PINNED, bytes ? bytes : 64, "a collective's host copy");
    if (!q->host) req_free(q);
    return q->host;
}

/* Staged: what of q's host copy goes back to the device when q completes. */
static void stage_back(tp_req *q, void *dev, const void *host, size_t bytes) {
    q->up_dst = dev;
    q->up_src = host;
    q->up_bytes = bytes;
}

static int start_fail(dist_ctx *d, tp_req *q, int mrc, const char *call, const char *what) {
    req_free(q);
    return dist_mpi_fail(d, mrc, call, what);
}

/* A collective HCCL queued (rc: how queueing went): its request. */
static int hccl_req(dist_ctx *d, tp_req *q, int rc, int64_t seq, void *tmp, tp_req **rq, const char *what) {
    q->be = d->stage_be;
    q->hccl_tmp = tmp;
    if (rc != QT_OK) {
        req_free(q);
        return rc;
    }
    q->hccl_seq = seq;
    return finish(d, q, rq, what);
}

static int size_table(dist_ctx *d, tp_req *q, const size_t *counts, const size_t *displs) {
    int N = d->world;
    q->counts = qt_malloc(2 * (size_t)N * sizeof(int), "collective counts");
    if (!q->counts) return QT_ENOMEM;
    q->displs = q->counts + N;
    for (int r = 0; r < N; r++) {
        if (counts[r] > TP_MAX_COUNT || displs[r] > (size_t)INT_MAX)
            return QT_ERR(QT_EINVAL, "dist: a gather/scatter part of %zu at %zu is too large for one call; cut it",
                          counts[r], displs[r]);
        q->counts[r] = (int)counts[r];
        q->displs[r] = (int)displs[r];
    }
    return QT_OK;
}
#endif

int tp_allreduce_f32(dist_ctx *d, float *buf, size_t count, tp_req **rq, const char *what) {
    QT_TRY(check_count(count, what));
    if (d->world == 1 || count == 0) return local_done(d, rq);
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)count * 4, &q));
    if (d->hccl) {
        int64_t seq = 0;
        int rc = dist_hccl_allreduce(d, buf, count, &seq, what);
        return hccl_req(d, q, rc, seq, NULL, rq, what);
    }
    float *b = buf;
    if (d->stage_be) {
        if (!(b = stage(d, q, count * 4))) return QT_ENOMEM;
        qt_be_download(d->stage_be, b, buf, count * 4);
        stage_back(q, buf, b, count * 4);
    }
    int mrc = MPI_Iallreduce(MPI_IN_PLACE, b, (int)count, MPI_FLOAT, MPI_SUM, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Iallreduce", what);
    return finish(d, q, rq, what);
#else
    (void)buf;
    return local_done(d, rq);
#endif
}

int tp_reduce_f32(dist_ctx *d, const float *send, float *recv, size_t count, int root, tp_req **rq,
                  const char *what) {
    QT_TRY(check_count(count, what));
    if (root < 0 || root >= d->world)
        return QT_ERR(QT_EINVAL, "dist: reduce root %d is not a rank (world %d)", root, d->world);
    if (d->world == 1 || count == 0) return local_copy(d, send, recv, count, rq);
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)count * 4, &q));
    if (d->hccl) {
        int64_t seq = 0;
        void *tmp = NULL;
        int rc = dist_hccl_reduce(d, send, recv, count, root, &tmp, &seq, what);
        return hccl_req(d, q, rc, seq, tmp, rq, what);
    }
    const float *s = send;
    float *r = recv;
    int in_place = d->rank == root && send == recv;
    if (d->stage_be) { /* the root sums in place into its copy of send, then that goes to recv */
        float *h = stage(d, q, count * 4);
        if (!h) return QT_ENOMEM;
        qt_be_download(d->stage_be, h, send, count * 4);
        s = h;
        if (d->rank == root) r = h, in_place = 1, stage_back(q, recv, h, count * 4);
    }
    const void *sb = in_place ? MPI_IN_PLACE : s;
    int mrc = MPI_Ireduce(sb, d->rank == root ? r : NULL, (int)count, MPI_FLOAT, MPI_SUM, root, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Ireduce", what);
    return finish(d, q, rq, what);
#else
    return local_done(d, rq);
#endif
}

int tp_reduce_scatter_f32(dist_ctx *d, const float *send, float *recv, size_t count, tp_req **rq, const char *what) {
    QT_TRY(check_count(count * (size_t)d->world, what));
    if (d->world == 1 || count == 0) return local_copy(d, send, recv, count, rq);
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)count * 4 * d->world, &q));
    if (d->hccl) {
        int64_t seq = 0;
        int rc = dist_hccl_reduce_scatter(d, send, recv, count, &seq, what);
        return hccl_req(d, q, rc, seq, NULL, rq, what);
    }
    const float *s = send;
    float *r = recv;
    if (d->stage_be) {
        const size_t all = count * (size_t)d->world;
        float *h = stage(d, q, (all + count) * 4);
        if (!h) return QT_ENOMEM;
        qt_be_download(d->stage_be, h, send, all * 4);
        s = h, r = h + all;
        stage_back(q, recv, r, count * 4);
    }
    int mrc = MPI_Ireduce_scatter_block(s, r, (int)count, MPI_FLOAT, MPI_SUM, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Ireduce_scatter_block", what);
    return finish(d, q, rq, what);
#else
    return local_done(d, rq);
#endif
}

int tp_allgather_f32(dist_ctx *d, const float *send, float *recv, size_t count, tp_req **rq, const char *what) {
    QT_TRY(check_count(count * (size_t)d->world, what));
    if (d->world == 1 || count == 0) return local_copy(d, send, recv, count, rq);
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)count * 4, &q));
    if (d->hccl) {
        int64_t seq = 0;
        void *tmp = NULL;
        int rc = dist_hccl_allgather(d, send, recv, count, &tmp, &seq, what);
        return hccl_req(d, q, rc, seq, tmp, rq, what);
    }
    const void *sb = send == recv + (size_t)d->rank * count ? MPI_IN_PLACE : send;
    float *r = recv;
    if (d->stage_be) { /* this rank's part in place in the copy of the whole result */
        const size_t all = count * (size_t)d->world;
        if (!(r = stage(d, q, all * 4))) return QT_ENOMEM;
        qt_be_download(d->stage_be, r + (size_t)d->rank * count, send, count * 4);
        sb = MPI_IN_PLACE;
        stage_back(q, recv, r, all * 4);
    }
    int mrc = MPI_Iallgather(sb, (int)count, MPI_FLOAT, r, (int)count, MPI_FLOAT, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Iallgather", what);
    return finish(d, q, rq, what);
#else
    return local_done(d, rq);
#endif
}

int tp_bcast(dist_ctx *d, void *buf, size_t bytes, int root, tp_req **rq, const char *what) {
    QT_TRY(check_count(bytes, what));
    if (root < 0 || root >= d->world)
        return QT_ERR(QT_EINVAL, "dist: broadcast root %d is not a rank (world %d)", root, d->world);
    if (d->world == 1 || bytes == 0) return local_done(d, rq);
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)bytes, &q));
    if (d->hccl) {
        int64_t seq = 0;
        int rc = dist_hccl_bcast(d, buf, bytes, root, &seq, what);
        return hccl_req(d, q, rc, seq, NULL, rq, what);
    }
    void *b = buf;
    if (d->stage_be) {
        if (!(b = stage(d, q, bytes))) return QT_ENOMEM;
        if (d->rank == root) qt_be_download(d->stage_be, b, buf, bytes);
        else stage_back(q, buf, b, bytes);
    }
    int mrc = MPI_Ibcast(b, (int)bytes, MPI_BYTE, root, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Ibcast", what);
    return finish(d, q, rq, what);
#else
    (void)buf;
    return local_done(d, rq);
#endif
}

int tp_barrier(dist_ctx *d, double deadline_s, const char *what) {
    if (d->world == 1) return QT_OK;
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, 0, &q));
    int mrc = MPI_Ibarrier(d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Ibarrier", what);
    double keep = d->timeout_s;
    if (deadline_s > 0) d->timeout_s = deadline_s;
    int rc = tp_wait(d, &q, 1, what);
    d->timeout_s = keep;
    return rc;
#else
    (void)deadline_s;
    (void)what;
    return QT_OK;
#endif
}

int tp_gatherv_f32(dist_ctx *d, const float *send, size_t n_mine, float *recv, const size_t *counts,
                   const size_t *displs, tp_req **rq, const char *what) {
    QT_TRY(check_count(n_mine, what));
    if (d->world == 1) { /* send is device memory, recv the host's */
        if (n_mine && d->stage_be) qt_be_download(d->stage_be, recv + displs[0], send, n_mine * sizeof(float));
        else if (n_mine) memcpy(recv + displs[0], send, n_mine * sizeof(float));
        return local_done(d, rq);
    }
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)n_mine * 4, &q));
    int rc = size_table(d, q, counts, displs);
    if (rc) {
        req_free(q);
        return rc;
    }
    const float *s = send;
    if (d->stage_be) {
        float *h = stage(d, q, n_mine * 4);
        if (!h) return QT_ENOMEM;
        qt_be_download(d->stage_be, h, send, n_mine * 4);
        s = h;
    }
    int mrc = MPI_Igatherv(s, (int)n_mine, MPI_FLOAT, d->rank == 0 ? recv : NULL, q->counts, q->displs, MPI_FLOAT,
                           0, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Igatherv", what);
    return finish(d, q, rq, what);
#else
    return local_done(d, rq);
#endif
}

int tp_scatterv_f32(dist_ctx *d, const float *send, const size_t *counts, const size_t *displs, float *recv,
                    size_t n_mine, tp_req **rq, const char *what) {
    QT_TRY(check_count(n_mine, what));
    if (d->world == 1) { /* send is the host's, recv device memory */
        if (n_mine && d->stage_be) qt_be_upload(d->stage_be, recv, send + displs[0], n_mine * sizeof(float));
        else if (n_mine) memcpy(recv, send + displs[0], n_mine * sizeof(float));
        return local_done(d, rq);
    }
#if QT_DIST_MPI
    tp_req *q;
    QT_TRY(req_new(d, (double)n_mine * 4, &q));
    int rc = size_table(d, q, counts, displs);
    if (rc) {
        req_free(q);
        return rc;
    }
    float *r = recv;
    if (d->stage_be) {
        if (!(r = stage(d, q, n_mine * 4))) return QT_ENOMEM;
        stage_back(q, recv, r, n_mine * 4);
    }
    int mrc = MPI_Iscatterv(d->rank == 0 ? send : NULL, q->counts, q->displs, MPI_FLOAT, r, (int)n_mine, MPI_FLOAT,
                            0, d->comm, &q->r);
    if (mrc != MPI_SUCCESS) return start_fail(d, q, mrc, "MPI_Iscatterv", what);
    return finish(d, q, rq, what);
#else
    return local_done(d, rq);
#endif
}

int tp_test(dist_ctx *d, tp_req *q, int *done) {
    *done = 1;
    if (!q || q->done) return QT_OK;
#if QT_DIST_MPI
    if (q->hccl_seq) {
        QT_TRY(dist_hccl_test(d, q->hccl_seq, done));
        if (*done) note_done(d, q);
        return QT_OK;
    }
    int flag = 0, mrc = MPI_Test(&q->r, &flag, MPI_STATUS_IGNORE);
    if (mrc != MPI_SUCCESS) return dist_mpi_fail(d, mrc, "MPI_Test", "a collective");
    if (!flag) {
        *done = 0;
        return QT_OK;
    }
#endif
    note_done(d, q);
    return QT_OK;
}

int tp_wait(dist_ctx *d, tp_req **rqs, int n, const char *what) {
    int rc = QT_OK, pending = 0;
    for (int i = 0; i < n; i++) pending += rqs[i] != NULL;
    if (pending) {
        double t0 = qt_now_s();
#if QT_DIST_MPI
        dist_waiter w;
        dist_waiter_start(d, &w, what);
        for (;;) {
            /* a large message crosses shared memory in many fragments, and libnbc moves
             * them only inside MPI calls: poll a burst before each tick, whose back-off
             * sleeps (measured: a 4 MB reduce took ~0.7 s with one poll per tick) */
            int left = 1;
            for (int burst = 0; burst < TP_POLL_BURST && left && rc == QT_OK; burst++) {
                left = 0;
                for (int i = 0; i < n && rc == QT_OK; i++) {
                    int done;
                    rc = tp_test(d, rqs[i], &done);
                    left += !done;
                }
            }
            if (rc || !left) break;
            dist_waiter_tick(d, &w);
        }
        dist_waiter_end(d, &w);
#else
        (void)what;
#endif
        d->tp.wait_s += qt_now_s() - t0;
    }
    /* After an error a request not yet complete may still be written by a
     * peer (a receive, or a staged copy MPI reads from): its buffers are left
     * allocated, not freed for reuse while MPI holds them. The rank ends
     * after an error (dist_abort), so what is left is never reclaimed. */
    for (int i = 0; i < n; i++) {
        if (rqs[i] && (rc == QT_OK || rqs[i]->done)) req_free(rqs[i]);
        else if (rqs[i]) d->tp.abandoned++;
        rqs[i] = NULL;
    }
    return rc;
}
