/* The verbs that delete ended jobs: rm (named jobs) and prune (jobs that ended long enough
 * ago). traind marks the jobs at once and deletes their metrics, logs and checkpoints a slice
 * at a time (PROTOCOL.md, "rm", "prune"); these wait for the reply, showing on a terminal how
 * many jobs are left, and print what went and how much the database shrank. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/client.h"

/* ---- the reply ---- */

/* The frames that answer a deletion: progress ones (a line on stderr when it is a terminal)
 * until the deleted reply, into *out. */
static int await_deleted(tc_conn *c, const char *sock, td_proto_frame **out)
{
    int tty = isatty(STDERR_FILENO), shown = 0, rc;
    td_proto_frame *f = NULL;

    *out = NULL;
    for (;;) {
        if ((rc = tc_conn_recv(c, &f, TC_REPLY_TIMEOUT_MS)) != TC_OK)
            break;
        if (f == NULL) {
            rc = tc_err(TC_UNAVAILABLE, "traind at %s went quiet for %d s while deleting", sock,
                        TC_REPLY_TIMEOUT_MS / 1000);
            break;
        }
        if (tc_pv_is(td_pv_get(td_proto_frame_root(f), "type"), "deleted")) {
            *out = f;
            break;
        }
        if (!tc_pv_is(td_pv_get(td_proto_frame_root(f), "type"), "progress")) {
            td_proto_frame_free(f);
            rc = tc_err(TC_PROTOCOL, "traind answered a deletion with a frame of another type");
            break;
        }
        if (tty) {
            fprintf(stderr, "\rdeleting: %lld job(s) to go ",
                    (long long)tc_job_int(td_proto_frame_root(f), "jobs_left", 0));
            shown = 1;
        }
        td_proto_frame_free(f);
    }
    if (shown)
        fprintf(stderr, "\r%40s\r", "");
    return rc;
}

/* One line per job listed: id, state, when it ended, its metric rows and its name. */
static void print_jobs(const td_pval *jobs)
{
    char name[4 * 128 + 1], state[32], when[64];

    printf("%6s  %-9s  %-19s  %11s  %s\n", "ID", "STATE", "ENDED", "METRIC ROWS", "NAME");
    for (size_t i = 0; i < td_pv_len(jobs); i++) {
        const td_pval *j = td_pv_at(jobs, i);
        tc_job_str(j, "name", name, sizeof(name));
        tc_job_str(j, "state", state, sizeof(state));
        tc_fmt_time(when, sizeof(when), tc_job_double(j, "ended", 0));
        printf("%6lld  %-9s  %-19s  %11lld  %s\n", (long long)tc_job_int(j, "id", 0), state, when,
               (long long)tc_job_int(j, "metric_rows", 0), name);
    }
}

/* The deleted reply for a person: the jobs (all of them for a dry run or a few, else the
 * count), then what went and what the database weighs now. */
static void print_deleted(const td_pval *r)
{
    const td_pval *jobs = td_pv_get(r, "jobs");
    int64_t count = tc_job_int(r, "count", 0), rows = tc_job_int(r, "metric_rows", 0);
    char before[32], after[32], spare[32];
    int dry = 0, more = 0, reclaimed = 0;

    td_pv_bool(td_pv_get(r, "dry_run"), &dry);
    td_pv_bool(td_pv_get(r, "more"), &more);
    td_pv_bool(td_pv_get(r, "reclaimed"), &reclaimed);
    tc_fmt_bytes(before, sizeof(before), (double)tc_job_int(r, "db_bytes_before", 0));
    if (count == 0) {
        printf("%s\n", dry ? "no job to prune" : "no job deleted");
        return;
    }
    if (dry || td_pv_len(jobs) <= 20) {
        print_jobs(jobs);
        if (more)
            printf("... and %lld more\n", (long long)(count - (int64_t)td_pv_len(jobs)));
    }
    if (dry) {
        printf("would delete %lld job(s), %lld metric row(s); the store is %s\n", (long long)count,
               (long long)rows, before);
        return;
    }
    tc_fmt_bytes(after, sizeof(after), (double)tc_job_int(r, "db_bytes_after", 0));
    tc_fmt_bytes(spare, sizeof(spare), (double)tc_job_int(r, "free_bytes", 0));
    printf("deleted %lld job(s), %lld metric row(s); the store went from %s to %s\n",
           (long long)count, (long long)rows, before, after);
    if (!reclaimed)
        printf("note: this database predates incremental auto-vacuum; %s stay free inside it "
               "for later writes (traind(8), \"Deleting jobs\", says how to convert it)\n",
               spare);
}

