/* The Ascend backend: one NPU, one stream, the ops through aclnn's two-phase
 * operators (GetWorkspaceSize, then the launch on the stream). Written
 * against CANN's published API (acl_api.h names each fact's source), tested
 * against the CPU stand-in of that API (tests/unit/backend_parity/
 * acl_standin.c), never run on an Ascend card.
 *
 * What exists: memory, copies, events; embedding forward; matmul forward
 * and backward (fp32 on the cube unit, f16/bf16 weights cast to fp32 in ws
 * first), RMSNorm, RoPE and SwiGLU forward and backward, Adam / AdamW,
 * convert (casts), acc, scale, sum of squares (on the host). Every other op is refused by name the
 * first time it is called (refuse below): the run stops with a sentence,
 * never a silently wrong result. half_matmul / half_gemm answer
 * QT_EUNSUPPORTED (the model then takes the fp32 op), as the contract allows.
 *
 * Dimension letters as backend_impl.h: N rows, IN/OUT a matmul's sides, C
 * hidden. Every pointer an op gets is device memory (aclrtMalloc). */
#include "backend/ascend/backend_ascend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/ascend/ascend_internal.h"
#include "backend/backend_impl.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/mem.h"

typedef struct {
    void *p;
    size_t bytes;
    qt_mem_place place;
} asc_blk;

typedef struct {
    const qt_acl_api *acl;
    int device;
    aclrtStream stream;
    char soc[64];
    int bf16;      /* the card does BFLOAT16 (Ascend910B, Ascend910_93) */
    int8_t cube;   /* cubeMathType for fp32 matmuls: KEEP_DTYPE where the card allows it */
    void *ws;      /* the operators' workspace, grown on demand */
    size_t ws_bytes;
    float *scratch; /* the backward's written-not-added outputs, before they are added */
    size_t scratch_bytes;
    float *ones; /* N ones: dbias as ones (1, N) @ dout */
    size_t ones_n;
    asc_blk *blk;
    int n_blk, cap_blk;
    size_t held, peak;
} ascend;

static ascend *asc(qt_backend *be) { return (ascend *)be->impl; }

/* A failed CANN call mid-run: the run cannot go on (as the CUDA backend). */
static void asc_fail(const char *what, int code, const char *file, int line) {
    fprintf(stderr,
            "qtune: error: the Ascend NPU failed in %s (error %d, at %s:%d); the run cannot go on: rerun it, and if "
            "it repeats, run `npu-smi info` and check the driver and CANN versions\n",
            what, code, file, line);
    fflush(stderr);
    exit(1);
}
#define CK(call, what)                                          \
    do {                                                        \
        int ck_rc_ = (int)(call);                               \
        if (ck_rc_ != 0) asc_fail(what, ck_rc_, __FILE__, __LINE__); \
    } while (0)

/* An op this backend has not written yet: stop at its first use, by name. */
static void refuse(const char *op) {
    fprintf(stderr,
            "qtune: error: the Ascend backend has no %s yet (written so far: memory, copies, embedding "
            "forward, matmul, RMSNorm, RoPE, SwiGLU, AdamW, convert, acc, scale, sum_squares; docs/backends.md lists the rest); run this job on \"cpu\" or \"cuda\"\n",
            op);
    fflush(stderr);
    exit(1);
}

