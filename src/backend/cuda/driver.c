/* What the NVIDIA driver itself reports, for `qtune doctor`: libcuda.so.1
 * (and libcudart.so for the free memory) looked up at run time, without the
 * module (loader.c), whose load costs seconds and which a broken install may
 * lack while the driver works. */
#include "backend/device.h"

#include <dlfcn.h>
#include <stdio.h>

#include "qtune_config.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* GPUs the driver reports (0 in a build without CUDA or without a driver). */
int qt_cuda_driver_gpu_count(void) {
#if QTUNE_HAVE_CUDA
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!drv) return 0;
    int (*cu_init)(unsigned) = (int (*)(unsigned))dlsym(drv, "cuInit");
    int (*cu_count)(int *) = (int (*)(int *))dlsym(drv, "cuDeviceGetCount");
    int n = 0;
    if (!cu_init || !cu_count || cu_init(0) != 0 || cu_count(&n) != 0) n = 0;
    dlclose(drv);
    return n;
#else
    return 0;
#endif
}

void qt_cuda_driver_report(FILE *f) {
#if QTUNE_HAVE_CUDA
    /* The driver is looked up at run time, so a CUDA build still runs (on the
     * CPU) on a machine without one. */
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!drv) {
        fprintf(f, "cuda       built with CUDA; no NVIDIA driver on this machine (libcuda.so.1 not found): CPU only\n");
        return;
    }
    typedef int (*init_fn)(unsigned);
    typedef int (*count_fn)(int *);
    typedef int (*ver_fn)(int *);
    typedef int (*get_fn)(int *, int);
    typedef int (*name_fn)(char *, int, int);
    typedef int (*mem_fn)(size_t *, int);
    init_fn cu_init = (init_fn)dlsym(drv, "cuInit");
    count_fn cu_count = (count_fn)dlsym(drv, "cuDeviceGetCount");
    ver_fn cu_ver = (ver_fn)dlsym(drv, "cuDriverGetVersion");
    get_fn cu_get = (get_fn)dlsym(drv, "cuDeviceGet");
    name_fn cu_name = (name_fn)dlsym(drv, "cuDeviceGetName");
    mem_fn cu_mem = (mem_fn)dlsym(drv, "cuDeviceTotalMem_v2");
    int n = 0, ver = 0;
    if (!cu_init || !cu_count || cu_init(0) != 0 || cu_count(&n) != 0) {
        fprintf(f, "cuda       built with CUDA; the driver did not initialise (no GPU visible?): CPU only\n");
        dlclose(drv);
        return;
    }
    if (cu_ver) cu_ver(&ver);
    fprintf(f, "cuda       driver supports CUDA %d.%d; %d GPU%s\n", ver / 1000, (ver % 1000) / 10, n, n == 1 ? "" : "s");
    void *rt = dlopen("libcudart.so", RTLD_NOW | RTLD_LOCAL);
    typedef int (*set_fn)(int);
    typedef int (*info_fn)(size_t *, size_t *);
    set_fn rt_set = NULL;
    info_fn rt_info = NULL;
    if (rt) {
        ver_fn rt_ver = (ver_fn)dlsym(rt, "cudaRuntimeGetVersion");
        rt_set = (set_fn)dlsym(rt, "cudaSetDevice");
        rt_info = (info_fn)dlsym(rt, "cudaMemGetInfo");
        int rv = 0;
        if (rt_ver && rt_ver(&rv) == 0) fprintf(f, "           runtime CUDA %d.%d\n", rv / 1000, (rv % 1000) / 10);
    }
    for (int i = 0; i < n && cu_get && cu_name && cu_mem; i++) {
        int dev;
        char name[256] = "?";
        size_t bytes = 0, fr = 0, tot = 0;
        if (cu_get(&dev, i) != 0) continue;
        cu_name(name, sizeof name, dev);
        cu_mem(&bytes, dev);
        /* free memory needs a context: the runtime makes one on the device */
        if (rt_set && rt_info && rt_set(i) == 0 && rt_info(&fr, &tot) == 0)
            fprintf(f, "           GPU %d: %s, %.1f GiB, %.1f GiB free\n", i, name, (double)bytes / GIB, (double)fr / GIB);
        else
            fprintf(f, "           GPU %d: %s, %.1f GiB\n", i, name, (double)bytes / GIB);
    }
    if (rt) dlclose(rt);
    dlclose(drv);
#else
    fprintf(f, "cuda       this build has no CUDA backend (configured without nvcc): CPU only\n");
#endif
}
