/* The server's requests about jobs and the daemon (server_int.h): hello, submit (and its
 * dry run's estimate), cancel and info. Loop thread only: a submit's files are checked on the
 * threadpool (daemon.h, td_submit_begin) while its connection is held. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/memguard.h"
#include "daemon/server/server_int.h"
#include "common/td_log.h"

#define TD_INFO_CLIENTS 256  /* connections an info reply lists */
#define TD_INFO_QUEUED  1000 /* queued job ids an info reply lists */

void td__req_hello(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    static const char *const features[] = {"dry_run",     "list_pages", "logs_pages", "delete",
                                           "safetensors", "classify",   "labels",     "probe"};
    int64_t version = 0;
    td_pw *w;

    if (td_pv_int(td_pv_get(root, "version"), &version) != 0 || version != TD_PROTO_VERSION) {
        char msg[128];
        snprintf(msg, sizeof(msg), "protocol version %lld is not spoken here; traind speaks %d",
                 (long long)version, TD_PROTO_VERSION);
        td_conn_error(c, id, TD_EVERSION, msg);
        td_conn_close(c);
        return;
    }
    td_conn_hello_done(c);
    w = td_conn_reply(c, "hello", id);
    td_pw_str(w, "version");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "server");
    td_pw_str(w, "traind " TD_VERSION);
    /* What this daemon understands beyond version 1's first form, so that a client never
     * sends a flag an older daemon would ignore (a submit's dry_run would queue the job). */
    td_pw_str(w, "features");
    td_pw_array(w, sizeof(features) / sizeof(features[0]));
    for (size_t i = 0; i < sizeof(features) / sizeof(features[0]); i++)
        td_pw_str(w, features[i]);
    td_conn_send(c);
}

/* ---- submit --dry-run ---- */

/* The estimate reply of PROTOCOL.md ("submit", dry run). */
static void send_estimate(td_conn *c, int64_t id, const td_jobspec *spec, int asked_auto,
                          const td_memguard *g, const char *message)
{
    td_pw *w;
    int world = spec->train.world;
    int batch = asked_auto ? (g->chose_batch > 0 ? g->chose_batch : world) : spec->train.batch_size;

    w = td_conn_reply(c, "estimate", id);
    td_pw_str(w, "device");
    td_pw_str(w, g->device);
    td_pw_str(w, "devices");
    td_pw_int(w, world);
    td_pw_str(w, "batch_size");
    td_pw_int(w, batch);
    td_pw_str(w, "batch_auto");
    td_pw_bool(w, asked_auto);
    td_pw_str(w, "memory");
    td_pw_map_open(w);
    td_pw_str(w, "rows");
    td_pw_int(w, g->est.batch);
    td_pw_str(w, "parameters");
    td_pw_int(w, (int64_t)g->est.params);
    td_pw_str(w, "gradients");
    td_pw_int(w, (int64_t)g->est.grads);
    td_pw_str(w, "optimizer");
    td_pw_int(w, (int64_t)g->est.optim);
    td_pw_str(w, "activations");
    td_pw_int(w, (int64_t)g->est.activations);
    td_pw_str(w, "attention");
    td_pw_int(w, (int64_t)g->est.attention);
    td_pw_str(w, "workspace");
    td_pw_int(w, (int64_t)g->est.workspace);
    td_pw_str(w, "total");
    td_pw_int(w, (int64_t)g->est.total);
    td_pw_str(w, "data");
    td_pw_int(w, (int64_t)g->est.data);
    td_pw_map_close(w);
    td_pw_str(w, "free_bytes");
    td_pw_int(w, (int64_t)g->free_bytes);
    td_pw_str(w, "total_bytes");
    td_pw_int(w, (int64_t)g->total_bytes);
    td_pw_str(w, "fits");
    td_pw_bool(w, g->fits);
    td_pw_str(w, "largest_batch");
    td_pw_int(w, g->largest_batch);
    td_pw_str(w, "auto_batch");
    td_pw_int(w, td_memguard_auto_batch(g->largest_batch, world));
    td_pw_str(w, "message");
    td_pw_str(w, message);
    td_conn_send(c);
}

