/* Integration tests of trainctl (TRAINCTL_BIN) as a user drives it: exit statuses (64 usage,
 * 69 unreachable with the socket named, 77 for an EPERM error frame, 78 for an impossible
 * socket path), --help on every verb, -o json as a synonym of --json, info and logs, plot's
 * PNG and SVG files (the SVG's text as <text> elements, --panels, --log), the completion
 * scripts sourced into a real bash, zsh and fish and asked to complete, ls's filters refused
 * by a traind too old for them, submit --dry-run's estimate (and that it creates no job), and
 * the GPU path's job keys refused with the field named. A real traind
 * (TRAIND_BIN) runs a short job on a temporary socket; a fake one, forked here, answers every
 * request with an EPERM error frame. */
#include <signal.h>
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

#include <setjmp.h>

#include <cmocka.h>

#include "proto/proto.h"

#define OUT_MAX (1 << 20) /* bytes of a command's stdout or stderr kept for checks */

static char dir[256];  /* the test's temporary directory */
static char sock[320]; /* the real daemon's socket */
static char fake[320]; /* the fake daemon's socket */
static pid_t daemon_pid = -1, fake_pid = -1;
static char out[OUT_MAX], err[OUT_MAX];

static const char *env_or(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : dflt;
}

static void slurp(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "rb");
    size_t n = f != NULL ? fread(buf, 1, size - 1, f) : 0;

    buf[n] = '\0';
    if (f != NULL)
        fclose(f);
}

static char big[OUT_MAX]; /* a file's text, for checks */

static size_t count_of(const char *hay, const char *needle)
{
    size_t n = 0;

    for (const char *p = strstr(hay, needle); p != NULL; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* Runs a shell command with TRAIND_SOCKET unset, its stdout and stderr kept in out and err;
 * returns its exit status. */
static int sh(const char *command)
{
    char cmd[4096], o[300], e[300];
    int status;

    snprintf(o, sizeof(o), "%s/out", dir);
    snprintf(e, sizeof(e), "%s/err", dir);
    snprintf(cmd, sizeof(cmd), "unset TRAIND_SOCKET; (%s) >%s 2>%s", command, o, e);
    status = system(cmd);
    slurp(o, out, sizeof(out));
    slurp(e, err, sizeof(err));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static const char *trainctl_bin(void)
{
    return env_or("TRAINCTL_BIN", "build/client/trainctl");
}

/* Runs `trainctl ARGS` (a printf format) through sh. */
static int tc(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int tc(const char *fmt, ...)
{
    char cmd[2048];
    size_t n = (size_t)snprintf(cmd, sizeof(cmd), "%s ", trainctl_bin());
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(cmd + n, sizeof(cmd) - n, fmt, ap);
    va_end(ap);
    return sh(cmd);
}

static int can_connect(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM, 0), ok;

    memcpy(sa.sun_path, path, strlen(path) + 1);
    ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

static void wait_listening(const char *path)
{
    for (int i = 0; i < 1200; i++) { /* 60 s: a sanitizer build on a loaded box */
        if (can_connect(path))
            return;
        usleep(50 * 1000);
    }
    fail_msg("nothing listened on %s within 60 s", path);
}

/* Starts a traind with one cpu device on STATE/traind.sock (sock_out), its log in STATE. */
static pid_t traind_start(const char *state, char *sock_out, size_t size)
{
    const char *bin = env_or("TRAIND_BIN", "build/daemon/traind");
    char log[320];
    pid_t pid;

    snprintf(sock_out, size, "%s/traind.sock", state);
    snprintf(log, sizeof(log), "%s/traind.log", state);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (freopen(log, "a", stderr) == NULL || freopen("/dev/null", "w", stdout) == NULL)
            _exit(126);
        execl(bin, bin, "--socket", sock_out, "--state-dir", state, "--devices", "cpu:1",
              (char *)NULL);
        _exit(127);
    }
    wait_listening(sock_out);
    return pid;
}

static void daemon_start(void)
{
    daemon_pid = traind_start(dir, sock, sizeof(sock));
}

/* ---- the fake daemon: hello, then EPERM for everything ---- */

static void fake_reply(int fd, td_pw *w, const td_pval *req)
{
    int64_t id = -1;
    const char *frame;
    size_t len;

    td_pv_int(td_pv_get(req, "id"), &id);
    td_pw_reset(w);
    if (td_pv_str(td_pv_get(req, "type"), &len) != NULL && len == 5 &&
        memcmp(td_pv_str(td_pv_get(req, "type"), &len), "hello", 5) == 0) {
        td_pw_map(w, 4);
        td_pw_str(w, "type");
        td_pw_str(w, "hello");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "version");
        td_pw_int(w, TD_PROTO_VERSION);
        td_pw_str(w, "server");
        td_pw_str(w, "fake");
    } else {
        td_proto_write_error(w, id, TD_EPERM, "permission denied: job 12 belongs to alice");
    }
    if (td_pw_finish(w, &frame, &len) == 0 && write(fd, frame, len) < 0)
        _exit(1);
}

static void fake_serve(int fd)
{
    td_proto_reader *r = NULL;
    td_proto_frame *f;
    td_error_t e;
    td_pw w;
    char buf[4096];
    ssize_t n;

    td_pw_init(&w);
    td_proto_reader_new(&r, 0);
    while ((n = read(fd, buf, sizeof(buf))) > 0) {
        td_proto_reader_feed(r, buf, (size_t)n);
        while (td_proto_reader_next(r, &f, &e) == 1) {
            fake_reply(fd, &w, td_proto_frame_root(f));
            td_proto_frame_free(f);
        }
    }
    td_proto_reader_free(r);
    td_pw_free(&w);
}

static void fake_start(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int lfd, cfd;

    snprintf(fake, sizeof(fake), "%s/fake.sock", dir);
    memcpy(sa.sun_path, fake, strlen(fake) + 1);
    lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 8), 0);
    fake_pid = fork();
    assert_true(fake_pid >= 0);
    if (fake_pid == 0) {
        while ((cfd = accept(lfd, NULL, NULL)) >= 0) {
            fake_serve(cfd);
            close(cfd);
        }
        _exit(0);
    }
    close(lfd);
}

