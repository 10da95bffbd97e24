/* The guard backend, for tests: the CPU kernels behind backend.h, with device
 * memory the host cannot read. Device allocations come from one reservation
 * of address space that stays PROT_NONE except while one of this backend's
 * own calls runs (an op, upload, download, copy, zero): any other read or
 * write of device memory -- a memset, a loop, a host library handed a device
 * pointer -- is a SIGSEGV at its line (run the test under gdb, or look at the
 * core's backtrace). Selected with QTUNE_BACKEND=guard; tests/backend/ runs
 * training, eval, generate and merge on it.
 *
 * One stream, one thread: the guard opens the whole reservation for a call and
 * closes it after. Under MPI the transport stages every collective through
 * host copies (dist_set_backend: the guard's device memory is not
 * host-readable), so MPI never reads a guard buffer itself. Freed blocks give their pages back but their
 * addresses are not reused: a use after free faults too. */
#include "backend/guard/backend_guard.h"

#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/backend_impl.h"
#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/mem.h"

typedef struct {
    qt_backend cpu; /* the kernels */
    char *base;     /* the reservation */
    size_t reserved, used;
    size_t held, peak; /* bytes of device blocks held now, and the most at once */
    int depth;      /* open calls nested (an op inside an op never happens; kept safe anyway) */
    struct blk { char *p; size_t bytes; } *blk;
    int n_blk, cap_blk;
} guard;

static const qt_backend_desc guard_desc = {
    .name = "guard",
    .alignment = 4096,
    .native_dtypes = QT_BE_DT(QT_F32) | QT_BE_DT(QT_F16), /* f16: the stand-in GEMMs below */
    .ce_chunk = OP_CE_CHUNK, /* the CPU's kernels, so the CPU's workspace facts */
    .matmul_ws_cap = OP_MATMUL_WS_CAP,
    .runtime_bytes = (size_t)6 << 20,
    .runtime_extra = (size_t)10 << 20,
    .blas_thread_vm = QT_CPU_BLAS_THREAD_VM,
    .host_reads_device = 0,
};

static guard *G(qt_backend *be) { return be->impl; }

/* A fault inside a guard reservation is a host touch of device memory: say
 * so, with the call stack (symbolise with addr2line -f -e qtune ADDR, or run
 * under gdb), then die of the same signal. Reservations are few (one per open
 * backend); a fault elsewhere is passed on untouched. */
enum { MAX_GUARDS = 8 };
static struct { char *base; size_t len; } guards[MAX_GUARDS];

static void on_fault(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    char *a = si->si_addr;
    for (int i = 0; i < MAX_GUARDS; i++)
        if (guards[i].base && a >= guards[i].base && a < guards[i].base + guards[i].len) {
            static const char msg[] = "qtune guard backend: the host touched device memory outside the backend's "
                                      "calls (a host read/write left outside src/backend/); call stack:\n";
            if (write(2, msg, sizeof msg - 1) < 0) break;
            void *bt[64];
            backtrace_symbols_fd(bt, backtrace(bt, 64), 2);
            break;
        }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void watch(char *base, size_t len) {
    for (int i = 0; i < MAX_GUARDS; i++)
        if (!guards[i].base) {
            guards[i].base = base, guards[i].len = len;
            break;
        }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGSEGV, &sa, NULL);
}

static void unwatch(char *base) {
    for (int i = 0; i < MAX_GUARDS; i++)
        if (guards[i].base == base) guards[i].base = NULL;
}

static void g_open(qt_backend *be) {
    guard *g = G(be);
    if (g->depth++ == 0 && g->used) mprotect(g->base, g->used, PROT_READ | PROT_WRITE);
}
static void g_close(qt_backend *be) {
    guard *g = G(be);
    if (--g->depth == 0 && g->used) mprotect(g->base, g->used, PROT_NONE);
}

