/* Loading the CUDA backend: the kernels live in a module, libqtune_cuda.so,
 * opened with dlopen the first time a run asks for the GPU. Linking the CUDA
 * runtime and cuBLAS into qtune itself cost every command 3.3 s and 220 MB
 * at start (measured: `qtune --help` 0.12 s / 6.5 MB without, 3.3 s / 225 MB
 * with), which no CPU run should pay, and a machine without the CUDA
 * libraries could not start qtune at all.
 *
 * Where the module is looked for, first found wins: $QTUNE_CUDA_MODULE; next
 * to the executable; ../lib beside it (the installed layout); the build
 * tree's lib/ (tests run from there). */
#define _GNU_SOURCE
#include "backend/cuda/backend_cuda.h"

#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "qtune_config.h"

typedef struct {
    int (*error_at)(int code, const char *file, int line, const char *fmt, ...);
    const qt_backend_desc *desc;
} cuda_host; /* the module's qt_cuda_host (cuda_internal.h), field for field */

static void *module;
static char tried[2048]; /* where it was looked for, for the error */

static void *load_module(void) {
    if (module) return module;
    char exe[PATH_MAX] = "", cand[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    char *dir = n > 0 ? dirname(exe) : ".";
    const char *env = getenv("QTUNE_CUDA_MODULE");
    const char *paths[4] = {env && *env ? env : NULL, NULL, NULL, QTUNE_CUDA_MODULE_BUILD};
    char p1[PATH_MAX + 32], p2[PATH_MAX + 32];
    snprintf(p1, sizeof p1, "%s/libqtune_cuda.so", dir);
    snprintf(p2, sizeof p2, "%s/../lib/libqtune_cuda.so", dir);
    paths[1] = p1, paths[2] = p2;
    tried[0] = 0;
    for (int i = 0; i < 4; i++) {
        if (!paths[i] || !*paths[i]) continue;
        module = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (module) return module;
        snprintf(cand, sizeof cand, "%s%s (%s)", tried[0] ? "; " : "", paths[i], dlerror());
        strncat(tried, cand, sizeof tried - strlen(tried) - 1);
    }
    return NULL;
}

int qt_backend_cuda_open(qt_backend **out) {
    *out = NULL;
    if (!load_module())
        return QT_ERR(QT_EUNSUPPORTED,
                      "the CUDA backend is not available: libqtune_cuda.so could not be loaded (%s); build qtune "
                      "where nvcc, cuBLAS and NCCL are installed, or set QTUNE_CUDA_MODULE to the module's path",
                      tried[0] ? tried : "this build has none: nvcc was not found when it was configured");
    int (*open_fn)(const cuda_host *, qt_backend **) =
        (int (*)(const cuda_host *, qt_backend **))dlsym(module, "qt_cuda_module_open");
    if (!open_fn) return QT_ERR(QT_EUNSUPPORTED, "libqtune_cuda.so has no qt_cuda_module_open: a module from "
                                "another qtune version; rebuild qtune");
    cuda_host h = {qt_error_at, qt_backend_cuda_desc()};
    return open_fn(&h, out);
}

int qt_cuda_device_count(void) {
    if (access("/dev/nvidiactl", F_OK) != 0 && !getenv("QTUNE_CUDA_MODULE")) return 0; /* no driver: skip the load */
    if (!load_module()) return 0;
    int (*fn)(void) = (int (*)(void))dlsym(module, "qt_cuda_module_device_count");
    return fn ? fn() : 0;
}

void qt_cuda_describe(char *buf, size_t cap) {
    if (!cap) return;
    buf[0] = 0;
    if (!load_module()) {
        snprintf(buf, cap, "CUDA backend: not available (%s)\n",
                 tried[0] ? tried : "this build has none: nvcc was not found when it was configured");
        return;
    }
    void (*fn)(char *, size_t) = (void (*)(char *, size_t))dlsym(module, "qt_cuda_module_describe");
    if (fn) fn(buf, cap);
}
