/* Device selection (src/backend/device.c): the values "auto", "cpu", "cuda",
 * "cuda:N", QTUNE_BACKEND winning, QTUNE_CUDA_DEVICE and the launcher's local
 * rank. The GPUs are a stand-in module (fake_cuda_module.c) loaded through
 * QTUNE_CUDA_MODULE, so every case runs the same with or without a GPU or a
 * CUDA build; QTUNE_FAKE_GPUS sets how many it reports. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "backend/device.h"
#include "core/error.h"

static const char *const launcher_env[] = {"QTUNE_BACKEND", "QTUNE_CUDA_DEVICE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                                           "SLURM_LOCALID"};

static int clean_env(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof launcher_env / sizeof launcher_env[0]; i++) unsetenv(launcher_env[i]);
    setenv("QTUNE_FAKE_GPUS", "2", 1);
    return 0;
}

static void contains(const char *s, const char *part) {
    if (!strstr(s, part)) fail_msg("\"%s\" does not contain \"%s\"", s, part);
}

static void test_spelling(void **state) {
    (void)state;
    const char *good[] = {NULL, "auto", "cpu", "cuda", "cuda:0", "cuda:7", "cuda:1023"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        assert_int_equal(qt_device_check(good[i], "--device"), QT_OK);
    const char *bad[] = {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda:1024", "cuda:01x", "cpu:0", " cpu"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(qt_device_check(bad[i], "job.json: \"device\":"), QT_EINVAL);
        contains(qt_error_message(), "is not a device; use \"auto\"");
    }
    contains(qt_error_message(), "job.json: \"device\": \" cpu\"");
    assert_string_equal(qt_device_desc_name("cpu"), "cpu");
    assert_string_equal(qt_device_desc_name("cuda"), "cuda");
    assert_string_equal(qt_device_desc_name("cuda:3"), "cuda");
    assert_null(qt_device_desc_name("auto"));
    assert_null(qt_device_desc_name("tpu"));
}

static void test_no_gpu(void **state) {
    (void)state;
    setenv("QTUNE_FAKE_GPUS", "0", 1);
    qt_device d;
    assert_int_equal(qt_device_resolve("auto", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "cpu");
    assert_int_equal(d.index, -1);
    contains(d.note, "device auto -> cpu: no CUDA GPU is visible");
    assert_int_equal(qt_device_resolve(NULL, "--device", &d), QT_OK); /* NULL is auto */
    assert_string_equal(d.backend, "cpu");
    assert_int_equal(qt_device_resolve("cpu", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "cpu");
    assert_string_equal(d.note, "");
    assert_int_equal(qt_device_resolve("cuda", "job.json: \"device\":", &d), QT_EUNSUPPORTED);
    contains(qt_error_message(), "job.json: \"device\": \"cuda\" asks for a GPU, but no CUDA GPU is visible");
    contains(qt_error_message(), "use \"cpu\"");
    assert_int_equal(qt_device_resolve("cuda:0", "--device", &d), QT_EUNSUPPORTED);
    /* cpu's label says its threads */
    char label[128];
    assert_int_equal(qt_device_resolve("cpu", "--device", &d), QT_OK);
    qt_device_label(&d, 16, label, sizeof label);
    assert_string_equal(label, "cpu (16 threads)");
    qt_device_label(&d, 1, label, sizeof label);
    assert_string_equal(label, "cpu (1 thread)");
}

static void test_gpus(void **state) {
    (void)state;
    qt_device d;
    char label[128];
    assert_int_equal(qt_device_resolve("auto", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "cuda");
    assert_int_equal(d.index, 0);
    assert_string_equal(d.note, "device auto -> cuda:0: 2 GPUs visible");
    qt_device_label(&d, 4, label, sizeof label);
    assert_string_equal(label, "cuda:0 (Fake GPU 0)");
    assert_int_equal(qt_device_resolve("cuda:1", "--device", &d), QT_OK);
    assert_int_equal(d.index, 1);
    assert_string_equal(d.note, "");
    assert_int_equal(qt_device_resolve("cuda:2", "job.json: \"device\":", &d), QT_EINVAL);
    contains(qt_error_message(), "job.json: \"device\": \"cuda:2\" names GPU 2, but 2 GPUs are visible");
    setenv("QTUNE_FAKE_GPUS", "1", 1);
    assert_int_equal(qt_device_resolve("cuda:1", "--device", &d), QT_EINVAL);
    contains(qt_error_message(), "names GPU 1, but 1 GPU is visible");
}

/* "cuda": QTUNE_CUDA_DEVICE, else the local rank modulo the GPUs, else 0 */
static void test_rank_picks_gpu(void **state) {
    (void)state;
    qt_device d;
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    assert_int_equal(d.index, 0);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3", 1);
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    assert_int_equal(d.index, 1); /* 3 mod 2 */
    assert_int_equal(qt_device_resolve("auto", "--device", &d), QT_OK);
    assert_int_equal(d.index, 1);
    contains(d.note, "each rank takes the GPU of its local rank");
    unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
    setenv("SLURM_LOCALID", "2", 1);
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    assert_int_equal(d.index, 0);
    setenv("QTUNE_CUDA_DEVICE", "1", 1);
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    assert_int_equal(d.index, 1);
    assert_int_equal(qt_device_resolve("cuda:0", "--device", &d), QT_OK); /* a named GPU wins */
    assert_int_equal(d.index, 0);
    setenv("QTUNE_CUDA_DEVICE", "2", 1);
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_EINVAL);
    contains(qt_error_message(), "QTUNE_CUDA_DEVICE is \"2\" but 2 GPUs are visible");
}

