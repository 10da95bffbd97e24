/* ZeRO over the flat fp32 trainable block: shard ranges, the gradient
 * reductions, the parameter all-gather (see dist.h for the call order). Every
 * collective goes through transport.h, so a device library can replace MPI.
 *
 * Layout: the block [0, n) is cut into N contiguous shards of `shard`
 * elements (ceil(n/N) rounded up to 16, so every shard starts on a 64-byte
 * boundary); rank r owns [r*shard, min((r+1)*shard, n)).
 *
 * Gradients, stage 0/1: the whole block is all-reduced in place, bucket by
 * bucket (reduce_bucket_size elements), last bucket first, at most
 * ZERO_IN_FLIGHT at once.
 * Gradients, stage 2 (DeepSpeed's partitioned gradients): the model hands
 * each gradient bucket over as soon as its backward is done (model.h
 * qt_grad_hook; the buckets are reduce_bucket_size's, memplan.h
 * qt_grad_pack); each slice of at most reduce_bucket_size elements that lies
 * in one rank's shard is reduced to that rank, in place into its fp32
 * gradient shard (the owner first adds its own contribution there). With
 * offload the shard is pinned host memory, which a device collective may not
 * write: the owner's sum lands in its window piece and is added to the shard
 * once complete (the same sum in another order: shard + (own + others)). The
 * shard accumulates over the micro-steps of an optimizer step. No rank holds a
 * gradient block; what stays in flight reads the model's windows (two
 * alternating with overlap_comm), and zero_grads_window waits for a window
 * before it is reused.
 * The embedding's gradient is sparse (the rows of this micro-batch's
 * tokens): the rows are all-gathered and each owner adds those in its shard.
 *
 * Parameters, stage 1/2: the shards are all-gathered through a staging bucket
 * of allgather_bucket_size elements in N equal padded partitions (NCCL's rule):
 * an fp32 block, or (a sharded master, model.h qt_model_sharded) the 2-byte
 * compute copy and the f32 runs of norm weights and biases.
 *
 * Parameters, stage 3: the model's compute weights stay partitioned; a
 * layer's flat range is gathered when the graph reads it (zero_gather_params:
 * each owner broadcasts its part in place, non-blocking for the prefetch),
 * and only the 1-D tensors kept whole are all-gathered after the update.
 *
 * The memory all this takes is zero_memory's answer, which zero_plan_create
 * allocates and `qtune plan` prints. */
#include "dist/dist_internal.h"
#include "dist/transport.h"

#include "backend/backend.h"

#include "core/error.h"
#include "core/shard.h"
#include "core/log.h"
#include "core/mem.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#define ZERO_ALIGN QT_SHARD_ALIGN /* elements: 64 bytes of fp32 */
#define ZERO_IN_FLIGHT 4  /* stage 0/1 all-reduce buckets communicating at once */
#define CKPT_CHUNK ((size_t)1 << 24) /* elements per checkpoint gather/scatter call */

typedef struct {
    tp_req *r;
    const float *at;  /* the window piece it came from (stage 2): [at, at + n), waited for before reuse */
    size_t n;
    float *acc_to;    /* offloaded: the owner's piece was reduced in the window; added here once done */
} zero_flight;

struct zero_plan {
    dist_ctx *d;
    int stage, offload, overlap;
    size_t n;            /* elements in the flat block */
    size_t shard;        /* elements per shard (last ones shorter) */
    size_t lo, hi;       /* own shard */
    size_t bucket;       /* reduce_bucket_size */
    size_t ag;           /* elements per rank in one all-gather bucket */
    int nb;              /* reduce buckets over the block */
    zero_mem mem;        /* what this rank allocated here (zero_memory) */
    float *gshard;       /* stage 2: (hi - lo) reduced gradients, summed over micro-steps (pinned host
                            memory with offload, as DeepSpeed keeps the offloaded gradient partition) */
    float *stage_buf;    /* stage 1/2: (N * ag) all-gather staging */
    float *rows_buf;     /* stage 2, trainable embedding: (N * rows_p) */
    size_t rows_p;       /* floats of one rank's rows message */
    int emb_rows, emb_dim;
    /* stage 0/1 reduction of the whole block */
    tp_req **req;        /* (nb) */
    int started, next, ready;
    float *grads_in_flight;
    /* stage 2 reductions in flight */
    zero_flight *fly;
    int n_fly, cap_fly;
    size_t bytes_device, bytes_host;
    zero_alloc_fn dev_alloc;
    zero_free_fn dev_free;
    void *dev_user;
    qt_backend *be;      /* copies, zeroing, sums and the sum of squares of device memory */
    int own_be;
    float *rows_host;    /* (1 + emb_rows): one rows message's count and ids, on the host */
    size_t *gtab;        /* (2N) a gather's counts and displacements: allocated with the plan, so a
                            gather every rank has entered cannot fail on one of them for memory */
};

