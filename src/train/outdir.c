/* The output-folder guard: one folder holds one run's outputs. */
#include "train/trainer.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "io/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#define RUN_FILE "qtune_run.json"

/* Names qtune writes into an output folder (and removes on overwrite). */
static int is_ours(const char *name) {
    /* runs: the TensorBoard event files' default folder (report_to "tensorboard") */
    static const char *const names[] = {RUN_FILE, "metrics.jsonl", "loss.svg", "report.html", "runs", "final",
                                        "final.tmp", "final.old", NULL};
    for (int i = 0; names[i]; i++)
        if (!strcmp(name, names[i])) return 1;
    return !strncmp(name, "checkpoint-", 11) || !strncmp(name, "final.tmp", 9) || !strncmp(name, "metrics.jsonl.tmp", 17) ||
           !strncmp(name, "loss.svg.tmp", 12) || !strncmp(name, "report.html.tmp", 15) ||
           !strncmp(name, RUN_FILE ".tmp", sizeof RUN_FILE + 3);
}

/* A temporary a write left behind when a crash or a kill cut it short:
 * checkpoint-N.tmp and final.tmp (folders written before their rename),
 * NAME.tmp.PID of qtune_run.json, metrics.jsonl, loss.svg and report.html (qt_atomic_open),
 * and the X.old of a qt_dir_replace stopped between its two renames. Nothing
 * a user keeps has such a name; a folder holding only these is empty. */
static int is_leftover(const char *name) {
    size_t n = strlen(name);
    if (!strncmp(name, "checkpoint-", 11) && n > 15 && (!strcmp(name + n - 4, ".tmp") || !strcmp(name + n - 4, ".old")))
        return 1;
    return !strncmp(name, "final.tmp", 9) || !strcmp(name, "final.old") || qt_tmp_pid(name, RUN_FILE) ||
           qt_tmp_pid(name, "metrics.jsonl") || qt_tmp_pid(name, "loss.svg") || qt_tmp_pid(name, "report.html");
}

/* 1 when the folder has anything in it but such leftovers. */
static int dir_nonempty(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int any = 0;
    while (!any && (e = readdir(d))) any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !is_leftover(e->d_name);
    closedir(d);
    return any;
}

/* An X.old whose X is missing is the only whole copy of X: a kill came
 * between qt_dir_replace's two renames. It is put back as X (a rename that
 * loses nothing), so that resume finds that checkpoint. */
static void restore_replaced(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[4096], back[4096], name[1024];
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (!is_leftover(e->d_name) || n < 5 || strcmp(e->d_name + n - 4, ".old") || n - 4 >= sizeof name) continue;
        snprintf(name, sizeof name, "%.*s", (int)(n - 4), e->d_name);
        if (qt_path_join(path, sizeof path, dir, e->d_name) != QT_OK || qt_path_join(back, sizeof back, dir, name) != QT_OK)
            continue;
        if (!qt_path_exists(back) && rename(path, back) == 0)
            qt_info("put back %s: a previous run was stopped while replacing it", back);
    }
    closedir(d);
    qt_error_clear();
}

/* Removes the temporaries an interrupted run left (see is_leftover), under
 * the folder's lock, once restore_replaced put back what it could. */
static int clean_leftovers(const char *dir) {
    restore_replaced(dir);
    DIR *d = opendir(dir);
    if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    int rc = QT_OK, removed = 0;
    char path[4096];
    struct dirent *e;
    while (rc == QT_OK && (e = readdir(d))) {
        if (!is_leftover(e->d_name)) continue;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        if (rc == QT_OK) rc = qt_rm_rf(path);
        removed++;
    }
    closedir(d);
    if (rc == QT_OK && removed) qt_info("removed %d temporary file(s) an interrupted run left in %s", removed, dir);
    return rc;
}

static int remove_ours(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    int rc = QT_OK;
    struct dirent *e;
    char path[4096];
    while (rc == QT_OK && (e = readdir(d))) {
        if (!is_ours(e->d_name)) continue;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        if (rc == QT_OK) rc = qt_rm_rf(path);
    }
    closedir(d);
    return rc;
}