static void *g_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what) {
    guard *g = G(be);
    if (place != QT_MEM_DEVICE && place != QT_MEM_DEVICE_SPARSE) return qt_alloc_aligned(bytes ? bytes : 64, what);
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), len = (bytes + pg - 1) / pg * pg;
    if (!len) len = pg;
    if (len > g->reserved - g->used) {
        QT_ERR(QT_ENOMEM, "guard backend: %s needs %.1f MiB beyond its %.0f GiB reservation; set QTUNE_GUARD_GIB "
                          "higher", what, (double)bytes / (1 << 20), (double)g->reserved / (1 << 30));
        return NULL;
    }
    if (g->n_blk == g->cap_blk) {
        int cap = g->cap_blk ? 2 * g->cap_blk : 64;
        struct blk *b = realloc(g->blk, sizeof *b * (size_t)cap);
        if (!b) {
            QT_ERR(QT_ENOMEM, "guard backend: out of memory for its block table");
            return NULL;
        }
        g->blk = b, g->cap_blk = cap;
    }
    char *p = g->base + g->used;
    g->used += len;
    /* the new pages join the open window when a call is running */
    if (g->depth) mprotect(p, len, PROT_READ | PROT_WRITE);
    g->blk[g->n_blk++] = (struct blk){p, len};
    g->held += len;
    if (g->held > g->peak) g->peak = g->held;
    return p;
}

static void g_free(qt_backend *be, void *p) {
    guard *g = G(be);
    if (!p) return;
    for (int i = 0; i < g->n_blk; i++)
        if (g->blk[i].p == p) {
            madvise(p, g->blk[i].bytes, MADV_DONTNEED);
            g->held -= g->blk[i].bytes;
            g->blk[i] = g->blk[--g->n_blk];
            return;
        }
    if ((char *)p >= g->base && (char *)p < g->base + g->reserved) return; /* freed twice: nothing to do */
    qt_free(p); /* host or pinned */
}

static int g_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what) {
    void *d = g_alloc(be, QT_MEM_DEVICE, bytes, what);
    if (!d) return QT_ENOMEM;
    g_open(be);
    memcpy(d, host, bytes);
    g_close(be);
    *dev = d;
    return QT_OK;
}

static void g_release_mapped(qt_backend *be, const void *dev) { g_free(be, (void *)dev); }

#define BE qt_backend *be
#define CALL(expr)    \
    do {              \
        g_open(be);   \
        expr;         \
        g_close(be);  \
    } while (0)
#define CPU (&G(be)->cpu)

static void g_upload(BE, void *dev, const void *host, size_t bytes) { CALL(CPU->upload(CPU, dev, host, bytes)); }
static void g_download(BE, void *host, const void *dev, size_t bytes) { CALL(CPU->download(CPU, host, dev, bytes)); }
static void g_copy(BE, void *dst, const void *src, size_t bytes) { CALL(CPU->copy(CPU, dst, src, bytes)); }
static void g_zero(BE, void *dst, size_t bytes) { CALL(CPU->zero(CPU, dst, bytes)); }
static void g_sync(BE) { (void)be; }
static qt_event *g_event_record(BE) { return (qt_event *)be; }
static void g_event_wait(BE, qt_event *e) { (void)be, (void)e; }
static void g_event_free(BE, qt_event *e) { (void)be, (void)e; }

