/* data loader: packing boundaries, positions and doc_start, padding mode,
 * targets shifted within an example, overlong handling, eval passes,
 * deterministic shuffling, sharding over 1/2/4 ranks, resume from a saved
 * position, and the same stream for any number of prefetch threads. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "data/loader.h"
#include "test_data_common.h"

static int setup(void **state) { (void)state; make_tmpdir(); qt_log_set_level(QT_LOG_ERROR); return 0; }
static int teardown(void **state) { (void)state; remove_tmpdir(); return 0; }

/* n examples; example i has length len_of(i) and tokens 1000*i+1000+j (so the
 * first token names the example); odd tokens of example 3 are unlabelled. */
static int len_of(int i) { return 1 + (i * 7) % 6; }

static const char *write_examples(const char *name, int n) {
    size_t cap = (size_t)n * 128 + 64;
    char *buf = malloc(cap), *w = buf;
    for (int i = 0; i < n; i++) {
        w += sprintf(w, "{\"input_ids\": [");
        for (int j = 0; j < len_of(i); j++) w += sprintf(w, "%s%d", j ? "," : "", 1000 * (i + 1) + j);
        w += sprintf(w, "]}\n");
    }
    const char *p = write_tmp(name, buf);
    free(buf);
    return p;
}

static dl_config cfg_for(const char *path, int T, int B) {
    dl_config c;
    dl_config_default(&c);
    c.path = path;
    c.seq_len = T;
    c.micro_batch = B;
    c.shuffle = 0;
    c.no_cache = 1;
    c.num_workers = 1;
    c.prefetch = 2;
    return c;
}

static void test_packing_boundaries(void **state) {
    (void)state;
    const char *p = write_tmp("pack.jsonl",
                              "{\"input_ids\": [1, 2, 3]}\n"
                              "{\"input_ids\": [4, 5, 6, 7], \"labels\": [-100, -100, 6, 7]}\n"
                              "{\"input_ids\": [8, 9]}\n"
                              "{\"input_ids\": [10, 11, 12, 13, 14]}\n");
    dl_config c = cfg_for(p, 8, 2);
    c.eval = 1;
    c.pack_window = 1; /* greedy, in order */
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    qt_batch b;
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    assert_int_equal(dl_next(l, &b), QT_OK);
    const int I = QT_IGNORE_INDEX;
    /* row 0: [1 2 3][4 5 6 7] pad; row 1: [8 9][10 11 12 13 14] pad */
    static const int32_t in[16] = {1, 2, 3, 4, 5, 6, 7, 0, 8, 9, 10, 11, 12, 13, 14, 0};
    static const int32_t tg[16] = {2, 3, I, I, 6, 7, I, I, 9, I, 11, 12, 13, 14, I, I};
    static const int32_t pos[16] = {0, 1, 2, 0, 1, 2, 3, 0, 0, 1, 0, 1, 2, 3, 4, 0};
    static const int32_t ds[16] = {0, 0, 0, 3, 3, 3, 3, 7, 0, 0, 2, 2, 2, 2, 2, 7};
    assert_memory_equal(b.inputs, in, sizeof in);
    assert_memory_equal(b.targets, tg, sizeof tg);
    assert_memory_equal(b.positions, pos, sizeof pos);
    assert_memory_equal(b.doc_start, ds, sizeof ds);
    assert_int_equal(b.n_target, 9);
    dl_state s = dl_state_get(l);
    assert_int_equal(s.epoch, 0);
    assert_int_equal(s.index, 2); /* rows */
    assert_int_equal(dl_next(l, &b), DL_END);
    assert_int_equal(dl_next(l, &b), DL_END);
    dl_stats st;
    dl_get_stats(l, &st);
    assert_int_equal(st.n_examples, 4);
    assert_int_equal(st.n_tokens, 14);
    assert_int_equal(st.n_labels, 12);
    assert_int_equal(st.n_targets, 9);
    assert_int_equal(st.n_unlabelled, 0);
    assert_int_equal(st.n_batches, 1);
    assert_int_equal(st.n_pad, 2);
    assert_int_equal(dl_tokens_per_epoch(l), 14);
    dl_batch_free(&b);
    dl_close(l);
}

/* Best-fit decreasing: lengths 3 4 2 5 in rows of 8 -> [5 3] [4 2]; the
 * greedy order would need 2 rows too, but lengths 5 4 3 2 2 need 3 greedy
 * rows ([5] [4 3] [2 2]) and 2 best-fit ones ([5 3] [4 2 2]). */
