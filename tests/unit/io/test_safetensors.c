/* safetensors: writer -> reader round trips (F32/F16/BF16, streamed tensors,
 * shards through an index), and every malformed input giving the right error
 * code and a message naming the problem, never a crash. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/safetensors.h"

static char g_dir[64];

static int setup(void **state) {
    (void)state;
    strcpy(g_dir, "/tmp/qtune_st_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    return qt_rm_rf(g_dir) == QT_OK ? 0 : -1;
}

static void path_in(char *out, const char *name) {
    snprintf(out, 512, "%s/%s", g_dir, name);
}

/* A file with an 8-byte length, the given header bytes and data_len zero bytes. */
static void write_raw(const char *path, uint64_t hlen_field, const char *header, size_t data_len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)(hlen_field >> (8 * i));
    assert_int_equal(fwrite(len8, 1, 8, f), 8);
    size_t n = strlen(header);
    assert_int_equal(fwrite(header, 1, n, f), n);
    for (size_t i = 0; i < data_len; i++) fputc(0, f);
    fclose(f);
}

static void write_hdr(const char *path, const char *header, size_t data_len) {
    write_raw(path, strlen(header), header, data_len);
}

/* Opens path expecting failure with code; the message must contain want. */
static void expect_fail(const char *path, int code, const char *want) {
    st_file *f = (st_file *)1;
    qt_error_clear();
    int rc = st_open(path, &f);
    if (rc != code || !strstr(qt_error_message(), want))
        fail_msg("st_open(%s): rc %d (want %d), message '%s' (want '%s')", path, rc, code, qt_error_message(), want);
    assert_null(f);
}

static int fill_ramp(void *ctx, float *dst, size_t offset, size_t n) {
    float scale = *(const float *)ctx;
    for (size_t i = 0; i < n; i++) dst[i] = scale * (float)(offset + i);
    return QT_OK;
}

static void test_round_trip_dtypes(void **state) {
    (void)state;
    enum { R = 3, K = 5 };
    float src[R * K];
    for (int i = 0; i < R * K; i++) src[i] = 0.25f * (float)i - 1.5f;
    int64_t shape[2] = {R, K}, vshape[1] = {100000}, eshape[2] = {0, 4};
    float scale = 0.5f;
    st_writer *w;
    assert_int_equal(st_writer_new(&w), QT_OK);
    assert_int_equal(st_writer_add(w, "z.f32", QT_F32, 2, shape, src, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "a.bf16", QT_BF16, 2, shape, src, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "m.f16", QT_F16, 2, shape, src, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "empty", QT_F32, 2, eshape, NULL, QT_F32), QT_OK);
    /* streamed, longer than one write chunk */
    assert_int_equal(st_writer_add_fn(w, "ramp", QT_F32, 1, vshape, fill_ramp, &scale), QT_OK);
    assert_int_equal(st_writer_add(w, "a.bf16", QT_F32, 2, shape, src, QT_F32), QT_EINVAL); /* twice */
    assert_int_equal(st_writer_set_metadata(w, "note", "a \"quoted\" value"), QT_OK);
    char path[512];
    path_in(path, "rt.safetensors");
    assert_int_equal(st_writer_write(w, path), QT_OK);
    st_writer_free(w);

    /* Header: 8-byte aligned, metadata first, tensors in name order. */
    char *raw;
    size_t len;
    assert_int_equal(qt_read_file(path, 1 << 22, &raw, &len), QT_OK);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | (uint8_t)raw[i];
    assert_int_equal(hlen % 8, 0);
    assert_non_null(strstr(raw + 8, "\"__metadata__\":{\"format\":\"pt\""));
    const char *pa = strstr(raw + 8, "\"a.bf16\""), *pm = strstr(raw + 8, "\"m.f16\""), *pz = strstr(raw + 8, "\"z.f32\"");
    assert_true(pa && pm && pz && pa < pm && pm < pz);
    qt_free(raw);

    st_file *f;
    assert_int_equal(st_open(path, &f), QT_OK);
    assert_int_equal(st_count(f), 5);
    assert_string_equal(st_at(f, 0)->name, "a.bf16"); /* sorted */
    assert_null(st_at(f, 5));
    assert_null(st_find(f, "nope"));
    float back[R * K];
    const st_tensor *t = st_find(f, "z.f32");
    assert_non_null(t);
    assert_int_equal(t->dtype, QT_F32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], R);
    assert_int_equal(t->shape[1], K);
    assert_int_equal(t->numel, R * K);
    assert_int_equal(t->nbytes, R * K * 4);
    assert_int_equal((uintptr_t)st_at(f, 0)->data % 8, 0); /* the data section starts 8-aligned */
    assert_int_equal(st_read_f32(t, back), QT_OK);
    assert_memory_equal(back, src, sizeof src);
    t = st_find(f, "m.f16");
    assert_int_equal(t->dtype, QT_F16);
    assert_int_equal(t->nbytes, R * K * 2);
    assert_int_equal(st_read_f32(t, back), QT_OK);
    for (int i = 0; i < R * K; i++) assert_true(back[i] == src[i]); /* quarter steps are exact in f16 */
    t = st_find(f, "a.bf16");
    assert_int_equal(t->dtype, QT_BF16);
    assert_int_equal(st_read_f32(t, back), QT_OK);
    for (int i = 0; i < R * K; i++) assert_true(back[i] == src[i]);
    t = st_find(f, "empty");
    assert_int_equal(t->numel, 0);
    t = st_find(f, "ramp");
    float *big = qt_malloc(100000 * sizeof(float), "test");
    assert_int_equal(st_read_f32(t, big), QT_OK);
    for (int i = 0; i < 100000; i += 997) assert_true(big[i] == 0.5f * (float)i);
    qt_free(big);

    const st_tensor *e;
    int64_t good[2] = {R, K}, bad[2] = {K, R};
    assert_int_equal(st_expect(f, "z.f32", 2, good, &e), QT_OK);
    assert_ptr_equal(e, st_find(f, "z.f32"));
    assert_int_equal(st_expect(f, "z.f32", 2, bad, &e), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "(3, 5)"));
    assert_non_null(strstr(qt_error_message(), "(5, 3)"));
    assert_int_equal(st_expect(f, "missing.weight", 2, good, &e), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "missing.weight"));
    st_close(f);

    /* The folder form finds model.safetensors. */
    char mpath[512];
    path_in(mpath, "model.safetensors");
    assert_int_equal(rename(path, mpath), 0);
    assert_int_equal(st_open(g_dir, &f), QT_OK);
    assert_int_equal(st_count(f), 5);
    st_close(f);
    unlink(mpath);
}

