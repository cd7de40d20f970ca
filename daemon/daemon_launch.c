/* The daemon's side of jobs that span nodes (DESIGN.md, "Past one box"; launch.h): what submit
 * checks of them, their dispatch (no device of this box; at most [cluster] max_running at
 * once), what their launch reports (the world's nodes, progress, log lines, the outcome), the
 * restarts after a rank's death (max_restarts, min_nodes), and the nodes and restarts status
 * shows, kept in the store (its jobs.nodes column) so that a restarted daemon goes on counting.
 * Loop thread only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/td_clock.h"
#include "common/td_log.h"
#include "daemon/daemon_int.h"

#define TD_LAUNCH_HISTORY 32 /* restarts status lists, the latest; restarts counts them all */

typedef struct restart_entry {
    double time; /* unix seconds */
    char cause[512];
    int nodes; /* the nodes it resumed on; 0 until its ranks have joined */
} restart_entry;

struct td_djob_cluster {
    char (*names)[TD_LAUNCH_MAX_NODE_NAME]; /* the nodes of its last launch, rank order */
    int nnames;
    int restarts; /* relaunches after a rank's death, all of them */
    restart_entry hist[TD_LAUNCH_HISTORY];
    int nhist;
    int min_nodes, max_nodes; /* the next launch's size */
    char exclude[1024];       /* nodes srun leaves out from now on: where ranks died */
    void *blob;               /* {names, restarts}, as status sends them */
    size_t blob_len;
};

/* ---- the nodes and restarts, as status shows them ---- */

static struct td_djob_cluster *cluster_of(td_djob *job)
{
    if (job->cl == NULL && job->spec.nodes > 1 && (job->cl = calloc(1, sizeof(*job->cl))) != NULL) {
        job->cl->min_nodes = job->cl->max_nodes = job->spec.nodes;
    }
    return job->cl;
}

void td__launch_free(td_djob *job)
{
    if (job->cl == NULL)
        return;
    free(job->cl->names);
    free(job->cl->blob);
    free(job->cl);
    job->cl = NULL;
}

const void *td__launch_nodes_blob(const td_djob *job, size_t *len)
{
    *len = job->cl != NULL ? job->cl->blob_len : 0;
    return job->cl != NULL ? job->cl->blob : NULL;
}

/* Encodes the nodes and restarts into cl->blob. */
static int encode(struct td_djob_cluster *cl)
{
    const void *body;
    size_t len = 0;
    void *copy;
    td_pw w;

    td_pw_init(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "names");
    td_pw_array(&w, (uint32_t)cl->nnames);
    for (int i = 0; i < cl->nnames; i++)
        td_pw_str(&w, cl->names[i]);
    td_pw_str(&w, "restarts");
    td_pw_array(&w, (uint32_t)cl->nhist);
    for (int i = 0; i < cl->nhist; i++) {
        td_pw_map_open(&w);
        td_pw_str(&w, "time");
        td_pw_double(&w, cl->hist[i].time);
        td_pw_str(&w, "cause");
        td_pw_str(&w, cl->hist[i].cause);
        td_pw_str(&w, "nodes");
        td_pw_int(&w, cl->hist[i].nodes);
        td_pw_map_close(&w);
    }
    td_pw_map_close(&w);
    body = td_pw_body(&w, &len);
    copy = body != NULL ? malloc(len) : NULL;
    if (copy != NULL)
        memcpy(copy, body, len);
    td_pw_free(&w);
    if (copy == NULL)
        return TD_ENOMEM;
    free(cl->blob);
    cl->blob = copy;
    cl->blob_len = len;
    return 0;
}

/* Encodes the nodes and restarts and writes them to the store. */
static void save(td_daemon *d, td_djob *job)
{
    td_error_t err;

    if (encode(job->cl) != 0) {
        td_log_warn("job %lld: no memory to record its nodes", (long long)job->id);
        return;
    }
    if (td_writes_nodes(&d->writes, job->id, job->cl->blob, job->cl->blob_len, job->cl->restarts,
                        &err) < 0)
        td_log_warn("job %lld: cannot record its nodes: %s", (long long)job->id, err.msg);
}

/* Sets the node names (n of them); TD_ENOMEM leaves the old ones. */
static int set_names(struct td_djob_cluster *cl, char (*names)[TD_LAUNCH_MAX_NODE_NAME], int n)
{
    char(*copy)[TD_LAUNCH_MAX_NODE_NAME] = calloc(n > 0 ? (size_t)n : 1, sizeof(*copy));

    if (copy == NULL)
        return TD_ENOMEM;
    memcpy(copy, names, (size_t)n * sizeof(*copy));
    free(cl->names);
    cl->names = copy;
    cl->nnames = n;
    return 0;
}

