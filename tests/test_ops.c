/* Integration tests of what traind gives operators: the Prometheus textfile ([metrics]
 * prometheus_textfile) read back with a real parser of the exposition format (the Python
 * client's, python3-prometheus-client; and promtool's lint where promtool is installed) while
 * a job runs, after state changes and after the stop; and traind's own log lines, with
 * journald's "<N>" prefixes only when its stderr is the journal's stream. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
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

#include "tests/jobs_support.h"
#include "tests/support.h"

#define PYTHON "/usr/bin/python3" /* Debian's, which has python3-prometheus-client */

/* The parser: every sample of the file as "name|label=value,...|value", labels sorted. A file
 * the parser refuses makes it exit non-zero with its reason on stderr. */
static const char parse_py[] =
    "import sys\n"
    "from prometheus_client.parser import text_string_to_metric_families\n"
    "for fam in text_string_to_metric_families(open(sys.argv[1]).read()):\n"
    "    for s in fam.samples:\n"
    "        labels = ','.join('%s=%s' % (k, s.labels[k]) for k in sorted(s.labels))\n"
    "        print('%s|%s|%r' % (s.name, labels, s.value))\n";

/* A parsed file: the parser's lines. */
typedef struct parsed {
    char text[65536];
} parsed;

/* Runs a shell command, its output into out (size bytes); returns its exit status. */
static int run(const char *cmd, char *out, size_t size)
{
    FILE *p = popen(cmd, "r");
    size_t n;
    int status;

    assert_non_null(p);
    n = fread(out, 1, size - 1, p);
    out[n] = '\0';
    status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Parses the file at path with the Python client's parser, and lints it with promtool when
 * there is one ($PROMTOOL, else on PATH). Fails the test when either refuses it. */
static void parse(const char *path, parsed *out)
{
    char cmd[1024], lint[4096];
    const char *promtool = getenv("PROMTOOL");
    FILE *py;

    snprintf(cmd, sizeof(cmd), "%s.py", path);
    py = fopen(cmd, "w");
    assert_non_null(py);
    fputs(parse_py, py);
    fclose(py);
    snprintf(cmd, sizeof(cmd), "%s %s.py %s", PYTHON, path, path);
    if (run(cmd, out->text, sizeof(out->text)) != 0)
        fail_msg("the Prometheus parser refused %s (python3-prometheus-client missing? run "
                 "scripts/deps.sh)",
                 path);
    snprintf(cmd, sizeof(cmd), "%s.py", path);
    unlink(cmd);
    if (promtool == NULL && run("command -v promtool", lint, sizeof(lint)) == 0)
        promtool = "promtool";
    if (promtool != NULL) {
        snprintf(cmd, sizeof(cmd), "%s check metrics < %s 2>&1", promtool, path);
        if (run(cmd, lint, sizeof(lint)) != 0)
            fail_msg("promtool check metrics: %s", lint);
    }
}

/* The value of sample name{labels} ("k=v,k=v", sorted), or NaN when the file has none. */
static double value_of(const parsed *p, const char *name, const char *labels)
{
    char key[512];
    const char *at;

    snprintf(key, sizeof(key), "%s|%s|", name, labels);
    for (at = strstr(p->text, key); at != NULL; at = strstr(at + 1, key))
        if (at == p->text || at[-1] == '\n')
            return strtod(at + strlen(key), NULL);
    return NAN;
}

/* How many samples of name the file has. */
static int samples_of(const parsed *p, const char *name)
{
    char key[256];
    int n = 0;

    snprintf(key, sizeof(key), "\n%s|", name);
    for (const char *at = strstr(p->text, key); at != NULL; at = strstr(at + 1, key))
        n++;
    return n + (strncmp(p->text, key + 1, strlen(key + 1)) == 0);
}

/* Waits until the file exists, parses it until check(p, ud) holds, and fails after
 * timeout_s saying what it read last. */
typedef int (*check_fn)(const parsed *p, const void *ud);
static void wait_for(const char *path, parsed *p, check_fn check, const void *ud, int timeout_s,
                     const char *what)
{
    long long until = ts_now_ms() + timeout_s * 1000LL;
    struct stat st;

    while (ts_now_ms() < until) {
        if (stat(path, &st) == 0) {
            parse(path, p);
            if (check(p, ud))
                return;
        }
        usleep(100 * 1000);
    }
    fail_msg("%s: not within %d s; the file said:\n%s", what, timeout_s, p->text);
}

static int written(const parsed *p, const void *ud)
{
    (void)ud;
    return value_of(p, "traind_up", "") == 1;
}

/* The job's labels, as the parser gives them back. */
typedef struct job_at {
    char labels[256];
    double step; /* a step the file must pass */
} job_at;

static int job_past(const parsed *p, const void *ud)
{
    const job_at *j = ud;

    return value_of(p, "traind_job_step", j->labels) > j->step;
}

/* Past j's step, and its latest stored train_loss in the file too: the step is the live one,
 * the loss the metric store's latest row, which may lag behind it (far, under TSan). */
static int job_past_with_loss(const parsed *p, const void *ud)
{
    const job_at *j = ud;

    return job_past(p, ud) && isfinite(value_of(p, "traind_job_train_loss", j->labels));
}

static int state_count(const parsed *p, const void *ud)
{
    const char *const *want = ud; /* {state, count} */

    return value_of(p, "traind_jobs", want[0]) == atof(want[1]);
}

/* A fresh directory for the file, outside the daemon's (ts_daemon_stop removes that one, and
 * the file is read after the stop too). */
static void prom_dir(char *dir, size_t size, char *path, size_t psize)
{
    snprintf(dir, size, "/tmp/traind-prom.XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_int_equal(chmod(dir, 0755), 0);
    snprintf(path, psize, "%s/traind.prom", dir);
}

static void remove_dir(const char *dir)
{
    char cmd[300];

    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

/* ---- the file while a job runs ---- */

static void test_prometheus_file(void **state)
{
    static parsed p; /* 64 KiB: not on the stack */
    char dir[64], path[128], conf[512], victim[160], tmp[160], buf[32] = "";
    const char *cancelled[] = {"state=cancelled", "1"};
    ts_daemon d;
    ts_client c;
    job_at j = {0};
    struct stat st;
    double step1, rows1, busy;
    int64_t job;
    FILE *v;

    (void)state;
    prom_dir(dir, sizeof(dir), path, sizeof(path));
    /* Whatever sits where the file is written through must not be written through: a link
     * to a file of someone else's. */
    snprintf(victim, sizeof(victim), "%s/victim", dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    v = fopen(victim, "w");
    assert_non_null(v);
    fputs("untouched", v);
    fclose(v);
    assert_int_equal(symlink(victim, tmp), 0);
    snprintf(conf, sizeof(conf),
             "[metrics]\nprometheus_textfile = %s\nprometheus_interval_s = 0.5\n", path);
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    ts_daemon_start_conf(&d, "cpu:2", conf);
    ts_connect_hello(&c, d.sock);

    /* Before any job. */
    wait_for(path, &p, written, NULL, 60, "the first write");
    assert_true(value_of(&p, "traind_jobs", "state=queued") == 0);
    assert_true(value_of(&p, "traind_jobs", "state=running") == 0);
    assert_true(value_of(&p, "traind_queue_length", "") == 0);
    assert_true(value_of(&p, "traind_device_busy", "device=cpu:0") == 0);
    assert_true(value_of(&p, "traind_device_busy", "device=cpu:1") == 0);
    assert_true(value_of(&p, "traind_device_memory_total_bytes", "device=cpu:1") > 0);
    assert_true(value_of(&p, "traind_device_memory_used_bytes", "device=cpu:0") > 0);
    assert_true(value_of(&p, "traind_uptime_seconds", "") >= 0);
    assert_true(value_of(&p, "traind_worker_restarts_total", "") == 0);
    assert_true(value_of(&p, "traind_info", "version=" TD_VERSION) == 1);
    assert_int_equal(samples_of(&p, "traind_job_step"), 0);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0644);
    assert_int_equal(lstat(tmp, &st), -1); /* the link went, replaced by the file */
    v = fopen(victim, "r");
    assert_non_null(v);
    assert_non_null(fgets(buf, sizeof(buf), v));
    fclose(v);
    assert_string_equal(buf, "untouched");

    /* A running job, whose name needs escaping: its step grows from one write to the next. */
    job = tj_submit(&c, "q\"uo\\te", 64, 1000000, NULL, 0);
    ts_wait_state(&c, job, "running", 60);
    snprintf(j.labels, sizeof(j.labels), "job=%lld,name=q\"uo\\te,uid=0", (long long)job);
    j.step = 0;
    wait_for(path, &p, job_past_with_loss, &j, 60, "the job's first steps and loss");
    step1 = value_of(&p, "traind_job_step", j.labels);
    rows1 = value_of(&p, "traind_metric_rows_written_total", "");
    assert_true(value_of(&p, "traind_jobs", "state=running") == 1);
    assert_true(value_of(&p, "traind_job_total_steps", j.labels) == 1000000);
    assert_true(isfinite(value_of(&p, "traind_job_train_loss", j.labels)));
    busy = value_of(&p, "traind_device_busy", "device=cpu:0") +
           value_of(&p, "traind_device_busy", "device=cpu:1");
    assert_true(busy == 1);
    j.step = step1;
    wait_for(path, &p, job_past, &j, 60, "the job's step growing");
    assert_true(value_of(&p, "traind_metric_rows_written_total", "") > rows1);
    assert_true(value_of(&p, "traind_job_samples_per_second", j.labels) > 0);
    assert_true(isnan(value_of(&p, "traind_job_tokens_per_second", j.labels)));
    assert_true(value_of(&p, "traind_metric_queue_blocked_seconds_total", "") >= 0);
    assert_true(value_of(&p, "traind_store_size_bytes", "") > 0);

    /* Cancelled: the state counts move and the job's series go. */
    ts_send_job_request(&c, "cancel", job);
    td_proto_frame_free(ts_client_recv(&c));
    ts_wait_state(&c, job, "cancelled", 60);
    wait_for(path, &p, state_count, cancelled, 60, "the cancelled job counted");
    assert_true(value_of(&p, "traind_jobs", "state=running") == 0);
    assert_int_equal(samples_of(&p, "traind_job_step"), 0);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);

    /* The file a clean stop leaves says so. */
    parse(path, &p);
    assert_true(value_of(&p, "traind_up", "") == 0);
    assert_true(value_of(&p, "traind_jobs", "state=cancelled") == 1);
    remove_dir(dir);
}

/* With an interval of an hour, only the state changes write: each shows at once. */
static void test_prometheus_state_changes(void **state)
{
    static parsed p;
    char dir[64], path[128], conf[512];
    const char *running[] = {"state=running", "1"}, *cancelled[] = {"state=cancelled", "1"};
    ts_daemon d;
    ts_client c;
    int64_t job;

    (void)state;
    prom_dir(dir, sizeof(dir), path, sizeof(path));
    snprintf(conf, sizeof(conf),
             "[metrics]\nprometheus_textfile = %s\nprometheus_interval_s = 3600\n", path);
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    ts_daemon_start_conf(&d, "cpu:1", conf);
    ts_connect_hello(&c, d.sock);
    wait_for(path, &p, written, NULL, 60, "the first write");
    job = tj_submit(&c, "long", 64, 1000000, NULL, 0);
    ts_wait_state(&c, job, "running", 60);
    wait_for(path, &p, state_count, running, 60, "the job counted as running");
    ts_send_job_request(&c, "cancel", job);
    td_proto_frame_free(ts_client_recv(&c));
    ts_wait_state(&c, job, "cancelled", 60);
    wait_for(path, &p, state_count, cancelled, 60, "the job counted as cancelled");
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
    remove_dir(dir);
}

/* A bad key stops the start, naming it; a missing directory too. */
static void test_prometheus_config(void **state)
{
    char dir[64], path[128], conf[512], log[320], cmd[2048];
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    ts_daemon d;
    int status;
    FILE *f;

    (void)state;
    prom_dir(dir, sizeof(dir), path, sizeof(path));
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    snprintf(log, sizeof(log), "%s/traind.log", d.dir);
    const char *bad[][2] = {
        {"prometheus_textfile = relative.prom", "expected an absolute path ending in .prom"},
        {"prometheus_textfile = /tmp/x.txt", "expected an absolute path ending in .prom"},
        {"prometheus_textfile_mode = 0755", "no execute bit"},
        {"prometheus_textfile_mode = 644", "with a leading 0"},
        {"prometheus_interval_s = 0", "expected a number above 0"},
        {"prometheus_textfile = /tmp/traind-no-such-dir/x.prom", "does not exist"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(conf, sizeof(conf), "%s/traind.conf", d.dir);
        f = fopen(conf, "w");
        assert_non_null(f);
        fprintf(f, "[metrics]\n%s\n", bad[i][0]);
        fclose(f);
        snprintf(cmd, sizeof(cmd), "%s --config %s --socket %s/s.sock --state-dir %s/st 2> %s", bin,
                 conf, d.dir, d.dir, log);
        status = system(cmd);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 78);
        if (ts_log_count(&d, bad[i][1]) != 1)
            fail_msg("%s: the log does not say \"%s\"", bad[i][0], bad[i][1]);
    }
    remove_dir(d.dir);
    remove_dir(dir);
}

/* ---- traind's log lines ---- */

/* Starts traind with its stderr on d->dir/traind.log, JOURNAL_STREAM naming that file when
 * journal is set, as systemd names the journal's stream; checks its lines' starts, and stops
 * it. */
static void check_lines(int journal)
{
    char log[320], v[64], line[1024];
    int y, mo, da, h, mi, s, ms, n = 0;
    struct stat st;
    ts_daemon d;
    FILE *f;

    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    snprintf(log, sizeof(log), "%s/traind.log", d.dir);
    f = fopen(log, "w"); /* the same file (inode) the daemon's stderr opens in append mode */
    assert_non_null(f);
    fclose(f);
    assert_int_equal(stat(log, &st), 0);
    snprintf(v, sizeof(v), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    if (journal)
        setenv("JOURNAL_STREAM", v, 1);
    ts_daemon_start_in(&d, "cpu:1");
    unsetenv("JOURNAL_STREAM");
    ts_wait_log(&d, "listening on", 1, 60);
    f = fopen(log, "r");
    assert_non_null(f);
    while (fgets(line, sizeof(line), f) != NULL) {
        n++;
        if (journal && (line[0] != '<' || line[1] < '0' || line[1] > '7' || line[2] != '>'))
            fail_msg("stderr is the journal, but a line has no <N> prefix: %s", line);
        if (!journal &&
            (sscanf(line, "%4d-%2d-%2d %2d:%2d:%2d.%3d ", &y, &mo, &da, &h, &mi, &s, &ms) != 7 ||
             line[0] == '<'))
            fail_msg("stderr is a file, but a line is not \"DATE TIME LEVEL: ...\": %s", line);
    }
    fclose(f);
    assert_true(n >= 1);
    assert_int_equal(ts_log_count(&d, journal ? "<5>traind " : " notice: traind "), 1);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

static void test_journal_prefixes(void **state)
{
    (void)state;
    check_lines(1);
    check_lines(0);
}

/* Starts traind on conf (the [metrics] lines) and expects it to refuse at once, exit 78,
 * saying want in its log. A daemon that starts anyway is stopped by timeout (exit 124). */
static void expect_refusal(ts_daemon *d, const char *bin, const char *lines, const char *want)
{
    char conf[320], log[320], cmd[2048];
    int status;
    FILE *f;

    snprintf(conf, sizeof(conf), "%s/traind.conf", d->dir);
    snprintf(log, sizeof(log), "%s/traind.log", d->dir);
    f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "[metrics]\n%s\n", lines);
    fclose(f);
    snprintf(cmd, sizeof(cmd),
             "timeout 20 %s --config %s --socket %s/s.sock --state-dir %s/st 2> %s", bin, conf,
             d->dir, d->dir, log);
    status = system(cmd);
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) != 78 || ts_log_count(d, want) != 1)
        fail_msg("%s: expected exit 78 and \"%s\", got exit %d", lines, want, WEXITSTATUS(status));
}

/* The file's directory, and each above it, must be safe from users other than root and
 * traind's own: owned by another uid, writable by another group or by everyone and not sticky,
 * or a symbolic link, it is refused at the start, naming it. */
static void test_prometheus_insecure_dir(void **state)
{
    char dir[64], path[128], sub[128], lines[300], want[300];
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    ts_daemon d;

    (void)state;
    prom_dir(dir, sizeof(dir), path, sizeof(path));
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    snprintf(lines, sizeof(lines), "prometheus_textfile = %s", path);

    /* Writable by every user and not sticky. */
    assert_int_equal(chmod(dir, 0777), 0);
    snprintf(want, sizeof(want), "insecure directory %s: writable by every user and not sticky",
             dir);
    expect_refusal(&d, bin, lines, want);
    assert_int_equal(chmod(dir, 0755), 0);

    /* A symbolic link on the way: dir/link -> dir/real. */
    snprintf(sub, sizeof(sub), "%s/real", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    snprintf(sub, sizeof(sub), "%s/link", dir);
    assert_int_equal(symlink("real", sub), 0);
    snprintf(lines, sizeof(lines), "prometheus_textfile = %s/traind.prom", sub);
    snprintf(want, sizeof(want), "insecure directory %s: a symbolic link", sub);
    expect_refusal(&d, bin, lines, want);

    if (geteuid() != 0) {
        print_message("not root: the checks of other owners and groups are skipped\n");
    } else {
        /* Owned by another uid (Debian's prometheus owning /var/lib/prometheus). */
        assert_int_equal(chown(dir, 65534, 65534), 0);
        snprintf(lines, sizeof(lines), "prometheus_textfile = %s", path);
        snprintf(want, sizeof(want), "insecure directory %s: owned by uid 65534", dir);
        expect_refusal(&d, bin, lines, want);
        /* A parent owned by another uid: dir/real is root's, dir is not. */
        snprintf(lines, sizeof(lines), "prometheus_textfile = %s/real/traind.prom", dir);
        expect_refusal(&d, bin, lines, want);
        /* Writable by a group not root's. */
        assert_int_equal(chown(dir, 0, 65534), 0);
        assert_int_equal(chmod(dir, 0775), 0);
        snprintf(lines, sizeof(lines), "prometheus_textfile = %s", path);
        snprintf(want, sizeof(want),
                 "insecure directory %s: writable by group 65534 and not sticky", dir);
        expect_refusal(&d, bin, lines, want);
        assert_int_equal(chown(dir, 0, 0), 0);
        assert_int_equal(chmod(dir, 0755), 0);
    }
    assert_int_equal(access(path, F_OK), -1);
    remove_dir(d.dir);
    remove_dir(dir);
}

/* A write after the file's path changed: whether traind_uptime_seconds moved past ud's. */
static int uptime_past(const parsed *p, const void *ud)
{
    return value_of(p, "traind_uptime_seconds", "") > *(const double *)ud;
}

/* The directory is held from the start: swapped for a link to another directory afterwards,
 * nothing appears in that one, and the writes go on into the held directory (its old name);
 * a link planted at the temporary file's name there is not written through. */
static void test_prometheus_dir_swapped(void **state)
{
    static parsed p;
    char dir[64], path[128], held[96], held_path[160], other[96], conf[512], victim[160], tmp[192],
        buf[32] = "", line[300];
    ts_daemon d;
    struct stat st;
    double up;
    FILE *v;

    (void)state;
    prom_dir(dir, sizeof(dir), path, sizeof(path));
    snprintf(held, sizeof(held), "%s.held", dir);
    snprintf(held_path, sizeof(held_path), "%s/traind.prom", held);
    snprintf(other, sizeof(other), "%s.other", dir);
    snprintf(victim, sizeof(victim), "%s/victim", other);
    snprintf(tmp, sizeof(tmp), "%s/traind.prom.tmp", held);
    snprintf(conf, sizeof(conf),
             "[metrics]\nprometheus_textfile = %s\nprometheus_interval_s = 0.2\n", path);
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    ts_daemon_start_conf(&d, "cpu:1", conf);
    wait_for(path, &p, written, NULL, 60, "the first write");

    /* The directory's owner swaps it: the old one moved aside, a link to another in its
     * place, and a link to a file there planted at the temporary file's name. */
    assert_int_equal(mkdir(other, 0755), 0);
    v = fopen(victim, "w");
    assert_non_null(v);
    fputs("untouched", v);
    fclose(v);
    assert_int_equal(rename(dir, held), 0);
    assert_int_equal(symlink(other, dir), 0);
    parse(held_path, &p);
    up = value_of(&p, "traind_uptime_seconds", "");
    for (int tries = 0; symlink(victim, tmp) != 0; tries++) { /* a write may be under way */
        assert_true(errno == EEXIST && tries < 100);
        unlink(tmp);
    }
    wait_for(held_path, &p, uptime_past, &up, 60, "a write into the held directory");
    snprintf(line, sizeof(line), "prometheus: %s is no longer the directory traind opened", dir);
    ts_wait_log(&d, line, 1, 60);
    assert_int_equal(stat(held_path, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(st.st_mode & 07777, 0644);
    assert_int_equal(ts_daemon_stop(&d), 0);

    /* Nothing reached the other directory, the victim is as it was, and the last write (the
     * clean stop's) is in the held one too. */
    snprintf(line, sizeof(line), "%s/traind.prom", other);
    assert_int_equal(lstat(line, &st), -1);
    snprintf(line, sizeof(line), "%s/traind.prom.tmp", other);
    assert_int_equal(lstat(line, &st), -1);
    v = fopen(victim, "r");
    assert_non_null(v);
    assert_non_null(fgets(buf, sizeof(buf), v));
    fclose(v);
    assert_string_equal(buf, "untouched");
    parse(held_path, &p);
    assert_true(value_of(&p, "traind_up", "") == 0);
    assert_int_equal(unlink(dir), 0);
    remove_dir(held);
    remove_dir(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_prometheus_file, ts_kill_leftover),
        cmocka_unit_test_teardown(test_prometheus_state_changes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_prometheus_config, ts_kill_leftover),
        cmocka_unit_test_teardown(test_prometheus_insecure_dir, ts_kill_leftover),
        cmocka_unit_test_teardown(test_prometheus_dir_swapped, ts_kill_leftover),
        cmocka_unit_test_teardown(test_journal_prefixes, ts_kill_leftover),
    };

    return cmocka_run_group_tests_name("ops", tests, NULL, NULL);
}
