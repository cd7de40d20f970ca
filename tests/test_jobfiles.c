/* Integration tests of how traind treats a job's files (issue 12's dataset part): each starts
 * a real traind (TRAIND_BIN) and submits with trainctl (TRAINCTL_BIN), as a user would, some
 * jobs as another user (nobody, from a forked child that drops root). A dataset swapped after
 * submit for a symlink to a root-only file is not read as root, at the first start nor at a
 * resume after a restart; one swapped for a FIFO fails at once and the daemon still stops on
 * SIGTERM; relative paths are resolved where trainctl runs; a data failure on two devices
 * names each; a dry run refuses what would fail at start. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "proto/proto.h"
#include "tests/support.h"

#define FMNIST "/usr/share/datasets/fashion-mnist"
#define NOBODY 65534 /* the other user's uid and gid */
#define SECRET "TOPSECRET-the-root-only-bytes"

/* ---- files -------------------------------------------------------------------------------- */

/* A world-readable temporary directory for the test's datasets and job files. */
static void make_dir(char *dir, size_t size)
{
    snprintf(dir, size, "/tmp/td-jobfiles-XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chmod(dir, 0755), 0);
}

static void remove_dir(const char *dir)
{
    char cmd[400];

    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");

    assert_non_null(f);
    assert_true(fputs(text, f) >= 0);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(chmod(path, mode), 0);
}

/* Text of at least 400 bytes (a tiny gpt's batch needs 17), starting with first. */
static void write_text(const char *path, const char *first, mode_t mode)
{
    char text[1024];
    size_t n = (size_t)snprintf(text, sizeof(text), "%s\n", first);

    while (n < 400)
        n += (size_t)snprintf(text + n, sizeof(text) - n, "the quick brown fox jumps. ");
    write_file(path, text, mode);
}

/* A tiny byte-level gpt job on train (a path as written into the job) as JSON at path;
 * extra is more pairs, "" or ", \"devices\": 2". */
static void write_job(const char *path, const char *train, long long max_steps, const char *extra)
{
    char json[2048];

    snprintf(json, sizeof(json),
             "{\"name\": \"files\", \"model\": {\"kind\": \"gpt\", \"n_layer\": 1, \"n_head\": 2, "
             "\"n_embd\": 16, \"seq_len\": 8, \"vocab_size\": 256}, \"data\": {\"kind\": "
             "\"text\", \"train\": \"%s\"}, \"batch_size\": 2, \"max_steps\": %lld%s}\n",
             train, max_steps, extra);
    write_file(path, json, 0644);
}

/* ---- trainctl, as root or as nobody ------------------------------------------------------- */

/* Runs trainctl with args (NULL-terminated, after the program name) in cwd, as uid (0 or
 * NOBODY), on sock; its output (stdout and stderr) into out. Returns its exit status. */
static int trainctl(int uid, const char *cwd, const char *sock, char *out, size_t size, ...)
{
    const char *bin = ts_env_or("TRAINCTL_BIN", "build/client/trainctl");
    const char *argv[12] = {"trainctl"};
    int p[2], status = 0, n = 1;
    size_t got = 0;
    va_list ap;
    pid_t pid;

    va_start(ap, size);
    while (n < 11 && (argv[n] = va_arg(ap, const char *)) != NULL)
        n++;
    va_end(ap);
    argv[n] = NULL;
    if (uid != 0)
        bin = ts_bin_for_user(bin, NOBODY, NOBODY);
    assert_int_equal(pipe(p), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        gid_t none[1] = {NOBODY};
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        if (uid != 0 && (setgroups(1, none) != 0 || setgid(NOBODY) != 0 || setuid(NOBODY) != 0))
            _exit(125);
        if (chdir(cwd) != 0 || setenv("TRAIND_SOCKET", sock, 1) != 0)
            _exit(125);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(p[1]);
    for (ssize_t r; got + 1 < size && (r = read(p[0], out + got, size - 1 - got)) > 0;)
        got += (size_t)r;
    out[got] = '\0';
    close(p[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* trainctl submit job as uid; the new job's id, or the test fails with trainctl's output. */
static int64_t submit_as(int uid, const char *cwd, const char *sock, const char *job)
{
    char out[2048];
    int rc = trainctl(uid, cwd, sock, out, sizeof(out), "submit", job, NULL);

    if (rc != 0)
        fail_msg("trainctl submit %s as uid %d: exit %d: %s", job, uid, rc, out);
    return strtoll(out, NULL, 10);
}

/* ---- the daemon --------------------------------------------------------------------------- */

/* Lets nobody connect to d's socket (the test's daemon makes it 0660 in a 0700 directory). */
static void open_to_nobody(const ts_daemon *d)
{
    assert_int_equal(chmod(d->dir, 0711), 0);
    assert_int_equal(chmod(d->sock, 0666), 0);
}

/* SIGTERM and wait at most timeout_s for the daemon to exit (a worker blocked in a read would
 * hold it for good); the directory stays, for a restart. Returns the wait status. */
static int stop_within(ts_daemon *d, int timeout_s)
{
    int status = 0;

    kill(d->pid, SIGTERM);
    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
            ts_live_pid = -1;
            return status;
        }
        usleep(50 * 1000);
    }
    fail_msg("traind did not stop within %d s of SIGTERM", timeout_s);
    return -1;
}

static void cancel(ts_client *c, int64_t id)
{
    td_proto_frame *f;

    ts_send_job_request(c, "cancel", id);
    f = ts_client_recv(c);
    assert_non_null(f);
    td_proto_frame_free(f);
}

/* Polls job id until it has ended, at most timeout_s; its state and error message. */
static void wait_end(ts_client *c, int64_t id, int timeout_s, char *state, size_t ssize,
                     char *error, size_t esize)
{
    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        const td_pval *job, *e;
        td_proto_frame *f = ts_status(c, id, &job);
        ts_get_s(job, "state", state, ssize);
        error[0] = '\0';
        e = td_pv_get(job, "error");
        if (td_pv_type_of(e) == TD_PV_MAP)
            td_pv_strcpy(td_pv_get(e, "message"), error, esize);
        td_proto_frame_free(f);
        if (strcmp(state, "succeeded") == 0 || strcmp(state, "failed") == 0 ||
            strcmp(state, "cancelled") == 0)
            return;
        usleep(100 * 1000);
    }
    fail_msg("job %lld is %s, not ended, after %d s", (long long)id, state, timeout_s);
}

static void expect_failed_with(ts_client *c, int64_t id, const char *needle)
{
    char state[32], error[1024];

    wait_end(c, id, 120, state, sizeof(state), error, sizeof(error));
    if (strcmp(state, "failed") != 0 || strstr(error, needle) == NULL)
        fail_msg("job %lld: expected failed with \"%s\", got %s \"%s\"", (long long)id, needle,
                 state, error);
    assert_null(strstr(error, SECRET));
}

/* ---- the tests ---------------------------------------------------------------------------- */

/* A dataset nobody may read when submitted, swapped for a symlink to a root-only file while
 * the job waits: the job fails with a permission error instead of training on the secret (and
 * `trainctl sample` reciting it). Again across a restart: the resumed queue opens its files
 * as their user too. */
static void test_swapped_for_a_symlink_after_submit(void **state)
{
    char dir[64], path[200], secret[200], job[200], blocker[200], text[200];
    ts_daemon d;
    ts_client c;
    int64_t blk, id;

    if (geteuid() != 0) {
        print_message("needs root, to submit as another user: skipped\n");
        skip();
    }
    make_dir(dir, sizeof(dir));
    snprintf(secret, sizeof(secret), "%s/secret.txt", dir);
    write_text(secret, SECRET, 0600);
    snprintf(text, sizeof(text), "%s/blocker.txt", dir);
    write_text(text, "the blocker's text", 0644);
    snprintf(blocker, sizeof(blocker), "%s/blocker.json", dir);
    write_job(blocker, text, 1000000, "");
    ts_daemon_start(&d, "cpu:1");
    open_to_nobody(&d);
    ts_connect_hello(&c, d.sock);

    for (int round = 0; round < 2; round++) {
        /* round 0: swapped, then started; round 1: swapped, then the daemon restarted */
        blk = submit_as(0, dir, d.sock, blocker);
        ts_wait_state(&c, blk, "running", 60);
        snprintf(path, sizeof(path), "%s/public-%d.txt", dir, round);
        write_text(path, "public text", 0644);
        snprintf(job, sizeof(job), "%s/job-%d.json", dir, round);
        write_job(job, path, 4, "");
        id = submit_as(NOBODY, dir, d.sock, job);
        assert_int_equal(unlink(path), 0);
        assert_int_equal(symlink(secret, path), 0);
        if (round == 1) {
            ts_client_close(&c);
            assert_int_equal(stop_within(&d, 60), 0);
            ts_daemon_start_in(&d, "cpu:1");
            ts_connect_hello(&c, d.sock);
        }
        cancel(&c, blk);
        expect_failed_with(&c, id, "Permission denied");
        expect_failed_with(&c, id, path);
    }
    ts_client_close(&c);
    assert_int_equal(stop_within(&d, 60), 0);
    remove_dir(d.dir);
    remove_dir(dir);
}

/* A dataset swapped for a FIFO while the job waits: the job fails at once, naming it (a read
 * would block its worker for good: no cancel, no shutdown), and SIGTERM still stops the
 * daemon. */
static void test_swapped_for_a_fifo_after_submit(void **state)
{
    char dir[64], path[200], job[200], blocker[200], text[200];
    ts_daemon d;
    ts_client c;
    int64_t blk, id;

    make_dir(dir, sizeof(dir));
    snprintf(text, sizeof(text), "%s/blocker.txt", dir);
    write_text(text, "the blocker's text", 0644);
    snprintf(blocker, sizeof(blocker), "%s/blocker.json", dir);
    write_job(blocker, text, 1000000, "");
    snprintf(path, sizeof(path), "%s/data.txt", dir);
    write_text(path, "a regular file at submit", 0644);
    snprintf(job, sizeof(job), "%s/job.json", dir);
    write_job(job, path, 4, "");
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    blk = submit_as(0, dir, d.sock, blocker);
    ts_wait_state(&c, blk, "running", 60);
    id = submit_as(0, dir, d.sock, job);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0644), 0);
    cancel(&c, blk);
    expect_failed_with(&c, id, "not a regular file (a FIFO)");
    ts_client_close(&c);
    assert_int_equal(stop_within(&d, 60), 0);
    remove_dir(d.dir);
    remove_dir(dir);
}

