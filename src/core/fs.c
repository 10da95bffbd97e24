#include "core/fs.h"
#include "core/error.h"
#include "core/mem.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

const char *qt_file_kind(unsigned mode) {
    return S_ISREG(mode)    ? "a regular file"
           : S_ISDIR(mode)  ? "a folder"
           : S_ISFIFO(mode) ? "a FIFO (named pipe)"
           : S_ISCHR(mode)  ? "a character device (like /dev/zero)"
           : S_ISBLK(mode)  ? "a block device"
           : S_ISSOCK(mode) ? "a socket"
                            : "not a regular file";
}

int qt_open_regular(const char *path, const char *what, int *fd) {
    *fd = -1;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer */
    int f = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (f < 0) return QT_ERR(QT_EIO, "cannot open %s %s: %s", what, path, strerror(errno));
    struct stat st;
    if (fstat(f, &st) != 0) {
        int e = errno;
        close(f);
        return QT_ERR(QT_EIO, "cannot open %s %s: %s", what, path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return QT_ERR(QT_EINVAL, "%s %s is %s, not a regular file; qtune reads only regular files: save it to a file "
                      "and name that", what, path, qt_file_kind((unsigned)st.st_mode));
    }
    int fl = fcntl(f, F_GETFL);
    if (fl >= 0) fcntl(f, F_SETFL, fl & ~O_NONBLOCK);
    *fd = f;
    return QT_OK;
}

FILE *qt_fopen_regular(const char *path, const char *what) {
    int fd;
    if (qt_open_regular(path, what, &fd) != QT_OK) return NULL;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        int e = errno;
        close(fd);
        QT_ERR(QT_EIO, "cannot open %s %s: %s", what, path, strerror(e));
    }
    return f;
}

int qt_read_file(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    FILE *f = qt_fopen_regular(path, "the file");
    if (!f) return qt_error_code();
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        fclose(f);
        return QT_ERR(QT_EIO, "cannot read %s: %s", path, strerror(errno));
    }
    if ((uint64_t)st.st_size > max_bytes) {
        fclose(f);
        return QT_ERR(QT_EFORMAT, "%s is %lld bytes, more than the %zu this kind of file may have; is it the right file?",
                      path, (long long)st.st_size, max_bytes);
    }
    size_t n = (size_t)st.st_size;
    char *buf = qt_malloc(n + 1, path);
    if (!buf) { fclose(f); return QT_ENOMEM; }
    size_t got = fread(buf, 1, n, f);
    int err = ferror(f);
    fclose(f);
    if (err || got != n) {
        qt_free(buf);
        return QT_ERR(QT_EIO, "cannot read %s (got %zu of %zu bytes)", path, got, n);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return QT_OK;
}

int qt_atomic_open(qt_atomic_file *af, const char *path) {
    memset(af, 0, sizeof *af);
    size_t n = strlen(path) + 32;
    af->path = qt_strdup(path);
    af->tmp = qt_malloc(n, "a temporary path");
    if (!af->path || !af->tmp) { qt_free(af->path); qt_free(af->tmp); return QT_ENOMEM; }
    snprintf(af->tmp, n, "%s.tmp.%d", path, (int)getpid());
    af->f = fopen(af->tmp, "wb");
    if (!af->f) {
        int e = errno;
        qt_free(af->path); qt_free(af->tmp);
        af->path = af->tmp = NULL;
        return QT_ERR(QT_EIO, "cannot create %s: %s", path, strerror(e));
    }
    return QT_OK;
}

int qt_atomic_write(qt_atomic_file *af, const void *buf, size_t n) {
    if (n && fwrite(buf, 1, n, af->f) != n)
        return QT_ERR(QT_EIO, "cannot write %s: %s; check free disk space", af->path, strerror(errno));
    return QT_OK;
}

static void atomic_release(qt_atomic_file *af) {
    qt_free(af->path);
    qt_free(af->tmp);
    af->path = af->tmp = NULL;
    af->f = NULL;
}

