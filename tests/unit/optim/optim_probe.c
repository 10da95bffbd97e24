/* A command-line window onto src/optim for the Python reference tests
 * (tests/optim/test_*.py): they feed numbers in on the command line and
 * stdin, and compare what comes out with torch and with independent Python
 * versions of DeepSpeed's formulas.
 *
 *   optim_probe sched TYPE BASE_LR MIN_LR MAX_LR WARMUP log|linear TOTAL WMIN_RATIO COS_MIN N
 *       prints qt_sched_lr(it) for it = -1 .. N, one a line
 *   optim_probe scaler POWER WINDOW HYST MIN_SCALE CONSECUTIVE STATIC_SCALE   < "0110..."
 *       prints "scale cur_hysteresis" after each step, or "error <message>" and stops
 *   optim_probe adam DECOUPLED LR B1 B2 EPS WD STEPS N [SHARDS]
 *       stdin: N params, N decay flags (0/1), then STEPS x N grads;
 *       prints the N params after each step (SHARDS > 1 splits the block)
 *   optim_probe clip MAX_NORM INV_SCALE N    < N grads
 *       prints the norm, then the N clipped grads */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "optim/adam.h"

/* the cpu backend: these buffers are host memory, which is its device memory */
static qt_backend *be;
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"

static int usage(void) {
    fprintf(stderr, "usage: see the comment at the top of optim_probe.c\n");
    return 2;
}

static int read_floats(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double d;
        if (scanf("%lf", &d) != 1) return -1;
        x[i] = (float)d;
    }
    return 0;
}

static int probe_sched(int argc, char **argv) {
    if (argc != 12) return usage();
    qt_sched s;
    int type = atoi(argv[2]);
    qt_sched_default(&s, (qt_sched_type)type, atof(argv[3]));
    s.warmup_min_lr = atof(argv[4]);
    s.warmup_max_lr = atof(argv[5]);
    s.warmup_num_steps = atoll(argv[6]);
    s.warmup_type = strcmp(argv[7], "linear") == 0 ? QT_WARMUP_LINEAR : QT_WARMUP_LOG;
    s.total_num_steps = atoll(argv[8]);
    s.warmup_min_ratio = atof(argv[9]);
    s.cos_min_ratio = atof(argv[10]);
    long long n = atoll(argv[11]);
    if (qt_sched_check(&s, "probe") != QT_OK) {
        printf("error %s\n", qt_error_message());
        return 0;
    }
    for (long long it = -1; it <= n; it++) printf("%.17g\n", qt_sched_lr(&s, it));
    return 0;
}

static int probe_scaler(int argc, char **argv) {
    if (argc != 8) return usage();
    qt_loss_scaler_cfg c;
    qt_loss_scaler_cfg_default(&c);
    c.initial_scale_power = atoi(argv[2]);
    c.loss_scale_window = atoll(argv[3]);
    c.hysteresis = atoi(argv[4]);
    c.min_loss_scale = atof(argv[5]);
    c.consecutive_hysteresis = atoi(argv[6]);
    c.loss_scale = atof(argv[7]);
    qt_loss_scaler s;
    if (qt_loss_scaler_init(&s, &c) != QT_OK) {
        printf("error %s\n", qt_error_message());
        return 0;
    }
    int ch;
    while ((ch = getchar()) != EOF) {
        if (ch != '0' && ch != '1') continue;
        if (qt_loss_scaler_update(&s, ch == '1') != QT_OK) {
            printf("error %s\n", qt_error_message());
            return 0;
        }
        printf("%.17g %d\n", s.scale, s.cur_hysteresis);
    }
    return 0;
}

static int probe_adam(int argc, char **argv) {
    if (argc != 10 && argc != 11) return usage();
    qt_adam_cfg c;
    qt_adam_cfg_default(&c);
    c.decoupled = atoi(argv[2]);
    double lr = atof(argv[3]);
    c.beta1 = atof(argv[4]);
    c.beta2 = atof(argv[5]);
    c.eps = atof(argv[6]);
    c.weight_decay = atof(argv[7]);
    int steps = atoi(argv[8]);
    size_t n = (size_t)atoll(argv[9]);
    int shards = argc == 11 ? atoi(argv[10]) : 1;
    if (n == 0 || n > 100000000 || steps < 1 || shards < 1) return usage();
    float *p = qt_calloc(n, 4, "params"), *g = qt_calloc(n, 4, "grads");
    float *m = qt_calloc(n, 4, "m"), *v = qt_calloc(n, 4, "v"), *flags = qt_calloc(n, 4, "decay flags");
    qt_range *decay = qt_calloc(n, sizeof *decay, "decay ranges");
    int rc = 2;
    if (!p || !g || !m || !v || !flags || !decay) goto done;
    if (read_floats(p, n) || read_floats(flags, n)) goto done;
    int nd = 0;
    for (size_t i = 0; i < n; i++) {
        if (flags[i] == 0.0f) continue;
        if (nd > 0 && decay[nd - 1].hi == i) decay[nd - 1].hi = i + 1;
        else decay[nd++] = (qt_range){i, i + 1};
    }
    for (int t = 1; t <= steps; t++) {
        if (read_floats(g, n)) goto done;
        size_t per = (n + (size_t)shards - 1) / (size_t)shards;
        for (size_t lo = 0; lo < n; lo += per) {
            size_t len = n - lo < per ? n - lo : per;
            if (qt_adam_step(be, &c, t, lr, 1.0f, p + lo, g + lo, m + lo, v + lo, len, lo, decay, nd, NULL) != QT_OK) {
                printf("error %s\n", qt_error_message());
                rc = 1;
                goto done;
            }
        }
        for (size_t i = 0; i < n; i++) printf("%.9g%c", p[i], i + 1 == n ? '\n' : ' ');
    }
    rc = 0;
done:
    qt_free(p), qt_free(g), qt_free(m), qt_free(v), qt_free(flags), qt_free(decay);
    return rc;
}

static int probe_clip(int argc, char **argv) {
    if (argc != 5) return usage();
    double max_norm = atof(argv[2]), inv_scale = atof(argv[3]);
    size_t n = (size_t)atoll(argv[4]);
    if (n == 0 || n > 100000000) return usage();
    float *g = qt_calloc(n, 4, "grads");
    if (!g || read_floats(g, n)) {
        qt_free(g);
        return 2;
    }
    printf("%.17g %d\n", qt_clip_grad_norm(be, g, n, max_norm, inv_scale), qt_grad_has_nonfinite(be, g, n));
    for (size_t i = 0; i < n; i++) printf("%.9g%c", g[i], i + 1 == n ? '\n' : ' ');
    qt_free(g);
    return 0;
}

int main(int argc, char **argv) {
    if (qt_backend_open("cpu", &be) != QT_OK) return 1;
    qt_log_set_level(QT_LOG_WARN);
    if (argc < 2) return usage();
    if (strcmp(argv[1], "sched") == 0) return probe_sched(argc, argv);
    if (strcmp(argv[1], "scaler") == 0) return probe_scaler(argc, argv);
    if (strcmp(argv[1], "adam") == 0) return probe_adam(argc, argv);
    if (strcmp(argv[1], "clip") == 0) return probe_clip(argc, argv);
    return usage();
}
