/* Just enough of CUDA to run a kernel's source on the CPU, for tests on
 * machines without a GPU (emu_attention.cpp): a launch runs the grid's blocks
 * one after another, each block's threads as host threads, with
 * __syncthreads a barrier of the block and __shfl_xor_sync an exchange
 * inside a warp (every lane of the warp must take part, as on the GPU with
 * a full mask). __shared__ variables become statics (one block at a time, so
 * one copy is the block's), dynamic shared memory a buffer per launch.
 * Nothing here is fast; it checks logic: indexing, masks, barriers. */
#ifndef QT_CUDA_EMU_H
#define QT_CUDA_EMU_H

#include <algorithm>
#include <barrier>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

struct qt_emu_dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local qt_emu_dim3 threadIdx, blockIdx;
inline qt_emu_dim3 qt_emu_block_dim, qt_emu_grid_dim;
#define blockDim qt_emu_block_dim
#define gridDim qt_emu_grid_dim

inline std::barrier<> *qt_emu_block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> qt_emu_warp_bar;
inline std::vector<float> qt_emu_xchg;
inline float *qt_emu_dyn;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define QT_DYN_SMEM(type, name) type *name = (type *)qt_emu_dyn
#define __syncthreads() qt_emu_block_bar->arrive_and_wait()

inline float __shfl_xor_sync(unsigned mask, float v, int off) {
    (void)mask;
    unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    qt_emu_xchg[t] = v;
    qt_emu_warp_bar[w]->arrive_and_wait();
    float r = qt_emu_xchg[w * 32 + (lane ^ (unsigned)off)];
    qt_emu_warp_bar[w]->arrive_and_wait(); /* the slot is free again */
    return r;
}
using std::max;
using std::min;

/* kernel(args...) over grid x threads with smem bytes of dynamic shared memory */
template <class F> void qt_emu_launch(qt_emu_dim3 grid, unsigned threads, size_t smem, F kernel) {
    std::vector<float> dyn(smem / sizeof(float) + 1, NAN); /* NaN: a read of what no thread wrote shows */
    qt_emu_dyn = dyn.data();
    qt_emu_block_dim = {threads, 1, 1};
    qt_emu_grid_dim = grid;
    qt_emu_xchg.assign(threads, 0.0f);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::barrier<> bar((std::ptrdiff_t)threads);
                qt_emu_block_bar = &bar;
                qt_emu_warp_bar.clear();
                for (unsigned w = 0; w < (threads + 31) / 32; w++)
                    qt_emu_warp_bar.push_back(std::make_unique<std::barrier<>>(32));
                std::vector<std::thread> ts;
                ts.reserve(threads);
                for (unsigned t = 0; t < threads; t++)
                    ts.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        kernel();
                    });
                for (auto &th : ts) th.join();
            }
}
#endif
