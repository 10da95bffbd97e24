/* Helpers shared by the data tests: temporary folders and JSONL files. */
#ifndef QT_TEST_DATA_COMMON_H
#define QT_TEST_DATA_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/fs.h"

static char tdir[64];

/* In /dev/shm when there is one: the cache is fsync'd on every write, which
 * costs nothing in memory and a lot on a busy disk. */
static void make_tmpdir(void) {
    snprintf(tdir, sizeof tdir, "/dev/shm/qtune_data_XXXXXX");
    if (mkdtemp(tdir)) return;
    snprintf(tdir, sizeof tdir, "/tmp/qtune_data_XXXXXX");
    assert_non_null(mkdtemp(tdir));
}

static void remove_tmpdir(void) { qt_rm_rf(tdir); }

/* Writes text to tdir/name and returns the path (static buffer per slot). */
static const char *write_tmp(const char *name, const char *text) {
    static char paths[8][512];
    static int slot;
    char *p = paths[slot++ % 8];
    snprintf(p, 512, "%s/%s", tdir, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
    return p;
}

#endif
