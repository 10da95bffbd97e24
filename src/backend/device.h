/* Which device a run uses: the job file's "device" key and the --device flag
 * of eval, generate and merge take the same values (docs/backends.md):
 *   auto     a GPU when the CUDA module loads and one is visible, else the CPU
 *   cpu      the CPU backend
 *   cuda     a GPU: QTUNE_CUDA_DEVICE when set, else the launcher's local rank
 *            modulo the GPUs visible (under mpirun each rank takes the GPU of
 *            its local rank), else GPU 0; an error when none is visible
 *   cuda:N   GPU N; an error when fewer are visible, and under a launcher
 *            that starts several ranks on this host (they would share it)
 *   npu, npu:N  an Ascend NPU (NPU 0, or N) through CANN (backend/ascend/):
 *            written against CANN's published API, never run on a card;
 *            opening it says when CANN or a card is missing ("auto" never
 *            picks it yet)
 * QTUNE_BACKEND, when set, wins over all of these (the test hook: guard runs
 * the suites with device memory the host cannot touch); the note says so. */
#ifndef QT_BACKEND_DEVICE_H
#define QT_BACKEND_DEVICE_H

#include <stddef.h>
#include <stdio.h>

typedef struct {
    const char *backend; /* the registry name qt_backend_open_index takes: "cpu", "guard", "cuda", "npu" */
    int index;           /* cuda: the GPU, 0 .. count-1; -1 for the others */
    char note[640];      /* what auto became and why, or that QTUNE_BACKEND overrides; "" when nothing */
} qt_device;

/* Checks the spelling of a device value (NULL is "auto") without looking at
 * the machine. where names its source and comes before the quoted value in
 * errors ("job.json: \"device\":", "--device"). QT_EINVAL with a sentence
 * when it is not one of the above. */
int qt_device_check(const char *spec, const char *where);

/* The backend whose descriptor a plan for spec sizes, without the device
 * present: "cpu", "cuda", "npu", or NULL for "auto" (the caller resolves it). */
const char *qt_device_desc_name(const char *spec);

/* Resolves spec on this machine (and this rank). Errors (QT_EINVAL,
 * QT_EUNSUPPORTED) say what was asked, what the machine has and what to
 * do; "auto" never fails for want of a GPU. */
int qt_device_resolve(const char *spec, const char *where, qt_device *out);

/* What the NVIDIA driver itself reports, without the CUDA module
 * (cuda/driver.c): the GPUs it sees (0 in a build without CUDA or without a
 * driver), and `qtune doctor`'s cuda lines (driver and runtime versions,
 * each GPU's name and memory) to f. */
int qt_cuda_driver_gpu_count(void);
void qt_cuda_driver_report(FILE *f);

/* "cuda:0 (NVIDIA H200)", "cpu (16 threads)", "guard (CPU kernels, 16 threads)"
 * for the run line; threads is the OpenMP thread count. */
void qt_device_label(const qt_device *d, int threads, char *buf, size_t cap);

#endif
