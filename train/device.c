/* Devices (device.h): the CPU's answers written here, CUDA's taken from kernels/cuda
 * (td_cuda.h) in builds with CUDA. This file is the one place above kernels/ that tests
 * TD_HAVE_CUDA, so that the daemon never has to. A td_group pairs the host reduce, whose
 * barriers every run uses for its step decisions, with NCCL's communicator ranks on GPUs. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/device.h"
#include "kernels/hostreduce.h"
#include "kernels/kernels.h"
#ifdef TD_HAVE_MPI
#include "kernels/mpireduce.h"
#endif
#include "common/td_panic.h"
#ifdef TD_HAVE_CUDA
#include "kernels/cuda/td_cuda.h"
#endif

#define NO_CUDA "this traind was built without CUDA"
#define NO_MPI  "this traind was built without MPI"

#ifdef TD_HAVE_CUDA
_Static_assert(TD_DEVICE_CUDA_CONTEXT_BYTES ==
                   (size_t)TD_CUDA_CUBLAS_WORKSPACE + TD_CUDA_SCRATCH_DEFAULT + TD_CUDA_CTX_FIXED,
               "device.h's context bytes must be td_cuda.h's");
#endif

struct td_device {
    td_device_kind kind;
    int ordinal;
#ifdef TD_HAVE_CUDA
    td_cuda_ctx *ctx; /* cuda: bound to the opening thread */
#endif
};

struct td_group {
    td_device_kind kind;
    int world;    /* every rank, over all processes */
    int local;    /* this process's ranks */
    int base;     /* the global rank of local rank 0 */
    int decision; /* the last barrier's, under hr's lock (a group of one process) */
    double timeout_s;
    td_hostreduce hr; /* one process: the barriers, and on cpu devices the average */
#ifdef TD_HAVE_MPI
    td_mpireduce *mr; /* over processes: the barriers, and on cpu devices the average */
#endif
    int stop; /* set atomically by td_group_abort: the NCCL watchdogs poll it */
#ifdef TD_HAVE_CUDA
    td_nccl_id id;                 /* cuda, world > 1: the communicator's */
    td_error_t id_err;             /* why no id could be made; rank 0's join fails with it */
    td_nccl *nccl[TD_MAX_DEVICES]; /* each rank's, written only by that rank's thread */
#endif
};

const char *td_device_kind_name(td_device_kind kind)
{
    return kind == TD_DEVICE_CUDA ? "cuda" : "cpu";
}

int td_device_kind_built(td_device_kind kind)
{
#ifdef TD_HAVE_CUDA
    return kind == TD_DEVICE_CPU || kind == TD_DEVICE_CUDA;
#else
    return kind == TD_DEVICE_CPU;
#endif
}

int td_device_count(td_device_kind kind, int *n, td_error_t *err)
{
    long cores;

    *n = 0;
    if (kind == TD_DEVICE_CPU) {
        cores = sysconf(_SC_NPROCESSORS_ONLN);
        *n = cores > 0 ? (int)cores : 1;
        return 0;
    }
#ifdef TD_HAVE_CUDA
    return td_cuda_devices(n, err);
#else
    return td_error_set(err, TD_EINVAL, NO_CUDA);
#endif
}

const td_kernels *td_device_kernels(td_device_kind kind)
{
#ifdef TD_HAVE_CUDA
    if (kind == TD_DEVICE_CUDA)
        return td_kernels_cuda();
#endif
    (void)kind;
    return td_kernels_cpu();
}

/* ---- an open device ---- */

int td_device_open(td_device **out, td_device_kind kind, int ordinal, td_error_t *err)
{
    td_device *d;

    *out = NULL;
    if (!td_device_kind_built(kind))
        return td_error_set(err, TD_EINVAL, NO_CUDA);
    d = calloc(1, sizeof(*d));
    if (d == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory opening %s:%d",
                            td_device_kind_name(kind), ordinal);
    d->kind = kind;
    d->ordinal = ordinal;
#ifdef TD_HAVE_CUDA
    if (kind == TD_DEVICE_CUDA) {
        int rc = td_cuda_ctx_new(&d->ctx, ordinal, NULL, err);
        if (rc != 0) {
            free(d);
            return rc;
        }
    }
#endif
    *out = d;
    return 0;
}

void td_device_close(td_device *d)
{
    if (d == NULL)
        return;
#ifdef TD_HAVE_CUDA
    td_cuda_ctx_free(d->ctx);
#endif
    free(d);
}

td_device_kind td_device_kind_of(const td_device *d)
{
    return d->kind;
}

