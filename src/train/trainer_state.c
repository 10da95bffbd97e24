/* The small questions trainer.c (the loop) and trainer_ckpt.c (its
 * checkpoints) both ask of the trainer's state (trainer_state.h): how long
 * the run has been going, where the data stands, which parameter an element
 * belongs to, whether a block is finite. Neither file calls the other for
 * them. */
#include "core/clock.h"
#include "core/mem.h"
#include "optim/clip.h"
#include "train/trainer_state.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <sys/stat.h>

double trainer_elapsed(const qt_trainer *t) { return t->elapsed_before + (qt_now_s() - t->t_start); }

double trainer_path_bytes(const char *path) {
    struct stat st;
    if (!path || stat(path, &st) != 0) return 0;
    if (S_ISREG(st.st_mode)) return (double)st.st_size;
    if (!S_ISDIR(st.st_mode)) return 0;
    DIR *dir = opendir(path);
    if (!dir) return 0;
    double sum = 0;
    char p[4096];
    for (struct dirent *e; (e = readdir(dir));)
        if (snprintf(p, sizeof p, "%s/%s", path, e->d_name) < (int)sizeof p && stat(p, &st) == 0 && S_ISREG(st.st_mode))
            sum += (double)st.st_size;
    closedir(dir);
    return sum;
}

dl_state trainer_data_position(const qt_trainer *t) {
    if (t->train_dl) return dl_state_get(t->train_dl);
    int64_t k = (int64_t)t->step * t->cfg.grad_accum * t->cfg.micro_batch * t->world, n = t->pref_train.n_pairs;
    return (dl_state){n ? k / n : 0, n ? (k % n) / t->world : 0};
}

const char *trainer_param_at(const qt_trainer *t, size_t i) {
    for (int k = 0; k < t->n_params; k++)
        if (i >= t->params[k].offset && i < t->params[k].offset + t->params[k].numel) return t->params[k].name;
    return "?";
}

/* 1 when dev (n floats of device memory) holds a NaN or inf, or with
 * nonneg a negative value, with *at its first such element. Without nonneg
 * the backend's sum of squares answers first (one pass on the device: finite
 * iff every element is); a bad block, or any block with nonneg, is read back
 * through a staging buffer and scanned to name the element. */
int trainer_find_bad(qt_trainer *t, const float *dev, size_t n, int nonneg, size_t *at) {
    if (n == 0 || (!nonneg && !qt_grad_has_nonfinite(t->be, dev, n))) return 0;
    enum { CHUNK = 1 << 18 };
    float *stage = qt_malloc(sizeof(float) * (n < CHUNK ? n : CHUNK), "finiteness check staging");
    int bad = !nonneg; /* the sum of squares said so; a failed allocation cannot name where */
    *at = 0;
    for (size_t k = 0; stage && k < n; k += CHUNK) {
        size_t c = n - k < CHUNK ? n - k : CHUNK;
        qt_be_download(t->be, stage, dev + k, sizeof(float) * c);
        for (size_t i = 0; i < c; i++)
            if (!isfinite(stage[i]) || (nonneg && stage[i] < 0)) {
                *at = k + i;
                qt_free(stage);
                return 1;
            }
    }
    qt_free(stage);
    return bad;
}
