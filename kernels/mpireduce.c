/* The collectives of a job that spans processes (see mpireduce.h). The group's mutex guards the
 * local barrier and the published buffer addresses; it is never held across an MPI wait, so
 * that an abort (which takes it) is never kept waiting by a poll. */
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/mpireduce.h"
#include "common/td_clock.h"

/* ---- the world ---- */

static int world_rank, world_size = 1, world_up;
static char (*node_names)[TD_MPI_NODE_NAME];

/* MPI's message for rc, after what. */
static int mpi_error(td_error_t *err, int rc, const char *what)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;

    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof(msg), "MPI error %d", rc);
    return td_error_set(err, TD_EMPI, "%s: %s", what, msg);
}

/* This process's node name (mpireduce.h, td_mpi_init). */
static void own_node_name(char *out, size_t size)
{
    const char *env = getenv("TRAIND_NODE_NAME");

    if (env == NULL || env[0] == '\0')
        env = getenv("SLURMD_NODENAME");
    if (env != NULL && env[0] != '\0') {
        snprintf(out, size, "%s", env);
        return;
    }
    if (gethostname(out, size) != 0)
        snprintf(out, size, "node%d", world_rank);
    out[size - 1] = '\0';
}

/* Appends "#rank" to every name another process shares. */
static void disambiguate(void)
{
    char(*orig)[TD_MPI_NODE_NAME] = malloc((size_t)world_size * TD_MPI_NODE_NAME);

    if (orig == NULL)
        return;
    memcpy(orig, node_names, (size_t)world_size * TD_MPI_NODE_NAME);
    for (int i = 0; i < world_size; i++)
        for (int j = 0; j < world_size; j++)
            if (j != i && strcmp(orig[i], orig[j]) == 0) {
                char base[TD_MPI_NODE_NAME - 12];
                snprintf(base, sizeof(base), "%s", orig[i]);
                snprintf(node_names[i], TD_MPI_NODE_NAME, "%s#%d", base, i);
                break;
            }
    free(orig);
}

int td_mpi_init(int *argc, char ***argv, td_error_t *err)
{
    char mine[TD_MPI_NODE_NAME] = {0};
    int provided = 0, rc;

    if (world_up)
        return 0;
    rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS)
        return mpi_error(err, rc, "MPI_Init_thread");
    /* Errors come back as codes, to be reported as the job's, never as MPI's abort. */
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (provided < MPI_THREAD_MULTIPLE) {
        MPI_Finalize();
        return td_error_set(err, TD_EINVAL,
                            "this MPI library offers thread level %d, and traind needs "
                            "MPI_THREAD_MULTIPLE (%d)",
                            provided, MPI_THREAD_MULTIPLE);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    if (world_size > TD_MPI_MAX_PROCS) {
        MPI_Finalize();
        return td_error_set(err, TD_EINVAL, "a world of %d processes (at most %d)", world_size,
                            TD_MPI_MAX_PROCS);
    }
    node_names = calloc((size_t)world_size, TD_MPI_NODE_NAME);
    if (node_names == NULL) {
        MPI_Finalize();
        return td_error_set(err, TD_ENOMEM, "out of memory joining the MPI world");
    }
    own_node_name(mine, sizeof(mine));
    rc = MPI_Allgather(mine, TD_MPI_NODE_NAME, MPI_CHAR, node_names, TD_MPI_NODE_NAME, MPI_CHAR,
                       MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS)
        return mpi_error(err, rc, "gathering the node names");
    for (int i = 0; i < world_size; i++)
        node_names[i][TD_MPI_NODE_NAME - 1] = '\0';
    disambiguate();
    world_up = 1;
    return 0;
}

int td_mpi_rank(void)
{
    return world_rank;
}

int td_mpi_size(void)
{
    return world_size;
}

const char *td_mpi_node_name(int proc)
{
    return world_up && proc >= 0 && proc < world_size ? node_names[proc] : "";
}

int td_mpi_bcast(void *p, size_t len, td_error_t *err)
{
    int rc = MPI_Bcast(p, (int)len, MPI_BYTE, 0, MPI_COMM_WORLD);

    return rc == MPI_SUCCESS ? 0 : mpi_error(err, rc, "a broadcast to the world");
}