/* A header whose length is odd leaves 16-bit data misaligned: still read right. */
static void test_unaligned_half(void **state) {
    (void)state;
    char path[512];
    path_in(path, "odd.safetensors");
    const char *h = "{\"x\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,6]}}"; /* 55 bytes */
    assert_int_equal(strlen(h) % 2, 1);
    FILE *fp = fopen(path, "wb");
    uint8_t len8[8] = {(uint8_t)strlen(h)};
    fwrite(len8, 1, 8, fp);
    fwrite(h, 1, strlen(h), fp);
    uint16_t v[3] = {qt_f32_to_bf16(1.0f), qt_f32_to_bf16(-2.0f), qt_f32_to_bf16(0.5f)};
    fwrite(v, 2, 3, fp);
    fclose(fp);
    st_file *f;
    assert_int_equal(st_open(path, &f), QT_OK);
    float out[3];
    assert_int_equal(st_read_f32(st_find(f, "x"), out), QT_OK);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f);
    st_close(f);
}

/* Slices of a tensor (what each rank of a resumed run reads from an optimizer
 * part) and the header's metadata. */
static void test_slices_and_metadata(void **state) {
    (void)state;
    enum { N = 1000 };
    float src[N];
    uint16_t half[N];
    for (int i = 0; i < N; i++) src[i] = 0.5f * (float)i - 7.0f;
    int64_t shape[1] = {N};
    st_writer *w;
    assert_int_equal(st_writer_new(&w), QT_OK);
    assert_int_equal(st_writer_add(w, "v", QT_F32, 1, shape, src, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "h", QT_BF16, 1, shape, src, QT_F32), QT_OK);
    assert_int_equal(st_writer_set_metadata(w, "range_lo", "250"), QT_OK);
    char path[512];
    path_in(path, "slices.safetensors");
    assert_int_equal(st_writer_write(w, path), QT_OK);
    st_writer_free(w);
    qt_convert_from_f32(half, QT_BF16, src, N);

    st_file *f;
    assert_int_equal(st_open(path, &f), QT_OK);
    assert_string_equal(st_metadata(f, "range_lo"), "250");
    assert_string_equal(st_metadata(f, "format"), "pt");
    assert_null(st_metadata(f, "range_hi"));
    const st_tensor *v = st_find(f, "v"), *h = st_find(f, "h");
    float out[N + 1];
    const size_t cuts[][2] = {{0, N}, {0, 1}, {999, 1}, {250, 500}, {13, 0}, {N, 0}};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
        size_t off = cuts[c][0], n = cuts[c][1];
        out[n] = 12345.0f; /* nothing past the slice is written */
        assert_int_equal(st_read_f32_range(v, off, n, out), QT_OK);
        assert_memory_equal(out, src + off, n * sizeof(float));
        assert_true(out[n] == 12345.0f);
        assert_int_equal(st_read_f32_range(h, off, n, out), QT_OK);
        for (size_t i = 0; i < n; i++) assert_true(out[i] == qt_bf16_to_f32(half[off + i]));
    }
    qt_error_clear();
    assert_int_equal(st_read_f32_range(v, 999, 2, out), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "'v'"));
    assert_int_equal(st_read_f32_range(v, N + 1, 0, out), QT_EINVAL);
    assert_int_equal(st_read_f32_range(v, 1, SIZE_MAX, out), QT_EINVAL);
    st_close(f);

    /* a header without __metadata__ (other writers) */
    path_in(path, "nometa.safetensors");
    write_hdr(path, "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    assert_int_equal(st_open(path, &f), QT_OK);
    assert_null(st_metadata(f, "format"));
    st_close(f);
}

