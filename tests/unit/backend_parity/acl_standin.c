/* A CPU stand-in of the part of CANN's API the Ascend backend calls
 * (src/backend/ascend/acl_api.h), so the backend's own code runs in CI where
 * there is no Ascend card: $QTUNE_ASCEND_LIB names this library and the
 * backend loads it in place of libascendcl/libnnopbase/libopapi.
 *
 * It keeps the documented rules, so the backend is held to them, not to
 * itself:
 *  - aclInit once (a second is ACL_ERROR_REPEAT_INITIALIZE); nothing before it;
 *    aclFinalize before the process exits (a process that leaves it out says
 *    so on stderr at its exit);
 *  - device memory is its own blocks: a memcpy whose kind does not match the
 *    pointers, or that runs past a block or destMax, is ACL_ERROR_INVALID_PARAM;
 *    new device memory holds NaN bytes, so an unset read shows;
 *  - a stream is an ordered queue: async copies, memsets, event records and
 *    operator launches wait in it until aclrtSynchronizeStream (or an event's
 *    synchronize) runs them, so a host buffer reused before the sync, or a
 *    result read without one, is caught;
 *  - two-phase operators: *GetWorkspaceSize checks the tensors (format ND,
 *    dtypes, shapes) and asks for a workspace (always some, so a backend that
 *    skips it fails); the launch checks the workspace is device memory of
 *    that size, and consumes the executor;
 *  - the card: $QTUNE_ACL_STANDIN_SOC (default "Ascend910B1"). On names
 *    outside Ascend910B / Ascend910_93, BFLOAT16 is refused and FLOAT32
 *    matmuls with cubeMathType KEEP_DTYPE are refused, as aclnnMatmul's and
 *    aclnnRmsNorm's documentation say for Ascend 910 / 310P; with
 *    ALLOW_FP32_DOWN_PRECISION the inputs are rounded to FLOAT16 there;
 *    FlashAttentionScore / Grad (documented for the Atlas A2 training
 *    series) and IndexAdd (A2 / A3) are refused there too.
 * Where the documentation does not say (the exact error code of some
 * refusals, Cast's rounding: round to nearest even here), the choice is the
 * stand-in's own. Built only for the tests. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/ascend/acl_api.h"

#define VIS __attribute__((visibility("default")))

/* ---- the card ------------------------------------------------------------ */
static int inited, device = -1;
static const char *soc(void) {
    const char *s = getenv("QTUNE_ACL_STANDIN_SOC");
    return s && *s ? s : "Ascend910B1";
}
static int soc_has_bf16(void) { return !strncmp(soc(), "Ascend910B", 10) || !strncmp(soc(), "Ascend910_93", 12); }
static int n_devices(void) {
    const char *s = getenv("QTUNE_ACL_STANDIN_DEVICES");
    return s && *s ? atoi(s) : 1;
}

/* ---- device memory: a list of blocks ------------------------------------- */
typedef struct block {
    char *p;
    size_t n;
    struct block *next;
} block;
static block *blocks;
static block *find(const void *p) {
    for (block *b = blocks; b; b = b->next)
        if ((const char *)p >= b->p && (const char *)p < b->p + (b->n ? b->n : 1)) return b;
    return NULL;
}
/* 1 when [p, p+n) lies inside one device block */
static int dev_range(const void *p, size_t n) {
    block *b = find(p);
    return b && (const char *)p + n <= b->p + b->n;
}

/* ---- streams: ordered queues of tasks ------------------------------------ */
typedef struct task {
    void (*run)(struct task *);
    struct task *next;
    void *dst;
    const void *src;
    size_t n;
    int value;
    aclOpExecutor *ex;
    int *flag; /* an event's "passed" */
} task;
typedef struct {
    task *head, *tail;
} stream;
static void push(stream *s, task *t) {
    t->next = NULL;
    if (s->tail) s->tail->next = t;
    else s->head = t;
    s->tail = t;
}
static void drain(stream *s, const int *until) {
    while (s->head) {
        task *t = s->head;
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        t->run(t);
        free(t);
        if (until && *until) return;
    }
}

VIS aclError aclInit(const char *configPath) {
    (void)configPath;
    if (inited) return ACL_ERROR_REPEAT_INITIALIZE;
    inited = 1;
    return ACL_SUCCESS;
}
VIS aclError aclFinalize(void) {
    inited = 0;
    return ACL_SUCCESS;
}
/* acl.h's documentation: the process calls aclFinalize before it exits, else
 * the exit may fail. A process that leaves it out says so on stderr here
 * (this runs at exit, after the program's atexit handlers). */
__attribute__((destructor)) static void finalize_checked(void) {
    if (inited)
        fprintf(stderr, "acl stand-in: the process exits after aclInit without aclFinalize (CANN's documentation: "
                        "call aclFinalize before the process exits)\n");
}
VIS const char *aclrtGetSocName(void) { return inited ? soc() : NULL; }
VIS aclError aclrtGetDeviceCount(uint32_t *count) {
    if (!count) return ACL_ERROR_INVALID_PARAM;
    *count = (uint32_t)n_devices();
    return ACL_SUCCESS;
}
VIS aclError aclrtSetDevice(int32_t id) {
    if (!inited) return ACL_ERROR_UNINITIALIZE;
    if (id < 0 || id >= n_devices()) return ACL_ERROR_INVALID_DEVICE; /* the stand-in's choice of code */
    device = id;
    return ACL_SUCCESS;
}
VIS aclError aclrtResetDevice(int32_t id) {
    if (id != device) return ACL_ERROR_INVALID_DEVICE;
    device = -1;
    return ACL_SUCCESS;
}
#define NEED_DEVICE()                                   \
    do {                                                \
        if (!inited) return ACL_ERROR_UNINITIALIZE;     \
        if (device < 0) return ACL_ERROR_INVALID_DEVICE; \
    } while (0)

VIS aclError aclrtCreateStream(aclrtStream *s) {
    NEED_DEVICE();
    *s = calloc(1, sizeof(stream));
    return *s ? ACL_SUCCESS : ACL_ERROR_BAD_ALLOC;
}
VIS aclError aclrtDestroyStream(aclrtStream s) {
    if (!s) return ACL_ERROR_INVALID_PARAM;
    drain(s, NULL);
    free(s);
    return ACL_SUCCESS;
}
VIS aclError aclrtSynchronizeStream(aclrtStream s) {
    if (!s) return ACL_ERROR_INVALID_PARAM;
    drain(s, NULL);
    return ACL_SUCCESS;
}

