/* A toy data-parallel trainer that drives src/dist the way the real trainer
 * does, for tests/dist/test_dist.py under real mpirun.
 *
 * Model: a one-hidden-layer MLP on one flat fp32 block, gradients by hand.
 *   h = tanh(W1 x + b1), y = W2 h + b2, loss per labelled sample = 0.5 |y - t|^2
 * Dimension letters: D inputs, H hidden, O outputs, M samples per micro-batch,
 * A micro-batches per rank per step (accumulation), N ranks.
 * Flat block layout: W1 (H, D) | b1 (H) | W2 (O, H) | b2 (O).
 *
 * Data: sample g (global index) is drawn from qt_rng_derive(seed, g); about
 * 1 in 5 samples carries no label (like -100 tokens). Step s uses the N*A
 * micro-batches s*N*A .. s*N*A + N*A - 1; rank r takes r*A .. r*A + A - 1. So
 * N ranks with accumulation A see exactly what 1 rank with N*A sees, and the
 * loss is the token-weighted mean over the whole global batch: the labelled
 * count is all-reduced BEFORE backward and grad_scale = 1 / count.
 *
 * Output (rank 0): one line per step "step S loss L gnorm G tokens T", then
 * with --out the final weights (n floats, raw). Every rank prints one JSON
 * line "{"rank":...}" with its optimizer bytes, peak RSS and timings.
 * Failure injection: --die-rank R --die-step K (SIGKILL itself), --hang-rank
 * R --hang-step K (sleeps, never enters the collective).
 * --signal-storm K: installs a SIGTERM flag handler after dist_init (as a CLI
 * that checkpoints on SIGTERM does), then runs K scalar all-reduces while a
 * thread of this process sends it SIGTERM every 20 microseconds; prints
 * "storm: K collectives, S signals caught" and exits 0. Every signal must
 * reach the program's handler, none the default action. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"
#include "core/mem.h"
#include "core/rng.h"
#include "dist/dist.h"
#include "optim/adam.h"

/* the cpu backend: these buffers are host memory, which is its device memory */
static qt_backend *be;
#include "optim/clip.h"

enum { D = 16, O = 4 };

typedef struct {
    int H, M, A, steps, start_step, stage, offload, overlap;
    size_t bucket;
    double lr, wd, clip;
    uint64_t seed;
    int die_rank, die_step, hang_rank, hang_step;
    int storm;
    size_t ckpt_chunk; /* > 0: checkpoint m, v through the range calls, this many elements at a time */
    const char *out, *save, *load;
} opts_t;

typedef struct {
    float *w1, *b1, *w2, *b2; /* (H, D) (H) (O, H) (O) */
} view_t;

static view_t view(float *blk, int H) {
    view_t v = {blk, blk + (size_t)H * D, blk + (size_t)H * D + H, blk + (size_t)H * D + H + (size_t)O * H};
    return v;
}

static size_t numel(int H) { return (size_t)H * D + H + (size_t)O * H + O; }

/* Sample g: input x (D), target t (O), labelled or not. */
static int sample(uint64_t seed, uint64_t g, float *x, float *t) {
    qt_rng r;
    qt_rng_derive(&r, seed, 0xda7a, g);
    for (int i = 0; i < D; i++) x[i] = qt_rng_normal(&r);
    for (int o = 0; o < O; o++) t[o] = sinf(x[o] + 0.5f * x[o + 4]) + 0.1f * qt_rng_normal(&r);
    return qt_rng_below(&r, 5) != 0;
}

/* Forward + backward of one micro-batch; grads += scale * d(sum of losses).
 * Layer 2's gradients are complete before layer 1's, so the caller may start
 * reducing [off_w2, n) in between (overlap). Returns the loss sum. */
