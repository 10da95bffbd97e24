/* core: dtype conversions, checked sizes, aligned buffers, atomic files, folder replace, rng streams. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/mem.h"
#include "core/rng.h"

static void test_bf16_round_trip(void **state) {
    (void)state;
    /* 1 + 2^-8 is exactly between two bf16 values: ties go to even (1.0). */
    assert_true(qt_bf16_to_f32(qt_f32_to_bf16(1.00390625f)) == 1.0f);
    assert_true(qt_bf16_to_f32(qt_f32_to_bf16(1.01171875f)) == 1.015625f);
    assert_true(isnan(qt_bf16_to_f32(qt_f32_to_bf16(NAN))));
    float src[19], back[19];
    uint16_t h[19];
    for (int i = 0; i < 19; i++) src[i] = (float)i * 0.37f - 3.0f;
    qt_convert_from_f32(h, QT_F16, src, 19);
    qt_convert_to_f32(back, h, QT_F16, 19);
    for (int i = 0; i < 19; i++) assert_true(fabsf(back[i] - src[i]) <= 2e-3f);
    qt_convert_from_f32(h, QT_BF16, src, 19);
    qt_convert_to_f32(back, h, QT_BF16, 19);
    for (int i = 0; i < 19; i++) assert_true(fabsf(back[i] - src[i]) <= 2e-2f);
}

static void test_mul_overflow(void **state) {
    (void)state;
    size_t out;
    assert_true(qt_mul_ok(1000, 1000, &out) && out == 1000000);
    assert_false(qt_mul_ok(SIZE_MAX / 2, 3, &out));
}

static void test_atomic_abort_keeps_old(void **state) {
    (void)state;
    char dir[] = "/tmp/qtune_core_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    assert_int_equal(qt_path_join(path, sizeof path, dir, "f.txt"), QT_OK);
    assert_int_equal(qt_write_file_atomic(path, "good", 4), QT_OK);
    qt_atomic_file af;
    assert_int_equal(qt_atomic_open(&af, path), QT_OK);
    assert_int_equal(qt_atomic_write(&af, "bad!", 4), QT_OK);
    qt_atomic_abort(&af);
    char *buf;
    size_t n;
    assert_int_equal(qt_read_file(path, 100, &buf, &n), QT_OK);
    assert_int_equal(n, 4);
    assert_memory_equal(buf, "good", 4);
    qt_free(buf);
    assert_int_equal(qt_read_file(path, 2, &buf, &n), QT_EFORMAT); /* over the cap */
    assert_non_null(strstr(qt_error_message(), "f.txt"));
    assert_int_equal(qt_rm_rf(dir), QT_OK);
    assert_false(qt_path_exists(dir));
}

static int file_is(const char *dir, const char *name, const char *want) {
    char path[256], *buf;
    size_t n;
    if (qt_path_join(path, sizeof path, dir, name) != QT_OK || qt_read_file(path, 100, &buf, &n) != QT_OK) return 0;
    int same = n == strlen(want) && memcmp(buf, want, n) == 0;
    qt_free(buf);
    return same;
}

/* a failed second rename puts the old folder back; a good one drops .old */
static void test_dir_replace(void **state) {
    (void)state;
    char dir[] = "/tmp/qtune_core_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char fin[256], tmp[256], old[256], f[256];
    assert_int_equal(qt_path_join(fin, sizeof fin, dir, "final"), QT_OK);
    assert_int_equal(qt_path_join(tmp, sizeof tmp, dir, "final.tmp"), QT_OK);
    assert_int_equal(qt_path_join(old, sizeof old, dir, "final.old"), QT_OK);
    assert_int_equal(qt_mkdir_p(fin), QT_OK);
    assert_int_equal(qt_path_join(f, sizeof f, fin, "a"), QT_OK);
    assert_int_equal(qt_write_file_atomic(f, "old", 3), QT_OK);
    /* tmp does not exist: rename(tmp, final) fails */
    assert_int_equal(qt_dir_replace(tmp, fin), QT_EIO);
    assert_true(file_is(fin, "a", "old"));
    assert_false(qt_path_exists(old));
    assert_int_equal(qt_mkdir_p(tmp), QT_OK);
    assert_int_equal(qt_path_join(f, sizeof f, tmp, "a"), QT_OK);
    assert_int_equal(qt_write_file_atomic(f, "new", 3), QT_OK);
    assert_int_equal(qt_dir_replace(tmp, fin), QT_OK);
    assert_true(file_is(fin, "a", "new"));
    assert_false(qt_path_exists(old));
    assert_false(qt_path_exists(tmp));
    assert_int_equal(qt_rm_rf(dir), QT_OK);
}

/* The THPeligible flag of the mapping that holds p (/proc/self/smaps), or -1
 * where the kernel does not report it. */
static int thp_eligible(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int in = 0, flag = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (in && sscanf(line, "THPeligible: %d", &flag) == 1)
            break;
    }
    fclose(f);
    return flag;
}

/* Whether transparent huge pages are on (always or madvise) on this kernel
 * and not switched off for this process (a container runtime may set
 * PR_SET_THP_DISABLE, which makes no mapping eligible). */
static int thp_enabled(void) {
    if (prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) > 0) return 0;
    char buf[128] = {0};
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, "[always]") || strstr(buf, "[madvise]");
}

/* qt_path_missing_top names the first folder mkdir_p will make, and
 * qt_rmdir_made removes what was made up to it, never a folder above it nor
 * one that holds anything. */
