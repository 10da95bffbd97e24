/* The loader: a planner decides, in order, which rows make up each batch
 * (cheap: it looks only at lengths), and worker threads fill the batches'
 * arrays ahead of the consumer into a ring of `prefetch` slots. Batch k is
 * always planned k-th, whatever thread fills it, so the stream is the same for
 * any number of workers. Dimension letters: B rows, T tokens per row. */
#define _GNU_SOURCE /* qsort_r */
#include "data/loader.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/rng.h"
#include "data/source.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint64_t start;   /* first token, in its file's ids */
    uint32_t len;     /* tokens, <= T */
    uint32_t file;
} dl_seg;

typedef struct {
    int64_t seg;      /* index into segs */
    int32_t row, col; /* where the example starts in the batch */
} dl_item;

enum { SLOT_FREE = 0, SLOT_FILLING, SLOT_READY };

typedef struct {
    int64_t seq;      /* which batch of the stream this slot holds */
    int state;
    qt_batch b;       /* own (B, T) buffers */
    dl_item *items;   /* (n_items) in row order, then column order */
    int n_items;
    int64_t n_pad;    /* padding positions */
    dl_state end;     /* position after this batch */
} dl_slot;

struct dl_loader {
    dl_config cfg;
    int B, T, P;              /* micro-batch rows, row length, prefetch depth */
    int32_t pad_id;
    int n_files;
    dl_source *files;         /* (n_files) */
    dl_seg *segs;             /* (n_segs) every example after overlong handling, file order */
    int64_t n_segs, n_rank;   /* all ranks; this rank's share of an epoch */
    dl_stats stats;

    /* planner (under mu) */
    int64_t *order;           /* (n_segs) this epoch's permutation; NULL when not shuffling */
    int64_t order_epoch;      /* epoch `order` was drawn for, -1 none */
    int64_t *row_ex;          /* (n_rank) this rank's examples of rows_epoch, row by row */
    int64_t *row_off;         /* (n_rank+1) row r holds row_ex[row_off[r] .. row_off[r+1]) */
    int64_t n_rows, rows_epoch; /* rows in that epoch; the epoch they are for, -1 none */
    int W;                    /* packing window (examples); <= 1: greedy in order */
    int64_t *win_ex;          /* (W) scratch for best-fit decreasing: a window's examples, */
    int64_t *win_bin;         /* (W) the bin each is put in, */
    int32_t *bin_rem;         /* (W) each bin's room left, */
    int64_t *bin_off;         /* (W+1) where each bin's examples start in row_ex */
    dl_state plan;            /* next row to plan */
    int plan_eof;             /* eval: the pass has been planned */

    /* prefetch ring */
    dl_slot *slots;           /* (P) */
    pthread_t *threads;       /* (n_threads) */
    int n_threads, threads_running;
    pthread_mutex_t mu;
    pthread_cond_t cv_space, cv_ready;
    int64_t next_plan, next_consume, end_seq; /* end_seq: first seq with no batch, -1 unknown */
    int stop;
    dl_state consumed;        /* position after the last batch handed out */
};

void dl_config_default(dl_config *c) {
    memset(c, 0, sizeof *c);
    c->format = DL_FORMAT_AUTO;
    c->seq_len = 512;
    c->micro_batch = 1;
    c->packing = 1;
    c->shuffle = 1;
    c->mask_prompt = 1;
    c->prefetch = 4;
    c->world = 1;
    c->overlong = DL_OVERLONG_TRUNCATE;
    c->pad_id = -1;
    c->pack_window = 1024;
}

/* ---- epoch order and sharding ---- */

/* Fisher-Yates over all examples with a stream of (seed, epoch): every rank
 * draws the same permutation and takes its own positions of it. */
static void draw_order(dl_loader *l, int64_t epoch) {
    for (int64_t i = 0; i < l->n_segs; i++) l->order[i] = i;
    qt_rng rng;
    qt_rng_derive(&rng, l->cfg.seed, 0x6461746100ull /* "data" */, (uint64_t)epoch);
    for (int64_t i = l->n_segs - 1; i > 0; i--) {
        int64_t j = (int64_t)qt_rng_below(&rng, (uint64_t)i + 1);
        int64_t t = l->order[i]; l->order[i] = l->order[j]; l->order[j] = t;
    }
    l->order_epoch = epoch;
}