int qt_atomic_commit(qt_atomic_file *af) {
    int rc = QT_OK;
    if (fflush(af->f) != 0 || fsync(fileno(af->f)) != 0)
        rc = QT_ERR(QT_EIO, "cannot write %s: %s; check free disk space", af->path, strerror(errno));
    if (fclose(af->f) != 0 && rc == QT_OK)
        rc = QT_ERR(QT_EIO, "cannot write %s: %s; check free disk space", af->path, strerror(errno));
    if (rc == QT_OK && rename(af->tmp, af->path) != 0)
        rc = QT_ERR(QT_EIO, "cannot rename %s to %s: %s", af->tmp, af->path, strerror(errno));
    if (rc != QT_OK) unlink(af->tmp);
    atomic_release(af);
    return rc;
}

void qt_atomic_abort(qt_atomic_file *af) {
    if (!af->f) return;
    fclose(af->f);
    unlink(af->tmp);
    atomic_release(af);
}

int qt_write_file_atomic(const char *path, const void *buf, size_t n) {
    qt_atomic_file af;
    QT_TRY(qt_atomic_open(&af, path));
    int rc = qt_atomic_write(&af, buf, n);
    if (rc != QT_OK) { qt_atomic_abort(&af); return rc; }
    return qt_atomic_commit(&af);
}

int qt_mkdir_p(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return QT_ERR(QT_EINVAL, "bad folder path '%s'", path);
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return QT_ERR(QT_EIO, "cannot create folder %s: %s", buf, strerror(errno));
            buf[i] = c;
        }
    }
    if (!qt_is_dir(path)) return QT_ERR(QT_EIO, "%s exists and is not a folder", path);
    return QT_OK;
}

int qt_path_missing_top(const char *path, char *top, size_t cap) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return QT_ERR(QT_EINVAL, "bad folder path '%s'", path);
    memcpy(buf, path, n + 1);
    if (cap) top[0] = 0;
    /* the same prefixes qt_mkdir_p creates, top down */
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        char c = buf[i];
        buf[i] = 0;
        struct stat st;
        if (lstat(buf, &st) != 0 && errno == ENOENT) {
            if (i + 1 > cap) return QT_ERR(QT_EINVAL, "folder path too long: %s", path);
            memcpy(top, buf, i + 1);
            return QT_OK;
        }
        buf[i] = c;
    }
    return QT_OK;
}

void qt_rmdir_made(const char *path, const char *top) {
    char buf[4096];
    size_t n = strlen(path), t = strlen(top);
    if (!t || t > n || n >= sizeof buf || strncmp(path, top, t) || (path[t] != '/' && path[t] != 0)) return;
    memcpy(buf, path, n + 1);
    for (size_t i = n; i >= t; i--) {
        if (i < n && buf[i] != '/') continue;
        buf[i] = 0;
        if (rmdir(buf) != 0 && errno != ENOENT) return; /* not empty: something else is in it */
    }
}

long qt_tmp_pid(const char *name, const char *base) {
    size_t n = strlen(base);
    if (strncmp(name, base, n) || strncmp(name + n, ".tmp.", 5)) return 0;
    const char *p = name + n + 5;
    long pid = 0;
    for (; *p >= '0' && *p <= '9' && pid < 100000000; p++) pid = pid * 10 + (*p - '0');
    return *p || p == name + n + 5 ? 0 : pid;
}

int qt_remove_dead_tmps(const char *path_of, int *removed) {
    *removed = 0;
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, path_of);
    const char *slash = strrchr(path_of, '/'), *base = slash ? slash + 1 : path_of;
    if (!base[0]) return QT_OK;
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? QT_OK : QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    int rc = QT_OK;
    char path[4096];
    struct dirent *e;
    while (rc == QT_OK && (e = readdir(d))) {
        long pid = qt_tmp_pid(e->d_name, base);
        /* ESRCH only: EPERM is a process of another user, alive */
        if (pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        rc = qt_path_join(path, sizeof path, dir, e->d_name);
        if (rc == QT_OK) rc = qt_rm_rf(path);
        if (rc == QT_OK) (*removed)++;
    }
    closedir(d);
    return rc;
}

