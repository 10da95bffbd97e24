/* Data parallelism: one process per rank under MPI (OpenMPI), or a single
 * process when qtune was built without MPI or was started without mpirun.
 *
 * Two layers:
 *  - dist_*: the process group. Rank and world, small scalar all-reduces (loss
 *    sums, token counts, grad-norm partial sums, overflow flags), broadcast and
 *    barrier. Every collective is non-blocking underneath and is waited on with
 *    a deadline (QTUNE_DIST_TIMEOUT seconds, default 300): a rank that dies or
 *    hangs makes every surviving rank print which rank stopped responding in
 *    which collective, and abort the job.
 *  - zero_*: the ZeRO plan over the model's ONE flat fp32 trainable block of n
 *    elements. Each rank owns a contiguous element range [lo, hi) (its shard);
 *    gradients are all-reduced (stage 0, 1) in buckets, or (stage 2) reduced
 *    to their owners as the backward hands them over, so that no rank holds a
 *    gradient block; the optimizer state (m, v, ...) is allocated for the
 *    rank's range only (stage 1, 2) in host memory when offloaded, and the
 *    updated parameters are all-gathered (stage 1, 2); at stage 3 the weights
 *    the graph reads stay partitioned too and each layer's are gathered at use
 *    (zero_gather_params). The collectives go through transport.h.
 *
 * Per optimizer step the trainer calls, in this order (docs/distributed.md):
 *   dist_allreduce_i64(&tokens)        global labelled-token count, BEFORE backward
 *   ... forward/backward of every micro-batch, grads += ...
 *   zero_reduce_grads(plan, grads)     grads[opt_lo, opt_hi) now hold the global sum
 *     (ZeRO-2 over several ranks instead: zero_grads_begin before the first
 *     backward; the backward hands its gradients to zero_grads_*; the shard
 *     zero_grad_shard holds the global sum)
 *   zero_reduce_partial(plan, ...)     grad-norm^2 partial sums, overflow flags
 *   optimizer on [opt_lo, opt_hi) with the zero_state slots
 *   zero_allgather_params(plan, params) every rank has the whole updated block
 *
 * Dimension letters: n elements in the flat block, N ranks (world). */
#ifndef QT_DIST_DIST_H
#define QT_DIST_DIST_H

#include "core/shard.h"
#include <signal.h>
#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------- */
/* Process group                                                               */

typedef struct dist_ctx dist_ctx;

typedef enum { DIST_SUM = 0, DIST_MAX = 1, DIST_MIN = 2 } dist_op;

/* Default collective deadline in seconds; QTUNE_DIST_TIMEOUT overrides it. */
#define DIST_DEFAULT_TIMEOUT_S 300.0

/* Starts MPI when the process was launched by mpirun/srun (OMPI_COMM_WORLD_SIZE,
 * PMIX_RANK or PMI_SIZE in the environment) and this build has MPI; otherwise
 * a single process (rank 0 of 1). A build without MPI launched as one of
 * several ranks fails with QT_EDIST and a sentence saying so. Reads
 * QTUNE_DIST_TIMEOUT (seconds, > 0). Call once, early (before threads). */
int dist_init(int *argc, char ***argv, dist_ctx **out);
/* Finalizes MPI (when it was started) and frees the context. NULL is fine. */
void dist_finalize(dist_ctx *d);

int dist_rank(const dist_ctx *d);
int dist_world(const dist_ctx *d);
int dist_is_main(const dist_ctx *d); /* rank 0: the one that logs and writes files */
int dist_uses_mpi(const dist_ctx *d); /* 1 when MPI was started for this run */
int dist_built_with_mpi(void);        /* QTUNE_HAVE_MPI of this build */

/* A program that handles SIGTERM itself (to stop after a step and save)
 * passes the flag its handler sets: a collective still waiting 2 s after it
 * was set says so, naming the collective (dist_init installs its own
 * SIGTERM note only where SIGTERM has the default action). */
void dist_set_stop_flag(dist_ctx *d, volatile sig_atomic_t *flag);

double dist_timeout(const dist_ctx *d);
void dist_set_timeout(dist_ctx *d, double seconds);

