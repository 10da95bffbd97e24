/* ZeRO over the flat fp32 trainable block: shard ranges, bucketed gradient
 * reduction, the parameter all-gather (see dist.h for the call order).
 *
 * Layout: the block [0, n) is cut into N contiguous shards of `shard`
 * elements (ceil(n/N) rounded up to 16, so every shard starts on a 64-byte
 * boundary); rank r owns [r*shard, min((r+1)*shard, n)). Communication goes
 * in buckets of bucket_elems elements (so MPI's int counts never overflow on
 * a 14B-element block, and reduction of the last layers can start while the
 * backward still runs). For bucket b and rank r, counts[b][r] = the length of
 * bucket ∩ shard_r and displs[b][r] its offset inside the bucket: one table
 * drives reduce-scatter, all-gather, gather and scatter.
 *
 * Reductions are reduce-scatter (+ all-gather at stage 0/1) rather than
 * MPI_Allreduce: each element is then summed once, by its owner, and every
 * rank receives the same bits, so replicated weights never drift apart. */
#include "dist/dist_internal.h"

#include "backend/backend.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"

#include <limits.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>

#define ZERO_ALIGN 16                     /* elements: 64 bytes of fp32 */
#define ZERO_DEFAULT_BUCKET ((size_t)1 << 23)  /* 32 MiB of fp32 */
#define ZERO_IN_FLIGHT 4                       /* buckets communicating at once */

/* Per-bucket progress of a gradient reduction. */
enum { B_IDLE = 0, B_SCATTER, B_SCATTERED, B_GATHER, B_DONE };

struct zero_plan {
    dist_ctx *d;
    int stage, offload;
    size_t n;            /* elements in the flat block */
    size_t shard;        /* elements per shard (last ones shorter) */
    size_t lo, hi;       /* own shard */
    size_t bucket;       /* elements per bucket */
    int nb;              /* buckets */
    int *counts;         /* (nb, N) bucket ∩ shard_r length */
    int *displs;         /* (nb, N) its offset inside the bucket */
    float *gshard;       /* (hi - lo) reduce-scatter target */
    unsigned char *bstate; /* (nb) B_* */
    int started;         /* a reduction is in flight for `grads_in_flight` */
    int next_op;         /* the next operation of the reduction sequence to start */
    int ready_ops;       /* operations zero_reduce_ready has allowed so far */
    int in_flight;       /* operations started and not yet complete */
    float *grads_in_flight;
#if QT_DIST_MPI
    MPI_Request *req;    /* (nb) */
#endif
    size_t bytes_device, bytes_host;
    zero_alloc_fn dev_alloc;
    zero_free_fn dev_free;
    void *dev_user;
    qt_backend *be;      /* copies, zeroing and the sum of squares of device memory */
    int own_be;
};

static void *default_dev_alloc(size_t bytes, const char *what, void *user) {
    (void)user;
    return qt_alloc_aligned(bytes, what);
}
static void default_dev_free(void *p, void *user) {
    (void)user;
    qt_free(p);
}