VIS aclError aclrtMalloc(void **p, size_t size, aclrtMemMallocPolicy policy) {
    NEED_DEVICE();
    if (!p || !size || policy > ACL_MEM_MALLOC_NORMAL_ONLY) return ACL_ERROR_INVALID_PARAM;
    block *b = malloc(sizeof *b);
    char *m = malloc(size);
    if (!b || !m) return free(b), free(m), ACL_ERROR_RT_MEMORY_ALLOCATION;
    memset(m, 0xff, size); /* NaN in every float type: an unset read shows */
    *b = (block){m, size, blocks};
    blocks = b;
    *p = m;
    return ACL_SUCCESS;
}
VIS aclError aclrtFree(void *p) {
    for (block **b = &blocks; *b; b = &(*b)->next)
        if ((*b)->p == p) {
            block *d = *b;
            *b = d->next;
            free(d->p);
            free(d);
            return ACL_SUCCESS;
        }
    return ACL_ERROR_INVALID_PARAM; /* not a device block's start */
}
VIS aclError aclrtMallocHost(void **p, size_t size) {
    NEED_DEVICE();
    if (!p || !size) return ACL_ERROR_INVALID_PARAM;
    *p = malloc(size);
    return *p ? ACL_SUCCESS : ACL_ERROR_BAD_ALLOC;
}
VIS aclError aclrtFreeHost(void *p) {
    if (find(p)) return ACL_ERROR_INVALID_PARAM;
    free(p);
    return ACL_SUCCESS;
}
static int kind_ok(void *dst, const void *src, size_t n, aclrtMemcpyKind kind) {
    int dd = dev_range(dst, n), sd = dev_range(src, n);
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_DEVICE: return dd && !find(src);
    case ACL_MEMCPY_DEVICE_TO_HOST: return sd && !find(dst);
    case ACL_MEMCPY_DEVICE_TO_DEVICE: return dd && sd;
    case ACL_MEMCPY_HOST_TO_HOST: return !find(dst) && !find(src);
    default: return 0;
    }
}
VIS aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind) {
    NEED_DEVICE();
    if (!dst || !src || count > destMax || !kind_ok(dst, src, count, kind)) return ACL_ERROR_INVALID_PARAM;
    memmove(dst, src, count); /* now, not ordered after any stream's queued work */
    return ACL_SUCCESS;
}
static void run_copy(task *t) { memmove(t->dst, t->src, t->n); }
static void run_set(task *t) { memset(t->dst, t->value, t->n); }
VIS aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                              aclrtStream s) {
    NEED_DEVICE();
    if (!s || !dst || !src || count > destMax || !kind_ok(dst, src, count, kind)) return ACL_ERROR_INVALID_PARAM;
    task *t = calloc(1, sizeof *t);
    *t = (task){.run = run_copy, .dst = dst, .src = src, .n = count}; /* the host side is read when it runs */
    push(s, t);
    return ACL_SUCCESS;
}
VIS aclError aclrtMemsetAsync(void *p, size_t maxCount, int32_t value, size_t count, aclrtStream s) {
    NEED_DEVICE();
    if (!s || count > maxCount || !dev_range(p, count)) return ACL_ERROR_INVALID_PARAM;
    task *t = calloc(1, sizeof *t);
    *t = (task){.run = run_set, .dst = p, .n = count, .value = value};
    push(s, t);
    return ACL_SUCCESS;
}

typedef struct {
    int recorded, passed;
    stream *on;
} event;
static void run_event(task *t) { *t->flag = 1; }
VIS aclError aclrtCreateEvent(aclrtEvent *e) {
    NEED_DEVICE();
    *e = calloc(1, sizeof(event));
    return *e ? ACL_SUCCESS : ACL_ERROR_BAD_ALLOC;
}
VIS aclError aclrtRecordEvent(aclrtEvent e, aclrtStream s) {
    if (!e || !s) return ACL_ERROR_INVALID_PARAM;
    event *ev = e;
    ev->recorded = 1, ev->passed = 0, ev->on = s;
    task *t = calloc(1, sizeof *t);
    *t = (task){.run = run_event, .flag = &ev->passed};
    push(s, t);
    return ACL_SUCCESS;
}
VIS aclError aclrtSynchronizeEvent(aclrtEvent e) {
    event *ev = e;
    if (!ev) return ACL_ERROR_INVALID_PARAM;
    if (ev->recorded && !ev->passed) drain(ev->on, &ev->passed);
    return ACL_SUCCESS;
}
VIS aclError aclrtDestroyEvent(aclrtEvent e) {
    free(e);
    return ACL_SUCCESS;
}
VIS aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *fr, size_t *total) {
    (void)attr;
    if (!fr || !total) return ACL_ERROR_INVALID_PARAM;
    *total = (size_t)32 << 30; /* the Atlas 300T A2's 32 GB, as the field report gives it */
    size_t used = 0;
    for (block *b = blocks; b; b = b->next) used += b->n;
    *fr = used < *total ? *total - used : 0;
    return ACL_SUCCESS;
}

/* ---- tensors and scalars -------------------------------------------------- */
#define MAXD 8
struct aclTensor {
    int64_t nd, dims[MAXD], strides[MAXD], offset, storage; /* storage: elements the data holds */
    aclDataType dt;
    aclFormat fmt;
    char *data;
};
struct aclScalar {
    double v;
};
static int dt_size(aclDataType dt) {
    switch (dt) {
    case ACL_FLOAT: case ACL_INT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: return 2;
    case ACL_UINT8: case ACL_BOOL: return 1;
    case ACL_INT64: return 8;
    default: return 0;
    }
}
VIS aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t nd, aclDataType dt, const int64_t *stride,
                               int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t snd,
                               void *data) {
    if (nd > MAXD || !dt_size(dt) || (nd && (!viewDims || !stride))) return NULL;
    aclTensor *t = calloc(1, sizeof *t);
    t->nd = (int64_t)nd, t->dt = dt, t->fmt = format, t->offset = offset, t->data = data, t->storage = 1;
    int64_t last = offset; /* the furthest element the view reaches */
    for (uint64_t i = 0; i < nd; i++) {
        t->dims[i] = viewDims[i], t->strides[i] = stride[i];
        if (viewDims[i] <= 0 || stride[i] < 0) return free(t), NULL;
        last += (viewDims[i] - 1) * stride[i];
    }
    for (uint64_t i = 0; i < snd; i++) t->storage *= storageDims[i];
    if (last >= t->storage || (data && !dev_range(data, (size_t)t->storage * dt_size(dt)))) return free(t), NULL;
    return t;
}
VIS aclnnStatus aclDestroyTensor(const aclTensor *t) {
    free((void *)t);
    return ACLNN_SUCCESS;
}
VIS aclScalar *aclCreateScalar(void *value, aclDataType dt) {
    if (!value) return NULL;
    aclScalar *s = calloc(1, sizeof *s);
    if (dt == ACL_FLOAT) s->v = *(float *)value;
    else if (dt == ACL_DOUBLE) s->v = *(double *)value;
    else if (dt == ACL_INT32) s->v = *(int32_t *)value;
    else return free(s), NULL;
    return s;
}
VIS aclnnStatus aclDestroyScalar(const aclScalar *s) {
    free((void *)s);
    return ACLNN_SUCCESS;
}
struct aclIntArray {
    uint64_t n;
    int64_t v[MAXD];
};
VIS aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    if ((size && !value) || size > MAXD) return NULL; /* the stand-in holds up to 8 */
    aclIntArray *a = calloc(1, sizeof *a);
    a->n = size;
    if (size) memcpy(a->v, value, size * sizeof(int64_t));
    return a;
}
VIS aclnnStatus aclDestroyIntArray(const aclIntArray *a) {
    free((void *)a);
    return ACLNN_SUCCESS;
}

