/* Integration tests of deleting ended jobs (PROTOCOL.md, "rm", "prune"): a real traind, jobs
 * that ran and checkpointed, then rm and prune through the protocol and through trainctl.
 * What is checked: all or none (a running job, a missing one, another user's), the reply's
 * listing and sizes, every row of the jobs gone from the database and their checkpoint
 * directories from the disk, owners (root's prune touches everyone's jobs, a user's only
 * theirs), dry runs, ids never given twice, the sweep of orphaned checkpoint directories, and
 * a deletion a stop interrupted going on at the next start. */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "tests/jobs_support.h"
#include "tests/support.h"

#define EPERM_CODE     (-4215)
#define ESTATE_CODE    (-4216)
#define EPROTO_CODE    (-4203)
#define ENOTFOUND_CODE (-4205)

/* ---- helpers ---- */

/* One integer from a query on the daemon's database, read with a connection of our own (it
 * sees what traind hides: rows of jobs being deleted). */
static int64_t db_int(const ts_daemon *d, const char *sql)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t v = -1;

    assert_int_equal(sqlite3_open(d->db, &db), SQLITE_OK);
    sqlite3_busy_timeout(db, 10000);
    assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
}

/* Every row the database holds of job, in any table. */
static int64_t rows_of(const ts_daemon *d, int64_t job)
{
    char sql[512];

    snprintf(sql, sizeof(sql),
             "SELECT (SELECT count(*) FROM jobs WHERE id = %1$lld) + (SELECT count(*) FROM "
             "metrics WHERE job = %1$lld) + (SELECT count(*) FROM metric_summary WHERE job = "
             "%1$lld) + (SELECT count(*) FROM job_logs WHERE job = %1$lld)",
             (long long)job);
    return db_int(d, sql);
}

static int64_t metric_rows(const ts_daemon *d, int64_t job)
{
    char sql[128];

    snprintf(sql, sizeof(sql), "SELECT count(*) FROM metrics WHERE job = %lld", (long long)job);
    return db_int(d, sql);
}

static int ckpt_dir_exists(const ts_daemon *d, const char *name)
{
    char path[400];
    struct stat st;

    snprintf(path, sizeof(path), "%s/checkpoints/%s", d->dir, name);
    return stat(path, &st) == 0;
}

static int job_dir_exists(const ts_daemon *d, int64_t job)
{
    char name[32];

    snprintf(name, sizeof(name), "%lld", (long long)job);
    return ckpt_dir_exists(d, name);
}

/* A short job that checkpoints, run to its end. */
static int64_t finished_job(ts_client *c, const char *name)
{
    tj_extra x = {.checkpoint_every = 5};
    int64_t id = tj_submit_ex(c, name, 16, 20, &x, NULL, 0);

    assert_true(id > 0);
    ts_wait_state(c, id, "succeeded", 120);
    return id;
}

/* The error frame answering the last request: its code, and its message into msg. */
static int recv_error(ts_client *c, char *msg, size_t size)
{
    td_proto_frame *f = ts_client_recv(c);
    int64_t code;

    assert_non_null(f);
    if (!ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "error"))
        fail_msg("expected an error frame");
    code = ts_get_i(td_proto_frame_root(f), "code");
    ts_get_s(td_proto_frame_root(f), "message", msg, size);
    td_proto_frame_free(f);
    return (int)code;
}

/* Sends rm for ids[0..n). */
static void send_rm(ts_client *c, const int64_t *ids, size_t n)
{
    ts_begin(c, "rm", 1);
    td_pw_str(&c->w, "job_ids");
    td_pw_array(&c->w, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        td_pw_int(&c->w, ids[i]);
    ts_client_send(c);
}

/* Sends prune: older_than seconds, states (NULL: none given), dry_run. */
static void send_prune(ts_client *c, double older_than, const char *states, int dry_run)
{
    ts_begin(c, "prune", 1 + (states != NULL) + (dry_run != 0));
    td_pw_str(&c->w, "older_than");
    td_pw_double(&c->w, older_than);
    if (states != NULL) {
        td_pw_str(&c->w, "states");
        td_pw_array(&c->w, 1);
        td_pw_str(&c->w, states);
    }
    if (dry_run) {
        td_pw_str(&c->w, "dry_run");
        td_pw_bool(&c->w, 1);
    }
    ts_client_send(c);
}

/* The deleted reply (after any progress frames); caller frees. Fails on anything else. */
static td_proto_frame *recv_deleted(ts_client *c)
{
    for (;;) {
        td_proto_frame *f = ts_client_recv(c);
        const td_pval *root;
        assert_non_null(f);
        root = td_proto_frame_root(f);
        if (ts_str_is(td_pv_get(root, "type"), "deleted"))
            return f;
        if (!ts_str_is(td_pv_get(root, "type"), "progress")) {
            char msg[1024] = "";
            td_pv_strcpy(td_pv_get(root, "message"), msg, sizeof(msg));
            fail_msg("expected progress or deleted, got another frame: %s", msg);
        }
        assert_true(ts_get_i(root, "jobs_left") >= 0);
        td_proto_frame_free(f);
    }
}

/* Whether the deleted reply f lists job. */
static int lists(const td_proto_frame *f, int64_t job)
{
    const td_pval *jobs = td_pv_get(td_proto_frame_root(f), "jobs");

    for (size_t i = 0; i < td_pv_len(jobs); i++)
        if (ts_get_i(td_pv_at(jobs, i), "id") == job)
            return 1;
    return 0;
}

/* status of job: 0 when it exists, else the error's code. */
static int status_code(ts_client *c, int64_t job)
{
    const td_pval *j;
    td_proto_frame *f = ts_status(c, job, &j);
    int code = 0;

    if (ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "error"))
        code = (int)ts_get_i(td_proto_frame_root(f), "code");
    td_proto_frame_free(f);
    return code;
}