int zero_plan_create(dist_ctx *d, size_t n, const zero_opts *opts, zero_plan **out) {
    *out = NULL;
    if (opts->stage < 0 || opts->stage > 2)
        return QT_ERR(QT_EUNSUPPORTED, "zero_optimization.stage %d is not supported; use 0, 1 or 2", opts->stage);
    size_t bucket = opts->bucket_elems ? opts->bucket_elems : ZERO_DEFAULT_BUCKET;
    if (bucket > (size_t)INT_MAX / 2) bucket = (size_t)INT_MAX / 2;
    int N = d->world;
    size_t nb = n ? (n + bucket - 1) / bucket : 0;
    if (nb > (size_t)INT_MAX / 4 || nb * (size_t)N > ((size_t)1 << 26))
        return QT_ERR(QT_EINVAL, "dist: %zu elements in buckets of %zu make %zu buckets; raise the bucket size "
                                 "(reduce_bucket_size) to at least %zu elements", n, bucket, nb,
                      n / (((size_t)1 << 26) / (size_t)N) + 1);
    zero_plan *p = qt_calloc(1, sizeof *p, "the ZeRO plan");
    if (!p) return QT_ENOMEM;
    p->d = d;
    p->stage = opts->stage;
    p->offload = opts->offload;
    p->n = n;
    p->bucket = bucket;
    p->nb = (int)nb;
    size_t per = (n + (size_t)N - 1) / (size_t)N;
    p->shard = (per + ZERO_ALIGN - 1) / ZERO_ALIGN * ZERO_ALIGN;
    zero_shard_of(p, d->rank, &p->lo, &p->hi);
    p->dev_alloc = default_dev_alloc;
    p->dev_free = default_dev_free;
    p->counts = qt_calloc(nb * (size_t)N + 1, sizeof(int), "ZeRO bucket counts");
    p->displs = qt_calloc(nb * (size_t)N + 1, sizeof(int), "ZeRO bucket offsets");
    p->bstate = qt_calloc(nb + 1, 1, "ZeRO bucket states");
    p->gshard = qt_alloc_aligned((p->hi - p->lo + 1) * sizeof(float), "the reduced gradient shard");
#if QT_DIST_MPI
    p->req = qt_calloc(nb + 1, sizeof *p->req, "ZeRO requests");
    if (p->req)
        for (size_t b = 0; b < nb; b++) p->req[b] = MPI_REQUEST_NULL;
    int ok_req = p->req != NULL;
#else
    int ok_req = 1;
#endif
    int ok_be = qt_backend_open("cpu", &p->be) == QT_OK; /* zero_set_backend replaces it */
    p->own_be = ok_be;
    if (!p->counts || !p->displs || !p->bstate || !p->gshard || !ok_req || !ok_be) {
        zero_plan_free(p);
        return QT_ENOMEM;
    }
    for (int b = 0; b < p->nb; b++) {
        size_t b0, b1;
        zero_bucket_range(p, b, &b0, &b1);
        for (int r = 0; r < N; r++) {
            size_t s0, s1;
            zero_shard_of(p, r, &s0, &s1);
            size_t a = s0 > b0 ? s0 : b0, e = s1 < b1 ? s1 : b1;
            p->counts[(size_t)b * N + r] = e > a ? (int)(e - a) : 0;
            p->displs[(size_t)b * N + r] = e > a ? (int)(a - b0) : 0;
        }
    }
    qt_debug("zero: stage %d, n %zu, rank %d shard [%zu, %zu), %d buckets of %zu", p->stage, n, d->rank, p->lo,
             p->hi, p->nb, bucket);
    *out = p;
    return QT_OK;
}

void zero_set_backend(zero_plan *p, qt_backend *be) {
    if (p->own_be) qt_backend_close(p->be);
    p->be = be;
    p->own_be = 0;
}

void zero_plan_free(zero_plan *p) {
    if (!p) return;
    if (p->own_be) qt_backend_close(p->be);
    qt_free(p->counts);
    qt_free(p->displs);
    qt_free(p->bstate);
    qt_free(p->gshard);
#if QT_DIST_MPI
    qt_free(p->req);
#endif
    qt_free(p);
}

int zero_stage(const zero_plan *p) { return p->stage; }
size_t zero_numel(const zero_plan *p) { return p->n; }
int zero_n_buckets(const zero_plan *p) { return p->nb; }

void zero_shard_of(const zero_plan *p, int r, size_t *lo, size_t *hi) {
    size_t a = (size_t)r * p->shard, e = a + p->shard;
    *lo = a < p->n ? a : p->n;
    *hi = e < p->n ? e : p->n;
}

void zero_opt_range(const zero_plan *p, size_t *lo, size_t *hi) {
    if (p->stage == 0) {
        *lo = 0;
        *hi = p->n;
    } else {
        *lo = p->lo;
        *hi = p->hi;
    }
}

void zero_bucket_range(const zero_plan *p, int b, size_t *lo, size_t *hi) {
    size_t a = (size_t)b * p->bucket, e = a + p->bucket;
    *lo = a < p->n ? a : p->n;
    *hi = e < p->n ? e : p->n;
}

/* ------------------------------------------------------------------------- */
/* Gradient reduction                                                          */

#if QT_DIST_MPI
static int bucket_start_scatter(zero_plan *p, float *grads, int b) {
    int N = p->d->world, me = p->d->rank;
    size_t b0, b1;
    zero_bucket_range(p, b, &b0, &b1);
    const int *cnt = p->counts + (size_t)b * N;
    /* own part of this bucket lands at its place inside the shard buffer */
    float *recv = p->gshard + (cnt[me] ? b0 + (size_t)p->displs[(size_t)b * N + me] - p->lo : 0);
    DIST_MPI_CHECK(p->d, MPI_Ireduce_scatter(grads + b0, recv, cnt, MPI_FLOAT, MPI_SUM, p->d->comm, &p->req[b]),
                   "gradient reduce-scatter");
    p->bstate[b] = B_SCATTER;
    return QT_OK;
}