/* A relative path in a job file is where the user runs trainctl, not where traind runs:
 * trainctl resolves it (a dry run fits, a submit trains); traind refuses a relative path from
 * any other client, saying where it should have been resolved. */
static void test_relative_paths(void **state)
{
    char dir[64], path[200], job[200], out[4096], msg[600], st[32], error[1024];
    td_proto_frame *f;
    const td_pval *root;
    ts_daemon d;
    ts_client c;
    int64_t id;

    make_dir(dir, sizeof(dir));
    snprintf(path, sizeof(path), "%s/data", dir);
    assert_int_equal(mkdir(path, 0755), 0);
    snprintf(path, sizeof(path), "%s/data/x.txt", dir);
    write_text(path, "where the user stands", 0644);
    snprintf(job, sizeof(job), "%s/job.json", dir);
    write_job(job, "data/x.txt", 3, "");
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);

    if (trainctl(0, dir, d.sock, out, sizeof(out), "submit", "job.json", "--dry-run", NULL) != 0 ||
        strstr(out, "fits: yes") == NULL)
        fail_msg("trainctl submit --dry-run from %s: %s", dir, out);
    id = submit_as(0, dir, d.sock, "job.json");
    wait_end(&c, id, 120, st, sizeof(st), error, sizeof(error));
    if (strcmp(st, "succeeded") != 0)
        fail_msg("job %lld from a relative path: %s \"%s\"", (long long)id, st, error);

    ts_begin(&c, "submit", 1);
    td_pw_str(&c.w, "job");
    td_pw_map(&c.w, 2);
    td_pw_str(&c.w, "model");
    td_pw_map(&c.w, 6);
    td_pw_str(&c.w, "kind");
    td_pw_str(&c.w, "gpt");
    td_pw_str(&c.w, "n_layer");
    td_pw_int(&c.w, 1);
    td_pw_str(&c.w, "n_head");
    td_pw_int(&c.w, 2);
    td_pw_str(&c.w, "n_embd");
    td_pw_int(&c.w, 16);
    td_pw_str(&c.w, "seq_len");
    td_pw_int(&c.w, 8);
    td_pw_str(&c.w, "vocab_size");
    td_pw_int(&c.w, 256);
    td_pw_str(&c.w, "data");
    td_pw_map(&c.w, 2);
    td_pw_str(&c.w, "kind");
    td_pw_str(&c.w, "text");
    td_pw_str(&c.w, "train");
    td_pw_str(&c.w, "data/x.txt");
    ts_client_send(&c);
    f = ts_client_recv(&c);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    assert_true(ts_str_is(td_pv_get(root, "type"), "error"));
    assert_int_equal(ts_get_i(root, "code"), TD_EJOB);
    ts_get_s(root, "message", msg, sizeof(msg));
    assert_string_equal(msg, "data.train: must be an absolute path; trainctl resolves relative "
                             "paths where you run it");
    td_proto_frame_free(f);
    ts_client_close(&c);
    assert_int_equal(stop_within(&d, 60), 0);
    remove_dir(d.dir);
    remove_dir(dir);
}

