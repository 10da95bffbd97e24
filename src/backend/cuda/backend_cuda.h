/* The CUDA backend (backend.h on one NVIDIA GPU through the CUDA runtime and
 * cuBLAS). Compiled where nvcc, cuBLAS and NCCL are found; it has not run on
 * a GPU yet (docs/backends.md says what is and is not verified). */
#ifndef QT_BACKEND_CUDA_H
#define QT_BACKEND_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif
#include "backend/backend.h"

/* Opens device QTUNE_CUDA_DEVICE (default 0; under mpirun the launcher's
 * local rank is the default instead). QT_EUNSUPPORTED with a sentence when no
 * GPU or driver is there. */
int qt_backend_cuda_open(qt_backend **out);
const qt_backend_desc *qt_backend_cuda_desc(void);
/* Number of visible GPUs (0 without a driver); never fails. */
int qt_cuda_device_count(void);
/* One line per GPU and the driver / runtime / cuBLAS / NCCL versions, for
 * `qtune doctor`; writes at most cap bytes to buf. */
void qt_cuda_describe(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