/* A connection made by a child running as uid/gid and handed back over a socket pair, so the
 * daemon sees that uid (SO_PEERCRED is the connecting process's). -1 when it could not. */
static int connect_as(const char *sock, uid_t uid, gid_t gid)
{
    char byte = 0, cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf};
    int sv[2], fd = -1, status;
    pid_t pid;

    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        struct cmsghdr *cm;
        int s;
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(2);
        if (strlen(sock) >= sizeof(sa.sun_path))
            _exit(5);
        memcpy(sa.sun_path, sock, strlen(sock) + 1);
        s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) != 0)
            _exit(3);
        mh.msg_controllen = sizeof(cbuf);
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &s, sizeof(int));
        _exit(sendmsg(sv[1], &mh, 0) == 1 ? 0 : 4);
    }
    close(sv[1]);
    mh.msg_controllen = sizeof(cbuf);
    if (recvmsg(sv[0], &mh, 0) == 1) {
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        if (cm != NULL && cm->cmsg_type == SCM_RIGHTS)
            memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    }
    close(sv[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return fd;
}

/* A hello'd client on a connection of nobody's. Skips the test where there is no nobody. */
static void connect_nobody(ts_client *c, const ts_daemon *d)
{
    struct passwd *pw = getpwnam("nobody");
    td_proto_frame *f;
    int fd;

    if (pw == NULL)
        skip();
    assert_int_equal(chmod(d->dir, 0711), 0);
    assert_int_equal(chmod(d->sock, 0666), 0);
    fd = connect_as(d->sock, pw->pw_uid, pw->pw_gid);
    assert_true(fd >= 0);
    memset(c, 0, sizeof(*c));
    c->fd = fd;
    assert_int_equal(td_proto_reader_new(&c->r, 0), 0);
    td_pw_init(&c->w);
    c->next_id = 1;
    ts_begin(c, "hello", 1);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "hello"));
    td_proto_frame_free(f);
}

/* Runs trainctl with args against d; its stdout into out; returns its exit status. */
static int trainctl(const ts_daemon *d, char *out, size_t size, const char *args)
{
    char cmd[1024];
    FILE *p;
    size_t n;
    int status;

    snprintf(cmd, sizeof(cmd), "%s --socket %s %s 2>&1",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), d->sock, args);
    p = popen(cmd, "r");
    assert_non_null(p);
    n = fread(out, 1, size - 1, p);
    out[n] = '\0';
    status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ---- rm ---- */

