/* `traind rank`: one process of a job that spans nodes, one per node, started by the launcher
 * (srun --mpi=pmix, or mpirun). It joins the launcher's MPI world (train/device.h,
 * td_world_init), trains with the devices of its node through the same workers and runs as
 * the daemon's (run.h, a spanning run), and exits with the job's outcome. Global rank 0
 * reports: on its stdout as traind's frames, for the daemon that launched it (the rank stream,
 * proto/PROTOCOL.md), or, with --state, into a store of its own, for a batch script without a
 * daemon. Signals: SIGUSR1 cancels; SIGUSR2, SIGTERM and SIGINT interrupt (both stop at the
 * next step boundary that every process agrees on, after a checkpoint).
 *
 * Threads: the main thread runs a libuv loop of its own (the run's mailbox, the signals, the
 * stream's writes); the workers are run.h's. */
#ifndef TD_RANK_H
#define TD_RANK_H

/* Exit statuses of every process of the job. */
enum {
    TD_RANK_SUCCEEDED = 0,
    TD_RANK_FAILED = 1,
    TD_RANK_CANCELLED = 2,
    TD_RANK_INTERRUPTED = 3,
    TD_RANK_USAGE = 64, /* EX_USAGE: bad flags or spec, said on stderr */
};

/* argv[0] is "rank". */
int td_rank_main(int argc, char **argv);

#endif
