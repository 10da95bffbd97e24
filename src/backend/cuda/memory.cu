/* Memory by placement, copies, events (backend.h's first rows) on one stream.
 * Device memory is cudaMalloc'd (never managed memory), pinned memory
 * cudaMallocHost'd, host memory the C heap. A mapped base tensor is copied to
 * the device once (the host mapping cannot be read by the kernels at speed). */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>
#include <string.h>


/* Device blocks and their sizes, for device_peak_bytes: cudaFree is told
 * only the pointer. A block the table has no room for still counts as held
 * (the peak then errs high, never low). */
static void track(qt_cuda *c, void *p, size_t n) {
    if (c->n_blk == c->cap_blk) {
        int cap = c->cap_blk ? 2 * c->cap_blk : 64;
        qt_cuda_blk *b = (qt_cuda_blk *)realloc(c->blk, sizeof *b * (size_t)cap);
        if (b) c->blk = b, c->cap_blk = cap;
    }
    if (c->n_blk < c->cap_blk) c->blk[c->n_blk++] = {p, n};
    c->held += n;
    if (c->held > c->peak) c->peak = c->held;
}
/* 1 where p is a tracked device block (now forgotten), else 0 */
static int untrack(qt_cuda *c, void *p) {
    for (int i = 0; i < c->n_blk; i++)
        if (c->blk[i].p == p) {
            c->held -= c->blk[i].n;
            c->blk[i] = c->blk[--c->n_blk];
            return 1;
        }
    return 0;
}

/* Which allocator gave a pointer, so free can return it: the device blocks
 * are in the table above; for the others (pinned or plain host memory, or a
 * device block the table had no room for) cudaPointerGetAttributes answers. */
void *qt_cuda_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what) {
    void *p = NULL;
    if (bytes == 0) bytes = 256;
    cudaError_t e;
    switch (place) {
    case QT_MEM_DEVICE:
    case QT_MEM_DEVICE_SPARSE: e = cudaMalloc(&p, bytes); break;
    case QT_MEM_PINNED: e = cudaMallocHost(&p, bytes); break;
    default:
        p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!p) QT_ERR(QT_ENOMEM, "out of host memory (%.1f MiB for %s)", (double)bytes / (1 << 20), what);
        return p;
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        QT_ERR(QT_ENOMEM, "cannot allocate %.1f MiB of %s memory for %s (%.1f of %.1f GiB free on the GPU): "
               "use gradient checkpointing, a smaller micro-batch or sequence length, ZeRO-2 with the optimizer "
               "offloaded, or LoRA; `qtune plan` shows what fits", (double)bytes / (1 << 20),
               place == QT_MEM_PINNED ? "pinned host" : "GPU", what, (double)fr / (1 << 30),
               (double)tot / (1 << 30));
        return NULL;
    }
    if (place != QT_MEM_PINNED) track(qt_cuda_of(be), p, bytes);
    return p;
}

void qt_cuda_free(qt_backend *be, void *p) {
    if (!p) return;
    if (untrack(qt_cuda_of(be), p)) {
        QT_CUDA(cudaFree(p));
        return;
    }
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        free(p);
        return;
    }
    if (a.type == cudaMemoryTypeDevice) QT_CUDA(cudaFree(p));
    else if (a.type == cudaMemoryTypeHost) QT_CUDA(cudaFreeHost(p));
    else free(p);
}

int qt_cuda_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what) {
    void *d = qt_cuda_alloc(be, QT_MEM_DEVICE, bytes, what);
    if (!d) return QT_ENOMEM;
    QT_CUDA(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, qt_cuda_of(be)->stream));
    QT_CUDA(cudaStreamSynchronize(qt_cuda_of(be)->stream)); /* the mapping may go once this returns */
    *dev = d;
    return QT_OK;
}
void qt_cuda_release_mapped(qt_backend *be, const void *dev) { qt_cuda_free(be, (void *)dev); }

/* upload/download are synchronous with the host's buffer: the caller may
 * reuse it at once (a pageable buffer makes the copy synchronous anyway) */
void qt_cuda_upload(qt_backend *be, void *dev, const void *host, size_t bytes) {
    if (!bytes) return;
    qt_cuda *c = qt_cuda_of(be);
    QT_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, c->stream));
    QT_CUDA(cudaStreamSynchronize(c->stream));
}
void qt_cuda_download(qt_backend *be, void *host, const void *dev, size_t bytes) {
    if (!bytes) return;
    qt_cuda *c = qt_cuda_of(be);
    QT_CUDA(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, c->stream));
    QT_CUDA(cudaStreamSynchronize(c->stream));
}
/* cudaMemcpyDefault: either side may be pinned host memory (a sharded master offloaded, ZeRO-2's offloaded
 * gradient shard), which unified addressing tells apart */
void qt_cuda_copy(qt_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes) QT_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, qt_cuda_of(be)->stream));
}
void qt_cuda_zero(qt_backend *be, void *dev, size_t bytes) {
    if (bytes) QT_CUDA(cudaMemsetAsync(dev, 0, bytes, qt_cuda_of(be)->stream));
}
void qt_cuda_sync(qt_backend *be) { QT_CUDA(cudaStreamSynchronize(qt_cuda_of(be)->stream)); }

qt_event *qt_cuda_event_record(qt_backend *be) {
    cudaEvent_t ev;
    QT_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    QT_CUDA(cudaEventRecord(ev, qt_cuda_of(be)->stream));
    return (qt_event *)ev;
}
void qt_cuda_event_wait(qt_backend *be, qt_event *e) {
    (void)be;
    QT_CUDA(cudaEventSynchronize((cudaEvent_t)e));
}
void qt_cuda_event_free(qt_backend *be, qt_event *e) {
    (void)be;
    if (e) QT_CUDA(cudaEventDestroy((cudaEvent_t)e));
}

size_t qt_cuda_runtime_bytes(qt_backend *be) { return qt_cuda_of(be)->runtime_bytes; }
size_t qt_cuda_device_peak_bytes(qt_backend *be) { return qt_cuda_of(be)->peak; }

extern "C" float *qt_cuda_scratch(qt_backend *be, size_t floats) {
    qt_cuda *c = qt_cuda_of(be);
    if (floats > c->scratch_floats) {
        if (c->scratch) {
            QT_CUDA(cudaStreamSynchronize(c->stream)); /* an enqueued op may still read the old one */
            untrack(c, c->scratch);
            QT_CUDA(cudaFree(c->scratch));
        }
        c->scratch = NULL;
        c->scratch_floats = 0;
        QT_CUDA(cudaMalloc((void **)&c->scratch, floats * sizeof(float)));
        track(c, c->scratch, floats * sizeof(float));
        c->scratch_floats = floats;
    }
    return c->scratch;
}

__global__ void k_colsum_finish(float *out, const float *part, int nch, int C, float alpha) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.0f;
    for (int k = 0; k < nch; k++) acc += part[(size_t)k * C + c];
    out[c] += alpha * acc;
}
extern "C" void qt_cuda_colsum_finish(qt_backend *be, float *out, const float *part, int nch, int C, float alpha) {
    k_colsum_finish<<<(C + 255) / 256, 256, 0, qt_cuda_of(be)->stream>>>(out, part, nch, C, alpha);
    QT_CUDA_LAUNCHED();
}

/* the work runs on the GPU's stream: no host threads to hold */
int qt_cuda_hold_threads(qt_backend *be, int (*fn)(void *arg), void *arg) {
    (void)be;
    return fn(arg);
}