/* The example at position `index` of this rank's share of `epoch`. */
static int64_t example_at(dl_loader *l, int64_t epoch, int64_t index) {
    int64_t pos = (int64_t)l->cfg.rank + index * (int64_t)l->cfg.world;
    if (!l->order) return pos;
    if (l->order_epoch != epoch) draw_order(l, epoch);
    return l->order[pos];
}

/* ---- rows of an epoch ----
 * An epoch's plan splits this rank's examples (in epoch order) into rows of
 * at most T tokens: one example a row in padding mode; with packing, best-fit
 * decreasing inside consecutive windows of W examples (rows then in a random
 * order within the window when shuffling), or greedy in order when W <= 1. */

static int32_t seg_len(const dl_loader *l, int64_t seg) { return (int32_t)l->segs[seg].len; }

static void greedy_rows(dl_loader *l) {
    int64_t r = 0, col = 0;
    l->row_off[0] = 0;
    for (int64_t k = 0; k < l->n_rank; k++) {
        int32_t len = seg_len(l, l->row_ex[k]);
        if (k > 0 && (!l->cfg.packing || col + len > l->T)) { l->row_off[++r] = k; col = 0; }
        col += len;
    }
    l->row_off[++r] = l->n_rank;
    l->n_rows = r;
}

static int by_len_desc(const void *a, const void *b, void *loader) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    int32_t lx = seg_len(loader, x), ly = seg_len(loader, y);
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y; /* ties: a fixed order */
}

/* Best-fit decreasing over row_ex[a, a+m): longest first, each into the
 * open row with the least room that still fits it. Rewrites the window in
 * place as its rows, appending their starts to row_off. */
static void bfd_window(dl_loader *l, int64_t a, int64_t m, qt_rng *rng) {
    int64_t *ex = l->win_ex;
    memcpy(ex, l->row_ex + a, (size_t)m * sizeof *ex);
    qsort_r(ex, (size_t)m, sizeof *ex, by_len_desc, l);
    int64_t nb = 0;
    for (int64_t j = 0; j < m; j++) {
        int32_t len = seg_len(l, ex[j]);
        int64_t best = -1;
        for (int64_t b = 0; b < nb; b++)
            if (l->bin_rem[b] >= len && (best < 0 || l->bin_rem[b] < l->bin_rem[best])) best = b;
        if (best < 0) { best = nb++; l->bin_rem[best] = l->T; }
        l->bin_rem[best] -= len;
        l->win_bin[j] = best;
    }
    /* bins in creation order, or shuffled; examples in each bin longest first */
    int64_t *perm = l->bin_off; /* reused: bin b is written perm[b]-th */
    for (int64_t b = 0; b < nb; b++) perm[b] = b;
    for (int64_t b = nb - 1; rng && b > 0; b--) {
        int64_t c = (int64_t)qt_rng_below(rng, (uint64_t)b + 1), t = perm[b];
        perm[b] = perm[c];
        perm[c] = t;
    }
    /* counting sort of the window by (position of its bin) */
    int32_t *count = l->bin_rem; /* room no longer needed: count examples per written slot */
    for (int64_t b = 0; b < nb; b++) count[b] = 0;
    for (int64_t j = 0; j < m; j++) count[perm[l->win_bin[j]]]++;
    int64_t at = a;
    for (int64_t b = 0; b < nb; b++) {
        int64_t n = count[b];
        count[b] = (int32_t)(at - a); /* becomes the slot's next write offset */
        l->row_off[++l->n_rows] = at + n;
        at += n;
    }
    for (int64_t j = 0; j < m; j++) l->row_ex[a + count[perm[l->win_bin[j]]]++] = ex[j];
}

static void build_rows(dl_loader *l, int64_t epoch) {
    for (int64_t k = 0; k < l->n_rank; k++) l->row_ex[k] = example_at(l, epoch, k);
    if (!l->cfg.packing || l->W <= 1) {
        greedy_rows(l);
    } else {
        l->n_rows = 0;
        l->row_off[0] = 0;
        qt_rng rng;
        qt_rng_derive(&rng, l->cfg.seed, 0x7061636bull /* "pack" */, (uint64_t)epoch);
        for (int64_t a = 0; a < l->n_rank; a += l->W) {
            int64_t m = l->n_rank - a < l->W ? l->n_rank - a : l->W;
            bfd_window(l, a, m, l->order ? &rng : NULL);
        }
    }
    l->rows_epoch = epoch;
}