/* Stage 0/1: every rank needs every reduced gradient, so the owner's sums go
 * back to all ranks with an in-place all-gather of the same bucket. */
static int bucket_start_gather(zero_plan *p, float *grads, int b) {
    int N = p->d->world, me = p->d->rank;
    size_t b0, b1;
    zero_bucket_range(p, b, &b0, &b1);
    const int *cnt = p->counts + (size_t)b * N, *dsp = p->displs + (size_t)b * N;
    if (cnt[me]) p->be->copy(p->be, grads + b0 + dsp[me], p->gshard + (b0 + dsp[me] - p->lo), (size_t)cnt[me] * sizeof(float));
    DIST_MPI_CHECK(p->d, MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, grads + b0, cnt, dsp, MPI_FLOAT, p->d->comm,
                                         &p->req[b]), "gradient all-gather");
    p->bstate[b] = B_GATHER;
    return QT_OK;
}

/* The reduction is a fixed sequence of operations, the same on every rank
 * (non-blocking collectives must start in the same order everywhere, while
 * the order in which they complete differs between ranks):
 *   op k < nb:        reduce-scatter of bucket nb-1-k (last layers first)
 *   op k >= nb:       all-gather of bucket nb-1-(k-nb)  (stage 0/1 only)
 * At most ZERO_IN_FLIGHT operations run at once: OpenMPI's reduce-scatter
 * keeps a temporary copy of each bucket in flight (measured: with every
 * bucket in flight rank 0 held one extra copy of the whole block), so the
 * window bounds that to ZERO_IN_FLIGHT buckets. */
static int n_ops(const zero_plan *p) { return p->stage == 2 ? p->nb : 2 * p->nb; }

/* Tests the operations in flight, then starts the next ones in sequence up to
 * op `limit` while the window has room. Returns the buckets not yet done. */
static int progress(zero_plan *p, float *grads, int limit, int *rc) {
    *rc = QT_OK;
    int left = 0;
    for (int b = p->nb - 1; b >= 0; b--) {
        unsigned char s = p->bstate[b];
        if (s == B_SCATTER || s == B_GATHER) {
            int flag = 0;
            int mrc = MPI_Test(&p->req[b], &flag, MPI_STATUS_IGNORE);
            if (mrc != MPI_SUCCESS) {
                *rc = dist_mpi_fail(p->d, mrc, "MPI_Test",
                                    s == B_SCATTER ? "gradient reduce-scatter" : "gradient all-gather");
                return 1;
            }
            if (flag) {
                p->bstate[b] = s = (s == B_GATHER || p->stage == 2) ? B_DONE : B_SCATTERED;
                p->in_flight--;
            }
        }
        if (s != B_DONE) left++;
    }
    while (p->next_op < limit && p->in_flight < ZERO_IN_FLIGHT) {
        int k = p->next_op;
        if (k < p->nb) {
            *rc = bucket_start_scatter(p, grads, p->nb - 1 - k);
        } else {
            int b = p->nb - 1 - (k - p->nb);
            if (p->bstate[b] != B_SCATTERED) break; /* its sums are not in yet */
            *rc = bucket_start_gather(p, grads, b);
        }
        if (*rc) return left ? left : 1;
        p->in_flight++;
        p->next_op++;
    }
    return left;
}

static int begin_reduction(zero_plan *p, float *grads) {
    if (p->started && p->grads_in_flight != grads)
        return QT_ERR(QT_EINVAL, "dist: the gradient block changed address during a reduction; pass the same "
                                 "pointer to zero_reduce_ready and zero_reduce_grads");
    if (!p->started) {
        memset(p->bstate, B_IDLE, (size_t)p->nb);
        p->started = 1;
        p->next_op = 0;
        p->ready_ops = 0;
        p->in_flight = 0;
        p->grads_in_flight = grads;
    }
    return QT_OK;
}
#endif