static void test_packing_best_fit(void **state) {
    (void)state;
    const char *p = write_tmp("bfd.jsonl",
                              "{\"input_ids\": [1, 1, 1, 1, 1]}\n"
                              "{\"input_ids\": [2, 2, 2, 2]}\n"
                              "{\"input_ids\": [3, 3, 3]}\n"
                              "{\"input_ids\": [4, 4]}\n"
                              "{\"input_ids\": [5, 5]}\n");
    dl_config c = cfg_for(p, 8, 1);
    c.eval = 1;
    dl_loader *l;
    qt_batch b;
    int rows[2];
    for (int w = 0; w < 2; w++) {
        c.pack_window = w ? 1024 : 1;
        assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
        assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
        rows[w] = 0;
        int seen[6] = {0};
        while (dl_next(l, &b) == QT_OK) {
            rows[w]++;
            for (int t = 0; t < 8; t++)
                if (b.positions[t] == 0 && b.targets[t] != QT_IGNORE_INDEX) seen[b.inputs[t]]++;
        }
        for (int e = 1; e <= 5; e++) assert_int_equal(seen[e], 1); /* every example once, whole */
        dl_batch_free(&b);
        dl_close(l);
    }
    assert_int_equal(rows[0], 3);
    assert_int_equal(rows[1], 2);
    /* the best-fit rows exactly: [5x1 3x3] [4x2 2x4 2x5] */
    c.pack_window = 1024;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    static const int32_t r0[8] = {1, 1, 1, 1, 1, 3, 3, 3}, r1[8] = {2, 2, 2, 2, 4, 4, 5, 5};
    static const int32_t d1[8] = {0, 0, 0, 0, 4, 4, 6, 6};
    assert_int_equal(dl_next(l, &b), QT_OK);
    assert_memory_equal(b.inputs, r0, sizeof r0);
    assert_int_equal(dl_next(l, &b), QT_OK);
    assert_memory_equal(b.inputs, r1, sizeof r1);
    assert_memory_equal(b.doc_start, d1, sizeof d1);
    assert_int_equal(dl_next(l, &b), DL_END);
    dl_batch_free(&b);
    dl_close(l);
}

static void test_padding_mode(void **state) {
    (void)state;
    const char *p = write_tmp("pad.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n{\"input_ids\": [6]}\n");
    dl_config c = cfg_for(p, 4, 2);
    c.packing = 0;
    c.eval = 1;
    c.pad_id = 77;
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    qt_batch b;
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    const int I = QT_IGNORE_INDEX;
    assert_int_equal(dl_next(l, &b), QT_OK);
    static const int32_t in1[8] = {1, 2, 3, 77, 4, 5, 77, 77};
    static const int32_t tg1[8] = {2, 3, I, I, 5, I, I, I};
    static const int32_t ds1[8] = {0, 0, 0, 3, 0, 0, 2, 2};
    assert_memory_equal(b.inputs, in1, sizeof in1);
    assert_memory_equal(b.targets, tg1, sizeof tg1);
    assert_memory_equal(b.doc_start, ds1, sizeof ds1);
    assert_int_equal(b.n_target, 3);
    /* the last batch of an eval pass: one example, the other row all padding */
    assert_int_equal(dl_next(l, &b), QT_OK);
    static const int32_t in2[8] = {6, 77, 77, 77, 77, 77, 77, 77};
    assert_memory_equal(b.inputs, in2, sizeof in2);
    for (int t = 0; t < 8; t++) assert_int_equal(b.targets[t], I);
    assert_int_equal(b.n_target, 0);
    assert_int_equal(dl_next(l, &b), DL_END);
    dl_stats st;
    dl_get_stats(l, &st);
    assert_int_equal(st.n_unlabelled, 1); /* the one-token example has nothing to predict */
    assert_int_equal(st.n_targets, 3);
    dl_batch_free(&b);
    dl_close(l);
}