static void test_rm(void **state)
{
    ts_daemon d;
    ts_client c;
    td_proto_frame *f;
    const td_pval *r;
    char msg[1024], want[256];
    int64_t a, b, keep, run, ids[3], rows_ab;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    a = finished_job(&c, "a");
    b = finished_job(&c, "b");
    keep = finished_job(&c, "keep");
    assert_true(job_dir_exists(&d, a) && job_dir_exists(&d, b) && job_dir_exists(&d, keep));
    run = tj_submit(&c, "running", 64, 1000000, NULL, 0);
    ts_wait_state(&c, run, "running", 60);

    /* All or none: a running job and a missing one are both named, nothing goes. */
    ids[0] = a;
    ids[1] = run;
    ids[2] = 999;
    send_rm(&c, ids, 3);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), ESTATE_CODE);
    snprintf(want, sizeof(want), "job %lld is running; cancel it first; no job 999",
             (long long)run);
    assert_string_equal(msg, want);
    assert_int_equal(status_code(&c, a), 0);
    send_rm(&c, ids, 0);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);

    /* a and b go: the reply lists them, with their rows; the database keeps none of it. */
    rows_ab = metric_rows(&d, a) + metric_rows(&d, b);
    assert_true(rows_ab > 0);
    ids[1] = b;
    send_rm(&c, ids, 2);
    f = recv_deleted(&c);
    r = td_proto_frame_root(f);
    assert_int_equal(ts_get_i(r, "count"), 2);
    assert_int_equal(ts_get_i(r, "metric_rows"), rows_ab);
    assert_true(lists(f, a) && lists(f, b) && !lists(f, keep));
    assert_true(ts_get_i(r, "db_bytes_before") > 0);
    assert_true(ts_get_i(r, "db_bytes_after") > 0);
    assert_true(ts_get_i(r, "db_bytes_after") <= ts_get_i(r, "db_bytes_before"));
    td_proto_frame_free(f);
    assert_int_equal(status_code(&c, a), ENOTFOUND_CODE);
    assert_int_equal(status_code(&c, b), ENOTFOUND_CODE);
    assert_int_equal(rows_of(&d, a) + rows_of(&d, b), 0);
    assert_false(job_dir_exists(&d, a) || job_dir_exists(&d, b));
    assert_true(job_dir_exists(&d, keep));
    assert_true(rows_of(&d, keep) > 0);
    assert_int_equal(db_int(&d, "SELECT count(*) FROM jobs_deleting"), 0);
    assert_int_equal(db_int(&d, "PRAGMA freelist_count"), 0); /* the space went back */

    /* Someone else's job is theirs to delete. */
    {
        ts_client other;
        connect_nobody(&other, &d);
        send_rm(&other, &keep, 1);
        assert_int_equal(recv_error(&other, msg, sizeof(msg)), EPERM_CODE);
        snprintf(want, sizeof(want), "permission denied: job %lld belongs to root",
                 (long long)keep);
        assert_string_equal(msg, want);
        ts_client_close(&other);
    }
    assert_int_equal(status_code(&c, keep), 0);

    /* The running job once cancelled; its id is never given again. */
    ts_send_job_request(&c, "cancel", run);
    td_proto_frame_free(ts_client_recv(&c));
    ts_wait_state(&c, run, "cancelled", 60);
    send_rm(&c, &run, 1);
    td_proto_frame_free(recv_deleted(&c));
    assert_int_equal(tj_submit(&c, "next", 16, 1, NULL, 0), run + 1);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- prune ---- */

static void test_prune(void **state)
{
    ts_daemon d;
    ts_client c, other;
    td_proto_frame *f;
    char msg[1024], path[400];
    int64_t done1, done2, cancelled, theirs;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    done1 = finished_job(&c, "done 1");
    done2 = finished_job(&c, "done 2");
    cancelled = tj_submit(&c, "cancelled", 64, 1000000, NULL, 0);
    ts_wait_state(&c, cancelled, "running", 60);
    ts_send_job_request(&c, "cancel", cancelled);
    td_proto_frame_free(ts_client_recv(&c));
    ts_wait_state(&c, cancelled, "cancelled", 60);
    connect_nobody(&other, &d);
    theirs = tj_submit(&other, "nobody's", 16, 20, NULL, 0);
    assert_true(theirs > 0);
    ts_wait_state(&c, theirs, "succeeded", 120);

    /* Bad requests. */
    ts_begin(&c, "prune", 0);
    ts_client_send(&c);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);
    assert_string_equal(msg, "older_than: must be a number of seconds, >= 0");
    send_prune(&c, 0, "running", 0);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);

    /* Nothing is that old, but the checkpoints are swept all the same (the sweep follows the
     * reply); a dry run lists and deletes nothing. */
    snprintf(path, sizeof(path), "%s/checkpoints/88888", d.dir);
    assert_int_equal(mkdir(path, 0700), 0);
    send_prune(&c, 3600, NULL, 0);
    f = recv_deleted(&c);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "count"), 0);
    td_proto_frame_free(f);
    for (int i = 0; i < 3000 && ckpt_dir_exists(&d, "88888"); i++) /* 60 s */
        usleep(20 * 1000);
    assert_false(ckpt_dir_exists(&d, "88888"));
    send_prune(&c, 0, "cancelled", 1);
    f = recv_deleted(&c);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "count"), 1);
    assert_true(lists(f, cancelled));
    assert_null(td_pv_get(td_proto_frame_root(f), "db_bytes_after"));
    td_proto_frame_free(f);
    assert_int_equal(status_code(&c, cancelled), 0);

    /* A user's prune touches only their own jobs. */
    send_prune(&other, 0, NULL, 0);
    f = recv_deleted(&other);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "count"), 1);
    assert_true(lists(f, theirs));
    td_proto_frame_free(f);
    assert_int_equal(rows_of(&d, theirs), 0);
    assert_int_equal(status_code(&c, done1), 0);
    ts_client_close(&other);

    /* By state; and the sweep takes checkpoint directories of jobs that do not exist, and
     * leaves what is not a job's. */
    snprintf(path, sizeof(path), "%s/checkpoints/99999", d.dir);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof(path), "%s/checkpoints/99999/ckpt-5.bin", d.dir);
    fclose(fopen(path, "w"));
    snprintf(path, sizeof(path), "%s/checkpoints/keep-me", d.dir);
    assert_int_equal(mkdir(path, 0700), 0);
    send_prune(&c, 0, "cancelled", 0);
    f = recv_deleted(&c);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "count"), 1);
    assert_true(lists(f, cancelled));
    td_proto_frame_free(f);
    assert_int_equal(rows_of(&d, cancelled), 0);
    assert_false(ckpt_dir_exists(&d, "99999"));
    assert_true(ckpt_dir_exists(&d, "keep-me"));
    assert_int_equal(status_code(&c, done1), 0);

    /* root's prune of everything left. */
    send_prune(&c, 0, NULL, 0);
    f = recv_deleted(&c);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "count"), 2);
    assert_true(lists(f, done1) && lists(f, done2));
    td_proto_frame_free(f);
    assert_int_equal(db_int(&d, "SELECT count(*) FROM jobs"), 0);
    assert_int_equal(db_int(&d, "SELECT count(*) FROM metrics"), 0);
    assert_int_equal(db_int(&d, "SELECT count(*) FROM job_logs"), 0);
    assert_false(job_dir_exists(&d, done1) || job_dir_exists(&d, done2));
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A deletion a stop interrupted (the jobs marked, their rows still there) goes on at the next
 * start; the job stays hidden meanwhile. */