int zero_reduce_ready(zero_plan *p, float *grads, size_t from) {
    if (p->d->world == 1) return QT_OK;
#if QT_DIST_MPI
    QT_TRY(begin_reduction(p, grads));
    /* buckets wholly inside [from, n): nb - ceil(from / bucket) of them */
    size_t first = (from + p->bucket - 1) / p->bucket;
    int ready = first >= (size_t)p->nb ? 0 : p->nb - (int)first;
    if (ready > p->ready_ops) p->ready_ops = ready;
    /* libnbc progresses only inside MPI calls: testing here is what lets the
     * buckets in flight advance while the backward computes */
    int rc;
    progress(p, grads, p->ready_ops, &rc);
    return rc;
#else
    (void)grads;
    (void)from;
    return QT_OK;
#endif
}

int zero_reduce_grads(zero_plan *p, float *grads) {
    if (p->d->world == 1) return QT_OK;
#if QT_DIST_MPI
    QT_TRY(begin_reduction(p, grads));
    const char *what = p->stage == 2 ? "gradient reduce-scatter" : "gradient all-reduce";
    dist_waiter w;
    dist_waiter_start(p->d, &w, what);
    int rc = QT_OK;
    while (progress(p, grads, n_ops(p), &rc) > 0 && rc == QT_OK) dist_waiter_tick(p->d, &w);
    dist_waiter_end(p->d, &w);
    p->started = 0;
    p->grads_in_flight = NULL;
    if (rc) return rc;
    /* stage 2: the own shard is final; copy it to its place in the block */
    if (p->stage == 2 && p->hi > p->lo) p->be->copy(p->be, grads + p->lo, p->gshard, (p->hi - p->lo) * sizeof(float));
    return QT_OK;
#else
    (void)grads;
    return QT_OK;
#endif
}

#if QT_DIST_MPI
/* Bucket-by-bucket collectives outside the gradient reduction (parameter
 * all-gather, checkpoint gather/scatter): started in bucket order, at most
 * ZERO_IN_FLIGHT at once, all waited on with the deadline. */
typedef int (*bucket_op)(zero_plan *p, int b, void *ctx);

static int run_buckets(zero_plan *p, bucket_op start, void *ctx, const char *what) {
    dist_waiter w;
    dist_waiter_start(p->d, &w, what);
    int next = 0, done = 0, rc = QT_OK;
    int lo = 0; /* buckets below lo are complete: the window is [lo, next) */
    while (done < p->nb) {
        while (next < p->nb && next - lo < ZERO_IN_FLIGHT) {
            rc = start(p, next, ctx);
            if (rc) goto out;
            next++;
        }
        int progressed = 0;
        for (int b = lo; b < next; b++) {
            if (p->req[b] == MPI_REQUEST_NULL) continue;
            int flag = 0, mrc = MPI_Test(&p->req[b], &flag, MPI_STATUS_IGNORE);
            if (mrc != MPI_SUCCESS) { rc = dist_mpi_fail(p->d, mrc, "MPI_Test", what); goto out; }
            if (flag) { done++; progressed = 1; }
        }
        while (lo < next && p->req[lo] == MPI_REQUEST_NULL) lo++;
        if (!progressed) dist_waiter_tick(p->d, &w);
    }
out:
    dist_waiter_end(p->d, &w);
    return rc;
}

static int start_param_gather(zero_plan *p, int b, void *ctx) {
    float *params = ctx;
    int N = p->d->world;
    size_t b0, b1;
    zero_bucket_range(p, b, &b0, &b1);
    DIST_MPI_CHECK(p->d, MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, params + b0, p->counts + (size_t)b * N,
                                         p->displs + (size_t)b * N, MPI_FLOAT, p->d->comm, &p->req[b]),
                   "parameter all-gather");
    return QT_OK;
}
#endif

int zero_reduce_partial(zero_plan *p, double *vals, int n, dist_op op, const char *what) {
    if (p->stage == 0) return QT_OK;
    return dist_allreduce_f64(p->d, vals, n, op, what);
}

int zero_allgather_params(zero_plan *p, float *params) {
    if (p->stage == 0 || p->d->world == 1) return QT_OK;
#if QT_DIST_MPI
    return run_buckets(p, start_param_gather, params, "parameter all-gather");
#else
    (void)params;
    return QT_OK;
#endif
}

