/* The CPU backend's entry for the registry (src/backend/backend.c) and for
 * the guard backend, which runs these same kernels. */
#ifndef QT_BACKEND_CPU_BACKEND_CPU_H
#define QT_BACKEND_CPU_BACKEND_CPU_H

#include "backend/backend.h"

extern const qt_backend_desc qt_cpu_desc;
/* Fills every entry of be's table with the CPU's (desc, memory, ops); close
 * is the caller's. impl must be NULL: hold_threads keeps the held team
 * there while its function runs. */
void qt_backend_cpu_fill(qt_backend *be);

#endif