int td__launch_load(td_djob *job, const td_job_row *row)
{
    td_proto_frame *f = NULL;
    const td_pval *names, *hist;
    struct td_djob_cluster *cl;
    td_error_t err;

    if (job->spec.nodes <= 1)
        return 0;
    if ((cl = cluster_of(job)) == NULL)
        return TD_ENOMEM;
    cl->restarts = row->restarts;
    if (row->nodes == NULL || td_proto_decode(row->nodes, row->nodes_len, &f, &err) != 0)
        return 0; /* none yet (or unreadable: status then shows none) */
    names = td_pv_get(td_proto_frame_root(f), "names");
    hist = td_pv_get(td_proto_frame_root(f), "restarts");
    cl->names = calloc(td_pv_len(names) + 1, sizeof(*cl->names));
    for (size_t i = 0; cl->names != NULL && i < td_pv_len(names) && i < TD_JOB_MAX_NODES; i++)
        if (td_pv_strcpy(td_pv_at(names, i), cl->names[cl->nnames], TD_LAUNCH_MAX_NODE_NAME) == 0)
            cl->nnames++;
    for (size_t i = 0; i < td_pv_len(hist) && cl->nhist < TD_LAUNCH_HISTORY; i++) {
        const td_pval *h = td_pv_at(hist, i);
        restart_entry *e = &cl->hist[cl->nhist];
        int64_t nodes = 0;
        td_pv_double(td_pv_get(h, "time"), &e->time);
        td_pv_int(td_pv_get(h, "nodes"), &nodes);
        e->nodes = (int)nodes;
        if (td_pv_strcpy(td_pv_get(h, "cause"), e->cause, sizeof(e->cause)) != 0)
            snprintf(e->cause, sizeof(e->cause), "?");
        cl->nhist++;
    }
    td_proto_frame_free(f);
    /* Out of memory here costs only what status shows until the ranks join again. */
    if (encode(cl) != 0)
        td_log_warn("job %lld: no memory to show its nodes", (long long)job->id);
    return 0;
}

int td__launch_job_dir(const td_daemon *d, const td_djob *job, char *out, size_t size)
{
    return td_launch_job_dir(&d->cfg.cluster, job->id, out, size, NULL);
}

/* ---- submit ---- */

int td__launch_validate(td_daemon *d, td_jobspec *spec, td_error_t *err)
{
    if (!td_world_built())
        return td_error_set(err, TD_EJOB,
                            "nodes: this traind was built without MPI (meson -Dmpi=enabled), so it "
                            "runs jobs of one node only; this job asks for %d",
                            spec->nodes);
    if (d->cfg.cluster.launcher == TD_LAUNCHER_NONE)
        return td_error_set(err, TD_EJOB,
                            "nodes: this daemon has no launcher for a job of %d nodes (traind.conf "
                            "[cluster] launcher = srun or mpirun)",
                            spec->nodes);
    if (spec->batch_auto)
        return td_error_set(err, TD_EJOB,
                            "batch_size: \"auto\" is chosen on this box's devices; a job of %d "
                            "nodes names its batch",
                            spec->nodes);
    return 0;
}

/* ---- dispatch ---- */

static td_djob *find_launched(td_daemon *d, const td_launch *l)
{
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->launch == l && l != NULL)
            return j;
    return NULL;
}

static void on_world(void *ud, td_launch *l, const td_launch_world *w);
static void on_started(void *ud, td_launch *l, int64_t step, int64_t total);
static void on_progress(void *ud, td_launch *l, int64_t step);
static void on_log(void *ud, td_launch *l, int level, const char *line);
static void on_store_failed(void *ud, td_launch *l, const td_error_t *err);
static void on_done(void *ud, td_launch *l, const td_launch_outcome *o);