int dist_step_gradients(dist_ctx *d, zero_plan *p, float *grads, double *grad_sq_sum, int *overflow) {
    (void)d;
    QT_TRY(zero_reduce_grads(p, grads));
    size_t lo, hi;
    zero_opt_range(p, &lo, &hi);
    double sq = p->be->sum_squares(p->be, grads + lo, hi - lo); /* finite iff every element is */
    int bad = !isfinite(sq);
    double vals[2] = {sq, bad};
    dist_op ops[2] = {DIST_SUM, DIST_MAX};
    if (p->stage != 0) QT_TRY(dist_allreduce_ops(p->d, vals, ops, 2, "gradient norm and overflow check"));
    if (grad_sq_sum) *grad_sq_sum = vals[0];
    if (overflow) *overflow = vals[1] != 0;
    return QT_OK;
}

int dist_allgather_params(dist_ctx *d, zero_plan *p, float *params) {
    (void)d;
    return zero_allgather_params(p, params);
}

/* ------------------------------------------------------------------------- */
/* Optimizer state                                                             */

void zero_set_device_allocator(zero_plan *p, zero_alloc_fn alloc, zero_free_fn release, void *user) {
    p->dev_alloc = alloc ? alloc : default_dev_alloc;
    p->dev_free = release ? release : default_dev_free;
    p->dev_user = user;
}

/* Host (offloaded) state comes straight from the kernel: page-aligned,
 * zero-filled, and committed only as the optimizer first touches it. A GPU
 * backend would pin these pages for its host-to-device copies. */
static void *host_alloc(size_t bytes) {
    void *q = mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (q == MAP_FAILED) {
        QT_ERR(QT_ENOMEM, "could not map %.1f MiB of host memory for the offloaded optimizer state; free host "
                          "memory or use more ranks (ZeRO stage 2 divides it by the rank count)",
               (double)bytes / (1 << 20));
        return NULL;
    }
    qt_advise_huge(q, bytes);
    return q;
}

int zero_state_alloc(zero_plan *p, int nslots, zero_state *st) {
    memset(st, 0, sizeof *st);
    if (nslots < 1 || nslots > ZERO_MAX_SLOTS)
        return QT_ERR(QT_EINVAL, "dist: %d optimizer state slots asked for; 1 to %d", nslots, ZERO_MAX_SLOTS);
    zero_opt_range(p, &st->lo, &st->hi);
    size_t len = st->hi - st->lo, bytes;
    if (!qt_mul_ok(len, sizeof(float), &bytes)) return QT_ERR(QT_ENOMEM, "dist: optimizer state size overflows");
    st->on_host = p->offload;
    for (int s = 0; s < nslots; s++) {
        float *q;
        if (p->offload) {
            q = host_alloc(bytes);
        } else {
            q = p->dev_alloc(bytes, "the optimizer state", p->dev_user);
            if (q) p->be->zero(p->be, q, bytes);
        }
        if (!q) {
            zero_state_free(p, st);
            return QT_ENOMEM;
        }
        st->slot[s] = q;
        st->nslots = s + 1;
        st->bytes += bytes;
        if (p->offload) p->bytes_host += bytes;
        else p->bytes_device += bytes;
    }
    return QT_OK;
}

void zero_state_free(zero_plan *p, zero_state *st) {
    size_t bytes = (st->hi - st->lo) * sizeof(float);
    for (int s = 0; s < st->nslots; s++) {
        if (!st->slot[s]) continue;
        if (st->on_host) {
            munmap(st->slot[s], bytes ? bytes : 1);
            p->bytes_host -= bytes;
        } else {
            p->dev_free(st->slot[s], p->dev_user);
            p->bytes_device -= bytes;
        }
        st->slot[s] = NULL;
    }
    st->nslots = 0;
    st->bytes = 0;
}

size_t zero_state_bytes_device(const zero_plan *p) { return p->bytes_device; }
size_t zero_state_bytes_host(const zero_plan *p) { return p->bytes_host; }

static int check_slot(const zero_plan *p, const zero_state *st, int slot) {
    size_t lo, hi;
    zero_opt_range(p, &lo, &hi);
    if (slot < 0 || slot >= st->nslots || !st->slot[slot])
        return QT_ERR(QT_EINVAL, "dist: optimizer state slot %d does not exist (%d slots)", slot, st->nslots);
    if (st->lo != lo || st->hi != hi)
        return QT_ERR(QT_EINVAL, "dist: optimizer state covers [%zu, %zu) but this plan's range is [%zu, %zu); "
                                 "allocate it with the same plan", st->lo, st->hi, lo, hi);
    return QT_OK;
}

