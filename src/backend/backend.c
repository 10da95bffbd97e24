/* The registry of compiled-in backends (backend.h). Adding one: a folder
 * src/backend/<name>/ with its table, open function and descriptor
 * (backend_impl.h), and a row here. */
#include "backend/backend.h"

#include <stdlib.h>
#include <string.h>

#include "backend/backend_impl.h"
#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/op_precision.h"
#include "backend/guard/backend_guard.h"
#include "backend/cuda/backend_cuda.h"
#include "backend/ascend/backend_ascend.h"
#include "core/error.h"
#include "core/mem.h"

static int cpu_open(int index, qt_backend **out) {
    (void)index;
    qt_backend *be = qt_malloc(sizeof *be, "cpu backend");
    if (!be) return QT_ENOMEM;
    *be = qt_backend_cpu_i;
    *out = be;
    return QT_OK;
}

static const qt_backend_desc *cpu_desc(void) { return &qt_cpu_desc; }

static int guard_open(int index, qt_backend **out) {
    (void)index;
    return qt_backend_guard_open(out);
}

static const struct {
    const char *name;
    int (*open)(int index, qt_backend **out); /* index: the device (cuda's GPU); < 0 the default */
    const qt_backend_desc *(*desc)(void);
} backends[] = {
    {"cpu", cpu_open, cpu_desc},
    {"guard", guard_open, qt_backend_guard_desc},
    {"cuda", qt_backend_cuda_open, qt_backend_cuda_desc}, /* loads its module on open (cuda/loader.c) */
    {"npu", qt_backend_ascend_open, qt_backend_ascend_desc}, /* opens CANN on open (ascend/loader.c) */
};
enum { N_BACKENDS = sizeof backends / sizeof backends[0] };

const char *qt_backend_default_name(void) {
    const char *e = getenv("QTUNE_BACKEND");
    return e && *e ? e : "cpu";
}

const qt_backend_desc *qt_backend_desc_of(const char *name) {
    if (!name) name = qt_backend_default_name();
    for (int i = 0; i < N_BACKENDS; i++)
        if (!strcmp(backends[i].name, name)) return backends[i].desc();
    return NULL;
}

int qt_backend_open_index(const char *name, int index, qt_backend **out) {
    *out = NULL;
    if (!name) name = qt_backend_default_name();
    for (int i = 0; i < N_BACKENDS; i++) {
        if (strcmp(backends[i].name, name)) continue;
        int rc = backends[i].open(index, out);
        const char *prof = getenv("QTUNE_PROFILE"); /* every op timed, a table at close (profile.c) */
        if (rc != QT_OK || !prof || !*prof || !strcmp(prof, "0")) return rc;
        qt_backend *in = *out;
        rc = qt_backend_profile_wrap(in, out);
        if (rc != QT_OK) qt_backend_close(in), *out = NULL;
        return rc;
    }
    return QT_ERR(QT_EINVAL, "backend \"%s\" is not compiled in (QTUNE_BACKEND); use cpu, guard, cuda or npu", name);
}

int qt_backend_open(const char *name, qt_backend **out) { return qt_backend_open_index(name, -1, out); }

void qt_backend_close(qt_backend *be) {
    if (be && be->close) be->close(be);
}

const char *qt_backend_empty_slot(const qt_backend *t) {
    if (!t->desc) return "desc";
#define X(name) \
    if (!t->name) return #name;
    QT_BACKEND_SLOTS(X)
#undef X
    return NULL;
}

size_t qt_backend_host_runtime_bytes(void) { return qt_cpu_runtime_bytes(); }

int qt_backend_bf16_arith(const char *name) {
    if (!name) name = qt_backend_default_name();
    /* the module is built for sm_90 (CMAKE_CUDA_ARCHITECTURES), whose tensor
     * cores do bf16; cpu and guard both run the CPU's kernels */
    if (!strcmp(name, "cuda")) return 1;
    /* npu: only an open backend knows its card; it refuses bf16 at its
     * first cast on a card without it, with a sentence naming the card
     * (backend_ascend.c: Ascend910B and Ascend910_93 have it) */
    if (!strcmp(name, "npu")) return 1;
    return op_cpu_has_bf16();
}
