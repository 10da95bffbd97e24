/* The ZeRO shard of rank r among N over a flat block of n elements: N
 * contiguous ranges of ceil(n / N) elements rounded up to 16 (64 bytes of
 * fp32, so every shard starts on a 64-byte boundary), the last ones shorter
 * or empty. One formula for src/dist, which reduces and gathers by it, and
 * src/model, whose fp32 master holds only its rank's shard when sharded
 * (qt_model_opts.master_shards). */
#ifndef QT_CORE_SHARD_H
#define QT_CORE_SHARD_H

#include <stddef.h>

#define QT_SHARD_ALIGN 16

/* Elements [flat, flat + n) of a flat block, kept elsewhere from offset at. */
typedef struct {
    size_t flat, n, at;
} qt_flat_run;

static inline size_t qt_shard_len(size_t n, int N) {
    size_t per = (n + (size_t)N - 1) / (size_t)N;
    return (per + QT_SHARD_ALIGN - 1) / QT_SHARD_ALIGN * QT_SHARD_ALIGN;
}

static inline void qt_shard_range(size_t n, int N, int r, size_t *lo, size_t *hi) {
    size_t sh = qt_shard_len(n, N), a = (size_t)r * sh, e = a + sh;
    *lo = a < n ? a : n;
    *hi = e < n ? e : n;
}

#endif