static int64_t rows_in(dl_loader *l, int64_t epoch) {
    if (l->rows_epoch != epoch) build_rows(l, epoch);
    return l->n_rows;
}

/* Decides the rows of the next batch into slot; 0 when the eval pass is over. */
static int plan_batch(dl_loader *l, dl_slot *s) {
    s->n_items = 0;
    for (int row = 0; row < l->B && !l->plan_eof; row++) {
        if (l->plan.index == rows_in(l, l->plan.epoch)) {
            if (l->cfg.eval) { l->plan_eof = 1; break; }
            l->plan.epoch++;
            l->plan.index = 0;
            rows_in(l, l->plan.epoch);
        }
        int col = 0;
        for (int64_t k = l->row_off[l->plan.index]; k < l->row_off[l->plan.index + 1]; k++) {
            s->items[s->n_items++] = (dl_item){.seg = l->row_ex[k], .row = row, .col = col};
            col += seg_len(l, l->row_ex[k]);
        }
        l->plan.index++;
    }
    if (!l->cfg.eval && l->plan.index == rows_in(l, l->plan.epoch)) {
        l->plan.epoch++;
        l->plan.index = 0;
    }
    s->end = l->plan;
    return s->n_items > 0;
}

/* ---- filling a batch ---- */

/* Pads [from, T) of a row: pad ids, no targets; the padding is its own
 * "example" (positions from 0, doc_start at its start) so it never attends
 * into real tokens. */
static void fill_pad(const dl_loader *l, qt_batch *b, int row, int from) {
    size_t base = (size_t)row * (size_t)l->T;
    for (int t = from; t < l->T; t++) {
        b->inputs[base + t] = l->pad_id;
        b->targets[base + t] = QT_IGNORE_INDEX;
        b->positions[base + t] = t - from;
        b->doc_start[base + t] = from;
    }
}

static void fill_batch(const dl_loader *l, dl_slot *s) {
    qt_batch *b = &s->b;
    int64_t n_target = 0, n_pad = 0;
    int item = 0;
    for (int row = 0; row < l->B; row++) {
        size_t base = (size_t)row * (size_t)l->T;
        int col = 0;
        for (; item < s->n_items && s->items[item].row == row; item++) {
            const dl_seg *g = &l->segs[s->items[item].seg];
            const dl_source *src = &l->files[g->file];
            const int32_t *ids = src->ids + g->start;
            const uint8_t *mask = src->mask + g->start;
            int c0 = s->items[item].col, L = (int)g->len;
            /* targets are shifted here: position j predicts token j+1 of the
             * same example, if that token carries a label */
            for (int j = 0; j < L; j++) {
                size_t t = base + (size_t)(c0 + j);
                b->inputs[t] = ids[j];
                b->positions[t] = j;
                b->doc_start[t] = c0;
                int lab = j + 1 < L && mask[j + 1];
                b->targets[t] = lab ? ids[j + 1] : QT_IGNORE_INDEX;
                n_target += lab;
            }
            col = c0 + L;
        }
        if (col < l->T) fill_pad(l, b, row, col);
        n_pad += l->T - col;
    }
    b->n_target = n_target;
    s->n_pad = n_pad;
}

/* ---- prefetch threads ---- */

static void *worker_main(void *arg) {
    dl_loader *l = arg;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && (l->end_seq >= 0 || l->next_plan >= l->next_consume + l->P))
            pthread_cond_wait(&l->cv_space, &l->mu);
        if (l->stop) break;
        int64_t seq = l->next_plan;
        dl_slot *s = &l->slots[seq % l->P];
        if (!plan_batch(l, s)) {
            l->end_seq = seq;
            pthread_cond_broadcast(&l->cv_ready);
            continue;
        }
        l->next_plan++;
        s->seq = seq;
        s->state = SLOT_FILLING;
        pthread_mutex_unlock(&l->mu);
        fill_batch(l, s);
        pthread_mutex_lock(&l->mu);
        s->state = SLOT_READY;
        pthread_cond_broadcast(&l->cv_ready);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

static void threads_stop(dl_loader *l) {
    if (!l->threads_running) return;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv_space);
    pthread_mutex_unlock(&l->mu);
    for (int i = 0; i < l->n_threads; i++) pthread_join(l->threads[i], NULL);
    l->threads_running = 0;
}

