/* checkpoint-STEP folders: write under .tmp, fsync, rename; find; prune. */
#include "io/checkpoint.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/safetensors.h"

#include <ctype.h>
#include <openssl/evp.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

long ckpt_step_of(const char *name) {
    static const char pre[] = "checkpoint-";
    if (strncmp(name, pre, sizeof pre - 1)) return -1;
    const char *p = name + sizeof pre - 1;
    if (!*p || strlen(p) > 15) return -1;
    long v = 0;
    for (; *p; p++) {
        if (!isdigit((unsigned char)*p)) return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

int ckpt_names(ckpt_writer *w, const char *output_dir, long step) {
    memset(w, 0, sizeof *w);
    w->step = step;
    char name[64];
    snprintf(name, sizeof name, "checkpoint-%ld", step);
    if (snprintf(w->output_dir, sizeof w->output_dir, "%s", output_dir) >= (int)sizeof w->output_dir)
        return QT_ERR(QT_EINVAL, "output folder path too long: %s", output_dir);
    QT_TRY(qt_path_join(w->final, sizeof w->final, output_dir, name));
    if (snprintf(w->dir, sizeof w->dir, "%s.tmp", w->final) >= (int)sizeof w->dir)
        return QT_ERR(QT_EINVAL, "output folder path too long: %s", output_dir);
    return QT_OK;
}

int ckpt_begin(ckpt_writer *w, const char *output_dir, long step) {
    QT_TRY(ckpt_names(w, output_dir, step));
    QT_TRY(qt_rm_rf(w->dir));
    QT_TRY(qt_mkdir_p(w->dir));
    return QT_OK;
}

/* fsync every regular file in dir (the atomic writers already did, but a
 * caller may have used plain stdio). */
static int sync_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    struct dirent *e;
    int rc = QT_OK;
    char path[CKPT_PATH_MAX];
    while (rc == QT_OK && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        if (rc != QT_OK) break;
        int fd = open(path, O_RDONLY);
        if (fd < 0) { rc = QT_ERR(QT_EIO, "cannot open %s: %s", path, strerror(errno)); break; }
        if (fsync(fd) != 0) rc = QT_ERR(QT_EIO, "cannot sync %s: %s; check free disk space", path, strerror(errno));
        close(fd);
    }
    closedir(d);
    return rc;
}

int ckpt_commit(ckpt_writer *w) {
    int rc = sync_files(w->dir);
    if (rc == QT_OK) rc = qt_fsync_dir(w->dir);
    /* a checkpoint of the same step (a re-save) is replaced so that at every
     * instant one complete copy exists */
    if (rc == QT_OK) rc = qt_dir_replace(w->dir, w->final);
    if (rc != QT_OK) qt_rm_rf(w->dir);
    return rc;
}

void ckpt_abort(ckpt_writer *w) {
    if (w->dir[0]) qt_rm_rf(w->dir);
}

static int is_complete(const char *output_dir, const char *name) {
    char path[CKPT_PATH_MAX], state[CKPT_PATH_MAX];
    if (qt_path_join(path, sizeof path, output_dir, name) != QT_OK) return 0;
    if (qt_path_join(state, sizeof state, path, CKPT_STATE_FILE) != QT_OK) return 0;
    return qt_is_dir(path) && qt_path_exists(state);
}

int ckpt_latest(const char *output_dir, char *path, size_t cap, long *step) {
    return ckpt_previous(output_dir, -1, path, cap, step);
}

int ckpt_previous(const char *output_dir, long before, char *path, size_t cap, long *step) {
    *step = -1;
    if (cap) path[0] = 0;
    DIR *d = opendir(output_dir);
    if (!d) return errno == ENOENT ? QT_OK : QT_ERR(QT_EIO, "cannot open folder %s: %s", output_dir, strerror(errno));
    struct dirent *e;
    long best = -1;
    char name[300] = "";
    while ((e = readdir(d))) {
        long s = ckpt_step_of(e->d_name);
        if (before >= 0 && s >= before) continue;
        if (s > best && is_complete(output_dir, e->d_name)) {
            best = s;
            snprintf(name, sizeof name, "%s", e->d_name);
        }
    }
    closedir(d);
    if (best < 0) return QT_OK;
    QT_TRY(qt_path_join(path, cap, output_dir, name));
    *step = best;
    return QT_OK;
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

int ckpt_prune(const char *output_dir, int keep, long protect) {
    DIR *d = opendir(output_dir);
    if (!d) return errno == ENOENT ? QT_OK : QT_ERR(QT_EIO, "cannot open folder %s: %s", output_dir, strerror(errno));
    long *steps = NULL;
    size_t n = 0, cap = 0;
    int rc = QT_OK;
    struct dirent *e;
    char path[CKPT_PATH_MAX];
    while (rc == QT_OK && (e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (!strncmp(e->d_name, "checkpoint-", 11) && len > 4 && !strcmp(e->d_name + len - 4, ".tmp")) {
            /* a write that never finished (crash or kill) */
            if (qt_path_join(path, sizeof path, output_dir, e->d_name) == QT_OK) qt_rm_rf(path);
            continue;
        }
        long s = ckpt_step_of(e->d_name);
        if (s < 0 || !is_complete(output_dir, e->d_name)) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            long *ns = qt_realloc(steps, cap * sizeof *steps, "checkpoint list");
            if (!ns) { rc = QT_ENOMEM; break; }
            steps = ns;
        }
        steps[n++] = s;
    }
    closedir(d);
    if (rc == QT_OK && keep > 0 && n > (size_t)keep) {
        qsort(steps, n, sizeof *steps, cmp_long);
        for (size_t i = 0; i + (size_t)keep < n && rc == QT_OK; i++) {
            if (steps[i] == protect) continue;
            char name[64];
            snprintf(name, sizeof name, "checkpoint-%ld", steps[i]);
            rc = qt_path_join(path, sizeof path, output_dir, name);
            /* renamed to .tmp first: a kill during the removal must not leave a
             * checkpoint-N folder that holds trainer_state.json but lacks
             * weights (found by scripts/soak); a leftover .tmp is removed above
             * on the next prune */
            char doomed[CKPT_PATH_MAX + 8];
            snprintf(doomed, sizeof doomed, "%s.tmp", path);
            if (rc == QT_OK) {
                qt_rm_rf(doomed);
                if (rename(path, doomed) != 0)
                    rc = QT_ERR(QT_EIO, "cannot remove the old checkpoint %s: %s", path, strerror(errno));
            }
            if (rc == QT_OK) rc = qt_rm_rf(doomed);
        }
    }
    qt_free(steps);
    return rc;
}

int ckpt_write_f32(const char *path, const char *name, const float *data, size_t n) {
    st_writer *w;
    QT_TRY(st_writer_new(&w));
    int64_t shape[1] = {(int64_t)n};
    int rc = st_writer_add(w, name, QT_F32, 1, shape, data, QT_F32);
    if (rc == QT_OK) rc = st_writer_write(w, path);
    st_writer_free(w);
    return rc;
}

int ckpt_read_f32(const char *path, const char *name, float *data, size_t n) {
    st_file *f;
    QT_TRY(st_open(path, &f));
    int64_t shape[1] = {(int64_t)n};
    const st_tensor *t;
    int rc = st_expect(f, name, 1, shape, &t);
    if (rc == QT_OK && t->dtype != QT_F32)
        rc = QT_ERR(QT_EFORMAT, "%s: tensor %s must be F32 in a checkpoint", path, name);
    if (rc == QT_OK) rc = st_read_f32(t, data);
    st_close(f);
    return rc;
}

/* ---------------------------------------------------------------------------
 * checksums */

#define SUM_HEX 64 /* SHA-256: 32 bytes as hex */
#define SUM_MAX_FILES 4096

/* SHA-256 of a file as 64 lowercase hex digits, read in 4 MiB blocks. A
 * checkpoint holds only regular files: anything else named there (a FIFO,
 * which would block in open(), a link to /dev/zero, which never ends) is
 * refused before it is read. Reading a large checkpoint takes minutes, so a
 * stop request (qt_cancel_requested) ends it between blocks. */
static int sha256_file(const char *path, char hex[SUM_HEX + 1]) {
    int fd;
    int rc0 = qt_open_regular(path, "checkpoint file", &fd); /* refuses a FIFO or a device without blocking */
    if (rc0 == QT_EINVAL) {
        struct stat sb;
        return QT_ERR(QT_EFORMAT, "%s is %s, not a regular file, and a checkpoint holds only regular files; the "
                      "checkpoint is damaged", path, stat(path, &sb) == 0 ? qt_file_kind((unsigned)sb.st_mode)
                                                                          : "not a regular file");
    }
    if (rc0 != QT_OK) return rc0;
    const size_t cap = (size_t)4 << 20;
    unsigned char *buf = qt_malloc(cap, "checksum buffer");
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int rc = buf && ctx ? QT_OK : QT_ERR(QT_ENOMEM, "out of memory hashing %s", path);
    if (rc == QT_OK && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
        rc = QT_ERR(QT_EIO, "cannot start a SHA-256 digest (OpenSSL) for %s", path);
    for (;;) {
        if (rc != QT_OK) break;
        if (qt_cancel_requested()) {
            rc = QT_ERR(QT_EINTERRUPTED, "stopped while checking %s against its checksum; nothing new to save", path);
            break;
        }
        ssize_t got = read(fd, buf, cap);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { rc = QT_ERR(QT_EIO, "cannot read %s: %s", path, strerror(errno)); break; }
        if (got == 0) break;
        if (EVP_DigestUpdate(ctx, buf, (size_t)got) != 1) rc = QT_ERR(QT_EIO, "SHA-256 of %s failed", path);
    }
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (rc == QT_OK && (EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 || mdlen != SUM_HEX / 2))
        rc = QT_ERR(QT_EIO, "SHA-256 of %s failed", path);
    for (unsigned i = 0; rc == QT_OK && i < mdlen; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    EVP_MD_CTX_free(ctx);
    qt_free(buf);
    close(fd);
    return rc;
}

static int cmp_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int ckpt_write_checksums(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    int rc = QT_OK;
    struct dirent *e;
    char path[CKPT_PATH_MAX];
    while (rc == QT_OK && (e = readdir(d))) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, CKPT_SUMS_FILE)) continue;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        struct stat sb;
        if (rc != QT_OK || stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nn = qt_realloc(names, cap * sizeof *names, "checksum list");
            if (!nn) { rc = QT_ENOMEM; break; }
            names = nn;
        }
        names[n] = qt_strdup(e->d_name);
        if (!names[n]) rc = QT_ENOMEM;
        else n++;
    }
    closedir(d);
    /* sorted, so the file reads the same whichever order the folder lists */
    if (rc == QT_OK) qsort(names, n, sizeof *names, cmp_name);
    size_t tcap = n * (SUM_HEX + 3 + 256) + 1, len = 0;
    char *text = rc == QT_OK ? qt_malloc(tcap, "checksum list") : NULL;
    if (rc == QT_OK && !text) rc = QT_ENOMEM;
    for (size_t i = 0; i < n && rc == QT_OK; i++) {
        char hex[SUM_HEX + 1];
        rc = qt_path_join(path, sizeof path, dir, names[i]);
        if (rc == QT_OK) rc = sha256_file(path, hex);
        if (rc == QT_OK) len += (size_t)snprintf(text + len, tcap - len, "%s  %s\n", hex, names[i]);
    }
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, dir, CKPT_SUMS_FILE);
    if (rc == QT_OK) rc = qt_write_file_atomic(path, text ? text : "", len);
    for (size_t i = 0; i < n; i++) qt_free(names[i]);
    qt_free(names);
    qt_free(text);
    return rc;
}

