/* A job running on its devices: one td_run per dispatch, shared by the job's device workers
 * (one replica each, rank = position in device order). It carries the host all-reduce and
 * the barriers through which the replicas agree, every step, whether to go on, stop for a
 * cancel, or stop for a shutdown; and it collects each replica's outcome, so that the last
 * worker to finish posts one DONE event naming every failed device in device order.
 *
 * The loop thread creates a run (td_run_new) and hands it to the workers (td_run_start); the
 * workers touch it until each has counted itself finished; the loop frees it when the DONE
 * event arrives (td_run_free). */
#ifndef TD_RUN_H
#define TD_RUN_H

#include "daemon.h"

typedef struct td_run td_run;

/* A run of job on the given workers (n of them, in device order). Copies the array. */
int td_run_new(td_run **out, td_daemon *d, td_djob *job, td_worker **workers, int n);
/* Wakes the run's workers. */
void td_run_start(td_run *r);
void td_run_free(td_run *r);

/* The thread of one device. */
void *td_worker_main(void *arg);

#endif
