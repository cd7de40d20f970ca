/* The host all-reduce of a data-parallel job on CPU devices: a barrier that a failed replica
 * can break, and the in-place average of the replicas' gradient buffers between two of them.
 * It is the CPU twin of NCCL's all-reduce (cuda/nccl.c), beside it in the collectives. One
 * td_hostreduce per run, shared by its replica threads through train/'s all-reduce group
 * (train/device.h), and used by bench_gpt, which measures exactly this code. Every function
 * is called from replica threads; the group's mutex guards the barrier and the published
 * buffer addresses, and is never held while averaging. */
#ifndef TD_HOSTREDUCE_H
#define TD_HOSTREDUCE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define TD_HOSTREDUCE_MAX 64 /* replicas in one group: train/device.h's TD_MAX_DEVICES */

typedef struct td_hostreduce {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int world;
    int arrived;
    uint64_t gen;
    int aborted; /* a replica failed: every barrier from now on refuses */
    float *bufs[TD_HOSTREDUCE_MAX];
    double average_ms[TD_HOSTREDUCE_MAX]; /* per rank: time spent averaging, not waiting */
} td_hostreduce;

void td_hostreduce_init(td_hostreduce *g, int world);
void td_hostreduce_destroy(td_hostreduce *g);

/* Waits until every replica has arrived. The last to arrive calls decide(ud) (when not NULL)
 * under the group's lock, so that all replicas see one decision. Returns 0, or -1 when the
 * group was aborted before everyone arrived. */
int td_hostreduce_barrier(td_hostreduce *g, void (*decide)(void *ud), void *ud);

/* Releases every replica waiting at a barrier; later barriers return -1 at once. */
void td_hostreduce_abort(td_hostreduce *g);

/* Averages buf (n floats; every replica passes its own buffer with the same n) across the
 * group in place: each replica averages its share of the elements across all buffers, summing
 * in rank order so the result does not depend on timing, between two barriers. Returns 0, or
 * -1 when the group was aborted. */
int td_hostreduce_average(td_hostreduce *g, int rank, float *buf, size_t n);

#endif
