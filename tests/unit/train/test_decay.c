/* train/decay.h: the weight-decay ranges from the model's parameter table
 * (moved with the function from tests/unit/optim/test_optim.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "train/decay.h"

static void test_decay_ranges_from_params(void **state) {
    (void)state;
    qt_param ps[4];
    memset(ps, 0, sizeof ps);
    ps[0] = (qt_param){.name = "b", .ndim = 1, .offset = 30, .numel = 5, .decay = 0};
    ps[1] = (qt_param){.name = "w2", .ndim = 2, .offset = 10, .numel = 20, .decay = 1};
    ps[2] = (qt_param){.name = "w1", .ndim = 2, .offset = 0, .numel = 10, .decay = 1};
    ps[3] = (qt_param){.name = "w3", .ndim = 2, .offset = 35, .numel = 7, .decay = 1};
    qt_range *r;
    int n;
    assert_int_equal(qt_decay_ranges_from_params(ps, 4, &r, &n), QT_OK);
    assert_int_equal(n, 2);
    assert_int_equal(r[0].lo, 0);
    assert_int_equal(r[0].hi, 30);
    assert_int_equal(r[1].lo, 35);
    assert_int_equal(r[1].hi, 42);
    qt_free(r);
    ps[3].offset = 25; /* overlaps w2 */
    assert_int_equal(qt_decay_ranges_from_params(ps, 4, &r, &n), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "overlap"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decay_ranges_from_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