/* Launches job on cl's size. Returns 0, or an error (logged) that leaves it unlaunched. */
static int launch(td_daemon *d, td_djob *job, td_error_t *err)
{
    struct td_djob_cluster *cl = cluster_of(job);
    td_job_row row = {0};
    td_launch_args a = {.job = job->id,
                        .spec = &job->spec,
                        .cluster = &d->cfg.cluster,
                        .mq = d->mq,
                        .cbs = {.ud = d,
                                .world = on_world,
                                .started = on_started,
                                .progress = on_progress,
                                .log = on_log,
                                .store_failed = on_store_failed,
                                .done = on_done}};
    int rc;

    if (cl == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory launching job %lld", (long long)job->id);
    rc = td_store_job_get(d->store, job->id, &row, err);
    if (rc == 0 && row.spec == NULL)
        rc = td_error_set(err, TD_EJOB, "the store holds no spec for job %lld", (long long)job->id);
    if (rc == 0) {
        a.spec_bytes = row.spec;
        a.spec_len = row.spec_len;
        a.nodes = cl->max_nodes;
        a.min_nodes = cl->min_nodes;
        a.exclude = cl->exclude;
        rc = td_launch_start(&job->launch, d->loop, &a, err);
    }
    td_job_row_clear(&row);
    return rc;
}

/* The next queued job that spans nodes: highest priority first, then oldest. */
static td_djob *next_launch(const td_daemon *d)
{
    td_djob *best = NULL;

    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->spec.nodes > 1 && j->run == NULL && j->launch == NULL &&
            strcmp(j->state, TD_JOB_QUEUED) == 0 &&
            (best == NULL || j->spec.priority > best->spec.priority))
            best = j;
    return best;
}

static int launched(const td_daemon *d)
{
    int n = 0;

    for (const td_djob *j = d->jobs; j != NULL; j = j->next)
        n += j->launch != NULL;
    return n;
}

void td__launch_reason(const td_daemon *d, const td_djob *job, char *out, size_t size)
{
    const td_djob *next = next_launch(d);

    if (d->cfg.cluster.max_running > 0 && launched(d) >= d->cfg.cluster.max_running)
        snprintf(out, size, "cluster limit ([cluster] max_running %d)", d->cfg.cluster.max_running);
    else if (next != NULL && next != job)
        snprintf(out, size, "priority (behind job %lld)", (long long)next->id);
    else
        snprintf(out, size, "launching");
}

/* Launches queued jobs that span nodes, up to [cluster] max_running at once; none holds a
 * device of this box, so they wait for nothing here (Slurm queues them itself). A job whose
 * launch cannot start (out of memory) stays queued until the next turn. */
void td__launch_schedule(td_daemon *d)
{
    int cap = d->cfg.cluster.max_running;
    td_djob *job;
    td_error_t err;

    while (!d->stopping && (cap == 0 || launched(d) < cap) && (job = next_launch(d)) != NULL) {
        if (launch(d, job, &err) != 0) {
            td_log_err("job %lld: %s; it stays queued", (long long)job->id, err.msg);
            return;
        }
        snprintf(job->state, sizeof(job->state), TD_JOB_RUNNING);
        job->device_list[0] = '\0';
        if (td_writes_state(&d->writes, job->id, TD_JOB_RUNNING, "", 0, NULL, &err) < 0)
            td_log_err("job %lld: cannot record state running: %s", (long long)job->id, err.msg);
        td_log_notice("job %lld (%s, uid %lld): launched on %d%s%.0d node(s) by %s",
                      (long long)job->id, job->spec.name, (long long)job->uid, job->cl->min_nodes,
                      job->cl->min_nodes < job->cl->max_nodes ? " to " : "",
                      job->cl->min_nodes < job->cl->max_nodes ? job->cl->max_nodes : 0,
                      d->cfg.cluster.launcher == TD_LAUNCHER_SRUN ? "srun" : "mpirun");
        td__daemon_job_changed(d, job->id, TD_JOB_RUNNING);
    }
}

/* ---- what the launch says ---- */

/* "n1,n2": the names joined, cut to fit size with "+K" for the K left out. */
static void join_names(char *out, size_t size, char (*names)[TD_LAUNCH_MAX_NODE_NAME], int n)
{
    size_t len = 0;

    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        size_t need = strlen(names[i]) + (i ? 1 : 0);
        if (len + need + 8 >= size && i + 1 < n) {
            snprintf(out + len, size - len, "%s+%d", i ? "," : "", n - i);
            return;
        }
        if (len + need >= size)
            return;
        len += (size_t)snprintf(out + len, size - len, "%s%s", i ? "," : "", names[i]);
    }
}

