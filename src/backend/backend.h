/* The backend interface, as its callers see it: everything the model, the
 * optimizer, clipping, the loss scaler, ZeRO and the trainer do to tensor
 * memory goes through one of these calls, qt_be_NAME(be, ...). Behind each
 * is a slot of a read-only table of function pointers chosen at run time
 * (qt_backend_open: "cpu", "guard", "cuda", "npu"); a new backend is one more
 * folder under src/backend/ and one more row in backend.c. The table itself
 * (struct qt_backend) and every op's contract (shapes, `+=` gradients,
 * workspaces) are in backend_impl.h, the implementers' header: a caller sees
 * qt_backend as an opaque type and never includes it.
 *
 * Ownership (docs/architecture.md draws it):
 *  - memory of placement QT_MEM_DEVICE belongs to the backend: the host never
 *    reads or writes it except through upload / download (the guard backend
 *    makes any other touch fault at its line);
 *  - QT_MEM_PINNED / QT_MEM_HOST are host memory the backend can copy from and
 *    to quickly (staging buffers for checkpoints, the batch, logits);
 *  - import_mapped hands the backend a read-only host mapping (the frozen base
 *    in its safetensors file) and returns what the kernels read: the mapping
 *    itself where the device can read host memory (cpu), a device copy
 *    otherwise.
 * All pointers an op receives are device pointers, including the int32 token
 * ids, targets, positions and doc_start of a batch (the model uploads them).
 * Calls are ordered (one stream); sync waits for all of them. */
#ifndef QT_BACKEND_BACKEND_H
#define QT_BACKEND_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* RoPE tables: head_dim / 2 entries at most (qwen2_load refuses head_dim > 1024) */
#define QT_ROPE_MAX_HALF 512

#include "core/dtype.h"
#include "core/label.h" /* QT_IGNORE_INDEX: the target the loss skips, on every backend */

typedef enum {
    QT_MEM_DEVICE = 0, /* the backend's own memory (kernels read/write it; the host does not) */
    QT_MEM_PINNED,     /* host memory registered for fast transfers (staging buffers) */
    QT_MEM_HOST,       /* plain host memory */
    QT_MEM_DEVICE_SPARSE, /* device memory written a little at a time, much of it never (the KV cache of
                           * --ctx positions): the cpu backend keeps it on 4 KiB pages, so only what is
                           * written is committed (a huge page commits 2 MiB at its first write) */
} qt_mem_place;

/* Plain facts about a backend, readable without the device (qt_backend_desc_of
 * "cuda" on a machine with no GPU): the memory plan (src/model/memplan.c) sizes
 * workspaces from them, so `qtune plan` can answer for it. */
typedef struct {
    const char *name;
    size_t alignment;        /* bytes every allocation is aligned to */
    unsigned native_dtypes;  /* QT_BE_DT(QT_F32) | ...: dtypes the GEMMs take natively */
    int ce_chunk;            /* vocabulary chunk of the fused lm_head + cross-entropy */
    size_t matmul_ws_cap;    /* floats of converted weight panel a matmul may use */
    size_t runtime_bytes;    /* process runtime outside the planned blocks (code, library buffers) */
    size_t runtime_extra;    /* ... more when the optional GEMM library (oneDNN) is in use */
    int host_reads_device;   /* 1: device pointers are host-readable (cpu); 0: never touch them */
    size_t blas_thread_vm;   /* address space the BLAS maps for each thread that calls it (OpenBLAS:
                                a buffer at its first call, never unmapped); counts against ulimit -v */
} qt_backend_desc;
#define QT_BE_DT(dt) (1u << (unsigned)(dt))

/* Workspace formulas over the descriptor (floats). */
static inline size_t qt_be_matmul_ws_floats(const qt_backend_desc *d, int IN, int OUT) {
    size_t full = (size_t)IN * (size_t)OUT, ws = full < d->matmul_ws_cap ? full : d->matmul_ws_cap;
    return ws > (size_t)IN ? ws : (size_t)IN;
}
static inline size_t qt_be_lmhead_ce_ws_floats(const qt_backend_desc *d, int N, int C) {
    /* logits chunk, weight chunk, per-row sum/max/target, dx accumulator (N, C), rescale (N) */
    return (size_t)N * d->ce_chunk + (size_t)d->ce_chunk * C + 4 * (size_t)N + (size_t)N * C + (size_t)N;
}
static inline size_t qt_be_lmhead_ce_kept_floats(const qt_backend_desc *d, int N, int V) {
    size_t chunks = ((size_t)V + d->ce_chunk - 1) / d->ce_chunk;
    return (size_t)N * (size_t)V + (size_t)N * chunks;
}

