/* Integration tests of traind's state directory and its database as a shared box sees them:
 * one daemon per state directory (a second exits 75 and touches nothing; kill -9 frees it);
 * a start refused for any reason creates nothing and names the real cause; the modes of
 * everything traind creates; another process's write lock on traind.db (the daemon keeps
 * answering, a submit fails fast, no row is lost, an outcome is kept until it can be
 * written); another process's read transaction (the WAL's size in info, a warning); and a
 * full disk (a job pauses and resumes without losing a row, or fails with a disk-full error
 * when the disk stays full, its outcome kept until there is room).
 *
 * A full disk is a small tmpfs mounted over the state directory (root, as CI runs the tests):
 * the tests that need one are skipped, saying so, where mount(2) is refused. The outside
 * locks and readers are the sqlite3 C API in this process. Timing bounds are loose on
 * purpose (a reply "well under" a lock's duration), for a busy 2-core box. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <pwd.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "proto/proto.h"
#include "tests/support.h"

#define FMNIST           "/usr/share/datasets/fashion-mnist"
#define START_TIMEOUT_MS 60000 /* a traind's start, up to its socket accepting */
#define EXIT_TIMEOUT_MS  30000 /* a refused traind's exit */
#define LOCK_HOLD_MS     12000 /* the outside write lock: past SQLite's 10 s busy timeout */
/* A reply while it is held: under SQLite's 10 s busy timeout, which a reply that waited for the
 * lock would have sat out, with room for a sanitizer build on a loaded box (it was 2500) */
#define REPLY_BOUND_MS   8000
#define FULL_WAIT_S      5     /* the [metrics] disk_full_wait_s of the test that waits it out */
#define TMPFS_SIZE       "64m" /* the state directory of the disk-full tests */
#define PAST_PAUSE_STEPS 100   /* steps a job paused by a full disk trains once room is back */
#define EX_TEMPFAIL      75
#define EX_CONFIG        78

/* ---- starting traind ---- */

/* Starts traind with its log and socket in d->dir (a fresh temporary directory) and its state
 * in state_dir (d->dir itself when NULL), so that a full state directory cannot silence its
 * log; returns once the socket accepts. ts_daemon_stop() and ts_log_count() work on it. */
/* Starts traind on state_dir (NULL: d->dir) with traind.conf conf (NULL: none). */
static void start_in_conf(ts_daemon *d, const char *state_dir, const char *devices,
                          const char *conf)
{
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    char log[320];

    snprintf(d->dir, sizeof(d->dir), "/tmp/traind-sd.XXXXXX");
    assert_non_null(mkdtemp(d->dir));
    if (state_dir == NULL)
        state_dir = d->dir;
    snprintf(d->sock, sizeof(d->sock), "%s/traind.sock", d->dir);
    snprintf(d->db, sizeof(d->db), "%s/traind.db", state_dir);
    snprintf(log, sizeof(log), "%s/traind.log", d->dir);
    d->pid = fork();
    assert_true(d->pid >= 0);
    if (d->pid == 0) {
        if (freopen(log, "a", stderr) == NULL || freopen("/dev/null", "w", stdout) == NULL)
            _exit(126);
        if (conf != NULL)
            execl(bin, bin, "--socket", d->sock, "--state-dir", state_dir, "--devices", devices,
                  "--log-level", "debug", "--config", conf, (char *)NULL);
        else
            execl(bin, bin, "--socket", d->sock, "--state-dir", state_dir, "--devices", devices,
                  "--log-level", "debug", (char *)NULL);
        _exit(127);
    }
    ts_live_pid = d->pid;
    for (long long until = ts_now_ms() + START_TIMEOUT_MS; ts_now_ms() < until;) {
        if (ts_can_connect(d->sock))
            return;
        if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
            ts_live_pid = -1;
            fail_msg("traind exited before listening; see %s", log);
        }
        usleep(20 * 1000);
    }
    fail_msg("traind did not listen on %s", d->sock);
}

static void start_in(ts_daemon *d, const char *state_dir, const char *devices)
{
    start_in_conf(d, state_dir, devices, NULL);
}

/* Runs traind with args (after the binary) as user uid (-1: as this process), its stderr in
 * log, and returns its wait status once it has exited; fails the test, killing it, when it
 * keeps running. ts_live_pid, a daemon of the test's own, is left alone. */