/* Starts the workers with an empty ring at position s. */
static int threads_start(dl_loader *l, dl_state s) {
    l->stop = 0;
    l->next_plan = l->next_consume = 0;
    l->end_seq = -1;
    l->plan = s;
    l->plan_eof = 0;
    l->consumed = s;
    for (int i = 0; i < l->P; i++) l->slots[i].state = SLOT_FREE;
    for (int i = 0; i < l->n_threads; i++) {
        int e = pthread_create(&l->threads[i], NULL, worker_main, l);
        if (e != 0) {
            l->n_threads = i;
            l->threads_running = 1;
            threads_stop(l);
            return QT_ERR(QT_EIO, "cannot start the data loader's threads (error %d); lower data.num_workers", e);
        }
    }
    l->threads_running = 1;
    return QT_OK;
}

/* ---- opening ---- */

static int check_config(const dl_config *c) {
    if (c->seq_len < 2) return QT_ERR(QT_EINVAL, "data.seq_len is %d; it must be at least 2", c->seq_len);
    if (c->micro_batch < 1) return QT_ERR(QT_EINVAL, "the micro-batch is %d; it must be at least 1", c->micro_batch);
    int world = c->world ? c->world : 1;
    if (world < 1 || c->rank < 0 || c->rank >= world)
        return QT_ERR(QT_EINVAL, "data-parallel rank %d of %d is out of range", c->rank, world);
    if (c->prefetch < 0 || c->num_workers < 0)
        return QT_ERR(QT_EINVAL, "data.prefetch and data.num_workers must not be negative");
    if (c->prefetch > DL_PREFETCH_MAX)
        return QT_ERR(QT_EINVAL, "data.prefetch is %d; it must be from 0 to %d", c->prefetch, DL_PREFETCH_MAX);
    if (c->n_paths <= 0 && !c->path) return QT_ERR(QT_EINVAL, "no data file given; set data.train");
    for (int f = 0; c->mix_weights && f < c->n_paths; f++)
        if (!(c->mix_weights[f] > 0) || c->mix_weights[f] > 1e12)
            return QT_ERR(QT_EINVAL, "mixing weight %d of %d is %g; each must be above 0", f + 1, c->n_paths,
                          c->mix_weights[f]);
    return QT_OK;
}

static int add_seg(dl_loader *l, int64_t *cap, const dl_source *src, uint64_t start, uint32_t len, uint32_t file) {
    if (l->n_segs == *cap) {
        int64_t c = *cap ? *cap * 2 : 1024;
        dl_seg *p = qt_realloc(l->segs, (size_t)c * sizeof *p, "the loader's example table");
        if (!p) return QT_ENOMEM;
        l->segs = p;
        *cap = c;
    }
    l->segs[l->n_segs++] = (dl_seg){.start = start, .len = len, .file = file};
    l->stats.n_tokens += len;
    /* labels this example contributes, and targets (labels of tokens 1..len-1) */
    const uint8_t *m = src->mask + start;
    int64_t targets = 0;
    for (uint32_t j = 1; j < len; j++) targets += m[j];
    l->stats.n_labels += targets + m[0];
    l->stats.n_targets += targets;
    l->stats.n_unlabelled += targets == 0;
    return QT_OK;
}

/* Every example of every file as segments of at most T tokens. */
static int build_segs(dl_loader *l) {
    int64_t cap = 0;
    uint64_t T = (uint64_t)l->T;
    for (int f = 0; f < l->n_files; f++) {
        const dl_source *s = &l->files[f];
        for (uint64_t i = 0; i < s->n_examples; i++) {
            uint64_t start = s->offsets[i], len = s->offsets[i + 1] - start;
            if (len <= T) {
                QT_TRY(add_seg(l, &cap, s, start, (uint32_t)len, (uint32_t)f));
            } else if (l->cfg.overlong == DL_OVERLONG_TRUNCATE) {
                QT_TRY(add_seg(l, &cap, s, start, (uint32_t)T, (uint32_t)f));
                l->stats.n_truncated++;
                l->stats.n_tokens_dropped += (int64_t)(len - T);
            } else {
                /* pieces overlap by one token: the last token of a piece is
                 * the first input of the next, so every label is predicted once */
                for (uint64_t p = 0;; p += T - 1) {
                    uint64_t n = len - p < T ? len - p : T;
                    QT_TRY(add_seg(l, &cap, s, start + p, (uint32_t)n, (uint32_t)f));
                    if (p + n >= len) break;
                }
                l->stats.n_split++;
            }
        }
    }
    return QT_OK;
}

