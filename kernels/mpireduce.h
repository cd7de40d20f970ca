/* The collectives of a job that spans processes, one per node, joined by MPI (built when meson
 * finds MPI: TD_HAVE_MPI). MPI is the transport and the rendezvous; traind adds none of its
 * own. This is the cross-process twin of the host reduce (hostreduce.h), with the same shape:
 * a barrier through which the ranks agree a step decision, and an average of the ranks'
 * gradient buffers that sums in global rank order (rank 0 first, then 1, ..., then the
 * 1/world scale), so that P processes of D devices compute bit for bit what one process of
 * P*D devices computes with the host reduce. A device's global rank is process * D + local.
 *
 * The ordered average, for n floats over W = P*D ranks: every process owns the contiguous
 * range of its D ranks' slices ([n*g/W, n*(g+1)/W) is rank g's, as in the host reduce). D
 * all-to-alls send each device's share of every process's range as it is (no partial sum
 * inside a process, which would change the order: MPI_Allreduce's own order differs from
 * rank order at 4 ranks); each local rank sums its own slice over the W shares in rank order
 * into local rank 0's buffer; an all-gather puts every process's range there; the other local
 * ranks copy it. Staging: about D*n floats per process (D * P * its range), kept between calls.
 *
 * Waiting: every MPI request is non-blocking and polled, by one local thread at a time (the
 * last to arrive at the step, the leader), together with three ways out: the group's local
 * abort (a replica of this process failed), a failure notice from another process (posted on a
 * communicator of its own, as the NCCL watchdog polls its stop flag), and the job's
 * collective timeout. So a rank that panics while the others wait in a collective releases
 * them within a poll, and a peer that is gone cuts the wait at the timeout, never hangs it.
 *
 * Threads: td_mpi_init and td_mpi_finalize on the main thread, the rest on any thread; MPI is
 * initialised with MPI_THREAD_MULTIPLE, since an abort's notice is sent by the failing thread
 * while another may poll. A td_mpireduce is shared by its process's replica threads as a
 * td_hostreduce is; td_mpireduce_new/free and td_mpireduce_outcomes are collective over the
 * processes and run on one thread of each. */
#ifndef TD_MPIREDUCE_H
#define TD_MPIREDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/hostreduce.h"
#include "common/td_errno.h"

#define TD_MPI_NODE_NAME 64  /* bytes of a node's name, with its NUL */
#define TD_MPI_MAX_PROCS 256 /* processes of one job: jobspec.h's TD_JOB_MAX_NODES */

/* Initialises MPI for the process (MPI_THREAD_MULTIPLE; a library that offers less is
 * refused, naming what it offered) and learns the world: its rank and size, and every
 * process's node name, gathered: TRAIND_NODE_NAME, else SLURMD_NODENAME, else the host name;
 * names that several processes share (mpirun on one host) get "#rank" appended. TD_EINVAL with
 * MPI's message. Once per process. */
int td_mpi_init(int *argc, char ***argv, td_error_t *err);
int td_mpi_rank(void);
int td_mpi_size(void);
const char *td_mpi_node_name(int proc); /* "" out of range */

/* Blocking collectives of the world, for what the processes settle before a run (the spec's
 * checks, the checkpoint directory's proof): len bytes of process 0's to all; len bytes of
 * each to all (all: size * len bytes). TD_EMPI. */
int td_mpi_bcast(void *p, size_t len, td_error_t *err);
int td_mpi_allgather(const void *mine, size_t len, void *all, td_error_t *err);

/* Ends MPI cleanly (every process calls it), or, after a failure that may have left a
 * collective half done, leaves without the barrier MPI_Finalize would be. */
void td_mpi_finalize(void);

typedef struct td_mpireduce td_mpireduce;

/* The group of every process's local ranks (local per process, the same everywhere), its
 * communicators duplicated from the world. timeout_s bounds each collective's wait.
 * Collective. TD_ENOMEM, TD_EINVAL. */
int td_mpireduce_new(td_mpireduce **out, int local, double timeout_s, td_error_t *err);
void td_mpireduce_free(td_mpireduce *g);

int td_mpireduce_world(const td_mpireduce *g); /* processes * local */
int td_mpireduce_base(const td_mpireduce *g);  /* this process's first global rank */

/* Waits until every rank of every process has arrived; one of this process's, the leader,
 * calls decide(ud) for the process's vote (a bit set: decisions combine by OR) and the
 * processes combine theirs; every rank gets the result in *decision. Returns 0; -1 once the
 * group is aborted (locally, or by a notice from another process); -2 when the wait timed out
 * or MPI failed, with err filled on the leader (the group is then aborted for everyone). */
int td_mpireduce_barrier(td_mpireduce *g, int (*decide)(void *ud), void *ud, int *decision,
                         td_error_t *err);

/* buf (n floats) := the mean over every global rank's buf, summed in global rank order, in
 * place. Every local rank calls it with its own buffer and the same n. Returns as
 * td_mpireduce_barrier. */
int td_mpireduce_average(td_mpireduce *g, int local_rank, float *buf, size_t n, td_error_t *err);

/* len bytes at p, global rank 0's copy to every process: called by one thread of each, the
 * other local ranks not in it. Returns as td_mpireduce_barrier. */
int td_mpireduce_bcast(td_mpireduce *g, void *p, size_t len, td_error_t *err);

/* Releases every rank of this process waiting in the group and, when why is not NULL (a local
 * rank failed, or stopped), tells every other process, which then releases its own: later
 * barriers and averages return -1 everywhere. Any thread, any time; the notice is sent once. */
void td_mpireduce_abort(td_mpireduce *g, int global_rank, const td_error_t *why);

/* The first notice another process sent, if any: its rank and why, into *global_rank and
 * *why. 1 when there is one. */
int td_mpireduce_notice(td_mpireduce *g, int *global_rank, td_error_t *why);

/* Gathers len bytes from every process at process 0, into all (processes * len bytes; process
 * 0 only, NULL elsewhere), on a communicator of its own (the others may have been left with a
 * collective half done by a failure). Waits at most timeout_s: a process that never arrives
 * (killed) leaves its part zeroed and *missing counts it. Collective. 0, or TD_EINVAL with
 * MPI's message. */
int td_mpireduce_outcomes(td_mpireduce *g, const void *mine, size_t len, void *all,
                          double timeout_s, int *missing, td_error_t *err);

/* Seconds this process's leader spent in MPI calls and waits of averages, for benchmarks. */
double td_mpireduce_average_ms(const td_mpireduce *g);

#endif
