/* The held team (backend/cpu/team.h): every job runs once on every thread,
 * job after job; the function's result comes back; no team where none is
 * worth holding (one thread, a team already held); and the two ops that use
 * it (op_matvec_team, op_attention_forward_cached_team) give the bits of
 * their plain forms. No team where the environment asks threads not to
 * spin. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/ops.h"
#include "backend/cpu/team.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

static qt_rng rng;

#define MAX_T 8
#define JOBS 20000

typedef struct {
    atomic_int runs[MAX_T]; /* jobs each tid ran */
    atomic_int bad;         /* a job saw a tid outside [0, nth) or a changing nth */
    int nth, nested_team, size;
} count_state;

static void count_job(void *arg, int tid, int nth) {
    count_state *s = arg;
    if (tid < 0 || tid >= nth || nth != s->nth || nth > MAX_T) {
        atomic_fetch_add(&s->bad, 1);
        return;
    }
    atomic_fetch_add(&s->runs[tid], 1);
}

static int nested(op_team *team, void *arg) {
    (void)arg;
    return team != NULL;
}

static int count_fn(op_team *team, void *arg) {
    count_state *s = arg;
    s->size = op_team_size(team);
    s->nth = s->size;
    for (int j = 0; j < JOBS; j++) {
        op_team_run(team, count_job, s);
        /* every thread has finished job j when op_team_run returns */
        for (int t = 0; t < s->nth && t < MAX_T; t++)
            if (atomic_load(&s->runs[t]) != j + 1) return -1;
    }
    s->nested_team = op_team_hold(nested, NULL);
    return team ? 7 : 5;
}

static void test_team_runs_every_job_on_every_thread(void **state) {
    (void)state;
    const int procs = omp_get_num_procs();
    /* the environment's wait policy decides too (below); here it allows spinning */
    unsetenv("OMP_WAIT_POLICY");
    unsetenv("GOMP_SPINCOUNT");
    for (int t = 1; t <= 2; t++) {
        omp_set_num_threads(t);
        count_state s;
        memset(&s, 0, sizeof s);
        const int rc = op_team_hold(count_fn, &s);
        assert_int_equal(atomic_load(&s.bad), 0);
        /* a team at 2 threads where there are 2 CPUs; none at 1 thread */
        assert_int_equal(rc, t >= 2 && procs >= 2 ? 7 : 5);
        assert_int_equal(s.size, t);
        for (int k = 0; k < s.nth; k++) assert_int_equal(atomic_load(&s.runs[k]), JOBS);
        assert_int_equal(s.nested_team, 0); /* a hold inside a hold gets no team of its own */
    }
    omp_set_num_threads(2);
}

/* Asked not to spin, the hold gives no team (its threads would spin through the step) */
static void test_team_respects_passive_wait(void **state) {
    (void)state;
    omp_set_num_threads(2);
    static const char *const env[][2] = {{"OMP_WAIT_POLICY", "passive"}, {"OMP_WAIT_POLICY", "PASSIVE"},
                                         {"GOMP_SPINCOUNT", "0"}};
    for (size_t i = 0; i < sizeof env / sizeof env[0]; i++) {
        setenv(env[i][0], env[i][1], 1);
        assert_int_equal(op_team_hold(nested, NULL), 0);
        unsetenv(env[i][0]);
    }
    setenv("GOMP_SPINCOUNT", "3000", 1);
    assert_int_equal(op_team_hold(nested, NULL), omp_get_num_procs() >= 2);
    unsetenv("GOMP_SPINCOUNT");
}

typedef struct {
    float *out;
    const float *x;
    const void *w;
    qt_dtype dt;
    const float *bias;
    int N, IN, OUT;
    const float *q, *kc, *vc;
    int n, pos0, H, KV, D;
} ops_args;

static int matvec_fn(op_team *team, void *arg) {
    ops_args *a = arg;
    op_matvec_team(team, a->out, a->x, a->w, a->dt, a->bias, a->N, a->IN, a->OUT, 0.5f, 1);
    return QT_OK;
}