int dl_mix_parse(const char *s, dl_mix *out) {
    if (s && !strcmp(s, "concat")) *out = DL_MIX_CONCAT;
    else if (s && !strcmp(s, "interleave_under")) *out = DL_MIX_INTERLEAVE_UNDER;
    else if (s && !strcmp(s, "interleave_over")) *out = DL_MIX_INTERLEAVE_OVER;
    else return QT_EINVAL;
    return QT_OK;
}

const char *dl_mix_name(dl_mix m) {
    return m == DL_MIX_INTERLEAVE_UNDER ? "interleave_under" : m == DL_MIX_INTERLEAVE_OVER ? "interleave_over" : "concat";
}

/* The interleave strategies (loader.h): the epoch's examples, file by file
 * counts from the weights, the files spread evenly through it (at each place
 * the file furthest behind its share goes next). Replaces segs. */
static int mix_segs(dl_loader *l) {
    const int F = l->n_files;
    int64_t *first = qt_calloc((size_t)F + 1, sizeof *first, "the data mix");
    int64_t *want = qt_calloc((size_t)F, sizeof *want, "the data mix");
    int64_t *taken = qt_calloc((size_t)F, sizeof *taken, "the data mix");
    dl_seg *out = NULL;
    int rc = QT_ENOMEM;
    if (!first || !want || !taken) goto done;
    for (int64_t i = 0; i < l->n_segs; i++) first[l->segs[i].file + 1]++;
    for (int f = 0; f < F; f++) first[f + 1] += first[f];
    double wsum = 0, S = -1;
    for (int f = 0; f < F; f++) wsum += l->cfg.mix_weights ? l->cfg.mix_weights[f] : 1.0;
    for (int f = 0; f < F; f++) {
        const double w = (l->cfg.mix_weights ? l->cfg.mix_weights[f] : 1.0) / wsum;
        const double s = (double)(first[f + 1] - first[f]) / w;
        if (S < 0 || (l->cfg.mix == DL_MIX_INTERLEAVE_UNDER ? s < S : s > S)) S = s;
    }
    int64_t total = 0;
    for (int f = 0; f < F; f++) {
        const double w = (l->cfg.mix_weights ? l->cfg.mix_weights[f] : 1.0) / wsum;
        const int64_t n = first[f + 1] - first[f];
        want[f] = (int64_t)(w * S + 0.5);
        if (want[f] < 1) want[f] = 1; /* every file named is seen */
        if (l->cfg.mix == DL_MIX_INTERLEAVE_UNDER && want[f] > n) want[f] = n;
        if (l->cfg.mix == DL_MIX_INTERLEAVE_OVER && want[f] < n) want[f] = n;
        if (want[f] < n) l->stats.n_mix_dropped += n - want[f];
        else l->stats.n_mix_repeated += want[f] - n;
        total += want[f];
    }
    out = qt_malloc((size_t)total * sizeof *out, "the data mix");
    if (!out) goto done;
    for (int64_t k = 0; k < total; k++) {
        int best = -1;
        double best_share = 0;
        for (int f = 0; f < F; f++) {
            if (taken[f] == want[f]) continue;
            const double share = ((double)taken[f] + 0.5) / (double)want[f];
            if (best < 0 || share < best_share) best = f, best_share = share;
        }
        const int64_t n = first[best + 1] - first[best];
        out[k] = l->segs[first[best] + taken[best] % n];
        taken[best]++;
    }
    /* the epoch's totals are the mix's */
    l->stats.n_tokens = l->stats.n_labels = l->stats.n_targets = l->stats.n_unlabelled = 0;
    for (int64_t k = 0; k < total; k++) {
        const uint8_t *m = l->files[out[k].file].mask + out[k].start;
        int64_t targets = 0;
        for (uint32_t j = 1; j < out[k].len; j++) targets += m[j];
        l->stats.n_tokens += out[k].len;
        l->stats.n_labels += targets + m[0];
        l->stats.n_targets += targets;
        l->stats.n_unlabelled += targets == 0;
    }
    qt_free(l->segs);
    l->segs = out;
    l->n_segs = total;
    out = NULL;
    rc = QT_OK;
done:
    qt_free(first);
    qt_free(want);
    qt_free(taken);
    qt_free(out);
    return rc;
}

