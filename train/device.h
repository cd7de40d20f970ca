/* Devices, as everything above the engine sees them (DESIGN.md, "Devices"): which devices
 * this process has, a device opened by the thread that computes on it, the memory a job would
 * have there, the all-reduce group of a data-parallel run (the host reduce on CPUs, NCCL on
 * GPUs), and whether the process's CUDA state is lost. The daemon reaches GPUs only through
 * this interface: it includes no CUDA header and never tests TD_HAVE_CUDA. A build without
 * CUDA has the same interface; for cuda devices it answers TD_EINVAL, "this traind was built
 * without CUDA".
 *
 * Threads: td_device_open/close, td_device_prepare and a rank's td_group_join, allreduce and
 * leave run on the thread that computes on the device (a worker); the rest on any thread. */
#ifndef TD_DEVICE_H
#define TD_DEVICE_H

#include <stddef.h>

#include "common/td_errno.h"

#define TD_MAX_DEVICES 64 /* devices one process drives, and replicas in one run */

struct td_kernels;

typedef enum { TD_DEVICE_CPU = 0, TD_DEVICE_CUDA = 1 } td_device_kind;

/* "cpu" or "cuda". */
const char *td_device_kind_name(td_device_kind kind);

/* 1 when this build can drive devices of kind (cpu always; cuda in builds with CUDA). */
int td_device_kind_built(td_device_kind kind);

/* How many devices of kind this process sees, into *n: cpu, the online cores; cuda, the GPUs
 * CUDA_VISIBLE_DEVICES leaves (0 on a machine without any). TD_ECUDA when the CUDA runtime
 * cannot answer; TD_EINVAL in a build without CUDA. */
int td_device_count(td_device_kind kind, int *n, td_error_t *err);

/* The backend table jobs on kind compute with (kernels.h): td_kernels_cpu() or
 * td_kernels_cuda(). In a build without CUDA, the CPU's for every kind (nothing asks for
 * cuda there: td_device_count refused it first). Static, never NULL. */
const struct td_kernels *td_device_kernels(td_device_kind kind);

/* ---- an open device (a worker thread's) --------------------------------------------------- */

typedef struct td_device td_device;

/* Opens device ordinal of kind for the calling thread, which must make every later call on
 * it: cuda, a context on the GPU (stream, cuBLAS handle, workspace, scratch) bound to the
 * thread; cpu, nothing to acquire. TD_ECUDA with CUDA's message, TD_ENOMEM, TD_EINVAL.
 * Caller closes with td_device_close() on the same thread. */
int td_device_open(td_device **out, td_device_kind kind, int ordinal, td_error_t *err);

/* Releases the device's context. Accepts NULL. Never fails (a poisoned context's errors are
 * ignored). */
void td_device_close(td_device *d);

td_device_kind td_device_kind_of(const td_device *d);

/* Readies d for a job: on a GPU, bf16 mixed precision on (bf16 1) or off, TF32 allowed or
 * not, and *peak_flops the device's dense peak at that precision (0 when the device is not
 * in the datasheet table: then no mfu is recorded); on a CPU nothing, and *peak_flops 0.
 * TD_ECUDA with cuBLAS's message. */
int td_device_prepare(td_device *d, int bf16, int tf32, double *peak_flops, td_error_t *err);

/* ---- memory ------------------------------------------------------------------------------- */

/* What a worker's open cuda device holds besides a job's buffers: cuBLAS's workspace, the
 * context's default scratch and its fixed buffers (kernels/cuda/td_cuda.h's
 * TD_CUDA_CUBLAS_WORKSPACE + TD_CUDA_SCRATCH_DEFAULT + TD_CUDA_CTX_FIXED, checked against
 * them in builds with CUDA). The memory estimate counts it as a job's workspace on a device
 * backend, in every build, so that tests of the device path without a GPU count it too. */
#define TD_DEVICE_CUDA_CONTEXT_BYTES \
    ((size_t)(32u << 20) + (size_t)(64u << 20) + (1024 * 8 + 65536 * 4)) /* bytes */

/* Free and total bytes of device ordinal of kind: cpu, MemAvailable and MemTotal of
 * /proc/meminfo (the machine's, shared by every cpu device); cuda, cudaMemGetInfo's (what
 * other processes and this one's contexts hold is not free). TD_EIO, TD_ECUDA. */