static int setup(void **state)
{
    char job[600];

    snprintf(dir, sizeof(dir), "/tmp/trainctl-test.XXXXXX");
    assert_non_null(mkdtemp(dir));
    daemon_start();
    fake_start();
    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    /* job 1: 60 steps, evaluated every 20 */
    assert_int_equal(tc("--socket %s submit %s --set max_steps=60 --set eval_every=20", sock, job),
                     0);
    assert_string_equal(out, "1\n");
    assert_int_equal(tc("--socket %s watch 1", sock), 0);
    return 0;
}

static int teardown(void **state)
{
    char cmd[300];

    if (daemon_pid > 0) {
        kill(daemon_pid, SIGTERM);
        waitpid(daemon_pid, NULL, 0);
    }
    if (fake_pid > 0) {
        kill(fake_pid, SIGKILL);
        waitpid(fake_pid, NULL, 0);
    }
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- tests ---- */

static void test_usage_errors_are_64(void **state)
{
    assert_int_equal(tc("--socket %s ls --bogus", sock), 64);
    assert_non_null(strstr(err, "unknown option '--bogus'"));
    assert_int_equal(tc("--socket %s frobnicate", sock), 64);
    assert_int_equal(tc("--socket %s metrics 1 -o yaml", sock), 64);
    assert_int_equal(tc("--socket %s ls -o csv", sock), 64); /* csv is metrics' only */
    assert_int_equal(tc("--socket %s plot 1", sock), 64);
    assert_non_null(strstr(err, "missing -o FILE"));
    assert_int_equal(tc("--socket %s plot 1 -o chart.jpg", sock), 64);
    assert_int_equal(tc("--socket %s plot -o chart.png", sock), 64);
    assert_int_equal(tc("completion tcsh"), 64); /* bash, zsh and fish only */
    assert_int_equal(tc("logs"), 64);
    assert_string_equal(out, "");
}

static void test_help_on_every_verb(void **state)
{
    static const char *const verbs[] = {"submit",  "watch", "status", "ls",   "cancel",
                                        "metrics", "logs",  "plot",   "info", "completion"};
    static char main_help[OUT_MAX];
    char want[64];

    assert_int_equal(tc("--help"), 0);
    memcpy(main_help, out, sizeof(main_help));
    for (size_t i = 0; i < sizeof(verbs) / sizeof(verbs[0]); i++) {
        snprintf(want, sizeof(want), "\n  %s", verbs[i]);
        assert_non_null(strstr(main_help, want));
        assert_int_equal(tc("%s --help", verbs[i]), 0);
        snprintf(want, sizeof(want), "usage: trainctl %s", verbs[i]);
        assert_true(strncmp(out, want, strlen(want)) == 0);
    }
}

static void test_unreachable_is_69_and_names_the_socket(void **state)
{
    char path[400], long_path[200];

    snprintf(path, sizeof(path), "%s/nobody-here.sock", dir);
    assert_int_equal(tc("--socket %s ls", path), 69);
    assert_non_null(strstr(err, path));
    memset(long_path, 'x', sizeof(long_path) - 1);
    long_path[0] = '/';
    long_path[sizeof(long_path) - 1] = '\0';
    assert_int_equal(tc("--socket %s info", long_path), 78);
    assert_non_null(strstr(err, "107"));
    /* no socket there: how to start one; a directory is no socket at all (78) */
    assert_int_equal(tc("--socket %s ls", path), 69);
    assert_non_null(strstr(err, "no such socket; is traind running? Start it"));
    assert_non_null(strstr(err, "$TRAIND_SOCKET"));
    assert_int_equal(tc("--socket %s ls", dir), 78);
    assert_non_null(strstr(err, "it is a directory, not a socket"));
}

static void test_eperm_is_77_with_its_message(void **state)
{
    assert_int_equal(tc("--socket %s cancel 12", fake), 77);
    assert_non_null(strstr(err, "permission denied: job 12 belongs to alice"));
    assert_int_equal(tc("--socket %s status 12 -o json", fake), 77);
    assert_string_equal(out, "");
}

/* `VERB ... -o json` prints exactly what `VERB ... --json` prints. */
static void same_output(const char *with_json, const char *with_o)
{
    static char first[OUT_MAX];

    assert_int_equal(tc("--socket %s %s", sock, with_json), 0);
    memcpy(first, out, sizeof(first));
    assert_true(out[0] == '[' || out[0] == '{');
    assert_int_equal(tc("--socket %s %s", sock, with_o), 0);
    assert_string_equal(out, first);
}

static void test_o_json_is_json(void **state)
{
    same_output("status 1 --json", "status 1 -o json");
    same_output("ls --json", "ls -ojson");
    same_output("metrics 1 --json", "metrics 1 -o=json");
    same_output("metrics 1 --summary --json", "metrics 1 --summary --output json");
    same_output("logs 1 --json", "logs 1 -o json");
    assert_int_equal(tc("--socket %s info -o json", sock), 0);
    assert_non_null(strstr(out, "\"protocol\": 1"));
    assert_non_null(strstr(out, "\"cpu:0\""));
    assert_non_null(strstr(out, "\"free_bytes\": "));
    assert_non_null(strstr(out, "\"total_bytes\": "));
}

static void test_info_and_logs(void **state)
{
    int y, mo, d, h, mi, s;
    char level[16];

    assert_int_equal(tc("--socket %s info", sock), 0);
    assert_non_null(strstr(out, ", protocol 1\n"));
    assert_non_null(strstr(out, "traind.db ("));
    /* "  cpu:0  1234/24000 MiB free  idle": the machine's memory, read from /proc/meminfo */
    {
        const char *dev = strstr(out, "cpu:0  ");
        long long freem = -1, total = -1;
        assert_non_null(dev);
        assert_int_equal(sscanf(dev, "cpu:0  %lld/%lld MiB free  idle", &freem, &total), 2);
        assert_true(freem > 0 && freem <= total);
    }
    assert_non_null(strstr(out, "queue    empty"));
    assert_int_equal(tc("--socket %s logs 1", sock), 0);
    /* every line: 2026-11-30 05:16:51 notice message */
    for (char *line = out; *line != '\0'; line = strchr(line, '\n') + 1) {
        assert_int_equal(
            sscanf(line, "%4d-%2d-%2d %2d:%2d:%2d %15s ", &y, &mo, &d, &h, &mi, &s, level), 7);
        assert_true(strcmp(level, "err") == 0 || strcmp(level, "warning") == 0 ||
                    strcmp(level, "notice") == 0 || strcmp(level, "info") == 0);
    }
    assert_non_null(strstr(out, "succeeded"));
    assert_int_equal(tc("--socket %s logs 999", sock), 1);
}

/* A PNG's signature and its IHDR width and height, w x h. */
static void check_png_size(const char *path, int w, int h)
{
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    unsigned char b[24];
    FILE *f = fopen(path, "rb");

    assert_non_null(f);
    assert_int_equal(fread(b, 1, sizeof(b), f), sizeof(b));
    fclose(f);
    assert_memory_equal(b, sig, sizeof(sig));
    assert_memory_equal(b + 12, "IHDR", 4);
    assert_int_equal((b[16] << 24) | (b[17] << 16) | (b[18] << 8) | b[19], w);
    assert_int_equal((b[20] << 24) | (b[21] << 16) | (b[22] << 8) | b[23], h);
}

/* A PNG's signature and its IHDR width and height. */
static void check_png(const char *path)
{
    static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    unsigned char h[24];
    FILE *f = fopen(path, "rb");
    struct stat st;

    assert_non_null(f);
    assert_int_equal(fread(h, 1, sizeof(h), f), sizeof(h));
    fclose(f);
    assert_memory_equal(h, sig, sizeof(sig));
    assert_memory_equal(h + 12, "IHDR", 4);
    assert_int_equal((h[16] << 24) | (h[17] << 16) | (h[18] << 8) | h[19], 1200);
    assert_int_equal((h[20] << 24) | (h[21] << 16) | (h[22] << 8) | h[23], 700);
    assert_int_equal(stat(path, &st), 0);
    assert_true(st.st_size > 10000); /* axes, labels and curves, not an empty canvas */
}

static void test_plot_png_and_svg(void **state)
{
    char png[300], svg[300], none[300];
    static char text[OUT_MAX];

    snprintf(png, sizeof(png), "%s/loss.png", dir);
    snprintf(svg, sizeof(svg), "%s/loss.svg", dir);
    snprintf(none, sizeof(none), "%s/none.png", dir);
    assert_int_equal(tc("--socket %s plot 1 -o %s", sock, png), 0);
    check_png(png);
    assert_int_equal(tc("--socket %s plot 1 1 --keys train_loss,test_accuracy -o %s", sock, svg),
                     0);
    slurp(svg, text, sizeof(text));
    assert_non_null(strstr(text, "<svg"));
    assert_non_null(strstr(text, "width=\"1200pt\""));
    assert_non_null(strstr(text, "</svg>"));
    /* a job that does not exist: traind's message, status 1, and no file */
    assert_int_equal(tc("--socket %s plot 999 -o %s", sock, none), 1);
    assert_int_equal(access(none, F_OK), -1);
    assert_int_equal(tc("--socket %s plot 1 --keys no_such_metric -o %s", sock, none), 1);
    assert_non_null(strstr(err, "nothing to plot"));
    assert_int_equal(access(none, F_OK), -1);
    assert_int_equal(tc("--socket %s plot 1 -o %s/no/such/dir/x.png", sock, dir), 73);
}

/* Sources the completion script into bash and completes the words given. */
static void complete_words(const char *script, const char *words, int cword)
{
    char cmd[2048];

    /* trainctl on PATH: the script runs it by the name typed, COMP_WORDS[0] */
    snprintf(cmd, sizeof(cmd),
             "PATH=$(dirname %s):$PATH bash -c 'source %s; COMP_WORDS=(%s); COMP_CWORD=%d; "
             "_trainctl; echo \"${COMPREPLY[*]}\"; complete -p trainctl'",
             trainctl_bin(), script, words, cword);
    assert_int_equal(sh(cmd), 0);
}

static void test_completion_bash(void **state)
{
    char script[300], words[600];

    snprintf(script, sizeof(script), "%s/trainctl.bash", dir);
    assert_int_equal(tc("completion bash >%s", script), 0);
    complete_words(script, "trainctl \"\"", 1);
    /* every verb, in the table's order (rm and prune sit between cancel and metrics) */
    assert_non_null(strstr(out, "submit watch status describe ls cancel "));
    assert_non_null(strstr(out, " metrics logs plot info completion "));
    assert_non_null(strstr(out, "complete -F _trainctl trainctl"));
    complete_words(script, "trainctl metrics 1 -o \"\"", 4);
    assert_non_null(strstr(out, "csv json"));
    complete_words(script, "trainctl plot --k", 2);
    assert_string_equal(strtok(out, "\n"), "--keys");
    snprintf(words, sizeof(words), "trainctl --socket %s watch \"\"", sock);
    complete_words(script, words, 4);
    assert_string_equal(strtok(out, "\n"), "1"); /* job 1, asked from traind */
    /* cancel offers only queued and running jobs: job 1 has ended (the first line, the
     * offers, is empty) */
    snprintf(words, sizeof(words), "trainctl --socket %s cancel \"\"", sock);
    complete_words(script, words, 4);
    assert_int_equal(out[0], '\n');
    /* --keys offers the job's own metrics: an mlp's, no tokens_per_s or valid_loss */
    snprintf(words, sizeof(words), "trainctl --socket %s metrics 1 --keys \"\"", sock);
    complete_words(script, words, 6);
    *strchrnul(out, '\n') = '\0';
    assert_non_null(strstr(out, "test_accuracy"));
    assert_non_null(strstr(out, "samples_per_s"));
    assert_null(strstr(out, "tokens_per_s"));
    assert_null(strstr(out, "valid_loss"));
    snprintf(words, sizeof(words), "trainctl --socket %s metrics 1 --keys train_loss,te", sock);
    complete_words(script, words, 6);
    *strchrnul(out, '\n') = '\0';
    assert_string_equal(out, "train_loss,test_accuracy train_loss,test_loss");
    /* no job named: the names every job records */
    complete_words(script, "trainctl plot --keys \"\"", 3);
    *strchrnul(out, '\n') = '\0';
    assert_non_null(strstr(out, "tokens_per_s"));
}

/* What python3's minidom makes of an SVG (which fails on one that is not well-formed XML):
 * "svg WIDTH HEIGHT", "clips N", "uses N", then "text: CONTENT" for every <text> element, its
 * tspans' text included. */
static void svg_facts(const char *path)
{
    char cmd[1400];

    snprintf(cmd, sizeof(cmd),
             "python3 -c 'import sys, xml.dom.minidom as m\n"
             "d = m.parse(sys.argv[1]); s = d.documentElement\n"
             "def text(e): return \"\".join(c.data if c.nodeType == c.TEXT_NODE else text(c) "
             "for c in e.childNodes)\n"
             "print(\"svg\", s.getAttribute(\"width\"), s.getAttribute(\"height\"))\n"
             "print(\"clips\", len(d.getElementsByTagName(\"clipPath\")))\n"
             "print(\"uses\", len(d.getElementsByTagName(\"use\")) + "
             "len(d.getElementsByTagName(\"symbol\")))\n"
             "[print(\"text:\", text(e)) for e in d.getElementsByTagName(\"text\")]' %s",
             path);
    assert_int_equal(sh(cmd), 0);
}

/* Submits a short job whose lr falls to 0 at its last step (rsqrt's cooldown), and waits for
 * it; returns its id. */
static long long submit_lr_to_zero(void)
{
    char job[600];
    long long id;

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set max_steps=20 --set schedule.kind=rsqrt "
                        "--set schedule.cooldown=0.5 --set name=to-zero",
                        sock, job),
                     0);
    id = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s watch %lld", sock, id), 0);
    return id;
}