/* qtune_run.json at path, parsed; NULL (and no error left set) when it
 * cannot be read or is not JSON. The caller cJSON_Deletes it. */
static cJSON *read_record(const char *path) {
    char *text;
    if (qt_read_file(path, 1 << 24, &text, NULL) != QT_OK) {
        qt_error_clear();
        return NULL;
    }
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    return j;
}

/* 1 and the recorded run's fingerprint: recomputed from the job it recorded
 * (so a change in how fingerprints are computed does not orphan a folder),
 * else the recorded value; 0 when the record gives none. */
static int recorded_fingerprint(const char *path, uint64_t *fp) {
    cJSON *j = read_record(path);
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(j, "fingerprint");
    const cJSON *job = cJSON_GetObjectItemCaseSensitive(j, "job");
    int found = 1;
    if (cJSON_IsObject(job)) *fp = qt_job_fingerprint_of(job);
    else if (cJSON_IsString(f)) *fp = strtoull(f->valuestring, NULL, 16);
    else found = 0;
    cJSON_Delete(j);
    return found;
}

int qt_output_dir_job_difference(const char *output_dir, const qt_job *job, char *out, size_t cap) {
    char run[4096];
    if (cap) out[0] = 0;
    if (qt_path_join(run, sizeof run, output_dir, RUN_FILE) != QT_OK || !qt_path_exists(run)) {
        qt_error_clear();
        return 0;
    }
    cJSON *j = read_record(run);
    const cJSON *was = cJSON_GetObjectItemCaseSensitive(j, "job");
    int n = cJSON_IsObject(was) ? qt_job_describe_difference(was, job->root, out, cap) : 0;
    cJSON_Delete(j);
    return n;
}

/* Who the folder's qtune_run.json says started the run there ("process N on
 * HOST"), or "" when it does not say. */
static void recorded_owner(const char *run, char *out, size_t cap) {
    out[0] = 0;
    cJSON *j = read_record(run);
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(j, "pid");
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(j, "host");
    if (cJSON_IsNumber(pid) && cJSON_IsString(host))
        snprintf(out, cap, " (its qtune_run.json names process %.0f on %s)", pid->valuedouble, host->valuestring);
    cJSON_Delete(j);
}

/* An exclusive flock on the folder itself, held until *fd is closed: a
 * second qtune started on the same output_dir would otherwise remove or
 * rename the first one's checkpoints under it. A filesystem without flock
 * support (some network mounts) gets a warning and no lock (*fd -2). */
static int lock_folder(const char *dir, const char *run, const qt_job *job, int *fd) {
    *fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*fd < 0) return QT_ERR(QT_EIO, "cannot open output_dir %s: %s", dir, strerror(errno));
    if (flock(*fd, LOCK_EX | LOCK_NB) == 0) return QT_OK;
    int e = errno;
    if (e == EWOULDBLOCK) {
        char who[512];
        recorded_owner(run, who, sizeof who);
        close(*fd), *fd = -1;
        return QT_ERR(QT_EINVAL,
                      "%s: output_dir %s is in use by another qtune process%s; wait for it to finish or stop it, "
                      "or name another output_dir",
                      job->path, dir, who);
    }
    qt_warn("output_dir %s cannot be locked (%s); nothing stops a second qtune from using it at the same time", dir,
            strerror(e));
    close(*fd), *fd = -2; /* no lock, said once: the claim does not try again */
    return QT_OK;
}

/* The guard's verdict on a locked folder, read only: QT_OK and *same (the
 * folder holds this job's run) when this job may use it, else the refusal. */
