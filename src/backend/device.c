/* Resolving "device" (device.h): a value's spelling, then what this machine
 * and this rank make of it. The CUDA module is probed only when a value can
 * use a GPU, and its load (seconds) is skipped where no module was built or
 * no NVIDIA driver is present (cuda/loader.c). */
#include "backend/device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/ascend/backend_ascend.h"
#include "backend/cuda/backend_cuda.h"
#include "backend/device_default.h"
#include "core/error.h"

enum { DEV_AUTO, DEV_CPU, DEV_CUDA, DEV_NPU };
#define DEV_MAX_INDEX 1023

/* kind and N (-1 when the value names no GPU); -1 when not a device value */
static int parse(const char *spec, int *n) {
    *n = -1;
    if (!spec || !strcmp(spec, "auto")) return DEV_AUTO;
    if (!strcmp(spec, "cpu")) return DEV_CPU;
    if (!strcmp(spec, "cuda")) return DEV_CUDA;
    if (!strcmp(spec, "npu")) return DEV_NPU;
    int kind = !strncmp(spec, "cuda:", 5) ? DEV_CUDA : !strncmp(spec, "npu:", 4) ? DEV_NPU : -1;
    const char *num = kind == DEV_CUDA ? spec + 5 : spec + 4;
    if (kind < 0 || !*num) return -1;
    long v = 0;
    for (const char *p = num; *p; p++) {
        if (*p < '0' || *p > '9' || v > DEV_MAX_INDEX) return -1;
        v = v * 10 + (*p - '0');
    }
    if (v > DEV_MAX_INDEX) return -1;
    *n = (int)v;
    return kind;
}

int qt_device_check(const char *spec, const char *where) {
    int n;
    if (parse(spec, &n) < 0)
        return QT_ERR(QT_EINVAL, "%s \"%s\" is not a device; use \"auto\" (a GPU, else an Ascend NPU, else the CPU), "
                      "\"cpu\", \"cuda\", \"cuda:N\" (GPU N, from 0), \"npu\" or \"npu:N\" (Ascend NPU N)", where, spec);
    return QT_OK;
}

const char *qt_device_desc_name(const char *spec) {
    int n;
    switch (parse(spec, &n)) {
    case DEV_CPU: return "cpu";
    case DEV_CUDA: return "cuda";
    case DEV_NPU: return "npu";
    default: return NULL;
    }
}

/* a GPU for "cuda" / "cuda:N" among count visible ones */
static int pick_gpu(int n, int count, const char *who, int *index) {
    if (n < 0) return qt_device_default_cuda_index(count, index);
    if (n >= count)
        return QT_ERR(QT_EINVAL, "%s names GPU %d, but %d GPU%s %s visible (numbered from 0); use \"cuda:0\"%s or "
                      "\"cuda\"", who, n, count, count == 1 ? "" : "s", count == 1 ? "is" : "are",
                      count > 1 ? " to a lower number" : "");
    *index = n;
    return QT_OK;
}

/* "npu" without a number: the card of the launcher's local rank, so ranks on
 * one host each take their own (HCCL joins one rank per card); -1 (card 0)
 * without a launcher. */
static int npu_default_index(int n) {
    const char *r = qt_device_local_rank();
    return n >= 0 ? n : r ? atoi(r) : -1;
}