static double micro_step(const opts_t *o, float *params, float *grads, uint64_t first, float scale,
                         zero_plan *plan, int last) {
    int H = o->H, M = o->M;
    view_t p = view(params, H), g = view(grads, H);
    float *h = malloc((size_t)M * H * sizeof *h), *dy = malloc((size_t)M * O * sizeof *dy);
    float (*x)[D] = malloc((size_t)M * sizeof *x);
    double loss = 0;
    for (int s = 0; s < M; s++) {
        float t[O];
        int lab = sample(o->seed, first + (uint64_t)s, x[s], t);
        float *hs = h + (size_t)s * H;
        for (int j = 0; j < H; j++) {
            float a = p.b1[j];
            for (int i = 0; i < D; i++) a += p.w1[(size_t)j * D + i] * x[s][i];
            hs[j] = tanhf(a);
        }
        for (int k = 0; k < O; k++) {
            float y = p.b2[k];
            for (int j = 0; j < H; j++) y += p.w2[(size_t)k * H + j] * hs[j];
            float e = lab ? y - t[k] : 0.0f;
            loss += 0.5 * (double)e * e;
            dy[s * O + k] = e * scale;
        }
    }
    /* layer 2 */
    for (int s = 0; s < M; s++)
        for (int k = 0; k < O; k++) {
            g.b2[k] += dy[s * O + k];
            for (int j = 0; j < H; j++) g.w2[(size_t)k * H + j] += dy[s * O + k] * h[(size_t)s * H + j];
        }
    if (last && o->overlap) zero_reduce_ready(plan, grads, (size_t)(g.w2 - grads));
    /* layer 1 */
    for (int s = 0; s < M; s++)
        for (int j = 0; j < H; j++) {
            float dh = 0;
            for (int k = 0; k < O; k++) dh += dy[s * O + k] * p.w2[(size_t)k * H + j];
            float hj = h[(size_t)s * H + j];
            float da = dh * (1 - hj * hj);
            g.b1[j] += da;
            for (int i = 0; i < D; i++) g.w1[(size_t)j * D + i] += da * x[s][i];
        }
    free(h);
    free(dy);
    free(x);
    return loss;
}

static void usage(void) {
    fprintf(stderr, "dist_driver [--hidden H] [--micro M] [--accum A] [--steps K] [--start-step S] [--stage 0|1|2]\n"
                    "  [--offload 0|1] [--overlap 0|1] [--bucket E] [--lr x] [--wd x] [--clip x] [--seed s]\n"
                    "  [--out FILE] [--save FILE] [--load FILE] [--ckpt-chunk E] [--die-rank R --die-step K] [--hang-rank R --hang-step K]\n");
}

static int parse(int argc, char **argv, opts_t *o) {
    *o = (opts_t){.H = 20, .M = 3, .A = 2, .steps = 5, .stage = 2, .overlap = 1, .bucket = 96, .lr = 1e-2,
                  .wd = 0.01, .clip = 1.0, .seed = 7, .die_rank = -1, .hang_rank = -1};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { usage(); return 1; }
        i++;
        if (!strcmp(k, "--hidden")) o->H = atoi(v);
        else if (!strcmp(k, "--micro")) o->M = atoi(v);
        else if (!strcmp(k, "--accum")) o->A = atoi(v);
        else if (!strcmp(k, "--steps")) o->steps = atoi(v);
        else if (!strcmp(k, "--start-step")) o->start_step = atoi(v);
        else if (!strcmp(k, "--stage")) o->stage = atoi(v);
        else if (!strcmp(k, "--offload")) o->offload = atoi(v);
        else if (!strcmp(k, "--overlap")) o->overlap = atoi(v);
        else if (!strcmp(k, "--bucket")) o->bucket = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--lr")) o->lr = atof(v);
        else if (!strcmp(k, "--wd")) o->wd = atof(v);
        else if (!strcmp(k, "--clip")) o->clip = atof(v);
        else if (!strcmp(k, "--seed")) o->seed = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--out")) o->out = v;
        else if (!strcmp(k, "--save")) o->save = v;
        else if (!strcmp(k, "--load")) o->load = v;
        else if (!strcmp(k, "--ckpt-chunk")) o->ckpt_chunk = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--die-rank")) o->die_rank = atoi(v);
        else if (!strcmp(k, "--die-step")) o->die_step = atoi(v);
        else if (!strcmp(k, "--hang-rank")) o->hang_rank = atoi(v);
        else if (!strcmp(k, "--hang-step")) o->hang_step = atoi(v);
        else if (!strcmp(k, "--signal-storm")) o->storm = atoi(v);
        else { usage(); return 1; }
    }
    if (o->H < 1 || o->M < 1 || o->A < 1 || o->steps < 0) { usage(); return 1; }
    return 0;
}

static int fail(dist_ctx *d) {
    fprintf(stderr, "dist_driver: error: rank %d: %s (%s)\n", dist_rank(d), qt_error_message(), qt_error_where());
    if (d && dist_world(d) > 1) dist_abort(d, 1);
    return 1;
}

#define CHECK(call) do { if ((call) != QT_OK) return fail(d); } while (0)

/* A slot through the range calls, `chunk` elements at a time (the way a
 * large model's checkpoint streams); full is rank 0's n floats. */
static int gather_chunked(zero_plan *plan, zero_state *st, int slot, float *full, size_t n, size_t chunk) {
    if (!chunk) return zero_state_gather(plan, st, slot, full);
    for (size_t lo = 0; lo < n; lo += chunk) {
        size_t hi = lo + chunk < n ? lo + chunk : n;
        QT_TRY(zero_state_gather_range(plan, st, slot, lo, hi, full ? full + lo : NULL));
    }
    return QT_OK;
}

