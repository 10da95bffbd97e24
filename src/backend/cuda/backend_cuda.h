/* The CUDA backend (backend.h on one NVIDIA GPU through the CUDA runtime and
 * cuBLAS), as the registry (backend.c) sees it: the kernels are a module
 * loaded on first use (loader.c), the descriptor is plain C (desc.c) and
 * always there. The module is compiled where nvcc, cuBLAS and NCCL are
 * found (docs/backends.md says what has run on a GPU). */
#ifndef QT_BACKEND_CUDA_H
#define QT_BACKEND_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif
#include "backend/backend.h"

/* Loads the module and opens GPU index (< 0: the process's default,
 * backend/device_default.h qt_device_default_cuda_index). QT_EUNSUPPORTED with a
 * sentence when the module, a driver or a GPU is missing; QT_EINVAL when
 * index is not a visible GPU. */
int qt_backend_cuda_open(int index, qt_backend **out);
const qt_backend_desc *qt_backend_cuda_desc(void);
/* Number of visible GPUs (0 without a driver or module); never fails. */
int qt_cuda_device_count(void);
/* The same, with why there are none in why ("libqtune_cuda.so not built
 * ...", "no CUDA GPU is visible (...)"); skips the module's load (seconds) where
 * no module was built or no driver is present. -1 when the module the user
 * named (QTUNE_CUDA_MODULE) does not load: why then is the error, whatever
 * the device asked for. */
int qt_cuda_probe(char *why, size_t cap);
/* The name of visible GPU index ("NVIDIA H200"); "" when unknown. */
void qt_cuda_device_name(int index, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