/* Sends the request built in c, waits for its reply and prints it. */
static int run_deletion(const tc_opts *o, tc_conn *c)
{
    td_proto_frame *f = NULL;
    int rc = tc_conn_send(c);

    if (rc == TC_OK)
        rc = await_deleted(c, o->socket, &f);
    if (rc == TC_OK && o->json)
        rc = tc_print_reply_json(td_proto_frame_root(f));
    else if (rc == TC_OK)
        print_deleted(td_proto_frame_root(f));
    td_proto_frame_free(f);
    return rc;
}

/* Connects to a traind that knows rm and prune. */
static int open_deleting(const tc_opts *o, tc_conn **c)
{
    int rc = tc_conn_open(c, o->socket);

    if (rc == TC_OK && !tc_conn_has(*c, "delete"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old for rm and prune", o->socket);
    return rc;
}

/* ---- the verbs ---- */

int tc_rm(const tc_opts *o)
{
    tc_conn *c = NULL;
    td_pw *w;
    int rc;

    if (o->njobs > TC_RM_MAX_JOBS)
        return tc_err(TC_USAGE, "rm takes at most %d jobs at once", TC_RM_MAX_JOBS);
    if ((rc = open_deleting(o, &c)) == TC_OK) {
        w = tc_conn_request(c, "rm", 3);
        td_pw_str(w, "job_ids");
        td_pw_array(w, (uint32_t)o->njobs);
        for (size_t i = 0; i < o->njobs; i++)
            td_pw_int(w, o->jobs[i]);
        rc = run_deletion(o, c);
    }
    tc_conn_close(c);
    return rc;
}

int tc_prune(const tc_opts *o)
{
    tc_conn *c = NULL;
    uint32_t nstates = 0;
    td_pw *w;
    int rc;

    if (o->older_than < 0)
        return tc_err(TC_USAGE, "prune needs --older-than DURATION (30d, 12h, 90m, 1h30m)");
    /* Bits 0 and 1 are queued and running (tc_state_names): never pruned. */
    if (o->states & 3u)
        return tc_err(TC_USAGE, "prune --state takes succeeded, failed or cancelled: a queued "
                                "or running job is never pruned");
    for (int i = 2; i < TC_NSTATES; i++)
        nstates += (o->states >> i) & 1u;
    if ((rc = open_deleting(o, &c)) != TC_OK)
        goto out;
    if (o->selector != NULL && !tc_conn_has(c, "labels")) {
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old to select jobs by labels", o->socket);
        goto out;
    }
    w = tc_conn_request(c, "prune", 3 + (nstates > 0) + (o->dry_run != 0) + (o->selector != NULL));
    td_pw_str(w, "older_than");
    td_pw_double(w, o->older_than);
    if (nstates > 0) {
        td_pw_str(w, "states");
        td_pw_array(w, nstates);
        for (int i = 2; i < TC_NSTATES; i++)
            if ((o->states >> i) & 1u)
                td_pw_str(w, tc_state_names[i]);
    }
    if (o->dry_run) {
        td_pw_str(w, "dry_run");
        td_pw_bool(w, 1);
    }
    if (o->selector != NULL)
        tc_pw_selector(w, o->selector);
    rc = run_deletion(o, c);
out:
    tc_conn_close(c);
    return rc;
}
