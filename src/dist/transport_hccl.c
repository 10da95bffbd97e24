/* transport.h's device collectives over HCCL, CANN's collective library,
 * for ranks on Ascend NPUs (backend "npu" with world > 1): all-reduce,
 * reduce, reduce-scatter, all-gather and broadcast run card to card on a
 * stream of their own; gatherv/scatterv (rank 0's buffer is host memory) and
 * the barrier stay on MPI (transport_mpi.c), which also bootstraps HCCL:
 * rank 0 makes the root info (HcclGetRootInfo), MPI broadcasts it, every
 * rank joins with HcclCommInitRootInfo.
 *
 * Ordering: a collective reads buffers the compute stream writes, so the
 * compute stream is drained (qt_be_sync) before each one is queued; the caller
 * leaves the buffers alone until the request completed (transport.h), so the
 * compute stream needs no wait on the collective's stream.
 * Completion: collectives on one stream finish in the order queued, so a
 * request is done once the stream has drained past it:
 * aclrtSynchronizeStreamWithTimeout(stream, 0) answers "all done" or "not
 * yet" without blocking, and transport_mpi.c's tp_wait polls it under the
 * collective deadline (dist_waiter), so a stalled rank is named as with MPI.
 *
 * In place: all-reduce and reduce at the root pass one buffer as send and
 * receive, as torch_npu's HCCL process group does; hccl.h does not promise
 * an all-gather whose send lies inside its receive buffer, so that one is
 * sent from a copy; a reduce's non-root ranks get a receive buffer of their
 * own (hccl.h exempts none from recvBuf).
 *
 * Written against CANN's published headers (backend/ascend/acl_api.h, the
 * HCCL heading), tested against a CPU stand-in over MPI
 * (tests/unit/backend_parity/hccl_standin.c), never run on an Ascend card. */
#define _GNU_SOURCE
#include "dist/dist_internal.h"

#include "backend/ascend/ascend_internal.h"
#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if QT_DIST_MPI

typedef struct {
#define X(ret, name, params) ret(*name) params;
    QT_HCCL_FUNCS(X)
    QT_HCCL_RT_FUNCS(X)
#undef X
} hccl_api;

struct dist_hccl {
    hccl_api api;
    const qt_acl_api *acl;
    qt_backend *be;
    HcclComm comm;
    aclrtStream stream;     /* the collectives' own stream */
    int64_t queued, drained; /* collectives queued on it; how many it is known to have finished */
};

static const char *result_name(int r) {
    static const char *const names[] = {"HCCL_SUCCESS", "HCCL_E_PARA", "HCCL_E_PTR", "HCCL_E_MEMORY",
                                        "HCCL_E_INTERNAL", "HCCL_E_NOT_SUPPORT", "HCCL_E_NOT_FOUND",
                                        "HCCL_E_UNAVAIL", "HCCL_E_SYSCALL", "HCCL_E_TIMEOUT",
                                        "HCCL_E_OPEN_FILE_FAILURE", "HCCL_E_TCP_CONNECT", "HCCL_E_ROCE_CONNECT",
                                        "HCCL_E_TCP_TRANSFER", "HCCL_E_ROCE_TRANSFER", "HCCL_E_RUNTIME",
                                        "HCCL_E_DRV", "HCCL_E_PROFILING", "HCCL_E_CCE", "HCCL_E_NETWORK",
                                        "HCCL_E_AGAIN", "HCCL_E_REMOTE", "HCCL_E_SUSPENDING"};
    return r >= 0 && r < (int)(sizeof names / sizeof names[0]) ? names[r] : "an unknown HcclResult";
}

static int hccl_fail(const dist_ctx *d, int r, const char *call, const char *what) {
    return QT_ERR(QT_EDIST, "rank %d: HCCL's %s failed in %s (%s, %d)%s; `qtune doctor` reports the HCCL_* "
                  "settings and the driver's state (npu-smi info)", d->rank, call, what, result_name(r), r,
                  r == HCCL_E_TIMEOUT || r == HCCL_E_TCP_CONNECT
                      ? ": a rank did not connect in time (HCCL_CONNECT_TIMEOUT) or a link is down" : "");
}

/* libhccl.so and libascendcl.so (on LD_LIBRARY_PATH once CANN's set_env.sh
 * is sourced), or $QTUNE_ASCEND_LIB alone, as the backend's loader. */