/* element i (row-major over the view) of t */
static int64_t at(const aclTensor *t, int64_t i) {
    int64_t off = t->offset;
    for (int64_t d = t->nd - 1; d >= 0; d--) off += (i % t->dims[d]) * t->strides[d], i /= t->dims[d];
    return off;
}
static int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (int64_t d = 0; d < t->nd; d++) n *= t->dims[d];
    return n;
}
static float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 31) f = m ? NAN : INFINITY;
    else if (e == 0) f = ldexpf((float)m, -24);
    else f = ldexpf((float)(m | 1024), (int)e - 25);
    return s ? -f : f;
}
static uint16_t f2h(float f) { /* round to nearest even; beyond the range: inf */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t s = (uint16_t)((x >> 16) & 0x8000);
    if (isnan(f)) return s | 0x7e00;
    float a = fabsf(f);
    if (a >= 65520.0f) return s | 0x7c00;
    if (a < ldexpf(1.0f, -14)) return s | (uint16_t)lrintf(a * ldexpf(1.0f, 24)); /* subnormal (rint: even) */
    int e;
    float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    long q = lrintf(ldexpf(m, 11));
    if (q == 2048) q = 1024, e++;
    return s | (uint16_t)(((e + 14) << 10) + (q - 1024));
}
static float b2f(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static uint16_t f2b(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if (isnan(f)) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}
static float ld(const aclTensor *t, int64_t i) {
    int64_t o = at(t, i);
    switch (t->dt) {
    case ACL_FLOAT: return ((float *)t->data)[o];
    case ACL_FLOAT16: return h2f(((uint16_t *)t->data)[o]);
    case ACL_BF16: return b2f(((uint16_t *)t->data)[o]);
    default: return NAN;
    }
}
static void st(const aclTensor *t, int64_t i, float v) {
    int64_t o = at(t, i);
    switch (t->dt) {
    case ACL_FLOAT: ((float *)t->data)[o] = v; break;
    case ACL_FLOAT16: ((uint16_t *)t->data)[o] = f2h(v); break;
    case ACL_BF16: ((uint16_t *)t->data)[o] = f2b(v); break;
    default: break;
    }
}

/* ---- executors ------------------------------------------------------------ */
enum {
    OP_ADDMM, OP_ADD, OP_CAST, OP_RMSNORM, OP_RMSNORM_GRAD, OP_COPY, OP_MULS, OP_SWIGLU, OP_SWIGLU_GRAD, OP_EMBEDDING,
    OP_EW, /* the elementwise family below: e->cube holds which */
    OP_FA, OP_FA_GRAD, OP_LOGSUMEXP, OP_INDEX_ADD
};
struct aclOpExecutor {
    int op, cube;
    aclTensor t[12];
    double a, b, eps;
    int64_t heads, pre, next; /* the attention's headNum, preTokens, nextTokens */
    int bnsd, has_mask;       /* its layout (BSND 0, BNSD 1), and whether attenMask was given */
    uint64_t ws;
};
#define WS_BYTES 512 /* every operator asks for this much (more where it uses it) */

/* a tensor an operator may take: device data, ND, a float dtype the card has */
static aclnnStatus usable(const aclTensor *t) {
    if (!t || !t->data) return ACLNN_ERR_PARAM_NULLPTR;
    if (t->fmt != ACL_FORMAT_ND) return ACLNN_ERR_PARAM_INVALID;
    if (t->dt != ACL_FLOAT && t->dt != ACL_FLOAT16 && t->dt != ACL_BF16) return ACLNN_ERR_PARAM_INVALID;
    if (t->dt == ACL_BF16 && !soc_has_bf16()) return ACLNN_ERR_PARAM_INVALID;
    return ACLNN_SUCCESS;
}
static aclOpExecutor *exec_new(int op, uint64_t *ws, aclOpExecutor **out) {
    aclOpExecutor *e = calloc(1, sizeof *e);
    e->op = op, e->ws = WS_BYTES;
    *ws = e->ws;
    *out = e;
    return e;
}
static int same_shape(const aclTensor *a, const aclTensor *b) {
    if (a->nd != b->nd) return 0;
    for (int64_t d = 0; d < a->nd; d++)
        if (a->dims[d] != b->dims[d]) return 0;
    return 1;
}

static void run(aclOpExecutor *e);
static void run_task(task *t) {
    run(t->ex);
    free(t->ex);
}
static aclnnStatus launch(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s, int op) {
    if (!e || !s || e->op != op) return ACLNN_ERR_PARAM_INVALID;
    if (wsz < e->ws || !ws || !dev_range(ws, e->ws)) return ACLNN_ERR_PARAM_INVALID;
    task *t = calloc(1, sizeof *t);
    *t = (task){.run = run_task, .ex = e};
    push(s, t);
    return ACLNN_SUCCESS;
}

/* selfRef = beta * selfRef + alpha * (mat1 @ mat2) */
VIS aclnnStatus aclnnInplaceAddmmGetWorkspaceSize(const aclTensor *self, const aclTensor *m1, const aclTensor *m2,
                                                  const aclScalar *beta, const aclScalar *alpha, int8_t cube,
                                                  uint64_t *ws, aclOpExecutor **ex) {
    if (!beta || !alpha || !ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(m1)) || (rc = usable(m2))) return rc;
    if (self->nd != 2 || m1->nd != 2 || m2->nd != 2 || m1->dims[1] != m2->dims[0] || self->dims[0] != m1->dims[0] ||
        self->dims[1] != m2->dims[1])
        return ACLNN_ERR_PARAM_INVALID;
    if (m1->dt != m2->dt || cube < 0 || cube > 3) return ACLNN_ERR_PARAM_INVALID;
    if (m1->dt == ACL_FLOAT && cube == QT_ACL_CUBE_KEEP_DTYPE && !soc_has_bf16())
        return ACLNN_ERR_PARAM_INVALID; /* 910 / 310P: FLOAT32 with KEEP_DTYPE unsupported */
    aclOpExecutor *e = exec_new(OP_ADDMM, ws, ex);
    e->t[0] = *self, e->t[1] = *m1, e->t[2] = *m2, e->a = alpha->v, e->b = beta->v, e->cube = cube;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnInplaceAddmm(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) {
    return launch(ws, wsz, e, s, OP_ADDMM);
}

/* selfRef += alpha * other, other broadcast to selfRef's shape */
VIS aclnnStatus aclnnInplaceAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other,
                                                const aclScalar *alpha, uint64_t *ws, aclOpExecutor **ex) {
    if (!alpha || !ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(other))) return rc;
    if (other->nd > self->nd) return ACLNN_ERR_PARAM_INVALID;
    for (int64_t d = 1; d <= other->nd; d++) {
        int64_t o = other->dims[other->nd - d], s = self->dims[self->nd - d];
        if (o != s && o != 1) return ACLNN_ERR_PARAM_INVALID;
    }
    aclOpExecutor *e = exec_new(OP_ADD, ws, ex);
    e->t[0] = *self, e->t[1] = *other, e->a = alpha->v;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnInplaceAdd(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_ADD);
}

VIS aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, const aclDataType dtype, aclTensor *out,
                                          uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(out))) return rc;
    if (out->dt != dtype || !same_shape(self, out)) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_CAST, ws, ex);
    e->t[0] = *self, e->t[1] = *out;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnCast(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_CAST);
}

/* x (..., C), gamma (C), yOut as x, rstdOut x's shape with the last dim 1 */
VIS aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double eps,
                                             const aclTensor *y, const aclTensor *rstd, uint64_t *ws,
                                             aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(x)) || (rc = usable(gamma)) || (rc = usable(y)) || (rc = usable(rstd))) return rc;
    if (gamma->nd != 1 || gamma->dims[0] != x->dims[x->nd - 1] || !same_shape(x, y) || rstd->nd != x->nd ||
        rstd->dims[x->nd - 1] != 1 || rstd->dt != ACL_FLOAT)
        return ACLNN_ERR_PARAM_INVALID;
    for (int64_t d = 0; d + 1 < x->nd; d++)
        if (rstd->dims[d] != x->dims[d]) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_RMSNORM, ws, ex);
    e->t[0] = *x, e->t[1] = *gamma, e->t[2] = *y, e->t[3] = *rstd, e->eps = eps;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnRmsNorm(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_RMSNORM);
}