int qt_rm_rf(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? QT_OK : QT_ERR(QT_EIO, "cannot stat %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (!d) return QT_ERR(QT_EIO, "cannot open folder %s: %s", path, strerror(errno));
        struct dirent *e;
        char child[4096];
        int rc = QT_OK;
        while (rc == QT_OK && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            rc = qt_path_join(child, sizeof child, path, e->d_name);
            if (rc == QT_OK) rc = qt_rm_rf(child);
        }
        closedir(d);
        if (rc != QT_OK) return rc;
        if (rmdir(path) != 0) return QT_ERR(QT_EIO, "cannot remove folder %s: %s", path, strerror(errno));
    } else if (unlink(path) != 0) {
        return QT_ERR(QT_EIO, "cannot remove %s: %s", path, strerror(errno));
    }
    return QT_OK;
}

int qt_path_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

int qt_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int qt_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return QT_ERR(QT_EIO, "cannot open folder %s: %s", dir, strerror(errno));
    int rc = fsync(fd);
    close(fd);
    return rc == 0 ? QT_OK : QT_ERR(QT_EIO, "cannot sync folder %s: %s", dir, strerror(errno));
}

int qt_dir_replace(const char *tmp, const char *final) {
    char old[4096], parent[4096];
    int n = snprintf(old, sizeof old, "%s.old", final);
    if (n < 0 || (size_t)n >= sizeof old) return QT_ERR(QT_EINVAL, "path too long: %s", final);
    qt_path_dirname(parent, sizeof parent, final);
    int moved = 0;
    if (qt_path_exists(final)) {
        qt_rm_rf(old);
        if (rename(final, old) != 0)
            return QT_ERR(QT_EIO, "cannot move the old %s aside: %s", final, strerror(errno));
        moved = 1;
    }
    if (rename(tmp, final) != 0) {
        int e = errno;
        if (moved && rename(old, final) != 0)
            return QT_ERR(QT_EIO, "cannot rename %s to %s: %s; the previous copy is kept as %s", tmp, final,
                          strerror(e), old);
        return QT_ERR(QT_EIO, "cannot rename %s to %s: %s", tmp, final, strerror(e));
    }
    int rc = qt_fsync_dir(parent);
    if (rc == QT_OK && moved) qt_rm_rf(old);
    return rc;
}

int qt_path_join(char *out, size_t cap, const char *dir, const char *name) {
    int n;
    if (name[0] == '/' || !dir || !dir[0]) n = snprintf(out, cap, "%s", name);
    else n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return QT_ERR(QT_EINVAL, "path too long: %s/%s", dir, name);
    return QT_OK;
}

void qt_path_dirname(char *out, size_t cap, const char *path) {
    const char *slash = strrchr(path, '/');
    if (!slash) { snprintf(out, cap, "."); return; }
    size_t n = (size_t)(slash - path);
    if (n == 0) n = 1; /* "/x" -> "/" */
    if (n >= cap) n = cap - 1;
    memcpy(out, path, n);
    out[n] = 0;
}

int qt_copy_file(const char *src, const char *dst) {
    /* a FIFO would block for ever, /dev/zero fill the disk */
    FILE *in = qt_fopen_regular(src, "the file to copy");
    if (!in) return qt_error_code();
    qt_atomic_file af;
    int rc = qt_atomic_open(&af, dst);
    if (rc != QT_OK) { fclose(in); return rc; }
    char buf[1 << 16];
    size_t n;
    while (rc == QT_OK && (n = fread(buf, 1, sizeof buf, in)) > 0) rc = qt_atomic_write(&af, buf, n);
    if (rc == QT_OK && ferror(in)) rc = QT_ERR(QT_EIO, "cannot read %s", src);
    fclose(in);
    if (rc != QT_OK) { qt_atomic_abort(&af); return rc; }
    return qt_atomic_commit(&af);
}

int64_t qt_free_disk_bytes(const char *path) {
    struct statvfs s;
    if (statvfs(path, &s) != 0) return -1;
    return (int64_t)s.f_bavail * (int64_t)s.f_frsize;
}

uint64_t qt_hash64(const void *data, size_t n, uint64_t seed) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ull ^ seed;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}
