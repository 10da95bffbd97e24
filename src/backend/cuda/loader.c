/* Loading the CUDA backend: the kernels live in a module, libqtune_cuda.so,
 * opened with dlopen the first time a run asks for the GPU. Linking the CUDA
 * runtime and cuBLAS into qtune itself would cost every command seconds and
 * hundreds of MB at start (bench/RESULTS.md), which no CPU run should pay,
 * and a machine without the CUDA libraries could not start qtune at all.
 *
 * Where the module is looked for, first found wins: next to the executable;
 * ../lib beside it (the installed layout); the build tree's lib/ (tests run
 * from there). A path the user names in $QTUNE_CUDA_MODULE is the only place
 * looked: it loads or is the error, never skipped in silence for another
 * module (a typo would otherwise load the build tree's, or blame the
 * driver). */
#define _GNU_SOURCE
#include "backend/cuda/backend_cuda.h"

#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/device_default.h"
#include "core/error.h"
#include "qtune_config.h"

typedef struct {
    int (*error_at)(int code, const char *file, int line, const char *fmt, ...);
    const qt_backend_desc *desc;
} cuda_host; /* the module's qt_cuda_host (cuda_internal.h), field for field */

static void *module;
static char tried[2048]; /* where it was looked for, for the error */

/* the module path the user named, NULL when none */
static const char *user_module(void) {
    const char *env = getenv("QTUNE_CUDA_MODULE");
    return env && *env ? env : NULL;
}

/* The places the module is looked for, first found wins; their count. */
static int module_paths(const char *paths[3], char p1[], char p2[], size_t cap) {
    if (user_module()) {
        paths[0] = user_module();
        return 1;
    }
    char exe[PATH_MAX] = "";
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) exe[n] = 0;
    char *dir = n > 0 ? dirname(exe) : ".";
    snprintf(p1, cap, "%s/libqtune_cuda.so", dir);
    snprintf(p2, cap, "%s/../lib/libqtune_cuda.so", dir);
    paths[0] = p1, paths[1] = p2;
    paths[2] = QTUNE_CUDA_MODULE_BUILD;
    return 3;
}

/* The sentence for a module the user named that did not load. */
static void user_module_failed(char *buf, size_t cap) {
    snprintf(buf, cap, "QTUNE_CUDA_MODULE names a module that could not be loaded: %s; correct the path, or unset "
             "QTUNE_CUDA_MODULE to use the module qtune finds itself", tried);
}

static void *load_module(void) {
    if (module) return module;
    char cand[PATH_MAX + 64], p1[PATH_MAX + 32], p2[PATH_MAX + 32];
    const char *paths[3];
    int n = module_paths(paths, p1, p2, sizeof p1);
    tried[0] = 0;
    for (int i = 0; i < n; i++) {
        if (!paths[i] || !*paths[i]) continue;
        module = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (module) return module;
        snprintf(cand, sizeof cand, "%s%s (%s)", tried[0] ? "; " : "", paths[i], dlerror());
        strncat(tried, cand, sizeof tried - strlen(tried) - 1);
    }
    return NULL;
}

/* 1 when a module file is where load_module looks (without loading it:
 * loading costs seconds) */
static int module_present(void) {
    char p1[PATH_MAX + 32], p2[PATH_MAX + 32];
    const char *paths[3];
    int n = module_paths(paths, p1, p2, sizeof p1);
    for (int i = 0; i < n; i++)
        if (paths[i] && *paths[i] && access(paths[i], F_OK) == 0) return 1;
    return 0;
}

int qt_backend_cuda_open(int index, qt_backend **out) {
    *out = NULL;
    if (!load_module() && user_module()) {
        char why[sizeof tried + 256];
        user_module_failed(why, sizeof why);
        return QT_ERR(QT_EINVAL, "%s", why);
    }
    if (!module)
        return QT_ERR(QT_EUNSUPPORTED,
                      "the CUDA backend is not available: libqtune_cuda.so could not be loaded (%s); build qtune "
                      "where nvcc, cuBLAS and NCCL are installed, or set QTUNE_CUDA_MODULE to the module's path",
                      tried[0] ? tried : "this build has none: nvcc was not found when it was configured");
    int (*open_fn)(const cuda_host *, int, qt_backend **) =
        (int (*)(const cuda_host *, int, qt_backend **))dlsym(module, "qt_cuda_module_open_device");
    int (*count_fn)(void) = (int (*)(void))dlsym(module, "qt_cuda_module_device_count");
    if (!open_fn || !count_fn)
        return QT_ERR(QT_EUNSUPPORTED, "libqtune_cuda.so has no qt_cuda_module_open_device: a module from "
                      "another qtune version; rebuild qtune");
    if (index < 0) { /* the process's GPU: device_default.c's rule */
        int count = count_fn();
        if (count > 0) QT_TRY(qt_device_default_cuda_index(count, &index));
    }
    cuda_host h = {qt_error_at, qt_backend_cuda_desc()};
    return open_fn(&h, index, out);
}

int qt_cuda_device_count(void) {
    if (access("/dev/nvidiactl", F_OK) != 0 && !user_module()) return 0; /* no driver: skip the load */
    if (!load_module()) return 0;
    int (*fn)(void) = (int (*)(void))dlsym(module, "qt_cuda_module_device_count");
    return fn ? fn() : 0;
}

int qt_cuda_probe(char *why, size_t cap) {
    if (cap) why[0] = 0;
    if (user_module() && !load_module()) {
        user_module_failed(why, cap);
        return -1;
    }
    if (!module && !module_present()) {
        snprintf(why, cap, QTUNE_CUDA_MODULE_BUILD[0]
                               ? "libqtune_cuda.so is not where qtune looks for it (next to qtune, ../lib, the build "
                                 "tree; or set $QTUNE_CUDA_MODULE to its path)"
                               : "libqtune_cuda.so was not built (nvcc was not found when this qtune was configured)");
        return 0;
    }
    if (!module && access("/dev/nvidiactl", F_OK) != 0) {
        snprintf(why, cap, "no CUDA GPU is visible (no NVIDIA driver: /dev/nvidiactl is absent)");
        return 0;
    }
    if (!load_module()) {
        snprintf(why, cap, "libqtune_cuda.so could not be loaded (%s)", tried);
        return 0;
    }
    int n = qt_cuda_device_count();
    if (n <= 0) snprintf(why, cap, "no CUDA GPU is visible (the driver reports none; CUDA_VISIBLE_DEVICES may hide them)");
    return n > 0 ? n : 0;
}

void qt_cuda_device_name(int index, char *buf, size_t cap) {
    if (!cap) return;
    buf[0] = 0;
    if (!module) return; /* only asked after a probe found GPUs */
    void (*fn)(int, char *, size_t) = (void (*)(int, char *, size_t))dlsym(module, "qt_cuda_module_device_name");
    if (fn) fn(index, buf, cap);
}
