#include "fuzz_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

const char *fuzz_temp_dir(void) {
    static char dir[64];
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/qtune-fuzz-%d", (int)getpid());
        char cmd[96];
        snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
        if (system(cmd) != 0) abort();
    }
    return dir;
}

const char *fuzz_write_temp(const uint8_t *data, size_t size, const char *suffix) {
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", fuzz_temp_dir(), suffix);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);
    return path;
}