int td_mpi_allgather(const void *mine, size_t len, void *all, td_error_t *err)
{
    int rc = MPI_Allgather(mine, (int)len, MPI_BYTE, all, (int)len, MPI_BYTE, MPI_COMM_WORLD);

    return rc == MPI_SUCCESS ? 0 : mpi_error(err, rc, "a gather of the world");
}

void td_mpi_finalize(void)
{
    if (!world_up)
        return;
    world_up = 0;
    MPI_Finalize();
    free(node_names);
    node_names = NULL;
}

/* ---- the group ---- */

/* A failure notice: who failed and why, sent to every other process. */
typedef struct notice {
    int32_t rank;
    int32_t code;
    char msg[sizeof(((td_error_t *)0)->msg)];
} notice;

struct td_mpireduce {
    int local, procs, proc, world;
    double timeout_s;
    MPI_Comm coll; /* the barriers' votes and the averages */
    MPI_Comm fail; /* failure notices */
    MPI_Comm out;  /* the outcomes at the end */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t gen;
    atomic_int aborted;
    int result;   /* the leader's outcome of the step, for the others: 0, -1 or -2 */
    int decision; /* the last vote's */
    float *bufs[TD_HOSTREDUCE_MAX];
    float *stage; /* local * n floats: every rank's share of this process's range */
    size_t stage_cap;
    int *counts, *displs, *rcounts, *rdispls; /* per process */
    /* notices: the one receive posted for the first that comes, and whether this process sent
     * its own */
    MPI_Request notice_req;
    notice in;
    atomic_int got_notice;
    atomic_int sent_notice;
    notice sent;               /* this process's, alive until the group is freed */
    pthread_mutex_t notice_mu; /* one thread tests notice_req at a time */
    double average_ms;
};

int td_mpireduce_new(td_mpireduce **out, int local, double timeout_s, td_error_t *err)
{
    td_mpireduce *g;
    int rc;

    *out = NULL;
    if (!world_up)
        return td_error_set(err, TD_EINVAL, "MPI is not initialised in this process");
    if (local < 1 || local > TD_HOSTREDUCE_MAX)
        return td_error_set(err, TD_EINVAL, "%d local ranks (1 to %d)", local, TD_HOSTREDUCE_MAX);
    g = calloc(1, sizeof(*g));
    if (g == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory making an MPI group");
    g->local = local;
    g->procs = world_size;
    g->proc = world_rank;
    g->world = world_size * local;
    g->timeout_s = timeout_s > 0 ? timeout_s : 600;
    g->coll = g->fail = g->out = MPI_COMM_NULL;
    g->notice_req = MPI_REQUEST_NULL;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    pthread_mutex_init(&g->notice_mu, NULL);
    g->counts = calloc((size_t)world_size * 4, sizeof(int));
    if (g->counts == NULL) {
        td_mpireduce_free(g);
        return td_error_set(err, TD_ENOMEM, "out of memory making an MPI group");
    }
    g->displs = g->counts + world_size;
    g->rcounts = g->displs + world_size;
    g->rdispls = g->rcounts + world_size;
    if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &g->coll)) != MPI_SUCCESS ||
        (rc = MPI_Comm_dup(MPI_COMM_WORLD, &g->fail)) != MPI_SUCCESS ||
        (rc = MPI_Comm_dup(MPI_COMM_WORLD, &g->out)) != MPI_SUCCESS) {
        td_mpireduce_free(g);
        return mpi_error(err, rc, "duplicating the world's communicator");
    }
    MPI_Irecv(&g->in, (int)sizeof(g->in), MPI_BYTE, MPI_ANY_SOURCE, 0, g->fail, &g->notice_req);
    *out = g;
    return 0;
}