/* Appends name to the ", "-separated list out (cap bytes), or counts it in
 * *more when it no longer fits. */
static void list_add(char *out, size_t cap, const char *name, int *more) {
    size_t len = strlen(out);
    if (len + strlen(name) + 2 + 24 >= cap) { /* room kept for " and N more" */
        (*more)++;
        return;
    }
    snprintf(out + len, cap - len, "%s%s", len ? ", " : "", name);
}

/* The regular files of dir (not dot files, not CKPT_SUMS_FILE) that the list
 * does not name: they would be resumed unchecked. */
static int find_unlisted(const char *dir, char *const *listed, size_t n_listed, char *out, size_t cap) {
    DIR *d = opendir(dir);
    if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    int more = 0, rc = QT_OK;
    char path[CKPT_PATH_MAX];
    struct dirent *e;
    while (rc == QT_OK && (e = readdir(d))) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, CKPT_SUMS_FILE)) continue;
        struct stat sb;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        if (rc != QT_OK || stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        size_t i = 0;
        while (i < n_listed && strcmp(listed[i], e->d_name)) i++;
        if (i == n_listed) list_add(out, cap, e->d_name, &more);
    }
    closedir(d);
    size_t len = strlen(out);
    if (more) snprintf(out + len, cap - len, " and %d more", more);
    return rc;
}