/* The SVG is written as SVG, text and all: well-formed XML whose axis titles, tick labels,
 * legend and title are <text> elements (no glyph outlines); --panels gives a panel (a clip
 * path, a y axis titled with its key) per key, one step axis, a taller chart; --log labels
 * powers of ten (10 with a raised exponent) and leaves out, saying so, values <= 0. */
static void test_plot_svg_text_panels_log(void **state)
{
    char svg[300], png[300];
    long long zero;

    snprintf(svg, sizeof(svg), "%s/text.svg", dir);
    snprintf(png, sizeof(png), "%s/panels.png", dir);
    assert_int_equal(
        tc("--socket %s plot 1 --keys train_loss,test_loss,test_accuracy -o %s", sock, svg), 0);
    svg_facts(svg);
    assert_non_null(strstr(out, "svg 1200pt 700pt\n"));
    assert_non_null(strstr(out, "clips 1\n"));
    assert_non_null(strstr(out, "uses 0\n"));
    assert_non_null(strstr(out, "text: step\n"));
    assert_non_null(strstr(out, "text: value\n")); /* the y axis: loss and accuracy together */
    assert_non_null(strstr(out, "text: job 1 train_loss\n"));
    assert_non_null(strstr(out, "text: job 1 test_loss\n"));
    assert_non_null(strstr(out, "text: job 1 test_accuracy\n"));
    assert_non_null(strstr(out, "text: fashion-mnist-mlp \xe2\x80\x94 job 1\n"));
    assert_non_null(strstr(out, "text: 0\n")); /* the first step tick */

    assert_int_equal(tc("--socket %s plot 1 --keys train_loss,test_loss,test_accuracy --panels "
                        "-o %s",
                        sock, svg),
                     0);
    svg_facts(svg);
    /* 3 panels of 220 (the least), 2 gaps of 28, 64 above and 74 below: taller than 700 */
    assert_non_null(strstr(out, "svg 1200pt 854pt\n"));
    assert_non_null(strstr(out, "clips 3\n"));
    assert_non_null(strstr(out, "text: train_loss\n"));
    assert_non_null(strstr(out, "text: test_loss\n"));
    assert_non_null(strstr(out, "text: test_accuracy\n"));
    assert_int_equal(count_of(out, "text: step\n"), 1); /* one shared step axis */
    assert_non_null(strstr(out, "text: job 1 test_accuracy\n"));

    assert_int_equal(
        tc("--socket %s plot 1 --keys train_loss,test_loss --panels --log -o %s", sock, png), 0);
    check_png_size(png, 1200, 700); /* 2 panels share the usual height */

    assert_int_equal(tc("--socket %s plot 1 --keys train_loss --log -o %s", sock, svg), 0);
    assert_string_equal(err, "");
    svg_facts(svg);
    assert_non_null(strstr(out, "text: 100\n")); /* 10 with exponent 0 */
    assert_non_null(strstr(out, "text: 101\n")); /* and 1: train_loss runs 0.3 to 2.3 */
    assert_non_null(strstr(out, "text: 10\xe2\x88\x92"
                                "1\n")); /* 10^-1, a real minus */
    slurp(svg, big, sizeof(big));
    assert_non_null(strstr(big, ">10<tspan dy=\""));

    /* An lr that falls to 0: that value is left out of a log axis, and trainctl says so. */
    zero = submit_lr_to_zero();
    assert_int_equal(tc("--socket %s plot %lld --keys lr --log -o %s", sock, zero, svg), 0);
    assert_non_null(strstr(err, "lr: 1 value <= 0 left out"));
    svg_facts(svg);
    assert_non_null(strstr(out, "text: 10\xe2\x88\x92"
                                "3\n")); /* lr starts at 1e-3 */
    assert_int_equal(tc("--socket %s plot %lld --keys lr -o %s", sock, zero, svg), 0);
    assert_string_equal(err, ""); /* a linear axis keeps the 0 */

    /* Two jobs, two keys: a colour per job (tab10's first two), a dash per key (the second
     * key's lines and legend entries dashed), not four unrelated colours. */
    assert_int_equal(tc("--socket %s plot 1 %lld --keys train_loss,lr -o %s", sock, zero, svg), 0);
    slurp(svg, big, sizeof(big));
    assert_int_equal(count_of(big, "stroke-dasharray=\"7 4\""), 4);
    assert_int_equal(count_of(big, "<path d=\"M"), 8); /* 4 series, 4 legend lines */
    assert_int_equal(count_of(big, "stroke=\"#1f77b4\""), 4);
    assert_int_equal(count_of(big, "stroke=\"#ff7f0e\""), 4);
    assert_null(strstr(big, "#2ca02c"));
    /* and a job with nothing to draw is named */
    assert_int_equal(tc("--socket %s plot %lld --keys valid_loss -o %s", sock, zero, svg), 1);
    snprintf(png, sizeof(png), "no finite values of valid_loss in job %lld", zero);
    if (strstr(err, png) == NULL)
        fail_msg("%s", err);
}