static void test_deletion_resumes(void **state)
{
    ts_daemon d;
    ts_client c;
    char sql[128], *errmsg = NULL;
    sqlite3 *db = NULL;
    int64_t gone, kept;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    gone = finished_job(&c, "gone");
    kept = finished_job(&c, "kept");
    ts_client_close(&c);
    ts_daemon_kill9(&d);
    assert_int_equal(sqlite3_open(d.db, &db), SQLITE_OK);
    snprintf(sql, sizeof(sql), "INSERT INTO jobs_deleting (id) VALUES (%lld)", (long long)gone);
    if (sqlite3_exec(db, sql, NULL, NULL, &errmsg) != SQLITE_OK)
        fail_msg("%s", errmsg);
    sqlite3_close(db);
    assert_true(rows_of(&d, gone) > 0);
    ts_daemon_start_in(&d, "cpu:1");
    ts_wait_log(&d, "deleting 1 job(s) whose deletion was under way", 1, 60);
    ts_wait_log(&d, "deleted 1 job(s)", 1, 60);
    assert_int_equal(rows_of(&d, gone), 0);
    assert_false(job_dir_exists(&d, gone));
    assert_true(rows_of(&d, kept) > 0);
    assert_true(job_dir_exists(&d, kept));
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- trainctl ---- */

static void test_trainctl_verbs(void **state)
{
    ts_daemon d;
    ts_client c;
    char out[16384], args[128];
    int64_t a, b;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    a = finished_job(&c, "first");
    b = finished_job(&c, "second");
    ts_client_close(&c);
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune"), 64);
    assert_non_null(strstr(out, "prune needs --older-than"));
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune --older-than 3 --dry-run"), 64);
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune --older-than 1h --state running"), 64);
    assert_int_equal(trainctl(&d, out, sizeof(out), "rm"), 64);
    assert_int_equal(trainctl(&d, out, sizeof(out), "rm 424242"), 1);
    assert_non_null(strstr(out, "no job 424242"));
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune --older-than 30d --dry-run"), 0);
    assert_non_null(strstr(out, "no job to prune"));
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune --older-than 0s --dry-run --json"), 0);
    assert_non_null(strstr(out, "\"dry_run\": true"));
    assert_non_null(strstr(out, "\"count\": 2"));
    snprintf(args, sizeof(args), "rm %lld", (long long)a);
    assert_int_equal(trainctl(&d, out, sizeof(out), args), 0);
    assert_non_null(strstr(out, "first"));
    assert_non_null(strstr(out, "deleted 1 job(s)"));
    assert_int_equal(trainctl(&d, out, sizeof(out), "prune --older-than 0s --state succeeded"), 0);
    assert_non_null(strstr(out, "second"));
    assert_non_null(strstr(out, "deleted 1 job(s)"));
    assert_int_equal(rows_of(&d, a) + rows_of(&d, b), 0);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_rm, ts_kill_leftover),
        cmocka_unit_test_teardown(test_prune, ts_kill_leftover),
        cmocka_unit_test_teardown(test_deletion_resumes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_trainctl_verbs, ts_kill_leftover),
    };

    return cmocka_run_group_tests_name("history", tests, NULL, NULL);
}