static int scatter_chunked(zero_plan *plan, zero_state *st, int slot, const float *full, size_t n, size_t chunk) {
    if (!chunk) return zero_state_scatter(plan, st, slot, full);
    for (size_t lo = 0; lo < n; lo += chunk) {
        size_t hi = lo + chunk < n ? lo + chunk : n;
        QT_TRY(zero_state_scatter_range(plan, st, slot, lo, hi, full ? full + lo : NULL));
    }
    return QT_OK;
}

/* Checkpoint file: n params, then n of m, then n of v (whole block, so any
 * rank count resumes it). Written by rank 0 only. */
static int save_state(dist_ctx *d, zero_plan *plan, zero_state *st, const float *params, size_t n, const char *path,
                      size_t chunk) {
    float *full = dist_is_main(d) ? qt_malloc(3 * n * sizeof(float) + 4, "checkpoint buffer") : NULL;
    if (dist_is_main(d) && !full) return QT_ENOMEM;
    if (full) memcpy(full, params, n * sizeof(float));
    int rc = gather_chunked(plan, st, 0, full ? full + n : NULL, n, chunk);
    if (!rc) rc = gather_chunked(plan, st, 1, full ? full + 2 * n : NULL, n, chunk);
    if (!rc && full) {
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(full, sizeof(float), 3 * n, f) != 3 * n) rc = QT_ERR(QT_EIO, "cannot write %s", path);
        if (f) fclose(f);
    }
    qt_free(full);
    return rc;
}

static int load_state(dist_ctx *d, zero_plan *plan, zero_state *st, float *params, size_t n, const char *path,
                      size_t chunk) {
    float *full = dist_is_main(d) ? qt_malloc(3 * n * sizeof(float) + 4, "checkpoint buffer") : NULL;
    int rc = QT_OK;
    if (dist_is_main(d)) {
        if (!full) return QT_ENOMEM;
        FILE *f = fopen(path, "rb");
        if (!f || fread(full, sizeof(float), 3 * n, f) != 3 * n) rc = QT_ERR(QT_EIO, "cannot read %s", path);
        if (f) fclose(f);
        if (!rc) memcpy(params, full, n * sizeof(float));
    }
    if (!rc) rc = dist_bcast(d, params, n * sizeof(float), 0, "checkpoint parameters");
    if (!rc) rc = scatter_chunked(plan, st, 0, full ? full + n : NULL, n, chunk);
    if (!rc) rc = scatter_chunked(plan, st, 1, full ? full + 2 * n : NULL, n, chunk);
    qt_free(full);
    return rc;
}

static volatile sig_atomic_t storm_caught, storm_done;
static void storm_handler(int sig) {
    (void)sig;
    storm_caught++;
}
static void *storm_sender(void *arg) {
    (void)arg;
    sigset_t m;
    sigemptyset(&m);
    sigaddset(&m, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &m, NULL); /* the signals land on the other threads */
    while (!storm_done) {
        kill(getpid(), SIGTERM);
        usleep(20);
    }
    return NULL;
}

static int signal_storm(dist_ctx *d, int k) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = storm_handler;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    pthread_t th;
    if (pthread_create(&th, NULL, storm_sender, NULL) != 0) return 1;
    int rc = QT_OK;
    for (int i = 0; i < k && rc == QT_OK; i++) {
        int64_t v = i;
        rc = dist_allreduce_i64(d, &v, 1, DIST_SUM, "storm");
    }
    storm_done = 1;
    pthread_join(th, NULL);
    if (rc != QT_OK) return 1;
    printf("storm: %d collectives, %d signals caught\n", k, (int)storm_caught);
    return 0;
}

