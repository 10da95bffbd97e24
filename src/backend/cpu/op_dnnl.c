/* oneDNN's GEMMs (see op_dnnl.h): the fp32 sgemm, and bf16 GEMM.
 *
 * bf16: oneDNN 2.x's C API has no
 * bf16 gemm call (only dnnl_sgemm and int8), so this is the matmul
 * primitive: src (M, K), weights (K, N), dst (M, N) fp32. A transposed
 * operand is the caller's row-major buffer read with the "ba" tag (no
 * transpose copy): the forward's W^T is W (OUT, IN) read that way, the
 * weight gradient's dout^T is dout (N, OUT). Accumulation into dst (beta 1)
 * is a "sum" post-op. The engine, stream and primitive are made per call and
 * freed after it, and oneDNN's own primitive cache makes the repeated
 * creation of the same shape cheap.
 *
 * The library is opened with dlopen on first use, not linked: a run that
 * never asks for a bf16 GEMM (every run on a CPU without AVX512_BF16) does
 * not load it and pays neither its start-up nor its resident pages (linked,
 * it added ~4 MB to every qtune process's peak RSS). The opened library and
 * its function table are the one process-wide state here, set once. */
#include "backend/cpu/op_dnnl.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "qtune_config.h"

#if QTUNE_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

/* The oneDNN 2.x C API (dnnl_matmul_desc_init, output scales); 3.x replaced
 * both, and with it this file refuses like a build without oneDNN. */
#if QTUNE_HAVE_DNNL && DNNL_VERSION_MAJOR == 2
#include <dlfcn.h>
#include <pthread.h>

#define DNNL_FUNCS(X)                                                                                                 \
    X(engine_create) X(engine_destroy) X(stream_create) X(stream_destroy) X(stream_wait)                              \
    X(memory_desc_init_by_tag) X(memory_desc_init_by_strides) X(matmul_desc_init) X(primitive_attr_create) X(primitive_attr_destroy)                 \
    X(primitive_attr_set_output_scales) X(primitive_desc_create) X(primitive_desc_destroy) X(primitive_desc_query)    \
    X(primitive_desc_query_md) X(primitive_create) X(primitive_destroy) X(memory_create) X(memory_destroy)            \
    X(primitive_execute) X(post_ops_create) X(post_ops_append_sum) X(post_ops_destroy)                    \
    X(primitive_attr_set_post_ops) X(sgemm)

static struct {
#define DECL(f) __typeof__(dnnl_##f) *f;
    DNNL_FUNCS(DECL)
#undef DECL
    int ok;
} dn;
static pthread_once_t dn_once = PTHREAD_ONCE_INIT;
static long dn_runs;       /* bf16 GEMMs run, for op_dnnl_bf16_runs (atomic adds) */
static long dn_sgemm_runs; /* fp32 sgemm calls, for op_dnnl_sgemm_runs */