int td_device_memory(td_device_kind kind, int ordinal, size_t *free_bytes, size_t *total_bytes,
                     td_error_t *err);

/* The memory one replica of a job on devices ordinals[0..n) of kind can count on, for the
 * memory guard: the least of the devices' usable memory into *free_bytes, that device's
 * total into *total_bytes and its index in ordinals into *which. A cpu device's share is
 * MemAvailable over n, since the job's devices share the machine's memory (read once). A
 * GPU's is td_device_gpu_usable's. Errors as td_device_memory. */
int td_device_job_memory(td_device_kind kind, const int *ordinals, int n, size_t *free_bytes,
                         size_t *total_bytes, int *which, td_error_t *err);

/* What a job can count on of a GPU whose cudaMemGetInfo says free_bytes, in a job of world
 * GPUs: free_bytes, plus its worker's own context (already allocated, and counted again by
 * the estimate's workspace), less td_device_gpu_reserve(world) for what is allocated outside
 * the estimate once the job runs: the kernels cuBLAS and the runtime load on first use, and
 * NCCL's buffers, which grow with the peers a rank talks to (NCCL_BUFFSIZE, 4 MiB by default,
 * per channel, for up to 32 channels each way per peer on NVLink; NVLS's multicast buffers on
 * top on NVSwitch systems). */
#define TD_DEVICE_GPU_RESERVE   ((size_t)1 << 30)   /* bytes, whatever the job */
#define TD_DEVICE_NCCL_PER_PEER ((size_t)256 << 20) /* bytes more per GPU beyond the first */
size_t td_device_gpu_reserve(int world);
size_t td_device_gpu_usable(size_t free_bytes, int world);

/* 1 once a CUDA call in this process met a sticky error (an illegal address and its kin): the
 * process's CUDA state is lost, and CUDA's guidance is to relaunch it. 0 in a build without
 * CUDA. */
int td_device_poisoned(void);

/* ---- the world of a job that spans processes ------------------------------------------- */

/* A job over several nodes runs one process per node (`traind rank`), joined by MPI in builds
 * with it (kernels/mpireduce.h); the daemon itself never joins a world. td_world_built says
 * whether this build can (0 without MPI: td_world_init answers TD_EINVAL, "this traind was
 * built without MPI"). td_world_init joins the launcher's world on the main thread, once, and
 * learns each process's node name; td_world_finalize leaves it. Without a world, rank 0 of
 * size 1. */
int td_world_built(void);
int td_world_init(int *argc, char ***argv, td_error_t *err);
int td_world_rank(void);
int td_world_size(void);
const char *td_world_node_name(int proc); /* "" out of range or without a world */
/* Blocking collectives over the world, for what its processes settle before a run: len bytes
 * of process 0's to every process; len bytes of each into all (size * len bytes). Without a
 * world they copy mine. TD_EMPI. */
int td_world_bcast(void *p, size_t len, td_error_t *err);
int td_world_allgather(const void *mine, size_t len, void *all, td_error_t *err);
void td_world_finalize(void);

/* ---- the all-reduce group of one run ------------------------------------------------------ */

/* A data-parallel run's replicas, one rank per device: the step barriers through which they
 * agree, a failed rank's release of the others, and the average of their gradients. On cpu
 * devices the host reduce (kernels/hostreduce.h) averages; on cuda devices NCCL does, one
 * non-blocking communicator per run whose watchdog gives up after the run's timeout or as
 * soon as any rank calls td_group_abort.
 *
 * A group may span the processes of a world (td_group_new_spanning): each process has the same
 * number of local ranks, a rank's global rank is process * local + its local rank, and the
 * world is processes * local. On cpu devices the average is MPI's ordered reduce
 * (mpireduce.h), which sums in global rank order as the host reduce does, so a run of P
 * processes of D devices computes bit for bit what one of P*D computes; on cuda devices one
 * NCCL communicator spans every process's GPUs, rank 0's unique id broadcast through MPI.
 * Ranks are local ranks in every call below but td_group_fail's. */
typedef struct td_group td_group;