static int run_refused(const char *const *args, const char *log, uid_t uid)
{
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    const char *argv[16];
    size_t n = 0;
    int status = 0;
    pid_t pid;

    if (uid != (uid_t)-1)
        bin = ts_bin_for_user(bin, uid, uid);
    argv[n++] = bin;
    for (size_t i = 0; args[i] != NULL && n + 1 < sizeof(argv) / sizeof(argv[0]); i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (freopen(log, "w", stderr) == NULL || freopen("/dev/null", "w", stdout) == NULL)
            _exit(126);
        if (uid != (uid_t)-1 && (setgid(uid) != 0 || setuid(uid) != 0))
            _exit(125);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    for (long long until = ts_now_ms() + EXIT_TIMEOUT_MS;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return status;
        if (ts_now_ms() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            fail_msg("traind (pid %d) was expected to refuse to start, but ran; see %s", (int)pid,
                     log);
        }
        usleep(20 * 1000);
    }
}

/* The whole of a small file, NUL-terminated; empty when it cannot be read. */
static void read_text(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    size_t n = 0;

    if (f != NULL) {
        n = fread(buf, 1, size - 1, f);
        fclose(f);
    }
    buf[n] = '\0';
}

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* ---- jobs ---- */

/* Sends a submit of a small MLP on Fashion-MNIST: fast steps, five metric rows each. */
static void send_mlp(ts_client *c, const char *name, int64_t max_steps, int64_t ckpt_every)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, ckpt_every > 0 ? 8 : 7);
    td_pw_str(&c->w, "name");
    td_pw_str(&c->w, name);
    td_pw_str(&c->w, "model");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "mlp");
    td_pw_str(&c->w, "layers");
    td_pw_array(&c->w, 3);
    td_pw_int(&c->w, 784);
    td_pw_int(&c->w, 16);
    td_pw_int(&c->w, 10);
    td_pw_str(&c->w, "data");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "idx");
    td_pw_str(&c->w, "train");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "images");
    td_pw_str(&c->w, FMNIST "/train-images-idx3-ubyte.gz");
    td_pw_str(&c->w, "labels");
    td_pw_str(&c->w, FMNIST "/train-labels-idx1-ubyte.gz");
    td_pw_str(&c->w, "optim");
    td_pw_map(&c->w, 1);
    td_pw_str(&c->w, "lr");
    td_pw_double(&c->w, 1e-3);
    td_pw_str(&c->w, "batch_size");
    td_pw_int(&c->w, 16);
    td_pw_str(&c->w, "max_steps");
    td_pw_int(&c->w, max_steps);
    td_pw_str(&c->w, "seed");
    td_pw_int(&c->w, 3);
    if (ckpt_every > 0) {
        td_pw_str(&c->w, "checkpoint_every");
        td_pw_int(&c->w, ckpt_every);
    }
    ts_client_send(c);
}

/* Submits send_mlp's job; returns its id (fails the test when it is refused). */
static int64_t submit_mlp(ts_client *c, const char *name, int64_t max_steps, int64_t ckpt_every)
{
    send_mlp(c, name, max_steps, ckpt_every);
    return ts_submitted(c);
}

/* Waits until job id runs and has done at least min_step steps. */
static void wait_step(ts_client *c, int64_t id, int64_t min_step, int timeout_s)
{
    char state[32] = "";
    int64_t step = 0;

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        step = ts_job_status(c, id, state, sizeof(state));
        if (strcmp(state, "running") == 0 && step >= min_step)
            return;
        usleep(50 * 1000);
    }
    fail_msg("job %lld is %s at step %lld, not running past %lld, after %d s", (long long)id, state,
             (long long)step, (long long)min_step, timeout_s);
}

/* Waits until job id has ended; its state into state. Fails the test after timeout_s. */
static void wait_ended(ts_client *c, int64_t id, char *state, size_t size, int timeout_s)
{
    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        ts_job_status(c, id, state, size);
        if (strcmp(state, "succeeded") == 0 || strcmp(state, "failed") == 0 ||
            strcmp(state, "cancelled") == 0)
            return;
        usleep(100 * 1000);
    }
    fail_msg("job %lld is still %s after %d s", (long long)id, state, timeout_s);
}

/* Cancels job id (queued or running); returns the state the reply gives. */
static void cancel_job(ts_client *c, int64_t id, char *state, size_t size)
{
    td_proto_frame *f;

    ts_send_job_request(c, "cancel", id);
    f = ts_client_recv(c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "cancelled"));
    ts_get_s(td_proto_frame_root(f), "state", state, size);
    td_proto_frame_free(f);
}