static void dn_open(void) {
    void *h = dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libdnnl.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
#define LOAD(f)                                                                                                       \
    if (!(*(void **)&dn.f = dlsym(h, "dnnl_" #f))) return;
    DNNL_FUNCS(LOAD)
#undef LOAD
    dn.ok = 1;
}

static int dn_ready(void) {
    pthread_once(&dn_once, dn_open);
    return dn.ok;
}

typedef struct {
    dnnl_engine_t eng;
    dnnl_stream_t stream;
    dnnl_primitive_attr_t attr;
    dnnl_post_ops_t post;
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, bias, dst;
} dnnl_call;

static void call_free(dnnl_call *c) {
    if (c->dst) dn.memory_destroy(c->dst);
    if (c->bias) dn.memory_destroy(c->bias);
    if (c->wei) dn.memory_destroy(c->wei);
    if (c->src) dn.memory_destroy(c->src);
    if (c->prim) dn.primitive_destroy(c->prim);
    if (c->pd) dn.primitive_desc_destroy(c->pd);
    if (c->attr) dn.primitive_attr_destroy(c->attr);
    if (c->post) dn.post_ops_destroy(c->post);
    if (c->stream) dn.stream_destroy(c->stream);
    if (c->eng) dn.engine_destroy(c->eng);
}

/* The primitive descriptor for dst (M, N) = alpha * op(A) (M, K) @ op(B) (K, N)
 * [+ bias (N)] [+ dst]; dnnl_unimplemented (and so a refusal) where the CPU has
 * no bf16 kernel, and a refusal too when oneDNN would fall back to its
 * reference kernel ("ref:..."), far slower than sgemm. */
static int call_init(dnnl_call *c, int M, int N, int K, int lda, int ta, int ldb, int tb, int ldc, int has_bias,
                     float alpha, int acc) {
    dnnl_memory_desc_t src_md, wei_md, bias_md, dst_md;
    dnnl_dims_t sd = {M, K}, wd = {K, N}, bd = {1, N}, dd = {M, N};
    /* row-major with leading dimensions: op(A) (m, k) at A[m * lda + k], or A[k * lda + m] read transposed */
    dnnl_dims_t ss = {ta ? 1 : lda, ta ? lda : 1}, ws = {tb ? 1 : ldb, tb ? ldb : 1}, ds = {ldc, 1};
    if (dn.engine_create(&c->eng, dnnl_cpu, 0) != dnnl_success) return QT_EUNSUPPORTED;
    if (dn.memory_desc_init_by_strides(&src_md, 2, sd, dnnl_bf16, ss) != dnnl_success ||
        dn.memory_desc_init_by_strides(&wei_md, 2, wd, dnnl_bf16, ws) != dnnl_success ||
        dn.memory_desc_init_by_tag(&bias_md, 2, bd, dnnl_f32, dnnl_ab) != dnnl_success ||
        dn.memory_desc_init_by_strides(&dst_md, 2, dd, dnnl_f32, ds) != dnnl_success)
        return QT_EUNSUPPORTED;
    dnnl_matmul_desc_t desc;
    if (dn.matmul_desc_init(&desc, &src_md, &wei_md, has_bias ? &bias_md : NULL, &dst_md) != dnnl_success)
        return QT_EUNSUPPORTED;
    if (dn.primitive_attr_create(&c->attr) != dnnl_success) return QT_EUNSUPPORTED;
    if (alpha != 1.0f && dn.primitive_attr_set_output_scales(c->attr, 1, 0, &alpha) != dnnl_success)
        return QT_EUNSUPPORTED;
    if (acc && (dn.post_ops_create(&c->post) != dnnl_success || dn.post_ops_append_sum(c->post, 1.0f) != dnnl_success ||
                dn.primitive_attr_set_post_ops(c->attr, c->post) != dnnl_success))
        return QT_EUNSUPPORTED;
    if (dn.primitive_desc_create(&c->pd, &desc, c->attr, c->eng, NULL) != dnnl_success) return QT_EUNSUPPORTED;
    const char *impl = NULL;
    if (dn.primitive_desc_query(c->pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl ||
        !strncmp(impl, "ref", 3))
        return QT_EUNSUPPORTED;
    return QT_OK;
}

/* QTUNE_BF16_GEMM=off: the bf16 GEMM is not used (the fp32 sgemm path on an
 * AVX512_BF16 CPU, as on one without; tests and comparisons). */
static int bf16_off(void) {
    const char *e = getenv("QTUNE_BF16_GEMM");
    return e && (!strcmp(e, "off") || !strcmp(e, "0"));
}

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static int probe_ok;

static void bf16_probe(void) {
    if (!dn_ready()) return;
    dnnl_call c;
    memset(&c, 0, sizeof c);
    probe_ok = call_init(&c, 16, 32, 64, 64, 0, 64, 1, 32, 1, 1.0f, 0) == QT_OK;
    call_free(&c);
}

int op_dnnl_bf16_available(void) {
    if (bf16_off()) return 0;
    pthread_once(&probe_once, bf16_probe);
    return probe_ok;
}

int op_dnnl_bf16_gemm_ld(float *C, int ldc, const uint16_t *A, int lda, int ta, const uint16_t *B, int ldb, int tb,
                         const float *bias, int M, int N, int K, float alpha, int acc) {
    if ((bias && (alpha != 1.0f || acc)) || bf16_off() || !dn_ready()) return QT_EUNSUPPORTED;
    dnnl_call c;
    memset(&c, 0, sizeof c);
    int rc = call_init(&c, M, N, K, lda, ta, ldb, tb, ldc, bias != NULL, alpha, acc);
    if (rc == QT_OK) {
        const dnnl_memory_desc_t *src_md = dn.primitive_desc_query_md(c.pd, dnnl_query_src_md, 0),
                                 *wei_md = dn.primitive_desc_query_md(c.pd, dnnl_query_weights_md, 0),
                                 *bias_md = dn.primitive_desc_query_md(c.pd, dnnl_query_weights_md, 1),
                                 *dst_md = dn.primitive_desc_query_md(c.pd, dnnl_query_dst_md, 0);
        /* the descriptors were given plain tags, so the primitive reads the caller's buffers in place */
        if (dn.primitive_create(&c.prim, c.pd) != dnnl_success ||
            dn.stream_create(&c.stream, c.eng, dnnl_stream_default_flags) != dnnl_success ||
            dn.memory_create(&c.src, src_md, c.eng, (void *)A) != dnnl_success ||
            dn.memory_create(&c.wei, wei_md, c.eng, (void *)B) != dnnl_success ||
            (bias && dn.memory_create(&c.bias, bias_md, c.eng, (void *)bias) != dnnl_success) ||
            dn.memory_create(&c.dst, dst_md, c.eng, C) != dnnl_success) {
            rc = QT_EUNSUPPORTED;
        } else {
            dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, c.src}, {DNNL_ARG_WEIGHTS, c.wei}, {DNNL_ARG_DST, c.dst},
                                       {DNNL_ARG_BIAS, c.bias}};
            if (dn.primitive_execute(c.prim, c.stream, bias ? 4 : 3, args) != dnnl_success ||
                dn.stream_wait(c.stream) != dnnl_success)
                rc = QT_ERR(QT_EINVAL, "oneDNN bf16 matmul (%d x %d x %d) failed while running", M, K, N);
            else
                __atomic_add_fetch(&dn_runs, 1, __ATOMIC_RELAXED);
        }
    }
    call_free(&c);
    return rc;
}

int op_dnnl_bf16_gemm(float *C, const uint16_t *A, int ta, const uint16_t *B, int tb, const float *bias, int M,
                      int N, int K, float alpha, int acc) {
    return op_dnnl_bf16_gemm_ld(C, N, A, ta ? M : K, ta, B, tb ? K : N, tb, bias, M, N, K, alpha, acc);
}

int op_dnnl_bf16_matmul(float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N, int IN,
                        int OUT, float alpha) {
    return op_dnnl_bf16_gemm(out, inp, 0, w, 1, bias, N, OUT, IN, alpha, 0);
}

long op_dnnl_bf16_runs(void) { return __atomic_load_n(&dn_runs, __ATOMIC_RELAXED); }

int op_dnnl_sgemm_available(void) { return dn_ready(); }

int op_dnnl_sgemm(char ta, char tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc) {
    if (!dn_ready()) return QT_EUNSUPPORTED;
    /* no QT_ERR: this runs on OpenMP worker threads; the caller falls back */
    if (dn.sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) != dnnl_success) return QT_EINVAL;
    __atomic_add_fetch(&dn_sgemm_runs, 1, __ATOMIC_RELAXED);
    return QT_OK;
}

long op_dnnl_sgemm_runs(void) { return __atomic_load_n(&dn_sgemm_runs, __ATOMIC_RELAXED); }

#else /* no oneDNN 2.x in this build: the fp32 sgemm path is the only one */

int op_dnnl_bf16_available(void) { return 0; }

int op_dnnl_bf16_gemm_ld(float *C, int ldc, const uint16_t *A, int lda, int ta, const uint16_t *B, int ldb, int tb,
                         const float *bias, int M, int N, int K, float alpha, int acc) {
    (void)C, (void)ldc, (void)A, (void)lda, (void)ta, (void)B, (void)ldb, (void)tb, (void)bias, (void)M, (void)N;
    (void)K, (void)alpha, (void)acc;
    return QT_EUNSUPPORTED;
}

int op_dnnl_bf16_gemm(float *C, const uint16_t *A, int ta, const uint16_t *B, int tb, const float *bias, int M,
                      int N, int K, float alpha, int acc) {
    return op_dnnl_bf16_gemm_ld(C, N, A, ta ? M : K, ta, B, tb ? K : N, tb, bias, M, N, K, alpha, acc);
}

int op_dnnl_bf16_matmul(float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N, int IN,
                        int OUT, float alpha) {
    return op_dnnl_bf16_gemm(out, inp, 0, w, 1, bias, N, OUT, IN, alpha, 0);
}

long op_dnnl_bf16_runs(void) { return 0; }

int op_dnnl_sgemm_available(void) { return 0; }

int op_dnnl_sgemm(char ta, char tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc) {
    (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda, (void)B, (void)ldb, (void)beta;
    (void)C, (void)ldc;
    return QT_EUNSUPPORTED;
}

long op_dnnl_sgemm_runs(void) { return 0; }

#endif