/* A shell's completion test needs the shell: skipped (and said so) without it. */
static void need_shell(const char *shell)
{
    char cmd[128];

    snprintf(cmd, sizeof(cmd), "command -v %s", shell);
    if (sh(cmd) != 0) {
        print_message("%s is not installed (scripts/deps.sh installs it): skipped\n", shell);
        skip();
    }
}

/* Completes LINE in an interactive zsh (through zsh/zpty) whose $fpath starts with the
 * directory of the generated _trainctl, compinit loaded as a user's .zshrc would, and prints
 * every match compadd was given, one a line. */
static const char zsh_driver[] =
    "zmodload zsh/zpty || exit 2\n"
    "zpty z zsh -f -i\n"
    "zpty -w z \"PS1=''; fpath=(${(q)1} \\$fpath); autoload -Uz compinit; compinit -u -D\"\n"
    "zpty -w z 'compadd() { if (( ${@[(I)-[OAD]]} )); then builtin compadd \"$@\"; return; fi; "
    "local -a m; builtin compadd -O m \"$@\"; (( $#m )) && print -rl -- \"@@match \"${^m[@]}; "
    "builtin compadd \"$@\"; }'\n"
    "zpty -w z '_zc_done() { print -r -- \"@@\"\"end\"; exit }; comppostfuncs=(_zc_done); "
    "print @@\"\"ready'\n"
    "zpty -r z out '*@@ready*' || exit 3\n"
    "zpty -w -n z \"$2\"$'\\t'\n"
    "zpty -r z out '*@@end*' || exit 4\n"
    "print -rl -- ${${(M)${(f)out//$'\\r'/}:#*@@match *}##*@@match }\n"
    "zpty -d z\n";