/* 80% of the online cores, at least 1. */
static int auto_workers(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = (int)((double)(cores > 0 ? cores : 1) * 0.8);
    return n < 1 ? 1 : n;
}

static int open_files(dl_loader *l, const bpe_tokenizer *tok) {
    const dl_config *c = &l->cfg;
    const char *const *paths = c->n_paths > 0 ? c->paths : &c->path;
    l->n_files = c->n_paths > 0 ? c->n_paths : 1;
    l->files = qt_calloc((size_t)l->n_files, sizeof *l->files, "the data files");
    if (!l->files) return QT_ENOMEM;
    dl_source_opts o = {
        .cache_dir = c->cache_dir,
        .no_cache = c->no_cache,
        .format = c->format,
        .enc = {.tok = tok, .mask_prompt = c->mask_prompt,
                .vocab_limit = c->vocab_size > 0 ? c->vocab_size : (tok ? bpe_vocab_size(tok) : 0)},
        .tokenizer_hash = tok ? bpe_hash(tok) : 0,
        .skip_bad_lines = c->skip_bad_lines,
        .max_line_bytes = c->max_line_bytes,
        .n_threads = c->num_workers > 0 ? c->num_workers : auto_workers(),
    };
    for (int f = 0; f < l->n_files; f++) {
        o.path = paths[f];
        if (!o.path) return QT_ERR(QT_EINVAL, "data file %d of %d has no path", f + 1, l->n_files);
        dl_seen_keys *seen = NULL;
        QT_TRY(dl_seen_keys_new(o.path, &seen)); /* dropped keys: one warning per file */
        o.enc.seen = seen;
        int rc = dl_source_open(&o, &l->files[f]);
        dl_seen_keys_free(seen);
        QT_TRY(rc);
        l->stats.n_cache_hits += l->files[f].cache_hit;
        l->stats.n_cache_written += l->files[f].cache_written;
        l->stats.n_lines_skipped += (int64_t)l->files[f].n_bad_lines;
        qt_debug("%s: %s format, %llu examples, %llu tokens, cache %s", o.path, dl_format_name(l->files[f].format),
                 (unsigned long long)l->files[f].n_examples, (unsigned long long)l->files[f].n_tokens,
                 l->files[f].cache_hit ? "hit" : (l->files[f].cache_written ? "built" : "none"));
    }
    return QT_OK;
}

static int loader_init(dl_loader *l, const bpe_tokenizer *tok) {
    const dl_config *c = &l->cfg;
    QT_TRY(open_files(l, tok));
    QT_TRY(build_segs(l));
    if (c->mix != DL_MIX_CONCAT && l->n_files > 1) QT_TRY(mix_segs(l));
    int world = c->world;
    if (l->n_segs < world)
        return QT_ERR(QT_EINVAL, "the data has %lld examples, fewer than the %d data-parallel ranks; add data or use fewer ranks",
                      (long long)l->n_segs, world);
    l->n_rank = (l->n_segs - c->rank + world - 1) / world;
    l->pad_id = c->pad_id >= 0 ? c->pad_id : 0;
    if (c->pad_id < 0 && tok) {
        int32_t eot = bpe_token_id(tok, "<|endoftext|>");
        if (eot >= 0) l->pad_id = eot;
    }
    if (c->shuffle && !c->eval) {
        l->order = qt_malloc((size_t)l->n_segs * sizeof *l->order, "the shuffled example order");
        if (!l->order) return QT_ENOMEM;
    }
    l->order_epoch = -1;
    l->rows_epoch = -1;
    l->W = c->pack_window;
    if (l->W > l->n_rank) l->W = (int)l->n_rank;
    l->row_ex = qt_malloc((size_t)l->n_rank * sizeof *l->row_ex, "the epoch's rows");
    l->row_off = qt_malloc(((size_t)l->n_rank + 1) * sizeof *l->row_off, "the epoch's rows");
    if (!l->row_ex || !l->row_off) return QT_ENOMEM;
    if (c->packing && l->W > 1) {
        size_t W = (size_t)l->W;
        l->win_ex = qt_malloc(W * sizeof *l->win_ex, "the packing window");
        l->win_bin = qt_malloc(W * sizeof *l->win_bin, "the packing window");
        l->bin_rem = qt_malloc(W * sizeof *l->bin_rem, "the packing window");
        l->bin_off = qt_malloc((W + 1) * sizeof *l->bin_off, "the packing window");
        if (!l->win_ex || !l->win_bin || !l->bin_rem || !l->bin_off) return QT_ENOMEM;
    }
    l->slots = qt_calloc((size_t)l->P, sizeof *l->slots, "the prefetch queue");
    if (!l->slots) return QT_ENOMEM;
    for (int i = 0; i < l->P; i++) {
        QT_TRY(dl_batch_alloc(l, &l->slots[i].b));
        l->slots[i].items = qt_malloc((size_t)l->B * (size_t)l->T * sizeof(dl_item), "a batch plan");
        if (!l->slots[i].items) return QT_ENOMEM;
    }
    l->threads = qt_calloc((size_t)l->n_threads, sizeof *l->threads, "the loader threads");
    if (!l->threads) return QT_ENOMEM;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv_space, NULL);
    pthread_cond_init(&l->cv_ready, NULL);
    return threads_start(l, (dl_state){0, 0});
}

