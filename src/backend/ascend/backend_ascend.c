/* The Ascend backend: one NPU, one stream, the ops through aclnn's two-phase
 * operators (GetWorkspaceSize, then the launch on the stream). Written
 * against CANN's published API (acl_api.h names each fact's source), tested
 * against the CPU stand-in of that API (tests/unit/backend_parity/
 * acl_standin.c), never run on an Ascend card.
 *
 * What exists: every op of backend.h. Memory, copies, events;
 * embedding forward (aclnnEmbedding) and backward (aclnnIndexAdd); matmul
 * forward and backward and decoding's matvec (fp32 on the cube unit, f16/bf16
 * weights cast to fp32 in ws first); RMSNorm, RoPE and SwiGLU forward and
 * backward; attention forward, backward and against a KV cache
 * (aclnnFlashAttentionScore / Grad); the lm_head + cross-entropy family
 * (matmuls, aclnnLogSumExp and elementwise operators, chunked over the
 * vocabulary); Adam / AdamW, convert and the 16-bit rounding (casts), acc,
 * scale, sum of squares (on the host), dropout (its mask made on the host:
 * CANN has no operator for backend.h's generator). 4-bit (QLoRA) weights are
 * refused by name the first time an op meets one (refuse below): the run
 * stops with a sentence, never a silently wrong result. half_matmul / half_gemm answer
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
#include "core/label.h"
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
    int a2;        /* the card is Atlas A2 / A3 class (the same two): FlashAttentionScore and IndexAdd exist */
    int8_t cube;   /* cubeMathType for fp32 matmuls: KEEP_DTYPE where the card allows it */
    void *ws;      /* the operators' workspace, grown on demand */
    size_t ws_bytes;
    float *scratch; /* the backward's written-not-added outputs, before they are added */
    size_t scratch_bytes;
    float *ones; /* N ones: dbias as ones (1, N) @ dout */
    size_t ones_n;
    uint8_t *mask; /* attention's attenMask: the compressed causal one, or a packed batch's (B, 1, T, T) */
    size_t mask_bytes;
    int mask_causal; /* mask holds the (2048, 2048) causal triangle */
    float *att;      /* attention's softmax statistics and written-not-added gradients */
    size_t att_bytes;
    float *ce; /* the cross-entropy's per-chunk log-sum-exps, target logits and row weights */
    size_t ce_bytes;
    void *wcast; /* a matvec's 16-bit weight as fp32 */
    size_t wcast_bytes;
    float *dmask; /* a dropout mask, keep_scale or 0 an element */
    size_t dmask_bytes;
    asc_blk *blk;
    int n_blk, cap_blk;
    size_t held, peak;
} ascend;

static ascend *asc(qt_backend *be) { return (ascend *)be->impl; }

#define ASC_CE_CHUNK 8192 /* the cross-entropy's vocabulary chunk (desc.ce_chunk) */

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
            "qtune: error: the Ascend backend has no %s yet (docs/backends.md lists what it has); run this job "
            "on \"cpu\" or \"cuda\"\n",
            op);
    fflush(stderr);
    exit(1);
}

/* An op whose aclnn operator CANN documents for Atlas A2 / A3 cards only
 * (Ascend910B, Ascend910_93): stop at its first use on another card. */