static void test_overlong_truncate_and_split(void **state) {
    (void)state;
    const char *p = write_tmp("long.jsonl", "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}\n{\"input_ids\": [11, 12]}\n");
    dl_config c = cfg_for(p, 4, 1);
    c.packing = 0;
    c.eval = 1;
    dl_loader *l;
    qt_batch b;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    dl_stats st;
    dl_get_stats(l, &st);
    assert_int_equal(st.n_truncated, 1);
    assert_int_equal(st.n_tokens_dropped, 6);
    assert_int_equal(st.n_labels, 4 + 2);
    assert_int_equal(st.n_targets, 3 + 1);
    assert_int_equal(dl_num_examples(l), 2);
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    assert_int_equal(dl_next(l, &b), QT_OK);
    static const int32_t t1[4] = {1, 2, 3, 4};
    assert_memory_equal(b.inputs, t1, sizeof t1);
    dl_batch_free(&b);
    dl_close(l);

    /* split: pieces of T overlapping by one token: [1..4] [4..7] [7..10] */
    c.overlong = DL_OVERLONG_SPLIT;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    dl_get_stats(l, &st);
    assert_int_equal(st.n_split, 1);
    assert_int_equal(dl_num_examples(l), 4);
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    int64_t labels = 0;
    static const int32_t first[4] = {1, 4, 7, 11};
    for (int k = 0; k < 4; k++) {
        assert_int_equal(dl_next(l, &b), QT_OK);
        assert_int_equal(b.inputs[0], first[k]);
        labels += b.n_target;
    }
    assert_int_equal(labels, 9 + 1); /* every label of the long example predicted once */
    assert_int_equal(dl_next(l, &b), DL_END);
    dl_batch_free(&b);
    dl_close(l);
}

/* The first tokens of the examples in the next n batches (padding mode, B=1). */
static void take(dl_loader *l, int n, int32_t *out) {
    qt_batch b;
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    for (int i = 0; i < n; i++) {
        assert_int_equal(dl_next(l, &b), QT_OK);
        out[i] = b.inputs[0];
    }
    dl_batch_free(&b);
}

static void test_shuffle_deterministic(void **state) {
    (void)state;
    const char *p = write_examples("shuf.jsonl", 50);
    dl_config c = cfg_for(p, 8, 1);
    c.packing = 0;
    c.shuffle = 1;
    c.seed = 42;
    int32_t a[100], b2[100], d[100];
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    take(l, 100, a);
    dl_close(l);
    c.num_workers = 3; /* same stream with more threads and a deeper queue */
    c.prefetch = 7;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    take(l, 100, b2);
    dl_close(l);
    assert_memory_equal(a, b2, sizeof a);
    /* each epoch is a permutation, and epochs differ */
    int seen[51] = {0};
    for (int i = 0; i < 50; i++) seen[a[i] / 1000]++;
    for (int i = 1; i <= 50; i++) assert_int_equal(seen[i], 1);
    assert_memory_not_equal(a, a + 50, 50 * sizeof(int32_t));
    int sorted = 1;
    for (int i = 1; i < 50; i++) sorted &= a[i] > a[i - 1];
    assert_false(sorted);
    c.seed = 43;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    take(l, 100, d);
    dl_close(l);
    assert_memory_not_equal(a, d, sizeof a);
}

static void test_sharding_covers_each_example_once(void **state) {
    (void)state;
    const int N = 37;
    const char *p = write_examples("shard.jsonl", N);
    for (int world = 1; world <= 4; world *= 2) {
        for (int epoch = 0; epoch < 2; epoch++) {
            int seen[38] = {0};
            int total = 0;
            for (int rank = 0; rank < world; rank++) {
                dl_config c = cfg_for(p, 8, 1);
                c.packing = 0;
                c.shuffle = 1;
                c.seed = 7;
                c.rank = rank;
                c.world = world;
                dl_loader *l;
                assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
                dl_stats st;
                dl_get_stats(l, &st);
                int n = (int)st.n_examples_rank;
                assert_true(n == N / world || n == N / world + 1);
                assert_int_equal(dl_state_set(l, (dl_state){epoch, 0}), QT_OK);
                int32_t first[40];
                take(l, n, first);
                for (int i = 0; i < n; i++) seen[first[i] / 1000]++;
                total += n;
                dl_state s = dl_state_get(l);
                assert_int_equal(s.epoch, epoch + 1); /* the share of the epoch is used up */
                assert_int_equal(s.index, 0);
                dl_close(l);
            }
            assert_int_equal(total, N);
            for (int i = 1; i <= N; i++) assert_int_equal(seen[i], 1);
        }
    }
    /* more ranks than examples is refused */
    const char *q = write_examples("tiny.jsonl", 2);
    dl_config c = cfg_for(q, 8, 1);
    c.rank = 0;
    c.world = 4;
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "ranks"));
}

/* Packed batches over several epochs: a run resumed from a saved position
 * yields the same batches as the run that went on. */