static int attention_fn(op_team *team, void *arg) {
    ops_args *a = arg;
    op_attention_forward_cached_team(team, a->out, a->q, a->kc, a->vc, a->n, a->pos0, a->H, a->KV, a->D);
    return QT_OK;
}

static float *randn(size_t n) {
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = qt_rng_normal(&rng);
    return p;
}

/* W large enough for the chunked split (3001 rows of 301, above the 512 KiB
 * threshold in f32) and small (the calling thread alone), N = 1 .. 5 rows */
static void test_team_matvec_bits(void **state) {
    (void)state;
    static const int shapes[][2] = {{301, 3001}, {896, 130}};
    static const qt_dtype dts[] = {QT_F32, QT_F16, QT_BF16};
    omp_set_num_threads(2);
    for (size_t d = 0; d < 3; d++)
        for (size_t s = 0; s < 2; s++)
            for (int N = 1; N <= 5; N += 2) {
                const int IN = shapes[s][0], OUT = shapes[s][1];
                float *wf = randn((size_t)IN * OUT), *x = randn((size_t)N * IN), *bias = randn((size_t)OUT);
                void *w = malloc((size_t)IN * OUT * qt_dtype_size(dts[d]));
                qt_convert_from_f32(w, dts[d], wf, (size_t)IN * OUT);
                float *plain = malloc((size_t)N * OUT * sizeof *plain), *held = malloc((size_t)N * OUT * sizeof *held);
                for (size_t i = 0; i < (size_t)N * OUT; i++) plain[i] = held[i] = 0.125f * (float)(i % 5);
                op_matvec(plain, x, w, dts[d], bias, N, IN, OUT, 0.5f, 1);
                ops_args a = {.out = held, .x = x, .w = w, .dt = dts[d], .bias = bias, .N = N, .IN = IN, .OUT = OUT};
                assert_int_equal(op_team_hold(matvec_fn, &a), QT_OK);
                if (memcmp(plain, held, (size_t)N * OUT * sizeof *held))
                    fail_msg("%s IN %d OUT %d N %d: the held team's product differs from op_matvec's",
                             qt_dtype_name(dts[d]), IN, OUT, N);
                free(held), free(plain), free(w), free(bias), free(x), free(wf);
            }
}

/* one and three rows against a cache, head layouts that split by kv head
 * (grouped) and by query head */
static void test_team_attention_bits(void **state) {
    (void)state;
    static const int cfg[][3] = {{14, 2, 64}, {8, 8, 64}, {6, 3, 36}, {4, 1, 24}};
    omp_set_num_threads(2);
    for (size_t c = 0; c < 4; c++)
        for (int n = 1; n <= 3; n += 2) {
            const int H = cfg[c][0], KV = cfg[c][1], D = cfg[c][2], pos0 = 200, T = pos0 + n;
            float *q = randn((size_t)n * H * D), *k = randn((size_t)T * KV * D), *v = randn((size_t)T * KV * D);
            float *plain = malloc((size_t)n * H * D * sizeof *plain), *held = malloc((size_t)n * H * D * sizeof *held);
            op_attention_forward_cached(plain, q, k, v, n, pos0, H, KV, D);
            ops_args a = {.out = held, .q = q, .kc = k, .vc = v, .n = n, .pos0 = pos0, .H = H, .KV = KV, .D = D};
            assert_int_equal(op_team_hold(attention_fn, &a), QT_OK);
            if (memcmp(plain, held, (size_t)n * H * D * sizeof *held))
                fail_msg("H %d KV %d D %d n %d: the held team's attention differs from the plain call's", H, KV, D,
                         n);
            free(held), free(plain), free(v), free(k), free(q);
        }
}

int main(void) {
    qt_rng_seed(&rng, 4321);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_team_runs_every_job_on_every_thread),
        cmocka_unit_test(test_team_respects_passive_wait),
        cmocka_unit_test(test_team_matvec_bits),
        cmocka_unit_test(test_team_attention_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