#ifdef TD_HAVE_CUDA
/* The context's precision switches, under a panic boundary of their own (they panic on a
 * cuBLAS error). A function of its own so that no caller's local lives across the setjmp. */
static int set_precision(td_cuda_ctx *ctx, int bf16, int tf32, td_error_t *err)
{
    td_boundary b;

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_cuda_ctx_set_bf16(ctx, bf16);
        td_cuda_ctx_set_tf32(ctx, tf32);
        td_boundary_leave(&b);
        return 0;
    }
    *err = b.err;
    return err->code;
}
#endif

int td_device_prepare(td_device *d, int bf16, int tf32, double *peak_flops, td_error_t *err)
{
    *peak_flops = 0;
#ifdef TD_HAVE_CUDA
    if (d->kind == TD_DEVICE_CUDA) {
        td_error_t why;
        int rc = set_precision(d->ctx, bf16, tf32, err);
        if (rc != 0)
            return rc;
        /* A device the datasheet table does not know records no mfu; that is no failure. */
        if (td_cuda_peak_flops(d->ordinal, bf16, tf32, peak_flops, &why) != 0)
            *peak_flops = 0;
    }
#else
    (void)d;
    (void)bf16;
    (void)tf32;
    (void)err;
#endif
    return 0;
}

/* ---- memory ---- */

/* MemAvailable and MemTotal of /proc/meminfo, in bytes. */
static int meminfo(size_t *avail, size_t *total, td_error_t *err)
{
    FILE *f = fopen("/proc/meminfo", "re");
    char line[256];
    unsigned long long kb;
    int got = 0;

    if (f == NULL)
        return td_error_set(err, TD_EIO, "cannot open /proc/meminfo: %s", strerror(errno));
    while (got != 3 && fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            *avail = (size_t)kb * 1024;
            got |= 1;
        } else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) {
            *total = (size_t)kb * 1024;
            got |= 2;
        }
    }
    fclose(f);
    if (got != 3)
        return td_error_set(err, TD_EIO, "/proc/meminfo has no MemAvailable or MemTotal");
    return 0;
}

int td_device_memory(td_device_kind kind, int ordinal, size_t *free_bytes, size_t *total_bytes,
                     td_error_t *err)
{
    *free_bytes = *total_bytes = 0;
    if (kind == TD_DEVICE_CPU)
        return meminfo(free_bytes, total_bytes, err);
#ifdef TD_HAVE_CUDA
    return td_cuda_mem_info(ordinal, free_bytes, total_bytes, err);
#else
    (void)ordinal;
    return td_error_set(err, TD_EINVAL, NO_CUDA);
#endif
}

size_t td_device_gpu_reserve(int world)
{
    return TD_DEVICE_GPU_RESERVE + (size_t)(world > 1 ? world - 1 : 0) * TD_DEVICE_NCCL_PER_PEER;
}

size_t td_device_gpu_usable(size_t free_bytes, int world)
{
    size_t reserve = td_device_gpu_reserve(world);

    free_bytes += TD_DEVICE_CUDA_CONTEXT_BYTES;
    return free_bytes > reserve ? free_bytes - reserve : 0;
}

int td_device_job_memory(td_device_kind kind, const int *ordinals, int n, size_t *free_bytes,
                         size_t *total_bytes, int *which, td_error_t *err)
{
    *free_bytes = *total_bytes = 0;
    *which = 0;
    for (int i = 0; i < n; i++) {
        size_t f = 0, t = 0;
        int rc = td_device_memory(kind, ordinals[i], &f, &t, err);
        if (rc != 0)
            return rc;
        f = kind == TD_DEVICE_CPU ? f / (size_t)n : td_device_gpu_usable(f, n);
        if (i == 0 || f < *free_bytes) {
            *free_bytes = f;
            *total_bytes = t;
            *which = i;
        }
        /* cpu devices share the machine's memory: one reading answers for all of them */
        if (kind == TD_DEVICE_CPU)
            break;
    }
    return 0;
}

int td_device_poisoned(void)
{
#ifdef TD_HAVE_CUDA
    return td_cuda_poisoned();
#else
    return 0;
#endif
}

/* ---- the world ---- */