/* A data failure on each of two devices: two lines, each naming its device, as every other
 * kind of failure does. */
static void test_data_failure_names_devices(void **state)
{
    char dir[64], path[200], job[200], st[32], error[1024];
    ts_daemon d;
    ts_client c;
    int64_t id;

    make_dir(dir, sizeof(dir));
    snprintf(path, sizeof(path), "%s/x.txt", dir);
    write_text(path, "two devices", 0644);
    snprintf(job, sizeof(job), "%s/job.json", dir);
    write_job(job, path, 10,
              ", \"devices\": 2, \"debug\": {\"fail\": {\"step\": 2, \"kind\": \"data\", "
              "\"device\": [0, 1]}}");
    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    id = submit_as(0, dir, d.sock, job);
    wait_end(&c, id, 120, st, sizeof(st), error, sizeof(error));
    assert_string_equal(st, "failed");
    assert_string_equal(error,
                        "2 training workers failed:\n"
                        "  dataset error on device 0 during training step: injected read error "
                        "at step 2\n"
                        "  dataset error on device 1 during training step: injected read error "
                        "at step 2");
    ts_client_close(&c);
    assert_int_equal(stop_within(&d, 60), 0);
    remove_dir(d.dir);
    remove_dir(dir);
}

/* A dry run checks the files as a submit does: a last layer short of the labels, and a labels
 * file given as the images, are refused naming the field and the file, not estimated. */
