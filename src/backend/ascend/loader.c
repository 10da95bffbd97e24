/* Loading CANN for the Ascend backend: qtune links nothing of CANN, so a
 * machine without it builds and runs qtune; the first run that asks for
 * "npu" opens the three libraries CANN's toolkit installs in its lib64
 * (on LD_LIBRARY_PATH once CANN's set_env.sh is sourced) and finds every
 * function acl_api.h lists. $QTUNE_ASCEND_LIB, when set, names one library
 * that has them all and is the only one opened: the tests' CPU stand-in. */
#define _GNU_SOURCE
#include "backend/ascend/ascend_internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

static qt_acl_api api;
static int loaded;

/* the handle of each library, opened once; NULL where it failed (why in err) */
static void *open_lib(const char *path, char *err, size_t cap) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) snprintf(err, cap, "%s", dlerror());
    return h;
}

const qt_acl_api *qt_acl_load(void) {
    if (loaded) return &api;
    const char *user = getenv("QTUNE_ASCEND_LIB");
    const char *names[3] = {"libascendcl.so", "libnnopbase.so", "libopapi.so"};
    void *h[3] = {0};
    int n = 3;
    char err[1024] = "";
    if (user && *user) names[0] = user, n = 1;
    for (int i = 0; i < n; i++) {
        h[i] = open_lib(names[i], err, sizeof err);
        if (h[i]) continue;
        for (int j = 0; j < i; j++) dlclose(h[j]);
        if (user && *user)
            return QT_ERR(QT_EINVAL, "QTUNE_ASCEND_LIB names a library that could not be loaded (%s); correct the "
                          "path, or unset it to use CANN's own libraries", err), NULL;
        return QT_ERR(QT_EUNSUPPORTED, "the Ascend backend (\"npu\") needs Huawei CANN, and %s could not be loaded "
                      "(%s); install the CANN toolkit and source its set_env.sh (it puts CANN's lib64 on "
                      "LD_LIBRARY_PATH), or use \"cpu\"", names[i], err), NULL;
    }
    /* every function, from whichever library has it */
#define X(ret, name, params)                                                                                    \
    for (int i = 0; i < n && !api.name; i++) *(void **)&api.name = dlsym(h[i], #name);                        \
    if (!api.name) {                                                                                            \
        memset(&api, 0, sizeof api);                                                                            \
        for (int i = 0; i < n; i++) dlclose(h[i]);                                                              \
        return QT_ERR(QT_EUNSUPPORTED, "the CANN libraries loaded have no %s: a CANN older than the 8.1 headers " \
                      "qtune's Ascend backend is written against (src/backend/ascend/acl_api.h); install CANN 8.1 " \
                      "or later", #name), NULL;                                                                 \
    }
    QT_ACL_FUNCS(X)
#undef X
    loaded = 1;
    return &api;
}
