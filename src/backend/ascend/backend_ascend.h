/* The Ascend backend (backend.h on one Huawei Ascend NPU through CANN's
 * AscendCL runtime and aclnn operators), as the registry (backend.c) sees
 * it. qtune is built without CANN: the libraries are opened with dlopen on
 * first use (loader.c). Written against CANN's published API, tested against
 * a CPU stand-in of that API, never run on an Ascend card (docs/backends.md
 * says what exists). */
#ifndef QT_BACKEND_ASCEND_H
#define QT_BACKEND_ASCEND_H

#include <stddef.h>

#include "backend/backend.h"

/* Loads CANN's libraries and opens NPU index (< 0: NPU 0). QT_EUNSUPPORTED
 * with a sentence when the libraries or a card are missing; QT_EINVAL when
 * index is not a visible NPU. */
int qt_backend_ascend_open(int index, qt_backend **out);
const qt_backend_desc *qt_backend_ascend_desc(void);
/* QT_OK when CANN's libraries (or $QTUNE_ASCEND_LIB) load and have every
 * function the backend calls; else the loader's error, raised (device.c
 * asks before the run starts, so a machine without CANN writes nothing). */
int qt_ascend_library_check(void);
/* For "auto": how many Ascend NPUs CANN sees (aclInit, then
 * aclrtGetDeviceCount); 0, with why, where CANN's libraries do not load or
 * see none. Raises nothing, so a machine without CANN stays quiet. */
int qt_ascend_probe(char *why, size_t cap);
/* The backend's table (backend_impl.h), every slot filled and written; 4-bit
 * weights, and the fused attention and embedding backward on a card
 * outside Atlas A2 / A3, are refused by name at their first call. */
extern const qt_backend qt_backend_ascend_i;

#endif