static void write_shard(const char *name, const char *tensor, float value) {
    char path[512];
    path_in(path, name);
    float d[4] = {value, value, value, value};
    int64_t shape[1] = {4};
    st_writer *w;
    assert_int_equal(st_writer_new(&w), QT_OK);
    assert_int_equal(st_writer_add(w, tensor, QT_F32, 1, shape, d, QT_F32), QT_OK);
    assert_int_equal(st_writer_write(w, path), QT_OK);
    st_writer_free(w);
}

static void write_index(const char *json) {
    char path[512];
    path_in(path, "model.safetensors.index.json");
    assert_int_equal(qt_write_file_atomic(path, json, strlen(json)), QT_OK);
}

static void test_sharded(void **state) {
    (void)state;
    write_shard("model-00001-of-00002.safetensors", "model.embed_tokens.weight", 1.0f);
    write_shard("model-00002-of-00002.safetensors", "lm_head.weight", 2.0f);
    write_index("{\"metadata\":{\"total_size\":32},\"weight_map\":{"
                "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                "\"lm_head.weight\":\"model-00002-of-00002.safetensors\"}}");
    st_file *f;
    assert_int_equal(st_open(g_dir, &f), QT_OK);
    assert_int_equal(st_count(f), 2);
    const st_tensor *a = st_find(f, "model.embed_tokens.weight"), *b = st_find(f, "lm_head.weight");
    assert_non_null(a);
    assert_non_null(b);
    assert_int_not_equal(a->shard, b->shard);
    assert_non_null(strstr(st_shard_path(f, b->shard), "00002"));
    float out[4];
    assert_int_equal(st_read_f32(b, out), QT_OK);
    assert_true(out[3] == 2.0f);
    st_close(f);

    char ipath[512];
    path_in(ipath, "model.safetensors.index.json");
    /* The index names a file for a tensor that file does not hold. */
    write_index("{\"weight_map\":{\"lm_head.weight\":\"model-00001-of-00002.safetensors\"}}");
    expect_fail(ipath, QT_EFORMAT, "does not hold it");
    /* Shard paths leaving the folder. */
    write_index("{\"weight_map\":{\"lm_head.weight\":\"../x.safetensors\"}}");
    expect_fail(g_dir, QT_EFORMAT, "not a plain relative path");
    write_index("{\"weight_map\":{\"lm_head.weight\":\"/etc/passwd\"}}");
    expect_fail(g_dir, QT_EFORMAT, "not a plain relative path");
    write_index("{\"weight_map\":{\"lm_head.weight\":\"sub/../../x\"}}");
    expect_fail(g_dir, QT_EFORMAT, "not a plain relative path");
    write_index("{\"weight_map\":{\"lm_head.weight\":\"\"}}");
    expect_fail(g_dir, QT_EFORMAT, "not a plain relative path");
    /* The same tensor in two shards. */
    write_shard("dup.safetensors", "lm_head.weight", 3.0f);
    write_index("{\"weight_map\":{\"lm_head.weight\":\"model-00002-of-00002.safetensors\","
                "\"other\":\"dup.safetensors\"}}");
    expect_fail(g_dir, QT_EFORMAT, "two shards");
    /* Broken index JSON, and a missing shard file. */
    write_index("{\"weight_map\": [");
    expect_fail(g_dir, QT_EFORMAT, "not a JSON object");
    write_index("{\"nothing\":1}");
    expect_fail(g_dir, QT_EFORMAT, "weight_map");
    write_index("{\"weight_map\":{\"a\":\"absent.safetensors\"}}");
    expect_fail(g_dir, QT_EIO, "absent.safetensors");
    write_index("{\"weight_map\":{\"a\":5}}");
    expect_fail(g_dir, QT_EFORMAT, "not a file name");
    unlink(ipath);
}

