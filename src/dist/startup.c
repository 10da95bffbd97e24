/* The deadline of MPI start-up (dist_startup.h). The collectives' deadlines
 * (dist.c) start after MPI_Init; MPI_Init itself and the MPI_Comm_dup calls
 * after it block until every rank arrives, so a rank stopped (SIGSTOP, a
 * debugger, a swapped-out node) or stuck before them hung the whole job
 * forever, with no message. A watchdog thread now waits beside start-up with
 * the same deadline (QTUNE_DIST_TIMEOUT); past it, the rank says which ranks
 * never arrived and exits, and mpirun ends the job.
 *
 * MPI cannot be asked who is missing while it starts, so each rank leaves a
 * marker on this host (a file named by its rank, holding its pid) before
 * MPI_Init, in a folder of /dev/shm (or $TMPDIR) named by the launcher's
 * daemon and job. The watchdog reads them: a rank without a marker never
 * reached start-up, one whose process is stopped (state T) or gone is named as
 * such. Ranks on other hosts leave their markers there, so with several hosts
 * the sentence says which ranks this host cannot see. A rank removes its
 * marker when start-up ends; the markers of a job whose launcher is gone (a
 * rank killed while stopped) are removed by the next job that starts here. */
#define _GNU_SOURCE
#include "dist/dist_internal.h"

#if QT_DIST_MPI
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/error.h"

struct dist_startup {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;          /* start-up finished: the watchdog returns */
    double timeout_s;
    int rank, world, local_world;
    char dir[256];     /* the markers' folder */
    char mine[300];    /* this rank's marker */
};

static int env_int(const char *const *names, int n, int fallback) {
    for (int i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return atoi(v);
    }
    return fallback;
}

/* What rank r is on this host: 'M' no marker, 'T' stopped, 'Z'/'X' gone,
 * 'R' otherwise (running or sleeping: it reached start-up). */
static char rank_state(const struct dist_startup *s, int r) {
    char path[320], buf[64];
    snprintf(path, sizeof path, "%s/%d", s->dir, r);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 'M';
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 'M';
    buf[n] = 0;
    long pid = strtol(buf, NULL, 10);
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 'X';
    char st[512];
    n = read(fd, st, sizeof st - 1);
    close(fd);
    if (n <= 0) return 'X';
    st[n] = 0;
    const char *p = strrchr(st, ')'); /* "pid (comm) S ..." where comm may hold anything */
    if (!p || !p[1] || !p[2]) return 'R';
    char c = p[2];
    return c == 'T' || c == 't' ? 'T' : c == 'Z' || c == 'X' ? 'X' : 'R';
}

static void append(char *buf, size_t cap, const char *s) {
    size_t len = strlen(buf);
    if (len < cap) snprintf(buf + len, cap - len, "%s", s);
}

/* "rank(s) 1 never reached MPI start-up; rank(s) 2 are stopped (SIGSTOP or a
 * debugger: SIGCONT resumes them)" and so on. */
static void describe(const struct dist_startup *s, char *out, size_t cap) {
    static const char kinds[] = "MTX";
    static const char *const says[] = {
        "never reached MPI start-up (they did not start, or hang before it)",
        "are stopped (SIGSTOP, Ctrl-Z or a debugger; SIGCONT resumes a stopped process)",
        "exited during start-up"};
    out[0] = 0;
    int local = s->local_world > 0 && s->local_world >= s->world;
    for (int k = 0; k < 3; k++) {
        char list[200] = "";
        int count = 0;
        for (int r = 0; r < s->world; r++) {
            if (r == s->rank || rank_state(s, r) != kinds[k]) continue;
            char num[16];
            snprintf(num, sizeof num, "%s%d", count ? ", " : "", r);
            if (strlen(list) + strlen(num) + 8 < sizeof list) append(list, sizeof list, num);
            else if (!strstr(list, "...")) append(list, sizeof list, ", ...");
            count++;
        }
        if (!count) continue;
        char part[400];
        if (k == 0 && !local)
            snprintf(part, sizeof part, "rank(s) %s did not reach MPI start-up on this host (they run on another "
                     "host, or never started)", list);
        else
            snprintf(part, sizeof part, "rank(s) %s %s", list, says[k]);
        if (out[0]) append(out, cap, "; ");
        append(out, cap, part);
    }
    if (!out[0])
        snprintf(out, cap, "every rank reached it and is running, so the launcher or the network between the "
                 "ranks stalls");
}