static void *default_dev_alloc(size_t bytes, const char *what, void *user) {
    (void)user;
    return qt_alloc_aligned(bytes, what);
}
static void default_dev_free(void *p, void *user) {
    (void)user;
    qt_free(p);
}

/* ------------------------------------------------------------------------- */
/* The plan of one rank's buffers                                              */

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
static size_t shard_len(size_t n, int N) { return qt_shard_len(n, N); }
static size_t opt_bucket(size_t b) { return b ? b : ZERO_DEFAULT_BUCKET; }

/* Elements per rank in one all-gather bucket: allgather_bucket_size over N
 * partitions, whole shards at most. */
static size_t gather_part(size_t n, int N, const zero_opts *o) {
    size_t sh = shard_len(n, N), ag = round_up(opt_bucket(o->allgather_bucket_elems) / (size_t)N, ZERO_ALIGN);
    if (ag > (size_t)INT_MAX / 2 / (size_t)N) ag = (size_t)INT_MAX / 2 / (size_t)N / ZERO_ALIGN * ZERO_ALIGN;
    if (o->stage == 3 && o->persist_elems < sh) sh = round_up(o->persist_elems ? o->persist_elems : 1, ZERO_ALIGN);
    return ag < sh ? ag : sh;
}

static size_t rows_msg(const zero_opts *o) {
    return o->emb_rows > 0 ? 1 + (size_t)o->emb_rows * ((size_t)o->emb_dim + 1) : 0;
}

size_t zero_reduce_piece(size_t n, int N, const zero_opts *o) {
    size_t bucket = opt_bucket(o->bucket_elems), sh = shard_len(n, N);
    if (bucket > n) bucket = n;
    /* zero_memory's rule: a piece is at most a bucket, a window and a shard (ready() cuts at shard boundaries) */
    size_t piece = o->unit_elems && o->unit_elems < bucket ? o->unit_elems : bucket;
    return piece > sh ? sh : piece;
}

int zero_memory(size_t n, int N, int rank, const zero_opts *o, int nslots, zero_mem *m) {
    memset(m, 0, sizeof *m);
    if (N < 1 || rank < 0 || rank >= N)
        return QT_ERR(QT_EINVAL, "dist: rank %d of %d ranks does not exist", rank, N);
    size_t sh = shard_len(n, N), lo, hi;
    qt_shard_range(n, N, rank, &lo, &hi);
    size_t own = o->stage == 0 ? n : hi - lo, bucket = opt_bucket(o->bucket_elems);
    if (bucket > n) bucket = n;
    if (N > 1) {
        if (o->stage >= 2) {
            m->grad_shard = (hi - lo) * 4;
            m->rows = (size_t)N * rows_msg(o) * 4;
            /* the reductions' temporaries: a piece is at most a bucket, a window and a shard (ready()
             * cuts at shard boundaries) */
            size_t piece = o->unit_elems && o->unit_elems < bucket ? o->unit_elems : bucket;
            if (piece > sh) piece = sh;
            m->reduce_parts = tp_reduce_temp_bytes(N, piece * 4, o->overlap);
        } else {
            /* the all-reduce's temporary, for each bucket in flight */
            size_t nb = n ? (n + bucket - 1) / bucket : 0;
            m->reduce_parts = (nb < ZERO_IN_FLIGHT ? nb : ZERO_IN_FLIGHT) * tp_allreduce_temp_bytes(N, rank, bucket * 4);
        }
        if (o->stage >= 1) m->gather_stage = (size_t)N * gather_part(n, N, o) * 4;
    }
    m->opt_state = (size_t)nslots * own * 4;
    m->total = m->grad_shard + m->reduce_parts + m->gather_stage + m->rows + m->opt_state;
    return QT_OK;
}

/* The plan's buffers are the backend's: the gradient shard pinned host
 * memory with offload (device memory otherwise), the staging buckets device
 * memory. */
static int bufs_alloc(zero_plan *p) {
    qt_backend *be = p->be;
    if (p->mem.grad_shard) {
        p->gshard = qt_be_alloc(be, p->offload ? QT_MEM_PINNED : QT_MEM_DEVICE, p->mem.grad_shard, "the gradient shard");
        if (!p->gshard) return QT_ENOMEM;
        qt_be_zero(be, p->gshard, p->mem.grad_shard);
    }
    if (p->mem.gather_stage && !(p->stage_buf = qt_be_alloc(be, QT_MEM_DEVICE, p->mem.gather_stage, "the all-gather bucket")))
        return QT_ENOMEM;
    if (p->mem.rows && !(p->rows_buf = qt_be_alloc(be, QT_MEM_DEVICE, p->mem.rows, "the embedding rows bucket")))
        return QT_ENOMEM;
    return QT_OK;
}

