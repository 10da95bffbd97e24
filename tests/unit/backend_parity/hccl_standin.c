/* A CPU stand-in of the part of HCCL (CANN's collective library,
 * src/backend/ascend/acl_api.h's HCCL heading) that qtune's HCCL transport
 * calls (src/dist/transport_hccl.c), over MPI between the ranks of an
 * mpirun: built into the same library as acl_standin.c, so
 * $QTUNE_ASCEND_LIB gives the transport both.
 *
 * It keeps the documented rules, so the transport is held to them:
 *  - a communicator only from HcclCommInitRootInfo with the root info of
 *    HcclGetRootInfo, the same on every rank (a rank that made its own, not
 *    the one broadcast from the root, gets HCCL_E_PARA), nRanks and rank the
 *    job's;
 *  - each collective takes only the data types its hccl.h comment lists and
 *    the four reduction ops (else HCCL_E_PARA), buffers of device memory of
 *    the sizes given (checked through aclrtMemcpy's own device test), a
 *    stream and a communicator (else HCCL_E_PTR);
 *  - a collective is queued on its stream and returns: it is started at once
 *    over MPI (MPI_I*), and the stream knows it done only once MPI says so.
 *    aclrtSynchronizeStreamWithTimeout (defined here, since only the stream's
 *    HCCL work is this file's) waits for it with acl_rt.h's semantics:
 *    -1 forever, 0 a check, else milliseconds; past it
 *    ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, the work still in flight.
 * The stand-in's own choices, where hccl.h says nothing: buffers that
 * overlap (other than the same buffer for an all-reduce, or a reduce at its
 * root) are refused with HCCL_E_PARA; float16/bfloat16 reductions are
 * refused with HCCL_E_NOT_SUPPORT (MPI has no sum for them); a reduce's
 * recvBuf must be device memory on every rank. Built only for the tests. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/ascend/acl_api.h"
#include "qtune_config.h"

#define VIS __attribute__((visibility("default")))

QT_HCCL_FUNCS(QT_ACL_PROTO)
QT_HCCL_RT_FUNCS(QT_ACL_PROTO)
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);

#if QTUNE_HAVE_MPI
#include <mpi.h>

#define MAGIC "qtune HCCL stand-in root info"

typedef struct {
    MPI_Comm comm;
    int rank, n;
} comm_t;

/* the collectives in flight, oldest first, each with its stream */
typedef struct pend {
    MPI_Request r;
    aclrtStream s;
    comm_t *c;
    struct pend *next;
} pend;
static pend *pending;

static void add_pending(MPI_Request r, aclrtStream s, comm_t *c) {
    pend *p = calloc(1, sizeof *p), **e = &pending;
    p->r = r, p->s = s, p->c = c;
    while (*e) e = &(*e)->next;
    *e = p;
}