/* Phases outside the training step (model and data loading, checkpoint save
 * and load, final outputs) move bytes through disks and tokenizers while the
 * other ranks wait in a collective. Each gets its own deadline: the user's
 * timeout (QTUNE_DIST_TIMEOUT, not any override in force) plus the time
 * `bytes` take at a deliberately slow rate, so a stalled rank is still named
 * (by the same message as in a step) and a slow disk is not taken for one.
 * Set it with dist_set_timeout for the phase and restore dist_timeout after. */
#define DIST_DISK_FLOOR_BPS 20e6    /* bytes/s: a slow disk or network filesystem */
#define DIST_TOKENIZE_FLOOR_BPS 1e6 /* bytes/s of text: building a token cache */
double dist_phase_timeout(const dist_ctx *d, double bytes, double bytes_per_s);

/* In-place all-reduce of a few scalars over all ranks. `what` names the
 * collective in the timeout message ("token count", "loss sum"). */
/* The most scalars one dist_allreduce_* call takes; callers with more split them. */
#define DIST_MAX_SCALARS 64
int dist_allreduce_f64(dist_ctx *d, double *vals, int n, dist_op op, const char *what);
int dist_allreduce_i64(dist_ctx *d, int64_t *vals, int n, dist_op op, const char *what);
/* Every rank's n values, rank-major into all (world * n); no count cap. */
int dist_allgather_i64(dist_ctx *d, const int64_t *mine, int n, int64_t *all, const char *what);
/* Bytes from root to every rank (any size; sent in chunks below INT_MAX). */
int dist_bcast(dist_ctx *d, void *buf, size_t bytes, int root, const char *what);
int dist_barrier(dist_ctx *d, const char *what);

/* Seconds this rank spent inside collectives since dist_init (waiting
 * included): the communication share of a step is its difference over the step. */
double dist_comm_seconds(const dist_ctx *d);

/* The backend whose memory the transport's buffers (transport.h tp_*: the
 * gradients, parameters and ZeRO's buckets) are. Where its device memory is
 * not host-readable (desc->host_reads_device 0: the guard backend, or CUDA
 * under an MPI that is not CUDA-aware, before an NCCL transport exists), each
 * collective copies its device buffers to host memory, runs MPI there and
 * copies the result back when it completes. A host-readable backend (cpu) or
 * NULL: MPI reads the buffers in place. Call it before the first collective
 * on device memory; the caller keeps the backend open.
 * With several ranks on the Ascend backend ("npu") it also starts HCCL, every
 * rank together (transport_hccl.c): all-reduce, reduce, reduce-scatter,
 * all-gather and broadcast then run card to card; gatherv/scatterv and the
 * barrier stay on MPI. QT_EDIST (every rank) when HCCL cannot start. */
struct qt_backend;
int dist_set_backend(dist_ctx *d, struct qt_backend *be);
/* "HCCL" once dist_set_backend started it, else "MPI". */
const char *dist_transport_name(const dist_ctx *d);

/* Ends every rank of the job now (MPI_Abort) after printing nothing more; a
 * single process just exits with `code`. For a fatal error on one rank that
 * the others would otherwise wait on until the timeout. */
_Noreturn void dist_abort(dist_ctx *d, int code);

/* ------------------------------------------------------------------------- */
/* ZeRO over the flat fp32 trainable block                                     */

typedef struct zero_plan zero_plan;
struct qt_backend;

/* DeepSpeed's default reduce_bucket_size and allgather_bucket_size. */
#define ZERO_DEFAULT_BUCKET ((size_t)500000000)

typedef struct {
    int stage;            /* 0: replicate everything; 1: shard optimizer state;
                             2: also partition gradients (each rank keeps only its shard);
                             3: also partition the parameters (gathered at use: zero_gather_params) */
    int offload_param;    /* stage 3, offload_param.device = cpu: the parameter shard in host memory */
    int prefetch;         /* stage 3: the next layer's gather starts before this layer computes */
    double reuse_distance; /* stage 3: stage3_max_reuse_distance, parameters (DeepSpeed's 1e9 by default;
                             model.h qt_model_opts.param_reuse_distance) */
    size_t persist_elems; /* stage 3: elements kept whole on every rank (norm weights, biases), all-gathered
                             after each update (zero_allgather_runs): they, not the block, size its bucket */
    int offload;          /* offload_optimizer.device = cpu: optimizer state in host memory */
    size_t bucket_elems;  /* reduce_bucket_size: elements per gradient collective; 0 = 5e8 */
    size_t allgather_bucket_elems; /* allgather_bucket_size: elements of the parameter
                             all-gather's staging bucket (all ranks' parts); 0 = 5e8 */
    int overlap;          /* overlap_comm, stage 2: reductions run while the backward goes on */
    int emb_rows, emb_dim; /* stage 2 with a trainable embedding: most rows per micro-batch
                             (max_B * max_T) and their width C; 0 otherwise */
    size_t unit_elems;    /* stage 2: the largest piece the model hands over (its gradient
                             window, qt_model_grad_window_elems); sizes the reduce temporaries */
    struct qt_backend *be; /* whose memory the gradients, parameters and the plan's buffers are
                             (backend/backend.h); ZeRO's copies, zeroing and sums go through it.
                             NULL: a cpu backend of the plan's own. The caller keeps it open */
} zero_opts;

