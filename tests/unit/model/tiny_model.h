/* Test fixture shared by the model and precision unit tests: a model folder
 * of the "tiny" preset in f32 with N(0, 0.1) weights drawn from seed, written
 * to a new folder /tmp/qtune-test-TAG-XXXXXX (mkdtemp). Include after cmocka.h.
 *
 * Not a name made from the PID: PIDs are reused (pid_max is 32768 here), a run
 * that is killed before its teardown leaves its folder behind, and a later
 * process with the same PID then loads from and writes into that old folder
 * instead of an empty one of its own; two runs in different PID namespaces
 * that share /tmp (CI containers) can even hold the same name at the same
 * time, one's teardown deleting the folder the other still loads from. mkdtemp
 * creates a folder that did not exist, atomically. */
#ifndef QT_TEST_TINY_MODEL_H
#define QT_TEST_TINY_MODEL_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/rng.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/model.h"

/* The same, with the weights stored in dt (f32, f16 or bf16; config.json's torch_dtype says so). */
static void tiny_model_write_dtype(char *dir, size_t dirsz, const char *tag, uint64_t seed, qt_config *cfg,
                                   qt_dtype dt) {
    snprintf(dir, dirsz, "/tmp/qtune-test-%s-XXXXXX", tag);
    assert_non_null(mkdtemp(dir));
    assert_int_equal(qt_preset("tiny", cfg), QT_OK);
    cfg->torch_dtype = dt;
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(qt_config_write(cfg, path), QT_OK);
    qt_model_opts o;
    qt_model_opts_default(&o);
    int n = qt_model_param_table(cfg, &o, NULL, NULL);
    qt_param *p = calloc((size_t)n, sizeof *p);
    size_t numel;
    qt_model_param_table(cfg, &o, p, &numel);
    float *w = malloc(numel * 4);
    qt_rng r;
    qt_rng_seed(&r, seed);
    for (size_t i = 0; i < numel; i++) w[i] = 0.1f * qt_rng_normal(&r);
    st_writer *sw;
    assert_int_equal(st_writer_new(&sw), QT_OK);
    for (int i = 0; i < n; i++)
        assert_int_equal(st_writer_add(sw, p[i].name, dt, p[i].ndim, p[i].shape, w + p[i].offset, QT_F32), QT_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(st_writer_write(sw, path), QT_OK);
    st_writer_free(sw);
    free(p), free(w);
}

static inline void tiny_model_write(char *dir, size_t dirsz, const char *tag, uint64_t seed, qt_config *cfg) {
    tiny_model_write_dtype(dir, dirsz, tag, seed, cfg, QT_F32);
}

#endif