/* ---- memory ---------------------------------------------------------------- */
static void track(ascend *a, void *p, size_t bytes, qt_mem_place place) {
    if (a->n_blk == a->cap_blk) {
        int cap = a->cap_blk ? 2 * a->cap_blk : 64;
        asc_blk *b = realloc(a->blk, (size_t)cap * sizeof *b);
        if (!b) asc_fail("the allocation table", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
        a->blk = b, a->cap_blk = cap;
    }
    a->blk[a->n_blk++] = (asc_blk){p, bytes, place};
    if (place == QT_MEM_DEVICE || place == QT_MEM_DEVICE_SPARSE) {
        a->held += bytes;
        if (a->held > a->peak) a->peak = a->held;
    }
}

/* bytes from p to the end of the block of this backend's it lies in; 0 when none */
static size_t bytes_after(const ascend *a, const void *p) {
    for (int i = 0; i < a->n_blk; i++) {
        const char *b = a->blk[i].p;
        const char *e = b + a->blk[i].bytes, *q = p;
        if (q >= b && q < e) return (size_t)(e - q);
    }
    return 0;
}

static void *dev_malloc(ascend *a, size_t bytes) {
    void *p = NULL;
    if (a->acl->aclrtMalloc(&p, bytes ? bytes : 1, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) return NULL;
    return p;
}

static void *a_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what) {
    ascend *a = asc(be);
    void *p = NULL;
    if (place == QT_MEM_PINNED) {
        if (a->acl->aclrtMallocHost(&p, bytes ? bytes : 1) != ACL_SUCCESS) p = NULL;
    } else if (place == QT_MEM_HOST) {
        p = qt_malloc(bytes ? bytes : 1, what);
    } else {
        p = dev_malloc(a, bytes);
    }
    if (!p) {
        QT_ERR(QT_ENOMEM, "the NPU has no room for %s (%zu bytes)", what, bytes);
        return NULL;
    }
    track(a, p, bytes, place);
    return p;
}

static void a_free(qt_backend *be, void *p) {
    if (!p) return;
    ascend *a = asc(be);
    for (int i = 0; i < a->n_blk; i++) {
        if (a->blk[i].p != p) continue;
        asc_blk b = a->blk[i];
        a->blk[i] = a->blk[--a->n_blk];
        CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream"); /* queued work may still use it */
        if (b.place == QT_MEM_PINNED) CK(a->acl->aclrtFreeHost(p), "aclrtFreeHost");
        else if (b.place == QT_MEM_HOST) qt_free(p);
        else {
            CK(a->acl->aclrtFree(p), "aclrtFree");
            a->held -= b.bytes;
        }
        return;
    }
    asc_fail("free (a pointer this backend did not allocate)", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
}

static void a_upload(qt_backend *be, void *dev, const void *host, size_t bytes) {
    ascend *a = asc(be);
    if (!bytes) return;
    CK(a->acl->aclrtMemcpyAsync(dev, bytes, host, bytes, ACL_MEMCPY_HOST_TO_DEVICE, a->stream), "aclrtMemcpyAsync");
    /* the host buffer is the caller's again when upload returns */
    CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream");
}
static void a_download(qt_backend *be, void *host, const void *dev, size_t bytes) {
    ascend *a = asc(be);
    if (!bytes) return;
    CK(a->acl->aclrtMemcpyAsync(host, bytes, dev, bytes, ACL_MEMCPY_DEVICE_TO_HOST, a->stream), "aclrtMemcpyAsync");
    CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream");
}
static void a_copy(qt_backend *be, void *dst, const void *src, size_t bytes) {
    ascend *a = asc(be);
    if (!bytes) return;
    CK(a->acl->aclrtMemcpyAsync(dst, bytes, src, bytes, ACL_MEMCPY_DEVICE_TO_DEVICE, a->stream), "aclrtMemcpyAsync");
}
static void a_zero(qt_backend *be, void *dev, size_t bytes) {
    ascend *a = asc(be);
    if (!bytes) return;
    CK(a->acl->aclrtMemsetAsync(dev, bytes, 0, bytes, a->stream), "aclrtMemsetAsync");
}
static void a_sync(qt_backend *be) {
    CK(asc(be)->acl->aclrtSynchronizeStream(asc(be)->stream), "aclrtSynchronizeStream");
}

static int a_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what) {
    void *p = a_alloc(be, QT_MEM_DEVICE, bytes, what);
    if (!p) return qt_error_code();
    a_upload(be, p, host, bytes);
    *dev = p;
    return QT_OK;
}
static void a_release_mapped(qt_backend *be, const void *dev) { a_free(be, (void *)dev); }

static qt_event *a_event_record(qt_backend *be) {
    ascend *a = asc(be);
    aclrtEvent e = NULL;
    CK(a->acl->aclrtCreateEvent(&e), "aclrtCreateEvent");
    CK(a->acl->aclrtRecordEvent(e, a->stream), "aclrtRecordEvent");
    return (qt_event *)e;
}
static void a_event_wait(qt_backend *be, qt_event *e) {
    if (e) CK(asc(be)->acl->aclrtSynchronizeEvent((aclrtEvent)e), "aclrtSynchronizeEvent");
}
static void a_event_free(qt_backend *be, qt_event *e) {
    if (e) CK(asc(be)->acl->aclrtDestroyEvent((aclrtEvent)e), "aclrtDestroyEvent");
}

/* A device buffer of the backend's own of at least bytes (*buf, *have grown
 * as needed). Growing frees the old one only after the stream has run the
 * work queued on it. */
static void *grow(ascend *a, void **buf, size_t *have, size_t bytes, const char *what) {
    if (bytes <= *have && *buf) return *buf;
    size_t n = bytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : bytes;
    CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream");
    if (*buf) {
        CK(a->acl->aclrtFree(*buf), "aclrtFree");
        a->held -= *have;
    }
    *buf = dev_malloc(a, n);
    if (!*buf) asc_fail(what, ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    *have = n;
    a->held += n;
    if (a->held > a->peak) a->peak = a->held;
    return *buf;
}

/* ---- aclnn's objects -------------------------------------------------------- */
static aclDataType acl_dt(qt_dtype dt) {
    switch (dt) {
    case QT_F32: return ACL_FLOAT;
    case QT_F16: return ACL_FLOAT16;
    case QT_BF16: return ACL_BF16;
    default: return ACL_DT_UNDEFINED;
    }
}

/* A 2-D view (rows, cols) with element strides (rs, cs) over storage of n
 * elements at data, format ND. */
static aclTensor *view2(ascend *a, const void *data, qt_dtype dt, int64_t rows, int64_t cols, int64_t rs, int64_t cs,
                        int64_t n) {
    int64_t dims[2] = {rows, cols}, strides[2] = {rs, cs};
    aclTensor *t = a->acl->aclCreateTensor(dims, 2, acl_dt(dt), strides, 0, ACL_FORMAT_ND, &n, 1, (void *)data);
    if (!t) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    return t;
}
/* row-major (rows, cols) */
static aclTensor *mat(ascend *a, const void *data, qt_dtype dt, int64_t rows, int64_t cols) {
    return view2(a, data, dt, rows, cols, cols, 1, rows * cols);
}
static aclTensor *vec(ascend *a, const void *data, qt_dtype dt, int64_t n) {
    int64_t stride = 1;
    aclTensor *t = a->acl->aclCreateTensor(&n, 1, acl_dt(dt), &stride, 0, ACL_FORMAT_ND, &n, 1, (void *)data);
    if (!t) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    return t;
}
static aclScalar *scalar(ascend *a, float v) {
    aclScalar *s = a->acl->aclCreateScalar(&v, ACL_FLOAT);
    if (!s) asc_fail("aclCreateScalar", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    return s;
}

/* The second phase of every operator: the workspace its first phase asked
 * for, then the launch on the stream. */
#define LAUNCH(op, ...)                                                                                          \
    do {                                                                                                         \
        uint64_t wsz_ = 0;                                                                                       \
        aclOpExecutor *ex_ = NULL;                                                                               \
        CK(a->acl->op##GetWorkspaceSize(__VA_ARGS__, &wsz_, &ex_), #op "GetWorkspaceSize");                     \
        void *w_ = wsz_ ? grow(a, &a->ws, &a->ws_bytes, wsz_, "the operators' workspace") : NULL;              \
        CK(a->acl->op(w_, wsz_, ex_, a->stream), #op);                                                           \
    } while (0)

/* self (rows, cols) += alpha * m1 @ m2 (fp32, fp32 accumulation) */
static void addmm(ascend *a, aclTensor *self, aclTensor *m1, aclTensor *m2, float alpha) {
    aclScalar *beta = scalar(a, 1.0f), *al = scalar(a, alpha);
    LAUNCH(aclnnInplaceAddmm, self, m1, m2, beta, al, a->cube);
    a->acl->aclDestroyScalar(beta), a->acl->aclDestroyScalar(al);
    a->acl->aclDestroyTensor(self), a->acl->aclDestroyTensor(m1), a->acl->aclDestroyTensor(m2);
}
/* self += other (other broadcast to self) */
static void add(ascend *a, aclTensor *self, aclTensor *other) {
    aclScalar *one = scalar(a, 1.0f);
    LAUNCH(aclnnInplaceAdd, self, other, one);
    a->acl->aclDestroyScalar(one);
    a->acl->aclDestroyTensor(self), a->acl->aclDestroyTensor(other);
}
static void cast(ascend *a, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    if ((ddt == QT_BF16 || sdt == QT_BF16) && !a->bf16) {
        fprintf(stderr, "qtune: error: this NPU (%s) has no bfloat16; train in fp16 (\"precision\": \"fp16\") or "
                "convert the model's weights to fp16\n", a->soc);
        exit(1);
    }
    aclTensor *s = vec(a, src, sdt, (int64_t)n), *d = vec(a, dst, ddt, (int64_t)n);
    LAUNCH(aclnnCast, s, acl_dt(ddt), d);
    a->acl->aclDestroyTensor(s), a->acl->aclDestroyTensor(d);
}

/* W (OUT, IN) as fp32: itself, or cast into ws */
static const float *weight_f32(ascend *a, const void *w, qt_dtype wdt, int IN, int OUT, float *ws) {
    if (wdt == QT_F32) return w;
    if (wdt != QT_F16 && wdt != QT_BF16) refuse("matmul on quantized weights");
    cast(a, ws, QT_F32, w, wdt, (size_t)IN * OUT);
    return ws;
}

/* ---- the model's ops --------------------------------------------------------- */
static void a_matmul_forward(qt_backend *be, float *out, const float *inp, const void *w, qt_dtype wdt,
                             const float *bias, int N, int IN, int OUT, float alpha, int accumulate, float *ws) {
    ascend *a = asc(be);
    const float *W = weight_f32(a, w, wdt, IN, OUT, ws);
    if (!accumulate) a_zero(be, out, (size_t)N * OUT * sizeof(float));
    /* W^T as a view (IN, OUT) of W's storage: strides (1, IN) */
    addmm(a, mat(a, out, QT_F32, N, OUT), mat(a, inp, QT_F32, N, IN),
          view2(a, W, QT_F32, IN, OUT, 1, IN, (int64_t)IN * OUT), alpha);
    if (bias) add(a, mat(a, out, QT_F32, N, OUT), vec(a, bias, QT_F32, OUT));
}

static void a_matmul_backward(qt_backend *be, float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha,
                              float *ws) {
    ascend *a = asc(be);
    if (dinp) {
        const float *W = weight_f32(a, w, wdt, IN, OUT, ws);
        addmm(a, mat(a, dinp, QT_F32, N, IN), mat(a, dout, QT_F32, N, OUT), mat(a, W, QT_F32, OUT, IN), alpha);
    }
    if (dweight) /* dout^T as a view (OUT, N): strides (1, OUT) */
        addmm(a, mat(a, dweight, QT_F32, OUT, IN), view2(a, dout, QT_F32, OUT, N, 1, OUT, (int64_t)N * OUT),
              mat(a, inp, QT_F32, N, IN), alpha);
    if (dbias) {
        if (a->ones_n < (size_t)N) { /* ones for every element of the buffer grow gives */
            size_t have = a->ones_n * sizeof(float);
            grow(a, (void **)&a->ones, &have, (size_t)N * sizeof(float), "a vector of ones");
            size_t n = have / sizeof(float);
            float *h = qt_malloc(have, "ones");
            if (!h) asc_fail("a host buffer of ones", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
            for (size_t i = 0; i < n; i++) h[i] = 1.0f;
            a_upload(be, a->ones, h, have);
            qt_free(h);
            a->ones_n = n;
        }
        addmm(a, mat(a, dbias, QT_F32, 1, OUT), mat(a, a->ones, QT_F32, 1, N), mat(a, dout, QT_F32, N, OUT), alpha);
    }
}

static void a_rmsnorm_forward(qt_backend *be, float *out, float *rstd, const float *inp, const float *weight, int N,
                              int C, float eps) {
    ascend *a = asc(be);
    /* rstd (N) is the (N, 1) rstdOut aclnnRmsNorm's documentation gives */
    aclTensor *x = mat(a, inp, QT_F32, N, C), *g = vec(a, weight, QT_F32, C), *y = mat(a, out, QT_F32, N, C),
              *r = mat(a, rstd, QT_F32, N, 1);
    LAUNCH(aclnnRmsNorm, x, g, (double)eps, y, r);
    a->acl->aclDestroyTensor(x), a->acl->aclDestroyTensor(g), a->acl->aclDestroyTensor(y), a->acl->aclDestroyTensor(r);
}

static void a_rmsnorm_backward(qt_backend *be, float *dinp, float *dweight, const float *dout, const float *inp,
                               const float *weight, const float *rstd, int N, int C) {
    ascend *a = asc(be);
    /* aclnnRmsNormGrad writes dx and dgamma; the contract adds them: both go
     * to scratch first, then into dinp / dweight */
    size_t nc = (size_t)N * C;
    float *s = grow(a, (void **)&a->scratch, &a->scratch_bytes, (nc + (size_t)C) * sizeof(float), "scratch");
    aclTensor *dy = mat(a, dout, QT_F32, N, C), *x = mat(a, inp, QT_F32, N, C), *r = mat(a, rstd, QT_F32, N, 1),
              *g = vec(a, weight, QT_F32, C), *dx = mat(a, s, QT_F32, N, C), *dg = vec(a, s + nc, QT_F32, C);
    LAUNCH(aclnnRmsNormGrad, dy, x, r, g, dx, dg);
    a->acl->aclDestroyTensor(dy), a->acl->aclDestroyTensor(x), a->acl->aclDestroyTensor(r);
    a->acl->aclDestroyTensor(g), a->acl->aclDestroyTensor(dx), a->acl->aclDestroyTensor(dg);
    if (dinp) add(a, mat(a, dinp, QT_F32, N, C), mat(a, s, QT_F32, N, C));
    if (dweight) add(a, vec(a, dweight, QT_F32, C), vec(a, s + nc, QT_F32, C));
}

/* out (N, C) = wte rows ids: gathered in wte's dtype (aclnnEmbedding's out
 * is the weight's dtype), a 16-bit gather into scratch then cast to fp32 */
static void a_embedding_forward(qt_backend *be, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N,
                                int C) {
    ascend *a = asc(be);
    if (wdt != QT_F32 && wdt != QT_F16 && wdt != QT_BF16) refuse("embedding_forward of a quantized table");
    size_t nc = (size_t)N * C;
    void *g = wdt == QT_F32 ? (void *)out : grow(a, (void **)&a->scratch, &a->scratch_bytes, nc * 2, "scratch");
    /* aclnnEmbedding needs the table's shape (V, C), which the interface does
     * not pass: the rows of the block wte lies in (this backend allocated it) */
    int64_t V = (int64_t)(bytes_after(a, wte) / ((size_t)C * qt_dtype_size(wdt))), n = N, one = 1;
    if (V <= 0) asc_fail("embedding_forward (a table this backend did not allocate)", ACL_ERROR_INVALID_PARAM,
                         __FILE__, __LINE__);
    aclTensor *i = a->acl->aclCreateTensor(&n, 1, ACL_INT32, &one, 0, ACL_FORMAT_ND, &n, 1, (void *)ids);
    if (!i) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    aclTensor *w = mat(a, wte, wdt, V, C), *o = mat(a, g, wdt, N, C);
    LAUNCH(aclnnEmbedding, w, i, o);
    a->acl->aclDestroyTensor(w), a->acl->aclDestroyTensor(i), a->acl->aclDestroyTensor(o);
    if (wdt != QT_F32) cast(a, out, QT_F32, g, wdt, nc);
}

/* dst (N, I) view at column col of a row-major (N, 2I) buffer x2 <- src (N, I) */
static void to_half(ascend *a, float *x2, int col, const float *src, int N, int I) {
    aclTensor *d = view2(a, x2 + col, QT_F32, N, I, 2 * (int64_t)I, 1, (int64_t)N * 2 * I - col),
              *s = mat(a, src, QT_F32, N, I);
    LAUNCH(aclnnInplaceCopy, d, s);
    a->acl->aclDestroyTensor(d), a->acl->aclDestroyTensor(s);
}

/* aclnnSwiGlu takes gate and up as one contiguous (N, 2I) tensor split on
 * its last dimension (gate first, up second): both are copied into scratch */
static void a_swiglu_forward(qt_backend *be, float *out, const float *gate, const float *up, int N, int I) {
    ascend *a = asc(be);
    size_t n2 = (size_t)N * 2 * I;
    float *x2 = grow(a, (void **)&a->scratch, &a->scratch_bytes, n2 * sizeof(float), "scratch");
    to_half(a, x2, 0, gate, N, I), to_half(a, x2, I, up, N, I);
    aclTensor *x = mat(a, x2, QT_F32, N, 2 * I), *o = mat(a, out, QT_F32, N, I);
    LAUNCH(aclnnSwiGlu, x, -1, o);
    a->acl->aclDestroyTensor(x), a->acl->aclDestroyTensor(o);
}

/* aclnnSwiGluGrad writes [dgate | dup] as one (N, 2I) tensor: its halves are
 * added into dgate and dup (the += contract) */
static void a_swiglu_backward(qt_backend *be, float *dgate, float *dup, const float *dout, const float *gate,
                              const float *up, int N, int I) {
    ascend *a = asc(be);
    size_t n2 = (size_t)N * 2 * I;
    float *x2 = grow(a, (void **)&a->scratch, &a->scratch_bytes, 2 * n2 * sizeof(float), "scratch"), *g2 = x2 + n2;
    to_half(a, x2, 0, gate, N, I), to_half(a, x2, I, up, N, I);
    aclTensor *dy = mat(a, dout, QT_F32, N, I), *x = mat(a, x2, QT_F32, N, 2 * I), *o = mat(a, g2, QT_F32, N, 2 * I);
    LAUNCH(aclnnSwiGluGrad, dy, x, -1, o);
    a->acl->aclDestroyTensor(dy), a->acl->aclDestroyTensor(x), a->acl->aclDestroyTensor(o);
    int64_t rest = (int64_t)n2 - I;
    add(a, mat(a, dgate, QT_F32, N, I), view2(a, g2, QT_F32, N, I, 2 * (int64_t)I, 1, (int64_t)n2));
    add(a, mat(a, dup, QT_F32, N, I), view2(a, g2 + I, QT_F32, N, I, 2 * (int64_t)I, 1, rest));
}

static void a_scale(qt_backend *be, float *x, size_t n, float sc) {
    if (!n) return;
    ascend *a = asc(be);
    aclTensor *t = vec(a, x, QT_F32, (int64_t)n);
    aclScalar *k = scalar(a, sc);
    LAUNCH(aclnnInplaceMuls, t, k);
    a->acl->aclDestroyScalar(k), a->acl->aclDestroyTensor(t);
}

/* A 3-D view (d0, d1, d2) with element strides s0, s1 (s2 = 1) at data,
 * storage n elements. */
static aclTensor *view3(ascend *a, const float *data, int64_t d0, int64_t d1, int64_t d2, int64_t s0, int64_t s1,
                        int64_t n) {
    int64_t dims[3] = {d0, d1, d2}, strides[3] = {s0, s1, 1};
    aclTensor *t = a->acl->aclCreateTensor(dims, 3, ACL_FLOAT, strides, 0, ACL_FORMAT_ND, &n, 1, (void *)data);
    if (!t) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    return t;
}
static void mul3(ascend *a, aclTensor *x, aclTensor *tab, aclTensor *out) {
    LAUNCH(aclnnMul, x, tab, out);
    a->acl->aclDestroyTensor(x), a->acl->aclDestroyTensor(tab), a->acl->aclDestroyTensor(out);
}

/* RoPE, rotate-half (op_rope.c's rule): the cos and sin tables (N, D/2) are
 * made on the host from the positions (a download: CANN's rotary operators
 * take tables, and the angles' fp32 product and the double cos / sin are
 * the CPU's), then, with x1, x2 x's halves (N, NH, D/2) as strided views and
 * the tables broadcast over the heads:
 *   x1' = x1 cs - x2 sn,  x2' = x2 cs + x1 sn   (aclnnMul, aclnnInplaceAdd)
 * into scratch, copied back (aclnnInplaceCopy). sign -1: the backward. */
static void rope(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale,
                 float sign) {
    ascend *a = asc(be);
    const int half = D / 2;
    size_t nt = (size_t)N * half, nx = (size_t)N * NH * half;
    int32_t *hp = qt_malloc((size_t)N * sizeof(int32_t), "positions");
    float *tab = qt_malloc(2 * nt * sizeof(float), "rope tables");
    if (!hp || !tab) asc_fail("rope's host tables", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    a_download(be, hp, pos, (size_t)N * sizeof(int32_t));
    for (int n = 0; n < N; n++)
        for (int i = 0; i < half; i++) {
            float ang = (float)hp[n] * inv[i];
            tab[(size_t)n * half + i] = (float)cos((double)ang) * scale;
            tab[nt + (size_t)n * half + i] = sign * (float)sin((double)ang) * scale;
        }
    /* scratch: cs, sn (N, D/2) each, then A, B, C (N, NH, D/2) each */
    float *s = grow(a, (void **)&a->scratch, &a->scratch_bytes, (2 * nt + 3 * nx) * sizeof(float), "scratch");
    float *cs = s, *sn = s + nt, *A = sn + nt, *B = A + nx, *C = B + nx;
    a_upload(be, cs, tab, 2 * nt * sizeof(float));
    qt_free(tab), qt_free(hp);
    int64_t sr = (int64_t)NH * D, nxe = (int64_t)N * NH * D; /* x's row stride and elements */
#define X1 view3(a, x, N, NH, half, sr, D, nxe)
#define X2 view3(a, x + half, N, NH, half, sr, D, nxe - half)
#define TAB(t) view3(a, t, N, 1, half, half, half, (int64_t)nt)
#define OUT(o) view3(a, o, N, NH, half, (int64_t)NH * half, half, (int64_t)nx)
    mul3(a, X1, TAB(cs), OUT(A));
    mul3(a, X2, TAB(sn), OUT(B));
    mul3(a, X2, TAB(cs), OUT(C));
    aclScalar *m1 = scalar(a, -1.0f);
    aclTensor *tA = OUT(A), *tB = OUT(B);
    LAUNCH(aclnnInplaceAdd, tA, tB, m1); /* A = x1 cs - x2 sn */
    a->acl->aclDestroyScalar(m1), a->acl->aclDestroyTensor(tA), a->acl->aclDestroyTensor(tB);
    mul3(a, X1, TAB(sn), OUT(B));
    add(a, OUT(C), OUT(B)); /* C = x2 cs + x1 sn */
    aclTensor *d1 = X1, *s1 = OUT(A), *d2 = X2, *s2 = OUT(C);
    LAUNCH(aclnnInplaceCopy, d1, s1);
    LAUNCH(aclnnInplaceCopy, d2, s2);
    a->acl->aclDestroyTensor(d1), a->acl->aclDestroyTensor(s1), a->acl->aclDestroyTensor(d2);
    a->acl->aclDestroyTensor(s2);
#undef X1
#undef X2
#undef TAB
#undef OUT
}
static void a_rope_forward(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                           float scale) {
    rope(be, x, pos, N, NH, D, inv_freq, scale, 1.0f);
}
static void a_rope_backward(qt_backend *be, float *dx, const int32_t *pos, int N, int NH, int D,
                            const float *inv_freq, float scale) {
    rope(be, dx, pos, N, NH, D, inv_freq, scale, -1.0f);
}

/* Adam / AdamW (optim/adam.h's rule) as torch's single-tensor loop writes
 * it, one aclnn elementwise operator a step, each rounding to fp32 where the
 * CPU's loop does (so the CPU's bits, FMA contraction aside), in pieces of
 * ADAM_PIECE elements: three scratch vectors (the scaled gradient, g - m, the
 * denominator) a piece. */
#define ADAM_PIECE ((size_t)1 << 22)
static void adam_piece(ascend *a, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n,
                       float *gi, float *t, float *d) {
    int64_t len = (int64_t)n;
    aclTensor *P = vec(a, p, QT_F32, len), *G = vec(a, g, QT_F32, len), *M = vec(a, m, QT_F32, len);
    aclTensor *Vt = vec(a, v, QT_F32, len), *GI = vec(a, gi, QT_F32, len), *T = vec(a, t, QT_F32, len);
    aclTensor *D = vec(a, d, QT_F32, len);
    aclScalar *gs = scalar(a, k->gs), *wd = scalar(a, k->wd_mul), *l2 = scalar(a, k->wd_l2), *one = scalar(a, 1.0f);
    aclScalar *omb1 = scalar(a, k->omb1), *b2 = scalar(a, k->b2), *omb2 = scalar(a, k->omb2);
    aclScalar *bc2 = scalar(a, k->bc2_sqrt), *eps = scalar(a, k->eps), *step = scalar(a, -k->step_size);
    LAUNCH(aclnnMuls, G, gs, GI);                             /* gi = g * gs */
    LAUNCH(aclnnInplaceMuls, P, wd);                          /* AdamW: p *= 1 - lr*wd */
    if (k->wd_l2 != 0.0f) LAUNCH(aclnnInplaceAdd, GI, P, l2); /* Adam: gi += wd * p */
    LAUNCH(aclnnSub, GI, M, one, T);                          /* m += (1-beta1) (gi - m) */
    LAUNCH(aclnnInplaceAdd, M, T, omb1);
    LAUNCH(aclnnInplaceMuls, Vt, b2); /* v = v beta2 + (1-beta2) gi gi */
    LAUNCH(aclnnInplaceAddcmul, Vt, GI, GI, omb2);
    LAUNCH(aclnnSqrt, Vt, D); /* d = sqrt(v) / sqrt(1-beta2^t) + eps */
    LAUNCH(aclnnInplaceDivs, D, bc2);
    LAUNCH(aclnnInplaceAdds, D, eps, one);
    LAUNCH(aclnnInplaceAddcdiv, P, M, D, step); /* p -= step_size * m / d */
    aclScalar *sc[] = {gs, wd, l2, one, omb1, b2, omb2, bc2, eps, step};
    for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) a->acl->aclDestroyScalar(sc[i]);
    aclTensor *tt[] = {P, G, M, Vt, GI, T, D};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) a->acl->aclDestroyTensor(tt[i]);
}
static void a_adam(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n) {
    ascend *a = asc(be);
    size_t piece = n < ADAM_PIECE ? n : ADAM_PIECE;
    if (!piece) return;
    float *s = grow(a, (void **)&a->scratch, &a->scratch_bytes, 3 * piece * sizeof(float), "scratch");
    for (size_t i = 0; i < n; i += piece) {
        size_t c = n - i < piece ? n - i : piece;
        adam_piece(a, k, p + i, g + i, m + i, v + i, c, s, s + piece, s + 2 * piece);
    }
}

/* The gradient norm's sum of squares, in double with the CPU's fixed order
 * (its bits, the contract), on the host: the vector is downloaded whole and
 * summed by the CPU backend's kernel. aclnn's reductions sum in fp32 in an
 * order of their own; a device pass with the contract's bits is a kernel CANN
 * does not have. One download of n floats a call (the norm, the overflow
 * check): a cost to measure on a card. */
static double a_sum_squares(qt_backend *be, const float *x, size_t n) {
    if (!n) return 0.0;
    float *h = qt_malloc(n * sizeof(float), "the gradient, for its norm");
    if (!h) asc_fail("a host copy of the gradient for its norm", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    a_download(be, h, x, n * sizeof(float));
    double s = op_sum_squares(h, n);
    qt_free(h);
    return s;
}

static void a_acc(qt_backend *be, float *out, const float *x, size_t n) {
    if (!n) return;
    ascend *a = asc(be);
    add(a, vec(a, out, QT_F32, (int64_t)n), vec(a, x, QT_F32, (int64_t)n));
}

static void a_convert(qt_backend *be, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    if (!n) return;
    if (ddt == sdt) {
        a_copy(be, dst, src, n * qt_dtype_size(sdt));
        return;
    }
    if (acl_dt(ddt) == ACL_DT_UNDEFINED || acl_dt(sdt) == ACL_DT_UNDEFINED) refuse("convert of quantized data");
    cast(asc(be), dst, ddt, src, sdt, n);
}

static int a_hold_threads(qt_backend *be, int (*fn)(void *arg), void *arg) {
    (void)be;
    return fn(arg);
}
static int a_half_available(qt_backend *be, qt_dtype dt) {
    (void)be, (void)dt;
    return 0; /* no fp16 x fp16 -> fp32 matmul yet (acl_api.h says why) */
}
static int a_half_matmul(qt_backend *be, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w,
                         const float *bias, int N, int IN, int OUT, float alpha) {
    (void)be, (void)dt, (void)out, (void)inp, (void)w, (void)bias, (void)N, (void)IN, (void)OUT, (void)alpha;
    return QT_EUNSUPPORTED;
}
static int a_half_gemm(qt_backend *be, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                       const float *bias, int M, int N, int K, float alpha, int acc) {
    (void)be, (void)dt, (void)C, (void)A, (void)ta, (void)B, (void)tb, (void)bias, (void)M, (void)N, (void)K;
    (void)alpha, (void)acc;
    return QT_EUNSUPPORTED;
}

static size_t a_runtime_bytes(qt_backend *be) { return be->desc->runtime_bytes; }
static size_t a_device_peak_bytes(qt_backend *be) { return asc(be)->peak; }

static void a_close(qt_backend *be) {
    if (!be) return;
    ascend *a = asc(be);
    if (a) {
        a->acl->aclrtSynchronizeStream(a->stream);
        for (int i = 0; i < a->n_blk; i++) {
            if (a->blk[i].place == QT_MEM_PINNED) a->acl->aclrtFreeHost(a->blk[i].p);
            else if (a->blk[i].place == QT_MEM_HOST) qt_free(a->blk[i].p);
            else a->acl->aclrtFree(a->blk[i].p);
        }
        if (a->ws) a->acl->aclrtFree(a->ws);
        if (a->scratch) a->acl->aclrtFree(a->scratch);
        if (a->ones) a->acl->aclrtFree(a->ones);
        a->acl->aclrtDestroyStream(a->stream);
        a->acl->aclrtResetDevice(a->device);
        free(a->blk);
        free(a);
    }
    free(be);
}

/* ---- the ops not written yet: each refuses by name ---------------------------- */
static void n_embedding_backward(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    (void)be, (void)dwte, (void)dout, (void)ids, (void)N, (void)C;
    refuse("embedding_backward");
}
static void n_matvec(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias,
                     int N, int IN, int OUT, float alpha, int accumulate) {
    (void)be, (void)out, (void)x, (void)w, (void)wdt, (void)bias, (void)N, (void)IN, (void)OUT, (void)alpha;
    (void)accumulate;
    refuse("matvec (decoding)");
}
static void n_matvec_many(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    (void)be, (void)x, (void)N, (void)IN, (void)count, (void)o;
    refuse("matvec_many (decoding)");
}
static void n_attention_forward(qt_backend *be, float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    (void)be, (void)out, (void)lse, (void)q, (void)k, (void)v, (void)doc_start, (void)B, (void)T, (void)H, (void)KV;
    (void)D;
    refuse("attention_forward");
}
static void n_attention_backward(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v,
                                 const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    (void)be, (void)dq, (void)dk, (void)dv, (void)dout, (void)out, (void)lse, (void)q, (void)k, (void)v;
    (void)doc_start, (void)B, (void)T, (void)H, (void)KV, (void)D;
    refuse("attention_backward");
}
static void n_attention_forward_cached(qt_backend *be, float *out, const float *q, const float *kc, const float *vc,
                                       int n, int pos0, int H, int KV, int D) {
    (void)be, (void)out, (void)q, (void)kc, (void)vc, (void)n, (void)pos0, (void)H, (void)KV, (void)D;
    refuse("attention_forward_cached");
}
static void n_lmhead_ce_forward(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, int N, int C, int V, float *ws) {
    (void)be, (void)loss, (void)lse, (void)x, (void)w, (void)wdt, (void)targets, (void)N, (void)C, (void)V, (void)ws;
    refuse("lmhead_ce_forward");
}
static void n_lmhead_ce_backward(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                                 const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                 float *ws) {
    (void)be, (void)dx, (void)dw, (void)x, (void)w, (void)wdt, (void)targets, (void)lse, (void)dscale, (void)N;
    (void)C, (void)V, (void)ws;
    refuse("lmhead_ce_backward");
}
static void n_lmhead_ce_forward_keep(qt_backend *be, float *loss, float *lse, float *kept, const float *x,
                                     const void *w, qt_dtype wdt, const int32_t *targets, int N, int C, int V,
                                     float *ws) {
    (void)be, (void)loss, (void)lse, (void)kept, (void)x, (void)w, (void)wdt, (void)targets, (void)N, (void)C;
    (void)V, (void)ws;
    refuse("lmhead_ce_forward_keep");
}
static void n_lmhead_ce_backward_kept(qt_backend *be, float *dx, float *dw, float *kept, const float *x,
                                      const void *w, qt_dtype wdt, const int32_t *targets, const float *lse,
                                      float dscale, int N, int C, int V, float *ws) {
    (void)be, (void)dx, (void)dw, (void)kept, (void)x, (void)w, (void)wdt, (void)targets, (void)lse, (void)dscale;
    (void)N, (void)C, (void)V, (void)ws;
    refuse("lmhead_ce_backward_kept");
}
static void n_lmhead_ce_forward_dx(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V,
                                   float *ws) {
    (void)be, (void)loss, (void)lse, (void)dx, (void)x, (void)w, (void)wdt, (void)targets, (void)dscale, (void)N;
    (void)C, (void)V, (void)ws;
    refuse("lmhead_ce_forward_dx");
}
/* the f16 rounding of the loss scaler: whether the card's Cast makes
 * |x| >= 65520 inf (the contract) or saturates depends on its saturation
 * mode, not yet checked against CANN's documentation */
static void n_round_to_dtype(qt_backend *be, float *x, size_t n, qt_dtype dt) {
    (void)be, (void)x, (void)n, (void)dt;
    refuse("round_to_dtype");
}
static void n_round_store(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    (void)be, (void)x, (void)dst, (void)n, (void)dt;
    refuse("round_store");
}
static void n_dropout(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
                      uint32_t threshold, float keep_scale) {
    (void)be, (void)dst, (void)src, (void)n, (void)key, (void)threshold, (void)keep_scale;
    refuse("dropout");
}

/* ---- the table and the descriptor ---------------------------------------------- */
/* Facts the memory plan reads. Not from CANN's documentation and not
 * measured: `qtune plan --device npu` is not written yet (issue 45), so
 * runtime_bytes is 0 until a card measures it; 512-byte alignment is what
 * this backend asks of nobody (aclrtMalloc's own alignment was not
 * confirmed) and only sizes the plan's padding. */
static const qt_backend_desc ascend_desc = {
    .name = "npu",
    .alignment = 512,
    .native_dtypes = QT_BE_DT(QT_F32) | QT_BE_DT(QT_F16),
    .ce_chunk = 8192,
    .matmul_ws_cap = (size_t)-1 / 8, /* a 16-bit weight is cast whole to fp32 in ws */
    .runtime_bytes = 0,
    .runtime_extra = 0,
    .host_reads_device = 0,
};
const qt_backend_desc *qt_backend_ascend_desc(void) { return &ascend_desc; }

const qt_backend qt_backend_ascend_i = {
    .desc = &ascend_desc,
    .alloc = a_alloc,
    .free = a_free,
    .import_mapped = a_import_mapped,
    .release_mapped = a_release_mapped,
    .upload = a_upload,
    .download = a_download,
    .copy = a_copy,
    .zero = a_zero,
    .sync = a_sync,
    .event_record = a_event_record,
    .event_wait = a_event_wait,
    .event_free = a_event_free,
    .embedding_forward = a_embedding_forward,
    .embedding_backward = n_embedding_backward,
    .rmsnorm_forward = a_rmsnorm_forward,
    .rmsnorm_backward = a_rmsnorm_backward,
    .matmul_forward = a_matmul_forward,
    .matmul_backward = a_matmul_backward,
    .matvec = n_matvec,
    .matvec_many = n_matvec_many,
    .rope_forward = a_rope_forward,
    .rope_backward = a_rope_backward,
    .attention_forward = n_attention_forward,
    .attention_backward = n_attention_backward,
    .attention_forward_cached = n_attention_forward_cached,
    .swiglu_forward = a_swiglu_forward,
    .swiglu_backward = a_swiglu_backward,
    .lmhead_ce_forward = n_lmhead_ce_forward,
    .lmhead_ce_backward = n_lmhead_ce_backward,
    .lmhead_ce_forward_keep = n_lmhead_ce_forward_keep,
    .lmhead_ce_backward_kept = n_lmhead_ce_backward_kept,
    .lmhead_ce_forward_dx = n_lmhead_ce_forward_dx,
    .acc = a_acc,
    .hold_threads = a_hold_threads,
    .round_to_dtype = n_round_to_dtype,
    .round_store = n_round_store,
    .convert = a_convert,
    .half_available = a_half_available,
    .half_matmul = a_half_matmul,
    .half_gemm = a_half_gemm,
    .dropout = n_dropout,
    .adam = a_adam,
    .sum_squares = a_sum_squares,
    .scale = a_scale,
    .runtime_bytes = a_runtime_bytes,
    .device_peak_bytes = a_device_peak_bytes,
    .close = a_close,
};

/* ---- open ------------------------------------------------------------------------ */
int qt_ascend_library_check(void) { return qt_acl_load() ? QT_OK : qt_error_code(); }

static int acl_inited; /* aclInit may run once a process */

int qt_backend_ascend_open(int index, qt_backend **out) {
    *out = NULL;
    const qt_acl_api *acl = qt_acl_load();
    if (!acl) return qt_error_code();
    if (!acl_inited) {
        int rc = acl->aclInit(NULL);
        if (rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE)
            return QT_ERR(QT_EUNSUPPORTED, "CANN's aclInit failed (error %d): the Ascend driver may be missing or "
                          "stopped; run `npu-smi info` to see the cards", rc);
        acl_inited = 1;
    }
    uint32_t count = 0;
    if (acl->aclrtGetDeviceCount(&count) != ACL_SUCCESS || count == 0)
        return QT_ERR(QT_EUNSUPPORTED, "no Ascend NPU is visible (CANN reports none; ASCEND_RT_VISIBLE_DEVICES may "
                      "hide them); run `npu-smi info`, or use \"cpu\"");
    if (index < 0) index = 0;
    if ((uint32_t)index >= count)
        return QT_ERR(QT_EINVAL, "\"npu:%d\" names NPU %d, but %u NPU%s visible (numbered from 0); use \"npu:0\" or "
                      "\"npu\"", index, index, count, count == 1 ? " is" : "s are");
    int rc = acl->aclrtSetDevice(index);
    if (rc != ACL_SUCCESS)
        return QT_ERR(QT_EUNSUPPORTED, "CANN could not open NPU %d (error %d); run `npu-smi info`", index, rc);
    qt_backend *be = qt_malloc(sizeof *be, "npu backend");
    ascend *a = calloc(1, sizeof *a);
    if (!be || !a) return free(a), qt_free(be), acl->aclrtResetDevice(index), QT_ENOMEM;
    a->acl = acl, a->device = index;
    rc = acl->aclrtCreateStream(&a->stream);
    if (rc != ACL_SUCCESS) {
        free(a), qt_free(be), acl->aclrtResetDevice(index);
        return QT_ERR(QT_EUNSUPPORTED, "CANN could not create a stream on NPU %d (error %d)", index, rc);
    }
    const char *soc = acl->aclrtGetSocName();
    snprintf(a->soc, sizeof a->soc, "%s", soc ? soc : "unknown");
    /* BFLOAT16 and FLOAT32 matmuls in KEEP_DTYPE: Ascend 910B and 910_93 only
     * (aclnnMatmul's and aclnnRmsNorm's documentation); elsewhere fp32
     * matmuls run as fp16 (ALLOW_FP32_DOWN_PRECISION) */
    a->bf16 = !strncmp(a->soc, "Ascend910B", 10) || !strncmp(a->soc, "Ascend910_93", 12);
    a->cube = a->bf16 ? QT_ACL_CUBE_KEEP_DTYPE : QT_ACL_CUBE_ALLOW_FP32_DOWN_PRECISION;
    *be = qt_backend_ascend_i;
    be->impl = a;
    *out = be;
    return QT_OK;
}