/* A submit or dry run whose job's files are checked on the threadpool (td_submit_begin): its
 * connection is held meanwhile, so that it reads no further request and its replies keep the
 * order of its requests. */
typedef struct submit_req {
    td_conn *c;
    int64_t id;
    int dry_run;
} submit_req;

/* A dry run's answer: the estimate, also when the job does not fit (an answer, not an error),
 * or the error a submit would get. */
static void answer_dry_run(td_conn *c, int64_t id, td_submit *sub)
{
    const td_jobspec *spec = NULL;
    td_error_t err = {0};
    td_memguard g;
    int asked_auto = 0, estimated = 0;
    int rc = td_submit_dry_run_end(sub, &spec, &g, &asked_auto, &estimated, &err);

    if (estimated) {
        send_estimate(c, id, spec, asked_auto, &g, rc == 0 ? NULL : err.msg);
        return;
    }
    td_log_info("client pid %lld uid %lld: dry run refused: %s", (long long)td_conn_pid(c),
                (long long)td_conn_uid(c), err.msg);
    td_conn_error(c, id, err.code, err.msg);
}

static void answer_submit(td_conn *c, int64_t id, td_submit *sub)
{
    td_error_t err = {0};
    int64_t job = 0;
    td_pw *w;

    if (td_submit_end(sub, &job, &err) != 0) {
        td_log_info("client pid %lld uid %lld: job refused: %s", (long long)td_conn_pid(c),
                    (long long)td_conn_uid(c), err.msg);
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    w = td_conn_reply(c, "submitted", id);
    td_pw_str(w, "job_id");
    td_pw_int(w, job);
    td_conn_send(c);
}

/* Back on the loop once the job's files are checked. A client that has gone meanwhile never
 * learns a job id, so its job is not queued (nor its dry run's guard answered). */
static void on_checked(td_submit *sub, void *ud)
{
    submit_req *q = ud;
    td_conn *c = q->c;

    if (td_conn_closing(c))
        td_log_info("client pid %lld uid %lld: gone before its %s was checked; nothing queued",
                    (long long)td_conn_pid(c), (long long)td_conn_uid(c),
                    q->dry_run ? "dry run" : "submit");
    else if (q->dry_run)
        answer_dry_run(c, q->id, sub);
    else
        answer_submit(c, q->id, sub);
    td_submit_free(sub);
    free(q);
    td_conn_release(c); /* may free a closed c */
}

void td__req_submit(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    const td_pval *dry = td_pv_get(root, "dry_run");
    td_error_t err = {0};
    td_submit *sub = NULL;
    submit_req *q;
    int dry_run = 0;

    if (dry != NULL && td_pv_bool(dry, &dry_run) != 0) {
        td_conn_error(c, id, TD_EPROTO, "dry_run: must be true or false");
        return;
    }
    if ((q = malloc(sizeof(*q))) == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    *q = (submit_req){.c = c, .id = id, .dry_run = dry_run};
    if (td_submit_begin(s->d, td_pv_get(root, "job"), td_conn_uid(c), td_conn_gid(c), dry_run,
                        on_checked, q, &sub, &err) != 0) {
        td_log_info("client pid %lld uid %lld: %s refused: %s", (long long)td_conn_pid(c),
                    (long long)td_conn_uid(c), dry_run ? "dry run" : "job", err.msg);
        td_conn_error(c, id, err.code, err.msg);
        free(q);
        return;
    }
    td_conn_hold(c);
}

void td__req_cancel(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    char state[TD_STORE_MAX_STATE];
    td_error_t err;
    td_pw *w;
    int64_t job;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_daemon_cancel(s->d, job, td_conn_uid(c), state, &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    w = td_conn_reply(c, "cancelled", id);
    td_pw_str(w, "job_id");
    td_pw_int(w, job);
    td_pw_str(w, "state");
    td_pw_str(w, state);
    td_conn_send(c);
}

/* Each device with its job and, where it can be read, its memory. */
static void write_devices(td_server *s, td_pw *w)
{
    td_daemon *d = s->d;
    int n = td_daemon_ndevices(d), mem = 0;
    size_t free_b = 0, total_b = 0;

    td_pw_array(w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        td_device_view v;
        td_error_t e;
        td_daemon_device(d, i, &v);
        /* A device whose memory cannot be read is listed without it; cpu devices share the
         * machine's memory, read once for all of them. */
        if (i == 0 || v.kind != TD_DEVICE_CPU)
            mem = td_daemon_device_memory(d, i, &free_b, &total_b, &e) == 0;
        td_pw_map_open(w);
        if (mem) {
            td_pw_str(w, "free_bytes");
            td_pw_int(w, (int64_t)free_b);
            td_pw_str(w, "total_bytes");
            td_pw_int(w, (int64_t)total_b);
        }
        td_pw_str(w, "name");
        td_pw_str(w, v.name);
        td_pw_str(w, "job_id");
        if (v.job != 0)
            td_pw_int(w, v.job);
        else
            td_pw_nil(w);
        td_pw_str(w, "job_name");
        if (v.job_name != NULL)
            td__write_text(w, v.job_name, strlen(v.job_name), 0, 4 * TD_STORE_MAX_NAME);
        else
            td_pw_nil(w);
        td_pw_map_close(w);
    }
}

/* Who is connected, and how much each has not yet read: a stalled watcher shows here. The
 * first TD_INFO_CLIENTS connections (newest first); clients_total counts them all. */
static void write_clients(td_server *s, td_pw *w)
{
    int all = td_conns_count(s->conns);
    uint32_t n = all < TD_INFO_CLIENTS ? (uint32_t)all : TD_INFO_CLIENTS, k = 0;

    td_pw_array(w, n);
    for (td_conn *o = td_conns_first(s->conns); o != NULL && k < n; o = td_conn_next(o), k++) {
        td_pw_map_open(w);
        td_pw_str(w, "pid");
        td_pw_int(w, td_conn_pid(o));
        td_pw_str(w, "uid");
        td_pw_int(w, td_conn_uid(o));
        td_pw_str(w, "pending_bytes");
        td_pw_int(w, (int64_t)td_conn_pending(o));
        td_pw_str(w, "streams");
        td_pw_int(w, td__streams_of(o));
        td_pw_map_close(w);
    }
}

/* The first TD_INFO_QUEUED queued jobs' ids, in the order the scheduler takes them:
 * priority, then submission; queued_total counts them all. */
static void write_queued(td_server *s, td_pw *w)
{
    static int64_t ids[TD_INFO_QUEUED]; /* loop thread only */
    size_t total = td_daemon_queued(s->d, ids, TD_INFO_QUEUED);
    size_t n = total < TD_INFO_QUEUED ? total : TD_INFO_QUEUED;

    td_pw_str(w, "queued");
    td_pw_array(w, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        td_pw_int(w, ids[i]);
    td_pw_str(w, "queued_total");
    td_pw_int(w, (int64_t)total);
}

void td__req_info(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_pw *w = td_conn_reply(c, "info", id);
    struct stat st;

    td_pw_str(w, "version");
    td_pw_str(w, TD_VERSION);
    td_pw_str(w, "protocol");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "store");
    td_pw_map_open(w);
    td_pw_str(w, "path");
    td_pw_str(w, s->cfg.db_path);
    td_pw_str(w, "size_bytes");
    td_pw_int(w, stat(s->cfg.db_path, &st) == 0 ? (int64_t)st.st_size : 0);
    td_pw_str(w, "wal_bytes"); /* a reader holding checkpoints back shows here */
    td_pw_int(w, td_store_wal_bytes(s->store));
    td_pw_map_close(w);
    td_pw_str(w, "devices");
    write_devices(s, w);
    td_pw_str(w, "clients");
    write_clients(s, w);
    td_pw_str(w, "clients_total");
    td_pw_int(w, td_conns_count(s->conns));
    write_queued(s, w);
    td_conn_send(c);
}
