#include "core/mem.h"
#include "core/error.h"
#include "core/messages.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

long long qt_meminfo_kib(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && line[kl] == ':') {
            v = strtoll(line + kl + 1, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}

static void *oom(size_t n, const char *what, const char *file, int line) {
    qt_error_at(QT_ENOMEM, file, line, QT_MSG_OOM_FMT, (double)n / (1 << 20), what);
    return NULL;
}

void *qt_malloc_at(size_t n, const char *what, const char *file, int line) {
    void *p = malloc(n ? n : 1);
    return p ? p : oom(n, what, file, line);
}

void *qt_calloc_at(size_t count, size_t size, const char *what, const char *file, int line) {
    size_t n;
    if (!qt_mul_ok(count, size, &n)) return oom(SIZE_MAX, what, file, line);
    void *p = calloc(count ? count : 1, size ? size : 1);
    return p ? p : oom(n, what, file, line);
}

void *qt_realloc_at(void *p, size_t n, const char *what, const char *file, int line) {
    void *q = realloc(p, n ? n : 1);
    return q ? q : oom(n, what, file, line);
}

void *qt_alloc_aligned_at(size_t n, const char *what, const char *file, int line) {
    size_t align = n >= QT_HUGE_MIN ? QT_HUGE_PAGE : 64, rounded = (n + align - 1) & ~(align - 1);
    if (rounded < n) return oom(n, what, file, line);
    void *p = aligned_alloc(align, rounded ? rounded : 64);
    if (!p) return oom(n, what, file, line);
    if (align == QT_HUGE_PAGE) qt_advise_huge(p, rounded);
    return p;
}

void *qt_alloc_sparse_at(size_t n, const char *what, const char *file, int line) {
    size_t rounded = (n + 63) & ~(size_t)63;
    if (rounded < n) return oom(n, what, file, line);
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) return oom(n, what, file, line);
    if (rounded >= QT_HUGE_MIN) (void)madvise((void *)((uintptr_t)p & ~(uintptr_t)4095), rounded, MADV_NOHUGEPAGE);
    return p;
}

void qt_advise_huge(void *p, size_t n) {
    /* Advice only: where transparent huge pages are off, or the kernel has
     * none free, the buffer keeps 4 KiB pages and nothing else changes. */
    if (n >= QT_HUGE_MIN) (void)madvise(p, n, MADV_HUGEPAGE);
}

void qt_free(void *p) { free(p); }

void qt_zero_floats(float *x, size_t n) {
    const size_t chunk = (size_t)1 << 18; /* 1 MiB pieces */
    if (n < 4 * chunk) {
        memset(x, 0, n * sizeof *x);
        return;
    }
    const size_t pieces = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < pieces; k++) {
        size_t a = k * chunk, len = n - a < chunk ? n - a : chunk;
        memset(x + a, 0, len * sizeof *x);
    }
}

char *qt_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = qt_malloc(n, "a string");
    if (d) memcpy(d, s, n);
    return d;
}

int qt_mul_ok(size_t a, size_t b, size_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
