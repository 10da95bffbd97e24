/* `qtune stop OUTPUT_DIR`: the stop file a running job polls between steps
 * (see trainer.h). A file rather than a signal because a signal cannot stop an
 * MPI job safely: mpirun forwards SIGTERM to the ranks and sends SIGKILL one
 * second later (OpenMPI's odls_base_sigkill_timeout), before a large model's
 * checkpoint is written. */
#include "train/trainer.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

static int stop_path(const char *output_dir, char *out, size_t cap) {
    return qt_path_join(out, cap, output_dir, QT_STOP_FILE);
}

int qt_output_dir_held(const char *output_dir) {
    int fd = open(output_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    int held;
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
        held = 0;
        flock(fd, LOCK_UN);
    } else {
        held = errno == EWOULDBLOCK ? 1 : -1;
    }
    close(fd);
    return held;
}

/* "process N on HOST" from the run's record, or "". */
static void holder_of(const char *output_dir, char *out, size_t cap) {
    char run[4096], *text = NULL;
    out[0] = 0;
    if (qt_path_join(run, sizeof run, output_dir, "qtune_run.json") != QT_OK ||
        qt_read_file(run, 1 << 24, &text, NULL) != QT_OK) {
        qt_error_clear();
        return;
    }
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(j, "pid"), *host = cJSON_GetObjectItemCaseSensitive(j, "host");
    if (cJSON_IsNumber(pid) && cJSON_IsString(host))
        snprintf(out, cap, "process %.0f on %s", pid->valuedouble, host->valuestring);
    cJSON_Delete(j);
}

int qt_stop_request(const char *output_dir, char *holder, size_t cap) {
    if (cap) holder[0] = 0;
    if (!qt_is_dir(output_dir))
        return QT_ERR(QT_EINVAL, "%s is not a folder: name the output_dir of the running job (its job file's "
                                 "\"output_dir\")", output_dir);
    int held = qt_output_dir_held(output_dir);
    if (held == 0)
        return QT_ERR(QT_EINVAL, "no qtune train holds %s, so there is nothing to stop (a job takes its output_dir "
                                 "once its model and data are loaded; if one is still loading, run this again in a "
                                 "moment)", output_dir);
    if (cap) holder_of(output_dir, holder, cap);
    char path[4096], body[128];
    QT_TRY(stop_path(output_dir, path, sizeof path));
    int n = snprintf(body, sizeof body, "{\"requested_by_pid\": %d, \"time\": %lld}\n", (int)getpid(),
                     (long long)time(NULL));
    return qt_write_file_atomic(path, body, (size_t)n);
}

int qt_stop_requested_file(const char *output_dir) {
    char path[4096];
    if (stop_path(output_dir, path, sizeof path) != QT_OK) {
        qt_error_clear();
        return 0;
    }
    return access(path, F_OK) == 0;
}

void qt_stop_file_clear(const char *output_dir) {
    char path[4096];
    if (stop_path(output_dir, path, sizeof path) != QT_OK) {
        qt_error_clear();
        return;
    }
    (void)unlink(path);
}
