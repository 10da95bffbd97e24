/* io: TensorBoard event files: CRC-32C against published check values, and a
 * written file read back record by record (length, masked CRCs, the Event
 * messages decoded with protobuf-c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/tb_events.h"
#include "tb_event.pb-c.h"

static void test_crc32c_check_values(void **state) {
    (void)state;
    unsigned char z[32] = {0}, ff[32];
    memset(ff, 0xff, sizeof ff);
    assert_int_equal(qt_crc32c("123456789", 9), 0xe3069283u); /* the CRC catalogue's check value */
    assert_int_equal(qt_crc32c(z, 32), 0x8a9136aau);          /* RFC 3720 B.4 */
    assert_int_equal(qt_crc32c(ff, 32), 0x62a8ab43u);
    uint32_t c = 0xe3069283u;
    assert_int_equal(qt_tb_masked_crc("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

static uint64_t rd64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint32_t rd32(const unsigned char *p) { return (uint32_t)rd64((const unsigned char[8]){p[0], p[1], p[2], p[3]}); }

static void test_written_file_reads_back(void **state) {
    (void)state;
    char d[] = "/tmp/qtune_tb_XXXXXX", logdir[4096];
    assert_non_null(mkdtemp(d));
    assert_int_equal(qt_path_join(logdir, sizeof logdir, d, "runs/a"), QT_OK);
    qt_tb_writer *w;
    assert_int_equal(qt_tb_open(&w, logdir), QT_OK); /* creates runs/a */
    assert_int_equal(qt_tb_scalar(w, "train/loss", 1, 1.7e9, 2.5f), QT_OK);
    assert_int_equal(qt_tb_scalar(w, "eval/loss", 10, 1.7e9 + 1, 1.25f), QT_OK);
    char path[4096];
    snprintf(path, sizeof path, "%s", qt_tb_path(w));
    assert_non_null(strstr(path, "/events.out.tfevents."));
    qt_tb_close(w);
    char *buf;
    size_t n;
    assert_int_equal(qt_read_file(path, 1 << 20, &buf, &n), QT_OK);
    const unsigned char *b = (const unsigned char *)buf;
    size_t pos = 0;
    int k = 0;
    while (pos < n) {
        assert_true(n - pos >= 16);
        uint64_t len = rd64(b + pos);
        assert_int_equal(rd32(b + pos + 8), qt_tb_masked_crc(b + pos, 8));
        assert_true(pos + 16 + len <= n);
        assert_int_equal(rd32(b + pos + 12 + len), qt_tb_masked_crc(b + pos + 12, len));
        Qtune__Tb__Event *ev = qtune__tb__event__unpack(NULL, len, b + pos + 12);
        assert_non_null(ev);
        if (k == 0) {
            assert_int_equal(ev->what_case, QTUNE__TB__EVENT__WHAT_FILE_VERSION);
            assert_string_equal(ev->file_version, "brain.Event:2");
        } else {
            assert_int_equal(ev->what_case, QTUNE__TB__EVENT__WHAT_SUMMARY);
            assert_int_equal(ev->summary->n_value, 1);
            assert_string_equal(ev->summary->value[0]->tag, k == 1 ? "train/loss" : "eval/loss");
            assert_true(ev->summary->value[0]->simple_value == (k == 1 ? 2.5f : 1.25f));
            assert_int_equal(ev->step, k == 1 ? 1 : 10);
            assert_true(ev->wall_time == (k == 1 ? 1.7e9 : 1.7e9 + 1));
        }
        qtune__tb__event__free_unpacked(ev, NULL);
        pos += 16 + len;
        k++;
    }
    assert_int_equal(k, 3);
    qt_free(buf);
    qt_rm_rf(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c_check_values),
        cmocka_unit_test(test_written_file_reads_back),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