int td_world_built(void)
{
#ifdef TD_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

int td_world_init(int *argc, char ***argv, td_error_t *err)
{
#ifdef TD_HAVE_MPI
    return td_mpi_init(argc, argv, err);
#else
    (void)argc;
    (void)argv;
    return td_error_set(err, TD_EINVAL, NO_MPI);
#endif
}

int td_world_rank(void)
{
#ifdef TD_HAVE_MPI
    return td_mpi_rank();
#else
    return 0;
#endif
}

int td_world_size(void)
{
#ifdef TD_HAVE_MPI
    return td_mpi_size();
#else
    return 1;
#endif
}

const char *td_world_node_name(int proc)
{
#ifdef TD_HAVE_MPI
    return td_mpi_node_name(proc);
#else
    (void)proc;
    return "";
#endif
}

int td_world_bcast(void *p, size_t len, td_error_t *err)
{
#ifdef TD_HAVE_MPI
    if (td_mpi_size() > 1)
        return td_mpi_bcast(p, len, err);
#endif
    (void)p;
    (void)len;
    (void)err;
    return 0;
}

int td_world_allgather(const void *mine, size_t len, void *all, td_error_t *err)
{
#ifdef TD_HAVE_MPI
    if (td_mpi_size() > 1)
        return td_mpi_allgather(mine, len, all, err);
#endif
    (void)err;
    memcpy(all, mine, len);
    return 0;
}

void td_world_finalize(void)
{
#ifdef TD_HAVE_MPI
    td_mpi_finalize();
#endif
}

/* ---- the all-reduce group ---- */

int td_group_new(td_group **out, td_device_kind kind, int world, double timeout_s, td_error_t *err)
{
    td_group *g;

    *out = NULL;
    if (world < 1 || world > TD_MAX_DEVICES)
        return td_error_set(err, TD_EINVAL, "a group of %d ranks (1 to %d)", world, TD_MAX_DEVICES);
    g = calloc(1, sizeof(*g));
    if (g == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory making an all-reduce group");
    g->kind = kind;
    g->world = g->local = world;
    g->timeout_s = timeout_s;
    td_hostreduce_init(&g->hr, world);
#ifdef TD_HAVE_CUDA
    /* One communicator per run: its id is made once, here, and every rank joins with it. */
    if (kind == TD_DEVICE_CUDA && world > 1)
        td_nccl_unique_id(&g->id, &g->id_err);
#endif
    *out = g;
    return 0;
}

int td_group_new_spanning(td_group **out, td_device_kind kind, int local, double timeout_s,
                          td_error_t *err)
{
#ifdef TD_HAVE_MPI
    td_group *g;
    int rc = td_group_new(&g, kind, local, timeout_s, err);

    if (rc != 0)
        return rc;
    rc = td_mpireduce_new(&g->mr, local, timeout_s, err);
    if (rc != 0) {
        td_group_free(g);
        return rc;
    }
    g->world = td_mpireduce_world(g->mr);
    g->base = td_mpireduce_base(g->mr);
#ifdef TD_HAVE_CUDA
    /* td_group_new made an id in every process (or failed to, without a GPU): global rank 0's
     * goes to all, and with it whether it could be made. */
    if (kind == TD_DEVICE_CUDA && g->world > 1) {
        struct {
            td_nccl_id id;
            td_error_t err;
        } share = {g->id, g->id_err};
        if (local == 1) {
            /* td_group_new made none for a world of one local rank */
            td_nccl_unique_id(&share.id, &share.err);
        }
        rc = td_mpireduce_bcast(g->mr, &share, sizeof(share), err);
        if (rc != 0) {
            td_group_free(g);
            return err->code != 0 ? err->code : TD_EMPI;
        }
        g->id = share.id;
        g->id_err = share.err;
    }
#endif
    *out = g;
    return 0;
#else
    (void)kind;
    (void)local;
    (void)timeout_s;
    *out = NULL;
    return td_error_set(err, TD_EINVAL, NO_MPI);
#endif
}

void td_group_free(td_group *g)
{
    if (g == NULL)
        return;
    td_hostreduce_destroy(&g->hr);
#ifdef TD_HAVE_MPI
    td_mpireduce_free(g->mr);
#endif
    free(g);
}

int td_group_world(const td_group *g)
{
    return g->world;
}

int td_group_base(const td_group *g)
{
    return g->base;
}

int td_group_spanning(const td_group *g)
{
#ifdef TD_HAVE_MPI
    return g->mr != NULL;
#else
    (void)g;
    return 0;
#endif
}

int td_group_join(td_group *g, int rank, td_device *d, long long *heartbeat, td_error_t *err)
{
#ifdef TD_HAVE_CUDA
    if (g->kind != TD_DEVICE_CUDA || g->world == 1)
        return 0;
    if (g->id_err.code != 0) {
        if (g->base + rank != 0)
            return td_error_set(err, TD_EABORTED, "stopped: another device of the job failed");
        *err = g->id_err;
        return err->code;
    }
    return td_nccl_init_stoppable(&g->nccl[rank], &g->id, g->world, g->base + rank, d->ctx,
                                  g->timeout_s, &g->stop, heartbeat, err);
#else
    (void)g;
    (void)rank;
    (void)d;
    (void)heartbeat;
    (void)err;
    return 0;
#endif
}

/* A group of one process: the hostreduce's decide, which keeps the vote for every rank. */
typedef struct local_vote {
    td_group *g;
    int (*decide)(void *ud);
    void *ud;
} local_vote;

static void decide_local(void *arg)
{
    local_vote *v = arg;

    v->g->decision = v->decide(v->ud);
}

int td_group_barrier(td_group *g, int rank, int (*decide)(void *ud), void *ud, int *decision,
                     td_error_t *err)
{
    local_vote v = {g, decide, ud};
    int rc;

    (void)rank;
#ifdef TD_HAVE_MPI
    if (g->mr != NULL)
        return td_mpireduce_barrier(g->mr, decide, ud, decision, err);
#else
    (void)err;
#endif
    rc = td_hostreduce_barrier(&g->hr, decide != NULL ? decide_local : NULL, &v);
    *decision = decide != NULL ? g->decision : 0;
    return rc;
}

void td_group_abort(td_group *g)
{
    __atomic_store_n(&g->stop, 1, __ATOMIC_RELEASE);
    td_hostreduce_abort(&g->hr);
#ifdef TD_HAVE_MPI
    if (g->mr != NULL) {
        td_error_t why;
        td_error_set(&why, TD_EABORTED, "stopped: another process of the job stopped");
        td_mpireduce_abort(g->mr, g->base, &why);
    }
#endif
}

void td_group_fail(td_group *g, int rank, const td_error_t *err)
{
#ifdef TD_HAVE_MPI
    /* the notice first: td_group_abort's generic one is sent only if this is not */
    if (g->mr != NULL)
        td_mpireduce_abort(g->mr, g->base + rank, err);
#else
    (void)rank;
    (void)err;
#endif
    td_group_abort(g);
}

int td_group_notice(td_group *g, int *global_rank, td_error_t *why)
{
#ifdef TD_HAVE_MPI
    if (g->mr != NULL)
        return td_mpireduce_notice(g->mr, global_rank, why);
#else
    (void)g;
    (void)global_rank;
    (void)why;
#endif
    return 0;
}

int td_group_outcomes(td_group *g, const void *mine, size_t len, void *all, double timeout_s,
                      int *missing, td_error_t *err)
{
    *missing = 0;
#ifdef TD_HAVE_MPI
    if (g->mr != NULL)
        return td_mpireduce_outcomes(g->mr, mine, len, all, timeout_s, missing, err);
#else
    (void)timeout_s;
    (void)err;
#endif
    if (all != NULL)
        memcpy(all, mine, len);
    return 0;
}

void td_group_allreduce(td_group *g, int rank, float *buf, size_t n)
{
#ifdef TD_HAVE_CUDA
    /* buf is device memory; NCCL averages it in place. A peer's failure surfaces here as
     * TD_EABORTED (the watchdog saw stop). */
    if (g->kind == TD_DEVICE_CUDA) {
        td_nccl_allreduce_avg(g->nccl[rank], buf, n);
        return;
    }
#endif
#ifdef TD_HAVE_MPI
    if (g->mr != NULL) {
        td_error_t e = {0};
        int rc = td_mpireduce_average(g->mr, rank, buf, n, &e);
        if (rc == -2)
            td_panic(e.code, "%s", e.msg);
        if (rc != 0)
            td_panic(TD_EABORTED, "stopped: another device of the job failed");
        return;
    }
#endif
    if (td_hostreduce_average(&g->hr, rank, buf, n) != 0)
        td_panic(TD_EABORTED, "stopped: another device of the job failed");
}

void td_group_leave(td_group *g, int rank)
{
#ifdef TD_HAVE_CUDA
    /* ncclCommFinalize completes only once every rank finalizes: meet first (after a failure
     * the barrier is aborted and returns at once). */
    if (g->nccl[rank] != NULL) {
        int decision;
        td_error_t e;
        (void)td_group_barrier(g, rank, NULL, NULL, &decision, &e);
        td_nccl_free(g->nccl[rank]);
        g->nccl[rank] = NULL;
    }
#else
    (void)g;
    (void)rank;
#endif
}