/* How many train_loss rows job has in db, and the highest step among them. */
static int64_t loss_rows(const char *db, int64_t job, int64_t *max_step)
{
    sqlite3 *h = NULL;
    sqlite3_stmt *st = NULL;
    int64_t n = -1;

    assert_int_equal(sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_busy_timeout(h, 5000);
    assert_int_equal(sqlite3_prepare_v2(h,
                                        "SELECT count(*), coalesce(max(m.step), 0) FROM metrics m "
                                        "JOIN metric_keys k ON k.id = m.key "
                                        "WHERE m.job = ?1 AND k.name = 'train_loss'",
                                        -1, &st, NULL),
                     SQLITE_OK);
    sqlite3_bind_int64(st, 1, job);
    if (sqlite3_step(st) == SQLITE_ROW) {
        n = sqlite3_column_int64(st, 0);
        *max_step = sqlite3_column_int64(st, 1);
    }
    sqlite3_finalize(st);
    sqlite3_close(h);
    return n;
}

/* Job id's state and error message as its row in db says (not as the daemon shows it). */
static void stored_state(const char *db, int64_t job, char *state, size_t size, char *msg,
                         size_t msize)
{
    sqlite3 *h = NULL;
    sqlite3_stmt *st = NULL;

    state[0] = msg[0] = '\0';
    assert_int_equal(sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_busy_timeout(h, 5000);
    assert_int_equal(
        sqlite3_prepare_v2(h, "SELECT state, err_msg FROM jobs WHERE id = ?1", -1, &st, NULL),
        SQLITE_OK);
    sqlite3_bind_int64(st, 1, job);
    if (sqlite3_step(st) == SQLITE_ROW) {
        snprintf(state, size, "%s", (const char *)sqlite3_column_text(st, 0));
        if (sqlite3_column_text(st, 1) != NULL)
            snprintf(msg, msize, "%s", (const char *)sqlite3_column_text(st, 1));
    }
    sqlite3_finalize(st);
    sqlite3_close(h);
}

/* Waits until job id's stored row says want; fails the test after timeout_s. */
static void wait_stored_state(const char *db, int64_t job, const char *want, char *msg,
                              size_t msize, int timeout_s)
{
    char state[32] = "";

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        stored_state(db, job, state, sizeof(state), msg, msize);
        if (strcmp(state, want) == 0)
            return;
        usleep(100 * 1000);
    }
    fail_msg("job %lld's row says %s, not %s, after %d s", (long long)job, state, want, timeout_s);
}

/* Sends a request that names job (0: none) and returns how long its reply took, in ms; the
 * reply's type into type. */
static long long timed_request(ts_client *c, const char *req, int64_t job, char *type, size_t size)
{
    long long t0 = ts_now_ms();
    td_proto_frame *f;

    if (job > 0) {
        ts_send_job_request(c, req, job);
    } else {
        ts_begin(c, req, 0);
        ts_client_send(c);
    }
    f = ts_client_recv(c);
    assert_non_null(f);
    ts_get_s(td_proto_frame_root(f), "type", type, size);
    td_proto_frame_free(f);
    return ts_now_ms() - t0;
}

/* ---- a small tmpfs for a full disk ---- */

/* Mounts a tmpfs of size on dir: 0, or skips the test (saying why) where mount(2) is refused. */
static int tmpfs_or_skip(const char *dir, const char *size)
{
    char opts[64];

    snprintf(opts, sizeof(opts), "size=%s,mode=0755", size);
    if (mount("tmpfs", dir, "tmpfs", 0, opts) == 0)
        return 0;
    fprintf(stderr,
            "skipped: cannot mount a tmpfs to fill (%s); the disk-full tests need root and "
            "mount(2)\n",
            strerror(errno));
    return -1;
}

/* Fills the filesystem of dir with dir/filler until it is full. */
static void fill(const char *dir)
{
    static char block[64 * 1024];
    char path[300];
    int fd;

    snprintf(path, sizeof(path), "%s/filler", dir);
    fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    assert_true(fd >= 0);
    memset(block, 'x', sizeof(block));
    while (write(fd, block, sizeof(block)) > 0)
        ;
    /* The last block's remainder, a byte at a time. */
    while (write(fd, block, 1) == 1)
        ;
    assert_int_equal(errno, ENOSPC);
    close(fd);
}

static void unfill(const char *dir)
{
    char path[300];

    snprintf(path, sizeof(path), "%s/filler", dir);
    assert_int_equal(unlink(path), 0);
}

/* ---- the tests ---- */

/* A second traind on the same state directory (another socket) is refused with 75 and the
 * first one's pid while the first runs, and changes nothing: the first one's job keeps
 * running. Once the first is killed (-9), the directory is free again. */
static void test_one_daemon_per_state_dir(void **state)
{
    ts_daemon a, b;
    ts_client c;
    char log[320], text[4096], want[512], st[32];
    char sock2[300];
    const char *args[9];
    int status;
    int64_t job, before, after;

    start_in(&a, NULL, "cpu:1");
    ts_connect_hello(&c, a.sock);
    job = submit_mlp(&c, "held", 1000000, 0);
    wait_step(&c, job, 1, 180);

    snprintf(log, sizeof(log), "%s/second.log", a.dir);
    snprintf(sock2, sizeof(sock2), "%s/second.sock", a.dir);
    args[0] = "--socket";
    args[1] = sock2;
    args[2] = "--state-dir";
    args[3] = a.dir;
    args[4] = "--log-level";
    args[5] = "debug";
    args[6] = NULL;
    status = run_refused(args, log, (uid_t)-1);
    read_text(log, text, sizeof(text));
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), EX_TEMPFAIL);
    snprintf(want, sizeof(want), "state directory %s is in use by traind pid %d", a.dir,
             (int)a.pid);
    if (strstr(text, want) == NULL)
        fail_msg("the second traind's log lacks \"%s\":\n%s", want, text);
    assert_null(strstr(text, "stopping"));
    assert_null(strstr(text, "stopped"));
    assert_false(exists(sock2));
    /* The first daemon's job was not requeued by the second: it runs on, its steps grow. */
    before = ts_job_status(&c, job, st, sizeof(st));
    assert_string_equal(st, "running");
    wait_step(&c, job, before + 1, 60);
    after = ts_job_status(&c, job, st, sizeof(st));
    assert_string_equal(st, "running");
    assert_true(after > before);
    assert_int_equal(ts_log_count(&a, "requeued"), 0);
    ts_client_close(&c);

    /* kill -9: the kernel drops the lock, and a new traind takes the directory. */
    ts_daemon_kill9(&a);
    b = a;
    snprintf(b.sock, sizeof(b.sock), "%s", sock2);
    {
        const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
        snprintf(log, sizeof(log), "%s/traind.log", a.dir);
        b.pid = fork();
        assert_true(b.pid >= 0);
        if (b.pid == 0) {
            if (freopen(log, "a", stderr) == NULL)
                _exit(126);
            execl(bin, bin, "--socket", b.sock, "--state-dir", b.dir, "--devices", "cpu:1",
                  (char *)NULL);
            _exit(127);
        }
        ts_live_pid = b.pid;
        for (int i = 0; i < 1200 && !ts_can_connect(b.sock); i++) /* 60 s */
            usleep(50 * 1000);
    }
    ts_connect_hello(&c, b.sock);
    wait_step(&c, job, 1, 180);
    cancel_job(&c, job, st, sizeof(st));
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&b), 0);
}