/* MPI_Test on every request of stream s (or of comm c); 1 when none is left */
static int progress(aclrtStream s, comm_t *c) {
    int left = 0;
    for (pend **e = &pending; *e;) {
        pend *p = *e;
        if ((s && p->s != s) || (c && p->c != c)) {
            e = &p->next;
            continue;
        }
        int flag = 0;
        MPI_Test(&p->r, &flag, MPI_STATUS_IGNORE);
        if (flag) {
            *e = p->next;
            free(p);
        } else {
            left++;
            e = &p->next;
        }
    }
    return left == 0;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

VIS aclError aclrtSynchronizeStreamWithTimeout(aclrtStream s, int32_t timeout) {
    if (!s || timeout < -1) return ACL_ERROR_INVALID_PARAM;
    aclError e = aclrtSynchronizeStream(s); /* the stream's other work (acl_standin.c's queue) */
    if (e != ACL_SUCCESS) return e;
    double t0 = now_ms();
    while (!progress(s, NULL)) {
        if (timeout == 0 || (timeout > 0 && now_ms() - t0 >= timeout)) return ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
        usleep(50);
    }
    return ACL_SUCCESS;
}

static uint64_t fnv(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h;
}

VIS HcclResult HcclGetRootInfo(HcclRootInfo *ri) {
    if (!ri) return HCCL_E_PTR;
    memset(ri, 0, sizeof *ri);
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    snprintf(ri->internal, sizeof ri->internal, "%s %d %ld.%09ld", MAGIC, (int)getpid(), (long)t.tv_sec, t.tv_nsec);
    return HCCL_SUCCESS;
}

VIS HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *ri, uint32_t rank, HcclComm *comm) {
    if (!ri || !comm) return HCCL_E_PTR;
    int inited = 0, wr = 0, wn = 0;
    MPI_Initialized(&inited);
    if (!inited) return HCCL_E_INTERNAL; /* the stand-in's ranks are MPI's */
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    MPI_Comm_size(MPI_COMM_WORLD, &wn);
    if (nRanks != (uint32_t)wn || rank != (uint32_t)wr) return HCCL_E_PARA;
    /* every rank holds the root's info: the same bytes, made by HcclGetRootInfo */
    int mine = !strncmp(ri->internal, MAGIC, strlen(MAGIC));
    uint64_t h[2] = {fnv(ri->internal, sizeof ri->internal), 0}, lo[2], hi[2];
    h[1] = (uint64_t)mine;
    MPI_Allreduce(h, lo, 2, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(h, hi, 2, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (lo[0] != hi[0] || !lo[1]) return HCCL_E_PARA;
    comm_t *c = calloc(1, sizeof *c);
    if (!c) return HCCL_E_MEMORY;
    MPI_Comm_dup(MPI_COMM_WORLD, &c->comm);
    c->rank = wr, c->n = wn;
    *comm = c;
    return HCCL_SUCCESS;
}

VIS HcclResult HcclCommDestroy(HcclComm comm) {
    comm_t *c = comm;
    if (!c) return HCCL_E_PTR;
    while (!progress(NULL, c)) usleep(50);
    MPI_Comm_free(&c->comm);
    free(c);
    return HCCL_SUCCESS;
}

/* The MPI type of HCCL type t for a collective of kind `ops`, which takes
 * the types its hccl.h comment lists (HCCL_E_PARA for the others). */
enum { OPS_REDUCE, OPS_REDUCE_SCATTER, OPS_MOVE };
static HcclResult dtype(HcclDataType t, int ops, MPI_Datatype *m, size_t *size) {
    int reduce = 0, reduce_scatter = 0;
    switch (t) {
    case HCCL_DATA_TYPE_INT8: *m = MPI_INT8_T, *size = 1, reduce = reduce_scatter = 1; break;
    case HCCL_DATA_TYPE_INT16: *m = MPI_INT16_T, *size = 2, reduce = 1; break;
    case HCCL_DATA_TYPE_INT32: *m = MPI_INT32_T, *size = 4, reduce = reduce_scatter = 1; break;
    case HCCL_DATA_TYPE_FP32: *m = MPI_FLOAT, *size = 4, reduce = reduce_scatter = 1; break;
    case HCCL_DATA_TYPE_INT64: *m = MPI_INT64_T, *size = 8; break;
    case HCCL_DATA_TYPE_UINT64: *m = MPI_UINT64_T, *size = 8; break;
    case HCCL_DATA_TYPE_UINT8: *m = MPI_UINT8_T, *size = 1; break;
    case HCCL_DATA_TYPE_UINT16: *m = MPI_UINT16_T, *size = 2; break;
    case HCCL_DATA_TYPE_UINT32: *m = MPI_UINT32_T, *size = 4; break;
    case HCCL_DATA_TYPE_FP64: *m = MPI_DOUBLE, *size = 8; break;
    case HCCL_DATA_TYPE_FP16:
    case HCCL_DATA_TYPE_BFP16: /* moved as two bytes each; MPI has no sum for them */
        if (ops != OPS_MOVE) return HCCL_E_NOT_SUPPORT;
        *m = MPI_UINT16_T, *size = 2;
        return HCCL_SUCCESS;
    default: return HCCL_E_PARA;
    }
    if ((ops == OPS_REDUCE && !reduce) || (ops == OPS_REDUCE_SCATTER && !reduce_scatter)) return HCCL_E_PARA;
    return HCCL_SUCCESS;
}

static HcclResult red_op(HcclReduceOp op, MPI_Op *m) {
    switch (op) {
    case HCCL_REDUCE_SUM: *m = MPI_SUM; return HCCL_SUCCESS;
    case HCCL_REDUCE_PROD: *m = MPI_PROD; return HCCL_SUCCESS;
    case HCCL_REDUCE_MAX: *m = MPI_MAX; return HCCL_SUCCESS;
    case HCCL_REDUCE_MIN: *m = MPI_MIN; return HCCL_SUCCESS;
    default: return HCCL_E_PARA;
    }
}

/* [p, p+n) is device memory of one block (acl_standin.c's test, through its memcpy) */
static int on_device(void *p, size_t n) {
    return p && (n == 0 || aclrtMemcpy(p, n, p, n, ACL_MEMCPY_DEVICE_TO_DEVICE) == ACL_SUCCESS);
}
static int overlap(const void *a, size_t na, const void *b, size_t nb) {
    return (const char *)a < (const char *)b + nb && (const char *)b < (const char *)a + na;
}
#define CHECK(x)                             \
    do {                                     \
        HcclResult chk_ = (x);               \
        if (chk_ != HCCL_SUCCESS) return chk_; \
    } while (0)
#define NEED(comm, stream)                         \
    do {                                           \
        if (!(comm) || !(stream)) return HCCL_E_PTR; \
    } while (0)

VIS HcclResult HcclAllReduce(void *send, void *recv, uint64_t count, HcclDataType t, HcclReduceOp op, HcclComm comm,
                             aclrtStream s) {
    NEED(comm, s);
    comm_t *c = comm;
    MPI_Datatype m;
    MPI_Op mo;
    size_t sz;
    CHECK(dtype(t, OPS_REDUCE, &m, &sz));
    CHECK(red_op(op, &mo));
    const size_t b = count * sz;
    if (!on_device(send, b) || !on_device(recv, b) || (send != recv && overlap(send, b, recv, b))) return HCCL_E_PARA;
    MPI_Request r;
    MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, m, mo, c->comm, &r);
    add_pending(r, s, c);
    return HCCL_SUCCESS;
}

VIS HcclResult HcclReduce(void *send, void *recv, uint64_t count, HcclDataType t, HcclReduceOp op, uint32_t root,
                          HcclComm comm, aclrtStream s) {
    NEED(comm, s);
    comm_t *c = comm;
    MPI_Datatype m;
    MPI_Op mo;
    size_t sz;
    CHECK(dtype(t, OPS_REDUCE, &m, &sz));
    CHECK(red_op(op, &mo));
    const size_t b = count * sz;
    if (root >= (uint32_t)c->n) return HCCL_E_PARA;
    const int at_root = (uint32_t)c->rank == root, in_place = at_root && send == recv;
    if (!on_device(send, b) || !on_device(recv, b) || (!in_place && overlap(send, b, recv, b))) return HCCL_E_PARA;
    MPI_Request r;
    MPI_Ireduce(in_place ? MPI_IN_PLACE : send, at_root ? recv : NULL, (int)count, m, mo, (int)root, c->comm, &r);
    add_pending(r, s, c);
    return HCCL_SUCCESS;
}

VIS HcclResult HcclReduceScatter(void *send, void *recv, uint64_t recvCount, HcclDataType t, HcclReduceOp op,
                                 HcclComm comm, aclrtStream s) {
    NEED(comm, s);
    comm_t *c = comm;
    MPI_Datatype m;
    MPI_Op mo;
    size_t sz;
    CHECK(dtype(t, OPS_REDUCE_SCATTER, &m, &sz));
    CHECK(red_op(op, &mo));
    const size_t b = recvCount * sz;
    if (!on_device(send, b * c->n) || !on_device(recv, b) || overlap(send, b * c->n, recv, b)) return HCCL_E_PARA;
    MPI_Request r;
    MPI_Ireduce_scatter_block(send, recv, (int)recvCount, m, mo, c->comm, &r);
    add_pending(r, s, c);
    return HCCL_SUCCESS;
}

VIS HcclResult HcclAllGather(void *send, void *recv, uint64_t sendCount, HcclDataType t, HcclComm comm,
                             aclrtStream s) {
    NEED(comm, s);
    comm_t *c = comm;
    MPI_Datatype m;
    size_t sz;
    CHECK(dtype(t, OPS_MOVE, &m, &sz));
    const size_t b = sendCount * sz;
    if (!on_device(send, b) || !on_device(recv, b * c->n) || overlap(send, b, recv, b * c->n)) return HCCL_E_PARA;
    MPI_Request r;
    MPI_Iallgather(send, (int)sendCount, m, recv, (int)sendCount, m, c->comm, &r);
    add_pending(r, s, c);
    return HCCL_SUCCESS;
}

VIS HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType t, uint32_t root, HcclComm comm, aclrtStream s) {
    NEED(comm, s);
    comm_t *c = comm;
    MPI_Datatype m;
    size_t sz;
    CHECK(dtype(t, OPS_MOVE, &m, &sz));
    if (root >= (uint32_t)c->n || !on_device(buf, count * sz)) return HCCL_E_PARA;
    MPI_Request r;
    MPI_Ibcast(buf, (int)count, m, (int)root, c->comm, &r);
    add_pending(r, s, c);
    return HCCL_SUCCESS;
}