/* dxOut (as x) and dgammaOut (C, FLOAT32) written, not accumulated */
VIS aclnnStatus aclnnRmsNormGradGetWorkspaceSize(const aclTensor *dy, const aclTensor *x, const aclTensor *rstd,
                                                 const aclTensor *gamma, const aclTensor *dx,
                                                 const aclTensor *dgamma, uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(dy)) || (rc = usable(x)) || (rc = usable(rstd)) || (rc = usable(gamma)) || (rc = usable(dx)) ||
        (rc = usable(dgamma)))
        return rc;
    if (!same_shape(dy, x) || !same_shape(dx, x) || !same_shape(gamma, dgamma) || gamma->nd != 1 ||
        gamma->dims[0] != x->dims[x->nd - 1] || dgamma->dt != ACL_FLOAT || numel(rstd) * gamma->dims[0] != numel(x))
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_RMSNORM_GRAD, ws, ex);
    e->t[0] = *dy, e->t[1] = *x, e->t[2] = *rstd, e->t[3] = *gamma, e->t[4] = *dx, e->t[5] = *dgamma;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnRmsNormGrad(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_RMSNORM_GRAD);
}

/* selfRef = src, selfRef may be a strided view (aclnn_copy.h: non-contiguous supported) */
VIS aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor *self, const aclTensor *src, uint64_t *ws,
                                                 aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(src))) return rc;
    if (!same_shape(self, src)) return ACLNN_ERR_PARAM_INVALID; /* the stand-in takes no broadcast here */
    aclOpExecutor *e = exec_new(OP_COPY, ws, ex);
    e->t[0] = *self, e->t[1] = *src;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnInplaceCopy(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) {
    return launch(ws, wsz, e, s, OP_COPY);
}

VIS aclnnStatus aclnnInplaceMulsGetWorkspaceSize(aclTensor *self, const aclScalar *other, uint64_t *ws,
                                                 aclOpExecutor **ex) {
    if (!other || !ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self))) return rc;
    aclOpExecutor *e = exec_new(OP_MULS, ws, ex);
    e->t[0] = *self, e->a = other->v;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnInplaceMuls(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_MULS);
}

/* 1 when t is row-major without gaps (aclnnSwiGlu refuses non-contiguous tensors) */
static int contiguous(const aclTensor *t) {
    int64_t want = 1;
    for (int64_t d = t->nd - 1; d >= 0; d--) {
        if (t->dims[d] != 1 && t->strides[d] != want) return 0;
        want *= t->dims[d];
    }
    return 1;
}
/* the dimension dim names (negative from the end), -1 when none */
static int64_t axis(const aclTensor *t, int64_t dim) {
    int64_t d = dim < 0 ? dim + t->nd : dim;
    return d >= 0 && d < t->nd ? d : -1;
}
/* out = swish(A) * B, A and B x's halves on dim; out x's shape with dim halved */
VIS aclnnStatus aclnnSwiGluGetWorkspaceSize(const aclTensor *x, int64_t dim, const aclTensor *out, uint64_t *ws,
                                            aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(x)) || (rc = usable(out))) return rc;
    int64_t d = axis(x, dim);
    if (d != x->nd - 1 || x->dims[d] % 2 || !contiguous(x) || !contiguous(out) || out->nd != x->nd ||
        out->dims[d] * 2 != x->dims[d])
        return ACLNN_ERR_PARAM_INVALID; /* the stand-in splits the last dimension only */
    aclOpExecutor *e = exec_new(OP_SWIGLU, ws, ex);
    e->t[0] = *x, e->t[1] = *out;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnSwiGlu(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_SWIGLU);
}
/* out (x's shape) = [dA | dB] of sum(yGrad * swish(A) * B) */
VIS aclnnStatus aclnnSwiGluGradGetWorkspaceSize(const aclTensor *dy, const aclTensor *x, int64_t dim,
                                                const aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(dy)) || (rc = usable(x)) || (rc = usable(out))) return rc;
    int64_t d = axis(x, dim);
    if (d != x->nd - 1 || x->dims[d] % 2 || !contiguous(x) || !contiguous(out) || !contiguous(dy) ||
        !same_shape(x, out) || dy->nd != x->nd || dy->dims[d] * 2 != x->dims[d])
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_SWIGLU_GRAD, ws, ex);
    e->t[0] = *dy, e->t[1] = *x, e->t[2] = *out;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnSwiGluGrad(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_SWIGLU_GRAD);
}

/* out (indices' shape, C) = weight (V, C) rows; indices INT32 or INT64, out weight's dtype */
VIS aclnnStatus aclnnEmbeddingGetWorkspaceSize(const aclTensor *w, const aclTensor *idx, const aclTensor *out,
                                               uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex || !idx || !idx->data) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(w)) || (rc = usable(out))) return rc;
    if (idx->fmt != ACL_FORMAT_ND || idx->dt != ACL_INT32 || w->nd != 2 || out->dt != w->dt ||
        out->nd != idx->nd + 1 || out->dims[out->nd - 1] != w->dims[1])
        return ACLNN_ERR_PARAM_INVALID; /* INT64 indices are documented too; the stand-in takes INT32 only */
    for (int64_t d = 0; d < idx->nd; d++)
        if (out->dims[d] != idx->dims[d]) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_EMBEDDING, ws, ex);
    e->t[0] = *w, e->t[1] = *idx, e->t[2] = *out;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnEmbedding(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) {
    return launch(ws, wsz, e, s, OP_EMBEDDING);
}
static void run_embedding(aclOpExecutor *e) {
    const aclTensor *w = &e->t[0], *idx = &e->t[1], *o = &e->t[2];
    int64_t V = w->dims[0], C = w->dims[1], N = numel(idx);
    for (int64_t n = 0; n < N; n++) {
        int64_t r = ((const int32_t *)idx->data)[at(idx, n)];
        for (int64_t c = 0; c < C; c++) st(o, n * C + c, r >= 0 && r < V ? ld(w, r * C + c) : NAN);
    }
}

/* ---- elementwise operators: t[0] the output (selfRef or out), t[1..] inputs of its shape */
enum { EW_MULS, EW_SUB, EW_ADDS, EW_ADDCMUL, EW_ADDCDIV, EW_SQRT, EW_DIVS, EW_MUL, EW_LOG, EW_EXP };
static aclnnStatus ew(int kind, const aclTensor *out, const aclTensor *a, const aclTensor *b, const aclTensor *c,
                      double s1, double s2, uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex) return ACLNN_ERR_PARAM_NULLPTR;
    const aclTensor *t[4] = {out, a, b, c};
    for (int i = 0; i < 4; i++) {
        if (!t[i]) continue;
        aclnnStatus rc = usable(t[i]);
        if (rc) return rc;
        if (kind == EW_MUL && i == 2) { /* other broadcasts to self (aclnn_mul.h) */
            if (t[i]->nd > out->nd) return ACLNN_ERR_PARAM_INVALID;
            for (int64_t d = 1; d <= t[i]->nd; d++)
                if (t[i]->dims[t[i]->nd - d] != 1 && t[i]->dims[t[i]->nd - d] != out->dims[out->nd - d])
                    return ACLNN_ERR_PARAM_INVALID;
        } else if (!same_shape(t[i], out)) {
            return ACLNN_ERR_PARAM_INVALID; /* the stand-in takes no other broadcast */
        }
    }
    aclOpExecutor *e = exec_new(OP_EW, ws, ex);
    for (int i = 0; i < 4; i++)
        if (t[i]) e->t[i] = *t[i];
    e->cube = kind, e->a = s1, e->b = s2;
    return ACLNN_SUCCESS;
}
#define EW_LAUNCH(name)                                                                   \
    VIS aclnnStatus name(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) { \
        return launch(ws, wsz, e, s, OP_EW);                                              \
    }