static void refuse_on_card(const ascend *a, const char *op, const char *operator_) {
    fprintf(stderr,
            "qtune: error: the Ascend backend's %s runs through %s, which CANN documents for Atlas A2 / A3 cards "
            "(Ascend910B, Ascend910_93) only, and this NPU is %s; run this job on one of those, or on \"cpu\"\n",
            op, operator_, a->soc);
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
/* host -> device, waited for (the host buffer is the caller's again) */
static void a_upload_raw(ascend *a, void *dev, const void *host, size_t bytes) {
    CK(a->acl->aclrtMemcpyAsync(dev, bytes, host, bytes, ACL_MEMCPY_HOST_TO_DEVICE, a->stream), "aclrtMemcpyAsync");
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
/* -1: what it wrote is not looked at here (the trainer checks the weights after) */
static int a_adam(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n) {
    ascend *a = asc(be);
    size_t piece = n < ADAM_PIECE ? n : ADAM_PIECE;
    if (!piece) return -1;
    float *s = grow(a, (void **)&a->scratch, &a->scratch_bytes, 3 * piece * sizeof(float), "scratch");
    for (size_t i = 0; i < n; i += piece) {
        size_t c = n - i < piece ? n - i : piece;
        adam_piece(a, k, p + i, g + i, m + i, v + i, c, s, s + piece, s + 2 * piece);
    }
    return -1;
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
        void *own[] = {a->mask, a->att, a->ce, a->wcast, a->dmask};
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
            if (own[i]) a->acl->aclrtFree(own[i]);
        a->acl->aclrtDestroyStream(a->stream);
        a->acl->aclrtResetDevice(a->device);
        free(a->blk);
        free(a);
    }
    free(be);
}

/* ---- embedding backward, decoding's matvec ---------------------------------------- */
/* dwte (V, C) += dout rows at ids: aclnnIndexAdd with out = self (the
 * in-place form; V from the block dwte lies in, as the forward's table) */
static void a_embedding_backward(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    ascend *a = asc(be);
    if (!a->a2) refuse_on_card(a, "embedding_backward", "aclnnIndexAdd");
    int64_t V = (int64_t)(bytes_after(a, dwte) / ((size_t)C * sizeof(float))), n = N, one = 1;
    if (V <= 0) asc_fail("embedding_backward (a gradient this backend did not allocate)", ACL_ERROR_INVALID_PARAM,
                         __FILE__, __LINE__);
    aclTensor *i = a->acl->aclCreateTensor(&n, 1, ACL_INT32, &one, 0, ACL_FORMAT_ND, &n, 1, (void *)ids);
    if (!i) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    aclTensor *self = mat(a, dwte, QT_F32, V, C), *src = mat(a, dout, QT_F32, N, C), *out = mat(a, dwte, QT_F32, V, C);
    aclScalar *al = scalar(a, 1.0f);
    LAUNCH(aclnnIndexAdd, self, 0, i, src, al, out);
    a->acl->aclDestroyScalar(al), a->acl->aclDestroyTensor(i), a->acl->aclDestroyTensor(self);
    a->acl->aclDestroyTensor(src), a->acl->aclDestroyTensor(out);
}

/* out (N, OUT) = alpha x @ W^T + bias (+= with accumulate): the matmul's
 * forward, a 16-bit W cast to fp32 in the backend's own buffer (the
 * interface gives matvec no ws). Not yet "a row's bits whatever N": that
 * needs aclnnMatmul's strong consistency (acl_api.h's list) */
static void a_matvec(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias,
                     int N, int IN, int OUT, float alpha, int accumulate) {
    ascend *a = asc(be);
    if (!OUT || !N) return;
    float *ws = NULL;
    if (wdt != QT_F32) ws = grow(a, &a->wcast, &a->wcast_bytes, (size_t)IN * OUT * sizeof(float), "matvec's weight");
    a_matmul_forward(be, out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate, ws);
}
static void a_matvec_many(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    for (int k = 0; k < count; k++) a_matvec(be, o[k].out, x, o[k].w, o[k].wdt, o[k].bias, N, IN, o[k].OUT, 1.0f, 0);
}

/* ---- attention: aclnnFlashAttentionScore / Grad ---------------------------------- */
/* A contiguous fp32 tensor of nd dimensions at data. */
static aclTensor *tens(ascend *a, const void *data, aclDataType dt, int nd, const int64_t *dims) {
    int64_t st[8], n = 1;
    for (int d = nd - 1; d >= 0; d--) st[d] = n, n *= dims[d];
    aclTensor *t = a->acl->aclCreateTensor(dims, (uint64_t)nd, dt, st, 0, ACL_FORMAT_ND, &n, 1, (void *)data);
    if (!t) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
    return t;
}
#define FA_CAUSAL 2048 /* the compressed causal mask's side (sparse modes 2 and 3) */

/* The attenMask for B sequences of T (1 = masked, the documents' rule) and
 * the sparse mode that reads it. Without doc_start: the compressed (2048,
 * 2048) lower triangle, built once, with sparse mode 3 (rightDownCausal:
 * query i of Sq sees keys up to i + Skv - Sq, so causal for training's Sq =
 * Skv and for a decode step's queries at the cache's end). With doc_start (a
 * packed batch): query t sees [doc_start[t], t], which no sparse mode gives,
 * so the whole (B, 1, T, T) mask with sparse mode 1 (allMask), built on the
 * host from the downloaded doc_start: B T^2 bytes, a cost to measure on a
 * card (aclnnFlashAttentionVarLenScore, one sequence a document, is the
 * other route). */
static aclTensor *fa_mask(ascend *a, const int32_t *doc_start, int B, int T, int64_t *mode) {
    if (!doc_start) {
        if (!a->mask_causal) {
            size_t n = (size_t)FA_CAUSAL * FA_CAUSAL;
            uint8_t *h = qt_malloc(n, "the causal mask");
            if (!h) asc_fail("a host causal mask", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
            for (size_t i = 0; i < FA_CAUSAL; i++)
                for (size_t j = 0; j < FA_CAUSAL; j++) h[i * FA_CAUSAL + j] = j > i;
            grow(a, (void **)&a->mask, &a->mask_bytes, n, "the causal mask");
            a_upload_raw(a, a->mask, h, n);
            qt_free(h);
            a->mask_causal = 1;
        }
        *mode = 3;
        int64_t d[2] = {FA_CAUSAL, FA_CAUSAL};
        return tens(a, a->mask, ACL_UINT8, 2, d);
    }
    size_t nt = (size_t)B * T, n = nt * (size_t)T;
    int32_t *ds = qt_malloc(nt * sizeof(int32_t), "doc_start");
    uint8_t *h = qt_malloc(n, "the packed batch's mask");
    if (!ds || !h) asc_fail("a host attention mask", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    CK(a->acl->aclrtMemcpyAsync(ds, nt * sizeof(int32_t), doc_start, nt * sizeof(int32_t), ACL_MEMCPY_DEVICE_TO_HOST,
                                a->stream), "aclrtMemcpyAsync");
    CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream");
    for (size_t r = 0; r < nt; r++)
        for (int j = 0; j < T; j++) h[r * T + j] = !(j >= ds[r] && j <= (int)(r % (size_t)T));
    a->mask_causal = 0;
    grow(a, (void **)&a->mask, &a->mask_bytes, n, "an attention mask");
    a_upload_raw(a, a->mask, h, n);
    qt_free(h), qt_free(ds);
    *mode = 1;
    int64_t d[4] = {B, 1, T, T};
    return tens(a, a->mask, ACL_UINT8, 4, d);
}

/* One FlashAttentionScore over q (B, Sq, H, D) and k, v (B, Skv, KV, D)
 * (layout BSND: qtune's own, so no transposes; GQA by the two head counts),
 * out (B, Sq, H, D) written; its softmax statistics (B, H, Sq, 8) at st. */
static void fa_forward(ascend *a, float *out, float *st, const float *q, const float *k, const float *v,
                       const int32_t *doc_start, int B, int Sq, int Skv, int H, int KV, int D) {
    if (!a->a2) refuse_on_card(a, "attention", "aclnnFlashAttentionScore");
    int64_t mode = 0;
    aclTensor *mask = fa_mask(a, doc_start, B, Sq, &mode);
    int64_t dq[4] = {B, Sq, H, D}, dk[4] = {B, Skv, KV, D}, ds[4] = {B, H, Sq, 8};
    aclTensor *Q = tens(a, q, ACL_FLOAT, 4, dq), *O = tens(a, out, ACL_FLOAT, 4, dq);
    aclTensor *K = tens(a, k, ACL_FLOAT, 4, dk), *Vt = tens(a, v, ACL_FLOAT, 4, dk); /* a cache: its first Skv rows */
    size_t ns = (size_t)B * H * Sq * 8;
    aclTensor *Mx = tens(a, st, ACL_FLOAT, 4, ds), *Sm = tens(a, st + ns, ACL_FLOAT, 4, ds);
    char layout[] = "BSND";
    LAUNCH(aclnnFlashAttentionScore, Q, K, Vt, NULL, NULL, NULL, mask, NULL, 1.0 / sqrt((double)D), 1.0, 2147483647,
           2147483647, H, layout, 0, mode, Mx, Sm, NULL, O);
    aclTensor *tt[] = {mask, Q, O, K, Vt, Mx, Sm};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) a->acl->aclDestroyTensor(tt[i]);
}

/* lse (B, H, T) = softmaxMax + log(softmaxSum), each the first of its 8 */
static void a_attention_forward(qt_backend *be, float *out, float *lse, const float *q, const float *k,
                                const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    ascend *a = asc(be);
    int64_t n = (int64_t)B * H * T;
    float *st = grow(a, (void **)&a->att, &a->att_bytes, (size_t)n * 17 * sizeof(float), "attention's statistics");
    fa_forward(a, out, st, q, k, v, doc_start, B, T, T, H, KV, D);
    float *lg = st + 16 * n; /* log(sum) */
    aclTensor *mx0 = view2(a, st, QT_F32, n, 1, 8, 1, 8 * n), *sm0 = view2(a, st + 8 * n, QT_F32, n, 1, 8, 1, 8 * n);
    aclTensor *L = mat(a, lse, QT_F32, n, 1), *G = mat(a, lg, QT_F32, n, 1);
    LAUNCH(aclnnInplaceCopy, L, mx0);
    LAUNCH(aclnnLog, sm0, G);
    a->acl->aclDestroyTensor(mx0), a->acl->aclDestroyTensor(sm0), a->acl->aclDestroyTensor(L);
    a->acl->aclDestroyTensor(G);
    add(a, mat(a, lse, QT_F32, n, 1), mat(a, lg, QT_F32, n, 1));
}

/* The backward takes softmaxMax = lse and softmaxSum = 1 (then exp(s - max)
 * / sum is the probability, as with the forward's own pair), so only lse
 * is kept between the passes. dq, dk, dv are written into scratch, then
 * added (the += contract). */
static void a_attention_backward(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v,
                                 const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    ascend *a = asc(be);
    if (!a->a2) refuse_on_card(a, "attention_backward", "aclnnFlashAttentionScoreGrad");
    int64_t n = (int64_t)B * H * T;
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D;
    float *st = grow(a, (void **)&a->att, &a->att_bytes, ((size_t)n * 16 + nq + 2 * nk) * sizeof(float),
                     "attention's gradients");
    float *sm = st + 8 * n, *gq = st + 16 * n, *gk = gq + nq, *gv = gk + nk;
    a_zero(be, st, (size_t)n * 16 * sizeof(float));
    add(a, mat(a, st, QT_F32, n, 8), mat(a, lse, QT_F32, n, 1)); /* max = lse, broadcast over the 8 */
    aclTensor *S = mat(a, sm, QT_F32, n, 8);
    aclScalar *one = scalar(a, 1.0f);
    LAUNCH(aclnnInplaceAdds, S, one, one); /* sum = 1 */
    a->acl->aclDestroyScalar(one), a->acl->aclDestroyTensor(S);
    int64_t mode = 0;
    aclTensor *mask = fa_mask(a, doc_start, B, T, &mode);
    int64_t dqd[4] = {B, T, H, D}, dkd[4] = {B, T, KV, D}, dsd[4] = {B, H, T, 8};
    aclTensor *Q = tens(a, q, ACL_FLOAT, 4, dqd), *K = tens(a, k, ACL_FLOAT, 4, dkd);
    aclTensor *Vt = tens(a, v, ACL_FLOAT, 4, dkd);
    aclTensor *DY = tens(a, dout, ACL_FLOAT, 4, dqd), *O = tens(a, out, ACL_FLOAT, 4, dqd);
    aclTensor *Mx = tens(a, st, ACL_FLOAT, 4, dsd), *Sm = tens(a, sm, ACL_FLOAT, 4, dsd);
    aclTensor *GQ = tens(a, gq, ACL_FLOAT, 4, dqd), *GK = tens(a, gk, ACL_FLOAT, 4, dkd);
    aclTensor *GV = tens(a, gv, ACL_FLOAT, 4, dkd);
    char layout[] = "BSND";
    LAUNCH(aclnnFlashAttentionScoreGrad, Q, K, Vt, DY, NULL, NULL, NULL, mask, Mx, Sm, NULL, O, NULL,
           1.0 / sqrt((double)D), 1.0, 2147483647, 2147483647, H, layout, 0, mode, GQ, GK, GV, NULL);
    aclTensor *tt[] = {mask, Q, K, Vt, DY, O, Mx, Sm, GQ, GK, GV};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) a->acl->aclDestroyTensor(tt[i]);
    add(a, vec(a, dq, QT_F32, (int64_t)nq), vec(a, gq, QT_F32, (int64_t)nq));
    add(a, vec(a, dk, QT_F32, (int64_t)nk), vec(a, gk, QT_F32, (int64_t)nk));
    add(a, vec(a, dv, QT_F32, (int64_t)nk), vec(a, gv, QT_F32, (int64_t)nk));
}

/* n new queries (1, n, H, D) against the cache's first pos0 + n rows of
 * (S, KV, D): the same operator, B = 1, sparse mode 3 (rightDownCausal:
 * query i sees keys up to pos0 + i). IncreFlashAttention is CANN's decode
 * operator, but it takes one query a sequence; one path for prefill and
 * decode keeps them the same arithmetic. */
static void a_attention_forward_cached(qt_backend *be, float *out, const float *q, const float *kc, const float *vc,
                                       int n, int pos0, int H, int KV, int D) {
    ascend *a = asc(be);
    float *st = grow(a, (void **)&a->att, &a->att_bytes, (size_t)H * n * 16 * sizeof(float), "attention's statistics");
    fa_forward(a, out, st, q, kc, vc, NULL, 1, n, pos0 + n, H, KV, D);
}

/* ---- lm_head + cross-entropy ------------------------------------------------------ */
/* The vocabulary in chunks of ce_chunk rows of W, so the (N, V) logits are
 * never whole: each chunk's logits (N, cv) = x @ Wc^T (aclnnInplaceAddmm, a
 * 16-bit Wc cast to fp32 first) go into ws, their row log-sum-exp
 * (aclnnLogSumExp) into a (chunks, N) table, and lse is the table's
 * log-sum-exp at the end. The target's logit is one element of the chunk
 * that holds it, copied device to device (the targets are downloaded once
 * a call: N small copies, a cost to measure on a card). aclnnCrossEntropyLoss
 * wants the whole (N, V) input, which the contract rules out. */
typedef struct {
    int nch;
    int32_t *tg; /* host copy of the targets */
    float *L, *Wf; /* ws: a chunk's logits (N, ce_chunk), its fp32 weight rows (ce_chunk, C) */
    float *tab, *tl, *lab; /* the chunks' lse (nch, N); target logits (N); 1 for a labelled row, else 0 (N) */
} ce_walk;

static void ce_begin(ascend *a, ce_walk *w, const int32_t *targets, int N, int C, int V, float *ws) {
    const int cc = (int)ASC_CE_CHUNK;
    w->nch = (V + cc - 1) / cc;
    w->L = ws, w->Wf = ws + (size_t)N * cc;
    float *b = grow(a, (void **)&a->ce, &a->ce_bytes, (size_t)N * (w->nch + 2) * sizeof(float), "the loss's rows");
    w->tab = b, w->tl = b + (size_t)N * w->nch, w->lab = w->tl + N;
    w->tg = qt_malloc((size_t)N * sizeof(int32_t), "targets");
    float *lab = qt_malloc((size_t)N * sizeof(float), "labels");
    if (!w->tg || !lab) asc_fail("the targets on the host", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    CK(a->acl->aclrtMemcpyAsync(w->tg, (size_t)N * sizeof(int32_t), targets, (size_t)N * sizeof(int32_t),
                                ACL_MEMCPY_DEVICE_TO_HOST, a->stream), "aclrtMemcpyAsync");
    CK(a->acl->aclrtSynchronizeStream(a->stream), "aclrtSynchronizeStream");
    for (int n = 0; n < N; n++) lab[n] = w->tg[n] == QT_IGNORE_INDEX ? 0.0f : 1.0f;
    a_upload_raw(a, w->lab, lab, (size_t)N * sizeof(float));
    qt_free(lab);
    (void)C;
}
static void ce_end(ce_walk *w) { qt_free(w->tg); }

/* chunk k's logits into w->L (N, cv); its fp32 weight rows, returned */
static const float *ce_logits(ascend *a, ce_walk *w, const float *x, const void *W, qt_dtype wdt, int k, int N,
                              int C, int cv) {
    const size_t c0 = (size_t)k * ASC_CE_CHUNK;
    const float *Wc;
    if (wdt == QT_F32) Wc = (const float *)W + c0 * C;
    else if (wdt == QT_F16 || wdt == QT_BF16) {
        cast(a, w->Wf, QT_F32, (const char *)W + c0 * C * 2, wdt, (size_t)cv * C);
        Wc = w->Wf;
    } else {
        refuse("lm_head on a quantized table");
        return NULL;
    }
    CK(a->acl->aclrtMemsetAsync(w->L, (size_t)N * cv * sizeof(float), 0, (size_t)N * cv * sizeof(float), a->stream),
       "aclrtMemsetAsync");
    addmm(a, mat(a, w->L, QT_F32, N, cv), mat(a, x, QT_F32, N, C), view2(a, Wc, QT_F32, C, cv, 1, C, (int64_t)cv * C),
          1.0f);
    return Wc;
}

/* loss (N) and lse (N) */
static void ce_forward(ascend *a, ce_walk *w, float *loss, float *lse, const float *x, const void *W, qt_dtype wdt,
                       int N, int C, int V) {
    const int cc = (int)ASC_CE_CHUNK;
    int64_t one = 1;
    aclIntArray *dim1 = a->acl->aclCreateIntArray(&one, 1);
    CK(a->acl->aclrtMemsetAsync(w->tl, (size_t)N * sizeof(float), 0, (size_t)N * sizeof(float), a->stream),
       "aclrtMemsetAsync");
    for (int k = 0; k < w->nch; k++) {
        const int c0 = k * cc, cv = V - c0 < cc ? V - c0 : cc;
        ce_logits(a, w, x, W, wdt, k, N, C, cv);
        aclTensor *Lt = mat(a, w->L, QT_F32, N, cv), *T = mat(a, w->tab + (size_t)k * N, QT_F32, N, 1);
        LAUNCH(aclnnLogSumExp, Lt, dim1, true, T);
        a->acl->aclDestroyTensor(Lt), a->acl->aclDestroyTensor(T);
        for (int n = 0; n < N; n++) {
            int t = w->tg[n];
            if (t == QT_IGNORE_INDEX || t < c0 || t >= c0 + cv) continue;
            CK(a->acl->aclrtMemcpyAsync(w->tl + n, sizeof(float), w->L + (size_t)n * cv + (t - c0), sizeof(float),
                                        ACL_MEMCPY_DEVICE_TO_DEVICE, a->stream), "aclrtMemcpyAsync");
        }
    }
    /* lse = log-sum-exp over the chunks: the table (nch, N) read as (N, nch) */
    aclTensor *Tt = view2(a, w->tab, QT_F32, N, w->nch, 1, N, (int64_t)N * w->nch), *Lse = vec(a, lse, QT_F32, N);
    LAUNCH(aclnnLogSumExp, Tt, dim1, false, Lse);
    a->acl->aclDestroyTensor(Tt), a->acl->aclDestroyTensor(Lse), a->acl->aclDestroyIntArray(dim1);
    /* loss = (lse - target logit) * labelled */
    aclTensor *A = vec(a, lse, QT_F32, N), *B = vec(a, w->tl, QT_F32, N), *O = vec(a, loss, QT_F32, N);
    aclScalar *s1 = scalar(a, 1.0f);
    LAUNCH(aclnnSub, A, B, s1, O);
    aclTensor *O2 = vec(a, loss, QT_F32, N), *M = vec(a, w->lab, QT_F32, N), *O3 = vec(a, loss, QT_F32, N);
    LAUNCH(aclnnMul, O2, M, O3);
    a->acl->aclDestroyScalar(s1);
    aclTensor *tt[] = {A, B, O, O2, M, O3};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) a->acl->aclDestroyTensor(tt[i]);
}

/* dx += dlogits @ W, dw += dlogits^T @ x (dw NULL: frozen), dlogits = dscale
 * (softmax - onehot) on labelled rows, 0 on the rest, chunk by chunk */
static void ce_backward(ascend *a, ce_walk *w, float *dx, float *dw, const float *x, const void *W, qt_dtype wdt,
                        const float *lse, float dscale, int N, int C, int V) {
    const int cc = (int)ASC_CE_CHUNK;
    float *rs = w->tl; /* the target logits are not needed here: dscale per labelled row */
    aclTensor *R = vec(a, rs, QT_F32, N), *Lb = vec(a, w->lab, QT_F32, N);
    aclScalar *ds = scalar(a, dscale);
    LAUNCH(aclnnMuls, Lb, ds, R);
    a->acl->aclDestroyTensor(R), a->acl->aclDestroyTensor(Lb), a->acl->aclDestroyScalar(ds);
    for (int k = 0; k < w->nch; k++) {
        const int c0 = k * cc, cv = V - c0 < cc ? V - c0 : cc;
        const float *Wc = ce_logits(a, w, x, W, wdt, k, N, C, cv);
        aclTensor *L1 = mat(a, w->L, QT_F32, N, cv), *Ls = mat(a, lse, QT_F32, N, 1);
        aclScalar *m1 = scalar(a, -1.0f);
        LAUNCH(aclnnInplaceAdd, L1, Ls, m1); /* logit - lse */
        LAUNCH(aclnnInplaceExp, L1);         /* softmax */
        aclTensor *L2 = mat(a, w->L, QT_F32, N, cv), *Rr = mat(a, rs, QT_F32, N, 1), *L3 = mat(a, w->L, QT_F32, N, cv);
        LAUNCH(aclnnMul, L2, Rr, L3); /* * dscale, or 0 */
        aclScalar *nd = scalar(a, -dscale), *one = scalar(a, 1.0f);
        for (int n = 0; n < N; n++) { /* - dscale at the target */
            int t = w->tg[n];
            if (t == QT_IGNORE_INDEX || t < c0 || t >= c0 + cv) continue;
            int64_t at1 = 1;
            aclTensor *e = a->acl->aclCreateTensor(&at1, 1, ACL_FLOAT, &at1, 0, ACL_FORMAT_ND, &at1, 1,
                                                   w->L + (size_t)n * cv + (t - c0));
            if (!e) asc_fail("aclCreateTensor", ACL_ERROR_INVALID_PARAM, __FILE__, __LINE__);
            LAUNCH(aclnnInplaceAdds, e, nd, one);
            a->acl->aclDestroyTensor(e);
        }
        a->acl->aclDestroyScalar(nd), a->acl->aclDestroyScalar(m1), a->acl->aclDestroyScalar(one);
        aclTensor *tt[] = {L1, Ls, L2, Rr, L3};
        for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) a->acl->aclDestroyTensor(tt[i]);
        if (dx) addmm(a, mat(a, dx, QT_F32, N, C), mat(a, w->L, QT_F32, N, cv), mat(a, Wc, QT_F32, cv, C), 1.0f);
        if (dw)
            addmm(a, mat(a, dw + (size_t)c0 * C, QT_F32, cv, C), view2(a, w->L, QT_F32, cv, N, 1, cv, (int64_t)N * cv),
                  mat(a, x, QT_F32, N, C), 1.0f);
    }
}

