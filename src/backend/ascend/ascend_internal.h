/* Inside the Ascend backend: the table of CANN functions the loader found,
 * and the checks every call goes through. */
#ifndef QT_BACKEND_ASCEND_INTERNAL_H
#define QT_BACKEND_ASCEND_INTERNAL_H

#include "backend/ascend/acl_api.h"

typedef struct {
#define X(ret, name, params) ret(*name) params;
    QT_ACL_FUNCS(X)
#undef X
} qt_acl_api;

/* The CANN functions, every one found (dlopen of libascendcl.so,
 * libnnopbase.so and libopapi.so, or of $QTUNE_ASCEND_LIB alone); NULL with
 * QT_ERR raised, saying what is missing and what to do, when not. */
const qt_acl_api *qt_acl_load(void);

#endif