/* AdamW / Adam over a range of the flat block; the per-element rule is
 * optim/adam.h's. The caller works out the step's scalars (in double, as
 * torch does) and splits the range at weight-decay boundaries. */
typedef struct {
    float omb1, b2, omb2; /* 1-beta1, beta2, 1-beta2 */
    float step_size;      /* lr / (1 - beta1^t) */
    float bc2_sqrt;       /* sqrt(1 - beta2^t) */
    float eps;
    float gs;             /* gradient multiplier (unscale * clip) */
    float wd_mul;         /* AdamW: 1 - lr*wd on decayed elements, else 1 */
    float wd_l2;          /* Adam: wd on decayed elements, else 0 */
} qt_adam_scalars;

/* The LoRA dropout mask of one (layer, module) at one micro step: element i
 * is kept iff qt_dropout_u24(key, i) >= threshold, a pure function of (seed,
 * micro step, layer, module, i), so every backend draws it in parallel. */
typedef struct {
    uint64_t seed, micro_step;
    uint32_t layer, module;
} qt_dropout_key;

/* The generator's arithmetic is written once, here, for the host and for
 * GPU kernels alike (the CUDA backend includes this header in its kernels). */
#if defined(__CUDACC__)
#define QT_HD __host__ __device__
#else
#define QT_HD
#endif

/* splitmix64's finaliser: a bijection of 64 bits with full avalanche. */
QT_HD static inline uint64_t qt_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* 24 uniform bits of element i of a mask: a counter-based generator (the
 * key's fields and the index hashed together), no state between elements. */
QT_HD static inline uint32_t qt_dropout_u24(const qt_dropout_key *k, uint64_t i) {
    uint64_t s = qt_mix64(k->seed ^ 0x44726f706f757421ull);
    s = qt_mix64(s ^ k->micro_step);
    s = qt_mix64(s ^ (((uint64_t)k->layer << 32) | k->module));
    return (uint32_t)(qt_mix64(s + i * 0x9e3779b97f4a7c15ull) >> 40);
}
/* The integer threshold for drop probability p: element dropped iff u24 < it,
 * i.e. iff u24 / 2^24 < p, as a uniform draw of 24 bits compared with p. */
static inline uint32_t qt_dropout_threshold(float p) {
    double t = (double)p * 16777216.0; /* exact: p has 24 significant bits */
    uint32_t u = (uint32_t)t;
    if ((double)u < t) u++; /* ceil */
    return u > 16777216u ? 16777216u : u;
}

/* One product of a matvec_many call: out (N, OUT) = x @ w^T + bias (bias
 * NULL: none). */
typedef struct {
    float *out;
    const void *w;
    qt_dtype wdt;
    const float *bias;
    int OUT;
} qt_matvec_out;

typedef struct qt_backend qt_backend;
typedef struct qt_event qt_event;

/* What the model, the optimizer, ZeRO and the trainer call: each qt_be_NAME(be, ...) runs slot NAME of
 * the backend's table (backend_impl.h declares the table; calls.c forwards). */
/* The backend's plain facts (qt_backend_desc above). */
const qt_backend_desc *qt_be_desc(const qt_backend *be);

/* ---- memory ----------------------------------------------------------- */
/* bytes of uninitialised memory in a placement (zero it with qt_be_zero),
 * aligned to desc->alignment; NULL (with QT_ERR raised, naming what) when
 * out of memory. Pages are committed as they are first written, as with
 * malloc, so a block the plan sizes for the worst case costs what is used. */
void *qt_be_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what);
void qt_be_free(qt_backend *be, void *p); /* NULL is a no-op */
/* A read-only host mapping (a tensor of the base's safetensors file) as the
 * kernels read it; release with qt_be_release_mapped (a no-op where it is the mapping). */
int qt_be_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what);
void qt_be_release_mapped(qt_backend *be, const void *dev); /* what import_mapped returned */
void qt_be_upload(qt_backend *be, void *dev, const void *host, size_t bytes);
void qt_be_download(qt_backend *be, void *host, const void *dev, size_t bytes);
void qt_be_copy(qt_backend *be, void *dst, const void *src, size_t bytes); /* device to device */
void qt_be_zero(qt_backend *be, void *dev, size_t bytes);
void qt_be_sync(qt_backend *be);
/* Events for overlap (e.g. a gradient bucket's reduction waits on the
 * backward that wrote it): record marks the point in the stream, wait
 * blocks the host until the stream passed it. */