static void zsh_complete(const char *fndir, const char *line)
{
    char driver[300], cmd[2048];
    FILE *f;

    snprintf(driver, sizeof(driver), "%s/zcomplete.zsh", dir);
    f = fopen(driver, "w");
    assert_non_null(f);
    assert_true(fputs(zsh_driver, f) >= 0);
    assert_int_equal(fclose(f), 0);
    /* trainctl on PATH: the script runs it by the name typed, for the job ids */
    snprintf(cmd, sizeof(cmd), "PATH=$(dirname %s):$PATH timeout 60 zsh -f %s %s '%s'",
             trainctl_bin(), driver, fndir, line);
    assert_int_equal(sh(cmd), 0);
}

static void test_completion_zsh(void **state)
{
    char fndir[300], line[600];

    need_shell("zsh");
    snprintf(fndir, sizeof(fndir), "%s/zsh", dir);
    assert_int_equal(mkdir(fndir, 0700), 0);
    assert_int_equal(tc("completion zsh >%s/_trainctl", fndir), 0);
    {
        char cmd[400];
        snprintf(cmd, sizeof(cmd), "zsh -n %s/_trainctl", fndir);
        assert_int_equal(sh(cmd), 0);
        assert_string_equal(err, "");
        /* sourced after compinit, it registers itself */
        snprintf(cmd, sizeof(cmd),
                 "zsh -fc 'autoload -Uz compinit; compinit -u -D; source %s/_trainctl; "
                 "print -r -- $_comps[trainctl]'",
                 fndir);
        assert_int_equal(sh(cmd), 0);
        assert_string_equal(out, "_trainctl\n");
    }
    zsh_complete(fndir, "trainctl su");
    assert_string_equal(out, "submit\n");
    zsh_complete(fndir, "trainctl ls --st");
    assert_string_equal(out, "--state\n");
    zsh_complete(fndir, "trainctl ls --state queued,ru");
    assert_string_equal(out, "running\n");
    zsh_complete(fndir, "trainctl metrics 1 -o ");
    assert_string_equal(out, "csv\njson\n");
    snprintf(line, sizeof(line), "trainctl --socket %s watch ", sock);
    zsh_complete(fndir, line);
    assert_true(strncmp(out, "1\n", 2) == 0); /* job 1, asked from traind */
}

/* fish's own completion of LINE (complete -C), with the generated script sourced. */
static void fish_complete(const char *script, const char *line)
{
    char cmd[2048];

    snprintf(cmd, sizeof(cmd),
             "PATH=$(dirname %s):$PATH timeout 60 fish --no-config -c 'source %s; complete "
             "-C\"%s\"'",
             trainctl_bin(), script, line);
    assert_int_equal(sh(cmd), 0);
}

static void test_completion_fish(void **state)
{
    char script[300], cmd[400], line[600];

    need_shell("fish");
    snprintf(script, sizeof(script), "%s/trainctl.fish", dir);
    assert_int_equal(tc("completion fish >%s", script), 0);
    snprintf(cmd, sizeof(cmd), "fish --no-config --no-execute %s", script);
    assert_int_equal(sh(cmd), 0);
    assert_string_equal(err, "");
    fish_complete(script, "trainctl su");
    assert_string_equal(out, "submit\tsubmit a job; prints its id\n");
    fish_complete(script, "trainctl ls --st");
    assert_true(strncmp(out, "--state\t", 8) == 0);
    fish_complete(script, "trainctl ls --state queued,ru");
    assert_true(strncmp(out, "queued,running\t", 15) == 0);
    fish_complete(script, "trainctl plot 1 --p");
    assert_true(strncmp(out, "--panels\t", 9) == 0);
    fish_complete(script, "trainctl completion ");
    assert_non_null(strstr(out, "bash\n"));
    assert_non_null(strstr(out, "fish\n"));
    assert_non_null(strstr(out, "zsh\n"));
    snprintf(line, sizeof(line), "trainctl --socket %s watch ", sock);
    fish_complete(script, line);
    assert_true(strncmp(out, "1\tfashion-mnist-mlp succeeded\n", 30) == 0);
}

/* A traind whose hello does not list list_pages ignores list's filters and would send every
 * job: ls refuses to show that as the jobs that match. */
static void test_ls_filters_need_list_pages(void **state)
{
    assert_int_equal(tc("--socket %s ls --state failed", fake), 69);
    assert_non_null(strstr(err, "too old to filter or limit ls"));
    assert_int_equal(tc("--socket %s ls --limit 3", fake), 69);
    assert_string_equal(out, "");
}

/* ---- submit --dry-run ---- */

/* Writes a job file at DIR/name: a byte-level gpt on DIR/train.txt with batch_size batch (a
 * JSON value: 8, 1048576, "auto"). */