static int check_locked(const char *output_dir, const char *run, const qt_job *job, int overwrite, int *same) {
    *same = 0;
    if (!dir_nonempty(output_dir)) return QT_OK;
    uint64_t fp = 0;
    *same = qt_path_exists(run) && recorded_fingerprint(run, &fp) && fp == job->fingerprint;
    char diff[1024] = "";
    if (!*same && !overwrite && qt_path_exists(run) && qt_output_dir_job_difference(output_dir, job, diff, sizeof diff))
        return QT_ERR(QT_EINVAL,
                      "%s: output_dir %s already holds the outputs of a run with a different job (it differs in "
                      "%s); qtune will not mix two runs in one folder: name another output_dir, or pass --set "
                      "train.overwrite_output_dir=true to replace its qtune outputs",
                      job->path, output_dir, diff);
    if (!*same && !overwrite)
        return QT_ERR(QT_EINVAL,
                      "%s: output_dir %s already holds %s; qtune will not mix two runs in one folder: name "
                      "another output_dir, or pass --set train.overwrite_output_dir=true to replace its "
                      "qtune outputs",
                      job->path, output_dir,
                      qt_path_exists(run) ? "the outputs of a run with a different job (model, data, LoRA or "
                                            "DeepSpeed settings changed)"
                                          : "files that no qtune run wrote");
    return QT_OK;
}

static int claim_locked(const char *output_dir, const char *run, const qt_job *job, int overwrite, int restart) {
    int same = 0;
    QT_TRY(check_locked(output_dir, run, job, overwrite, &same));
    if (dir_nonempty(output_dir) && (!same || overwrite || restart)) {
        qt_info("%s: removing the previous run's checkpoints and outputs in %s",
                overwrite ? "overwrite_output_dir" : "resume \"never\"", output_dir);
        QT_TRY(remove_ours(output_dir));
    }
    QT_TRY(clean_leftovers(output_dir));
    cJSON *j = cJSON_CreateObject();
    char hex[32];
    snprintf(hex, sizeof hex, "%016" PRIx64, job->fingerprint);
    cJSON_AddStringToObject(j, "fingerprint", hex);
    cJSON_AddStringToObject(j, "job_file", job->path);
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "?");
    cJSON_AddNumberToObject(j, "pid", (double)getpid());
    cJSON_AddStringToObject(j, "host", host);
    cJSON_AddItemToObject(j, "job", cJSON_Duplicate(job->root, 1));
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    if (!s) return QT_ERR(QT_ENOMEM, "out of memory writing %s", run);
    int rc = qt_write_file_atomic(run, s, strlen(s));
    free(s);
    return rc;
}

static int not_a_folder(const char *output_dir, const qt_job *job) {
    if (qt_path_exists(output_dir) && !qt_is_dir(output_dir))
        return QT_ERR(QT_EINVAL, "%s: output_dir %s exists and is not a folder; name another output_dir", job->path,
                      output_dir);
    return QT_OK;
}

int qt_output_dir_check(const char *output_dir, const qt_job *job, int overwrite, int *lock_fd) {
    char run[4096];
    *lock_fd = -1;
    QT_TRY(qt_path_join(run, sizeof run, output_dir, RUN_FILE));
    QT_TRY(not_a_folder(output_dir, job));
    if (!qt_is_dir(output_dir)) return QT_OK; /* made by the claim, once the job has been checked */
    /* the lock comes first: nothing in the folder is read without it */
    QT_TRY(lock_folder(output_dir, run, job, lock_fd));
    int same;
    int rc = check_locked(output_dir, run, job, overwrite, &same);
    if (rc == QT_OK && same) restore_replaced(output_dir); /* before resume looks for checkpoints */
    if (rc != QT_OK && *lock_fd >= 0) close(*lock_fd), *lock_fd = -1;
    return rc;
}

int qt_output_dir_claim(const char *output_dir, const qt_job *job, int overwrite, int restart, int *lock_fd) {
    char run[4096];
    QT_TRY(qt_path_join(run, sizeof run, output_dir, RUN_FILE));
    QT_TRY(not_a_folder(output_dir, job));
    QT_TRY(qt_mkdir_p(output_dir));
    /* the lock comes first: nothing in the folder is removed or written without it */
    if (*lock_fd == -1) QT_TRY(lock_folder(output_dir, run, job, lock_fd));
    int rc = claim_locked(output_dir, run, job, overwrite, restart);
    if (rc != QT_OK && *lock_fd >= 0) close(*lock_fd), *lock_fd = -1;
    return rc;
}