qt_event *qt_be_event_record(qt_backend *be);
void qt_be_event_wait(qt_backend *be, qt_event *e);
void qt_be_event_free(qt_backend *be, qt_event *e);

/* ---- the model's ops (backend_impl.h states each one's contract) ----------- */
void qt_be_embedding_forward(qt_backend *be, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N,
                             int C);
void qt_be_embedding_backward(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C);
void qt_be_rmsnorm_forward(qt_backend *be, float *out, float *rstd, const float *inp, const float *weight, int N, int C,
                           float eps);
void qt_be_rmsnorm_backward(qt_backend *be, float *dinp, float *dweight, const float *dout, const float *inp,
                            const float *weight, const float *rstd, int N, int C);
void qt_be_matmul_forward(qt_backend *be, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias,
                          int N, int IN, int OUT, float alpha, int accumulate, float *ws);
void qt_be_matmul_backward(qt_backend *be, float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha,
                           float *ws);
/* Decoding, one token for each of N sequences: out (N, OUT) = alpha *
 * x (N, IN) @ W^T (W: OUT, IN) + bias (+ out with accumulate), each weight
 * read once for all N rows, in its stored dtype; a row's result is the
 * same bits whatever N (so --batch decodes as separate runs do). */
void qt_be_matvec(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
                  int IN, int OUT, float alpha, int accumulate);
/* Several products of one input, as count matvec calls with alpha 1 and
 * no accumulate (each out the same bits as that call's): for each k,
 * o[k].out (N, o[k].OUT) = x (N, IN) @ o[k].w^T + o[k].bias. One job
 * where the backend can (a decode step's q/k/v, and gate/up): a CPU
 * thread goes from one product's rows to the next's without waiting for
 * the others. o is host memory (the descriptors; their out, w and bias
 * are the backend's). The outs must not overlap x or each other. */
void qt_be_matvec_many(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o);
/* RoPE, HF rotate-half, in place on x (N, NH, D): angle pos[n] * inv_freq[i]
 * (an fp32 product), x[i] <- (x[i] cos - x[i+D/2] sin) * scale, x[i+D/2] <-
 * (x[i+D/2] cos + x[i] sin) * scale. inv_freq (D/2 <= QT_ROPE_MAX_HALF
 * floats) is HOST memory the model computed (qt_rope_inv_freq: the
 * config's rope_scaling); scale is YaRN's attention factor, else 1. The
 * backward applies the transposed rotation. */
void qt_be_rope_forward(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                        float scale);
void qt_be_rope_backward(qt_backend *be, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                         float scale);
void qt_be_attention_forward(qt_backend *be, float *out, float *lse, const float *q, const float *k, const float *v,
                             const int32_t *doc_start, int B, int T, int H, int KV, int D);
void qt_be_attention_backward(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
                              const float *lse, const float *q, const float *k, const float *v,
                              const int32_t *doc_start, int B, int T, int H, int KV, int D);
void qt_be_attention_forward_cached(qt_backend *be, float *out, const float *q, const float *kc, const float *vc, int n,
                                    int pos0, int H, int KV, int D);
void qt_be_swiglu_forward(qt_backend *be, float *out, const float *gate, const float *up, int N, int I);
void qt_be_swiglu_backward(qt_backend *be, float *dgate, float *dup, const float *dout, const float *gate,
                           const float *up, int N, int I);
void qt_be_lmhead_ce_forward(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                             const int32_t *targets, int N, int C, int V, float *ws);
void qt_be_lmhead_ce_backward(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                              const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws);
void qt_be_lmhead_ce_forward_keep(qt_backend *be, float *loss, float *lse, float *kept, const float *x, const void *w,
                                  qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws);
void qt_be_lmhead_ce_backward_kept(qt_backend *be, float *dx, float *dw, float *kept, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N, int C,
                                   int V, float *ws);
void qt_be_lmhead_ce_forward_dx(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
                                qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V, float *ws);
void qt_be_acc(qt_backend *be, float *out, const float *a, size_t n); /* out += a */
/* Runs fn(arg) on the calling thread and returns its result, with the
 * backend's host threads held ready for the ops fn calls in between: for
 * a run of many small ops (a decode step of few rows), where the threads'
 * start for each op would cost more than the op. The cpu backend holds
 * its OpenMP team (backend/cpu/team.h); backends whose work runs on a
 * device call fn(arg). */