static int load(hccl_api *api) {
    const char *user = getenv("QTUNE_ASCEND_LIB");
    const char *names[2] = {"libhccl.so", "libascendcl.so"};
    void *h[2] = {0};
    int n = 2;
    if (user && *user) names[0] = user, n = 1;
    for (int i = 0; i < n; i++) {
        h[i] = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h[i]) continue;
        char err[512];
        snprintf(err, sizeof err, "%s", dlerror());
        for (int j = 0; j < i; j++) dlclose(h[j]);
        return QT_ERR(QT_EUNSUPPORTED, "several ranks on Ascend NPUs talk through HCCL, and %s could not be "
                      "loaded (%s); source CANN's set_env.sh on every host, or run one rank", names[i], err);
    }
#define X(ret, name, params)                                                                                    \
    for (int i = 0; i < n && !api->name; i++) *(void **)&api->name = dlsym(h[i], #name);                       \
    if (!api->name) {                                                                                           \
        for (int i = 0; i < n; i++) dlclose(h[i]);                                                              \
        return QT_ERR(QT_EUNSUPPORTED, "the CANN libraries loaded have no %s: a CANN older than the 8.1 headers " \
                      "qtune's HCCL transport is written against; install CANN 8.1 or later", #name);          \
    }
    QT_HCCL_FUNCS(X)
    QT_HCCL_RT_FUNCS(X)
#undef X
    return QT_OK;
}

/* One verdict for every rank, so a rank that failed ends the job instead of
 * leaving the others waiting for it in HCCL (which waits HCCL_CONNECT_TIMEOUT). */
static void agree(dist_ctx *d, int *rc) {
    int64_t ok = *rc == QT_OK;
    int arc = dist_allreduce_i64(d, &ok, 1, DIST_MIN, "HCCL start-up");
    if (*rc != QT_OK) return;
    if (arc != QT_OK) *rc = arc;
    else if (!ok) *rc = QT_ERR(QT_EDIST, "rank %d: another rank could not start HCCL (its log says why)", d->rank);
}

/* Every rank, together: HCCL on the ranks of d over the backend's card. */
int dist_hccl_open(dist_ctx *d, qt_backend *be) {
    struct dist_hccl *h = qt_calloc(1, sizeof *h, "the HCCL transport");
    if (!h) return QT_ENOMEM;
    h->be = be;
    /* rank 0's root info, or why it has none, reaches every rank (they would
     * otherwise wait in HcclCommInitRootInfo for a root that never comes) */
    struct {
        int32_t ok;
        HcclRootInfo info;
    } boot;
    memset(&boot, 0, sizeof boot);
    int rc = load(&h->api);
    if (rc == QT_OK) h->acl = qt_acl_load();
    if (rc == QT_OK && !h->acl) rc = qt_error_code();
    if (d->rank == 0 && rc == QT_OK) {
        int r = h->api.HcclGetRootInfo(&boot.info);
        if (r != HCCL_SUCCESS) rc = hccl_fail(d, r, "HcclGetRootInfo", "start-up");
        boot.ok = rc == QT_OK;
    }
    MPI_Request rq;
    int mrc = MPI_Ibcast(&boot, (int)sizeof boot, MPI_BYTE, 0, d->comm, &rq);
    if (mrc != MPI_SUCCESS) rc = dist_mpi_fail(d, mrc, "MPI_Ibcast", "HCCL start-up");
    else {
        int wrc = dist_wait_all(d, &rq, 1, "HCCL start-up (the root info)");
        if (rc == QT_OK) rc = wrc;
    }
    if (rc == QT_OK && !boot.ok)
        rc = QT_ERR(QT_EDIST, "rank %d: rank 0 could not start HCCL (its log says why); the job cannot use the NPUs' "
                    "links", d->rank);
    if (rc == QT_OK) {
        int r = h->acl->aclrtCreateStream(&h->stream);
        if (r != ACL_SUCCESS) rc = QT_ERR(QT_EDIST, "rank %d: CANN could not create the collectives' stream (error "
                                          "%d)", d->rank, r);
    }
    /* every rank ready before any waits in HcclCommInitRootInfo for the others */
    agree(d, &rc);
    if (rc == QT_OK) {
        int r = h->api.HcclCommInitRootInfo((uint32_t)d->world, &boot.info, (uint32_t)d->rank, &h->comm);
        if (r != HCCL_SUCCESS) rc = hccl_fail(d, r, "HcclCommInitRootInfo", "start-up");
    }
    agree(d, &rc);
    if (rc != QT_OK) {
        if (h->comm) h->api.HcclCommDestroy(h->comm);
        if (h->stream) h->acl->aclrtDestroyStream(h->stream);
        qt_free(h);
        return rc;
    }
    d->hccl = h;
    return QT_OK;
}

void dist_hccl_close(dist_ctx *d) {
    struct dist_hccl *h = d->hccl;
    if (!h) return;
    h->api.aclrtSynchronizeStreamWithTimeout(h->stream, -1);
    h->api.HcclCommDestroy(h->comm);
    h->acl->aclrtDestroyStream(h->stream);
    qt_free(h);
    d->hccl = NULL;
}

const char *dist_transport_name(const dist_ctx *d) { return d && d->hccl ? "HCCL" : "MPI"; }

/* After a collective was queued (r: its HcclResult): its number on the stream. */
static int queued(dist_ctx *d, int r, const char *call, const char *what, int64_t *seq) {
    if (r != HCCL_SUCCESS) return hccl_fail(d, r, call, what);
    *seq = ++d->hccl->queued;
    return QT_OK;
}

int dist_hccl_allreduce(dist_ctx *d, float *buf, size_t count, int64_t *seq, const char *what) {
    struct dist_hccl *h = d->hccl;
    qt_be_sync(h->be);
    int r = h->api.HcclAllReduce(buf, buf, count, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, h->comm, h->stream);
    return queued(d, r, "HcclAllReduce", what, seq);
}

int dist_hccl_reduce(dist_ctx *d, const float *send, float *recv, size_t count, int root, void **tmp, int64_t *seq,
                     const char *what) {
    struct dist_hccl *h = d->hccl;
    if (d->rank != root) { /* a receive buffer of its own, freed when the request completes */
        recv = qt_be_alloc(h->be, QT_MEM_DEVICE, count * sizeof(float), "a reduction's receive buffer");
        if (!recv) return qt_error_code();
        *tmp = recv;
    }
    qt_be_sync(h->be);
    int r = h->api.HcclReduce((void *)send, recv, count, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, (uint32_t)root,
                              h->comm, h->stream);
    return queued(d, r, "HcclReduce", what, seq);
}

int dist_hccl_reduce_scatter(dist_ctx *d, const float *send, float *recv, size_t count, int64_t *seq,
                             const char *what) {
    struct dist_hccl *h = d->hccl;
    qt_be_sync(h->be);
    int r = h->api.HcclReduceScatter((void *)send, recv, count, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, h->comm,
                                     h->stream);
    return queued(d, r, "HcclReduceScatter", what, seq);
}

int dist_hccl_allgather(dist_ctx *d, const float *send, float *recv, size_t count, void **tmp, int64_t *seq,
                        const char *what) {
    struct dist_hccl *h = d->hccl;
    const float *end = recv + count * (size_t)d->world;
    if (send + count > recv && send < end) { /* in place: this rank's part goes from a copy */
        float *c = qt_be_alloc(h->be, QT_MEM_DEVICE, count * sizeof(float), "an all-gather's send copy");
        if (!c) return qt_error_code();
        qt_be_copy(h->be, c, send, count * sizeof(float));
        *tmp = c;
        send = c;
    }
    qt_be_sync(h->be);
    int r = h->api.HcclAllGather((void *)send, recv, count, HCCL_DATA_TYPE_FP32, h->comm, h->stream);
    return queued(d, r, "HcclAllGather", what, seq);
}

int dist_hccl_bcast(dist_ctx *d, void *buf, size_t bytes, int root, int64_t *seq, const char *what) {
    struct dist_hccl *h = d->hccl;
    qt_be_sync(h->be);
    int r = h->api.HcclBroadcast(buf, bytes, HCCL_DATA_TYPE_INT8, (uint32_t)root, h->comm, h->stream);
    return queued(d, r, "HcclBroadcast", what, seq);
}

int dist_hccl_test(dist_ctx *d, int64_t seq, int *done) {
    struct dist_hccl *h = d->hccl;
    *done = seq <= h->drained;
    if (*done) return QT_OK;
    int r = h->api.aclrtSynchronizeStreamWithTimeout(h->stream, 0);
    if (r == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT) return QT_OK;
    if (r != ACL_SUCCESS)
        return QT_ERR(QT_EDIST, "rank %d: the NPU's collective stream failed (aclrtSynchronizeStreamWithTimeout "
                      "error %d): HCCL stopped (HCCL_EXEC_TIMEOUT, or a link or card failed); `qtune doctor` "
                      "and `npu-smi info` say which", d->rank, r);
    h->drained = h->queued;
    *done = 1;
    return QT_OK;
}

#else /* no MPI: one process, no HCCL */

int dist_hccl_open(dist_ctx *d, qt_backend *be) {
    (void)d, (void)be;
    return QT_OK;
}
void dist_hccl_close(dist_ctx *d) { (void)d; }
const char *dist_transport_name(const dist_ctx *d) {
    (void)d;
    return "MPI";
}

#endif