static void a_lmhead_ce_forward(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, int N, int C, int V, float *ws) {
    ascend *a = asc(be);
    ce_walk cw;
    ce_begin(a, &cw, targets, N, C, V, ws);
    ce_forward(a, &cw, loss, lse, x, w, wdt, N, C, V);
    ce_end(&cw);
}
static void a_lmhead_ce_backward(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                                 const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                 float *ws) {
    ascend *a = asc(be);
    ce_walk cw;
    ce_begin(a, &cw, targets, N, C, V, ws);
    ce_backward(a, &cw, dx, dw, x, w, wdt, lse, dscale, N, C, V);
    ce_end(&cw);
}
/* The kept pair recomputes the logits in the backward rather than keeping
 * them (kept is left unused): the gradients are lmhead_ce_backward's, as
 * the contract asks, at one more logits GEMM's cost. */
static void a_lmhead_ce_forward_keep(qt_backend *be, float *loss, float *lse, float *kept, const float *x,
                                     const void *w, qt_dtype wdt, const int32_t *targets, int N, int C, int V,
                                     float *ws) {
    (void)kept;
    a_lmhead_ce_forward(be, loss, lse, x, w, wdt, targets, N, C, V, ws);
}
static void a_lmhead_ce_backward_kept(qt_backend *be, float *dx, float *dw, float *kept, const float *x,
                                      const void *w, qt_dtype wdt, const int32_t *targets, const float *lse,
                                      float dscale, int N, int C, int V, float *ws) {
    (void)kept;
    a_lmhead_ce_backward(be, dx, dw, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}
static void a_lmhead_ce_forward_dx(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V,
                                   float *ws) {
    ascend *a = asc(be);
    ce_walk cw;
    ce_begin(a, &cw, targets, N, C, V, ws);
    ce_forward(a, &cw, loss, lse, x, w, wdt, N, C, V);
    ce_backward(a, &cw, dx, NULL, x, w, wdt, lse, dscale, N, C, V);
    ce_end(&cw);
}

/* ---- 16-bit rounding: a cast there and back (aclnnCast) ---------------------------- */
/* f16: round to nearest even, |x| >= 65520 to inf, as the loss scaler needs.
 * aclnnCast's documentation does not say what an fp32 beyond fp16's range
 * becomes; the stand-in makes it inf (the IEEE rule). A card whose cast
 * saturates to 65504 (CANN's "saturation mode") would hide an overflow from
 * the loss scaler: scripts/npu-check's first check on a card. */
static void a_round_store(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    if (!n || dt == QT_F32) return;
    ascend *a = asc(be);
    cast(a, dst, dt, x, QT_F32, n);
    cast(a, x, QT_F32, dst, dt, n);
}
static void a_round_to_dtype(qt_backend *be, float *x, size_t n, qt_dtype dt) {
    if (!n || dt == QT_F32) return;
    ascend *a = asc(be);
    uint16_t *h = grow(a, (void **)&a->scratch, &a->scratch_bytes, n * 2, "scratch");
    a_round_store(be, x, h, n, dt);
}

/* LoRA dropout: backend.h's counter-based mask (qt_dropout_u24 of the key
 * and the element's index, the CPU's bits) has no CANN operator, so the
 * mask is made on the host as keep_scale or 0 an element (the CPU
 * backend's own op_dropout on ones), uploaded, and applied with aclnnMul;
 * + 0 (aclnnInplaceAdds) turns a dropped negative's -0 into the CPU's +0.
 * n floats made and uploaded a call, one call a LoRA module a micro-step: a
 * cost to measure on a card (an Ascend C kernel of the generator is the way
 * out). */
static void a_dropout(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
                      uint32_t threshold, float keep_scale) {
    if (!n) return;
    ascend *a = asc(be);
    float *h = qt_malloc(n * sizeof(float), "a dropout mask");
    if (!h) asc_fail("a host dropout mask", ACL_ERROR_BAD_ALLOC, __FILE__, __LINE__);
    for (size_t i = 0; i < n; i++) h[i] = 1.0f;
    op_dropout(h, h, n, key, threshold, keep_scale);
    float *m = grow(a, (void **)&a->dmask, &a->dmask_bytes, n * sizeof(float), "a dropout mask");
    a_upload_raw(a, m, h, n * sizeof(float));
    qt_free(h);
    aclTensor *S = vec(a, src, QT_F32, (int64_t)n), *M = vec(a, m, QT_F32, (int64_t)n);
    aclTensor *D = vec(a, dst, QT_F32, (int64_t)n);
    LAUNCH(aclnnMul, S, M, D);
    aclTensor *D2 = vec(a, dst, QT_F32, (int64_t)n);
    aclScalar *zero = scalar(a, 0.0f), *one = scalar(a, 1.0f);
    LAUNCH(aclnnInplaceAdds, D2, zero, one);
    a->acl->aclDestroyScalar(zero), a->acl->aclDestroyScalar(one);
    a->acl->aclDestroyTensor(S), a->acl->aclDestroyTensor(M), a->acl->aclDestroyTensor(D), a->acl->aclDestroyTensor(D2);
}

/* ---- the table and the descriptor ---------------------------------------------- */
/* Facts the memory plan reads. Not from CANN's documentation and not
 * measured: `qtune plan --device npu` sizes with the Atlas 300T A2's card
 * (src/train/plan_card.c), but runtime_bytes (CANN's own memory) is 0 until a
 * card measures it; 512-byte alignment is what
 * this backend asks of nobody (aclrtMalloc's own alignment was not
 * confirmed) and only sizes the plan's padding. */
static const qt_backend_desc ascend_desc = {
    .name = "npu",
    .alignment = 512,
    .native_dtypes = QT_BE_DT(QT_F32) | QT_BE_DT(QT_F16),
    .ce_chunk = ASC_CE_CHUNK,
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
    .embedding_backward = a_embedding_backward,
    .rmsnorm_forward = a_rmsnorm_forward,
    .rmsnorm_backward = a_rmsnorm_backward,
    .matmul_forward = a_matmul_forward,
    .matmul_backward = a_matmul_backward,
    .matvec = a_matvec,
    .matvec_many = a_matvec_many,
    .rope_forward = a_rope_forward,
    .rope_backward = a_rope_backward,
    .attention_forward = a_attention_forward,
    .attention_backward = a_attention_backward,
    .attention_forward_cached = a_attention_forward_cached,
    .swiglu_forward = a_swiglu_forward,
    .swiglu_backward = a_swiglu_backward,
    .lmhead_ce_forward = a_lmhead_ce_forward,
    .lmhead_ce_backward = a_lmhead_ce_backward,
    .lmhead_ce_forward_keep = a_lmhead_ce_forward_keep,
    .lmhead_ce_backward_kept = a_lmhead_ce_backward_kept,
    .lmhead_ce_forward_dx = a_lmhead_ce_forward_dx,
    .acc = a_acc,
    .hold_threads = a_hold_threads,
    .round_to_dtype = a_round_to_dtype,
    .round_store = a_round_store,
    .convert = a_convert,
    .half_available = a_half_available,
    .half_matmul = a_half_matmul,
    .half_gemm = a_half_gemm,
    .dropout = a_dropout,
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

/* aclFinalize "before the process exits" (acl.h's documentation, which
 * advises against calling it from a destructor): registered once aclInit has
 * succeeded, so it runs at exit before anything CANN registered during
 * aclInit is torn down, after the backend's close (reset device) on a normal
 * end, and on an error's exit too */
static void acl_finalize_at_exit(void) {
    const qt_acl_api *acl = qt_acl_load();
    if (acl && acl_inited) acl->aclFinalize();
    acl_inited = 0;
}

static int acl_init(const qt_acl_api *acl) {
    if (acl_inited) return QT_OK;
    int rc = acl->aclInit(NULL);
    if (rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE)
        return QT_ERR(QT_EUNSUPPORTED, "CANN's aclInit failed (error %d): the Ascend driver may be missing or "
                      "stopped; run `npu-smi info` to see the cards", rc);
    acl_inited = 1;
    atexit(acl_finalize_at_exit);
    return QT_OK;
}

int qt_ascend_probe(char *why, size_t cap) {
    const qt_acl_api *acl = qt_acl_load();
    uint32_t count = 0;
    if (!acl || acl_init(acl) != QT_OK) {
        snprintf(why, cap, "%s", qt_error_message());
        qt_error_clear();
        return 0;
    }
    if (acl->aclrtGetDeviceCount(&count) != ACL_SUCCESS || !count)
        snprintf(why, cap, "CANN reports no Ascend NPU (ASCEND_RT_VISIBLE_DEVICES may hide them)"), count = 0;
    return (int)count;
}

int qt_backend_ascend_open(int index, qt_backend **out) {
    *out = NULL;
    const qt_acl_api *acl = qt_acl_load();
    if (!acl) return qt_error_code();
    QT_TRY(acl_init(acl));
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
    /* aclnnFlashAttentionScore / Grad: "Atlas A2 training series" only;
     * aclnnIndexAdd: Atlas A2 / A3 (their documents) */
    a->a2 = a->bf16;
    *be = qt_backend_ascend_i;
    be->impl = a;
    *out = be;
    return QT_OK;
}