int qt_be_hold_threads(qt_backend *be, int (*fn)(void *arg), void *arg);

/* ---- precision (backend_impl.h: the rounding each does) ------------------- */
void qt_be_round_to_dtype(qt_backend *be, float *x, size_t n, qt_dtype dt);
void qt_be_round_store(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt);
void qt_be_convert(qt_backend *be, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n);
/* Native 16-bit GEMMs (bf16 or f16 inputs, dt; fp32 accumulation and
 * output): half_available says whether they run here for dt (probe once,
 * at load); each call returns QT_OK or QT_EUNSUPPORTED with its output
 * untouched (the model then takes the fp32 op). The products of two
 * 16-bit values are exact in fp32, so only the summation order differs
 * from fp32 sgemm on the same values. Forms in backend_impl.h:
 * the cpu backend has bf16 (oneDNN, where the CPU has AVX512_BF16), cuda
 * both (the tensor cores). */
int qt_be_half_available(qt_backend *be, qt_dtype dt);
int qt_be_half_matmul(qt_backend *be, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w,
                      const float *bias, int N, int IN, int OUT, float alpha);
int qt_be_half_gemm(qt_backend *be, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                    const float *bias, int M, int N, int K, float alpha, int acc);

/* ---- LoRA dropout ------------------------------------------------------ */
/* dst[i] = src[i] kept by key's mask (qt_dropout_u24 >= threshold) ?
 * src[i] * keep_scale : 0, for i < n; dst may alias src. */
void qt_be_dropout(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
                   uint32_t threshold, float keep_scale);

/* ---- optimizer, clipping, loss scaler ---------------------------------- */
/* Returns 1 when every updated p is finite, 0 when one is not (NaN or inf),
 * -1 when the backend does not look (the caller then checks p itself): the
 * trainer's check of the update rides on this pass instead of reading the
 * whole master again. */
int qt_be_adam(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n);
/* Sum of squares in double, the same bits for any thread count (the
 * gradient norm; it is finite iff every element is: the overflow check). */
double qt_be_sum_squares(qt_backend *be, const float *x, size_t n);
void qt_be_scale(qt_backend *be, float *x, size_t n, float s); /* x *= s */

/* ---- facts only the running backend knows ------------------------------- */
size_t qt_be_runtime_bytes(qt_backend *be); /* desc->runtime_bytes (+ runtime_extra where in use) */
/* The most bytes of device memory (QT_MEM_DEVICE and _SPARSE allocations,
 * the backend's own buffers included) held at once since open; 0 where
 * device memory is host memory (cpu: the peak RSS measures it). What
 * metrics.jsonl's device_peak_bytes reports, against qtune plan's
 * per-device total. */
size_t qt_be_device_peak_bytes(qt_backend *be);
void qt_be_close(qt_backend *be);

/* The backends compiled in, by name ("cpu", "guard", "cuda"); NULL name: the
 * environment's QTUNE_BACKEND, else "cpu". QT_EINVAL naming the known ones
 * for an unknown name. Close with qt_backend_close. The device a run asks
 * for ("device": "auto", "cuda:1", ...) is resolved to a name and an index
 * by backend/device.h. */
int qt_backend_open(const char *name, qt_backend **out);
/* The same on device index of that backend (cuda: the GPU; < 0: the
 * process's default, device_default.h qt_device_default_cuda_index; cpu and guard
 * have one device and ignore it). */
int qt_backend_open_index(const char *name, int index, qt_backend **out);
void qt_backend_close(qt_backend *be);
/* The descriptor of a backend by name without opening it (NULL: unknown). */
const qt_backend_desc *qt_backend_desc_of(const char *name);
/* The host process's runtime outside the planned blocks (code, library
 * buffers) while the CPU's kernels run: what a plan counts in the host's
 * memory, read without opening a backend. */
size_t qt_backend_host_runtime_bytes(void);
/* The name qt_backend_open(NULL, ...) picks. */
const char *qt_backend_default_name(void);
/* 1 when the named backend's device (NULL: the default's) does bf16
 * arithmetic natively (cpu, guard: the CPU has AVX512_BF16; cuda: always,
 * the GPUs the module is built for have it; npu: left to the open backend,
 * which refuses bf16 by name on a card without it). */
int qt_backend_bf16_arith(const char *name);

#endif
