/* Resuming from a checkpoint whose files are arbitrary bytes. The harness
 * trains a tiny LoRA job for one step once (a genuine checkpoint-1/), then for
 * each input replaces that checkpoint's files and runs the job again with
 * resume "auto": the trainer must resume or refuse with one sentence, never
 * crash or read outside a buffer.
 *
 * Input layout: the trainer_state.json text, then optional sections that
 * replace the other files, each introduced by a line of its own:
 *   "\n@@optimizer\n" optimizer-00000-of-00001.safetensors bytes (the one
 *                     part of a single rank; written as optimizer.safetensors
 *                     too, which states of format 1 name)
 *   "\n@@adapter\n"   adapter_model.safetensors bytes
 *   "\n@@config\n"    adapter_config.json text
 * Missing sections keep the genuine files. "@FP@" in the state text stands
 * for this job's fingerprint (which the fuzzer could not guess). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "dist/dist.h"
#include "fuzz_util.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "train/job.h"
#include "train/trainer.h"

static dist_ctx *dist;
static qt_job job;
static char ckpt[512], fp_hex[32];
static char *genuine[4];
static size_t genuine_len[4];
static const char *const files[4] = {"trainer_state.json", "optimizer-00000-of-00001.safetensors",
                                     "adapter_model.safetensors", "adapter_config.json"};
static const char *const marks[4] = {NULL, "\n@@optimizer\n", "\n@@adapter\n", "\n@@config\n"};

static void die(const char *what) {
    fprintf(stderr, "fuzz_checkpoint: %s: %s\n", what, qt_error_message());
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    qt_log_set_level(QT_LOG_ERROR);
    const char *dir = fuzz_temp_dir();
    char path[512];
    qt_config cfg;
    if (qt_preset("tiny", &cfg) != QT_OK) die("preset");
    snprintf(path, sizeof path, "%s/model", dir);
    if (qt_mkdir_p(path) != QT_OK) die("mkdir");
    snprintf(path, sizeof path, "%s/model/config.json", dir);
    if (qt_config_write(&cfg, path) != QT_OK) die("config");
    snprintf(path, sizeof path, "%s/model/model.safetensors", dir);
    if (qt_init_weights_write(&cfg, QT_F32, 1, path) != QT_OK) die("weights");
    static const char rows[] = "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n{\"input_ids\": [9, 8, 7, 6, 5, 4]}\n";
    fuzz_write_temp((const uint8_t *)rows, sizeof rows - 1, "train.jsonl");
    static const char job_text[] =
        "{\"model\": \"model\", \"output_dir\": \"out\",\n"
        " \"data\": {\"train\": \"train.jsonl\", \"seq_len\": 8, \"packing\": false, \"shuffle\": true},\n"
        " \"lora\": {\"r\": 2, \"lora_alpha\": 4, \"lora_dropout\": 0.1, \"target_modules\": [\"q_proj\"]},\n"
        " \"train\": {\"max_steps\": 1, \"save_steps\": 1, \"seed\": 3, \"resume\": \"auto\"},\n"
        " \"deepspeed\": {\"train_micro_batch_size_per_gpu\": 1, \"gradient_accumulation_steps\": 1}}\n";
    const char *job_path = fuzz_write_temp((const uint8_t *)job_text, sizeof job_text - 1, "job.json");
    if (dist_init(argc, argv, &dist) != QT_OK) die("dist");
    if (qt_job_load(job_path, NULL, 0, &job) != QT_OK) die("job");
    snprintf(fp_hex, sizeof fp_hex, "%016llx", (unsigned long long)job.fingerprint);
    qt_train_result res;
    if (qt_train_run(&job, dist, NULL, &res) != QT_OK) die("first run");
    snprintf(ckpt, sizeof ckpt, "%s/out/checkpoint-1", dir);
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/%s", ckpt, files[i]);
        if (qt_read_file(path, 1 << 24, &genuine[i], &genuine_len[i]) != QT_OK) die("reading the checkpoint");
    }
    return 0;
}

static void put_name(const char *name, const void *data, size_t n) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", ckpt, name);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(data, 1, n, f) != n) abort();
    fclose(f);
}

static void put(int i, const void *data, size_t n) {
    put_name(files[i], data, n);
    if (i == 1) put_name("optimizer.safetensors", data, n); /* the format-1 name */
}

/* memmem for a marker */
static const uint8_t *find(const uint8_t *p, size_t n, const char *m) {
    size_t k = strlen(m);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(p + i, m, k)) return p + i;
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* split into sections: [start, end) of each file's replacement, or none */
    const uint8_t *at[4] = {data, NULL, NULL, NULL}, *end[4];
    for (int i = 1; i < 4; i++) at[i] = find(data, size, marks[i]);
    for (int i = 0; i < 4; i++) {
        end[i] = data + size;
        for (int j = 1; j < 4; j++)
            if (at[j] && at[i] && at[j] > at[i] && at[j] < end[i]) end[i] = at[j];
        if (i && at[i]) at[i] += strlen(marks[i]);
    }
    char out_dir[512];
    snprintf(out_dir, sizeof out_dir, "%s/out", fuzz_temp_dir());
    /* only checkpoint-1 (fresh) and qtune_run.json stay */
    char p[600];
    snprintf(p, sizeof p, "%s/final", out_dir);
    qt_rm_rf(p);
    for (int s = 2; s < 4; s++) {
        snprintf(p, sizeof p, "%s/checkpoint-%d", out_dir, s);
        qt_rm_rf(p);
    }
    if (qt_mkdir_p(ckpt) != QT_OK) abort();
    /* the state text with @FP@ replaced */
    size_t n0 = (size_t)(end[0] - at[0]);
    char *state = qt_malloc(n0 * 4 + 1, "fuzz state");
    size_t w = 0;
    for (size_t i = 0; i < n0;) {
        if (i + 4 <= n0 && !memcmp(at[0] + i, "@FP@", 4)) {
            memcpy(state + w, fp_hex, 16);
            w += 16;
            i += 4;
        } else {
            state[w++] = (char)at[0][i++];
        }
    }
    put(0, state, w);
    qt_free(state);
    for (int i = 1; i < 4; i++) {
        if (at[i]) put(i, at[i], (size_t)(end[i] - at[i]));
        else put(i, genuine[i], genuine_len[i]);
    }
    qt_train_result res;
    qt_train_run(&job, dist, NULL, &res);
    qt_error_clear();
    return 0;
}