int dl_open(const dl_config *cfg, const bpe_tokenizer *tok, dl_loader **out) {
    *out = NULL;
    QT_TRY(check_config(cfg));
    double t0 = qt_now_s();
    dl_loader *l = qt_calloc(1, sizeof *l, "the data loader");
    if (!l) return QT_ENOMEM;
    l->cfg = *cfg;
    if (l->cfg.world == 0) l->cfg.world = 1;
    l->B = cfg->micro_batch;
    l->T = cfg->seq_len;
    l->P = cfg->prefetch > 0 ? cfg->prefetch : 4;
    int n = cfg->num_workers > 0 ? cfg->num_workers : auto_workers();
    l->n_threads = n < l->P ? n : l->P; /* more workers than slots would only wait */
    l->stats.num_workers = l->n_threads;
    l->stats.prefetch = l->P;
    l->stats.n_files = cfg->n_paths > 0 ? cfg->n_paths : 1;
    int rc = loader_init(l, tok);
    if (rc != QT_OK) { dl_close(l); return rc; }
    l->stats.n_examples = l->n_segs;
    l->stats.n_examples_rank = l->n_rank;
    l->stats.open_s = qt_now_s() - t0;
    if (l->stats.n_mix_dropped || l->stats.n_mix_repeated)
        qt_info("data mix %s over %d files: %lld examples an epoch (%lld left out, %lld repeated)",
                dl_mix_name(cfg->mix), l->n_files, (long long)l->n_segs, (long long)l->stats.n_mix_dropped,
                (long long)l->stats.n_mix_repeated);
    if (l->stats.n_truncated)
        qt_info("%lld examples were longer than seq_len %d and were truncated (%lld tokens dropped)",
                (long long)l->stats.n_truncated, l->T, (long long)l->stats.n_tokens_dropped);
    if (l->stats.n_split)
        qt_info("%lld examples were longer than seq_len %d and were split into pieces", (long long)l->stats.n_split, l->T);
    if (l->stats.n_unlabelled)
        qt_warn("%lld of %lld examples carry no labels%s, so they cost compute and teach nothing; "
                "check mask_prompt and the data, or raise seq_len", (long long)l->stats.n_unlabelled,
                (long long)l->n_segs, l->stats.n_truncated ? " (some after truncation)" : "");
    *out = l;
    return QT_OK;
}

void dl_close(dl_loader *l) {
    if (!l) return;
    if (l->threads) {
        threads_stop(l);
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv_space);
        pthread_cond_destroy(&l->cv_ready);
    }
    qt_free(l->threads);
    for (int i = 0; l->slots && i < l->P; i++) {
        dl_batch_free(&l->slots[i].b);
        qt_free(l->slots[i].items);
    }
    qt_free(l->slots);
    qt_free(l->order);
    qt_free(l->row_ex);
    qt_free(l->row_off);
    qt_free(l->win_ex);
    qt_free(l->win_bin);
    qt_free(l->bin_rem);
    qt_free(l->bin_off);
    qt_free(l->segs);
    for (int f = 0; l->files && f < l->n_files; f++) dl_source_close(&l->files[f]);
    qt_free(l->files);
    qt_free(l);
}

/* ---- consuming ---- */