VIS aclnnStatus aclnnMulsGetWorkspaceSize(const aclTensor *self, const aclScalar *other, aclTensor *out, uint64_t *ws,
                                          aclOpExecutor **ex) {
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_MULS, out, self, NULL, NULL, other->v, 0, ws, ex);
}
EW_LAUNCH(aclnnMuls)
VIS aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out, uint64_t *ws,
                                         aclOpExecutor **ex) {
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_MUL, out, self, other, NULL, 0, 0, ws, ex);
}
EW_LAUNCH(aclnnMul)
VIS aclnnStatus aclnnSubGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                         aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    if (!alpha) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_SUB, out, self, other, NULL, alpha->v, 0, ws, ex);
}
EW_LAUNCH(aclnnSub)
VIS aclnnStatus aclnnInplaceAddsGetWorkspaceSize(const aclTensor *self, const aclScalar *other,
                                                 const aclScalar *alpha, uint64_t *ws, aclOpExecutor **ex) {
    if (!other || !alpha) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_ADDS, self, self, NULL, NULL, other->v, alpha->v, ws, ex);
}
EW_LAUNCH(aclnnInplaceAdds)
VIS aclnnStatus aclnnInplaceAddcmulGetWorkspaceSize(const aclTensor *self, const aclTensor *t1, const aclTensor *t2,
                                                    const aclScalar *value, uint64_t *ws, aclOpExecutor **ex) {
    if (!value || !t1 || !t2) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_ADDCMUL, self, self, t1, t2, value->v, 0, ws, ex);
}
EW_LAUNCH(aclnnInplaceAddcmul)
VIS aclnnStatus aclnnInplaceAddcdivGetWorkspaceSize(const aclTensor *self, const aclTensor *t1, const aclTensor *t2,
                                                    const aclScalar *value, uint64_t *ws, aclOpExecutor **ex) {
    if (!value || !t1 || !t2) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_ADDCDIV, self, self, t1, t2, value->v, 0, ws, ex);
}
EW_LAUNCH(aclnnInplaceAddcdiv)
VIS aclnnStatus aclnnSqrtGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    return ew(EW_SQRT, out, self, NULL, NULL, 0, 0, ws, ex);
}
EW_LAUNCH(aclnnSqrt)
VIS aclnnStatus aclnnInplaceDivsGetWorkspaceSize(aclTensor *self, const aclScalar *other, uint64_t *ws,
                                                 aclOpExecutor **ex) {
    if (!other) return ACLNN_ERR_PARAM_NULLPTR;
    return ew(EW_DIVS, self, self, NULL, NULL, other->v, 0, ws, ex);
}
EW_LAUNCH(aclnnInplaceDivs)
VIS aclnnStatus aclnnLogGetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    return ew(EW_LOG, out, self, NULL, NULL, 0, 0, ws, ex);
}
EW_LAUNCH(aclnnLog)
VIS aclnnStatus aclnnInplaceExpGetWorkspaceSize(aclTensor *self, uint64_t *ws, aclOpExecutor **ex) {
    return ew(EW_EXP, self, self, NULL, NULL, 0, 0, ws, ex);
}
EW_LAUNCH(aclnnInplaceExp)
static int64_t bcast(const aclTensor *s, const aclTensor *o, int64_t i);
/* each as its documentation writes it, in fp32 */
static void run_ew(aclOpExecutor *e) {
    const aclTensor *t = e->t;
    float s1 = (float)e->a, s2 = (float)e->b;
    for (int64_t i = 0, n = numel(&t[0]); i < n; i++) {
        float a = ld(&t[1], i), r = 0.0f;
        switch (e->cube) {
        case EW_MULS: r = a * s1; break;
        case EW_SUB: r = a - s1 * ld(&t[2], i); break;                  /* self - alpha * other */
        case EW_ADDS: r = a + s2 * s1; break;                           /* self + alpha * other */
        case EW_ADDCMUL: r = a + s1 * ld(&t[2], i) * ld(&t[3], i); break; /* self + value * t1 * t2 */
        case EW_ADDCDIV: r = a + s1 * (ld(&t[2], i) / ld(&t[3], i)); break;
        case EW_SQRT: r = sqrtf(a); break;
        case EW_DIVS: r = a / s1; break;
        case EW_MUL: r = a * ld(&t[2], bcast(&t[0], &t[2], i)); break;
        case EW_LOG: r = logf(a); break;
        case EW_EXP: r = expf(a); break;
        }
        st(&t[0], i, r);
    }
}

/* ---- fused attention (FlashAttentionScore.md, FlashAttentionScoreGrad.md) --
 * out = softmax(mask(scale q k^T)) v per batch and query head, the key head
 * n / (Nq / Nkv) (GQA); softmaxMax / softmaxSum (B, N, Sq, 8) FLOAT, each
 * value 8 times; attenMask 1 = masked. Sparse modes: 0 (no mask: all keys;
 * with a mask: the mask and the preTokens / nextTokens band), 1 (allMask:
 * the mask, [B,N,S,S], [B,1,S,S], [1,1,S,S] or [S,S]), 2 (leftUpCausal) and
 * 3 (rightDownCausal), which take the compressed (2048, 2048) lower
 * triangle, checked here. The stand-in's own limits: layouts BSND and BNSD
 * (BSH and SBH are documented too), no pse, no dropout (keepProb 1), no
 * prefix; modes 4 to 8 refused. */