static void g_embedding_forward(BE, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C) {
    CALL(CPU->embedding_forward(CPU, out, ids, wte, wdt, N, C));
}
static void g_embedding_backward(BE, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    CALL(CPU->embedding_backward(CPU, dwte, dout, ids, N, C));
}
static void g_rmsnorm_forward(BE, float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps) {
    CALL(CPU->rmsnorm_forward(CPU, out, rstd, inp, w, N, C, eps));
}
static void g_rmsnorm_backward(BE, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                               const float *rstd, int N, int C) {
    CALL(CPU->rmsnorm_backward(CPU, dinp, dw, dout, inp, w, rstd, N, C));
}
static void g_matmul_forward(BE, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N,
                             int IN, int OUT, float alpha, int accumulate, float *ws) {
    CALL(CPU->matmul_forward(CPU, out, inp, w, wdt, bias, N, IN, OUT, alpha, accumulate, ws));
}
/* no CALL: the ops fn calls open the memory themselves */
static int g_hold_threads(BE, int (*fn)(void *arg), void *arg) { return CPU->hold_threads(CPU, fn, arg); }
static void g_matvec(BE, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                     int OUT, float alpha, int accumulate) {
    CALL(CPU->matvec(CPU, out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate));
}
static void g_matvec_many(BE, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    CALL(CPU->matvec_many(CPU, x, N, IN, count, o));
}
static void g_matmul_backward(BE, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                              const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    CALL(CPU->matmul_backward(CPU, dinp, dw, db, dout, inp, w, wdt, N, IN, OUT, alpha, ws));
}
static void g_rope_forward(BE, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    CALL(CPU->rope_forward(CPU, x, pos, N, NH, D, inv, scale));
}
static void g_rope_backward(BE, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv,
                            float scale) {
    CALL(CPU->rope_backward(CPU, dx, pos, N, NH, D, inv, scale));
}
static void g_attention_forward(BE, float *out, float *lse, const float *q, const float *k, const float *v,
                                const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    CALL(CPU->attention_forward(CPU, out, lse, q, k, v, doc_start, B, T, H, KV, D));
}
static void g_attention_backward(BE, float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v,
                                 const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    CALL(CPU->attention_backward(CPU, dq, dk, dv, dout, out, lse, q, k, v, doc_start, B, T, H, KV, D));
}
static void g_attention_forward_cached(BE, float *out, const float *q, const float *kc, const float *vc, int n,
                                       int pos0, int H, int KV, int D) {
    CALL(CPU->attention_forward_cached(CPU, out, q, kc, vc, n, pos0, H, KV, D));
}
static void g_swiglu_forward(BE, float *out, const float *gate, const float *up, int N, int I) {
    CALL(CPU->swiglu_forward(CPU, out, gate, up, N, I));
}
static void g_swiglu_backward(BE, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                              int N, int I) {
    CALL(CPU->swiglu_backward(CPU, dgate, dup, dout, gate, up, N, I));
}
static void g_lmhead_ce_forward(BE, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, int N, int C, int V, float *ws) {
    CALL(CPU->lmhead_ce_forward(CPU, loss, lse, x, w, wdt, targets, N, C, V, ws));
}
static void g_lmhead_ce_backward(BE, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                                 const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                 float *ws) {
    CALL(CPU->lmhead_ce_backward(CPU, dx, dw, x, w, wdt, targets, lse, dscale, N, C, V, ws));
}
static void g_lmhead_ce_forward_keep(BE, float *loss, float *lse, float *kept, const float *x, const void *w,
                                     qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws) {
    CALL(CPU->lmhead_ce_forward_keep(CPU, loss, lse, kept, x, w, wdt, targets, N, C, V, ws));
}
static void g_lmhead_ce_backward_kept(BE, float *dx, float *dw, float *kept, const float *x, const void *w,
                                      qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N,
                                      int C, int V, float *ws) {
    CALL(CPU->lmhead_ce_backward_kept(CPU, dx, dw, kept, x, w, wdt, targets, lse, dscale, N, C, V, ws));
}
static void g_lmhead_ce_forward_dx(BE, float *loss, float *lse, float *dx, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V,
                                   float *ws) {
    CALL(CPU->lmhead_ce_forward_dx(CPU, loss, lse, dx, x, w, wdt, targets, dscale, N, C, V, ws));
}
static void g_acc(BE, float *out, const float *a, size_t n) { CALL(CPU->acc(CPU, out, a, n)); }
static void g_round_to_dtype(BE, float *x, size_t n, qt_dtype dt) { CALL(CPU->round_to_dtype(CPU, x, n, dt)); }
static void g_round_store(BE, float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    CALL(CPU->round_store(CPU, x, dst, n, dt));
}
static void g_convert(BE, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    CALL(CPU->convert(CPU, dst, ddt, src, sdt, n));
}
/* 16-bit GEMMs. bf16: the CPU's (oneDNN, where the CPU has it). f16, which
 * no CPU here has: the guard stands in for a GPU's f16 GEMM, so the model's
 * f16 path (qwen2.c, m->native16) runs in every test on it. Each form the
 * model uses becomes the CPU's fp32 op on the same values widened (exact),
 * the op the model itself calls without a 16-bit GEMM, so a run on the
 * guard stays bit for bit the CPU's run:
 *   (ta 0, tb 1, no acc)  C = A B^T (+ bias)  matmul_forward (A the input, B the 16-bit weight)
 *   (ta 0, tb 0, acc)     C += A B            matmul_backward's dinp (A the output gradient)
 *   (ta 1, tb 0, acc)     C += A^T B          matmul_backward's dW (B the input)
 * Other forms answer QT_EUNSUPPORTED (the model then takes the fp32 op). */
