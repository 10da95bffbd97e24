#include "core/rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void qt_rng_seed(qt_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

void qt_rng_derive(qt_rng *r, uint64_t seed, uint64_t a, uint64_t b) {
    uint64_t x = seed;
    uint64_t h = splitmix64(&x) ^ (a * 0xd1b54a32d192ed03ull);
    h = splitmix64(&h) ^ (b * 0x8cb92ba72f3d8dd7ull);
    qt_rng_seed(r, h);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t qt_rng_u64(qt_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float qt_rng_uniform(qt_rng *r) { return (float)(qt_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

float qt_rng_normal(qt_rng *r) {
    float u1 = qt_rng_uniform(r), u2 = qt_rng_uniform(r);
    if (u1 < 1e-12f) u1 = 1e-12f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

uint64_t qt_rng_below(qt_rng *r, uint64_t n) {
    if (n == 0) return 0;
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = qt_rng_u64(r); while (x >= limit);
    return x % n;
}
