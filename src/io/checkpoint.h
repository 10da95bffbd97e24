/* checkpoint-STEP folders inside an output folder.
 *
 * A checkpoint is written into checkpoint-STEP.tmp/, every file fsync'd, the
 * folder fsync'd, then renamed to checkpoint-STEP/ and the parent fsync'd: a
 * folder named checkpoint-STEP is complete by construction, and a write cut
 * short (crash, SIGKILL, full disk) leaves only a .tmp folder that the next
 * run removes. What goes inside is the caller's business (the trainer writes
 * trainer_state.json last; see docs/training.md). */
#ifndef QT_IO_CHECKPOINT_H
#define QT_IO_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#define CKPT_PATH_MAX 4096
#define CKPT_STATE_FILE "trainer_state.json"

typedef struct {
    char output_dir[CKPT_PATH_MAX];
    char dir[CKPT_PATH_MAX];   /* checkpoint-STEP.tmp: write the files here */
    char final[CKPT_PATH_MAX]; /* checkpoint-STEP */
    long step;
} ckpt_writer;

/* Fills w's names for output_dir and step without touching the disk: every
 * rank of a run derives the same .tmp folder from the same job and step. */
int ckpt_names(ckpt_writer *w, const char *output_dir, long step);
/* ckpt_names, then creates output_dir/checkpoint-STEP.tmp (removing a stale one). */
int ckpt_begin(ckpt_writer *w, const char *output_dir, long step);
/* fsyncs every file and the folder, replaces any old checkpoint-STEP, renames. */
int ckpt_commit(ckpt_writer *w);
/* Removes the .tmp folder. */
void ckpt_abort(ckpt_writer *w);

/* The newest complete checkpoint (holds CKPT_STATE_FILE) in output_dir: its
 * path and step; *step = -1 (and QT_OK) when there is none. */
int ckpt_latest(const char *output_dir, char *path, size_t cap, long *step);
/* Keeps the newest `keep` complete checkpoints (keep 0: all) and removes
 * leftover checkpoint-*.tmp folders. `protect` (a step, or -1) is never removed. */
int ckpt_prune(const char *output_dir, int keep, long protect);
/* Parses "checkpoint-123" (a folder name, no path); -1 when it is not one. */
long ckpt_step_of(const char *name);

/* Checksums: CKPT_SUMS_FILE lists the SHA-256 of every other file of a
 * checkpoint (and of final/), one "HEX  NAME" line each in sha256sum's
 * format, so `sha256sum -c checksums.sha256` inside the folder checks it too. */
#define CKPT_SUMS_FILE "checksums.sha256"

/* Hashes every regular file of dir (not dot files, not CKPT_SUMS_FILE itself)
 * and writes dir/CKPT_SUMS_FILE atomically. */
int ckpt_write_checksums(const char *dir);
/* Checks every file dir/CKPT_SUMS_FILE lists. *present = 0 (and QT_OK) when
 * the folder has no such file (written before qtune recorded checksums).
 * A missing file, one that is not a regular file (a FIFO, a link to a
 * device) or a different hash is QT_EFORMAT naming the file; a stop request
 * (qt_cancel_requested) ends the reading with QT_EINTERRUPTED. The regular
 * files of dir that the list leaves out (an empty or edited list) go into
 * unlisted (cap bytes, ", "-separated; "" when every file is listed): they
 * are not checked, and the caller says so. */
int ckpt_verify_checksums(const char *dir, int *present, char *unlisted, size_t cap);
/* The newest complete checkpoint of output_dir older than `step` (path and
 * its step), *prev = -1 when there is none: what to resume from instead of
 * a damaged one. */
int ckpt_previous(const char *output_dir, long step, char *path, size_t cap, long *prev);

/* A flat fp32 array as a one-tensor safetensors file, and back. Reading checks
 * the name, dtype and length and names the file when they differ. */
int ckpt_write_f32(const char *path, const char *name, const float *data, size_t n);
int ckpt_read_f32(const char *path, const char *name, float *data, size_t n);

#endif