static void write_gpt_job(char *path, size_t size, const char *name, const char *batch)
{
    char text[300];
    FILE *f;

    snprintf(text, sizeof(text), "%s/train.txt", dir);
    f = fopen(text, "w");
    assert_non_null(f);
    for (int i = 0; i < 200; i++)
        fputs("the quick brown fox jumps over the lazy dog\n", f);
    assert_int_equal(fclose(f), 0);
    snprintf(path, size, "%s/%s", dir, name);
    f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "{\"name\": \"%s\", \"model\": {\"kind\": \"gpt\", \"n_layer\": 4, \"n_head\": 4, "
            "\"n_embd\": 256, \"seq_len\": 256, \"vocab_size\": 256}, \"data\": {\"kind\": "
            "\"text\", \"train\": \"%s\"}, \"batch_size\": %s, \"max_steps\": 10}\n",
            name, text, batch);
    assert_int_equal(fclose(f), 0);
}

/* The number after "prefix" in s, or -1. */
static long long number_after(const char *s, const char *prefix)
{
    const char *p = strstr(s, prefix);

    return p != NULL ? strtoll(p + strlen(prefix), NULL, 10) : -1;
}

/* A dry run on a daemon of its own: the estimate printed, per part, in MiB; JSON with --json;
 * exit 1 with the refusal for a job far larger than the machine; and no job created. */
static void test_dry_run_estimates_and_creates_no_job(void **state)
{
    char state_dir[300], dsock[400], small[400], huge[400], autoj[400];
    pid_t pid;

    snprintf(state_dir, sizeof(state_dir), "%s/dry", dir);
    assert_int_equal(mkdir(state_dir, 0700), 0);
    pid = traind_start(state_dir, dsock, sizeof(dsock));
    write_gpt_job(small, sizeof(small), "small.json", "8");
    write_gpt_job(huge, sizeof(huge), "huge.json", "1048576");
    write_gpt_job(autoj, sizeof(autoj), "auto.json", "\"auto\"");

    assert_int_equal(tc("--socket %s submit %s --dry-run", dsock, small), 0);
    assert_non_null(strstr(out, "batch_size 8 over 1 device(s): 8 rows per device\n"));
    assert_non_null(strstr(out, "memory per device:\n"));
    static const char *const parts[] = {"parameters", "gradients", "optimizer", "activations",
                                        "attention",  "workspace", "total"};
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        char want[64];
        snprintf(want, sizeof(want), "  %s ", parts[i]);
        assert_non_null(strstr(out, want));
    }
    assert_non_null(strstr(out, " MiB (of activations)\n"));
    assert_non_null(strstr(out, "MiB free of "));
    assert_non_null(strstr(out, "fits: yes\n"));
    assert_true(number_after(out, "largest batch_size that fits: ") >= 8);
    assert_string_equal(err, "");

    assert_int_equal(tc("--socket %s submit %s --dry-run --json", dsock, small), 0);
    assert_true(out[0] == '{');
    assert_non_null(strstr(out, "\"fits\": true"));
    assert_non_null(strstr(out, "\"device\": \"cpu:0\""));
    assert_non_null(strstr(out, "\"attention\": "));
    assert_non_null(strstr(out, "\"message\": null"));
    assert_null(strstr(out, "\"type\""));

    /* batch_size "auto": the batch it would take, a multiple of its one device. */
    assert_int_equal(tc("--socket %s submit %s --dry-run", dsock, autoj), 0);
    assert_non_null(strstr(out, " (auto) over 1 device(s)"));
    assert_true(number_after(out, "batch_size ") >= 1);
    assert_int_equal(number_after(out, "batch_size "),
                     number_after(out, "batch_size \"auto\" would take: "));

    /* 4 layers of (1048576, 4, 256, 256) attention scores alone are 4 TiB: refused with the
     * numbers and the largest batch, and exit 1. */
    assert_int_equal(tc("--socket %s submit %s --dry-run", dsock, huge), 1);
    assert_non_null(strstr(out, "fits: no\n"));
    assert_non_null(strstr(err, "does not fit on cpu:0: needs "));
    assert_non_null(strstr(err, " MiB per device (parameters "));
    assert_non_null(strstr(err, " of which attention "));
    assert_true(number_after(err, "MiB free; batch_size ") >= 1);
    assert_true(number_after(err, "MiB free; batch_size ") < 1048576);
    assert_non_null(strstr(err, " would fit"));
    assert_int_equal(tc("--socket %s submit %s --dry-run --json", dsock, huge), 1);
    assert_non_null(strstr(out, "\"fits\": false"));
    assert_true(number_after(out, "\"largest_batch\": ") >= 1);

    /* An invalid job is refused as a submit would refuse it. */
    assert_int_equal(tc("--socket %s submit %s --dry-run --set batch_size=0", dsock, small), 65);
    assert_non_null(strstr(err, "batch_size: must be a positive integer"));
    assert_int_equal(tc("--socket %s submit %s --dry-run --set devices=2", dsock, small), 65);
    assert_non_null(strstr(err, "devices: the job asks for 2 devices but this daemon has 1"));

    /* None of it made a job. */
    assert_int_equal(tc("--socket %s ls --json", dsock), 0);
    assert_string_equal(out, "[]\n");
    assert_int_equal(tc("--socket %s info", dsock), 0);
    assert_non_null(strstr(out, "queue    empty"));

    /* --json belongs to the dry run. */
    assert_int_equal(tc("--socket %s submit %s --json", dsock, small), 64);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

/* A daemon whose hello does not list dry_run would queue the job: nothing is sent. */
static void test_dry_run_needs_a_daemon_that_knows_it(void **state)
{
    char job[400];

    write_gpt_job(job, sizeof(job), "old.json", "8");
    assert_int_equal(tc("--socket %s submit %s --dry-run", fake, job), 69);
    assert_non_null(strstr(err, "too old for submit --dry-run; nothing was submitted"));
}