static void *watch(void *arg) {
    struct dist_startup *s = arg;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)s->timeout_s;
    until.tv_nsec += (long)((s->timeout_s - (double)(time_t)s->timeout_s) * 1e9);
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (!s->done && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int done = s->done;
    pthread_mutex_unlock(&s->mu);
    if (done) return NULL;
    char who[1024];
    describe(s, who, sizeof who);
    fprintf(stderr, "qtune: error: rank %d: MPI start-up did not finish within %g s (QTUNE_DIST_TIMEOUT); %s. "
                    "Every rank must start; mpirun then ends the job\n", s->rank, s->timeout_s, who);
    fflush(stderr);
    unlink(s->mine);
    _exit(1); /* MPI is half started: no MPI_Abort; a rank that exits makes mpirun end the job */
}

/* Removes the marker folders of this user's jobs whose launcher daemon no
 * longer runs. */
static void sweep(const char *tmp) {
    DIR *dir = opendir(tmp);
    if (!dir) return;
    char prefix[64];
    int plen = snprintf(prefix, sizeof prefix, "qtune-start-%u-", (unsigned)getuid());
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (strncmp(e->d_name, prefix, (size_t)plen)) continue;
        long daemon = strtol(e->d_name + plen, NULL, 10);
        if (daemon <= 1 || kill((pid_t)daemon, 0) == 0 || errno != ESRCH) continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", tmp, e->d_name);
        DIR *in = opendir(path);
        struct dirent *f;
        while (in && (f = readdir(in))) {
            if (f->d_name[0] == '.') continue;
            char file[800];
            snprintf(file, sizeof file, "%s/%s", path, f->d_name);
            unlink(file);
        }
        if (in) closedir(in);
        rmdir(path);
    }
    closedir(dir);
}

int dist_startup_begin(double timeout_s, struct dist_startup **out) {
    *out = NULL;
    static const char *const rank_names[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"};
    static const char *const local_names[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"};
    static const char *const size_names[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"};
    struct dist_startup *s = calloc(1, sizeof *s);
    if (!s) return QT_ERR(QT_ENOMEM, "out of memory starting MPI");
    s->timeout_s = timeout_s;
    s->rank = env_int(rank_names, 3, 0);
    s->world = env_int(size_names, 3, 1);
    s->local_world = env_int(local_names, 2, 0);
    const char *ns = getenv("PMIX_NAMESPACE");
    const char *tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    /* the parent is the launcher's daemon on this host, the same for every rank of the job here */
    snprintf(s->dir, sizeof s->dir, "%s/qtune-start-%u-%ld-%.64s", tmp, (unsigned)getuid(), (long)getppid(),
             ns ? ns : "");
    for (char *p = s->dir + strlen(tmp) + 1; *p; p++)
        if (*p == '/') *p = '_';
    sweep(tmp);
    snprintf(s->mine, sizeof s->mine, "%s/%d", s->dir, s->rank);
    if (mkdir(s->dir, 0700) == 0 || errno == EEXIST) {
        int fd = open(s->mine, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd >= 0) {
            char pid[32];
            int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
            ssize_t w = write(fd, pid, (size_t)n);
            (void)w;
            close(fd);
        }
    } /* without markers the watchdog still ends the job; it then names no rank */
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, watch, s) != 0) {
        unlink(s->mine);
        free(s);
        return QT_ERR(QT_ENOMEM, "could not start a thread to watch MPI start-up (out of memory or threads)");
    }
    *out = s;
    return QT_OK;
}

void dist_startup_end(struct dist_startup *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->done = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    unlink(s->mine);
    rmdir(s->dir); /* the last rank here to finish removes the folder */
    free(s);
}
#endif