int dl_batch_alloc(const dl_loader *l, qt_batch *b) {
    memset(b, 0, sizeof *b);
    size_t n;
    if (!qt_mul_ok((size_t)l->B * (size_t)l->T, 4 * sizeof(int32_t), &n))
        return QT_ERR(QT_ENOMEM, "a batch of %d x %d tokens is too large", l->B, l->T);
    int32_t *p = qt_alloc_aligned(n, "a data batch");
    if (!p) return QT_ENOMEM;
    size_t BT = (size_t)l->B * (size_t)l->T;
    b->B = l->B;
    b->T = l->T;
    b->inputs = p;
    b->targets = p + BT;
    b->positions = p + 2 * BT;
    b->doc_start = p + 3 * BT;
    return QT_OK;
}

void dl_batch_free(qt_batch *b) {
    qt_free(b->inputs); /* one block holds all four arrays */
    memset(b, 0, sizeof *b);
}

int dl_next(dl_loader *l, qt_batch *out) {
    if (out->B != l->B || out->T != l->T || !out->inputs)
        return QT_ERR(QT_EINVAL, "dl_next needs a batch from dl_batch_alloc for this loader (%d x %d)", l->B, l->T);
    /* without workers no batch would ever arrive (a failed restart in dl_state_set) */
    if (!l->threads_running || l->n_threads <= 0)
        return QT_ERR(QT_EINVAL, "the data loader has no worker threads running; it could not restart them after "
                      "an earlier error, so reopen it");
    double t0 = qt_now_s();
    pthread_mutex_lock(&l->mu);
    int64_t seq = l->next_consume;
    dl_slot *s = &l->slots[seq % l->P];
    while (!(s->state == SLOT_READY && s->seq == seq) && !(l->end_seq >= 0 && seq >= l->end_seq))
        pthread_cond_wait(&l->cv_ready, &l->mu);
    l->stats.wait_s += qt_now_s() - t0;
    if (l->end_seq >= 0 && seq >= l->end_seq) {
        pthread_mutex_unlock(&l->mu);
        return DL_END;
    }
    pthread_mutex_unlock(&l->mu);
    /* No worker writes this slot until next_consume moves past it. */
    size_t BT = (size_t)l->B * (size_t)l->T;
    memcpy(out->inputs, s->b.inputs, BT * sizeof(int32_t));
    memcpy(out->targets, s->b.targets, BT * sizeof(int32_t));
    memcpy(out->positions, s->b.positions, BT * sizeof(int32_t));
    memcpy(out->doc_start, s->b.doc_start, BT * sizeof(int32_t));
    out->n_target = s->b.n_target;
    pthread_mutex_lock(&l->mu);
    l->consumed = s->end;
    s->state = SLOT_FREE;
    l->next_consume++;
    l->stats.n_batches++;
    l->stats.n_pad += s->n_pad;
    pthread_cond_broadcast(&l->cv_space);
    pthread_mutex_unlock(&l->mu);
    return QT_OK;
}

dl_state dl_state_get(const dl_loader *l) {
    dl_loader *m = (dl_loader *)l; /* the lock, not the state, changes */
    pthread_mutex_lock(&m->mu);
    dl_state s = l->consumed;
    pthread_mutex_unlock(&m->mu);
    return s;
}

int dl_state_set(dl_loader *l, dl_state s) {
    threads_stop(l);
    if (s.epoch < 0 || s.index < 0 || (l->cfg.eval && s.epoch != 0) || s.index > rows_in(l, s.epoch)) {
        int64_t rows = s.epoch >= 0 ? rows_in(l, s.epoch) : 0;
        /* keep the loader usable at its old position; if its workers cannot be
         * restarted that is the error to report, since dl_next would need them */
        QT_TRY(threads_start(l, l->consumed));
        return QT_ERR(QT_EINVAL, "the saved data position (epoch %lld, row %lld) does not fit this data "
                      "(%lld rows for this rank in that epoch); was the data, seq_len or the number of ranks changed?",
                      (long long)s.epoch, (long long)s.index, (long long)rows);
    }
    return threads_start(l, s);
}

int64_t dl_num_examples(const dl_loader *l) { return l->n_segs; }
int64_t dl_tokens_per_epoch(const dl_loader *l) { return l->stats.n_tokens; }

void dl_get_stats(const dl_loader *l, dl_stats *out) {
    dl_loader *m = (dl_loader *)l;
    pthread_mutex_lock(&m->mu);
    *out = l->stats;
    pthread_mutex_unlock(&m->mu);
}