/* Every start refused for a reason of its own creates nothing (no state directory, no
 * database, no lock file), logs no "stopping" or "stopped", and names the real cause. */
static void test_refused_start_creates_nothing(void **state)
{
    ts_daemon a;
    char dir[64], st_dir[128], sock[160], log[160], text[4096], file[160], want[400];
    const char *args[9];
    struct passwd *nobody = getpwnam("nobody");
    int status;

    snprintf(dir, sizeof(dir), "/tmp/traind-ref.XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(log, sizeof(log), "%s/traind.log", dir);
    snprintf(st_dir, sizeof(st_dir), "%s/state/deeper", dir);

    /* A socket in a directory that does not exist: not "permission denied". */
    args[0] = "--socket";
    args[1] = "/nonexistent-traind-dir/x.sock";
    args[2] = "--state-dir";
    args[3] = st_dir;
    args[4] = NULL;
    status = run_refused(args, log, (uid_t)-1);
    read_text(log, text, sizeof(text));
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    if (strstr(text, "directory /nonexistent-traind-dir does not exist") == NULL)
        fail_msg("no word of the missing directory:\n%s", text);
    assert_null(strstr(text, "permission denied"));
    snprintf(file, sizeof(file), "%s/state", dir);
    assert_false(exists(file));

    /* A state directory that is a regular file. */
    snprintf(file, sizeof(file), "%s/plain", dir);
    fclose(fopen(file, "w"));
    snprintf(sock, sizeof(sock), "%s/t.sock", dir);
    args[1] = sock;
    args[3] = file;
    status = run_refused(args, log, (uid_t)-1);
    read_text(log, text, sizeof(text));
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == EX_CONFIG);
    snprintf(want, sizeof(want), "state directory %s is not a directory", file);
    if (strstr(text, want) == NULL)
        fail_msg("the log lacks \"%s\":\n%s", want, text);
    assert_null(strstr(text, "sqlite 14"));

    /* A state directory traind may not write (nobody, in a directory of root's). */
    if (nobody != NULL) {
        snprintf(file, sizeof(file), "%s/roots", dir);
        assert_int_equal(mkdir(file, 0755), 0);
        assert_int_equal(chmod(dir, 0777), 0); /* nobody writes its log and socket here */
        status = run_refused(args, log, nobody->pw_uid);
        read_text(log, text, sizeof(text));
        assert_true(WIFEXITED(status) && WEXITSTATUS(status) == EX_CONFIG);
        snprintf(want, sizeof(want), "state directory %s is not writable", file);
        if (strstr(text, want) == NULL)
            fail_msg("the log lacks \"%s\":\n%s", want, text);
        assert_non_null(strstr(text, "Permission denied"));
        assert_null(strstr(text, "sqlite 14"));
        snprintf(want, sizeof(want), "%s/traind.db", file);
        assert_false(exists(want));
        chmod(dir, 0700);
    }

    /* A socket another traind listens on: the start fails after the store was opened, and
     * undoes it. */
    start_in(&a, NULL, "cpu:1");
    args[1] = a.sock;
    args[3] = st_dir;
    status = run_refused(args, log, (uid_t)-1);
    read_text(log, text, sizeof(text));
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    assert_non_null(strstr(text, "another traind is listening"));
    assert_null(strstr(text, "stopping"));
    assert_null(strstr(text, "stopped"));
    snprintf(file, sizeof(file), "%s/state", dir);
    assert_false(exists(file));
    assert_int_equal(ts_daemon_stop(&a), 0);

    snprintf(text, sizeof(text), "rm -rf '%s'", dir);
    assert_int_equal(system(text), 0);
}

/* Checks path's mode against want_max: no permission bit outside it. */
static void mode_at_most(const char *path, mode_t want_max)
{
    struct stat st;

    assert_int_equal(lstat(path, &st), 0);
    if ((st.st_mode & 0777 & ~want_max) != 0)
        fail_msg("%s has mode %04o; at most %04o was expected", path, (unsigned)(st.st_mode & 0777),
                 (unsigned)want_max);
}

/* Walks dir: nothing traind created in it is readable by other users or writable by its group
 * (the socket aside, 0660 by design); checkpoints are its owner's alone. */