static void test_malformed(void **state) {
    (void)state;
    char p[512];
    path_in(p, "bad.safetensors");

    FILE *fp = fopen(p, "wb");
    fwrite("\x10\x00\x00", 1, 3, fp); /* truncated inside the length */
    fclose(fp);
    expect_fail(p, QT_EFORMAT, "too short");

    fp = fopen(p, "wb");
    fclose(fp);
    expect_fail(p, QT_EFORMAT, "empty");

    write_raw(p, 4096, "{}", 0); /* header length past the end of the file */
    expect_fail(p, QT_EFORMAT, "runs past the end");

    write_raw(p, (uint64_t)1 << 40, "{}", 0); /* absurd header length */
    expect_fail(p, QT_EFORMAT, "more than");

    write_raw(p, UINT64_MAX, "{}", 0); /* would wrap 8 + N */
    expect_fail(p, QT_EFORMAT, "more than");

    write_hdr(p, "not json at all", 0);
    expect_fail(p, QT_EFORMAT, "not a JSON object");

    write_hdr(p, "[1,2,3]", 0);
    expect_fail(p, QT_EFORMAT, "not a JSON object");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8); /* cut JSON */
    expect_fail(p, QT_EFORMAT, "not a JSON object");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8); /* data cut short */
    expect_fail(p, QT_EFORMAT, "run past");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[1000,1008]}}", 8);
    expect_fail(p, QT_EFORMAT, "'w'");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8);
    expect_fail(p, QT_EFORMAT, "end before they begin");

    write_hdr(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12);
    expect_fail(p, QT_EFORMAT, "overlap");

    write_hdr(p, "{\"w\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    expect_fail(p, QT_EFORMAT, "unknown dtype 'Q7'");

    write_hdr(p, "{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8);
    expect_fail(p, QT_EUNSUPPORTED, "I64");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8);
    expect_fail(p, QT_EFORMAT, "need 12");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8);
    expect_fail(p, QT_EFORMAT, "appears twice");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8);
    expect_fail(p, QT_EFORMAT, "shape entry 0");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}", 8);
    expect_fail(p, QT_EFORMAT, "shape entry 0");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4);
    expect_fail(p, QT_EFORMAT, "9 dimensions");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,4]}}", 4);
    expect_fail(p, QT_EFORMAT, "overflow");

    write_hdr(p, "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    expect_fail(p, QT_EFORMAT, "'dtype'");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4);
    expect_fail(p, QT_EFORMAT, "'shape'");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4);
    expect_fail(p, QT_EFORMAT, "data_offsets");

    write_hdr(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,-4]}}", 4);
    expect_fail(p, QT_EFORMAT, "data_offsets");

    write_hdr(p, "{\"w\":[1,2]}", 4);
    expect_fail(p, QT_EFORMAT, "not a JSON object");

    write_hdr(p, "{\"__metadata__\":7}", 0);
    expect_fail(p, QT_EFORMAT, "__metadata__");

    path_in(p, "absent.safetensors");
    expect_fail(p, QT_EIO, "absent.safetensors");
    expect_fail(g_dir, QT_EIO, "neither model.safetensors");

    /* An empty table with metadata only is a valid file. */
    path_in(p, "meta.safetensors");
    write_hdr(p, "{\"__metadata__\":{\"format\":\"pt\"}}", 0);
    st_file *f;
    assert_int_equal(st_open(p, &f), QT_OK);
    assert_int_equal(st_count(f), 0);
    st_close(f);
}

/* Every truncation of a good file fails cleanly (no crash, no OK). */
static void test_every_truncation(void **state) {
    (void)state;
    float d[6] = {1, 2, 3, 4, 5, 6};
    int64_t s1[1] = {6}, s2[2] = {2, 3};
    st_writer *w;
    char path[512], cut[512];
    path_in(path, "good.safetensors");
    path_in(cut, "cut.safetensors");
    assert_int_equal(st_writer_new(&w), QT_OK);
    assert_int_equal(st_writer_add(w, "a", QT_F32, 1, s1, d, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "b", QT_BF16, 2, s2, d, QT_F32), QT_OK);
    assert_int_equal(st_writer_write(w, path), QT_OK);
    st_writer_free(w);
    char *buf;
    size_t len;
    assert_int_equal(qt_read_file(path, 1 << 20, &buf, &len), QT_OK);
    for (size_t n = 0; n < len; n++) {
        assert_int_equal(qt_write_file_atomic(cut, buf, n), QT_OK);
        st_file *f;
        int rc = st_open(cut, &f);
        assert_int_not_equal(rc, QT_OK);
        assert_true(strlen(qt_error_message()) > 0);
    }
    qt_free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip_dtypes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unaligned_half, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sharded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_slices_and_metadata, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_every_truncation, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
