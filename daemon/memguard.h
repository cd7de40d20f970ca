/* The memory guard (DESIGN.md, "Before a job starts on a device"): a job's estimated peak on
 * one device (train/memest.c: parameters, gradients, optimizer state, activations with
 * attention's B*NH*T*T scores, the CUDA workspace; on cpu devices the dataset in host memory)
 * held against what its devices have free. A job that cannot fit is refused with the numbers
 * and the largest batch that would fit; a batch_size "auto" job takes the largest batch that
 * fits. The caller (the scheduler at dispatch, submit --dry-run) reads the devices' memory;
 * the guard reads only the dataset's headers and sizes, as the job's user. Loop thread. */
#ifndef TD_MEMGUARD_H
#define TD_MEMGUARD_H

#include <stddef.h>

#include "daemon/jobspec.h"

/* What the guard found, for the refusal, the job's log and --dry-run's reply. */
typedef struct td_memguard {
    td_mem_estimate est; /* per device, at the batch the job will run (or asked for) */
    size_t need;         /* what is held against free_bytes: est.total, plus est.data (the
                          * dataset in host memory) on cpu devices, whose free memory is the
                          * host's */
    size_t free_bytes;   /* the least free memory among the job's devices */
    size_t total_bytes;  /* that device's total */
    char device[16];     /* that device's name, "cuda:1" */
    int fits;            /* need <= free_bytes */
    int largest_batch;   /* the largest global batch_size that fits (at most TD_JOB_MAX_BATCH);
                          * 0 when not even world rows fit */
    int chose_batch;     /* batch_auto: the batch taken (also written into spec->train) */
} td_memguard;

/* Checks spec, its train.world set to the number of devices it will run on, against
 * free_bytes (the least free memory among those devices; device names it). Fills *g. On a
 * host backend (cpu devices) the dataset's bytes (est.data, read from the files' headers as
 * spec->uid, td_data_access) come off the top: the largest batch is the one whose estimate
 * fits in what the data leaves. On a GPU the dataset stays in host memory and is not held
 * against the device (TD_DATA_MAX_BYTES bounds it at submit). With
 * spec->batch_auto it sets spec->train.batch_size to the largest global batch that fits
 * (a multiple of world, at most TD_JOB_MAX_BATCH: what a job file accepts, so the stored
 * choice parses again after a restart) and clears batch_auto. Returns 0 when the
 * job fits (then or with its new batch); TD_ENOMEM when it does not, err giving the estimate
 * by part, the free memory, the device and the largest batch that would fit:
 * "does not fit on cuda:1: needs 81234 MiB per device (parameters 475, gradients 475,
 * optimizer 950, activations 78810 of which attention 36864, workspace 98), 80517 MiB free;
 * batch_size 12 would fit" (", data N" after workspace where the dataset counts); TD_EINVAL for a
 * batch_size below world ("batch_size 1 cannot be split across 2 devices"); the estimate's errors
 * (TD_EINVAL, TD_ESHAPE, TD_EDATA, TD_E2BIG). */
int td_memguard_check(td_jobspec *spec, size_t free_bytes, size_t total_bytes, const char *device,
                      td_memguard *g, td_error_t *err);

/* Rows per device "auto" takes at most: past this a bigger batch buys a small model no more
 * speed, only fewer steps per epoch (a 2-layer mlp "fits" a million rows). llm.c's GPT-2
 * runs take 16 to 64 sequences per GPU, well under it. */
#define TD_MEMGUARD_AUTO_MAX_ROWS 1024

/* The batch an "auto" job takes given the largest global batch that fits: largest, at most
 * TD_MEMGUARD_AUTO_MAX_ROWS per device, rounded down to a multiple of world (every replica
 * computes the same rows); 0 when below world. */
int td_memguard_auto_batch(int largest, int world);

#endif