static void test_dry_run_checks_files(void **state)
{
    static const char *const images[2] = {FMNIST "/train-images-idx3-ubyte.gz",
                                          FMNIST "/train-labels-idx1-ubyte.gz"};
    static const int last[2] = {5, 10};
    static const char *const want[2] = {
        "model.layers[2]: 5 outputs, but " FMNIST "/train-labels-idx1-ubyte.gz has labels up "
        "to 9 (10 classes)",
        "data.train.images: " FMNIST "/train-labels-idx1-ubyte.gz: magic 0x00000801 is an IDX "
        "labels file, expected images (0x00000803)"};
    char msg[1024];
    td_proto_frame *f;
    const td_pval *root;
    ts_daemon d;
    ts_client c;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    for (int i = 0; i < 2; i++) {
        ts_begin(&c, "submit", 2);
        td_pw_str(&c.w, "dry_run");
        td_pw_bool(&c.w, 1);
        td_pw_str(&c.w, "job");
        td_pw_map(&c.w, 2);
        td_pw_str(&c.w, "model");
        td_pw_map(&c.w, 2);
        td_pw_str(&c.w, "kind");
        td_pw_str(&c.w, "mlp");
        td_pw_str(&c.w, "layers");
        td_pw_array(&c.w, 3);
        td_pw_int(&c.w, 784);
        td_pw_int(&c.w, 32);
        td_pw_int(&c.w, last[i]);
        td_pw_str(&c.w, "data");
        td_pw_map(&c.w, 2);
        td_pw_str(&c.w, "kind");
        td_pw_str(&c.w, "idx");
        td_pw_str(&c.w, "train");
        td_pw_map(&c.w, 2);
        td_pw_str(&c.w, "images");
        td_pw_str(&c.w, images[i]);
        td_pw_str(&c.w, "labels");
        td_pw_str(&c.w, FMNIST "/train-labels-idx1-ubyte.gz");
        ts_client_send(&c);
        f = ts_client_recv(&c);
        assert_non_null(f);
        root = td_proto_frame_root(f);
        if (!ts_str_is(td_pv_get(root, "type"), "error"))
            fail_msg("dry run %d: not refused", i);
        assert_int_equal(ts_get_i(root, "code"), TD_EJOB);
        ts_get_s(root, "message", msg, sizeof(msg));
        assert_string_equal(msg, want[i]);
        td_proto_frame_free(f);
    }
    ts_client_close(&c);
    assert_int_equal(stop_within(&d, 60), 0);
    remove_dir(d.dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_swapped_for_a_symlink_after_submit, ts_kill_leftover),
        cmocka_unit_test_teardown(test_swapped_for_a_fifo_after_submit, ts_kill_leftover),
        cmocka_unit_test_teardown(test_relative_paths, ts_kill_leftover),
        cmocka_unit_test_teardown(test_data_failure_names_devices, ts_kill_leftover),
        cmocka_unit_test_teardown(test_dry_run_checks_files, ts_kill_leftover),
    };

    return cmocka_run_group_tests_name("jobfiles", tests, NULL, NULL);
}
