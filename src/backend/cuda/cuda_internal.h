/* The CUDA backend's shared state and helpers (internal to src/backend/cuda/).
 *
 * One device, one stream: every op is enqueued on `stream` in call order,
 * which is backend.h's ordering contract; cuBLAS runs on the same stream.
 * Reductions that end in a parameter gradient (embedding, RMSNorm weight,
 * bias, attention dK/dV) are written without atomics, each output element
 * summed by one thread in a fixed order, so a run is reproducible bit for
 * bit, as on the CPU. */
#ifndef QT_BACKEND_CUDA_INTERNAL_H
#define QT_BACKEND_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "backend/backend.h"
#include "backend/backend_impl.h" /* the table the module fills */
#include "backend/cuda/cuda_ops.h"
#include "core/error.h" /* the QT_E* codes only: errors are raised through the host's table below */

/* This folder is built as a module (libqtune_cuda.so) that qtune loads with
 * dlopen only when a run asks for the GPU: the CUDA runtime and cuBLAS take
 * seconds and hundreds of MB to load, which no CPU run should pay. The module
 * raises errors through the host's own error function, so the sentence lands
 * where the CLI reads it. */
typedef struct {
    int (*error_at)(int code, const char *file, int line, const char *fmt, ...);
    const qt_backend_desc *desc; /* desc.c's, which qtune plan reads without the module */
} qt_cuda_host;
extern qt_cuda_host qt_cuda_host_api;
#undef QT_ERR
#define QT_ERR(code, ...) qt_cuda_host_api.error_at((code), __FILE__, __LINE__, __VA_ARGS__)

static inline size_t qt_cuda_dtype_size(qt_dtype dt) { return dt == QT_F32 ? 4 : 2; }

typedef struct {
    void *p;
    size_t n;
} qt_cuda_blk;

typedef struct {
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    double *sq_part;     /* (QT_CUDA_SQ_BLOCKS) device partial sums of sum_squares */
    double *sq_host;     /* the same, pinned, read back */
    float *scratch;      /* column-sum partials (qt_cuda_scratch), grown on first use */
    size_t scratch_floats;
    size_t runtime_bytes;
    /* device memory this backend cudaMalloc'd (memory.cu): each block's size, the bytes held now and the most
     * held at once (device_peak_bytes) */
    qt_cuda_blk *blk;
    int n_blk, cap_blk;
    size_t held, peak;
} qt_cuda;

#define QT_CUDA_SQ_BLOCKS 1024

static inline qt_cuda *qt_cuda_of(qt_backend *be) { return (qt_cuda *)be->impl; }

/* A failed CUDA or cuBLAS call inside an op leaves the device context
 * unusable, and backend.h's ops return nothing, so this prints one sentence
 * (what failed, where, what to do) and ends the process with status 1: the
 * one documented exit outside src/cli/ besides a collective's deadline. */
void qt_cuda_fail(const char *what, const char *detail, const char *file, int line);
#define QT_CUDA(call)                                                              \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess) qt_cuda_fail(#call, cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)
#define QT_CUBLAS(call)                                                            \
    do {                                                                           \
        cublasStatus_t s_ = (call);                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) qt_cuda_fail(#call, cublasGetStatusString(s_), __FILE__, __LINE__); \
    } while (0)
/* after a kernel launch: a bad launch configuration shows here */
#define QT_CUDA_LAUNCHED() QT_CUDA(cudaGetLastError())

/* ---- the ops, one file per family: cuda_ops.h declares them, table.c gathers them ---- */

/* f32 copy of rows [0, rows) of a (rows, cols) matrix in dtype dt, into ws
 * (returned), or src itself when it is f32 already. */
const float *qt_cuda_weight_f32(qt_backend *be, const void *src, qt_dtype dt, size_t rows, size_t cols, float *ws);

/* A device buffer of at least `floats` floats owned by the backend, for
 * partial sums inside one op (memory.cu). It grows on the first steps only
 * (the largest request wins), then stays. */
float *qt_cuda_scratch(qt_backend *be, size_t floats);

/* Column sums over N rows in two deterministic passes: rows are cut into at
 * most QT_CUDA_COL_CHUNKS runs of QT_CUDA_ROWS_PER(N) rows, a thread sums one
 * column of one run (pass 1, the op's own kernel, into scratch), then a
 * thread per column adds the runs in order (qt_cuda_colsum_finish). The same
 * bits every run, without a thread walking all N rows alone. */
#define QT_CUDA_COL_CHUNKS 64
static inline int QT_CUDA_ROWS_PER(int N) { return (N + QT_CUDA_COL_CHUNKS - 1) / QT_CUDA_COL_CHUNKS; }
/* out[c] += alpha * sum over the nch runs of part[k * C + c] */
void qt_cuda_colsum_finish(qt_backend *be, float *out, const float *part, int nch, int C, float alpha);

/* the grid of an elementwise launch over n items, 256 threads a block */
static inline unsigned qt_cuda_blocks(size_t n) {
    size_t b = (n + 255) / 256;
    return (unsigned)(b < 65535u * 32u ? (b ? b : 1) : 65535u * 32u);
}

#ifdef __cplusplus
}
#endif
#endif