static void bufs_free(zero_plan *p) {
    if (!p->be) return;
    qt_be_free(p->be, p->gshard);
    qt_be_free(p->be, p->stage_buf);
    qt_be_free(p->be, p->rows_buf);
    p->gshard = p->stage_buf = p->rows_buf = NULL;
}

int zero_plan_create(dist_ctx *d, size_t n, const zero_opts *opts, zero_plan **out) {
    *out = NULL;
    if (opts->stage < 0 || opts->stage > 3)
        return QT_ERR(QT_EUNSUPPORTED, "zero_optimization.stage %d is not supported; use 0, 1, 2 or 3", opts->stage);
    size_t bucket = opt_bucket(opts->bucket_elems);
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
    p->overlap = opts->overlap;
    p->n = n;
    p->bucket = bucket;
    p->nb = (int)nb;
    p->shard = shard_len(n, N);
    zero_shard_of(p, d->rank, &p->lo, &p->hi);
    p->dev_alloc = default_dev_alloc;
    p->dev_free = default_dev_free;
    p->emb_rows = opts->emb_rows;
    p->emb_dim = opts->emb_dim;
    p->rows_p = rows_msg(opts);
    p->ag = gather_part(n, N, opts);
    zero_memory(n, N, d->rank, opts, 0, &p->mem);
    int ok = 1;
    p->req = qt_calloc(nb + 1, sizeof *p->req, "ZeRO requests");
    ok &= p->req != NULL;
    p->gtab = qt_calloc(2 * (size_t)N, sizeof *p->gtab, "a gather table");
    ok &= p->gtab != NULL;
    if (p->mem.rows)
        ok &= (p->rows_host = qt_malloc((1 + (size_t)p->emb_rows) * sizeof(float), "the embedding rows ids")) != NULL;
    if (opts->be) {
        p->be = opts->be;
    } else {
        int ok_be = qt_backend_open("cpu", &p->be) == QT_OK;
        p->own_be = ok_be;
        ok &= ok_be;
    }
    if (!ok || bufs_alloc(p) != QT_OK) {
        zero_plan_free(p);
        return QT_ENOMEM;
    }
    qt_debug("zero: stage %d, n %zu, rank %d shard [%zu, %zu), %d buckets of %zu, all-gather %zu per rank",
             p->stage, n, d->rank, p->lo, p->hi, p->nb, bucket, p->ag);
    *out = p;
    return QT_OK;
}



void zero_plan_free(zero_plan *p) {
    if (!p) return;
    if (p->req) tp_wait(p->d, p->req, p->nb, "gradient all-reduce");
    for (int i = 0; i < p->n_fly; i++) tp_wait(p->d, &p->fly[i].r, 1, "gradient reduce");
    bufs_free(p);
    if (p->own_be) qt_backend_close(p->be);
    qt_free(p->rows_host);
    qt_free(p->gtab);
    qt_free(p->req);
    qt_free(p->fly);
    qt_free(p);
}

int zero_n_buckets(const zero_plan *p) { return p->nb; }
float *zero_grad_shard(zero_plan *p) { return p->gshard; }

void zero_shard_of(const zero_plan *p, int r, size_t *lo, size_t *hi) { qt_shard_range(p->n, p->d->world, r, lo, hi); }

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
/* Stage 0/1: all-reduce of the whole gradient block, bucket by bucket        */

/* Tests the buckets in flight, then starts the next ones (last bucket first)
 * up to `limit` while the window has room. Returns the buckets not yet done. */
static int progress(zero_plan *p, float *grads, int limit, int *rc) {
    *rc = QT_OK;
    int in_flight = 0;
    for (int k = 0; k < p->next; k++) {
        int b = p->nb - 1 - k, done;
        if (!p->req[b]) continue;
        *rc = tp_test(p->d, p->req[b], &done);
        if (*rc) return 1;
        if (done) *rc = tp_wait(p->d, &p->req[b], 1, "gradient all-reduce");
        else in_flight++;
        if (*rc) return 1;
    }
    while (p->next < limit && in_flight < ZERO_IN_FLIGHT) {
        int b = p->nb - 1 - p->next;
        size_t b0, b1;
        zero_bucket_range(p, b, &b0, &b1);
        *rc = tp_allreduce_f32(p->d, grads + b0, b1 - b0, &p->req[b], "gradient all-reduce");
        if (*rc) return 1;
        p->next++;
        in_flight++;
    }
    return in_flight + (p->nb - p->next);
}

