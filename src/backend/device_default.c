/* The GPU a process takes when it names none (device_default.h): the
 * environment's QTUNE_CUDA_DEVICE, else the launcher's local rank. Read by
 * device.c (resolving "cuda") and by cuda/loader.c (an open with no index),
 * neither of which calls the other for it. */
#include "backend/device_default.h"

#include <stdlib.h>

#include "core/error.h"

static const char *env_first(const char *const *names, int n) {
    for (int i = 0; i < n; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) return v;
    }
    return NULL;
}

/* the launcher's local rank and ranks on this host (OpenMPI, MPICH/Hydra, Slurm) */
const char *qt_device_local_rank(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    return env_first(names, 3);
}
int qt_device_local_size(void) {
    static const char *const names[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"};
    const char *v = env_first(names, 2);
    return v ? atoi(v) : 1;
}

int qt_device_default_cuda_index(int count, int *index) {
    const char *e = getenv("QTUNE_CUDA_DEVICE");
    if (e && *e) {
        char *end;
        long v = strtol(e, &end, 10);
        if (*end || v < 0 || v >= count)
            return QT_ERR(QT_EINVAL, "QTUNE_CUDA_DEVICE is \"%s\" but %d GPU%s %s visible; set it to a number from 0 "
                          "to %d, or unset it", e, count, count == 1 ? "" : "s", count == 1 ? "is" : "are", count - 1);
        *index = (int)v;
        return QT_OK;
    }
    const char *r = qt_device_local_rank();
    *index = r && count > 0 ? atoi(r) % count : 0;
    if (*index < 0) *index = 0;
    return QT_OK;
}