/* several ranks on one host would share the one GPU "cuda:N" names */
static void test_named_gpu_under_a_launcher(void **state) {
    (void)state;
    qt_device d;
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
    assert_int_equal(qt_device_resolve("cuda:1", "--device", &d), QT_EINVAL);
    contains(qt_error_message(), "--device \"cuda:1\" names one GPU, but the launcher starts 4 ranks on this host");
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1); /* one rank a host: its GPU may be named */
    assert_int_equal(qt_device_resolve("cuda:1", "--device", &d), QT_OK);
    assert_int_equal(d.index, 1);
}

static void test_qtune_backend_wins(void **state) {
    (void)state;
    qt_device d;
    setenv("QTUNE_BACKEND", "guard", 1);
    assert_int_equal(qt_device_resolve("cuda:1", "job.json: \"device\":", &d), QT_OK);
    assert_string_equal(d.backend, "guard");
    assert_int_equal(d.index, -1);
    assert_string_equal(d.note, "QTUNE_BACKEND=guard overrides job.json: \"device\": \"cuda:1\"");
    setenv("QTUNE_FAKE_GPUS", "0", 1); /* no GPU needed for it */
    assert_int_equal(qt_device_resolve("cuda", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "guard");
    setenv("QTUNE_BACKEND", "cuda", 1);
    assert_int_equal(qt_device_resolve("cpu", "--device", &d), QT_EUNSUPPORTED);
    contains(qt_error_message(), "QTUNE_BACKEND=cuda asks for a GPU, but no CUDA GPU is visible");
    setenv("QTUNE_FAKE_GPUS", "2", 1);
    assert_int_equal(qt_device_resolve("cpu", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "cuda");
    assert_int_equal(d.index, 0);
    assert_int_equal(qt_device_resolve("cuda:1", "--device", &d), QT_OK); /* a named GPU is kept */
    assert_int_equal(d.index, 1);
    setenv("QTUNE_BACKEND", "tpu", 1);
    assert_int_equal(qt_device_resolve("auto", "--device", &d), QT_EINVAL);
    contains(qt_error_message(), "backend \"tpu\" is not compiled in (QTUNE_BACKEND)");
}

/* the index reaches the module's open (the stand-in says which GPU it was asked for) */
static void test_open_reaches_the_gpu(void **state) {
    (void)state;
    qt_backend *be = NULL;
    assert_int_equal(qt_backend_open_index("cuda", 1, &be), QT_EUNSUPPORTED);
    assert_null(be);
    contains(qt_error_message(), "asked to open GPU 1 of 2");
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5", 1); /* the default: 5 mod 2 */
    assert_int_equal(qt_backend_open("cuda", &be), QT_EUNSUPPORTED);
    contains(qt_error_message(), "asked to open GPU 1 of 2");
}

int main(void) {
    setenv("QTUNE_CUDA_MODULE", QT_FAKE_CUDA_MODULE, 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_spelling, clean_env),
        cmocka_unit_test_setup(test_no_gpu, clean_env),
        cmocka_unit_test_setup(test_gpus, clean_env),
        cmocka_unit_test_setup(test_rank_picks_gpu, clean_env),
        cmocka_unit_test_setup(test_named_gpu_under_a_launcher, clean_env),
        cmocka_unit_test_setup(test_qtune_backend_wins, clean_env),
        cmocka_unit_test_setup(test_open_reaches_the_gpu, clean_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
