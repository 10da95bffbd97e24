/* A small, fast, seedable generator (xoshiro256**, seeded through splitmix64).
 * Every random choice qtune makes (init, dropout masks, shuffles, sampling)
 * draws from a qt_rng derived from the job's seed, so a run is reproducible,
 * and a stream can be split per rank/layer/step with qt_rng_derive. */
#ifndef QT_CORE_RNG_H
#define QT_CORE_RNG_H

#include <stdint.h>

typedef struct { uint64_t s[4]; } qt_rng;

void qt_rng_seed(qt_rng *r, uint64_t seed);
/* An independent stream for (seed, a, b): e.g. (job seed, rank, step). */
void qt_rng_derive(qt_rng *r, uint64_t seed, uint64_t a, uint64_t b);
uint64_t qt_rng_u64(qt_rng *r);
float qt_rng_uniform(qt_rng *r);               /* [0, 1) with 24 random bits */
float qt_rng_normal(qt_rng *r);                /* standard normal (Box-Muller) */
uint64_t qt_rng_below(qt_rng *r, uint64_t n);  /* uniform in [0, n), unbiased */

#endif