static void walk_modes(const char *dir, int *files)
{
    DIR *dh = opendir(dir);
    struct dirent *e;
    char path[600];
    struct stat st;

    assert_non_null(dh);
    while ((e = readdir(dh)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 ||
            strcmp(e->d_name, "traind.log") == 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        assert_int_equal(lstat(path, &st), 0);
        (*files)++;
        if (S_ISSOCK(st.st_mode))
            mode_at_most(path, 0660);
        else if (strstr(path, "/checkpoints") != NULL)
            mode_at_most(path, S_ISDIR(st.st_mode) ? 0700 : 0600);
        else
            mode_at_most(path, S_ISDIR(st.st_mode) ? 0750 : 0640);
        if (S_ISDIR(st.st_mode))
            walk_modes(path, files);
    }
    closedir(dh);
}

/* Under umask 022 (a service unit's old UMask=0022), traind creates its state directory 0750,
 * the database, its WAL and the lock 0640, checkpoints 0600 in 0700 directories. */
static void test_modes_of_what_traind_creates(void **state)
{
    ts_daemon d;
    ts_client c;
    char top[64], st_dir[128], path[400];
    mode_t old = umask(022);
    int files = 0;
    int64_t job;

    snprintf(top, sizeof(top), "/tmp/traind-modes.XXXXXX");
    assert_non_null(mkdtemp(top));
    snprintf(st_dir, sizeof(st_dir), "%s/state", top);
    start_in(&d, st_dir, "cpu:1");
    ts_connect_hello(&c, d.sock);
    job = submit_mlp(&c, "modes", 30, 10);
    ts_wait_state(&c, job, "succeeded", 120);
    ts_client_close(&c);
    mode_at_most(st_dir, 0750);
    mode_at_most(d.db, 0640);
    snprintf(path, sizeof(path), "%s-wal", d.db);
    mode_at_most(path, 0640);
    snprintf(path, sizeof(path), "%s/traind.lock", st_dir);
    mode_at_most(path, 0640);
    snprintf(path, sizeof(path), "%s/checkpoints/%lld/ckpt-30.bin", st_dir, (long long)job);
    mode_at_most(path, 0600);
    walk_modes(st_dir, &files);
    assert_true(files >= 6); /* db, -wal, -shm, lock, checkpoints/, its job directory, files */
    walk_modes(d.dir, &files);
    assert_int_equal(ts_daemon_stop(&d), 0);
    mode_at_most(d.db, 0640);
    umask(old);
    snprintf(path, sizeof(path), "rm -rf '%s'", top);
    assert_int_equal(system(path), 0);
}

/* Another process holds the write lock for 12 s (past SQLite's 10 s busy timeout): the
 * daemon keeps answering ls and status at once, a submit fails at once saying to try again,
 * a cancel of a queued job answers at once and status shows the job cancelled while its row
 * cannot be written; once the lock goes, the row catches up, and the running job, which
 * paused on its metric queue, has lost no row. */
static void test_outside_write_lock(void **state)
{
    ts_daemon d;
    ts_client c;
    sqlite3 *h = NULL;
    char type[32], st[32], msg[1024];
    td_proto_frame *f;
    long long worst = 0, t;
    int64_t running, queued, rows, max_step = 0;

    start_in(&d, NULL, "cpu:1");
    ts_connect_hello(&c, d.sock);
    running = submit_mlp(&c, "runs", 1000000, 0);
    queued = submit_mlp(&c, "waits", 10, 0);
    wait_step(&c, running, 5, 180);

    assert_int_equal(sqlite3_open(d.db, &h), SQLITE_OK);
    /* The daemon's own writes hold the lock now and then, briefly. */
    sqlite3_busy_timeout(h, 10000);
    assert_int_equal(sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    long long until = ts_now_ms() + LOCK_HOLD_MS;
    /* A submit is refused at once, with a reason to try again. */
    t = ts_now_ms();
    send_mlp(&c, "late", 10, 0);
    f = ts_client_recv(&c);
    assert_non_null(f);
    t = ts_now_ms() - t;
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "error"));
    /* EBUSY: a client may send the same request again (trainctl exits 75, EX_TEMPFAIL) */
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "name"), "EBUSY"));
    ts_get_s(td_proto_frame_root(f), "message", msg, sizeof(msg));
    td_proto_frame_free(f);
    if (strstr(msg, "locked by another process") == NULL || strstr(msg, "try again") == NULL)
        fail_msg("submit under the lock: \"%s\"", msg);
    if (t > REPLY_BOUND_MS)
        fail_msg("submit under the lock took %lld ms", t);
    /* Cancel the queued job: answered at once; status shows it cancelled. */
    t = ts_now_ms();
    cancel_job(&c, queued, st, sizeof(st));
    t = ts_now_ms() - t;
    assert_string_equal(st, "cancelled");
    assert_true(t < REPLY_BOUND_MS);
    ts_job_status(&c, queued, st, sizeof(st));
    assert_string_equal(st, "cancelled");
    /* ... and the error its kept state carries, though its row has none yet. */
    {
        const td_pval *job = NULL;
        td_proto_frame *sf = ts_status(&c, queued, &job);
        const td_pval *e = td_pv_get(job, "error");
        assert_non_null(e);
        ts_get_s(e, "message", msg, sizeof(msg));
        assert_string_equal(msg, "cancelled while queued");
        assert_true(ts_str_is(td_pv_get(e, "name"), "ECANCELLED"));
        td_proto_frame_free(sf);
    }
    /* ls and status answer at once all through the lock. */
    while (ts_now_ms() < until) {
        t = timed_request(&c, "list", 0, type, sizeof(type));
        assert_string_equal(type, "jobs");
        worst = t > worst ? t : worst;
        t = timed_request(&c, "status", running, type, sizeof(type));
        assert_string_equal(type, "job");
        worst = t > worst ? t : worst;
        usleep(300 * 1000);
    }
    if (worst > REPLY_BOUND_MS)
        fail_msg("a reply took %lld ms while another process held the lock", worst);
    ts_job_status(&c, running, st, sizeof(st));
    assert_string_equal(st, "running");
    /* The row of the cancelled job could not be written: it still says queued. */
    stored_state(d.db, queued, st, sizeof(st), msg, sizeof(msg));
    assert_string_equal(st, "queued");
    assert_int_equal(sqlite3_exec(h, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(h);

    wait_stored_state(d.db, queued, "cancelled", msg, sizeof(msg), 30);
    cancel_job(&c, running, st, sizeof(st));
    ts_wait_state(&c, running, "cancelled", 60);
    /* Every step's row is there: none was dropped while the lock lasted. */
    rows = loss_rows(d.db, running, &max_step);
    assert_true(max_step > 0);
    assert_int_equal(rows, max_step);
    assert_int_equal(ts_log_count(&d, "database is locked (sqlite 5)") > 0, 1);
    assert_int_equal(ts_log_count(&d, "metrics could not be stored"), 0);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Another process keeps a read transaction open: checkpoints cannot empty the WAL, which
 * grows; info shows its size and traind warns, naming the cause; once the reader ends, the
 * next checkpoint empties it and traind says so. */
static void test_outside_reader_holds_wal(void **state)
{
    ts_daemon d;
    ts_client c;
    sqlite3 *h = NULL;
    td_proto_frame *f;
    char st[32];
    int64_t job, wal = 0;

    start_in(&d, NULL, "cpu:1");
    ts_connect_hello(&c, d.sock);
    assert_int_equal(sqlite3_open(d.db, &h), SQLITE_OK);
    /* The daemon's own writes hold the lock now and then, briefly. */
    sqlite3_busy_timeout(h, 10000);
    assert_int_equal(sqlite3_exec(h, "BEGIN; SELECT count(*) FROM jobs;", NULL, NULL, NULL),
                     SQLITE_OK);
    job = submit_mlp(&c, "writes", 100000000, 0);
    /* info shows the WAL growing past 16 MiB (4x what a checkpoint lets gather)... */
    for (long long until = ts_now_ms() + 240000; wal < 16 << 20 && ts_now_ms() < until;) {
        usleep(500 * 1000);
        ts_begin(&c, "info", 0);
        ts_client_send(&c);
        f = ts_client_recv(&c);
        assert_non_null(f);
        wal = ts_get_i(td_pv_get(td_proto_frame_root(f), "store"), "wal_bytes");
        td_proto_frame_free(f);
    }
    assert_true(wal >= 16 << 20);
    /* ...and traind says why, soon after (it looks every 5 s). */
    ts_wait_log(&d, "a checkpoint cannot empty it", 1, 60);
    assert_true(ts_log_count(&d, "keeps a read transaction open") >= 1);
    assert_int_equal(sqlite3_exec(h, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(h);
    ts_wait_log(&d, "the WAL is checkpointed again", 1, 120);
    cancel_job(&c, job, st, sizeof(st));
    ts_wait_state(&c, job, "cancelled", 60);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Job id's step once it has made none for 2 s (paused on the metric queue, below max_step),
 * or -1 when it does not pause within timeout_s. It must be running all along. */
static int64_t paused_step(ts_client *c, int64_t id, int64_t max_step, int timeout_s)
{
    char s[32] = "";

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        int64_t a = ts_job_status(c, id, s, sizeof(s)), b;
        usleep(2000 * 1000);
        b = ts_job_status(c, id, s, sizeof(s));
        assert_string_equal(s, "running");
        if (a == b && b < max_step)
            return b;
    }
    return -1;
}

/* A fresh tmpfs of TMPFS_SIZE for a state directory, top/state; skips the test (saying why)
 * where it cannot be mounted. */
static void full_dir(char *top, size_t tsize, char *st_dir, size_t ssize)
{
    snprintf(top, tsize, "/tmp/traind-full.XXXXXX");
    assert_non_null(mkdtemp(top));
    snprintf(st_dir, ssize, "%s/state", top);
    assert_int_equal(mkdir(st_dir, 0750), 0);
    if (tmpfs_or_skip(st_dir, TMPFS_SIZE) != 0) {
        rmdir(st_dir);
        rmdir(top);
        skip();
    }
}

static void full_dir_remove(const char *top, const char *st_dir)
{
    assert_int_equal(umount(st_dir), 0);
    rmdir(st_dir);
    rmdir(top);
}

/* The state directory on a small tmpfs, filled while a job runs: metric writes wait for room
 * and the job pauses once its samples fill the queue (some 13000 steps); room comes back well
 * within the wait, and the job trains on with every row. Under a slow build (ThreadSanitizer)
 * the queue may not fill before room must come back; either way the job has not run further
 * past the store's first failed write than the queue holds (a pause seen, 2 s without a step,
 * is printed, not judged). The job has more
 * steps than it ever runs, so it is running all through, whatever the box's speed (with 20000 it
 * could reach its end, and its last checkpoint, while the disk was full); once it has gone on past
 * the pause, it is cancelled. */
static void test_disk_full_pauses_then_resumes(void **state)
{
    ts_daemon d;
    ts_client c;
    char top[64], st_dir[128], s[32];
    int64_t job, at_fill, at_fail = -1, paused, at_unfill, rows, max_step = 0;

    full_dir(top, sizeof(top), st_dir, sizeof(st_dir));
    start_in(&d, st_dir, "cpu:1");
    ts_connect_hello(&c, d.sock);
    job = submit_mlp(&c, "fills", 1000000, 0);
    wait_step(&c, job, 50, 180);
    at_fill = ts_job_status(&c, job, s, sizeof(s));
    fill(st_dir);
    /* The step when the store first met the full disk (read just after it said so, so no
     * earlier): SQLite may fit some batches into room its files already hold, no bound of
     * traind's; from that write on, the queue fills and blocks the worker. */
    for (long long until = ts_now_ms() + 30000; at_fail < 0 && ts_now_ms() < until;) {
        if (ts_log_count(&d, "metric store: the disk is full") > 0)
            at_fail = ts_job_status(&c, job, s, sizeof(s));
        else
            usleep(50 * 1000);
    }
    paused = paused_step(&c, job, 1000000, 30);
    at_unfill = ts_job_status(&c, job, s, sizeof(s));
    print_message("disk full at step %lld, the store's first failed write by step %lld: %s; step "
                  "%lld when room came back\n",
                  (long long)at_fill, (long long)at_fail,
                  paused >= 0 ? "paused" : "no pause seen in 30 s", (long long)at_unfill);
    /* Paused or only slow, the job cannot get further past that write than its queue holds
     * (65536 samples, some 13000 steps): that is the pause, whatever the box's speed; one that
     * never paused passes the bound within the 30 s on the plain build. Under a slow build the
     * store may not have met the full disk yet, and there is nothing to bound. */
    if (at_fail >= 0)
        assert_true(at_unfill - at_fail < 14000 + 5000);
    unfill(st_dir);
    /* Room again: the queue drains and the job trains on. */
    wait_step(&c, job, at_unfill + PAST_PAUSE_STEPS, 300);
    cancel_job(&c, job, s, sizeof(s));
    wait_ended(&c, job, s, sizeof(s), 600);
    assert_string_equal(s, "cancelled");
    rows = loss_rows(d.db, job, &max_step);
    assert_true(max_step >= at_unfill + PAST_PAUSE_STEPS);
    assert_int_equal(rows, max_step);
    assert_true(ts_log_count(&d, "metric store: the disk is full") >= 1);
    assert_true(ts_log_count(&d, "metric store: writing again") >= 1);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
    full_dir_remove(top, st_dir);
}

/* The disk stays full past the wait: the job fails with a disk-full error, at most what the
 * metric queue holds past the store's first failed write (the old behaviour: training on to its
 * millionth step, rows lost), status shows it failed at once, and its row says so, with the error,
 * once there is room (a state that cannot be written meanwhile is kept: test_outside_write_lock
 * shows that for certain; here SQLite may fit the small write into WAL space a failed batch
 * left). A reader of the test's own holds checkpoints back, so that every metric batch needs
 * new room. */
static void test_disk_full_fails_job_and_keeps_outcome(void **state)
{
    ts_daemon d;
    ts_client c;
    char top[64], st_dir[128], s[32], msg[1024], conf[128];
    sqlite3 *h = NULL;
    FILE *f;
    int64_t job, at_fill, at_end, rows, max_step = 0;

    full_dir(top, sizeof(top), st_dir, sizeof(st_dir));
    /* The configuration outside the small file system, which is about to be full. */
    snprintf(conf, sizeof(conf), "%s/traind.conf", top);
    f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "[metrics]\ndisk_full_wait_s = %d\n", FULL_WAIT_S);
    assert_int_equal(fclose(f), 0);
    start_in_conf(&d, st_dir, "cpu:1", conf);
    ts_connect_hello(&c, d.sock);
    job = submit_mlp(&c, "stays-full", 1000000, 0);
    wait_step(&c, job, 50, 180);
    assert_int_equal(sqlite3_open(d.db, &h), SQLITE_OK);
    /* The daemon's own writes hold the lock now and then, briefly. */
    sqlite3_busy_timeout(h, 10000);
    assert_int_equal(sqlite3_exec(h, "BEGIN; SELECT count(*) FROM jobs;", NULL, NULL, NULL),
                     SQLITE_OK);
    fill(st_dir);
    /* Counted from the store's first failed write, not from the fill: SQLite may still fit
     * some batches into room its files already hold, for as long as that lasts, which is no
     * bound of traind's. From the failure on, the queue fills and blocks the worker. */
    ts_wait_log(&d, "metric store: the disk is full", 1, FULL_WAIT_S + 120);
    at_fill = ts_job_status(&c, job, s, sizeof(s));
    ts_wait_state(&c, job, "failed", FULL_WAIT_S + 120);
    at_end = ts_job_status(&c, job, s, sizeof(s));
    if (at_end - at_fill > 14000 + 5000)
        fail_msg("job went on from step %lld to %lld while its metrics could not be stored",
                 (long long)at_fill, (long long)at_end);
    assert_true(ts_log_count(&d, "metric store: the disk is full") >= 1);
    assert_true(ts_log_count(&d, "metric store: the disk stayed full") >= 1);
    unfill(st_dir);
    assert_int_equal(sqlite3_exec(h, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(h);
    wait_stored_state(d.db, job, "failed", msg, sizeof(msg), 60);
    if (strstr(msg, "metrics could not be stored: disk full: no room to store metrics for 5 s") ==
        NULL)
        fail_msg("the failed job's error (after disk_full_wait_s = %d): \"%s\"", FULL_WAIT_S, msg);
    /* What was stored is every step up to a point, none missing in between. */
    rows = loss_rows(d.db, job, &max_step);
    assert_int_equal(rows, max_step);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
    unlink(conf);
    full_dir_remove(top, st_dir);
}

/* A state directory of its own whose checkpoints/ is a small tmpfs, full from the start, and
 * a traind.conf of disk_full_wait_s = wait_s beside it: the store has room, the checkpoints
 * none. top, st_dir, ck_dir and conf are filled; skips the test where mount(2) is refused. */
static void full_checkpoints(char *top, char *st_dir, char *ck_dir, char *conf, size_t size,
                             int wait_s)
{
    FILE *f;

    snprintf(top, size, "/tmp/traind-ckfull.XXXXXX");
    assert_non_null(mkdtemp(top));
    snprintf(st_dir, size, "%s/state", top);
    snprintf(ck_dir, size, "%s/checkpoints", st_dir);
    snprintf(conf, size, "%s/traind.conf", top);
    assert_int_equal(mkdir(st_dir, 0750), 0);
    assert_int_equal(mkdir(ck_dir, 0700), 0);
    if (tmpfs_or_skip(ck_dir, "1m") != 0) {
        rmdir(ck_dir);
        rmdir(st_dir);
        rmdir(top);
        skip();
    }
    fill(ck_dir);
    f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "[metrics]\ndisk_full_wait_s = %d\n", wait_s);
    assert_int_equal(fclose(f), 0);
}

static void full_checkpoints_remove(const char *top, const char *st_dir, const char *ck_dir,
                                    const char *conf)
{
    char cmd[400];

    assert_int_equal(umount2(ck_dir, MNT_DETACH), 0);
    unlink(conf);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", top);
    assert_int_equal(system(cmd), 0);
    (void)st_dir;
}

/* A job that trains all its steps while its checkpoints' disk is full: the final checkpoint
 * waits disk_full_wait_s for room, then the job fails saying that every step trained and which
 * checkpoint could not be written; every metric row of its 200 steps is kept, and status says
 * it took them all (it used to fail at once as "checkpoint at step 200: ..."). */
static void test_full_disk_final_checkpoint_says_all_trained(void **state)
{
    ts_daemon d;
    ts_client c;
    char top[128], st_dir[128], ck_dir[128], conf[128], s[32], msg[1024];
    int64_t job, rows, max_step = 0;

    full_checkpoints(top, st_dir, ck_dir, conf, sizeof(top), 2);
    start_in_conf(&d, st_dir, "cpu:1", conf);
    ts_connect_hello(&c, d.sock);
    job = submit_mlp(&c, "ckpt-full", 200, 0);
    ts_wait_state(&c, job, "failed", 120);
    assert_int_equal(ts_job_status(&c, job, s, sizeof(s)), 200);
    wait_stored_state(d.db, job, "failed", msg, sizeof(msg), 30);
    if (strstr(msg, "all 200 steps trained, but the final checkpoint (step 200) could not be "
                    "written in 2 s of waiting for room: ") == NULL ||
        strstr(msg, "No space left on device") == NULL)
        fail_msg("the job's error: \"%s\"", msg);
    assert_int_equal(ts_log_count(&d, "checkpoint at step 200: the disk is full; waiting up to "
                                      "2 s for room"),
                     1);
    rows = loss_rows(d.db, job, &max_step);
    assert_int_equal(max_step, 200);
    assert_int_equal(rows, 200);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
    full_checkpoints_remove(top, st_dir, ck_dir, conf);
}

/* The same job, with room back while its final checkpoint waits for it: the checkpoint is
 * written and the job succeeds, as a metric write that waited would have. */
static void test_full_disk_checkpoint_waits_for_room(void **state)
{
    ts_daemon d;
    ts_client c;
    char top[128], st_dir[128], ck_dir[128], conf[128], path[300];
    int64_t job;
    glob_t g;

    full_checkpoints(top, st_dir, ck_dir, conf, sizeof(top), 120);
    start_in_conf(&d, st_dir, "cpu:1", conf);
    ts_connect_hello(&c, d.sock);
    job = submit_mlp(&c, "ckpt-room", 200, 0);
    ts_wait_log(&d, "checkpoint at step 200: the disk is full", 1, 120);
    unfill(ck_dir);
    ts_wait_state(&c, job, "succeeded", 60);
    assert_true(ts_log_count(&d, "checkpoint at step 200 written after") == 1);
    snprintf(path, sizeof(path), "%s/%lld/*", ck_dir, (long long)job);
    assert_int_equal(glob(path, 0, NULL, &g), 0);
    assert_true(g.gl_pathc >= 1);
    globfree(&g);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
    full_checkpoints_remove(top, st_dir, ck_dir, conf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_one_daemon_per_state_dir, ts_kill_leftover),
        cmocka_unit_test_teardown(test_refused_start_creates_nothing, ts_kill_leftover),
        cmocka_unit_test_teardown(test_modes_of_what_traind_creates, ts_kill_leftover),
        cmocka_unit_test_teardown(test_outside_write_lock, ts_kill_leftover),
        cmocka_unit_test_teardown(test_outside_reader_holds_wal, ts_kill_leftover),
        cmocka_unit_test_teardown(test_disk_full_pauses_then_resumes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_disk_full_fails_job_and_keeps_outcome, ts_kill_leftover),
        cmocka_unit_test_teardown(test_full_disk_final_checkpoint_says_all_trained,
                                  ts_kill_leftover),
        cmocka_unit_test_teardown(test_full_disk_checkpoint_waits_for_room, ts_kill_leftover),
    };

    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_ONLY=test_outside_write_lock runs that one (a pattern, as cmocka takes it). */
    if (getenv("TD_TEST_ONLY") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_ONLY"));
    return cmocka_run_group_tests_name("statedir", tests, NULL, NULL);
}