static void test_rmdir_made(void **state) {
    (void)state;
    char dir[] = "/tmp/qtune_core_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char deep[256], top[256], want[256], f[256];
    snprintf(deep, sizeof deep, "%s/a/b/c", dir);
    snprintf(want, sizeof want, "%s/a", dir);
    assert_int_equal(qt_path_missing_top(deep, top, sizeof top), QT_OK);
    assert_string_equal(top, want);
    assert_int_equal(qt_path_missing_top(dir, top, sizeof top), QT_OK);
    assert_string_equal(top, ""); /* it exists */
    assert_int_equal(qt_path_missing_top(deep, top, sizeof top), QT_OK);
    assert_int_equal(qt_mkdir_p(deep), QT_OK);
    qt_rmdir_made(deep, top);
    assert_false(qt_path_exists(want));
    assert_true(qt_is_dir(dir)); /* above top: kept */
    /* a folder that is not empty stops it: b holds a file of someone else's */
    assert_int_equal(qt_mkdir_p(deep), QT_OK);
    snprintf(f, sizeof f, "%s/a/b/theirs", dir);
    assert_int_equal(qt_write_file_atomic(f, "x", 1), QT_OK);
    qt_rmdir_made(deep, top);
    assert_false(qt_path_exists(deep));
    assert_true(qt_path_exists(f));
    /* a top that is no prefix of the path: nothing is removed */
    assert_int_equal(qt_mkdir_p(deep), QT_OK);
    qt_rmdir_made(deep, "/tmp/elsewhere");
    assert_true(qt_is_dir(deep));
    assert_int_equal(qt_rm_rf(dir), QT_OK);
}

static void test_alloc_aligned(void **state) {
    (void)state;
    unsigned char *small = qt_alloc_aligned(1000, "a small buffer");
    assert_non_null(small);
    assert_int_equal((uintptr_t)small % 64, 0);
    memset(small, 7, 1000);
    qt_free(small);

    /* a weight-sized buffer: 2 MiB aligned, whole, and advised to use huge pages */
    size_t n = QT_HUGE_MIN + 12345;
    unsigned char *big = qt_alloc_aligned(n, "a large buffer");
    assert_non_null(big);
    assert_int_equal((uintptr_t)big % QT_HUGE_PAGE, 0);
    memset(big, 0xab, n);
    assert_int_equal(big[0], 0xab);
    assert_int_equal(big[n - 1], 0xab);
    if (thp_enabled()) {
        int e = thp_eligible(big);
        if (e >= 0) assert_int_equal(e, 1);
    }
    qt_free(big);
}

static void test_rng_streams(void **state) {
    (void)state;
    qt_rng a, b, c;
    qt_rng_derive(&a, 42, 1, 7);
    qt_rng_derive(&b, 42, 1, 7);
    qt_rng_derive(&c, 42, 2, 7);
    uint64_t x = qt_rng_u64(&a);
    assert_true(x == qt_rng_u64(&b));
    assert_true(x != qt_rng_u64(&c));
    double sum = 0;
    for (int i = 0; i < 10000; i++) sum += qt_rng_uniform(&a);
    assert_true(fabs(sum / 10000 - 0.5) < 0.02);
}

/* cJSON reads 1e-400 as 0 and 1e400 as infinity without a word; the range
 * check refuses both by key path, and leaves exact zeros and ordinary
 * numbers (also inside strings and keys) alone. */
static void check_range(const char *json, int want_ok, const char *must) {
    int rc = qt_json_check_range(json, strlen(json), "cfg.json");
    if (want_ok) {
        assert_int_equal(rc, QT_OK);
        return;
    }
    assert_int_equal(rc, QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "cfg.json"));
    if (!strstr(qt_error_message(), must)) fail_msg("'%s' not in: %s", must, qt_error_message());
}

static void test_json_range(void **state) {
    (void)state;
    check_range("{\"a\": 0, \"b\": 0.0, \"c\": 0e-400, \"d\": -1.5e-300, \"e\": 1.7e308, \"f\": \"1e-400\"}", 1, NULL);
    check_range("{\"1e999\": [1, 2, {\"x\": \"\\\"1e-999\"}]}", 1, NULL);
    check_range("{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-400}}}", 0,
                "optimizer.params.lr is 1e-400");
    check_range("{\"optimizer\": {\"params\": {\"lr\": 1e-4, \"betas\": [0.9, 1e400]}}}", 0,
                "optimizer.params.betas[1] is 1e400");
    check_range("{\"a\": {\"b\": 1}, \"c\": -1e-320}", 0, "c is -1e-320");
    check_range("{\"eps\": 1e-310}", 0, "eps is 1e-310");
    check_range("[1, 2, 3e999]", 0, "[2] is 3e999");
    check_range("-1e-400", 0, "top-level value");
    assert_non_null(strstr(qt_error_message(), "read as -0"));
    /* a key with an escaped quote does not derail the path */
    check_range("{\"k\\\"x\": {\"lr\": 2e-999}}", 0, "lr is 2e-999");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_round_trip),
        cmocka_unit_test(test_mul_overflow),
        cmocka_unit_test(test_alloc_aligned),
        cmocka_unit_test(test_atomic_abort_keeps_old),
        cmocka_unit_test(test_dir_replace),
        cmocka_unit_test(test_rmdir_made),
        cmocka_unit_test(test_rng_streams),
        cmocka_unit_test(test_json_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