static void test_resume_exact(void **state) {
    (void)state;
    const char *p = write_examples("resume.jsonl", 23);
    dl_config c = cfg_for(p, 8, 2);
    c.shuffle = 1;
    c.seed = 5;
    c.num_workers = 2;
    c.prefetch = 3;
    dl_loader *a, *r;
    qt_batch x, y;
    assert_int_equal(dl_open(&c, NULL, &a), QT_OK);
    assert_int_equal(dl_batch_alloc(a, &x), QT_OK);
    for (int i = 0; i < 9; i++) assert_int_equal(dl_next(a, &x), QT_OK);
    dl_state s = dl_state_get(a);
    assert_true(s.epoch >= 1); /* 9 batches of 2 rows span more than one epoch of 23 short examples */
    assert_int_equal(dl_open(&c, NULL, &r), QT_OK);
    assert_int_equal(dl_batch_alloc(r, &y), QT_OK);
    assert_int_equal(dl_next(r, &y), QT_OK); /* filled ahead, then thrown away by state_set */
    assert_int_equal(dl_state_set(r, s), QT_OK);
    for (int i = 0; i < 12; i++) {
        assert_int_equal(dl_next(a, &x), QT_OK);
        assert_int_equal(dl_next(r, &y), QT_OK);
        assert_memory_equal(x.inputs, y.inputs, 16 * sizeof(int32_t));
        assert_memory_equal(x.targets, y.targets, 16 * sizeof(int32_t));
        assert_memory_equal(x.doc_start, y.doc_start, 16 * sizeof(int32_t));
        assert_int_equal(x.n_target, y.n_target);
        dl_state sa = dl_state_get(a), sr = dl_state_get(r);
        assert_int_equal(sa.epoch, sr.epoch);
        assert_int_equal(sa.index, sr.index);
    }
    assert_int_equal(dl_state_set(r, (dl_state){0, 24}), QT_EINVAL); /* past the end of the epoch */
    dl_batch_free(&x);
    dl_batch_free(&y);
    dl_close(a);
    dl_close(r);
}

/* K batches of an accumulation window held at once, each counting its labels. */
static void test_window_of_batches(void **state) {
    (void)state;
    const char *p = write_examples("win.jsonl", 10);
    dl_config c = cfg_for(p, 8, 1);
    c.eval = 1;
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    qt_batch w[4];
    int64_t labels = 0;
    for (int k = 0; k < 4; k++) assert_int_equal(dl_batch_alloc(l, &w[k]), QT_OK);
    for (int k = 0; k < 4; k++) { assert_int_equal(dl_next(l, &w[k]), QT_OK); labels += w[k].n_target; }
    for (int k = 0; k < 4; k++) {
        int64_t n = 0;
        for (int t = 0; t < 8; t++) n += w[k].targets[t] != QT_IGNORE_INDEX;
        assert_int_equal(n, w[k].n_target);
    }
    assert_true(labels > 0);
    assert_ptr_not_equal(w[0].inputs, w[1].inputs);
    qt_batch wrong = {0};
    assert_int_equal(dl_next(l, &wrong), QT_EINVAL);
    for (int k = 0; k < 4; k++) dl_batch_free(&w[k]);
    dl_close(l);
}

static void test_config_errors(void **state) {
    (void)state;
    const char *p = write_examples("cfg.jsonl", 3);
    dl_config c = cfg_for(p, 1, 1);
    dl_loader *l;
    assert_int_equal(dl_open(&c, NULL, &l), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "seq_len"));
    c = cfg_for(p, 8, 1);
    c.rank = 2;
    c.world = 2;
    assert_int_equal(dl_open(&c, NULL, &l), QT_EINVAL);
    c = cfg_for(NULL, 8, 1);
    assert_int_equal(dl_open(&c, NULL, &l), QT_EINVAL);
    /* several files read in order, each with its own format detection */
    const char *q = write_tmp("cfg2.jsonl", "{\"input_ids\": [5, 6]}\n");
    const char *paths[2] = {p, q};
    c = cfg_for(NULL, 8, 1);
    c.paths = paths;
    c.n_paths = 2;
    c.eval = 1;
    c.num_workers = 0; /* auto */
    assert_int_equal(dl_open(&c, NULL, &l), QT_OK);
    assert_int_equal(dl_num_examples(l), 4);
    dl_stats st;
    dl_get_stats(l, &st);
    assert_true(st.num_workers >= 1);
    assert_int_equal(st.n_files, 2);
    dl_close(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_packing_boundaries),
        cmocka_unit_test(test_packing_best_fit),
        cmocka_unit_test(test_padding_mode),
        cmocka_unit_test(test_overlong_truncate_and_split),
        cmocka_unit_test(test_shuffle_deterministic),
        cmocka_unit_test(test_sharding_covers_each_example_once),
        cmocka_unit_test(test_resume_exact),
        cmocka_unit_test(test_window_of_batches),
        cmocka_unit_test(test_config_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