/* The rule both the trainer and `qtune plan` follow: at stage 2 over several
 * ranks the model holds no gradient block (model.h opts.grad_windows) and
 * hands its gradients to zero_grads_*; on one rank there is nothing to
 * partition, so the model keeps its block. */
static inline int zero_partitions_grads(int stage, int world) { return stage >= 2 && world > 1; }
/* ZeRO-3 over several ranks: each rank keeps 1/N of the weights the graph
 * reads (model.h qt_model_opts.param_shards); a layer's are gathered before
 * its forward and again before its backward (zero_gather_params). */
static inline int zero_partitions_params(int stage, int world) { return stage == 3 && world > 1; }
/* ZeRO 1/2 over several ranks keep each rank's shard of the fp32 master (the
 * model applies it where the master is not the weights the graph reads:
 * qt_model_opts.master_shards, memplan.h qt_model_opts_sharded). */
static inline int zero_partitions_master(int stage, int world) { return stage >= 1 && world > 1; }

/* What one rank of a ZeRO plan allocates, in bytes: zero_plan_create
 * allocates exactly these (and zero_state_alloc the optimizer state), and
 * `qtune plan` adds them to the model's own blocks. */
typedef struct {
    size_t grad_shard;   /* stage 2: the fp32 gradient shard (the whole block on one rank) */
    size_t reduce_parts; /* the communication library's temporaries for the gradient
                            reductions (transport.h tp_*_temp_bytes); counted, not allocated here */
    size_t gather_stage; /* stage 1/2: the parameter all-gather's staging bucket */
    size_t rows;         /* stage 2, trainable embedding: the embedding rows all-gather */
    size_t opt_state;    /* nslots fp32 arrays over the optimizer range (host when offloaded) */
    size_t total;
} zero_mem;
int zero_memory(size_t n, int world, int rank, const zero_opts *opts, int nslots, zero_mem *out);
/* Stage 2/3: the most elements one gradient reduction carries (a bucket, a window and a shard at most);
 * zero_mem.reduce_parts counts the communication library's temporaries of these. */
size_t zero_reduce_piece(size_t n, int world, const zero_opts *opts);

/* Every rank must pass the same n and opts. */
int zero_plan_create(dist_ctx *d, size_t n, const zero_opts *opts, zero_plan **out);
/* Frees the plan (waits for nothing: call zero_reduce_grads first). */
void zero_plan_free(zero_plan *p);

/* Shard of rank r: [lo, hi). Shards are contiguous, in rank order, of equal
 * length rounded up to 16 elements (64 bytes); the last ones may be shorter
 * or empty when n is small. Defined for every stage. */
void zero_shard_of(const zero_plan *p, int r, size_t *lo, size_t *hi);
/* The element range this rank's optimizer updates: its shard at stage 1/2,
 * the whole block [0, n) at stage 0. After zero_reduce_grads the gradients
 * of this range are final (summed over ranks). */
void zero_opt_range(const zero_plan *p, size_t *lo, size_t *hi);
int zero_n_buckets(const zero_plan *p);
void zero_bucket_range(const zero_plan *p, int b, size_t *lo, size_t *hi);

