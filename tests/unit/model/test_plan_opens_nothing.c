/* The memory plan reads descriptors and process facts only: sizing the
 * runtime must not open a backend (with QTUNE_BACKEND=cuda that would start a
 * GPU from `qtune plan`). The stand-in CUDA module (tests/unit/backend/
 * fake_cuda_module.c) raises an error naming the GPU whenever it is asked to
 * open one, so an open leaves its sentence behind. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "model/memplan.h"

static void test_runtime_bytes_open_no_backend(void **state) {
    (void)state;
    setenv("QTUNE_CUDA_MODULE", QT_FAKE_CUDA_MODULE, 1);
    setenv("QTUNE_BACKEND", "cuda", 1);
    qt_error_clear();
    size_t n = qt_model_cpu_runtime_bytes();
    if (strstr(qt_error_message(), "fake CUDA module"))
        fail_msg("sizing the runtime opened the cuda backend: %s", qt_error_message());
    assert_true(n >= qt_backend_desc_of("cpu")->runtime_bytes);
    unsetenv("QTUNE_BACKEND");
    assert_int_equal(qt_model_cpu_runtime_bytes(), n); /* the host's figure, whatever QTUNE_BACKEND says */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_runtime_bytes_open_no_backend),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