void zero_ckpt_part(const zero_plan *p, int *index, int *count, size_t *lo, size_t *hi) {
    if (p->stage == 0 || p->d->world == 1) {
        *count = 1;
        *index = p->d->rank == 0 ? 0 : -1;
        *lo = 0;
        *hi = p->d->rank == 0 ? p->n : 0;
        return;
    }
    *count = p->d->world;
    *index = p->d->rank;
    zero_shard_of(p, p->d->rank, lo, hi);
}

int zero_state_view(const zero_plan *p, const zero_state *st, int slot, float **data) {
    *data = NULL;
    QT_TRY(check_slot(p, st, slot));
    *data = st->slot[slot];
    return QT_OK;
}

#if QT_DIST_MPI
typedef struct {
    float *mine;
    float *full;
} slot_io;

static int start_state_gather(zero_plan *p, int b, void *ctx) {
    slot_io *io = ctx;
    int N = p->d->world, me = p->d->rank;
    size_t b0, b1;
    zero_bucket_range(p, b, &b0, &b1);
    const int *cnt = p->counts + (size_t)b * N, *dsp = p->displs + (size_t)b * N;
    const float *send = io->mine + (cnt[me] ? b0 + (size_t)dsp[me] - p->lo : 0);
    DIST_MPI_CHECK(p->d, MPI_Igatherv(send, cnt[me], MPI_FLOAT, me == 0 ? io->full + b0 : NULL, cnt, dsp,
                                      MPI_FLOAT, 0, p->d->comm, &p->req[b]), "optimizer state gather");
    return QT_OK;
}

static int start_state_scatter(zero_plan *p, int b, void *ctx) {
    slot_io *io = ctx;
    int N = p->d->world, me = p->d->rank;
    size_t b0, b1;
    zero_bucket_range(p, b, &b0, &b1);
    const int *cnt = p->counts + (size_t)b * N, *dsp = p->displs + (size_t)b * N;
    if (p->stage == 0) {
        /* every rank holds the whole block */
        if (me == 0) p->be->upload(p->be, io->mine + b0, io->full + b0, (b1 - b0) * sizeof(float));
        DIST_MPI_CHECK(p->d, MPI_Ibcast(io->mine + b0, (int)(b1 - b0), MPI_FLOAT, 0, p->d->comm, &p->req[b]),
                       "optimizer state scatter");
    } else {
        float *recv = io->mine + (cnt[me] ? b0 + (size_t)dsp[me] - p->lo : 0);
        DIST_MPI_CHECK(p->d, MPI_Iscatterv(me == 0 ? io->full + b0 : NULL, cnt, dsp, MPI_FLOAT, recv, cnt[me],
                                           MPI_FLOAT, 0, p->d->comm, &p->req[b]), "optimizer state scatter");
    }
    return QT_OK;
}
#endif

int zero_state_gather(zero_plan *p, const zero_state *st, int slot, float *full) {
    QT_TRY(check_slot(p, st, slot));
    float *mine = st->slot[slot];
    if (p->stage == 0 || p->d->world == 1) {
        /* replicated: rank 0 already holds everything */
        if (p->d->rank == 0 && p->n) p->be->download(p->be, full, mine, p->n * sizeof(float));
        return QT_OK;
    }
#if QT_DIST_MPI
    slot_io io = {mine, full};
    return run_buckets(p, start_state_gather, &io, "optimizer state gather");
#else
    return QT_OK;
#endif
}

int zero_state_scatter(zero_plan *p, zero_state *st, int slot, const float *full) {
    QT_TRY(check_slot(p, st, slot));
    float *mine = st->slot[slot];
    if (p->d->world == 1) {
        if (p->n) p->be->upload(p->be, mine, full, p->n * sizeof(float));
        return QT_OK;
    }
#if QT_DIST_MPI
    slot_io io = {mine, (float *)full};
    return run_buckets(p, start_state_scatter, &io, "optimizer state scatter");
#else
    return QT_OK;
#endif
}

/* ------------------------------------------------------------------------- */
/* Streaming checkpoints: one element range at a time, so rank 0 never needs
 * the whole optimizer state in memory (2 x 56 GB for Qwen-14B's m and v). */