static float *widen(qt_backend *be, const uint16_t *x, qt_dtype dt, size_t n) {
    float *f = qt_malloc(sizeof(float) * (n ? n : 1), "guard backend: widened f16 operand");
    if (f) CALL(CPU->convert(CPU, f, QT_F32, x, dt, n));
    return f;
}
static int g_half_available(BE, qt_dtype dt) { return dt == QT_F16 || CPU->half_available(CPU, dt); }
static int g_half_gemm(BE, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                       const float *bias, int M, int N, int K, float alpha, int acc) {
    int rc;
    if (dt != QT_F16) {
        CALL(rc = CPU->half_gemm(CPU, dt, C, A, ta, B, tb, bias, M, N, K, alpha, acc));
        return rc;
    }
    int form = -1; /* the three forms above, in that order */
    if (!ta && tb && !acc) form = 0;
    else if (!ta && !tb && acc && !bias) form = 1;
    else if (ta && !tb && acc && !bias) form = 2;
    if (form < 0) return QT_EUNSUPPORTED;
    float *a = widen(be, A, dt, (size_t)M * K), *b = form == 2 ? widen(be, B, dt, (size_t)K * N) : NULL, *ws = NULL;
    rc = a && (form != 2 || b) ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK && form != 2) {
        ws = qt_malloc(sizeof(float) * qt_be_matmul_ws_floats(CPU->desc, form == 0 ? K : N, form == 0 ? N : K),
                       "guard backend: f16 GEMM workspace");
        if (!ws) rc = QT_ENOMEM;
    }
    if (rc == QT_OK) {
        if (form == 0) CALL(CPU->matmul_forward(CPU, C, a, B, dt, bias, M, K, N, alpha, 0, ws));
        else if (form == 1) CALL(CPU->matmul_backward(CPU, C, NULL, NULL, a, NULL, B, dt, M, N, K, alpha, ws));
        else CALL(CPU->matmul_backward(CPU, NULL, C, NULL, a, b, NULL, dt, K, N, M, alpha, NULL));
    }
    qt_free(a), qt_free(b), qt_free(ws);
    return rc;
}
static int g_half_matmul(BE, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N,
                         int IN, int OUT, float alpha) {
    return g_half_gemm(be, dt, out, inp, 0, w, 1, bias, N, OUT, IN, alpha, 0);
}
static void g_dropout(BE, float *dst, const float *src, size_t n, const qt_dropout_key *key, uint32_t threshold,
                      float keep_scale) {
    CALL(CPU->dropout(CPU, dst, src, n, key, threshold, keep_scale));
}
static int g_adam(BE, const qt_adam_scalars *k, float *p, const float *gr, float *m, float *v, size_t n) {
    int finite;
    CALL(finite = CPU->adam(CPU, k, p, gr, m, v, n));
    return finite;
}
static double g_sum_squares(BE, const float *x, size_t n) {
    double s;
    CALL(s = CPU->sum_squares(CPU, x, n));
    return s;
}
static void g_scale(BE, float *x, size_t n, float s) { CALL(CPU->scale(CPU, x, n, s)); }
static size_t g_runtime_bytes(BE) { return CPU->runtime_bytes(CPU); }
static size_t g_device_peak_bytes(BE) { return G(be)->peak; } /* in whole pages, as allocated */

