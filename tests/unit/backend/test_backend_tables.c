/* Every backend is one read-only table (backend_impl.h) with no empty slot:
 * the cpu table itself, the instances the registry opens (cpu, guard, and
 * either behind QTUNE_PROFILE's decorator), and the CUDA module's table,
 * read from the module with dlsym (no GPU needed: loading the module does not
 * touch a device) where this build has the module. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/backend_impl.h"
#include "backend/cpu/backend_cpu.h"
#include "backend/cuda/backend_cuda.h"
#include "core/error.h"
#include "qtune_config.h"

/* QT_BACKEND_SLOTS names every function slot: the struct holds desc, impl
 * and exactly those, so a slot added to backend.h but not to the list (and
 * so never walked) fails here. */
#define ONE(name) +1
enum { N_SLOTS = 0 QT_BACKEND_SLOTS(ONE) };
#undef ONE
static void test_slot_list_is_the_struct(void **state) {
    (void)state;
    assert_int_equal(offsetof(qt_backend, alloc), 2 * sizeof(void *));
    assert_int_equal(sizeof(qt_backend), offsetof(qt_backend, alloc) + N_SLOTS * sizeof(void (*)(void)));
#define AT(name) assert_true(offsetof(qt_backend, name) >= offsetof(qt_backend, alloc));
    QT_BACKEND_SLOTS(AT)
#undef AT
}

/* the walk names the slot it finds empty, whichever it is */
static void test_walk_finds_a_hole(void **state) {
    (void)state;
    assert_null(qt_backend_empty_slot(&qt_backend_cpu_i));
#define HOLE(name)                                                \
    {                                                             \
        qt_backend t = qt_backend_cpu_i;                          \
        t.name = NULL;                                            \
        assert_string_equal(qt_backend_empty_slot(&t), #name);    \
    }
    QT_BACKEND_SLOTS(HOLE)
#undef HOLE
    qt_backend t = qt_backend_cpu_i;
    t.desc = NULL;
    assert_string_equal(qt_backend_empty_slot(&t), "desc");
}

static void walk_opened(const char *name) {
    qt_backend *be;
    assert_int_equal(qt_backend_open(name, &be), QT_OK);
    const char *hole = qt_backend_empty_slot(be);
    if (hole) fail_msg("backend %s%s: slot %s is empty", name, getenv("QTUNE_PROFILE") ? " (profiled)" : "", hole);
    assert_string_equal(be->desc->name, name);
    qt_backend_close(be);
}

static void test_opened_backends_are_complete(void **state) {
    (void)state;
    unsetenv("QTUNE_PROFILE");
    walk_opened("cpu");
    walk_opened("guard");
    setenv("QTUNE_PROFILE", "1", 1);
    walk_opened("cpu");
    walk_opened("guard");
    unsetenv("QTUNE_PROFILE");
}

static void test_cuda_table_is_complete(void **state) {
    (void)state;
    if (!QTUNE_CUDA_MODULE_BUILD[0] || access(QTUNE_CUDA_MODULE_BUILD, F_OK) != 0) {
        print_message("no CUDA module in this build (configured without nvcc): its table is not checked\n");
        skip();
    }
    void *m = dlopen(QTUNE_CUDA_MODULE_BUILD, RTLD_NOW | RTLD_LOCAL);
    if (!m) fail_msg("the CUDA module does not load: %s", dlerror());
    const qt_backend *t = dlsym(m, "qt_cuda_backend_i");
    assert_non_null(t);
    qt_backend inst = *t; /* as the module's open makes an instance: the host's descriptor */
    assert_null(inst.desc);
    inst.desc = qt_backend_cuda_desc();
    const char *hole = qt_backend_empty_slot(&inst);
    if (hole) fail_msg("backend cuda: slot %s is empty", hole);
    dlclose(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slot_list_is_the_struct),
        cmocka_unit_test(test_walk_finds_a_hole),
        cmocka_unit_test(test_opened_backends_are_complete),
        cmocka_unit_test(test_cuda_table_is_complete),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
