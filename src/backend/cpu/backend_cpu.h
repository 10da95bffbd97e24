/* The CPU backend's entry for the registry (src/backend/backend.c) and for
 * the guard backend, which runs these same kernels. */
#ifndef QT_BACKEND_CPU_BACKEND_CPU_H
#define QT_BACKEND_CPU_BACKEND_CPU_H

#include "backend/backend.h"

extern const qt_backend_desc qt_cpu_desc;
/* What OpenBLAS maps for each thread that calls it: its BUFFER_SIZE (128 MiB
 * on x86-64) through malloc, which adds a page and its header: measured
 * 134225920 bytes per mapping (Debian's 0.3.21 pthreads build, gdb on a run
 * stuck in blas_memory_alloc under ulimit -v). */
#define QT_CPU_BLAS_THREAD_VM ((size_t)134225920)
/* The CPU's table (desc, memory, ops; close frees the instance). An instance
 * starts as a copy of it with impl NULL: hold_threads keeps the held team
 * there while its function runs. */
extern const qt_backend qt_backend_cpu_i;
/* The process runtime the CPU's kernels add outside the planned blocks:
 * the descriptor's figure, more while sgemm runs on oneDNN. A process fact:
 * no instance needed. */
size_t qt_cpu_runtime_bytes(void);

#endif