void td_mpireduce_free(td_mpireduce *g)
{
    if (g == NULL)
        return;
    /* An unmatched receive may be cancelled; a notice nobody sent leaves it pending. */
    if (g->notice_req != MPI_REQUEST_NULL) {
        MPI_Cancel(&g->notice_req);
        MPI_Request_free(&g->notice_req);
    }
    if (g->coll != MPI_COMM_NULL)
        MPI_Comm_free(&g->coll);
    if (g->fail != MPI_COMM_NULL)
        MPI_Comm_free(&g->fail);
    if (g->out != MPI_COMM_NULL)
        MPI_Comm_free(&g->out);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->notice_mu);
    free(g->counts);
    free(g->stage);
    free(g);
}

int td_mpireduce_world(const td_mpireduce *g)
{
    return g->world;
}

int td_mpireduce_base(const td_mpireduce *g)
{
    return g->proc * g->local;
}

double td_mpireduce_average_ms(const td_mpireduce *g)
{
    return g->average_ms;
}

/* Releases this process's waiting ranks (the group's lock taken here). */
static void release_local(td_mpireduce *g)
{
    pthread_mutex_lock(&g->mu);
    atomic_store(&g->aborted, 1);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* Whether another process's notice has come; once it has, the group is aborted here. */
static int poll_notice(td_mpireduce *g)
{
    int got = 0;

    if (atomic_load(&g->got_notice))
        return 1;
    pthread_mutex_lock(&g->notice_mu);
    if (g->notice_req != MPI_REQUEST_NULL &&
        MPI_Test(&g->notice_req, &got, MPI_STATUS_IGNORE) == MPI_SUCCESS && got) {
        g->in.msg[sizeof(g->in.msg) - 1] = '\0';
        atomic_store(&g->got_notice, 1);
    }
    pthread_mutex_unlock(&g->notice_mu);
    if (got)
        release_local(g);
    return atomic_load(&g->got_notice);
}

void td_mpireduce_abort(td_mpireduce *g, int global_rank, const td_error_t *why)
{
    release_local(g);
    if (why == NULL || atomic_exchange(&g->sent_notice, 1))
        return;
    g->sent = (notice){.rank = global_rank, .code = why->code};
    snprintf(g->sent.msg, sizeof(g->sent.msg), "%s", why->msg);
    /* A small message each, never waited for here (a peer may be gone): MPI completes the
     * sends as the process goes on polling, and the buffer lives as long as the group. */
    for (int p = 0; p < g->procs; p++)
        if (p != g->proc) {
            MPI_Request req;
            if (MPI_Isend(&g->sent, (int)sizeof(g->sent), MPI_BYTE, p, 0, g->fail, &req) ==
                MPI_SUCCESS)
                MPI_Request_free(&req);
        }
}

int td_mpireduce_notice(td_mpireduce *g, int *global_rank, td_error_t *why)
{
    if (!poll_notice(g))
        return 0;
    *global_rank = g->in.rank;
    td_error_set(why, g->in.code, "%s", g->in.msg);
    return 1;
}

/* This process's own failure of a collective (err already says why): every other process is
 * told, this one's ranks released; the leader returns -2 with err. */
static int own_failure(td_mpireduce *g, td_error_t *err)
{
    td_mpireduce_abort(g, g->proc * g->local, err);
    return -2;
}

/* MPI's error rc in what, as this process's failure. */
static int mpi_failure(td_mpireduce *g, int rc, const char *what, td_error_t *err)
{
    mpi_error(err, rc, what);
    return own_failure(g, err);
}

/* Polls reqs until all complete, the group aborts, a notice comes, or the timeout: 0, -1
 * (aborted) or -2 (err: the timeout or MPI's error; the group is aborted for everyone). */
static int wait_all(td_mpireduce *g, int n, MPI_Request *reqs, const char *what, td_error_t *err)
{
    double start = td_mono_ms();
    long spins = 0;

    for (;;) {
        int done = 0, rc = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_failure(g, rc, what, err);

        if (done)
            return 0;
        if (atomic_load(&g->aborted) || poll_notice(g))
            return -1;
        if (td_mono_ms() - start > g->timeout_s * 1e3) {
            td_error_set(err, TD_EMPI,
                         "%s did not complete within %g s (nccl_timeout_s): a peer process is "
                         "gone or hung",
                         what, g->timeout_s);
            return own_failure(g, err);
        }
        /* MPI makes progress inside the test: spin briefly, then back off to 50 us so that a
         * process waiting for a slower one leaves the cores to its compute. */
        if (++spins < 2000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

/* The local barrier around a leader's operation: every local rank arrives; the last runs
 * op(g, arg, err) unlocked, and every rank returns its result. */
static int local_step(td_mpireduce *g, int (*op)(td_mpireduce *g, void *arg, td_error_t *err),
                      void *arg, td_error_t *err)
{
    uint64_t gen;
    int rc;

    pthread_mutex_lock(&g->mu);
    if (atomic_load(&g->aborted)) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    gen = g->gen;
    if (++g->arrived == g->local) {
        pthread_mutex_unlock(&g->mu);
        rc = op != NULL ? op(g, arg, err) : 0;
        pthread_mutex_lock(&g->mu);
        g->result = rc;
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return rc;
    }
    while (g->gen == gen && !atomic_load(&g->aborted))
        pthread_cond_wait(&g->cv, &g->mu);
    rc = g->gen != gen ? g->result : -1;
    pthread_mutex_unlock(&g->mu);
    /* The leader's error is its own; the others stop as for an abort. */
    return rc == -2 ? -1 : rc;
}

typedef struct vote_arg {
    int (*decide)(void *ud);
    void *ud;
} vote_arg;

static int vote_op(td_mpireduce *g, void *arg, td_error_t *err)
{
    vote_arg *v = arg;
    int mine = v->decide != NULL ? v->decide(v->ud) : 0, all = 0, rc;
    MPI_Request req;

    rc = MPI_Iallreduce(&mine, &all, 1, MPI_INT, MPI_BOR, g->coll, &req);
    if (rc != MPI_SUCCESS)
        return mpi_failure(g, rc, "the step's vote", err);

    rc = wait_all(g, 1, &req, "the step's vote", err);
    if (rc == 0)
        g->decision = all;
    return rc;
}

int td_mpireduce_barrier(td_mpireduce *g, int (*decide)(void *ud), void *ud, int *decision,
                         td_error_t *err)
{
    vote_arg v = {decide, ud};
    int rc = local_step(g, vote_op, &v, err);

    *decision = g->decision;
    return rc;
}

/* This process's range of n and process p's: [lo(p), lo(p+1)). */
static size_t range_lo(const td_mpireduce *g, size_t n, int p)
{
    return n * (size_t)p * (size_t)g->local / (size_t)g->world;
}

/* Phase 1: each local device's share of every process's range, to that process (arg: n).
 * Sets the ranges (counts, displs) that phase 3 gathers by. */
static int exchange_op(td_mpireduce *g, void *arg, td_error_t *err)
{
    size_t n = *(const size_t *)arg;
    size_t len = range_lo(g, n, g->proc + 1) - range_lo(g, n, g->proc);
    MPI_Request reqs[TD_HOSTREDUCE_MAX];
    double t0 = td_mono_ms();
    int rc;

    /* every local device's share from every process: local * procs * len, which passes
     * local * n when the ranges are uneven */
    size_t need = (size_t)g->local * (size_t)g->procs * len;

    if (need > g->stage_cap) {
        float *s = realloc(g->stage, need * sizeof(float));
        if (s == NULL) {
            td_error_set(err, TD_ENOMEM, "out of memory staging an all-reduce of %zu floats", n);
            return own_failure(g, err);
        }
        g->stage = s;
        g->stage_cap = need;
    }
    for (int p = 0; p < g->procs; p++) {
        g->counts[p] = (int)(range_lo(g, n, p + 1) - range_lo(g, n, p));
        g->displs[p] = (int)range_lo(g, n, p);
        g->rcounts[p] = (int)len;
        g->rdispls[p] = (int)((size_t)p * len);
    }
    for (int l = 0; l < g->local; l++) {
        rc = MPI_Ialltoallv(g->bufs[l], g->counts, g->displs, MPI_FLOAT,
                            g->stage + (size_t)l * (size_t)g->procs * len, g->rcounts, g->rdispls,
                            MPI_FLOAT, g->coll, &reqs[l]);
        if (rc != MPI_SUCCESS)
            return mpi_failure(g, rc, "the all-reduce's exchange", err);
    }
    rc = wait_all(g, g->local, reqs, "the all-reduce's exchange", err);
    g->average_ms += td_mono_ms() - t0;
    return rc;
}

/* Phase 3: every process's range of the mean, from local rank 0's buffer to everyone's, by
 * the ranges phase 1 set. */
static int gather_op(td_mpireduce *g, void *arg, td_error_t *err)
{
    MPI_Request req;
    double t0 = td_mono_ms();
    int rc;

    (void)arg;
    rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, g->bufs[0], g->counts, g->displs,
                         MPI_FLOAT, g->coll, &req);
    if (rc != MPI_SUCCESS)
        return mpi_failure(g, rc, "the all-reduce's gather", err);

    rc = wait_all(g, 1, &req, "the all-reduce's gather", err);
    g->average_ms += td_mono_ms() - t0;
    return rc;
}

int td_mpireduce_average(td_mpireduce *g, int local_rank, float *buf, size_t n, td_error_t *err)
{
    int gr = g->proc * g->local + local_rank, rc;
    size_t base = range_lo(g, n, g->proc);
    size_t len = range_lo(g, n, g->proc + 1) - base;
    size_t lo = n * (size_t)gr / (size_t)g->world, hi = n * (size_t)(gr + 1) / (size_t)g->world;
    float inv = 1.0f / (float)g->world;

    if (n > (size_t)0x7fffffff) {
        td_error_set(err, TD_EINVAL, "an all-reduce of %zu floats (MPI counts are int)", n);
        td_mpireduce_abort(g, gr, err);
        return -2;
    }
    pthread_mutex_lock(&g->mu);
    g->bufs[local_rank] = buf;
    pthread_mutex_unlock(&g->mu);
    if ((rc = local_step(g, exchange_op, &n, err)) != 0)
        return rc;
    /* Phase 2: this rank's slice, summed over the global ranks in order (process q's local
     * rank l is global rank q*local + l), as the host reduce sums. */
    for (size_t i = lo; i < hi; i++) {
        float s = 0;
        for (int q = 0; q < g->procs; q++)
            for (int l = 0; l < g->local; l++)
                s += g->stage[((size_t)l * (size_t)g->procs + (size_t)q) * len + (i - base)];
        g->bufs[0][i] = s * inv;
    }
    if ((rc = local_step(g, gather_op, NULL, err)) != 0)
        return rc;
    if (local_rank != 0)
        memcpy(buf, g->bufs[0], n * sizeof(float));
    /* rank 0's buffer is read until every copy is made */
    return local_step(g, NULL, NULL, err);
}

int td_mpireduce_bcast(td_mpireduce *g, void *p, size_t len, td_error_t *err)
{
    MPI_Request req;
    int rc = MPI_Ibcast(p, (int)len, MPI_BYTE, 0, g->coll, &req);

    if (rc != MPI_SUCCESS)
        return mpi_failure(g, rc, "a broadcast", err);
    return wait_all(g, 1, &req, "a broadcast", err);
}

int td_mpireduce_outcomes(td_mpireduce *g, const void *mine, size_t len, void *all,
                          double timeout_s, int *missing, td_error_t *err)
{
    MPI_Request req;
    double start = td_mono_ms();
    int rc, done = 0;

    *missing = 0;
    if (all != NULL)
        memset(all, 0, (size_t)g->procs * len);
    rc = MPI_Igather(mine, (int)len, MPI_BYTE, all, (int)len, MPI_BYTE, 0, g->out, &req);
    if (rc != MPI_SUCCESS)
        return mpi_error(err, rc, "gathering the outcomes");
    while (!done) {
        rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_error(err, rc, "gathering the outcomes");
        if (!done && td_mono_ms() - start > timeout_s * 1e3) {
            /* Who is missing cannot be told from a gather: the caller sees zeroed parts. */
            *missing = 1;
            return 0;
        }
        if (!done) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
    return 0;
}