static int64_t fa_ix(const aclTensor *t, int bnsd, int64_t b, int64_t s, int64_t n, int64_t d) {
    if (bnsd) return ((b * t->dims[1] + n) * t->dims[2] + s) * t->dims[3] + d;
    return ((b * t->dims[1] + s) * t->dims[2] + n) * t->dims[3] + d;
}
/* (B, S, N, D) of a tensor in the layout */
static void fa_dims(const aclTensor *t, int bnsd, int64_t *B, int64_t *S, int64_t *N, int64_t *D) {
    *B = t->dims[0], *S = t->dims[bnsd ? 2 : 1], *N = t->dims[bnsd ? 1 : 2], *D = t->dims[3];
}
static int mask_byte(const aclTensor *m, int64_t i) { return ((const uint8_t *)m->data)[at(m, i)] != 0; }
/* 1 when key j is masked for query i of (b, n) */
static int fa_masked(const aclOpExecutor *e, const aclTensor *m, int64_t b, int64_t n, int64_t i, int64_t j,
                     int64_t Sq, int64_t Skv) {
    int mode = e->cube;
    if (mode == 2) return j > i;
    if (mode == 3) return j > i + Skv - Sq;
    if (!e->has_mask) return 0;
    if (mode == 0 && (j - i > e->next || i - j > e->pre)) return 1;
    if (m->nd == 2) return mask_byte(m, i * Skv + j);
    int64_t mb = m->dims[0] == 1 ? 0 : b, mn = m->dims[1] == 1 ? 0 : n;
    return mask_byte(m, ((mb * m->dims[1] + mn) * Sq + i) * Skv + j);
}
static aclnnStatus fa_check(const aclTensor *q, const aclTensor *k, const aclTensor *v, const aclTensor *mask,
                            const aclTensor *mx, const aclTensor *sm, int64_t heads, const char *layout,
                            int64_t mode, double keep, aclOpExecutor *e) {
    aclnnStatus rc;
    if (!layout || !mx || !sm) return ACLNN_ERR_PARAM_NULLPTR;
    if (!soc_has_bf16()) return ACLNN_ERR_PARAM_INVALID; /* "Atlas A2 training series" only (its document) */
    if ((rc = usable(q)) || (rc = usable(k)) || (rc = usable(v)) || (rc = usable(mx)) || (rc = usable(sm))) return rc;
    int bnsd = !strcmp(layout, "BNSD");
    if (!bnsd && strcmp(layout, "BSND")) return ACLNN_ERR_PARAM_INVALID; /* the stand-in's limit */
    if (q->nd != 4 || k->nd != 4 || !same_shape(k, v) || q->dt != k->dt || k->dt != v->dt)
        return ACLNN_ERR_PARAM_INVALID;
    int64_t B, Sq, N, D, Bk, Skv, Nk, Dk;
    fa_dims(q, bnsd, &B, &Sq, &N, &D), fa_dims(k, bnsd, &Bk, &Skv, &Nk, &Dk);
    if (B != Bk || D != Dk || heads != N || N % Nk || N > 256 || D > 512) return ACLNN_ERR_PARAM_INVALID;
    if (keep != 1.0) return ACLNN_ERR_PARAM_INVALID; /* dropout: the stand-in's limit */
    int64_t want[4] = {B, N, Sq, 8};
    const aclTensor *stat[2] = {mx, sm};
    for (int i = 0; i < 2; i++) {
        if (stat[i]->dt != ACL_FLOAT || stat[i]->nd != 4) return ACLNN_ERR_PARAM_INVALID;
        for (int d = 0; d < 4; d++)
            if (stat[i]->dims[d] != want[d]) return ACLNN_ERR_PARAM_INVALID;
    }
    if (mode < 0 || mode > 3) return ACLNN_ERR_PARAM_INVALID; /* modes 4-8: the stand-in's limit */
    if (mask) {
        if (!mask->data) return ACLNN_ERR_PARAM_NULLPTR;
        if ((mask->dt != ACL_UINT8 && mask->dt != ACL_BOOL) || mask->fmt != ACL_FORMAT_ND)
            return ACLNN_ERR_PARAM_INVALID;
        if (mode >= 2) { /* the compressed triangle */
            if (mask->nd != 2 || mask->dims[0] != 2048 || mask->dims[1] != 2048 || !contiguous(mask))
                return ACLNN_ERR_PARAM_INVALID;
        } else if (mask->nd == 2) {
            if (mask->dims[0] != Sq || mask->dims[1] != Skv) return ACLNN_ERR_PARAM_INVALID;
        } else if (mask->nd != 4 || (mask->dims[0] != 1 && mask->dims[0] != B) ||
                   (mask->dims[1] != 1 && mask->dims[1] != N) || mask->dims[2] != Sq || mask->dims[3] != Skv) {
            return ACLNN_ERR_PARAM_INVALID;
        }
    } else if (mode >= 1) {
        return ACLNN_ERR_PARAM_INVALID; /* modes 1-3 need their mask (the documents: else the result is wrong) */
    }
    e->bnsd = bnsd, e->has_mask = mask != NULL, e->cube = (int)mode, e->heads = heads;
    return ACLNN_SUCCESS;
}
/* modes 2 and 3 read the compressed triangle: 0 on and below the diagonal, 1 above; anything else is the
 * caller's error, shown as NaN outputs */
static int fa_triangle_ok(const aclOpExecutor *e, const aclTensor *m) {
    if (e->cube < 2) return 1;
    const uint8_t *p = (const uint8_t *)m->data + m->offset;
    for (int64_t i = 0; i < 2048; i++)
        for (int64_t j = 0; j < 2048; j++)
            if ((p[i * 2048 + j] != 0) != (j > i)) return 0;
    return 1;
}

VIS aclnnStatus aclnnFlashAttentionScoreGetWorkspaceSize(
    const aclTensor *q, const aclTensor *k, const aclTensor *v, const aclTensor *pse, const aclTensor *drop,
    const aclTensor *pad, const aclTensor *mask, const aclIntArray *prefix, double scale, double keep, int64_t pre,
    int64_t next, int64_t heads, char *layout, int64_t inner, int64_t mode, const aclTensor *mx, const aclTensor *sm,
    const aclTensor *smo, const aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    (void)inner, (void)smo; /* softmaxOutOut: reserved, unused (the document) */
    if (!ws || !ex || !out) return ACLNN_ERR_PARAM_NULLPTR;
    if (pse || drop || pad || prefix) return ACLNN_ERR_PARAM_INVALID; /* the stand-in's limit */
    aclOpExecutor tmp = {0};
    aclnnStatus rc = fa_check(q, k, v, mask, mx, sm, heads, layout, mode, keep, &tmp);
    if (rc) return rc;
    if ((rc = usable(out))) return rc;
    if (!same_shape(out, q) || out->dt != q->dt) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_FA, ws, ex);
    int op = e->op;
    uint64_t w = e->ws;
    *e = tmp, e->op = op, e->ws = w;
    e->t[0] = *q, e->t[1] = *k, e->t[2] = *v, e->t[4] = *mx, e->t[5] = *sm, e->t[6] = *out;
    if (mask) e->t[3] = *mask;
    e->a = scale, e->pre = pre, e->next = next;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnFlashAttentionScore(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) {
    return launch(ws, wsz, e, s, OP_FA);
}
VIS aclnnStatus aclnnFlashAttentionScoreGradGetWorkspaceSize(
    const aclTensor *q, const aclTensor *k, const aclTensor *v, const aclTensor *dy, const aclTensor *pse,
    const aclTensor *drop, const aclTensor *pad, const aclTensor *mask, const aclTensor *mx, const aclTensor *sm,
    const aclTensor *smin, const aclTensor *attn, const aclIntArray *prefix, double scale, double keep, int64_t pre,
    int64_t next, int64_t heads, char *layout, int64_t inner, int64_t mode, const aclTensor *dq, const aclTensor *dk,
    const aclTensor *dv, const aclTensor *dpse, uint64_t *ws, aclOpExecutor **ex) {
    (void)inner, (void)dpse;
    if (!ws || !ex || !dy || !attn || !dq || !dk || !dv) return ACLNN_ERR_PARAM_NULLPTR;
    if (smin) return ACLNN_ERR_PARAM_INVALID; /* softmaxInOptional: reserved, "must be passed null" */
    if (pse || drop || pad || prefix) return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor tmp = {0};
    aclnnStatus rc = fa_check(q, k, v, mask, mx, sm, heads, layout, mode, keep, &tmp);
    if (rc) return rc;
    if ((rc = usable(dy)) || (rc = usable(attn)) || (rc = usable(dq)) || (rc = usable(dk)) || (rc = usable(dv)))
        return rc;
    if (!same_shape(dy, q) || !same_shape(attn, q) || !same_shape(dq, q) || !same_shape(dk, k) || !same_shape(dv, v))
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_FA_GRAD, ws, ex);
    int op = e->op;
    uint64_t w = e->ws;
    *e = tmp, e->op = op, e->ws = w;
    e->t[0] = *q, e->t[1] = *k, e->t[2] = *v, e->t[4] = *mx, e->t[5] = *sm, e->t[6] = *attn, e->t[7] = *dy;
    e->t[8] = *dq, e->t[9] = *dk, e->t[10] = *dv;
    if (mask) e->t[3] = *mask;
    e->a = scale, e->pre = pre, e->next = next;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnFlashAttentionScoreGrad(void *ws, uint64_t wsz, aclOpExecutor *e, const aclrtStream s) {
    return launch(ws, wsz, e, s, OP_FA_GRAD);
}
/* the scores of query i (b, n) in sc[0..Skv), masked ones -inf; their max */
static double fa_scores(const aclOpExecutor *e, int64_t b, int64_t n, int64_t i, double *sc) {
    const aclTensor *q = &e->t[0], *k = &e->t[1], *m = &e->t[3];
    int64_t B, Sq, N, D, Skv, Nk;
    fa_dims(q, e->bnsd, &B, &Sq, &N, &D), fa_dims(k, e->bnsd, &B, &Skv, &Nk, &D);
    int64_t g = n / (N / Nk);
    double mx = -INFINITY;
    for (int64_t j = 0; j < Skv; j++) {
        if (fa_masked(e, m, b, n, i, j, Sq, Skv)) {
            sc[j] = -INFINITY;
            continue;
        }
        double s = 0;
        for (int64_t d = 0; d < D; d++)
            s += (double)ld(q, fa_ix(q, e->bnsd, b, i, n, d)) * ld(k, fa_ix(k, e->bnsd, b, j, g, d));
        sc[j] = s * e->a;
        if (sc[j] > mx) mx = sc[j];
    }
    return mx;
}
static void run_fa(aclOpExecutor *e) {
    const aclTensor *q = &e->t[0], *k = &e->t[1], *v = &e->t[2], *mx = &e->t[4], *sm = &e->t[5], *o = &e->t[6];
    int64_t B, Sq, N, D, Skv, Nk;
    fa_dims(q, e->bnsd, &B, &Sq, &N, &D), fa_dims(k, e->bnsd, &B, &Skv, &Nk, &D);
    int ok = !e->has_mask || fa_triangle_ok(e, &e->t[3]);
    double *sc = malloc((size_t)Skv * sizeof(double)), *acc = malloc((size_t)D * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < Sq; i++) {
                double m = fa_scores(e, b, n, i, sc), l = 0;
                for (int64_t d = 0; d < D; d++) acc[d] = 0;
                for (int64_t j = 0; j < Skv; j++) {
                    if (sc[j] == -INFINITY) continue;
                    double p = exp(sc[j] - m);
                    l += p;
                    for (int64_t d = 0; d < D; d++) acc[d] += p * ld(v, fa_ix(v, e->bnsd, b, j, n / (N / Nk), d));
                }
                for (int64_t d = 0; d < D; d++)
                    st(o, fa_ix(o, e->bnsd, b, i, n, d), ok && l > 0 ? (float)(acc[d] / l) : NAN);
                for (int c = 0; c < 8; c++) {
                    int64_t r = ((b * N + n) * Sq + i) * 8 + c;
                    st(mx, r, ok ? (float)m : NAN), st(sm, r, ok ? (float)l : NAN);
                }
            }
    free(sc), free(acc);
}
/* p = exp(s - max) / sum from the given statistics; dS = p (dy.v - dy.attentionIn); dq = scale dS k,
 * dk = scale dS^T q, dv = p^T dy, written */