static void g_close_backend(BE) {
    guard *g = G(be);
    if (g->base) {
        unwatch(g->base);
        munmap(g->base, g->reserved);
    }
    free(g->blk);
    qt_free(g);
    qt_free(be);
}
#undef BE

/* The guard's table: every entry that touches device memory opens the
 * reservation, runs the CPU's entry and closes it again (backend_impl.h). */
static const qt_backend guard_i = {
    .desc = &guard_desc,
    .alloc = g_alloc,
    .free = g_free,
    .import_mapped = g_import_mapped,
    .release_mapped = g_release_mapped,
    .upload = g_upload,
    .download = g_download,
    .copy = g_copy,
    .zero = g_zero,
    .sync = g_sync,
    .event_record = g_event_record,
    .event_wait = g_event_wait,
    .event_free = g_event_free,
    .embedding_forward = g_embedding_forward,
    .embedding_backward = g_embedding_backward,
    .rmsnorm_forward = g_rmsnorm_forward,
    .rmsnorm_backward = g_rmsnorm_backward,
    .matmul_forward = g_matmul_forward,
    .matmul_backward = g_matmul_backward,
    .matvec = g_matvec,
    .matvec_many = g_matvec_many,
    .rope_forward = g_rope_forward,
    .rope_backward = g_rope_backward,
    .attention_forward = g_attention_forward,
    .attention_backward = g_attention_backward,
    .attention_forward_cached = g_attention_forward_cached,
    .swiglu_forward = g_swiglu_forward,
    .swiglu_backward = g_swiglu_backward,
    .lmhead_ce_forward = g_lmhead_ce_forward,
    .lmhead_ce_backward = g_lmhead_ce_backward,
    .lmhead_ce_forward_keep = g_lmhead_ce_forward_keep,
    .lmhead_ce_backward_kept = g_lmhead_ce_backward_kept,
    .lmhead_ce_forward_dx = g_lmhead_ce_forward_dx,
    .acc = g_acc,
    .hold_threads = g_hold_threads,
    .round_to_dtype = g_round_to_dtype,
    .round_store = g_round_store,
    .convert = g_convert,
    .half_available = g_half_available,
    .half_matmul = g_half_matmul,
    .half_gemm = g_half_gemm,
    .dropout = g_dropout,
    .adam = g_adam,
    .sum_squares = g_sum_squares,
    .scale = g_scale,
    .runtime_bytes = g_runtime_bytes,
    .device_peak_bytes = g_device_peak_bytes,
    .close = g_close_backend,
};

int qt_backend_guard_open(qt_backend **out) {
    *out = NULL;
    qt_backend *be = qt_calloc(1, sizeof *be, "guard backend");
    guard *g = qt_calloc(1, sizeof *g, "guard backend");
    if (!be || !g) {
        qt_free(be), qt_free(g);
        return QT_ENOMEM;
    }
    g->cpu = qt_backend_cpu_i;
    const char *gib = getenv("QTUNE_GUARD_GIB");
    double want = gib ? atof(gib) : 64.0;
    g->reserved = (size_t)((want > 0 ? want : 64.0) * (double)(1u << 30));
    void *p = mmap(NULL, g->reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        qt_free(be), qt_free(g);
        return QT_ERR(QT_ENOMEM, "guard backend: could not reserve %.0f GiB of address space; set QTUNE_GUARD_GIB "
                                 "lower", want);
    }
    g->base = p;
    watch(g->base, g->reserved);
    *be = guard_i;
    be->impl = g;
    *out = be;
    return QT_OK;
}

const qt_backend_desc *qt_backend_guard_desc(void) { return &guard_desc; }