/* The job keys of the GPU path, refused with the field named (exit 65), dry run or not. */
static void test_bad_new_keys_name_the_field(void **state)
{
    static const struct {
        const char *set, *msg;
    } bad[] = {
        {"precision=fp16", "precision: must be one of \"fp32\", \"bf16\""},
        {"tf32=1", "tf32: must be true or false"},
        {"batch_size=max", "batch_size: must be a positive integer or \"auto\""},
        {"nccl_timeout_s=0", "nccl_timeout_s: must be a number of seconds > 0"},
        {"nccl_timeout_s=fast", "nccl_timeout_s: must be a number of seconds > 0"},
        {"debug.fail.kind=segv", "debug.fail.kind: must be one of \"panic\", \"nan\", \"oom\", "
                                 "\"data\", \"sticky\""},
    };
    char job[400];

    write_gpt_job(job, sizeof(job), "keys.json", "8");
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(tc("--socket %s submit %s --set '%s'", sock, job, bad[i].set), 65);
        assert_non_null(strstr(err, bad[i].msg));
        assert_int_equal(tc("--socket %s submit %s --dry-run --set '%s'", sock, job, bad[i].set),
                         65);
        assert_non_null(strstr(err, bad[i].msg));
    }
    /* and good ones pass */
    assert_int_equal(tc("--socket %s submit %s --dry-run --set precision=bf16 --set tf32=true "
                        "--set nccl_timeout_s=30 --set debug.fail.kind=sticky",
                        sock, job),
                     0);
}

/* --set takes the notation of the validator's own messages: model.layers[1]=48 sets an
 * element of a list (one past its end appends), and a bad index says what the list holds. */
static void test_set_indexes_lists(void **state)
{
    static const struct {
        const char *set, *msg;
    } bad[] = {
        {"model.layers[7]=1", "model.layers has 4 elements (an index from 0 to 4)"},
        {"model.kind[0]=1", "model.kind is not a list in the job"},
        {"model.layers[x]=1", "an index is [N], N an integer >= 0"},
        {"model.layers[-1]=1", "an index is [N], N an integer >= 0"},
        {"optim.betas[0]=1", "the job has no list optim.betas to index"},
        {"model.layers[1].x=1", "'model.layers[1]' is not an object in the job"},
        {"model.layers[1]x=2", "expected '.' or '[' after ']'"},
    };
    char job[600];
    long long id;

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set 'model.layers[1]=48' --set max_steps=1 "
                        "--set name=indexed",
                        sock, job),
                     0);
    id = strtoll(out, NULL, 10); /* one step: it ends by itself */
    assert_int_equal(tc("--socket %s status %lld --json", sock, id), 0);
    assert_non_null(strstr(out, "\"layers\": [\n        784,\n        48,\n        256,\n"));
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(tc("--socket %s submit %s --set '%s'", sock, job, bad[i].set), 64);
        if (strstr(err, bad[i].msg) == NULL)
            fail_msg("--set %s: \"%s\"", bad[i].set, err);
    }
}

/* Waits (a deadline) until the file at path holds needle. */
static void wait_file_has(const char *path, const char *needle, int timeout_s)
{
    for (int i = 0; i < timeout_s * 20; i++) {
        slurp(path, big, sizeof(big));
        if (strstr(big, needle) != NULL)
            return;
        usleep(50 * 1000);
    }
    fail_msg("%s never held \"%s\": \"%s\"", path, needle, big);
}

/* logs -f follows a job's log until it ends; cancel takes several ids (one it cannot cancel is
 * named and the rest are cancelled still, the exit status the failure's) and filters (--name,
 * --state, only queued or running jobs). The held job waits for the test (debug.hold). */
static void test_cancel_many_and_logs_follow(void **state)
{
    char job[600], follow[320], cmd[1200];
    long long held, queued, keep, ended;
    pid_t pid;
    int status = -1;

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set max_steps=1 --set name=done", sock, job), 0);
    ended = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s watch %lld", sock, ended), 0);
    assert_int_equal(tc("--socket %s submit %s --set name=sel-held --set "
                        "'debug={\"hold\":{\"step\":1}}'",
                        sock, job),
                     0);
    held = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s submit %s --set name=sel-queued", sock, job), 0);
    queued = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s submit %s --set name=keep", sock, job), 0);
    keep = strtoll(out, NULL, 10);
    snprintf(follow, sizeof(follow), "%s/follow.out", dir);
    snprintf(cmd, sizeof(cmd), "%s --socket %s logs -f %lld >%s 2>&1", trainctl_bin(), sock, held,
             follow);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    wait_file_has(follow, "running on cpu:0", 60);
    /* filters: only queued or running jobs; the held one and the queued one, not "keep" */
    assert_int_equal(tc("--socket %s cancel --state succeeded", sock), 64);
    assert_non_null(strstr(err, "only queued and running jobs can be cancelled"));
    assert_int_equal(tc("--socket %s cancel --name 'sel-*'", sock), 0);
    assert_non_null(strstr(out, "cancelling (stops at its next step)"));
    snprintf(cmd, sizeof(cmd), "job %lld: cancelled\n", queued);
    assert_non_null(strstr(out, cmd));
    /* logs -f ends with the job, its last line printed */
    for (int i = 0; i < 1200 && waitpid(pid, &status, WNOHANG) == 0; i++)
        usleep(50 * 1000);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fail_msg("logs -f did not end with its job");
    }
    slurp(follow, big, sizeof(big));
    assert_non_null(strstr(big, "notice cancelled at step"));
    /* several ids: an ended one is named, the other is cancelled still (queued, or running
     * by now on the device the held one left) */
    assert_int_equal(tc("--socket %s cancel %lld %lld", sock, ended, keep), 1);
    snprintf(cmd, sizeof(cmd), "job %lld: cancel", keep);
    assert_non_null(strstr(out, cmd));
    assert_non_null(strstr(err, "ended"));
    assert_int_equal(tc("--socket %s cancel --name 'nomatch-*'", sock), 0);
    assert_non_null(strstr(err, "no queued or running job matches"));
}

/* describe shows the whole job: who, state, devices, times, the error with its failed
 * device, the spec, the last metrics, the checkpoints and the events, whose failure line
 * names one step (the failing one), not "failed at step 4: ... at step 5". */