#else /* a build without MPI: no ranks to join, as HCCL on a machine without its network */

VIS aclError aclrtSynchronizeStreamWithTimeout(aclrtStream s, int32_t timeout) {
    (void)timeout;
    return aclrtSynchronizeStream(s);
}
VIS HcclResult HcclGetRootInfo(HcclRootInfo *ri) { return ri ? HCCL_E_NOT_SUPPORT : HCCL_E_PTR; }
VIS HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *ri, uint32_t rank, HcclComm *comm) {
    return HCCL_E_NOT_SUPPORT;
}
VIS HcclResult HcclCommDestroy(HcclComm comm) { return HCCL_E_PTR; }
VIS HcclResult HcclAllReduce(void *a, void *b, uint64_t n, HcclDataType t, HcclReduceOp op, HcclComm c, aclrtStream s) {
    return HCCL_E_PTR;
}
VIS HcclResult HcclReduce(void *a, void *b, uint64_t n, HcclDataType t, HcclReduceOp op, uint32_t root, HcclComm c,
                          aclrtStream s) {
    return HCCL_E_PTR;
}
VIS HcclResult HcclReduceScatter(void *a, void *b, uint64_t n, HcclDataType t, HcclReduceOp op, HcclComm c,
                                 aclrtStream s) {
    return HCCL_E_PTR;
}
VIS HcclResult HcclAllGather(void *a, void *b, uint64_t n, HcclDataType t, HcclComm c, aclrtStream s) {
    return HCCL_E_PTR;
}
VIS HcclResult HcclBroadcast(void *a, uint64_t n, HcclDataType t, uint32_t root, HcclComm c, aclrtStream s) {
    return HCCL_E_PTR;
}

#endif
