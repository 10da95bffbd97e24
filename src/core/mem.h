/* Checked allocation. Every allocation names what it is for, so running out
 * of memory tells the user which buffer and how big, and what to try. */
#ifndef QT_CORE_MEM_H
#define QT_CORE_MEM_H

#include <stddef.h>

void *qt_malloc_at(size_t n, const char *what, const char *file, int line);
void *qt_calloc_at(size_t count, size_t size, const char *what, const char *file, int line);
void *qt_realloc_at(void *p, size_t n, const char *what, const char *file, int line);
/* 64-byte aligned (cache line, AVX-512); release with qt_free. Buffers of
 * QT_HUGE_MIN bytes or more (weights, gradients, optimizer state,
 * activations) are 2 MiB aligned and advised to use transparent huge pages:
 * fewer TLB misses where sgemm packs them and Adam streams them, and 512x
 * fewer page faults when they are first touched. */
void *qt_alloc_aligned_at(size_t n, const char *what, const char *file, int line);
/* 64-byte aligned, on 4 KiB pages even where transparent huge pages are
 * always on: memory of which only what is written is committed. */
void *qt_alloc_sparse_at(size_t n, const char *what, const char *file, int line);
/* madvise(MADV_HUGEPAGE) on a buffer of QT_HUGE_MIN bytes or more, else nothing. */
void qt_advise_huge(void *p, size_t n);
#define QT_HUGE_PAGE ((size_t)2 << 20)
#define QT_HUGE_MIN ((size_t)8 << 20)
void qt_free(void *p);
/* x[0..n) = 0, by all OpenMP threads for large n (a step's gradient block). */
void qt_zero_floats(float *x, size_t n);
char *qt_strdup(const char *s); /* NULL (with error set) on failure */

#define qt_malloc(n, what) qt_malloc_at((n), (what), __FILE__, __LINE__)
#define qt_calloc(c, s, what) qt_calloc_at((c), (s), (what), __FILE__, __LINE__)
#define qt_realloc(p, n, what) qt_realloc_at((p), (n), (what), __FILE__, __LINE__)
#define qt_alloc_aligned(n, what) qt_alloc_aligned_at((n), (what), __FILE__, __LINE__)
#define qt_alloc_sparse(n, what) qt_alloc_sparse_at((n), (what), __FILE__, __LINE__)

/* A /proc/meminfo value in KiB ("MemAvailable", "MemTotal"), -1 where it
 * cannot be read. */
long long qt_meminfo_kib(const char *key);

/* Multiplies sizes, failing on overflow: lengths from files must pass here
 * before they size an allocation. Returns 0 on overflow. */
int qt_mul_ok(size_t a, size_t b, size_t *out);

#endif