static void test_describe_a_failed_job(void **state)
{
    char job[600], line[200];
    long long id;

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set max_steps=10 --set checkpoint_every=2 --set "
                        "name=described --set 'debug={\"fail\":{\"step\":5,\"kind\":\"nan\"}}'",
                        sock, job),
                     0);
    id = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s watch %lld", sock, id), 1);
    assert_int_equal(tc("--socket %s describe %lld", sock, id), 0);
    snprintf(line, sizeof(line), "Job:            %lld\n", id);
    assert_non_null(strstr(out, line));
    assert_non_null(strstr(out, "Name:           described\n"));
    assert_non_null(strstr(out, "User:           root (uid 0)\n"));
    assert_non_null(strstr(out, "State:          failed\n"));
    assert_non_null(strstr(out, "Step:           4 of 10 (40%)\n"));
    assert_non_null(strstr(out, "Devices:        1 (cpu:0)\n"));
    assert_non_null(strstr(out, "Error:          ENAN: training worker on device 0 failed: loss "
                                "is NaN at step 5\n"));
    assert_non_null(strstr(out, "Failed devices:\n  DEVICE  CODE        MESSAGE\n  0       ENAN"));
    assert_non_null(strstr(out, "Spec:\n  \"name\": \"described\"\n"));
    assert_non_null(strstr(out, "\n  \"max_steps\": 10\n"));
    assert_non_null(strstr(out, "Last metrics:\n"));
    assert_non_null(strstr(out, "\n  train_loss "));
    assert_non_null(strstr(out, "Checkpoints:\n  STEP      SIZE        WRITTEN\n  4         "));
    assert_non_null(strstr(out, "\n  2         "));
    assert_non_null(strstr(out, "Events:\n"));
    assert_non_null(strstr(out, "notice   queued\n"));
    assert_non_null(strstr(out, "err      failed: training worker on device 0 failed: loss is NaN "
                                "at step 5\n"));
    assert_null(strstr(out, "failed at step"));
    /* a job that does not exist: traind's error, status 1 */
    assert_int_equal(tc("--socket %s describe 999999", sock), 1);
    assert_non_null(strstr(err, "no job 999999"));
}

/* Job labels: kept with the job, shown by ls (-o wide, --format labels) and status, and
 * --selector on ls, prune and cancel selects by them (all must match); bad labels are refused
 * at submit naming the label. */
static void test_labels_select(void **state)
{
    char job[600], want[200];
    long long a, b;

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set max_steps=1 --set name=lab-a --set "
                        "'labels={\"team\":\"vision\",\"env\":\"prod\"}'",
                        sock, job),
                     0);
    a = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s submit %s --set max_steps=1 --set name=lab-b --set "
                        "'labels={\"team\":\"nlp\"}'",
                        sock, job),
                     0);
    b = strtoll(out, NULL, 10);
    assert_int_equal(tc("--socket %s watch %lld", sock, a), 0);
    assert_int_equal(tc("--socket %s watch %lld", sock, b), 0);
    assert_int_equal(tc("--socket %s ls --selector team=vision --format id,labels", sock), 0);
    snprintf(want, sizeof(want), "ID  LABELS\n%lld   team=vision,env=prod\n", a);
    assert_string_equal(out, want);
    assert_int_equal(tc("--socket %s ls -l team=vision,env=dev --format id", sock), 0);
    assert_string_equal(out, "ID\n");
    assert_int_equal(tc("--socket %s ls -l team=nlp --format id", sock), 0);
    snprintf(want, sizeof(want), "ID\n%lld\n", b);
    assert_string_equal(out, want);
    assert_int_equal(tc("--socket %s status %lld --json", sock, a), 0);
    assert_non_null(
        strstr(out, "\"labels\": {\n    \"team\": \"vision\",\n    \"env\": \"prod\"\n"));
    assert_int_equal(tc("--socket %s prune --older-than 0s --selector team=nlp --dry-run", sock),
                     0);
    assert_non_null(strstr(out, "lab-b"));
    assert_null(strstr(out, "lab-a"));
    assert_int_equal(tc("--socket %s cancel --selector team=nlp", sock), 0);
    assert_non_null(strstr(err, "no queued or running job matches"));
    assert_int_equal(tc("--socket %s ls --selector team", sock), 64);
    assert_non_null(strstr(err, "--selector: 'team' is not NAME=VALUE"));
    assert_int_equal(tc("--socket %s submit %s --set 'labels={\"bad key\":\"x\"}'", sock, job), 65);
    assert_non_null(strstr(err, "labels: 'bad key': a label's name is 1 to 63 bytes"));
    assert_int_equal(tc("--socket %s submit %s --set 'labels={\"team\":5}'", sock, job), 65);
    assert_non_null(strstr(err, "labels.team: must be a string of at most 63 bytes"));
}

/* A batch larger than the train split is refused at submit and by the dry run (it used to run
 * one step of the whole split an epoch, and the dry run said it fits). */
static void test_batch_larger_than_split(void **state)
{
    char job[600];

    snprintf(job, sizeof(job), "%s/examples/fashion-mnist-mlp.json", env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(tc("--socket %s submit %s --set batch_size=100000", sock, job), 65);
    assert_non_null(strstr(err, "batch_size: 100000, but the train split ("));
    assert_non_null(strstr(err, ") has 60000 images: at most 60000"));
    assert_int_equal(tc("--socket %s submit %s --set batch_size=100000 --dry-run", sock, job), 65);
    assert_non_null(strstr(err, "has 60000 images: at most 60000"));
    assert_int_equal(tc("--socket %s submit %s --set batch_size=60000 --dry-run", sock, job), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_usage_errors_are_64),
        cmocka_unit_test(test_help_on_every_verb),
        cmocka_unit_test(test_unreachable_is_69_and_names_the_socket),
        cmocka_unit_test(test_eperm_is_77_with_its_message),
        cmocka_unit_test(test_o_json_is_json),
        cmocka_unit_test(test_info_and_logs),
        cmocka_unit_test(test_plot_png_and_svg),
        cmocka_unit_test(test_completion_bash),
        cmocka_unit_test(test_completion_zsh),
        cmocka_unit_test(test_completion_fish),
        cmocka_unit_test(test_plot_svg_text_panels_log), /* after them: it adds job 2 */
        cmocka_unit_test(test_ls_filters_need_list_pages),
        cmocka_unit_test(test_dry_run_estimates_and_creates_no_job),
        cmocka_unit_test(test_dry_run_needs_a_daemon_that_knows_it),
        cmocka_unit_test(test_bad_new_keys_name_the_field),
        cmocka_unit_test(test_set_indexes_lists),
        cmocka_unit_test(test_cancel_many_and_logs_follow),
        cmocka_unit_test(test_describe_a_failed_job),
        cmocka_unit_test(test_labels_select),
        cmocka_unit_test(test_batch_larger_than_split),
    };
    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests_name("integration", tests, setup, teardown);
}
