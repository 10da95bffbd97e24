/* Where a decode step's product time goes (0.5B shape, bf16, one product per
 * job as before session 15's grouping): per kind of product, the caller's
 * wall time and each thread's idle time (wall minus its time in the job).
 *   gcc -O3 -march=native -fopenmp -Isrc bench/probes/product_idle.c -o /tmp/product_idle \
 *       -Lbuild/src/core -lqt_core -lm
 *   OMP_NUM_THREADS=2 /tmp/product_idle REPS */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <x86intrin.h>
#include "backend/cpu/team.c"
static double busy[64];
static int cur_tid_used[64];
typedef struct { op_team_job job; void *arg; } wrap_t;
static void wrapped(void *a, int tid, int nth) {
    wrap_t *w = a; unsigned long long t0 = __rdtsc(); w->job(w->arg, tid, nth); busy[tid] += (double)(__rdtsc() - t0); cur_tid_used[tid] = 1;
}
static void probe_run(op_team *t, op_team_job job, void *arg) { wrap_t w = {job, arg}; op_team_run(t, wrapped, &w); }
#define op_team_run probe_run
#include "backend/cpu/op_matvec.c"
#undef op_team_run
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { int L, C, V; char *w; float *x, *out; double kw[8], kb[8][2]; int kind_n[8]; } S;
static const int C_=896, I_=4864, Q_=896, KV_=128, V_=151936, L_=24;
static int lin[7][2];
static int step(op_team *team, void *arg) {
    S *s = arg; char *p = s->w;
    for (int k = 0; k < 7 * L_ + 1; k++) {
        int kind = k < 7 * L_ ? k % 7 : 7;
        int in = kind < 7 ? lin[kind][0] : C_, o = kind < 7 ? lin[kind][1] : V_;
        busy[0] = busy[1] = 0;
        unsigned long long t0 = __rdtsc();
        op_matvec_team(team, s->out, s->x, p, QT_BF16, NULL, 1, in, o, 1.0f, 0);
        double wall = (double)(__rdtsc() - t0);
        if (busy[0] == 0 && busy[1] == 0) busy[0] = wall; /* ran on the caller */
        s->kw[kind] += wall; s->kb[kind][0] += busy[0]; s->kb[kind][1] += busy[1]; s->kind_n[kind]++;
        p += (size_t)in * o * 2;
    }
    return 0;
}
int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 10;
    int l2[7][2] = {{C_, Q_}, {C_, KV_}, {C_, KV_}, {Q_, C_}, {C_, I_}, {C_, I_}, {I_, C_}}; memcpy(lin, l2, sizeof l2);
    size_t per = 0; for (int j = 0; j < 7; j++) per += (size_t)lin[j][0] * lin[j][1];
    size_t total = per * L_ + (size_t)V_ * C_;
    char *w = aligned_alloc(1 << 21, (total * 2 + (1<<21)) & ~((size_t)(1<<21)-1)); madvise(w, total*2, MADV_HUGEPAGE);
    for (size_t i = 0; i < total; i++) ((uint16_t *)w)[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24));
    float *x = aligned_alloc(64, 4 * 200000), *out = aligned_alloc(64, 4 * 200000);
    for (int i = 0; i < 200000; i++) x[i] = (i % 13) * 0.1f - 0.6f;
    S s = {0}; s.w = w; s.x = x; s.out = out;
    op_team_hold(step, &s); memset(s.kw, 0, sizeof s.kw); memset(s.kb, 0, sizeof s.kb); memset(s.kind_n, 0, sizeof s.kind_n);
    double t0 = now_s(); unsigned long long c0 = __rdtsc();
    for (int r = 0; r < reps; r++) op_team_hold(step, &s);
    double el = now_s() - t0; double hz = (double)(__rdtsc() - c0) / el;
    const char *nm[8] = {"q", "k", "v", "o", "gate", "up", "down", "lm_head"};
    double tw = 0, ti0 = 0, ti1 = 0;
    printf("step %.3f ms  (%.1f GB/s)\n", el / reps * 1e3, total * 2 / (el / reps) / 1e9);
    for (int k = 0; k < 8; k++) {
        double w_ = s.kw[k] / hz / reps * 1e3, b0 = s.kb[k][0] / hz / reps * 1e3, b1 = s.kb[k][1] / hz / reps * 1e3;
        int in = k < 7 ? lin[k][0] : C_, o = k < 7 ? lin[k][1] : V_;
        double bytes = (double)in * o * 2 * (k < 7 ? L_ : 1);
        printf("%-8s wall %6.3f ms  %5.1f GB/s  idle t0 %.3f t1 %.3f ms\n", nm[k], w_, bytes / (w_ * 1e-3) / 1e9, w_ - b0, w_ - b1);
        tw += w_; ti0 += w_ - b0; ti1 += w_ - b1;
    }
    printf("sum wall %.3f ms, idle t0 %.3f t1 %.3f\n", tw, ti0, ti1);
}
