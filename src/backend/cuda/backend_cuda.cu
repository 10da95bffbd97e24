/* The CUDA backend: opening and closing a device, and the failure path every
 * checked call takes. The ops live one family a file (op_*.cu); table.c
 * gathers them into the backend's table. */
#include "backend/cuda/backend_cuda.h"
#include "backend/cuda/cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" void qt_cuda_fail(const char *what, const char *detail, const char *file, int line) {
    fprintf(stderr,
            "qtune: error: the GPU failed in %s (%s, at %s:%d); the run cannot go on: rerun it, and if it "
            "repeats, run `qtune doctor` and check the driver and the card's memory (nvidia-smi)\n",
            what, detail, file, line);
    fflush(stderr);
    exit(1);
}

static int device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear it: no driver is an answer, not an error */
        return 0;
    }
    return n;
}

void qt_cuda_close(qt_backend *be) {
    if (!be) return;
    qt_cuda *c = qt_cuda_of(be);
    if (c) {
        cudaStreamSynchronize(c->stream);
        if (c->sq_part) cudaFree(c->sq_part);
        if (c->sq_host) cudaFreeHost(c->sq_host);
        if (c->scratch) cudaFree(c->scratch);
        if (c->blas) cublasDestroy(c->blas);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c->blk);
        free(c);
    }
    free(be);
}

/* dev: the GPU the host chose (backend/device.c: "cuda:N", QTUNE_CUDA_DEVICE
 * or the launcher's local rank); the module only checks it */
static int cuda_open(int dev, qt_backend **out) {
    *out = NULL;
    int count = device_count();
    if (count <= 0)
        return QT_ERR(QT_EUNSUPPORTED,
                      "no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them); use \"device\": "
                      "\"cpu\", or run `qtune doctor` to see what the machine has");
    if (dev < 0 || dev >= count)
        return QT_ERR(QT_EINVAL, "GPU %d was asked for (QTUNE_CUDA_DEVICE or \"device\": \"cuda:N\") but %d %s "
                      "visible; use 0 to %d", dev, count, count == 1 ? "is" : "are", count - 1);
    cudaError_t e = cudaSetDevice(dev);
    if (e != cudaSuccess)
        return QT_ERR(QT_EUNSUPPORTED, "cannot use GPU %d: %s; run `qtune doctor` (a driver older than the CUDA "
                      "runtime qtune was built with is the usual cause)", dev, cudaGetErrorString(e));
    qt_backend *be = (qt_backend *)malloc(sizeof *be);
    qt_cuda *c = (qt_cuda *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be), free(c);
        return QT_ERR(QT_ENOMEM, "out of host memory opening the CUDA backend");
    }
    c->device = dev;
    *be = qt_cuda_backend_i;
    be->impl = c;
    be->desc = qt_cuda_host_api.desc;
    size_t free0 = 0, total = 0;
    cudaMemGetInfo(&free0, &total);
    if (cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess ||
        cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cudaMalloc((void **)&c->sq_part, QT_CUDA_SQ_BLOCKS * sizeof(double)) != cudaSuccess ||
        cudaMallocHost((void **)&c->sq_host, QT_CUDA_SQ_BLOCKS * sizeof(double)) != cudaSuccess) {
        qt_cuda_close(be);
        return QT_ERR(QT_EUNSUPPORTED, "cannot set up GPU %d (stream, cuBLAS handle or a small buffer failed: "
                      "out of device memory, or another process holds the card in exclusive mode); check "
                      "nvidia-smi", dev);
    }
    /* fp32 GEMMs stay fp32 (no TF32): the fp32 path is the reference path */
    cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
    size_t free1 = 0;
    cudaMemGetInfo(&free1, &total);
    c->runtime_bytes = free0 > free1 ? free0 - free1 : 0;
    *out = be;
    return QT_OK;
}

/* ---- the module's entry points (loader.c finds them with dlsym) ---------- */
qt_cuda_host qt_cuda_host_api;

extern "C" __attribute__((visibility("default"))) int qt_cuda_module_open_device(const qt_cuda_host *host,
                                                                                 int dev, qt_backend **out) {
    qt_cuda_host_api = *host;
    return cuda_open(dev, out);
}
extern "C" __attribute__((visibility("default"))) int qt_cuda_module_device_count(void) { return device_count(); }
extern "C" __attribute__((visibility("default"))) void qt_cuda_module_device_name(int dev, char *buf,
                                                                                 size_t cap) {
    cudaDeviceProp p;
    if (cap && cudaGetDeviceProperties(&p, dev) == cudaSuccess) snprintf(buf, cap, "%s", p.name);
    else cudaGetLastError();
}
