/* The CUDA backend (backend.h on one NVIDIA GPU through the CUDA runtime and
 * cuBLAS), as the registry (backend.c) sees it: the kernels are a module
 * loaded on first use (loader.c), the descriptor is plain C (desc.c) and
 * always there. The module is compiled where nvcc, cuBLAS and NCCL are
 * found; it has not run on a GPU yet (docs/backends.md says what is and is
 * not verified). */
#ifndef QT_BACKEND_CUDA_H
#define QT_BACKEND_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif
#include "backend/backend.h"

/* Loads the module and opens device QTUNE_CUDA_DEVICE (default: the
 * launcher's local rank under mpirun, else 0). QT_EUNSUPPORTED with a
 * sentence when the module, a driver or a GPU is missing. */
int qt_backend_cuda_open(qt_backend **out);
const qt_backend_desc *qt_backend_cuda_desc(void);
/* Number of visible GPUs (0 without a driver or module); never fails. */
int qt_cuda_device_count(void);
/* One line per GPU and the driver / runtime / cuBLAS / NCCL versions, for
 * `qtune doctor`; writes at most cap bytes to buf. */
void qt_cuda_describe(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