static void run_fa_grad(aclOpExecutor *e) {
    const aclTensor *q = &e->t[0], *k = &e->t[1], *v = &e->t[2], *mx = &e->t[4], *sm = &e->t[5], *at_ = &e->t[6];
    const aclTensor *dy = &e->t[7], *dq = &e->t[8], *dk = &e->t[9], *dv = &e->t[10];
    int64_t B, Sq, N, D, Skv, Nk;
    fa_dims(q, e->bnsd, &B, &Sq, &N, &D), fa_dims(k, e->bnsd, &B, &Skv, &Nk, &D);
    int ok = !e->has_mask || fa_triangle_ok(e, &e->t[3]);
    int64_t nq = numel(q), nk = numel(k);
    double *gq = calloc((size_t)nq, sizeof(double)), *gk = calloc((size_t)nk, sizeof(double));
    double *gv = calloc((size_t)nk, sizeof(double)), *sc = malloc((size_t)Skv * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < Sq; i++) {
                int64_t g = n / (N / Nk), r = ((b * N + n) * Sq + i) * 8;
                fa_scores(e, b, n, i, sc);
                double m = ld(mx, r), l = ld(sm, r), di = 0;
                for (int64_t d = 0; d < D; d++)
                    di += (double)ld(dy, fa_ix(dy, e->bnsd, b, i, n, d)) * ld(at_, fa_ix(at_, e->bnsd, b, i, n, d));
                for (int64_t j = 0; j < Skv; j++) {
                    if (sc[j] == -INFINITY) continue;
                    double p = exp(sc[j] - m) / l, dp = 0;
                    for (int64_t d = 0; d < D; d++)
                        dp += (double)ld(dy, fa_ix(dy, e->bnsd, b, i, n, d)) * ld(v, fa_ix(v, e->bnsd, b, j, g, d));
                    double ds = p * (dp - di) * e->a;
                    for (int64_t d = 0; d < D; d++) {
                        int64_t iq = fa_ix(q, e->bnsd, b, i, n, d), ik = fa_ix(k, e->bnsd, b, j, g, d);
                        gq[iq] += ds * ld(k, ik);
                        gk[ik] += ds * ld(q, iq);
                        gv[ik] += p * ld(dy, iq);
                    }
                }
            }
    for (int64_t i = 0; i < nq; i++) st(dq, i, ok ? (float)gq[i] : NAN);
    for (int64_t i = 0; i < nk; i++) st(dk, i, ok ? (float)gk[i] : NAN), st(dv, i, ok ? (float)gv[i] : NAN);
    free(gq), free(gk), free(gv), free(sc);
}

/* ---- aclnnLogSumExp: out = log(sum(exp(self))) over dim (one dimension of a 2-D self here: the stand-in's
 * limit), keepDim keeping it as 1 */
VIS aclnnStatus aclnnLogSumExpGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keep,
                                               aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex || !dim) return ACLNN_ERR_PARAM_NULLPTR;
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(out))) return rc;
    if (self->nd != 2 || dim->n != 1) return ACLNN_ERR_PARAM_INVALID;
    int64_t d = axis(self, dim->v[0]);
    if (d < 0) return ACLNN_ERR_PARAM_INVALID;
    int64_t rest = self->dims[1 - d];
    if (keep ? (out->nd != 2 || out->dims[d] != 1 || out->dims[1 - d] != rest) : (out->nd != 1 || out->dims[0] != rest))
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_LOGSUMEXP, ws, ex);
    e->t[0] = *self, e->t[1] = *out, e->cube = (int)d;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnLogSumExp(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_LOGSUMEXP);
}
static void run_logsumexp(aclOpExecutor *e) {
    const aclTensor *x = &e->t[0], *o = &e->t[1];
    int d = e->cube;
    int64_t R = x->dims[1 - d], K = x->dims[d];
    for (int64_t r = 0; r < R; r++) {
        double m = -INFINITY, s = 0;
        for (int64_t k = 0; k < K; k++) m = fmax(m, ld(x, d ? r * K + k : k * R + r));
        for (int64_t k = 0; k < K; k++) s += exp(ld(x, d ? r * K + k : k * R + r) - m);
        st(o, r, (float)(m + log(s)));
    }
}

/* ---- aclnnIndexAdd: out = self, then out[index[i]] += alpha source[i] along dim (0 here: the stand-in's
 * limit); out may be self (the in-place form) */
