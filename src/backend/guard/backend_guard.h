/* The guard backend's entry for the registry (src/backend/backend.c). */
#ifndef QT_BACKEND_GUARD_BACKEND_GUARD_H
#define QT_BACKEND_GUARD_BACKEND_GUARD_H

#include "backend/backend.h"

int qt_backend_guard_open(qt_backend **out);
const qt_backend_desc *qt_backend_guard_desc(void);

#endif
