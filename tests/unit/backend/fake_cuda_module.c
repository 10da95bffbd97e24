/* A stand-in for libqtune_cuda.so, loaded through QTUNE_CUDA_MODULE, so the
 * device selection (src/backend/device.c, cuda/loader.c) is tested on
 * machines without a GPU: it reports QTUNE_FAKE_GPUS GPUs (default 2) named
 * "Fake GPU N", and opening one fails with a sentence that names the GPU
 * asked for, which is how the tests see which GPU a command chose. It runs
 * nothing. */
#include <stdio.h>
#include <stdlib.h>

#include "backend/backend.h"
#include "core/error.h"

typedef struct {
    int (*error_at)(int code, const char *file, int line, const char *fmt, ...);
    const qt_backend_desc *desc;
} cuda_host; /* cuda_internal.h's qt_cuda_host, field for field */

static int gpus(void) {
    const char *e = getenv("QTUNE_FAKE_GPUS");
    return e && *e ? atoi(e) : 2;
}

__attribute__((visibility("default"))) int qt_cuda_module_device_count(void) { return gpus(); }

__attribute__((visibility("default"))) void qt_cuda_module_device_name(int dev, char *buf, size_t cap) {
    snprintf(buf, cap, "Fake GPU %d", dev);
}

__attribute__((visibility("default"))) int qt_cuda_module_open_device(const cuda_host *host, int dev,
                                                                       qt_backend **out) {
    *out = NULL;
    return host->error_at(QT_EUNSUPPORTED, __FILE__, __LINE__,
                          "fake CUDA module: asked to open GPU %d of %d; it runs nothing (a test double)", dev,
                          gpus());
}
