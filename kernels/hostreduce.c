/* The host all-reduce (see hostreduce.h). Called from replica threads; the group's mutex
 * guards the barrier and the published buffer addresses, never held while averaging. */
#include <time.h>

#include "kernels/hostreduce.h"
#include "common/td_clock.h"

void td_hostreduce_init(td_hostreduce *g, int world)
{
    *g = (td_hostreduce){.world = world};
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
}

void td_hostreduce_destroy(td_hostreduce *g)
{
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
}

int td_hostreduce_barrier(td_hostreduce *g, void (*decide)(void *ud), void *ud)
{
    uint64_t gen;
    int ok;

    pthread_mutex_lock(&g->mu);
    if (g->aborted) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    gen = g->gen;
    if (++g->arrived == g->world) {
        if (decide != NULL)
            decide(ud);
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (g->gen == gen && !g->aborted)
            pthread_cond_wait(&g->cv, &g->mu);
    }
    ok = g->gen != gen;
    pthread_mutex_unlock(&g->mu);
    return ok ? 0 : -1;
}

void td_hostreduce_abort(td_hostreduce *g)
{
    pthread_mutex_lock(&g->mu);
    g->aborted = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

int td_hostreduce_average(td_hostreduce *g, int rank, float *buf, size_t n)
{
    size_t lo = n * (size_t)rank / (size_t)g->world;
    size_t hi = n * (size_t)(rank + 1) / (size_t)g->world;
    float inv = 1.0f / (float)g->world;
    double t0;

    pthread_mutex_lock(&g->mu);
    g->bufs[rank] = buf;
    pthread_mutex_unlock(&g->mu);
    if (td_hostreduce_barrier(g, NULL, NULL) != 0)
        return -1;
    t0 = td_mono_ms();
    for (size_t i = lo; i < hi; i++) {
        float s = 0;
        for (int k = 0; k < g->world; k++)
            s += g->bufs[k][i];
        s *= inv;
        for (int k = 0; k < g->world; k++)
            g->bufs[k][i] = s;
    }
    g->average_ms[rank] += td_mono_ms() - t0;
    return td_hostreduce_barrier(g, NULL, NULL);
}
