/* The memory guard (DESIGN.md, "Before a job starts on a device"): a job's estimated peak on
 * one device (train/memest.c: parameters, gradients, optimizer state, activations with
 * attention's B*NH*T*T scores, the CUDA workspace) held against what its devices have free.
 * A job that cannot fit is refused with the numbers and the largest batch that would fit; a
 * batch_size "auto" job takes the largest batch that fits. Pure: the caller (the scheduler at
 * dispatch, submit --dry-run) reads the devices' memory. Loop thread. */
#ifndef TD_MEMGUARD_H
#define TD_MEMGUARD_H

#include <stddef.h>

#include "jobspec.h"

/* What the guard found, for the refusal, the job's log and --dry-run's reply. */
typedef struct td_memguard {
    td_mem_estimate est; /* per device, at the batch the job will run (or asked for) */
    size_t free_bytes;   /* the least free memory among the job's devices */
    size_t total_bytes;  /* that device's total */
    char device[16];     /* that device's name, "cuda:1" */
    int fits;            /* est.total <= free_bytes */
    int largest_batch; /* the largest global batch_size that fits; 0 when not even world rows fit */
    int chose_batch;   /* batch_auto: the batch taken (also written into spec->train) */
} td_memguard;

/* Checks spec, its train.world set to the number of devices it will run on, against
 * free_bytes (the least free memory among those devices; device names it). Fills *g. With
 * spec->batch_auto it sets spec->train.batch_size to the largest global batch that fits
 * (a multiple of world, at most TD_MEM_MAX_BATCH) and clears batch_auto. Returns 0 when the
 * job fits (then or with its new batch); TD_ENOMEM when it does not, err giving the estimate
 * by part, the free memory, the device and the largest batch that would fit:
 * "does not fit on cuda:1: needs 81234 MiB per device (parameters 475, gradients 475,
 * optimizer 950, activations 78810 of which attention 36864, workspace 98), 80517 MiB free;
 * batch_size 12 would fit"; the estimate's errors (TD_EINVAL, TD_ESHAPE, TD_EDATA). */
int td_memguard_check(td_jobspec *spec, size_t free_bytes, size_t total_bytes, const char *device,
                      td_memguard *g, td_error_t *err);

#endif