int qt_device_resolve(const char *spec, const char *where, qt_device *out) {
    memset(out, 0, sizeof *out);
    out->index = -1;
    QT_TRY(qt_device_check(spec, where));
    int n, kind = parse(spec, &n);
    const char *asked = spec ? spec : "auto";
    char who[160]; /* what asked for a GPU, for the errors */
    snprintf(who, sizeof who, "%s \"%s\"", where, asked);
    const char *env = getenv("QTUNE_BACKEND");
    if (env && *env) {
        const qt_backend_desc *d = qt_backend_desc_of(env);
        if (!d) return QT_ERR(QT_EINVAL, "backend \"%s\" is not compiled in (QTUNE_BACKEND); use cpu, guard or cuda, "
                              "or unset QTUNE_BACKEND to use %s", env, who);
        out->backend = d->name;
        snprintf(out->note, sizeof out->note, "QTUNE_BACKEND=%s overrides %s", env, who);
        if (!strcmp(d->name, "npu")) out->index = npu_default_index(n);
        if (strcmp(d->name, "cuda")) return QT_OK;
        kind = DEV_CUDA; /* the GPU is chosen as for "cuda" (a "cuda:N" keeps its N) */
        snprintf(who, sizeof who, "QTUNE_BACKEND=cuda");
    }
    /* several ranks on this host would all open the one GPU named */
    if (n >= 0 && kind == DEV_CUDA && qt_device_local_size() > 1)
        return QT_ERR(QT_EINVAL, "%s names one GPU, but the launcher starts %d ranks on this host, which would all "
                      "share it; use \"cuda\" (each rank takes the GPU of its local rank) and choose the GPUs with "
                      "CUDA_VISIBLE_DEVICES", who, qt_device_local_size());
    if (kind == DEV_CPU) {
        out->backend = "cpu";
        return QT_OK;
    }
    if (kind == DEV_NPU) { /* CANN's libraries here, before the run starts; opening it says when no card is */
        if (qt_ascend_library_check() != QT_OK) {
            char why[1024];
            snprintf(why, sizeof why, "%s", qt_error_message());
            int code = qt_error_code();
            qt_error_clear();
            return QT_ERR(code, "%s: %s", who, why);
        }
        out->backend = "npu";
        out->index = npu_default_index(n);
        return QT_OK;
    }
    char why[512];
    int count = qt_cuda_probe(why, sizeof why);
    if (count < 0) return QT_ERR(QT_EINVAL, "%s", why); /* a module the user named: never skipped for the CPU */
    if (count <= 0 && kind == DEV_AUTO) { /* then an Ascend NPU: CANN opened quietly, absent in a few ms */
        char npu_why[512];
        int npus = qt_ascend_probe(npu_why, sizeof npu_why);
        if (npus > 0) {
            out->backend = "npu";
            out->index = npu_default_index(-1);
            snprintf(out->note, sizeof out->note, "device auto -> npu:%d: no CUDA GPU, %d Ascend NPU%s visible%s",
                     out->index < 0 ? 0 : out->index, npus, npus == 1 ? "" : "s",
                     qt_device_local_rank() ? ", each rank takes the NPU of its local rank" : "");
            return QT_OK;
        }
        out->backend = "cpu";
        snprintf(out->note, sizeof out->note, "device auto -> cpu: %s", why);
        return QT_OK;
    }
    if (count <= 0)
        return QT_ERR(QT_EUNSUPPORTED, "%s asks for a GPU, but %s; use \"cpu\" (or \"auto\", which takes a GPU only "
                      "where one is visible), or run `qtune doctor` to see what this machine has", who, why);
    QT_TRY(pick_gpu(n, count, who, &out->index));
    out->backend = "cuda";
    if (kind == DEV_AUTO && !out->note[0])
        snprintf(out->note, sizeof out->note, "device auto -> cuda:%d: %d GPU%s visible%s", out->index, count,
                 count == 1 ? "" : "s", qt_device_local_rank() ? ", each rank takes the GPU of its local rank" : "");
    return QT_OK;
}

void qt_device_label(const qt_device *d, int threads, char *buf, size_t cap) {
    if (!strcmp(d->backend, "cuda")) {
        char name[256];
        qt_cuda_device_name(d->index, name, sizeof name);
        if (name[0]) snprintf(buf, cap, "cuda:%d (%s)", d->index, name);
        else snprintf(buf, cap, "cuda:%d", d->index);
    } else if (!strcmp(d->backend, "npu")) {
        snprintf(buf, cap, "npu:%d", d->index < 0 ? 0 : d->index);
    } else if (!strcmp(d->backend, "guard")) {
        snprintf(buf, cap, "guard (the CPU's kernels, %d thread%s)", threads, threads == 1 ? "" : "s");
    } else {
        snprintf(buf, cap, "%s (%d thread%s)", d->backend, threads, threads == 1 ? "" : "s");
    }
}
