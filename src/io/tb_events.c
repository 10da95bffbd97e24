/* TensorBoard event files: TFRecord framing around protobuf-c Event messages. */
#include "io/tb_events.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "tb_event.pb-c.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct qt_tb_writer {
    FILE *f;
    char path[4096];
};

/* Debian ships no CRC-32C library (zlib's crc32 is the other polynomial):
 * the byte-wise table form, computed once. Event files are a few hundred
 * bytes per log line, so speed does not matter here. */
uint32_t qt_crc32c(const void *p, size_t n) {
    static uint32_t table[256];
    static int ready;
    if (!ready) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    const unsigned char *b = p;
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) c = table[(c ^ b[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

uint32_t qt_tb_masked_crc(const void *p, size_t n) {
    uint32_t c = qt_crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static void le64(unsigned char *o, uint64_t v) { for (int i = 0; i < 8; i++) o[i] = (unsigned char)(v >> (8 * i)); }
static void le32(unsigned char *o, uint32_t v) { for (int i = 0; i < 4; i++) o[i] = (unsigned char)(v >> (8 * i)); }

/* One TFRecord holding the serialized event, flushed. */
static int write_event(qt_tb_writer *w, const Qtune__Tb__Event *ev) {
    size_t n = qtune__tb__event__get_packed_size(ev);
    unsigned char *buf = qt_malloc(n + 16, "a TensorBoard event");
    if (!buf) return QT_ENOMEM;
    unsigned char *data = buf + 12;
    qtune__tb__event__pack(ev, data);
    le64(buf, (uint64_t)n);
    le32(buf + 8, qt_tb_masked_crc(buf, 8));
    le32(data + n, qt_tb_masked_crc(data, n));
    int ok = fwrite(buf, 1, n + 16, w->f) == n + 16 && fflush(w->f) == 0;
    qt_free(buf);
    if (!ok) return QT_ERR(QT_EIO, "cannot write %s: %s; check free disk space", w->path, strerror(errno));
    return QT_OK;
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int qt_tb_open(qt_tb_writer **out, const char *logdir) {
    *out = NULL;
    QT_TRY(qt_mkdir_p(logdir));
    qt_tb_writer *w = qt_calloc(1, sizeof *w, "the TensorBoard writer");
    if (!w) return QT_ENOMEM;
    char host[256] = "localhost", name[512];
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");
    double now = wall_now();
    /* torch's SummaryWriter names its files so: TensorBoard reads every
     * "*tfevents*" file in the folder, in name order */
    snprintf(name, sizeof name, "events.out.tfevents.%lld.%s.%ld.0", (long long)now, host, (long)getpid());
    int rc = qt_path_join(w->path, sizeof w->path, logdir, name);
    if (rc == QT_OK) {
        w->f = fopen(w->path, "wbx"); /* a new file, never another run's */
        if (!w->f) rc = QT_ERR(QT_EIO, "cannot create the TensorBoard event file %s: %s", w->path, strerror(errno));
    }
    if (rc == QT_OK) {
        Qtune__Tb__Event ev = QTUNE__TB__EVENT__INIT;
        ev.wall_time = now;
        ev.what_case = QTUNE__TB__EVENT__WHAT_FILE_VERSION;
        ev.file_version = "brain.Event:2";
        rc = write_event(w, &ev);
    }
    if (rc != QT_OK) {
        qt_tb_close(w);
        return rc;
    }
    *out = w;
    return QT_OK;
}

int qt_tb_scalar(qt_tb_writer *w, const char *tag, long step, double wall_time, float value) {
    Qtune__Tb__SummaryValue v = QTUNE__TB__SUMMARY_VALUE__INIT, *vs[1] = {&v};
    v.tag = (char *)tag;
    v.value_case = QTUNE__TB__SUMMARY_VALUE__VALUE_SIMPLE_VALUE;
    v.simple_value = value;
    Qtune__Tb__Summary s = QTUNE__TB__SUMMARY__INIT;
    s.n_value = 1;
    s.value = vs;
    Qtune__Tb__Event ev = QTUNE__TB__EVENT__INIT;
    ev.wall_time = wall_time > 0 ? wall_time : wall_now();
    ev.step = step;
    ev.what_case = QTUNE__TB__EVENT__WHAT_SUMMARY;
    ev.summary = &s;
    return write_event(w, &ev);
}

const char *qt_tb_path(const qt_tb_writer *w) { return w->path; }

void qt_tb_close(qt_tb_writer *w) {
    if (!w) return;
    if (w->f) fclose(w->f);
    qt_free(w);
}