int ckpt_verify_checksums(const char *dir, int *present, char *unlisted, size_t cap) {
    char sums[CKPT_PATH_MAX], path[CKPT_PATH_MAX];
    *present = 0;
    if (cap) unlisted[0] = 0;
    QT_TRY(qt_path_join(sums, sizeof sums, dir, CKPT_SUMS_FILE));
    if (!qt_path_exists(sums)) return QT_OK;
    *present = 1;
    char *text;
    size_t len;
    QT_TRY(qt_read_file(sums, (size_t)SUM_MAX_FILES * (SUM_HEX + 3 + 256), &text, &len));
    char **listed = qt_calloc(SUM_MAX_FILES, sizeof *listed, "checksum list");
    size_t n_listed = 0;
    int rc = listed ? QT_OK : QT_ENOMEM;
    long line = 0;
    for (char *p = text; rc == QT_OK && *p;) {
        char *nl = strchr(p, '\n');
        if (!nl) nl = p + strlen(p);
        line++;
        /* "HEX  NAME": 64 hex digits, two spaces, a plain file name; a list
         * saved with Windows line ends (CRLF) reads the same */
        size_t ll = (size_t)(nl - p);
        if (ll && p[ll - 1] == '\r') ll--;
        char name[256];
        int good = ll > SUM_HEX + 2 && ll - SUM_HEX - 2 < sizeof name && p[SUM_HEX] == ' ' && p[SUM_HEX + 1] == ' ';
        for (int i = 0; good && i < SUM_HEX; i++) good = isxdigit((unsigned char)p[i]) && !isupper((unsigned char)p[i]);
        if (good) {
            memcpy(name, p + SUM_HEX + 2, ll - SUM_HEX - 2);
            name[ll - SUM_HEX - 2] = 0;
            good = name[0] && name[0] != '.' && !strchr(name, '/');
        }
        if (!good) {
            rc = QT_ERR(QT_EFORMAT, "%s line %ld is not \"SHA-256  file name\"; the checkpoint is damaged", sums, line);
            break;
        }
        char hex[SUM_HEX + 1];
        rc = qt_path_join(path, sizeof path, dir, name);
        if (rc == QT_OK && !qt_path_exists(path))
            rc = QT_ERR(QT_EFORMAT, "%s is missing, although %s lists it; the checkpoint is incomplete", path,
                        CKPT_SUMS_FILE);
        if (rc == QT_OK) rc = sha256_file(path, hex);
        if (rc == QT_OK && memcmp(hex, p, SUM_HEX))
            rc = QT_ERR(QT_EFORMAT,
                        "%s does not match its SHA-256 in %s: it changed after it was written (a disk error, or a "
                        "file copied in)",
                        path, CKPT_SUMS_FILE);
        if (rc == QT_OK && n_listed < SUM_MAX_FILES && !(listed[n_listed] = qt_strdup(name))) rc = QT_ENOMEM;
        if (rc == QT_OK && n_listed < SUM_MAX_FILES) n_listed++;
        p = *nl ? nl + 1 : nl;
    }
    /* a list cut short or edited must not switch the check off in silence */
    if (rc == QT_OK && cap) rc = find_unlisted(dir, listed, n_listed, unlisted, cap);
    for (size_t i = 0; i < n_listed; i++) qt_free(listed[i]);
    qt_free(listed);
    qt_free(text);
    return rc;
}
