/* The job file (`qtune train JOB.json`) on arbitrary text, with its inline
 * DeepSpeed section parsed and finalized as the trainer does: every input is
 * a job or one error sentence, never a crash. The job's folder holds a model
 * folder and a data file so that valid seeds get past the path checks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "fuzz_util.h"
#include "train/ds_config.h"
#include "train/job.h"
#include "train/trainer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int ready;
    if (!ready) {
        /* "model" and "train.jsonl" exist beside the job */
        char dir[256];
        snprintf(dir, sizeof dir, "%s/model", fuzz_temp_dir());
        if (qt_mkdir_p(dir) != QT_OK) abort();
        fuzz_write_temp((const uint8_t *)"{}", 2, "model/config.json");
        fuzz_write_temp((const uint8_t *)"{\"text\": \"a\"}\n", 14, "train.jsonl");
        ready = 1;
    }
    char *s = qt_malloc(size + 1, "fuzz");
    memcpy(s, data, size);
    s[size] = 0;
    /* the first line may carry one --set override: "#set key.path=value" */
    const char *sets[1];
    int n_sets = 0;
    char *body = s;
    if (!strncmp(s, "#set ", 5)) {
        char *nl = strchr(s, '\n');
        if (nl) {
            *nl = 0;
            sets[n_sets++] = s + 5;
            body = nl + 1;
        }
    }
    qt_job job;
    if (qt_job_parse(body, fuzz_temp_dir(), "fuzz/job.json", sets, n_sets, &job) == QT_OK) {
        qt_ds_config ds;
        int rc = job.deepspeed ? qt_ds_config_parse(job.deepspeed, "fuzz/job.json: deepspeed", 1, &ds) : QT_OK;
        if (rc == QT_OK) qt_ds_config_finalize(&ds, job.train.max_steps);
        qt_train_cfg cfg;
        qt_train_cfg_from_job(&job, 1, job.train.max_steps, &cfg);
        qt_job_free(&job);
    }
    qt_error_clear();
    qt_free(s);
    return 0;
}