/* Gradient reduction (sum over ranks). Simple path: call zero_reduce_grads
 * after the last backward of the step. Overlapped path: during the last
 * backward, call zero_reduce_ready(p, grads, from) whenever every gradient in
 * [from, n) is final (a backward pass runs last layer first); it starts the
 * non-blocking reduction of the buckets that lie wholly in [from, n) and lets
 * MPI progress the ones in flight; zero_reduce_grads then starts the rest and
 * waits for all. Afterwards:
 *   stage 0, 1: grads[0, n) hold the global sum on every rank;
 *   stage 2:    grads[lo, hi) (own shard) hold the global sum; the rest of the
 *               gradient block holds partial data and may be reused.
 * `grads` must stay the same pointer between these calls, and every rank
 * must make the same sequence of calls with the same `from` values
 * (non-blocking collectives start in call order). At most 4 buckets are in
 * flight at once; the others start as those finish. */
int zero_reduce_ready(zero_plan *p, float *grads, size_t from);
int zero_reduce_grads(zero_plan *p, float *grads);

/* Stage 2, gradients handed over by the model's backward (model.h
 * qt_grad_hook; these are its three callbacks plus the step's bounds):
 *   zero_grads_begin       at the start of an optimizer step: the shard is zeroed
 *   zero_grads_window(g, n) waits until nothing in flight reads g[0, n)
 *   zero_grads_ready(lo, hi, g)  g holds this micro-batch's gradients of [lo, hi):
 *                          each part is reduced to the rank owning it, into its
 *                          shard (non-blocking with opts.overlap, else at once)
 *   zero_grads_rows        the embedding rows of this micro-batch (all-gathered;
 *                          each owner adds the rows in its shard)
 *   zero_grads_finish      waits for all (dist_step_gradients calls it)
 * zero_grad_shard: the reduced gradients of [lo, hi), summed over ranks and
 * micro-steps (stage 2; on one rank the whole block). */
int zero_grads_begin(zero_plan *p);
int zero_grads_window(zero_plan *p, const float *g, size_t n);
int zero_grads_ready(zero_plan *p, size_t lo, size_t hi, const float *g);
int zero_grads_rows(zero_plan *p, size_t lo, int C, const int32_t *ids, const float *rows, int n);
int zero_grads_finish(zero_plan *p);
float *zero_grad_shard(zero_plan *p);

/* Turns per-rank partial values over the optimizer range into global ones:
 * at stage 1/2 (disjoint shards) an all-reduce with op; at stage 0 every rank
 * already computed the global value over [0, n), so nothing moves. Use it for
 * the sum of squared gradients (clipping) and the overflow flag (DIST_MAX). */
int zero_reduce_partial(zero_plan *p, double *vals, int n, dist_op op, const char *what);

/* After the optimizer updated params[opt_lo, opt_hi): every rank receives the
 * other shards (stage 1/2, in-place all-gather in buckets). No-op at stage 0. */
int zero_allgather_params(zero_plan *p, float *params);
/* The same over a block of esize-byte elements (a 2-byte compute copy: each
 * rank converted its own shard; half the bytes of the fp32 gather). */
int zero_allgather_block(zero_plan *p, void *block, size_t esize);
/* The elements of runs (core/shard.h: flat ranges kept in dst at their `at`)
 * that lie in each rank's shard reach every rank: each rank filled its own
 * (a sharded master's norm weights and biases, copied whole to every rank). */
int zero_allgather_runs(zero_plan *p, float *dst, const qt_flat_run *runs, int n);
/* Rank 0 receives elements [lo, hi) of a block sharded as the plan shards
 * (mine: this rank's elements, its lo first) in out (host memory, hi - lo
 * floats; ignored on the other ranks). Collective: every rank calls it with
 * the same range. Stage 1/2 over 2+ ranks only. */
int zero_gather_range(zero_plan *p, const float *mine, size_t lo, size_t hi, float *out);

/* Stage 3: the flat elements [lo, hi) of a block of n esize-byte elements
 * sharded by the plan's formula (core/shard.h over n: the trainable block's
 * n = zero_numel, or LoRA's frozen base block; mine: this rank's elements,
 * its lo first) reach
 * every rank's dst (hi - lo elements): each owner broadcasts its part in
 * place, so no staging and no padding, and every rank receives the same bits.
 * With rqs (at least zero_gather_slots(p, lo, hi) slots) the broadcasts are
 * started and left in flight (the prefetch); tp_wait them before reading dst.
 * Collective: every rank calls it with the same range, in the same order. */
struct tp_req;
int zero_gather_slots(const zero_plan *p, size_t n, size_t lo, size_t hi, size_t esize);
int zero_gather_params(zero_plan *p, size_t n, const void *mine, size_t esize, size_t lo, size_t hi, void *dst,
                       struct tp_req **rqs);