VIS aclnnStatus aclnnIndexAddGetWorkspaceSize(const aclTensor *self, const int64_t dim, const aclTensor *index,
                                              const aclTensor *source, const aclScalar *alpha, aclTensor *out,
                                              uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex || !alpha || !index || !index->data) return ACLNN_ERR_PARAM_NULLPTR;
    if (!soc_has_bf16()) return ACLNN_ERR_PARAM_INVALID; /* Atlas A2 / A3 only: "Atlas training series x" */
    aclnnStatus rc;
    if ((rc = usable(self)) || (rc = usable(source)) || (rc = usable(out))) return rc;
    if ((index->dt != ACL_INT32 && index->dt != ACL_INT64) || index->nd > 1 || index->fmt != ACL_FORMAT_ND)
        return ACLNN_ERR_PARAM_INVALID;
    if (self->dt != source->dt || self->dt != out->dt || !same_shape(self, out) || self->nd != source->nd)
        return ACLNN_ERR_PARAM_INVALID;
    if (axis(self, dim) != 0 || self->nd != 2 || numel(index) != source->dims[0] || source->dims[1] != self->dims[1])
        return ACLNN_ERR_PARAM_INVALID;
    aclOpExecutor *e = exec_new(OP_INDEX_ADD, ws, ex);
    e->t[0] = *self, e->t[1] = *index, e->t[2] = *source, e->t[3] = *out, e->a = alpha->v;
    return ACLNN_SUCCESS;
}
VIS aclnnStatus aclnnIndexAdd(void *ws, uint64_t wsz, aclOpExecutor *e, aclrtStream s) {
    return launch(ws, wsz, e, s, OP_INDEX_ADD);
}
static void run_index_add(aclOpExecutor *e) {
    const aclTensor *self = &e->t[0], *idx = &e->t[1], *src = &e->t[2], *o = &e->t[3];
    int64_t V = self->dims[0], C = self->dims[1], n = numel(idx);
    if (o->data != self->data)
        for (int64_t i = 0; i < V * C; i++) st(o, i, ld(self, i));
    for (int64_t i = 0; i < n; i++) {
        int64_t r = idx->dt == ACL_INT32 ? ((const int32_t *)idx->data)[at(idx, i)]
                                         : ((const int64_t *)idx->data)[at(idx, i)];
        if (r < 0 || r >= V) continue; /* outside [0, V): the document's range, the caller's error */
        for (int64_t c = 0; c < C; c++) st(o, r * C + c, ld(o, r * C + c) + (float)e->a * ld(src, i * C + c));
    }
}

/* ---- the operators' arithmetic, when a stream runs them ------------------- */
static void run_swiglu(aclOpExecutor *e, int grad) {
    const aclTensor *x = &e->t[grad], *dy = &e->t[0], *o = &e->t[grad ? 2 : 1];
    int64_t I2 = x->dims[x->nd - 1], I = I2 / 2, N = numel(x) / I2;
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < I; i++) {
            float a = ld(x, n * I2 + i), b = ld(x, n * I2 + I + i), sg = 1.0f / (1.0f + expf(-a));
            if (!grad) {
                st(o, n * I + i, a * sg * b);
                continue;
            }
            float g = ld(dy, n * I + i);
            st(o, n * I2 + i, g * (sg + sg * (1.0f - sg) * a) * b);
            st(o, n * I2 + I + i, g * sg * a);
        }
}
static float down(const aclOpExecutor *e, float v) { /* FLOAT32 computed as FLOAT16 on 910 / 310P */
    return e->cube == QT_ACL_CUBE_ALLOW_FP32_DOWN_PRECISION && !soc_has_bf16() ? h2f(f2h(v)) : v;
}
static void run_addmm(aclOpExecutor *e) {
    const aclTensor *o = &e->t[0], *a = &e->t[1], *b = &e->t[2];
    int64_t M = a->dims[0], K = a->dims[1], N = b->dims[1];
    float *acc = malloc((size_t)(M * N) * sizeof(float));
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f; /* fp32 accumulation */
            for (int64_t k = 0; k < K; k++) s += down(e, ld(a, i * K + k)) * down(e, ld(b, k * N + j));
            acc[i * N + j] = s;
        }
    for (int64_t i = 0; i < M * N; i++) st(o, i, (float)(e->b * ld(o, i) + e->a * acc[i]));
    free(acc);
}
/* the element of o (broadcast to s's shape) under element i of s */
static int64_t bcast(const aclTensor *s, const aclTensor *o, int64_t i) {
    int64_t j = 0, rest = i, mul = 1;
    for (int64_t d = 1; d <= s->nd; d++) {
        int64_t idx = rest % s->dims[s->nd - d];
        rest /= s->dims[s->nd - d];
        if (d <= o->nd) {
            int64_t od = o->dims[o->nd - d];
            j += (od == 1 ? 0 : idx) * mul;
            mul *= od;
        }
    }
    return j;
}
static void run_add(aclOpExecutor *e) {
    const aclTensor *s = &e->t[0], *o = &e->t[1];
    for (int64_t i = 0, n = numel(s); i < n; i++) st(s, i, ld(s, i) + (float)e->a * ld(o, bcast(s, o, i)));
}
static void run_rmsnorm(aclOpExecutor *e) {
    const aclTensor *x = &e->t[0], *g = &e->t[1], *y = &e->t[2], *r = &e->t[3];
    int64_t C = g->dims[0], N = numel(x) / C;
    for (int64_t n = 0; n < N; n++) {
        float ss = 0.0f;
        for (int64_t c = 0; c < C; c++) ss += ld(x, n * C + c) * ld(x, n * C + c);
        float rs = 1.0f / sqrtf(ss / (float)C + (float)e->eps);
        for (int64_t c = 0; c < C; c++) st(y, n * C + c, ld(g, c) * (ld(x, n * C + c) * rs));
        st(r, n, rs);
    }
}
static void run_rmsnorm_grad(aclOpExecutor *e) {
    const aclTensor *dy = &e->t[0], *x = &e->t[1], *r = &e->t[2], *g = &e->t[3], *dx = &e->t[4], *dg = &e->t[5];
    int64_t C = g->dims[0], N = numel(x) / C;
    for (int64_t c = 0; c < C; c++) st(dg, c, 0.0f);
    for (int64_t n = 0; n < N; n++) {
        float rs = ld(r, n), dot = 0.0f;
        for (int64_t c = 0; c < C; c++) dot += ld(g, c) * ld(dy, n * C + c) * ld(x, n * C + c);
        float k = rs * rs * rs * dot / (float)C;
        for (int64_t c = 0; c < C; c++) {
            st(dx, n * C + c, rs * ld(g, c) * ld(dy, n * C + c) - k * ld(x, n * C + c));
            st(dg, c, ld(dg, c) + ld(dy, n * C + c) * ld(x, n * C + c) * rs);
        }
    }
}
static void run(aclOpExecutor *e) {
    switch (e->op) {
    case OP_ADDMM: run_addmm(e); break;
    case OP_ADD: run_add(e); break;
    case OP_CAST:
        for (int64_t i = 0, n = numel(&e->t[0]); i < n; i++) st(&e->t[1], i, ld(&e->t[0], i));
        break;
    case OP_RMSNORM: run_rmsnorm(e); break;
    case OP_RMSNORM_GRAD: run_rmsnorm_grad(e); break;
    case OP_COPY:
        for (int64_t i = 0, n = numel(&e->t[0]); i < n; i++) st(&e->t[0], i, ld(&e->t[1], i));
        break;
    case OP_MULS:
        for (int64_t i = 0, n = numel(&e->t[0]); i < n; i++) st(&e->t[0], i, ld(&e->t[0], i) * (float)e->a);
        break;
    case OP_SWIGLU: run_swiglu(e, 0); break;
    case OP_SWIGLU_GRAD: run_swiglu(e, 1); break;
    case OP_EMBEDDING: run_embedding(e); break;
    case OP_EW: run_ew(e); break;
    case OP_FA: run_fa(e); break;
    case OP_FA_GRAD: run_fa_grad(e); break;
    case OP_LOGSUMEXP: run_logsumexp(e); break;
    case OP_INDEX_ADD: run_index_add(e); break;
    }
}

/* every prototype of acl_api.h is defined above with its published signature */
QT_ACL_FUNCS(QT_ACL_PROTO)