#if QT_DIST_MPI
/* counts/displs of [lo, hi) ∩ shard_r, relative to lo (N entries each). */
static void range_table(const zero_plan *p, size_t lo, size_t hi, int *cnt, int *dsp) {
    for (int r = 0; r < p->d->world; r++) {
        size_t s0, s1;
        zero_shard_of(p, r, &s0, &s1);
        size_t a = s0 > lo ? s0 : lo, e = s1 < hi ? s1 : hi;
        cnt[r] = e > a ? (int)(e - a) : 0;
        dsp[r] = e > a ? (int)(a - lo) : 0;
    }
}
#endif

static int check_range(const zero_plan *p, size_t lo, size_t hi) {
    if (lo > hi || hi > p->n)
        return QT_ERR(QT_EINVAL, "dist: element range [%zu, %zu) is outside the block of %zu", lo, hi, p->n);
    if (hi - lo > (size_t)INT_MAX / 2)
        return QT_ERR(QT_EINVAL, "dist: element range of %zu elements is too long for one transfer; use chunks of at "
                                 "most %d", hi - lo, INT_MAX / 2);
    return QT_OK;
}

int zero_state_gather_range(zero_plan *p, const zero_state *st, int slot, size_t lo, size_t hi, float *out) {
    QT_TRY(check_slot(p, st, slot));
    QT_TRY(check_range(p, lo, hi));
    const float *mine = st->slot[slot];
    if (p->stage == 0 || p->d->world == 1) {
        if (p->d->rank == 0 && hi > lo) p->be->download(p->be, out, mine + lo, (hi - lo) * sizeof(float));
        return QT_OK;
    }
#if QT_DIST_MPI
    int N = p->d->world, me = p->d->rank;
    int *cnt = qt_malloc(2 * (size_t)N * sizeof(int), "a gather table");
    if (!cnt) return QT_ENOMEM;
    int *dsp = cnt + N;
    range_table(p, lo, hi, cnt, dsp);
    const float *send = mine + (cnt[me] ? lo + (size_t)dsp[me] - p->lo : 0);
    MPI_Request rq;
    int rc = MPI_Igatherv(send, cnt[me], MPI_FLOAT, me == 0 ? out : NULL, cnt, dsp, MPI_FLOAT, 0, p->d->comm, &rq);
    rc = rc == MPI_SUCCESS ? dist_wait_all(p->d, &rq, 1, "optimizer state gather")
                           : dist_mpi_fail(p->d, rc, "MPI_Igatherv", "optimizer state gather");
    qt_free(cnt);
    return rc;
#else
    return QT_OK;
#endif
}

int zero_state_scatter_range(zero_plan *p, zero_state *st, int slot, size_t lo, size_t hi, const float *in) {
    QT_TRY(check_slot(p, st, slot));
    QT_TRY(check_range(p, lo, hi));
    float *mine = st->slot[slot];
    if (p->d->world == 1) {
        if (hi > lo) p->be->upload(p->be, mine + lo, in, (hi - lo) * sizeof(float));
        return QT_OK;
    }
#if QT_DIST_MPI
    int N = p->d->world, me = p->d->rank;
    MPI_Request rq;
    int rc;
    if (p->stage == 0) {
        if (me == 0 && hi > lo) p->be->upload(p->be, mine + lo, in, (hi - lo) * sizeof(float));
        rc = MPI_Ibcast(mine + lo, (int)(hi - lo), MPI_FLOAT, 0, p->d->comm, &rq);
        return rc == MPI_SUCCESS ? dist_wait_all(p->d, &rq, 1, "optimizer state scatter")
                                 : dist_mpi_fail(p->d, rc, "MPI_Ibcast", "optimizer state scatter");
    }
    int *cnt = qt_malloc(2 * (size_t)N * sizeof(int), "a scatter table");
    if (!cnt) return QT_ENOMEM;
    int *dsp = cnt + N;
    range_table(p, lo, hi, cnt, dsp);
    float *recv = mine + (cnt[me] ? lo + (size_t)dsp[me] - p->lo : 0);
    rc = MPI_Iscatterv(me == 0 ? in : NULL, cnt, dsp, MPI_FLOAT, recv, cnt[me], MPI_FLOAT, 0, p->d->comm, &rq);
    rc = rc == MPI_SUCCESS ? dist_wait_all(p->d, &rq, 1, "optimizer state scatter")
                           : dist_mpi_fail(p->d, rc, "MPI_Iscatterv", "optimizer state scatter");
    qt_free(cnt);
    return rc;
#else
    return QT_OK;
#endif
}