static void on_world(void *ud, td_launch *l, const td_launch_world *w)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);
    struct td_djob_cluster *cl = job != NULL ? job->cl : NULL;
    char line[1200];

    if (cl == NULL)
        return;
    if (set_names(cl, w->names, w->nodes) != 0)
        td_log_warn("job %lld: no memory to keep its node names", (long long)job->id);
    if (cl->nhist > 0 && cl->hist[cl->nhist - 1].nodes == 0)
        cl->hist[cl->nhist - 1].nodes = w->nodes;
    join_names(job->device_list, sizeof(job->device_list), w->names, w->nodes);
    save(d, job);
    td__daemon_store_state(d, job, TD_JOB_RUNNING, job->device_list, NULL);
    join_names(line, 900, w->names, w->nodes);
    td_log_notice("job %lld (%s, uid %lld): running on %d node(s), %d %s device(s) each: %s",
                  (long long)job->id, job->spec.name, (long long)job->uid, w->nodes,
                  w->devices_per_node, w->device_kind, line);
    td__daemon_job_changed(d, job->id, TD_JOB_RUNNING);
}

static void on_started(void *ud, td_launch *l, int64_t step, int64_t total)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);

    if (job == NULL)
        return;
    job->total_steps = total;
    job->step = step;
    td__daemon_write_progress(d, job);
    if (step > 0) {
        char line[128];
        snprintf(line, sizeof(line), "resumed from its checkpoint at step %lld", (long long)step);
        td__daemon_job_log(d, job->id, TD_LOG_NOTICE, line);
        td_log_notice("job %lld (%s): %s", (long long)job->id, job->spec.name, line);
    }
    td__daemon_job_changed(d, job->id, job->state);
}

static void on_progress(void *ud, td_launch *l, int64_t step)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);

    if (job == NULL)
        return;
    job->step = step;
    if (td_mono_ms() - job->progress_written >= TD_PROGRESS_WRITE_MS)
        td__daemon_write_progress(d, job);
}

static void on_log(void *ud, td_launch *l, int level, const char *line)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);

    if (job != NULL)
        td__daemon_job_log(d, job->id, level, line);
}

static void on_store_failed(void *ud, td_launch *l, const td_error_t *err)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);

    if (job != NULL)
        td__daemon_store_failed(d, job, err);
}

/* The failed devices of a done frame as the store keeps them for status: {device, code,
 * message, node, node_name}, in the order rank 0 gave ((node, device) order). */
static void store_failed_devices(td_daemon *d, int64_t job, const td_launch_outcome *o)
{
    td_pw w;

    if (o->nfailed == 0)
        return;
    td_pw_init(&w);
    td_pw_array(&w, (uint32_t)o->nfailed);
    for (size_t i = 0; i < o->nfailed; i++) {
        const td_launch_failed *f = &o->failed[i];
        td_pw_map_open(&w);
        td_pw_str(&w, "device");
        td_pw_int(&w, f->device);
        td_pw_str(&w, "code");
        td_pw_int(&w, f->code);
        td_pw_str(&w, "message");
        td_pw_str(&w, f->message);
        td_pw_str(&w, "node");
        td_pw_int(&w, f->node);
        td_pw_str(&w, "node_name");
        td_pw_str(&w, f->node_name);
        td_pw_map_close(&w);
    }
    td__daemon_store_err_devices(d, job, &w);
}

/* Adds node to the nodes srun leaves out of the job's later launches. */
static void exclude(struct td_djob_cluster *cl, const char *node)
{
    size_t len = strlen(cl->exclude);

    if (node[0] == '\0' || len + strlen(node) + 2 >= sizeof(cl->exclude))
        return;
    snprintf(cl->exclude + len, sizeof(cl->exclude) - len, "%s%s", len ? "," : "", node);
}

/* A rank died and the job may restart (max_restarts): it is launched again from its last
 * checkpoint, on as many nodes as are free, at least min_nodes. srun picks them (-N min-max)
 * and leaves out the nodes where ranks died; mpirun, which cannot leave a host out, runs one
 * process fewer. Returns 0 once relaunched, or the error that ends the job. */
