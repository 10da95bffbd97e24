/* The GPU a process takes when it names none, from its environment alone
 * (no module, no device): the one rule device.c's "cuda" and an open of the
 * CUDA backend with no index both follow. */
#ifndef QT_BACKEND_DEVICE_DEFAULT_H
#define QT_BACKEND_DEVICE_DEFAULT_H

/* The launcher's local rank on this host (OpenMPI, MPICH/Hydra, Slurm), NULL
 * when there is no launcher, and the ranks it starts on this host (1 when
 * none says). */
const char *qt_device_local_rank(void);
int qt_device_local_size(void);

/* The GPU a "cuda" without a number takes among count visible ones:
 * QTUNE_CUDA_DEVICE, else the launcher's local rank modulo count, else 0.
 * QT_EINVAL when QTUNE_CUDA_DEVICE is not a GPU number below count. */
int qt_device_default_cuda_index(int count, int *index);

#endif