int zero_gather_wait(zero_plan *p, struct tp_req **rqs, int n);

/* Convenience for the trainer: one call per optimizer step between the last
 * backward and the optimizer. Reduces the gradients (see zero_reduce_grads;
 * grads NULL at stage 2: the handed-over gradients, zero_grads_finish)
 * and returns the global sum of squared gradients and whether any gradient is
 * inf/NaN on any rank (both computed over the own range, then combined). */
int dist_step_gradients(dist_ctx *d, zero_plan *p, float *grads, double *grad_sq_sum, int *overflow);
/* Same as zero_allgather_params (named to pair with dist_step_gradients). */
int dist_allgather_params(dist_ctx *d, zero_plan *p, float *params);

/* ------------------------------------------------------------------------- */
/* Optimizer state over the rank's range                                       */

#define ZERO_MAX_SLOTS 4

/* nslots fp32 arrays of zero_opt_range length (e.g. AdamW m and v; a third for
 * an fp32 master copy when the compute weights live elsewhere), zeroed.
 * With opts.offload they come from host memory (counted as host bytes), else
 * from the device allocator (counted as device bytes; on the CPU backend that
 * is aligned host memory too, but the path and the count stay separate). */
typedef struct {
    float *slot[ZERO_MAX_SLOTS]; /* (hi - lo) each */
    int nslots;
    size_t lo, hi;               /* the element range they cover */
    int on_host;                 /* 1 when offloaded */
    size_t bytes;                /* nslots * (hi - lo) * 4 */
} zero_state;

/* Allocator for device-resident optimizer state (a GPU backend installs one;
 * the default is qt_alloc_aligned/qt_free). */
typedef void *(*zero_alloc_fn)(size_t bytes, const char *what, void *user);
typedef void (*zero_free_fn)(void *ptr, void *user);
void zero_set_device_allocator(zero_plan *p, zero_alloc_fn alloc, zero_free_fn release, void *user);

int zero_state_alloc(zero_plan *p, int nslots, zero_state *st);
void zero_state_free(zero_plan *p, zero_state *st);

/* Optimizer-state bytes this rank holds now, by placement (metrics.jsonl:
 * opt_state_bytes). Counted by the allocator above. */
size_t zero_state_bytes_device(const zero_plan *p);
size_t zero_state_bytes_host(const zero_plan *p);

/* Checkpoints, sharded (what the trainer writes): each rank saves its own
 * range of the state, nothing moves between ranks. zero_ckpt_part says which
 * part of the checkpoint this rank writes: part *index of *count, elements
 * [lo, hi). At stage 1/2 that is its shard (count = world; a shard may be
 * empty when n is small); at stage 0 every rank holds the whole state, so
 * rank 0 writes it as the one part and the others write nothing (*index = -1).
 * zero_state_view gives the rank's slot (hi - lo floats over zero_opt_range,
 * host-addressable as the gather below assumes), checked against the plan.
 * A reader takes any element range from the parts, so a checkpoint written by
 * N ranks resumes with any other number of ranks or stage. */
void zero_ckpt_part(const zero_plan *p, int *index, int *count, size_t *lo, size_t *hi);
int zero_state_view(const zero_plan *p, const zero_state *st, int slot, float **data);

/* Checkpoints, gathered (the format before sharded files). Gather one slot to rank 0: full (n floats) must be valid on
 * rank 0 and is ignored elsewhere. Scatter is the reverse: rank 0 holds the
 * whole slot (n floats, as saved) and every rank receives its range. Because
 * shards are element ranges of the same flat block, a checkpoint written with
 * N ranks resumes with any other number of ranks or stage. */
int zero_state_gather(zero_plan *p, const zero_state *st, int slot, float *full);
int zero_state_scatter(zero_plan *p, zero_state *st, int slot, const float *full);
/* The same for the element range [lo, hi) of the block only (out/in hold
 * hi - lo floats on rank 0; at most INT_MAX/2 elements per call), so a
 * checkpoint of a large model can stream through a small buffer on rank 0.
 * Every rank calls with the same range. */
int zero_state_gather_range(zero_plan *p, const zero_state *st, int slot, size_t lo, size_t hi, float *out);
int zero_state_scatter_range(zero_plan *p, zero_state *st, int slot, size_t lo, size_t hi, const float *in);

#endif