static int restart(td_daemon *d, td_djob *job, const td_launch_outcome *o, td_error_t *err)
{
    struct td_djob_cluster *cl = job->cl;
    restart_entry *e;
    int before = cl->nnames > 0 ? cl->nnames : cl->max_nodes;
    char line[1400];

    cl->restarts++;
    if (cl->nhist == TD_LAUNCH_HISTORY) {
        memmove(cl->hist, cl->hist + 1, sizeof(cl->hist) - sizeof(cl->hist[0]));
        cl->nhist--;
    }
    e = &cl->hist[cl->nhist++];
    e->time = td_wall_s();
    e->nodes = 0;
    snprintf(e->cause, sizeof(e->cause), "%.*s", (int)sizeof(e->cause) - 1, o->err.msg);
    cl->min_nodes = job->spec.min_nodes;
    if (d->cfg.cluster.launcher == TD_LAUNCHER_SRUN) {
        exclude(cl, o->dead_node);
        cl->max_nodes = job->spec.nodes;
    } else {
        cl->max_nodes = before - 1 > job->spec.min_nodes ? before - 1 : job->spec.min_nodes;
        cl->min_nodes = cl->max_nodes;
    }
    job->device_list[0] = '\0';
    save(d, job);
    if (cl->min_nodes < cl->max_nodes)
        snprintf(line, sizeof(line),
                 "restart %d of %d at step %lld after %s; relaunched from its last checkpoint on "
                 "%d to %d nodes%s%s",
                 cl->restarts, job->spec.max_restarts, (long long)job->step, o->err.msg,
                 cl->min_nodes, cl->max_nodes, cl->exclude[0] ? ", leaving out " : "", cl->exclude);
    else
        snprintf(line, sizeof(line),
                 "restart %d of %d at step %lld after %s; relaunched from its last checkpoint on "
                 "%d node(s)%s%s",
                 cl->restarts, job->spec.max_restarts, (long long)job->step, o->err.msg,
                 cl->max_nodes, cl->exclude[0] ? ", leaving out " : "", cl->exclude);
    td__daemon_job_log(d, job->id, TD_LOG_WARNING, line);
    td_log_warn("job %lld (%s, uid %lld): %s", (long long)job->id, job->spec.name,
                (long long)job->uid, line);
    return launch(d, job, err);
}

static void on_done(void *ud, td_launch *l, const td_launch_outcome *o)
{
    td_daemon *d = ud;
    td_djob *job = find_launched(d, l);
    char state[TD_STORE_MAX_STATE];
    td_error_t err = o->err, why;
    int64_t id;
    int later = 0;

    td_launch_close(l); /* o stays readable until this callback returns */
    if (job == NULL)
        return;
    id = job->id;
    job->launch = NULL;
    job->step = o->step > job->step ? o->step : job->step;
    td__daemon_write_progress(d, job);
    snprintf(state, sizeof(state), "%s", o->state);
    td_mailbox_wake(&d->mailbox); /* the next launch, or the end of a stop */
    if (job->metrics_err.code != 0 && strcmp(state, TD_JOB_FAILED) != 0) {
        snprintf(state, sizeof(state), TD_JOB_FAILED);
        td_error_set(&err, job->metrics_err.code, "metrics could not be stored: %s",
                     job->metrics_err.msg);
    } else if (o->rank_died && !d->stopping && job->cl->restarts < job->spec.max_restarts &&
               job->metrics_err.code == 0) {
        if (restart(d, job, o, &why) == 0)
            return;
        td_error_set(&err, why.code, "%s; the restart could not be launched: %s", o->err.msg,
                     why.msg);
    }
    if (strcmp(state, TD_JOB_QUEUED) == 0) {
        /* Interrupted by a shutdown: it resumes from its checkpoint at the next start. */
        snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
        job->device_list[0] = '\0';
        td__daemon_store_state(d, job, TD_JOB_QUEUED, "", NULL);
        td_log_notice("job %lld (%s): interrupted at step %lld, requeued", (long long)job->id,
                      job->spec.name, (long long)job->step);
        td__daemon_job_changed(d, job->id, TD_JOB_QUEUED);
        return;
    }
    later = td__daemon_store_state(d, job, state, NULL, &err);
    if (strcmp(state, TD_JOB_FAILED) == 0)
        store_failed_devices(d, job->id, o);
    if (err.code != 0 && strcmp(state, TD_JOB_CANCELLED) != 0) {
        char line[1200];
        td__daemon_outcome_line(line, sizeof(line), state, job->step, err.msg);
        td_log_warn("job %lld (%s, uid %lld): %s", (long long)job->id, job->spec.name,
                    (long long)job->uid, line);
    } else
        td_log_notice("job %lld (%s, uid %lld): %s at step %lld", (long long)job->id,
                      job->spec.name, (long long)job->uid, state, (long long)job->step);
    td__daemon_job_unlink(d, job);
    td__daemon_job_forget(d, job, state, &err, later);
    td__daemon_job_changed(d, id, state);
}