/* A group of world ranks on devices of kind, in this process. For a cuda group of more than
 * one rank it makes the communicator's unique id here; a failure to do so is kept and given
 * to rank 0's td_group_join. TD_ENOMEM. Caller frees with td_group_free() once every rank has
 * left. */
int td_group_new(td_group **out, td_device_kind kind, int world, double timeout_s, td_error_t *err);

/* A group of local ranks in each process of the world (td_world_init first). Collective: every
 * process calls it at about the same time, from one thread. For cuda, global rank 0's process
 * makes the unique id and broadcasts it. TD_EINVAL without a world or MPI, TD_EMPI, TD_ENOMEM. */
int td_group_new_spanning(td_group **out, td_device_kind kind, int local, double timeout_s,
                          td_error_t *err);
void td_group_free(td_group *g); /* accepts NULL */

int td_group_world(const td_group *g);    /* every rank of the group, over all processes */
int td_group_base(const td_group *g);     /* the global rank of this process's local rank 0 */
int td_group_spanning(const td_group *g); /* 1 for a group over processes */

/* Joins rank on its own thread, with its open device d: for a cuda group of more than one
 * rank, its rank of the communicator (collective: every rank joins at about the same time).
 * heartbeat (the worker's, or NULL; borrowed until td_group_leave) is set to td_mono_ms()
 * atomically on every poll while the rank waits in NCCL, so that the daemon's watchdog sees
 * a rank waiting for its peers as alive and leaves the wait to the group's timeout.
 * TD_EABORTED when a peer failed first; TD_ECUDA with NCCL's message or the timeout's. */
int td_group_join(td_group *g, int rank, td_device *d, long long *heartbeat, td_error_t *err);

/* Waits until every rank (of every process) has arrived. One rank of each process calls
 * decide(ud) (when not NULL) for its vote, a set of bits; the votes of the processes are
 * combined by OR, and every rank gets the one result in *decision. Returns 0; -1 once the
 * group is aborted (a peer failed or stopped); -2 when this rank's wait failed on its own (a
 * spanning group's collective timeout, MPI's error), with err filled: the rank's failure. */
int td_group_barrier(td_group *g, int rank, int (*decide)(void *ud), void *ud, int *decision,
                     td_error_t *err);

/* Releases every rank waiting at a barrier or in a collective (their NCCL watchdogs see it
 * and abort): later barriers return -1 and collectives fail with TD_EABORTED. In a spanning
 * group the other processes are told too. Any rank, any time. */
void td_group_abort(td_group *g);

/* td_group_abort for rank's failure err: in a spanning group the other processes learn which
 * global rank failed and why (td_group_notice), so that the job's report names it even when
 * this process cannot report any more. */
void td_group_fail(td_group *g, int rank, const td_error_t *err);

/* The first failure another process reported, if any: its global rank into *global_rank, its
 * error into *why. 1 when there is one; 0 in a group of one process. */
int td_group_notice(td_group *g, int *global_rank, td_error_t *why);

/* Gathers len bytes of every process at global rank 0's (all: processes * len bytes there,
 * NULL elsewhere), waiting at most timeout_s for the others; a process that never comes
 * leaves its part zeroed and sets *missing. Collective, one thread of each process, after
 * every local rank has left. A group of one process copies mine. TD_EMPI. */
int td_group_outcomes(td_group *g, const void *mine, size_t len, void *all, double timeout_s,
                      int *missing, td_error_t *err);

/* buf (n floats, in the memory of rank's device) := the mean of every rank's buf, in place.
 * Every rank calls it at the same point with the same n. Must run under a panic boundary:
 * panics TD_EABORTED ("stopped: another device of the job failed") once the group is
 * aborted, TD_ECUDA with NCCL's message or the watchdog's, TD_EMPI with MPI's or the
 * timeout's. */
void td_group_allreduce(td_group *g, int rank, float *buf, size_t n);

/* Leaves the group: for a cuda rank, first meets its peers (a rank done early does not wait
 * out the timeout in NCCL's finalize while rank 0 evaluates and checkpoints), then finalizes
 * and frees its communicator. Every rank that joined calls it, also after a failure. */
void td_group_leave(td_group *g, int rank);

#endif
