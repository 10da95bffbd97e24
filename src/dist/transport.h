/* The collectives ZeRO needs, as one small interface a device library can sit
 * under: MPI implements it now (transport_mpi.c); NCCL (and later HCCL) map
 * onto it call for call, so this header names no MPI type.
 *
 *   all-reduce       in place, sum; every rank receives the same bits
 *   reduce           sum to one root (ZeRO-2: a gradient slice to its owner);
 *                    at the root send may equal recv (in place)
 *   reduce-scatter   equal counts: send holds N partitions of `count`
 *                    elements, rank r receives the sum of partition r
 *   all-gather       equal counts: rank r's `count` elements land at
 *                    recv + r*count; send may be recv + rank*count (in place)
 *   broadcast, barrier (both with the collective deadline of dist.h)
 *   gatherv/scatterv to/from rank 0 (checkpoints written the old way, a
 *                    sharded master's writes)
 *
 * Buffers are the backend's device memory (dist_set_backend), except rank 0's
 * whole buffer of gatherv/scatterv, which is host memory.
 *
 * Equal counts are NCCL's rule: a caller whose partitions differ in length
 * pads them to the longest (zero.c's all-gather staging does).
 *
 * Every call is non-blocking when given a request slot (rq != NULL): it
 * starts the collective and returns; tp_test polls it (and lets the library
 * progress), tp_wait waits for several with the deadline (QTUNE_DIST_TIMEOUT)
 * and frees them. rq == NULL: start and wait. Non-blocking collectives must be
 * started in the same order on every rank. Buffers stay untouched by the
 * caller until the request completed.
 *
 * Counts are elements (fp32) or bytes (broadcast) below TP_MAX_COUNT; larger
 * transfers are the caller's to cut (ZeRO's buckets are). With one rank every
 * call is a local copy (or nothing) and completes at once. */
#ifndef QT_DIST_TRANSPORT_H
#define QT_DIST_TRANSPORT_H

#include <stddef.h>

#include "dist/dist.h"

#define TP_MAX_COUNT ((size_t)1 << 30)

typedef struct tp_req tp_req;

int tp_allreduce_f32(dist_ctx *d, float *buf, size_t count, tp_req **rq, const char *what);
int tp_reduce_f32(dist_ctx *d, const float *send, float *recv, size_t count, int root, tp_req **rq,
                  const char *what);
int tp_reduce_scatter_f32(dist_ctx *d, const float *send, float *recv, size_t count, tp_req **rq, const char *what);
int tp_allgather_f32(dist_ctx *d, const float *send, float *recv, size_t count, tp_req **rq, const char *what);
int tp_bcast(dist_ctx *d, void *buf, size_t bytes, int root, tp_req **rq, const char *what);
/* Waits for every rank, at most `deadline_s` seconds (<= 0: the collective
 * deadline); past it the job ends with the message of dist.h naming the
 * ranks that did not arrive. */
int tp_barrier(dist_ctx *d, double deadline_s, const char *what);
/* Rank 0 receives counts[r] floats from rank r at recv + displs[r]; the
 * reverse for scatterv. recv/send on other ranks are ignored. */
int tp_gatherv_f32(dist_ctx *d, const float *send, size_t n_mine, float *recv, const size_t *counts,
                   const size_t *displs, tp_req **rq, const char *what);
int tp_scatterv_f32(dist_ctx *d, const float *send, const size_t *counts, const size_t *displs, float *recv,
                    size_t n_mine, tp_req **rq, const char *what);

/* *done = 1 when the request completed (it stays valid until tp_wait or
 * tp_free). NULL request: done. */
int tp_test(dist_ctx *d, tp_req *rq, int *done);
/* Waits for all n requests (NULL entries are skipped) with the deadline,
 * frees them and sets the slots to NULL. The time spent here is the exposed
 * communication (tp_stats). */
int tp_wait(dist_ctx *d, tp_req **rqs, int n, const char *what);

/* The communication library's own memory in one rank's process beyond the
 * buffers above (its code, shared-memory segments and fragment lists):
 * measured with OpenMPI 4 over shared memory as 5 MB for a LoRA job and
 * 10-11 MB for a full fine-tuning job of 5M parameters at 2 and 4 ranks
 * (tests/dist/test_zero_memory.py); 8 MiB for several ranks, 0 for one. */
size_t tp_runtime_bytes(int world);
/* Temporary memory the library touches on `rank` for collectives of
 * `bytes` (measured, OpenMPI's libnbc, tests/dist/test_zero_memory.py):
 *   all-reduce: a copy of the buffer on the ranks that receive in its
 *     binomial tree (2 ranks: both; more: rank 0 and the even ranks with a
 *     right neighbour), nothing on the leaves;
 *   reduce to an owner (ZeRO-2): about two pieces' worth per rank, three
 *     with several reductions in flight (the tree's partial sums, and the
 *     heap they leave behind); on 2 ranks one piece, in flight or not
 *     (measured with pieces of 9.5 MiB, a 2.9M-element bucket cut at the
 *     shard, over 4 runs: 0.4 to 1.4 pieces). A piece is at most a bucket, a
 *     window and a shard. */
size_t tp_allreduce_temp_bytes(int world, int rank, size_t bytes);
size_t tp_reduce_temp_bytes(int world, size_t piece_bytes, int in_flight);

/* Counters of the collectives this rank started through this interface,
 * since dist_init (kept in the dist_ctx). Overlap: the share of the
 * communication that hid behind computation is about 1 - wait_s / busy_s
 * (busy_s ends when a poll first sees a request done, so it runs long by up
 * to one poll interval; bench/bench_zero.py compares against overlap off). */
typedef struct {
    double wait_s;    /* seconds blocked in tp_wait (communication not hidden) */
    double busy_s;    /* sum over requests of (completion seen - start) */
    double bytes;     /* payload bytes this rank put into collectives */
    long calls;
    long abandoned;   /* requests left in flight after an error: their buffers are never freed */
} tp_stats;
void tp_get_stats(const dist_ctx *d, tp_stats *out);

#endif
