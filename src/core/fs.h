/* Files and folders. Everything qtune writes that a user keeps (models,
 * adapters, checkpoints, caches) goes through qt_atomic_*: written under a
 * temporary name in the same folder, fsync'd, then renamed, so an interrupted
 * or failed write never replaces a good file. */
#ifndef QT_CORE_FS_H
#define QT_CORE_FS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Opens path for reading when it is a regular file; a FIFO, a device
 * (/dev/zero, /dev/urandom), a socket or a folder is refused at once with one
 * sentence ("WHAT PATH is a FIFO (named pipe), not a regular file; ..."),
 * without blocking on a FIFO or reading forever from a device. `what` names
 * the file's role, e.g. "the data file". */
int qt_open_regular(const char *path, const char *what, int *fd);
/* What a stat mode is, for such a sentence: "a folder", "a FIFO (named
 * pipe)", "a character device (like /dev/zero)", ... */
const char *qt_file_kind(unsigned mode);
/* The same as a stdio stream; NULL with the error set. */
FILE *qt_fopen_regular(const char *path, const char *what);

/* Reads a whole file into a NUL-terminated buffer (qt_free it). Refuses files
 * larger than max_bytes, and files that are not regular files, with an error
 * that names the file. */
int qt_read_file(const char *path, size_t max_bytes, char **out, size_t *len);

/* Atomic single-file write: `path.tmp.PID` then rename. */
typedef struct {
    FILE *f;
    char *path;
    char *tmp;
} qt_atomic_file;
int qt_atomic_open(qt_atomic_file *af, const char *path);
int qt_atomic_write(qt_atomic_file *af, const void *buf, size_t n);
int qt_atomic_commit(qt_atomic_file *af); /* flush, fsync, rename; always releases */
void qt_atomic_abort(qt_atomic_file *af); /* remove the temporary; always releases */
int qt_write_file_atomic(const char *path, const void *buf, size_t n);

int qt_mkdir_p(const char *path);
/* The highest of path and its parent folders that does not exist yet ("" when
 * path exists): the first folder qt_mkdir_p(path) will create. Asked before
 * creating anything, it lets a command that fails remove the folders it made
 * (qt_rmdir_made) and nothing that was there before. */
int qt_path_missing_top(const char *path, char *top, size_t cap);
/* Removes the folder path, then each parent up to and including top (a
 * prefix of path, from qt_path_missing_top), each only while it is empty: a
 * missing one is passed over, one that is not empty (or cannot be removed)
 * stops it. Only rmdir and string copies: async-signal-safe. */
void qt_rmdir_made(const char *path, const char *top);
int qt_rm_rf(const char *path);
/* A writer killed before its rename (kill -9, a power cut) leaves its
 * temporary, named PATH.tmp.PID: qt_atomic_open's files, merge's staging
 * folders. qt_tmp_pid is the PID of such a file name for the file name base
 * (0 when name is not one); qt_remove_dead_tmps removes the temporaries of
 * path whose process no longer exists on this host (a live one, a concurrent
 * writer, is left) and counts them in *removed. A run that takes its output
 * folder under a lock removes its own kinds (train/outdir.c); export and merge,
 * which hold no lock, call this before they write. */
long qt_tmp_pid(const char *name, const char *base);
int qt_remove_dead_tmps(const char *path, int *removed);
int qt_path_exists(const char *path);
int qt_is_dir(const char *path);
int qt_fsync_dir(const char *dir);
/* Replaces the folder `final` by the complete folder `tmp`, keeping one
 * complete copy at every instant: an existing `final` is moved to final.old,
 * tmp is renamed to final, and .old is removed; if the second rename fails,
 * .old is renamed back. The parent folder is fsync'd. tmp is left to the
 * caller on failure. */
int qt_dir_replace(const char *tmp, const char *final);
/* Joins dir and name into out (size cap); QT_EINVAL if it does not fit. */
int qt_path_join(char *out, size_t cap, const char *dir, const char *name);
/* Folder part of a path ("." when none). */
void qt_path_dirname(char *out, size_t cap, const char *path);
/* Copies the regular file src to dst (atomically); anything else at src (a
 * FIFO, a device) is refused as qt_open_regular refuses it. */
int qt_copy_file(const char *src, const char *dst);
/* Free bytes on the filesystem holding path, or -1. */
int64_t qt_free_disk_bytes(const char *path);

/* FNV-1a 64-bit, for cache keys and quick content hashes (not cryptographic). */
uint64_t qt_hash64(const void *data, size_t n, uint64_t seed);

#endif
