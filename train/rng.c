/* The engine's PRNG: xoshiro256** seeded through splitmix64 (both by Blackman and Vigna, public
 * domain). Deterministic on every machine, so a seed names one initialisation and one
 * sequence of shuffles. A td_rng belongs to whoever holds it; no global state. */
#include "train/engine.h"

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* The stream is mixed into splitmix's start, so (seed, 1) and (seed, 2) share nothing. */
void td_rng_seed(td_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull);

    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

uint64_t td_rng_next(td_rng *r)
{
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

/* The top 24 bits make every float in [0,1) a multiple of 2^-24, all exactly representable. */
float td_rng_uniform(td_rng *r)
{
    return (float)(td_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

/* Lemire's multiply-and-reject: no modulo bias, rarely more than one draw. */
uint32_t td_rng_below(td_rng *r, uint32_t n)
{
    uint64_t m = (td_rng_next(r) >> 32) * (uint64_t)n;
    uint32_t low = (uint32_t)m;

    if (low < n) {
        uint32_t threshold = (uint32_t)(-n) % n;
        while (low < threshold) {
            m = (td_rng_next(r) >> 32) * (uint64_t)n;
            low = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}