int main(int argc, char **argv) {
    if (qt_backend_open("cpu", &be) != QT_OK) return 1;
    dist_ctx *d = NULL;
    if (dist_init(&argc, &argv, &d) != QT_OK) {
        fprintf(stderr, "dist_driver: error: %s\n", qt_error_message());
        return 1;
    }
    opts_t o;
    if (parse(argc, argv, &o)) { dist_finalize(d); return 2; }
    if (o.storm > 0) {
        int src = signal_storm(d, o.storm);
        dist_finalize(d);
        return src;
    }
    int N = dist_world(d), rank = dist_rank(d);
    size_t n = numel(o.H);

    float *params = qt_alloc_aligned(n * sizeof(float), "parameters");
    float *grads = qt_alloc_aligned(n * sizeof(float), "gradients");
    if (!params || !grads) return fail(d);
    qt_rng r;
    qt_rng_seed(&r, o.seed);
    for (size_t i = 0; i < n; i++) params[i] = 0.3f * qt_rng_normal(&r);

    zero_plan *plan = NULL;
    zero_opts zo = {.stage = o.stage, .offload = o.offload, .bucket_elems = o.bucket};
    CHECK(zero_plan_create(d, n, &zo, &plan));
    zero_state st;
    CHECK(zero_state_alloc(plan, 2, &st)); /* AdamW m, v over the own range */
    if (o.load) CHECK(load_state(d, plan, &st, params, n, o.load, o.ckpt_chunk));

    qt_adam_cfg ac;
    qt_adam_cfg_default(&ac);
    ac.lr = o.lr;
    ac.weight_decay = o.wd;
    /* weight matrices decay, biases do not (HF grouping) */
    qt_range decay[2] = {{0, (size_t)o.H * D}, {(size_t)o.H * D + o.H, (size_t)o.H * D + o.H + (size_t)O * o.H}};
    size_t lo, hi;
    zero_opt_range(plan, &lo, &hi);

    double t_start = 0, comm_start = 0;
    for (int s = o.start_step; s < o.start_step + o.steps; s++) {
        if (s == o.start_step + 1) { /* time from the second step: the first pays for page faults */
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            t_start = ts.tv_sec + 1e-9 * ts.tv_nsec;
            comm_start = dist_comm_seconds(d);
        }
        if (rank == o.die_rank && s == o.die_step) raise(SIGKILL);
        if (rank == o.hang_rank && s == o.hang_step) sleep(100000);
        uint64_t mb0 = (uint64_t)s * N * o.A + (uint64_t)rank * o.A; /* first micro-batch of this rank */
        /* the global labelled count, before backward: the mean's denominator */
        int64_t tokens = 0;
        for (int a = 0; a < o.A; a++)
            for (int i = 0; i < o.M; i++) {
                float x[D], t[O];
                tokens += sample(o.seed, (mb0 + a) * o.M + i, x, t);
            }
        CHECK(dist_allreduce_i64(d, &tokens, 1, DIST_SUM, "token count"));
        memset(grads, 0, n * sizeof(float));
        double loss = 0;
        float scale = tokens ? 1.0f / (float)tokens : 0.0f;
        for (int a = 0; a < o.A; a++)
            loss += micro_step(&o, params, grads, (mb0 + a) * o.M, scale, plan, a == o.A - 1);
        CHECK(dist_allreduce_f64(d, &loss, 1, DIST_SUM, "loss sum"));
        double sq;
        int overflow;
        CHECK(dist_step_gradients(d, plan, grads, &sq, &overflow));
        double gnorm = sqrt(sq);
        float coef = qt_clip_coef(gnorm, o.clip);
        if (!overflow)
            CHECK(qt_adam_step(be, &ac, s + 1, o.lr, coef, params + lo, grads + lo, st.slot[0], st.slot[1], hi - lo,
                               lo, decay, 2, NULL));
        CHECK(dist_allgather_params(d, plan, params));
        if (dist_is_main(d))
            printf("step %d loss %.9g gnorm %.9g tokens %lld\n", s, loss / (double)(tokens ? tokens : 1), gnorm,
                   (long long)tokens);
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t_end = ts.tv_sec + 1e-9 * ts.tv_nsec;
    int timed = o.steps - 1;
    double step_s = timed > 0 ? (t_end - t_start) / timed : 0;
    double comm_s = timed > 0 ? (dist_comm_seconds(d) - comm_start) / timed : 0;

    if (o.save) CHECK(save_state(d, plan, &st, params, n, o.save, o.ckpt_chunk));
    if (o.out && dist_is_main(d)) {
        FILE *f = fopen(o.out, "wb");
        if (!f || fwrite(params, sizeof(float), n, f) != n) {
            fprintf(stderr, "dist_driver: cannot write %s\n", o.out);
            return fail(d);
        }
        fclose(f);
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fflush(stdout);
    CHECK(dist_barrier(d, "report"));
    printf("{\"rank\": %d, \"world\": %d, \"stage\": %d, \"offload\": %d, \"n\": %zu, \"opt_lo\": %zu, "
           "\"opt_hi\": %zu, \"opt_bytes_device\": %zu, \"opt_bytes_host\": %zu, \"peak_rss_bytes\": %ld, "
           "\"step_s\": %.6f, \"comm_s\": %.6f}\n",
           rank, N, o.stage, o.offload, n, lo, hi, zero_state_bytes_device(plan), zero_state_bytes_host(plan),
           ru.ru_maxrss * 1024L, step_s, comm_s);
    fflush(stdout);
    zero_state_free(plan, &st);
    zero_plan_free(plan);
    qt_free(params);
    qt_free(grads);
    dist_finalize(d);
    return 0;
}