static int begin_reduction(zero_plan *p, float *grads) {
    if (p->started && p->grads_in_flight != grads)
        return QT_ERR(QT_EINVAL, "dist: the gradient block changed address during a reduction; pass the same "
                                 "pointer to zero_reduce_ready and zero_reduce_grads");
    if (!p->started) {
        p->started = 1;
        p->next = 0;
        p->ready = 0;
        p->grads_in_flight = grads;
    }
    return QT_OK;
}

int zero_reduce_ready(zero_plan *p, float *grads, size_t from) {
    if (p->d->world == 1 || p->stage >= 2) return QT_OK;
    QT_TRY(begin_reduction(p, grads));
    /* buckets wholly inside [from, n): nb - ceil(from / bucket) of them */
    size_t first = (from + p->bucket - 1) / p->bucket;
    int ready = first >= (size_t)p->nb ? 0 : p->nb - (int)first;
    if (ready > p->ready) p->ready = ready;
    /* MPI progresses only inside its calls: testing here lets the buckets in
     * flight advance while the backward computes */
    int rc;
    progress(p, grads, p->ready, &rc);
    return rc;
}

static int reduce_block_stage2(zero_plan *p, float *grads);

int zero_reduce_grads(zero_plan *p, float *grads) {
    if (p->d->world == 1) return QT_OK;
    if (p->stage >= 2) return reduce_block_stage2(p, grads);
    QT_TRY(begin_reduction(p, grads));
    int rc = QT_OK;
    while (progress(p, grads, p->nb, &rc) > 0 && rc == QT_OK) {
        /* block on the oldest bucket in flight (tp_wait keeps the deadline) */
        for (int k = 0; k < p->next; k++) {
            int b = p->nb - 1 - k;
            if (p->req[b]) {
                rc = tp_wait(p->d, &p->req[b], 1, "gradient all-reduce");
                break;
            }
        }
        if (rc) break;
    }
    p->started = 0;
    p->grads_in_flight = NULL;
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Stage 2: gradients reduced to their owners as the backward produces them   */

static int fly_push(zero_plan *p, tp_req *r, const float *at, size_t n, float *acc_to) {
    if (p->n_fly == p->cap_fly) {
        int cap = p->cap_fly ? 2 * p->cap_fly : 64;
        zero_flight *f = qt_realloc(p->fly, (size_t)cap * sizeof *f, "ZeRO requests in flight");
        if (!f) {
            tp_wait(p->d, &r, 1, "gradient reduce");
            return QT_ENOMEM;
        }
        p->fly = f;
        p->cap_fly = cap;
    }
    p->fly[p->n_fly++] = (zero_flight){r, at, n, acc_to};
    return QT_OK;
}

/* Waits for the requests filed under any of [win, win + n) (or all),
 * and lets the others progress; completed ones leave the list. A window holds
 * a bucket's several ranges, each handed over on its own, so the test is by
 * address range, not by the pointer handed over. */
static int fly_settle(zero_plan *p, const float *win, size_t n, int all) {
    int k = 0, rc = QT_OK;
    for (int i = 0; i < p->n_fly; i++) {
        zero_flight f = p->fly[i];
        int done = 0, hit = win && f.at < win + n && win < f.at + f.n;
        if (rc == QT_OK) rc = tp_test(p->d, f.r, &done);
        if (rc == QT_OK && (done || all || hit)) rc = tp_wait(p->d, &f.r, 1, "gradient reduce");
        if (f.r) p->fly[k++] = f;
        else if (rc == QT_OK && f.acc_to) qt_be_acc(p->be, f.acc_to, f.at, f.n); /* an offloaded owner's sum */
    }
    p->n_fly = k;
    return rc;
}

int zero_grads_begin(zero_plan *p) {
    if (p->stage < 2) return QT_ERR(QT_EINVAL, "dist: gradient hand-over is ZeRO stage 2's and 3's; this plan is stage %d",
                                     p->stage);
    QT_TRY(fly_settle(p, NULL, 0, 1));
    if (p->gshard) qt_be_zero(p->be, p->gshard, p->mem.grad_shard);
    return QT_OK;
}

int zero_grads_window(zero_plan *p, const float *win, size_t n) { return fly_settle(p, win, n, 0); }

int zero_grads_ready(zero_plan *p, size_t lo, size_t hi, const float *g) {
    if (hi > p->n || lo > hi)
        return QT_ERR(QT_EINVAL, "dist: gradient range [%zu, %zu) is outside the block of %zu", lo, hi, p->n);
    const int me = p->d->rank;
    for (size_t a = lo; a < hi;) {
        int r = (int)(a / p->shard);
        size_t s0, s1;
        zero_shard_of(p, r, &s0, &s1);
        size_t e = hi < s1 ? hi : s1;
        if (e - a > p->bucket) e = a + p->bucket;
        tp_req *q = NULL;
        float *dst = p->gshard + (a - p->lo), *acc_to = NULL;
        if (r == me && p->offload) {
            /* the shard is host memory, which a device collective may not write: the ranks' sum lands in
             * the owner's window piece (the model is done with it until window() hands it back), and is
             * added to the shard once complete */
            float *piece = (float *)g + (a - lo);
            QT_TRY(tp_reduce_f32(p->d, piece, piece, e - a, r, p->overlap ? &q : NULL, "gradient reduce"));
            if (q) acc_to = dst;
            else qt_be_acc(p->be, dst, piece, e - a);
        } else if (r == me) {
            /* the owner's contribution goes into its shard, which the reduce then sums in place */
            qt_be_acc(p->be, dst, g + (a - lo), e - a);
            QT_TRY(tp_reduce_f32(p->d, dst, dst, e - a, r, p->overlap ? &q : NULL, "gradient reduce"));
        } else {
            QT_TRY(tp_reduce_f32(p->d, g + (a - lo), NULL, e - a, r, p->overlap ? &q : NULL, "gradient reduce"));
        }
        /* filed under the window piece it came from, the owner's too (it reads the shard): the window's
         * reuse then waits for it as well, which keeps what is in flight (and MPI's temporaries,
         * zero_memory's count) to the two windows' worth */
        if (q) QT_TRY(fly_push(p, q, g + (a - lo), e - a, acc_to));
        a = e;
    }
    return fly_settle(p, NULL, 0, 0); /* progress for what is in flight */
}

int zero_grads_rows(zero_plan *p, size_t base, int C, const int32_t *ids, const float *rows, int n) {
    if (n > p->emb_rows || C != p->emb_dim)
        return QT_ERR(QT_EINVAL, "dist: %d embedding rows of %d for a plan sized for %d of %d", n, C, p->emb_rows,
                      p->emb_dim);
    /* the lm_head's slices of a tied embedding may still be summing into the shard */
    QT_TRY(fly_settle(p, NULL, 0, 1));
    const int N = p->d->world;
    const size_t P = p->rows_p;
    /* the message: count and ids (the host's, staged in rows_host and uploaded), then the
     * rows (device memory, copied by the backend); the bucket is the transport's */
    float *mine = p->rows_buf + (size_t)p->d->rank * P, *hdr = p->rows_host;
    const size_t H = 1 + (size_t)p->emb_rows;
    hdr[0] = (float)n;
    memcpy(hdr + 1, ids, (size_t)n * sizeof(int32_t)); /* ids travel as bit patterns */
    qt_be_upload(p->be, mine, hdr, (1 + (size_t)n) * sizeof *hdr);
    qt_be_copy(p->be, mine + H, rows, (size_t)n * C * sizeof *mine);
    QT_TRY(tp_allgather_f32(p->d, mine, p->rows_buf, P, NULL, "embedding rows"));
    for (int r = 0; r < N; r++) {
        const float *msg = p->rows_buf + (size_t)r * P, *d = msg + H;
        qt_be_download(p->be, hdr, msg, sizeof *hdr); /* the count, then its ids */
        int cnt = (int)hdr[0];
        if (cnt > 0) qt_be_download(p->be, hdr + 1, msg + 1, (size_t)cnt * sizeof *hdr);
        for (int i = 0; i < cnt; i++) {
            int32_t id;
            memcpy(&id, hdr + 1 + i, sizeof id);
            size_t a = base + (size_t)id * C, e = a + (size_t)C;
            size_t x0 = a > p->lo ? a : p->lo, x1 = e < p->hi ? e : p->hi;
            if (x1 > x0) qt_be_acc(p->be, p->gshard + (x0 - p->lo), d + (size_t)i * C + (x0 - a), x1 - x0);
        }
    }
    return QT_OK;
}

int zero_grads_finish(zero_plan *p) { return fly_settle(p, NULL, 0, 1); }

/* The full-block path at stage 2 (a caller with its own gradient block): the
 * block is reduced to the owners, whose shard lands at its place. */
static int reduce_block_stage2(zero_plan *p, float *grads) {
    int overlap = p->overlap;
    p->overlap = 1;
    int rc = zero_grads_begin(p);
    if (rc == QT_OK) rc = zero_grads_ready(p, 0, p->n, grads);
    if (rc == QT_OK) rc = zero_grads_finish(p);
    p->overlap = overlap;
    if (rc == QT_OK && p->hi > p->lo) qt_be_copy(p->be, grads + p->lo, p->gshard, (p->hi - p->lo) * sizeof(float));
    return rc;
}

/* ------------------------------------------------------------------------- */
/* Parameters: the shards all-gathered through the staging bucket             */

int zero_allgather_block(zero_plan *p, void *block, size_t esize) {
    if (p->stage == 0 || p->d->world == 1) return QT_OK;
    const int N = p->d->world, me = p->d->rank;
    const size_t s = p->ag, part = s * esize; /* s is a multiple of 16: whole floats for the transport */
    char *b = block, *stage = (char *)p->stage_buf;
    for (size_t k0 = 0; k0 < p->shard; k0 += s) {
        /* partition r of this bucket: shard r's elements [k0, k0 + s), padded */
        char *mine = stage + (size_t)me * part;
        size_t a = p->lo + k0, e = a + s < p->hi ? a + s : p->hi, len = e > a ? e - a : 0;
        if (len) qt_be_copy(p->be, mine, b + a * esize, len * esize);
        if (len < s) qt_be_zero(p->be, mine + len * esize, (s - len) * esize);
        QT_TRY(tp_allgather_f32(p->d, (float *)mine, p->stage_buf, part / sizeof(float), NULL, "parameter all-gather"));
        for (int r = 0; r < N; r++) {
            size_t s0, s1;
            zero_shard_of(p, r, &s0, &s1);
            size_t ra = s0 + k0, re = ra + s < s1 ? ra + s : s1;
            if (r != me && re > ra) qt_be_copy(p->be, b + ra * esize, stage + (size_t)r * part, (re - ra) * esize);
        }
    }
    return QT_OK;
}

int zero_allgather_params(zero_plan *p, float *params) { return zero_allgather_block(p, params, sizeof(float)); }

/* Rank r's elements of the runs, packed in run order: positions [k0, k1) of
 * that sequence copied between the packed buffer buf (position k0 first) and
 * dst (each run at its `at`). to_buf: dst -> buf; else buf -> dst. Returns
 * the rank's whole count. */
static size_t runs_move(zero_plan *p, int r, const qt_flat_run *runs, int n, float *dst, float *buf, size_t k0,
                        size_t k1, int to_buf) {
    size_t s0, s1, k = 0;
    zero_shard_of(p, r, &s0, &s1);
    for (int i = 0; i < n; i++) {
        size_t a = runs[i].flat > s0 ? runs[i].flat : s0, e = runs[i].flat + runs[i].n;
        if (e > s1) e = s1;
        if (e <= a) continue;
        /* this piece is positions [k, k + e - a) of rank r's sequence */
        size_t x0 = k > k0 ? k : k0, x1 = k + (e - a) < k1 ? k + (e - a) : k1;
        if (x1 > x0) {
            float *d = dst + runs[i].at + (a - runs[i].flat) + (x0 - k), *q = buf + (x0 - k0);
            if (to_buf) qt_be_copy(p->be, q, d, (x1 - x0) * sizeof(float));
            else qt_be_copy(p->be, d, q, (x1 - x0) * sizeof(float));
        }
        k += e - a;
    }
    return k;
}

int zero_allgather_runs(zero_plan *p, float *dst, const qt_flat_run *runs, int n) {
    if (p->stage == 0 || p->d->world == 1) return QT_OK;
    const int N = p->d->world, me = p->d->rank;
    const size_t s = p->ag;
    size_t most = 0;
    for (int r = 0; r < N; r++) {
        size_t c = runs_move(p, r, runs, n, dst, NULL, 0, 0, 0);
        if (c > most) most = c;
    }
    /* through the staging bucket, s elements of each rank's sequence a round */
    for (size_t k0 = 0; k0 < most; k0 += s) {
        float *mine = p->stage_buf + (size_t)me * s;
        size_t c = runs_move(p, me, runs, n, dst, mine, k0, k0 + s, 1);
        size_t len = c > k0 ? (c - k0 < s ? c - k0 : s) : 0;
        if (len < s) qt_be_zero(p->be, mine + len, (s - len) * sizeof(float));
        QT_TRY(tp_allgather_f32(p->d, mine, p->stage_buf, s, NULL, "norm and bias all-gather"));
        for (int r = 0; r < N; r++)
            if (r != me) runs_move(p, r, runs, n, dst, p->stage_buf + (size_t)r * s, k0, k0 + s, 0);
    }
    return QT_OK;
}

/* ------------------------------------------------------------------------- */
/* Stage 3: a range of the sharded parameters gathered at use                 */

/* Broadcasts of at most this many bytes (the transport's counts are below TP_MAX_COUNT). */
#define GATHER_CHUNK ((size_t)1 << 28)

/* Rank r's part of [lo, hi): [*a, *e), empty when *e <= *a. */
static void part_of(const zero_plan *p, size_t n, int r, size_t lo, size_t hi, size_t *a, size_t *e) {
    size_t s0, s1;
    qt_shard_range(n, p->d->world, r, &s0, &s1);
    *a = s0 > lo ? s0 : lo;
    *e = s1 < hi ? s1 : hi;
}

int zero_gather_slots(const zero_plan *p, size_t n, size_t lo, size_t hi, size_t esize) {
    int k = 0;
    for (int r = 0; r < p->d->world; r++) {
        size_t a, e;
        part_of(p, n, r, lo, hi, &a, &e);
        if (e > a) k += (int)(((e - a) * esize + GATHER_CHUNK - 1) / GATHER_CHUNK);
    }
    return k;
}

int zero_gather_params(zero_plan *p, size_t n, const void *mine, size_t esize, size_t lo, size_t hi, void *dst,
                       tp_req **rqs) {
    if (lo > hi || hi > n)
        return QT_ERR(QT_EINVAL, "dist: parameter range [%zu, %zu) is outside the block of %zu", lo, hi, n);
    char *out = dst;
    size_t mlo, mhi;
    qt_shard_range(n, p->d->world, p->d->rank, &mlo, &mhi);
    int k = 0;
    for (int r = 0; r < p->d->world; r++) {
        size_t a, e;
        part_of(p, n, r, lo, hi, &a, &e);
        if (e <= a) continue;
        char *at = out + (a - lo) * esize;
        size_t bytes = (e - a) * esize;
        if (r == p->d->rank) qt_be_copy(p->be, at, (const char *)mine + (a - mlo) * esize, bytes);
        if (p->d->world == 1) continue;
        for (size_t o = 0; o < bytes; o += GATHER_CHUNK) {
            size_t c = bytes - o < GATHER_CHUNK ? bytes - o : GATHER_CHUNK;
            QT_TRY(tp_bcast(p->d, at + o, c, r, rqs ? &rqs[k++] : NULL, "parameter gather"));
        }
    }
    return QT_OK;
}

int zero_gather_wait(zero_plan *p, tp_req **rqs, int n) { return tp_wait(p->d, rqs, n, "parameter gather"); }

int zero_reduce_partial(zero_plan *p, double *vals, int n, dist_op op, const char *what) {
    if (p->stage == 0) return QT_OK;
    return dist_allreduce_f64(p->d, vals, n, op, what);
}

int dist_step_gradients(dist_ctx *d, zero_plan *p, float *grads, double *grad_sq_sum, int *overflow) {
    (void)d;
    size_t lo, hi;
    zero_opt_range(p, &lo, &hi);
    const float *g = grads + lo;
    if (grads) {
        QT_TRY(zero_reduce_grads(p, grads));
    } else {
        /* stage 2 with the gradients handed over during the backward */
        QT_TRY(zero_grads_finish(p));
        if (!p->gshard && hi > lo)
            return QT_ERR(QT_EINVAL, "dist: no gradient block and no gradient shard (ZeRO stage %d)", p->stage);
        g = p->gshard;
    }
    double sq = qt_be_sum_squares(p->be, g, hi - lo); /* finite iff every element is */
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

/* Host (offloaded) state is the backend's pinned host memory, which its ops
 * read and write in place (on the cpu backend plain host memory; under CUDA
 * page-locked memory a kernel reaches through unified addressing), beside the
 * master and gradient shards offload also puts there. */
static void *host_alloc(zero_plan *p, size_t bytes) {
    void *q = qt_be_alloc(p->be, QT_MEM_PINNED, bytes ? bytes : 64, "the offloaded optimizer state");
    if (!q) {
        QT_ERR(QT_ENOMEM, "could not allocate %.1f MiB of host memory for the offloaded optimizer state; free "
                          "host memory or use more ranks (ZeRO stage 1/2 divide it by the rank count)",
               (double)bytes / (1 << 20));
        return NULL;
    }
    qt_be_zero(p->be, q, bytes);
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
            q = host_alloc(p, bytes);
        } else {
            q = p->dev_alloc(bytes, "the optimizer state", p->dev_user);
            if (q) qt_be_zero(p->be, q, bytes);
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
            qt_be_free(p->be, st->slot[s]);
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

/* ------------------------------------------------------------------------- */
/* Checkpoints, gathered: rank 0 receives or sends whole element ranges, one
 * chunk at a time, through the transport's gatherv/scatterv (stage 1/2) or
 * broadcast (stage 0: every rank holds the whole state). */

/* counts/displs of [a, e) ∩ shard_r, relative to a (N entries each). */
static void range_table(const zero_plan *p, size_t a0, size_t e0, size_t *cnt, size_t *dsp) {
    for (int r = 0; r < p->d->world; r++) {
        size_t s0, s1;
        zero_shard_of(p, r, &s0, &s1);
        size_t a = s0 > a0 ? s0 : a0, e = s1 < e0 ? s1 : e0;
        cnt[r] = e > a ? e - a : 0;
        dsp[r] = e > a ? a - a0 : 0;
    }
}

static int check_range(const zero_plan *p, size_t lo, size_t hi) {
    if (lo > hi || hi > p->n)
        return QT_ERR(QT_EINVAL, "dist: element range [%zu, %zu) is outside the block of %zu", lo, hi, p->n);
    if (hi - lo > (size_t)INT_MAX / 2)
        return QT_ERR(QT_EINVAL, "dist: element range of %zu elements is too long for one transfer; use chunks of at "
                                 "most %d", hi - lo, INT_MAX / 2);
    return QT_OK;
}

/* [lo, hi) of the slot to/from rank 0's buffer io (hi - lo floats). */
static int move_range(zero_plan *p, float *mine, size_t lo, size_t hi, float *io, int to_root) {
    const int N = p->d->world, me = p->d->rank;
    if (p->stage == 0 || N == 1) {
        /* replicated: rank 0 holds everything; a scatter broadcasts it */
        if (to_root) {
            if (me == 0 && hi > lo) qt_be_download(p->be, io, mine + lo, (hi - lo) * sizeof(float));
            return QT_OK;
        }
        if (me == 0 && hi > lo) qt_be_upload(p->be, mine + lo, io, (hi - lo) * sizeof(float));
        for (size_t a = lo; a < hi; a += CKPT_CHUNK) {
            size_t e = hi - a < CKPT_CHUNK ? hi : a + CKPT_CHUNK;
            QT_TRY(tp_bcast(p->d, mine + a, (e - a) * sizeof(float), 0, NULL, "optimizer state scatter"));
        }
        return QT_OK;
    }
    size_t *cnt = p->gtab, *dsp = cnt + N;
    int rc = QT_OK;
    for (size_t a = lo; a < hi && rc == QT_OK; a += CKPT_CHUNK) {
        size_t e = hi - a < CKPT_CHUNK ? hi : a + CKPT_CHUNK;
        range_table(p, a, e, cnt, dsp);
        float *part = mine + (cnt[me] ? a + dsp[me] - p->lo : 0);
        float *root = io ? io + (a - lo) : NULL;
        rc = to_root ? tp_gatherv_f32(p->d, part, cnt[me], root, cnt, dsp, NULL, "optimizer state gather")
                     : tp_scatterv_f32(p->d, root, cnt, dsp, part, cnt[me], NULL, "optimizer state scatter");
    }
    return rc;
}

int zero_gather_range(zero_plan *p, const float *mine, size_t lo, size_t hi, float *out) {
    if (p->stage == 0 || p->d->world == 1)
        return QT_ERR(QT_EINVAL, "dist: zero_gather_range is for a block sharded over ranks (ZeRO 1/2, 2+ ranks)");
    QT_TRY(check_range(p, lo, hi));
    return move_range(p, (float *)mine, lo, hi, out, 1);
}

int zero_state_gather(zero_plan *p, const zero_state *st, int slot, float *full) {
    QT_TRY(check_slot(p, st, slot));
    return move_range(p, st->slot[slot], 0, p->n, full, 1);
}

int zero_state_scatter(zero_plan *p, zero_state *st, int slot, const float *full) {
    QT_TRY(check_slot(p, st, slot));
    return move_range(p, st->slot[slot], 0, p->n, (float *)full, 0);
}

int zero_state_gather_range(zero_plan *p, const zero_state *st, int slot, size_t lo, size_t hi, float *out) {
    QT_TRY(check_slot(p, st, slot));
    QT_TRY(check_range(p, lo, hi));
    return move_range(p, st->slot[slot], lo, hi, out, 1);
}

int zero_state_scatter_range(zero_plan *p, zero_state *st, int slot, size_t lo, size_t hi, const float *in) {
    QT_TRY(check_slot(p, st, slot));
    QT_TRY(check_range(p, lo, hi));
    return move_range(p, st->slot[slot], lo, hi, (float *)in, 0);
}
