/* Integration tests of `trainctl dashboard` in a real browser: a real traind trains a real
 * Fashion-MNIST job, the dashboard serves it, and headless Chromium (cdp.c) loads the page.
 * They check from the DOM, the charts' canvases and a screenshot that the list shows the jobs
 * (with a hostile name shown as text), that the failed job's page shows its failure per
 * device and its log, that the running job's charts draw and take new points while it trains,
 * and that several jobs share a chart; that the server keeps its token and its address; and
 * with 1,000,000 metric rows in one job (inserted with SQL before traind starts), they measure
 * the page's load and the live updates' latency and print the figures (bounded only
 * generously), and check that a browser that stops reading costs the dashboard no memory.
 *
 * Without a browser: --listen, a second dashboard on the next port, 1,000 connections that
 * trickle a header without the token (the owner is still answered), the request deadline, and
 * %00 in a URL. The browser's tests are left out only when Chromium cannot run here at all
 * (cdp_usable); everything else that goes wrong in the browser fails.
 *
 * The screenshot of the running job's page goes to $TD_DASHBOARD_SCREENSHOT, else
 * dashboard.png in the working directory (meson's: the build tree);
 * scripts/dashboard-screenshot.sh points it at doc/dashboard.png. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cairo.h>
#include <cmocka.h>

#include "tests/cdp.h"
#include "tests/jobs_support.h"
#include "proto/proto.h"
#include "store/store_int.h"
#include "tests/support.h"

/* Sanitizer builds run the large test with a tenth of the rows: its figures are the plain
 * build's, and a 14-times-slower traind would only make the run long. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define BIG_ROWS  100000
#define SANITIZED 1 /* memory figures mean nothing here: ASan keeps freed memory quarantined */
#else
#define BIG_ROWS  1000000
#define SANITIZED 0
#endif
#define BIG_KEYS   5     /* metrics of the large job; BIG_ROWS / BIG_KEYS steps */
#define MANY_JOBS  10000 /* ended jobs besides it, for the list's pages */
#define LIST_PAGE  50    /* jobs of one page of the list (app.js) */
#define VIEW_W     1280  /* the browser's viewport, pixels */
#define VIEW_H     900
#define WAIT_MS    120000   /* what a page must show within, on a loaded machine */
#define LIVE_STEPS 1000000  /* max_steps of the job that trains during a test: it is cancelled */
#define SERIES_RGB 0x2f6fdf /* the first series' colour (app.js COLORS[0]) */

/* The failing job's name: markup, which the page must show as text and never run. */
static const char hostile_name[] = "<img src=x onerror=\"window.pwned=1\"> & co";

/* A `trainctl dashboard` of the test's own. */
typedef struct dash {
    pid_t pid;
    int out;       /* its stdout, a pipe */
    char url[256]; /* http://127.0.0.1:PORT/TOKEN/ */
    char token[64];
    int port;
    char second[512]; /* its second line of output */
} dash;

/* What a failed test leaves running, for teardown() to end. */
static pid_t live_dash = -1;
static pid_t live_dash2 = -1;
static rlim_t dash_nofile; /* the open-file limit the next dashboard starts with; 0: inherited */
static cdp *live_browser;

/* A cmocka teardown: the browser, the dashboard and the daemon a failed test left behind. */
static int teardown(void **state)
{
    cdp_stop(live_browser);
    live_browser = NULL;
    if (live_dash > 0) {
        kill(live_dash, SIGKILL);
        waitpid(live_dash, NULL, 0);
        live_dash = -1;
    }
    if (live_dash2 > 0) {
        kill(live_dash2, SIGKILL);
        waitpid(live_dash2, NULL, 0);
        live_dash2 = -1;
    }
    dash_nofile = 0;
    return ts_kill_leftover(state);
}

/* Reads one line from fd into buf within timeout_ms; fails the test otherwise. */
static void read_line(int fd, char *buf, size_t size, int timeout_ms)
{
    size_t n = 0;
    long long until = ts_now_ms() + timeout_ms;

    while (n + 1 < size) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        char c;
        if (poll(&p, 1, (int)(until - ts_now_ms())) <= 0)
            fail_msg("trainctl dashboard printed no line within %d s", timeout_ms / 1000);
        if (read(fd, &c, 1) != 1)
            fail_msg("trainctl dashboard closed its output");
        if (c == '\n')
            break;
        buf[n++] = c;
    }
    buf[n] = '\0';
}

/* Starts `trainctl --socket SOCK dashboard --listen addr` (no --listen when addr is NULL) with
 * its page from the source tree; its stderr goes to errlog. Returns once it has printed its
 * URL. */
static void dash_start(dash *ds, const char *sock, const char *addr, const char *errlog)
{
    const char *bin = ts_env_or("TRAINCTL_BIN", "build/client/trainctl");
    char assets[512], line[512];
    int pipefd[2];

    memset(ds, 0, sizeof(*ds));
    snprintf(assets, sizeof(assets), "%s/client/dashboard", ts_env_or("TD_SOURCE_ROOT", "."));
    assert_int_equal(pipe(pipefd), 0);
    ds->pid = fork();
    assert_true(ds->pid >= 0);
    if (ds->pid == 0) {
        if (dup2(pipefd[1], 1) < 0 || freopen(errlog, "a", stderr) == NULL)
            _exit(126);
        close(pipefd[0]);
        setenv("TRAINCTL_DASHBOARD_DIR", assets, 1);
        if (dash_nofile != 0) {
            struct rlimit rl = {.rlim_cur = dash_nofile, .rlim_max = dash_nofile};
            if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
                _exit(125);
        }
        if (addr == NULL)
            execl(bin, bin, "--socket", sock, "dashboard", (char *)NULL);
        else
            execl(bin, bin, "--socket", sock, "dashboard", "--listen", addr, (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    if (live_dash > 0)
        live_dash2 = ds->pid;
    else
        live_dash = ds->pid;
    ds->out = pipefd[0];
    read_line(ds->out, line, sizeof(line), 30000);
    if (sscanf(line, "trainctl dashboard: %255s", ds->url) != 1)
        fail_msg("trainctl dashboard printed '%s', not its URL", line);
    const char *port = strrchr(ds->url, ':'), *slash;
    assert_non_null(port);
    ds->port = atoi(port + 1);
    slash = strchr(port, '/');
    assert_non_null(slash);
    snprintf(ds->token, sizeof(ds->token), "%.*s", (int)strcspn(slash + 1, "/"), slash + 1);
    assert_int_equal(strlen(ds->token), 32);
    read_line(ds->out, ds->second, sizeof(ds->second), 5000);
}

/* SIGTERM, and it must exit 0 within 20 s. */
static void dash_stop(dash *ds)
{
    int status = -1;

    kill(ds->pid, SIGTERM);
    for (long long until = ts_now_ms() + 20000; ts_now_ms() < until;) {
        if (waitpid(ds->pid, &status, WNOHANG) == ds->pid)
            break;
        usleep(50 * 1000);
    }
    if (status == -1) {
        kill(ds->pid, SIGKILL);
        waitpid(ds->pid, &status, 0);
        fail_msg("trainctl dashboard did not stop within 20 s of SIGTERM");
    }
    if (live_dash == ds->pid)
        live_dash = -1;
    if (live_dash2 == ds->pid)
        live_dash2 = -1;
    close(ds->out);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* A socket connected to the dashboard's port on 127.0.0.1. */
static int http_connect(int port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);

    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_true(fd >= 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

/* GET path over HTTP/1.0; returns the status code. */
static int http_status(int port, const char *path)
{
    char req[512], resp[256];
    int fd = http_connect(port), code = -1;
    ssize_t n;

    snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    assert_int_equal(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    n = read(fd, resp, sizeof(resp) - 1);
    close(fd);
    if (n > 0) {
        resp[n] = '\0';
        sscanf(resp, "HTTP/%*s %d", &code);
    }
    return code;
}

/* The dashboard process's memory: the resident set now and its peak, KiB. */
static void rss_kib(pid_t pid, long *now, long *peak)
{
    char path[64], line[256];
    FILE *f;

    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    f = fopen(path, "r");
    assert_non_null(f);
    *now = *peak = -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        sscanf(line, "VmRSS: %ld", now);
        sscanf(line, "VmHWM: %ld", peak);
    }
    fclose(f);
}

/* This process's user name, which the page shows as every job's owner. */
static void my_name(char *buf, size_t size)
{
    struct passwd *pw = getpwuid(getuid());

    snprintf(buf, size, "%s", pw != NULL ? pw->pw_name : "");
}

/* Cancels job id (a running one stops at its next step). */
static void cancel(const ts_daemon *d, int64_t id)
{
    ts_client c;
    td_proto_frame *f;

    ts_connect_hello(&c, d->sock);
    ts_send_job_request(&c, "cancel", id);
    f = ts_client_recv(&c);
    assert_non_null(f);
    td_proto_frame_free(f);
    ts_client_close(&c);
}

/* ---- reading the screenshot ---- */

typedef struct png_src {
    const unsigned char *p;
    size_t len, at;
} png_src;

static cairo_status_t png_read(void *ud, unsigned char *data, unsigned int len)
{
    png_src *s = ud;

    if (s->len - s->at < len)
        return CAIRO_STATUS_READ_ERROR;
    memcpy(data, s->p + s->at, len);
    s->at += len;
    return CAIRO_STATUS_SUCCESS;
}

/* Pixels of the screenshot within 40 of rgb in each channel; checks its size too. */
static long count_color(const unsigned char *png, size_t len, uint32_t rgb)
{
    png_src src = {png, len, 0};
    cairo_surface_t *s = cairo_image_surface_create_from_png_stream(png_read, &src);
    long n = 0;

    assert_int_equal(cairo_surface_status(s), CAIRO_STATUS_SUCCESS);
    assert_int_equal(cairo_image_surface_get_width(s), VIEW_W);
    assert_int_equal(cairo_image_surface_get_height(s), VIEW_H);
    const unsigned char *px = cairo_image_surface_get_data(s);
    int stride = cairo_image_surface_get_stride(s);
    for (int y = 0; y < VIEW_H; y++)
        for (int x = 0; x < VIEW_W; x++) {
            uint32_t v = *(const uint32_t *)(px + y * stride + 4 * x);
            int r = (v >> 16) & 255, g = (v >> 8) & 255, b = v & 255;
            n += abs(r - (int)(rgb >> 16)) < 40 && abs(g - (int)((rgb >> 8) & 255)) < 40 &&
                 abs(b - (int)(rgb & 255)) < 40;
        }
    cairo_surface_destroy(s);
    return n;
}

static void save(const char *path, const unsigned char *p, size_t len)
{
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* ---- the page ---- */

/* JavaScript: the train_loss panel's drawn pixels of the first series' colour, over every
 * canvas dygraphs made for it (the band's pixels too: they keep the colour, less alpha). */
static const char js_chart_pixels[] =
    "(() => { const p = document.querySelector('.panel[data-key=\"train_loss\"]');"
    "  if (!p) return 0; let n = 0;"
    "  for (const c of p.querySelectorAll('canvas')) {"
    "    if (!c.width || !c.height) continue;"
    "    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
    "    for (let i = 0; i < d.length; i += 4)"
    "      if (d[i + 3] > 0 && Math.abs(d[i] - 47) < 40 && Math.abs(d[i + 1] - 111) < 40 &&"
    "          Math.abs(d[i + 2] - 223) < 40) n++;"
    "  }"
    "  return n; })()";

/* Loads url afresh (not a same-document jump), so that the page's clock starts with it. */
static void load_page(cdp *b, const char *url)
{
    cdp_navigate(b, "about:blank");
    cdp_navigate(b, url);
}

static void go(cdp *b, const dash *ds, const char *fragment)
{
    char url[400];

    snprintf(url, sizeof(url), "%s%s", ds->url, fragment);
    load_page(b, url);
}

/* The job list: both jobs, the hostile name as text, the owner, the state filter. */
static void check_list(cdp *b, const dash *ds, int64_t failed, int64_t live)
{
    char expr[1024], buf[512], me[256];

    my_name(me, sizeof(me));
    go(b, ds, "");
    snprintf(expr, sizeof(expr),
             "(() => { const r = document.querySelector('#jobs tr[data-job=\"%lld\"]');"
             "  return r && r.textContent.includes('running'); })()",
             (long long)live);
    cdp_wait(b, expr, WAIT_MS, "the running job in the list");
    snprintf(expr, sizeof(expr),
             "document.querySelector('#jobs tr[data-job=\"%lld\"] .job-name').textContent",
             (long long)failed);
    cdp_eval_str(b, expr, buf, sizeof(buf));
    assert_string_equal(buf, hostile_name);
    assert_int_equal(cdp_eval_int(b, "document.querySelectorAll('#main img').length"), 0);
    assert_int_equal(cdp_eval_int(b, "window.pwned === undefined"), 1);
    snprintf(expr, sizeof(expr),
             "document.querySelector('#jobs tr[data-job=\"%lld\"]').children[3].textContent",
             (long long)live);
    cdp_eval_str(b, expr, buf, sizeof(buf));
    assert_string_equal(buf, me);
    snprintf(expr, sizeof(expr),
             "document.querySelector('#jobs tr[data-job=\"%lld\"]').textContent.includes('failed')",
             (long long)failed);
    assert_int_equal(cdp_eval_int(b, expr), 1);

    /* Only failed jobs, then every job again. */
    json_decref(cdp_eval(b, "document.querySelector('input[data-state=\"failed\"]').click()"));
    snprintf(expr, sizeof(expr),
             "(() => { const ids = [...document.querySelectorAll('#jobs tr[data-job]')]"
             "  .map(r => r.dataset.job); return ids.length === 1 && ids[0] === '%lld'; })()",
             (long long)failed);
    cdp_wait(b, expr, WAIT_MS, "only the failed job when filtered by state");
    json_decref(cdp_eval(b, "document.querySelector('input[data-state=\"failed\"]').click()"));
    cdp_wait(b, "document.querySelectorAll('#jobs tr[data-job]').length === 2", WAIT_MS,
             "both jobs again");
}

/* The failed job's page: its failure and each failed device, and its log. */
static void check_failed_job(cdp *b, const dash *ds, int64_t id)
{
    char frag[64], buf[2048];

    snprintf(frag, sizeof(frag), "#/job/%lld", (long long)id);
    go(b, ds, frag);
    cdp_wait(b, "document.querySelector('#failure pre')", WAIT_MS, "the failure");
    cdp_eval_str(b, "document.querySelector('#failure pre').textContent", buf, sizeof(buf));
    assert_string_equal(buf, "2 training workers failed:\n"
                             "  training worker on device 0 failed: injected panic at step 5\n"
                             "  training worker on device 1 failed: injected panic at step 5");
    /* A header row, then one row per failed device, in device order. */
    assert_int_equal(cdp_eval_int(b, "document.querySelectorAll('#failure tr').length"), 3);
    cdp_eval_str(b, "document.querySelectorAll('#failure tr')[2].textContent", buf, sizeof(buf));
    assert_non_null(strstr(buf, "injected panic at step 5"));
    assert_true(buf[0] == '1');
    /* the code by its name, not its number */
    cdp_eval_str(b, "document.querySelectorAll('#failure tr')[2].children[1].textContent", buf,
                 sizeof(buf));
    assert_string_equal(buf, "EPANIC");
    cdp_eval_str(b, "document.querySelector('.job-title').textContent", buf, sizeof(buf));
    assert_string_equal(buf, hostile_name);
    cdp_wait(b, "document.querySelector('#log').textContent.includes('running on cpu:0,cpu:1')",
             WAIT_MS, "the log");
    /* Once the stream has ended (the job's end asks for the log again) and no load runs, each
     * line is there once: the page's first load and the end's no longer both start at 0. */
    cdp_wait(b, "window.tdash.done === true && window.tdash.logBusy === false", WAIT_MS,
             "the log's loads done");
    assert_int_equal(cdp_eval_int(b, "document.querySelector('#log').textContent"
                                     ".split('running on cpu:0,cpu:1').length - 1"),
                     1);
    assert_int_equal(cdp_eval_int(b, "window.pwned === undefined"), 1);
}

/* The running job's page: the chart draws, and takes new points while the job trains. Writes
 * the screenshot. */
static void check_live_job(cdp *b, const dash *ds, int64_t id)
{
    const char *shot = ts_env_or("TD_DASHBOARD_SCREENSHOT", "dashboard.png");
    char frag[64], expr[256];
    long long s1, s2, pixels;
    unsigned char *png;
    size_t len;

    snprintf(frag, sizeof(frag), "#/job/%lld", (long long)id);
    go(b, ds, frag);
    cdp_wait(b,
             "Number(document.querySelector('.panel[data-key=\"train_loss\"]')?.dataset.points)"
             " > 20",
             WAIT_MS, "train_loss points");
    cdp_wait(b, js_chart_pixels, WAIT_MS, "the train_loss chart drawn");
    pixels = cdp_eval_int(b, js_chart_pixels);
    assert_true(pixels > 100);
    s1 = cdp_eval_int(
        b, "Number(document.querySelector('.panel[data-key=\"train_loss\"]').dataset.lastStep)");
    snprintf(expr, sizeof(expr),
             "Number(document.querySelector('.panel[data-key=\"train_loss\"]').dataset.lastStep)"
             " > %lld",
             s1 + 20);
    cdp_wait(b, expr, WAIT_MS, "new train_loss points");
    s2 = cdp_eval_int(
        b, "Number(document.querySelector('.panel[data-key=\"train_loss\"]').dataset.lastStep)");
    assert_true(s2 > s1);
    assert_true(cdp_eval_int(b, "window.tdash.latency.length") > 0);
    assert_true(cdp_eval_int(b, "document.querySelectorAll('.panel').length") >= 4);
    print_message("dashboard: the live chart went from step %lld to %lld while the job trained\n",
                  s1, s2);
    /* Let the other charts catch up before the picture; scripts/dashboard-screenshot.sh lets
     * the job train longer ($TD_DASHBOARD_SETTLE_S), for a picture with more to see. */
    usleep((useconds_t)(1000 * 1000 * atof(ts_env_or("TD_DASHBOARD_SETTLE_S", "1.5"))));
    png = cdp_screenshot(b, &len);
    save(shot, png, len);
    assert_true(count_color(png, len, SERIES_RGB) > 500);
    free(png);
    print_message("dashboard: screenshot in %s\n", shot);

    /* The controls redraw without errors: log scale, wall time, smoothing. */
    long long draws = cdp_eval_int(b, "window.tdash.draws");
    json_decref(cdp_eval(b, "document.querySelector('#logscale').click()"));
    json_decref(cdp_eval(b, "document.querySelector('#x-wall').click()"));
    json_decref(cdp_eval(b,
                         "(() => { const s = document.querySelector('#smoothing'); s.value = 0.9;"
                         "  s.dispatchEvent(new Event('input')); })()"));
    snprintf(expr, sizeof(expr), "window.tdash.draws > %lld + 3", draws);
    cdp_wait(b, expr, WAIT_MS, "the charts redrawn");
    cdp_wait(b, js_chart_pixels, WAIT_MS, "the redrawn chart");
    /* lr is constant (a constant schedule): its log axis is still labelled */
    cdp_wait(b,
             "document.querySelectorAll('.panel[data-key=\"lr\"] .dygraph-axis-label-y').length "
             ">= 2",
             WAIT_MS, "the constant lr's log axis labelled");
}

/* GET path over HTTP/1.0: the whole reply (head and body, to the close) into buf. */
static void http_body(int port, const char *path, char *buf, size_t size)
{
    char req[512];
    int fd = http_connect(port);
    size_t n = 0;
    ssize_t got;

    snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    assert_int_equal(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    while (n + 1 < size && (got = read(fd, buf + n, size - 1 - n)) > 0)
        n += (size_t)got;
    buf[n] = '\0';
    close(fd);
}

/* The job list by labels, as trainctl's --selector: api/jobs?labels=team=vision lists only the
 * jobs with them; a selector that is not NAME=VALUE is a 400 saying so. */
static void test_dashboard_labels(void **state)
{
    char errlog[400], path[256], cmd[1200], body[65536];
    const char *tc = ts_env_or("TRAINCTL_BIN", "build/client/trainctl");
    ts_daemon d;
    ts_client c;
    dash ds;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof(cmd),
                 "%s --socket %s submit %s/examples/fashion-mnist-mlp.json --set max_steps=1 "
                 "--set 'labels={\"team\":\"%s\"}' >/dev/null",
                 tc, d.sock, ts_env_or("TD_SOURCE_ROOT", "."), i == 0 ? "vision" : "nlp");
        assert_int_equal(system(cmd), 0);
    }
    ts_connect_hello(&c, d.sock);
    ts_wait_state(&c, 2, "succeeded", 120);
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    snprintf(path, sizeof(path), "/%s/api/jobs?labels=team%%3Dvision", ds.token);
    http_body(ds.port, path, body, sizeof(body));
    assert_non_null(strstr(body, "200 OK"));
    assert_non_null(strstr(body, "\"id\":1,"));
    assert_null(strstr(body, "\"id\":2,"));
    snprintf(path, sizeof(path), "/%s/api/jobs?labels=team", ds.token);
    assert_int_equal(http_status(ds.port, path), 400);
    dash_stop(&ds);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* app.js's names of traind's error codes are common/td_errno.h's, every one. */
static void test_dashboard_code_names(void **state)
{
    char path[512], line[512], want[64];
    static char js[1 << 20];
    FILE *f;
    int n = 0;

    (void)state;
    snprintf(path, sizeof(path), "%s/client/dashboard/app.js", ts_env_or("TD_SOURCE_ROOT", "."));
    f = fopen(path, "r");
    assert_non_null(f);
    js[fread(js, 1, sizeof(js) - 1, f)] = '\0';
    fclose(f);
    snprintf(path, sizeof(path), "%s/common/td_errno.h", ts_env_or("TD_SOURCE_ROOT", "."));
    f = fopen(path, "r");
    assert_non_null(f);
    while (fgets(line, sizeof(line), f) != NULL) {
        char name[32];
        int code;
        if (sscanf(line, " X(%31[A-Z0-9_], %d,", name, &code) != 2)
            continue;
        snprintf(want, sizeof(want), "'%d': '%s'", code, name);
        if (strstr(js, want) == NULL)
            fail_msg("app.js's CODE_NAMES lacks %s", want);
        n++;
    }
    fclose(f);
    assert_true(n >= 20);
}

/* Both jobs on one chart. */
static void check_compare(cdp *b, const dash *ds, int64_t a, int64_t c)
{
    char frag[64];

    snprintf(frag, sizeof(frag), "#/compare/%lld,%lld", (long long)a, (long long)c);
    go(b, ds, frag);
    cdp_wait(b, "document.querySelectorAll('.legend [data-job]').length === 2", WAIT_MS,
             "the comparison's legend");
    cdp_wait(b, "document.querySelector('.panel[data-key=\"train_loss\"]')?.dataset.series === '2'",
             WAIT_MS, "both jobs on the train_loss chart");
    cdp_wait(b, js_chart_pixels, WAIT_MS, "the comparison drawn");
}

/* A failed two-device job with a hostile name and a running one: the list, each job's page,
 * a comparison, the token, the screenshot. */
static void test_dashboard_live(void **state)
{
    tj_extra fail = {
        .devices = 2, .fail_step = 5, .fail_kind = "panic", .fail_devices = {0, 1, -1}};
    char log[400], errlog[400], path[200], exc[1024];
    int64_t failed, live;
    ts_daemon d;
    ts_client c;
    dash ds;
    cdp *b;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    failed = tj_submit_ex(&c, hostile_name, 32, 100, &fail, NULL, 0);
    assert_true(failed > 0);
    ts_wait_state(&c, failed, "failed", 120);
    live = tj_submit(&c, "fashion-mnist mlp", 128, LIVE_STEPS, NULL, 0);
    assert_true(live > 0);
    ts_wait_state(&c, live, "running", 120);

    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    assert_non_null(strstr(ds.second, "loopback only"));
    assert_int_equal(http_status(ds.port, "/"), 404);
    snprintf(path, sizeof(path), "/%s/api/jobs", ds.token);
    assert_int_equal(http_status(ds.port, path), 200);
    snprintf(path, sizeof(path), "/%032d/api/jobs", 0);
    assert_int_equal(http_status(ds.port, path), 404);
    snprintf(path, sizeof(path), "/%s/api/job?id=999", ds.token);
    assert_int_equal(http_status(ds.port, path), 404); /* traind: no job 999 */

    snprintf(log, sizeof(log), "%s/chromium.log", d.dir);
    b = live_browser = cdp_start(VIEW_W, VIEW_H, log);
    check_list(b, &ds, failed, live);
    check_failed_job(b, &ds, failed);
    check_live_job(b, &ds, live);
    check_compare(b, &ds, failed, live);
    if (cdp_exceptions(b, exc, sizeof(exc)) != 0)
        fail_msg("the page threw: %s", exc);
    cdp_stop(b);
    live_browser = NULL;

    dash_stop(&ds);
    cancel(&d, live);
    ts_wait_state(&c, live, "cancelled", 120);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* --listen: a bad address is a usage error, a non-loopback one is used with a warning; and a
 * traind that cannot be reached stops the dashboard before it listens. */
static void test_dashboard_listen(void **state)
{
    const char *bin = ts_env_or("TRAINCTL_BIN", "build/client/trainctl");
    char cmd[1024], errlog[400], buf[4096] = "";
    ts_daemon d;
    dash ds;
    FILE *f;

    ts_daemon_start(&d, "cpu:1");
    snprintf(cmd, sizeof(cmd), "%s --socket %s dashboard --listen 1.2.3 2>/dev/null", bin, d.sock);
    assert_int_equal(WEXITSTATUS(system(cmd)), 64);
    snprintf(cmd, sizeof(cmd),
             "%s --socket %s/none.sock dashboard --listen 127.0.0.1:0 2>/dev/null", bin, d.dir);
    assert_int_equal(WEXITSTATUS(system(cmd)), 69);

    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "0.0.0.0:0", errlog);
    assert_null(strstr(ds.second, "loopback"));
    dash_stop(&ds);
    f = fopen(errlog, "r");
    assert_non_null(f);
    assert_true(fread(buf, 1, sizeof(buf) - 1, f) > 0);
    fclose(f);
    assert_non_null(strstr(buf, "warning: 0.0.0.0 is not a loopback address"));
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- connections that hold on ---- */

#define HOSTILE     1000  /* connections a local user without the token holds */
#define REQUEST_MS  5000  /* the dashboard's deadline for a whole request (TC_DASH_REQUEST_MS) */
#define SLACK_MS    55000 /* on top of it, for a loaded 2-core machine: a 60 s deadline */
#define HOSTILE_HDR "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "

/* Sends the request for path on fd (HTTP/1.1, kept alive) and reads the reply's head and body
 * (Content-Length) within 20 s. Returns the status, or -1 when the connection closed or broke
 * first. */
static int http_get_on(int fd, const char *path)
{
    char req[512], buf[65536];
    size_t n = 0;
    long long until = ts_now_ms() + 20000;
    int code = -1;

    snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (send(fd, req, strlen(req), MSG_NOSIGNAL) != (ssize_t)strlen(req))
        return -1;
    while (n + 1 < sizeof(buf)) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        char *end;
        ssize_t got;
        if (poll(&p, 1, (int)(until - ts_now_ms())) <= 0)
            return -1;
        if ((got = read(fd, buf + n, sizeof(buf) - 1 - n)) <= 0)
            return -1;
        n += (size_t)got;
        buf[n] = '\0';
        if ((end = strstr(buf, "\r\n\r\n")) != NULL) {
            const char *cl = strstr(buf, "Content-Length: ");
            size_t want = (size_t)(end + 4 - buf) + (cl != NULL ? strtoul(cl + 16, NULL, 10) : 0);
            if (n >= want) {
                sscanf(buf, "HTTP/%*s %d", &code);
                return code;
            }
        }
    }
    return -1;
}

/* One more byte of a header to each of the n connections (those the dashboard closed refuse
 * it). */
static void trickle(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0)
            (void)!send(fds[i], "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* HOSTILE connections, each having sent part of a header. */
static int *hold(int port)
{
    int *fds = calloc(HOSTILE, sizeof(int));

    assert_non_null(fds);
    for (size_t i = 0; i < HOSTILE; i++) {
        fds[i] = http_connect(port);
        (void)!send(fds[i], HOSTILE_HDR, strlen(HOSTILE_HDR), MSG_NOSIGNAL);
    }
    return fds;
}

static void let_go(int *fds)
{
    for (size_t i = 0; i < HOSTILE; i++)
        close(fds[i]);
    free(fds);
}

/* The sockets pid holds (its /proc/PID/fd entries that are sockets), or -1. */
static int sockets_of(pid_t pid)
{
    char dir[64], path[400], link[64];
    struct dirent *e;
    DIR *dp;
    int n = 0;

    snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
    if ((dp = opendir(dir)) == NULL)
        return -1;
    while ((e = readdir(dp)) != NULL) {
        ssize_t len;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if ((len = readlink(path, link, sizeof(link) - 1)) > 0 && strncmp(link, "socket:", 7) == 0)
            n++;
    }
    closedir(dp);
    return n;
}

/* The connections waiting in the kernel to be accepted on the listening TCP socket of port
 * (the rx_queue of its /proc/net/tcp line), or -1 when there is no such socket. */
static int accept_queue(unsigned port)
{
    FILE *f = fopen("/proc/net/tcp", "r");
    char line[512];
    int n = -1;

    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned lport, st, txq, rxq;
        if (sscanf(line, " %*d: %*x:%x %*x:%*x %x %x:%x", &lport, &st, &txq, &rxq) == 4 &&
            lport == port && st == 0x0a)
            n = (int)rxq;
    }
    fclose(f);
    return n;
}

/* Waits, 60 s at most, until the dashboard has taken in the whole flood and let go of what it
 * shed: nothing waits in its accept queue and it holds at most max sockets. Each connection it
 * sheds is shut down at once but closed by its own thread, which on a loaded machine may run
 * some time later; until then libmicrohttpd counts it against its own limit and turns new
 * connections away (the owner's among them, while the flood is still being accepted). Returns
 * the sockets held when the wait ended. */
static int wait_shed(const dash *ds, int max)
{
    long long until = ts_now_ms() + 60000;
    int n = sockets_of(ds->pid);

    while ((accept_queue((unsigned)ds->port) > 0 || (n = sockets_of(ds->pid)) > max) &&
           ts_now_ms() < until)
        usleep(20 * 1000);
    return sockets_of(ds->pid);
}

/* The owner's GETs of the job list on fresh connections while the hostile ones trickle: each
 * answered 200; the slowest time is returned, ms. */
static double owner_rounds(const dash *ds, int *fds, int rounds)
{
    char path[128];
    double worst = 0;

    snprintf(path, sizeof(path), "/%s/api/jobs", ds->token);
    for (int r = 0; r < rounds; r++) {
        double t0 = (double)ts_now_ms();
        int fd = http_connect(ds->port), code = http_get_on(fd, path);
        double ms = (double)ts_now_ms() - t0;
        close(fd);
        if (code != 200)
            fail_msg("the owner's GET %s got %d with %d connections held", path, code, HOSTILE);
        worst = ms > worst ? ms : worst;
        trickle(fds, HOSTILE);
        usleep(300 * 1000);
    }
    return worst;
}

/* 1,000 connections that trickle a header a byte at a time, without the token, do not keep the
 * owner out: the owner's requests are answered while they are held, with the dashboard's own
 * connection limit (2048) and with one below their number (a dashboard started with 600 open
 * files holds 268), when the oldest of them are shed; and an owner's kept-alive connection is
 * not among those shed. */
static void test_dashboard_hold(void **state)
{
    char errlog[400], path[128];
    struct rlimit rl;
    long rss, peak, rss0, peak0;
    double worst;
    ts_daemon d;
    dash ds;
    int *fds, keep;

    (void)state;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur < 2 * HOSTILE + 256) {
        rl.rlim_cur = rl.rlim_max < 2 * HOSTILE + 256 ? rl.rlim_max : 2 * HOSTILE + 256;
        assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
    }
    if (rl.rlim_cur < HOSTILE + 64)
        fail_msg("the test needs %d open files; the hard limit is %llu", HOSTILE + 64,
                 (unsigned long long)rl.rlim_max);
    ts_daemon_start(&d, "cpu:1");
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);

    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    rss_kib(ds.pid, &rss0, &peak0);
    fds = hold(ds.port);
    worst = owner_rounds(&ds, fds, 5);
    rss_kib(ds.pid, &rss, &peak);
    printf("# %d connections held: the owner's GET api/jobs took %.1f ms at worst (5 rounds); "
           "the dashboard's VmRSS %ld KiB (%ld before), peak %ld KiB\n",
           HOSTILE, worst, rss, rss0, peak); /* answered (http_get_on's deadline) is the test */
    let_go(fds);
    dash_stop(&ds);

    /* Fewer connections than the flood: the owner's kept-alive one stays, the oldest hostile
     * ones go. */
    dash_nofile = 600;
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    dash_nofile = 0;
    snprintf(path, sizeof(path), "/%s/api/jobs", ds.token);
    keep = http_connect(ds.port);
    assert_int_equal(http_get_on(keep, path), 200);
    fds = hold(ds.port);
    {
        long long t0 = ts_now_ms();
        int n = wait_shed(&ds, 268 + 8); /* its connections, the listener, traind's */
        printf("# the flood against a limit of 268: the dashboard held %d sockets %lld ms after "
               "the last connection\n",
               n, ts_now_ms() - t0);
        if (n > 268 + 8)
            fail_msg("the dashboard still holds %d sockets, its limit 268, 60 s after the flood",
                     n);
    }
    worst = owner_rounds(&ds, fds, 3);
    assert_int_equal(http_get_on(keep, path), 200);
    printf("# %d connections against a limit of 268: the owner's GET took %.1f ms at worst; its "
           "kept-alive connection still answered\n",
           HOSTILE, worst);
    close(keep);
    let_go(fds);
    dash_stop(&ds);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A connection that sends a header a byte at a time is closed when its request is not whole
 * REQUEST_MS after it connected, bytes or not, with a 408 when it can still be read. */
static void test_dashboard_slowloris(void **state)
{
    char errlog[400], buf[512] = "";
    size_t n = 0;
    long long t0, closed = -1;
    ts_daemon d;
    dash ds;
    int fd;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    fd = http_connect(ds.port);
    t0 = ts_now_ms();
    assert_true(send(fd, HOSTILE_HDR, strlen(HOSTILE_HDR), MSG_NOSIGNAL) > 0);
    while (ts_now_ms() - t0 < REQUEST_MS + SLACK_MS) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 500) > 0) {
            ssize_t got = read(fd, buf + n, sizeof(buf) - 1 - n);
            if (got <= 0) {
                closed = ts_now_ms() - t0;
                break;
            }
            n += (size_t)got;
            buf[n] = '\0';
            continue;
        }
        (void)!send(fd, "a", 1, MSG_NOSIGNAL);
    }
    close(fd);
    printf("# a header trickled a byte each 0.5 s: closed after %lld ms (deadline %d ms); "
           "reply: %.40s\n",
           closed, REQUEST_MS, n > 0 ? buf : "(none: reset)");
    if (closed < 0)
        fail_msg("a trickling connection was still open %d ms after it connected",
                 REQUEST_MS + SLACK_MS);
    assert_true(closed >= REQUEST_MS - 500);
    if (n > 0)
        assert_non_null(strstr(buf, "HTTP/1.1 408 "));
    dash_stop(&ds);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Two dashboards without --listen both serve, the second on a port after the first's; a port
 * named with --listen that is taken fails (71, not traind's 69), naming the port. */
static void test_dashboard_two(void **state)
{
    const char *bin = ts_env_or("TRAINCTL_BIN", "build/client/trainctl");
    char errlog[400], cmd[1200], path[128], buf[4096] = "";
    ts_daemon d;
    dash a, b;
    FILE *f;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&a, d.sock, NULL, errlog);
    dash_start(&b, d.sock, NULL, errlog);
    printf("# two dashboards: ports %d and %d\n", a.port, b.port);
    assert_int_not_equal(a.port, b.port);
    assert_true(a.port >= 8080 && a.port < 8180 && b.port >= 8080 && b.port < 8180);
    snprintf(path, sizeof(path), "/%s/", a.token);
    assert_int_equal(http_status(a.port, path), 200);
    snprintf(path, sizeof(path), "/%s/", b.token);
    assert_int_equal(http_status(b.port, path), 200);
    snprintf(cmd, sizeof(cmd), "%s --socket %s dashboard --listen 127.0.0.1:%d 2>%s/taken.log", bin,
             d.sock, a.port, d.dir);
    assert_int_equal(WEXITSTATUS(system(cmd)), 71);
    snprintf(cmd, sizeof(cmd), "%s/taken.log", d.dir);
    f = fopen(cmd, "r");
    assert_non_null(f);
    assert_true(fread(buf, 1, sizeof(buf) - 1, f) > 0);
    fclose(f);
    snprintf(cmd, sizeof(cmd), "cannot listen on 127.0.0.1 port %d: Address already in use",
             a.port);
    if (strstr(buf, cmd) == NULL)
        fail_msg("a taken --listen port said '%s'", buf);
    dash_stop(&b);
    dash_stop(&a);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* %00 in a URL is refused with 400 (it would end the decoded path: app.js%00../../etc/passwd
 * was served as app.js), in the path and in a query. */
static void test_dashboard_nul(void **state)
{
    char errlog[400], path[256];
    ts_daemon d;
    dash ds;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);
    snprintf(path, sizeof(path), "/%s/app.js", ds.token);
    assert_int_equal(http_status(ds.port, path), 200);
    snprintf(path, sizeof(path), "/%s/app.js%%00../../etc/passwd", ds.token);
    assert_int_equal(http_status(ds.port, path), 400);
    snprintf(path, sizeof(path), "/%s/api/jobs?name=a%%00b", ds.token);
    assert_int_equal(http_status(ds.port, path), 400);
    dash_stop(&ds);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- 1,000,000 rows ---- */

/* Job 1: BIG_ROWS rows of BIG_KEYS metrics, stored as traind stores them (keys, rows,
 * summary), ended long ago; then MANY_JOBS ended jobs without rows (ids 2 on). */
static void seed_big_job(const char *db)
{
    char sql[2048];
    td_error_t err;
    td_store *s;

    assert_int_equal(td_store_open(&s, db, &err), 0);
    snprintf(sql, sizeof(sql),
             "BEGIN;"
             "INSERT INTO jobs (name, state, step, total_steps, devices, device_list, uid, created,"
             " started, ended) VALUES ('a million rows', 'succeeded', %d, %d, 1, 'cpu:0', %d,"
             " 1700000000, 1700000000, 1700002000);"
             "INSERT OR IGNORE INTO metric_keys(name) VALUES ('train_loss'), ('lr'),"
             " ('grad_norm'), ('step_ms'), ('samples_per_s');"
             "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < %d)"
             " INSERT INTO metrics (job, key, step, value, time)"
             " SELECT 1, mk.id, i, CASE mk.name"
             "  WHEN 'train_loss' THEN 2.0 * exp(-i / (%d / 6.0)) + 0.3 + (abs(random()) %% 1000)"
             "   / 4000.0"
             "  WHEN 'lr' THEN 0.001 WHEN 'grad_norm' THEN 1.0 + (abs(random()) %% 1000) / 1000.0"
             "  WHEN 'step_ms' THEN 10.0 ELSE 6400.0 END, 1700000000 + i * 0.01"
             " FROM k, metric_keys mk WHERE mk.name IN ('train_loss', 'lr', 'grad_norm',"
             " 'step_ms', 'samples_per_s');"
             "INSERT OR REPLACE INTO metric_summary (job, key, count, last_step, last, \"min\","
             " \"max\") SELECT job, key, count(*), max(step), (SELECT value FROM metrics m2"
             " WHERE m2.job = m.job AND m2.key = m.key ORDER BY step DESC LIMIT 1), min(value),"
             " max(value) FROM metrics m WHERE job = 1 GROUP BY job, key;"
             "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < %d)"
             " INSERT INTO jobs (name, state, step, total_steps, devices, device_list, uid,"
             " created, started, ended) SELECT printf('sweep-%%05d', i), CASE i %% 5 WHEN 0"
             " THEN 'failed' ELSE 'succeeded' END, 100, 100, 1, 'cpu:0', %d, 1700003000 + i,"
             " 1700003000 + i, 1700003100 + i FROM k;"
             "COMMIT;",
             BIG_ROWS / BIG_KEYS, BIG_ROWS / BIG_KEYS, (int)getuid(), BIG_ROWS / BIG_KEYS,
             BIG_ROWS / BIG_KEYS, MANY_JOBS, (int)getuid());
    if (td__store_exec(s, sql, &err) != 0)
        fail_msg("seeding the large job: %s", err.msg);
    td_store_close(s);
}

/* Reads the stream of job id to its "done" event over a raw socket: its bytes and the time it
 * took. With stall_ms > 0 it first reads nothing for that long, with a small receive buffer,
 * and reports the dashboard's memory then (*rss_stalled): a reader that stops must cost the
 * dashboard one round of events at most, not the job's rows. */
static long long read_stream(const dash *ds, int64_t id, int stall_ms, long *rss_stalled,
                             size_t *bytes)
{
    char req[256];
    long long t0 = ts_now_ms();
    int fd = http_connect(ds->port), small = 4096; /* bytes: a receive buffer that fills */
    size_t cap = 1 << 20;
    char *all = malloc(cap);
    long peak;

    assert_non_null(all);
    if (stall_ms > 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    snprintf(req, sizeof(req), "GET /%s/api/stream?jobs=%lld HTTP/1.1\r\nHost: x\r\n\r\n",
             ds->token, (long long)id);
    assert_int_equal(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    if (stall_ms > 0) {
        usleep((useconds_t)stall_ms * 1000);
        rss_kib(ds->pid, rss_stalled, &peak);
    }
    *bytes = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        size_t from = *bytes > 16 ? *bytes - 16 : 0;
        if (poll(&p, 1, WAIT_MS) <= 0)
            fail_msg("the stream of job %lld stalled", (long long)id);
        if (cap - *bytes < 65536) {
            cap *= 2;
            all = realloc(all, cap);
            assert_non_null(all);
        }
        ssize_t n = read(fd, all + *bytes, 65536);
        if (n <= 0)
            fail_msg("the stream of job %lld ended without its done event", (long long)id);
        *bytes += (size_t)n;
        if (memmem(all + from, *bytes - from, "event: done", 11) != NULL)
            break;
    }
    close(fd);
    free(all);
    return ts_now_ms() - t0;
}

/* The list over MANY_JOBS + 2 jobs: its first page (the newest first), the next page, and
 * the running job alone when filtered by state; each within WAIT_MS, and the times printed. */
static void check_many_jobs(cdp *b, const dash *ds, int64_t live)
{
    char expr[512];
    long long first, next, filtered;

    go(b, ds, "");
    snprintf(expr, sizeof(expr),
             "document.querySelectorAll('#jobs tr[data-job]').length === %d && "
             "document.querySelector('#jobs tr[data-job]').dataset.job === '%lld'",
             LIST_PAGE, (long long)live);
    first = cdp_wait(b, expr, WAIT_MS, "the list's first page");
    json_decref(cdp_eval(b, "document.querySelectorAll('.pager button')[1].click()"));
    snprintf(expr, sizeof(expr),
             "document.querySelectorAll('#jobs tr[data-job]').length === %d && "
             "document.querySelector('#jobs tr[data-job]').dataset.job === '%lld'",
             LIST_PAGE, (long long)(live - LIST_PAGE));
    next = cdp_wait(b, expr, WAIT_MS, "the list's second page");
    json_decref(cdp_eval(b, "document.querySelector('input[data-state=\"running\"]').click()"));
    snprintf(expr, sizeof(expr),
             "document.querySelectorAll('#jobs tr[data-job]').length === 1 && "
             "document.querySelector('#jobs tr[data-job]').dataset.job === '%lld'",
             (long long)live);
    filtered = cdp_wait(b, expr, WAIT_MS, "the running job alone");
    json_decref(cdp_eval(b, "document.querySelector('input[data-state=\"running\"]').click()"));
    print_message("dashboard: list of %d jobs: first page in %.2f s, the next in %.2f s, the "
                  "running ones in %.2f s\n",
                  MANY_JOBS + 2, first / 1000.0, next / 1000.0, filtered / 1000.0);
}

static void test_dashboard_million(void **state)
{
    char errlog[400], log[400], frag[64], expr[512], stats[512];
    long rss_before, rss_stalled, rss_now, rss_peak, peak;
    long long stream_ms, load_ms, page_ms, cmp_ms;
    size_t bytes;
    int64_t live;
    ts_daemon d;
    ts_client c;
    dash ds;
    cdp *b;

    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    snprintf(d.db, sizeof(d.db), "%s/traind.db", d.dir);
    long long t0 = ts_now_ms();
    seed_big_job(d.db);
    print_message("dashboard: %d rows stored in %.1f s\n", BIG_ROWS, (ts_now_ms() - t0) / 1000.0);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    live = tj_submit(&c, "live beside a million rows", 128, LIVE_STEPS, NULL, 0);
    assert_int_equal(live, MANY_JOBS + 2);
    ts_wait_state(&c, live, "running", 120);
    snprintf(errlog, sizeof(errlog), "%s/dashboard.log", d.dir);
    dash_start(&ds, d.sock, "127.0.0.1:0", errlog);

    /* The stream alone, read as fast as possible; then by a reader that stops for 3 s. */
    stream_ms = read_stream(&ds, 1, 0, NULL, &bytes);
    print_message("dashboard: the stream of %d rows took %.2f s: %zu bytes of events\n", BIG_ROWS,
                  stream_ms / 1000.0, bytes);
    rss_kib(ds.pid, &rss_before, &peak);
    read_stream(&ds, 1, 3000, &rss_stalled, &bytes);
    print_message("dashboard: memory %ld KiB, %ld KiB while a reader of the stream stalled\n",
                  rss_before, rss_stalled);
    /* One round of events, not the rows. */
    assert_true(SANITIZED || rss_stalled < rss_before + 16 * 1024);

    /* The job's page: loaded when every row is in its charts. */
    snprintf(log, sizeof(log), "%s/chromium.log", d.dir);
    b = live_browser = cdp_start(VIEW_W, VIEW_H, log);
    snprintf(frag, sizeof(frag), "#/job/1");
    go(b, &ds, frag);
    snprintf(expr, sizeof(expr),
             "window.tdash.done && Object.values(window.tdash.series)"
             ".reduce((n, s) => n + s.rows, 0) === %d && window.tdash.drawnMs >= "
             "window.tdash.doneMs - 1000",
             BIG_ROWS);
    load_ms = cdp_wait(b, expr, WAIT_MS, "every row of the large job");
    page_ms = cdp_eval_int(b, "Math.round(Math.max(window.tdash.doneMs, window.tdash.drawnMs))");
    cdp_wait(b, js_chart_pixels, WAIT_MS, "the large job's chart drawn");
    assert_int_equal(cdp_eval_int(b, "window.tdash.series['1/train_loss'].points <= 1024"), 1);
    print_message("dashboard: job page with %d rows loaded in %.2f s (the page's clock, from "
                  "navigation to the last chart drawn; %.2f s seen by the test)\n",
                  BIG_ROWS, page_ms / 1000.0, load_ms / 1000.0);
    assert_true(page_ms < WAIT_MS);

    check_many_jobs(b, &ds, live);

    /* The large job and the live one on one chart: how long a new row takes to be drawn. */
    snprintf(frag, sizeof(frag), "#/compare/1,%lld", (long long)live);
    go(b, &ds, frag);
    snprintf(expr, sizeof(expr),
             "(window.tdash.series['1/train_loss']?.rows === %d) && "
             "(window.tdash.series['%lld/train_loss']?.points > 0)",
             BIG_ROWS / BIG_KEYS, (long long)live);
    cmp_ms = cdp_wait(b, expr, WAIT_MS, "both jobs on the comparison");
    json_decref(cdp_eval(b, "window.tdash.latency = []"));
    /* the live job's next rows, drawn: as many as a loaded box gives in the wait */
    cdp_wait(b, "window.tdash.latency.filter(l => l.job !== 1).length >= 10", WAIT_MS,
             "10 live rows drawn");
    cdp_eval_str(b,
                 "(() => { const ms = window.tdash.latency.filter(l => l.job !== 1)"
                 "  .map(l => l.ms).sort((a, b) => a - b);"
                 "  if (!ms.length) return '';"
                 "  const q = f => ms[Math.min(ms.length - 1, Math.floor(f * ms.length))];"
                 "  return `${ms.length} ${q(0.5)} ${q(0.9)} ${ms[ms.length - 1]}`; })()",
                 stats, sizeof(stats));
    long n = 0, p50 = 0, p90 = 0, max = 0;
    if (sscanf(stats, "%ld %ld %ld %ld", &n, &p50, &p90, &max) != 4)
        fail_msg("no live row's latency was recorded");
    print_message("dashboard: a chart holding %d rows and following a live job: loaded in %.2f s; "
                  "a new row drawn %ld ms after the trainer recorded it (median of %ld draws; "
                  "90th percentile %ld ms, max %ld ms)\n",
                  BIG_ROWS, cmp_ms / 1000.0, p50, n, p90, max);
    assert_true(p50 < 30000);
    cdp_stop(b);
    live_browser = NULL;

    rss_kib(ds.pid, &rss_now, &rss_peak);
    print_message("dashboard: peak memory %ld KiB\n", rss_peak);
    dash_stop(&ds);
    cancel(&d, live);
    ts_wait_state(&c, live, "cancelled", 120);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    /* These need no browser. */
    const struct CMUnitTest plain[] = {
        cmocka_unit_test_teardown(test_dashboard_listen, teardown),
        cmocka_unit_test_teardown(test_dashboard_hold, teardown),
        cmocka_unit_test_teardown(test_dashboard_slowloris, teardown),
        cmocka_unit_test_teardown(test_dashboard_two, teardown),
        cmocka_unit_test_teardown(test_dashboard_nul, teardown),
        cmocka_unit_test(test_dashboard_code_names),
        cmocka_unit_test_teardown(test_dashboard_labels, teardown),
    };
    const struct CMUnitTest browser[] = {
        cmocka_unit_test_teardown(test_dashboard_live, teardown),
        cmocka_unit_test_teardown(test_dashboard_million, teardown),
    };
    const char *only = getenv("TD_TEST_FILTER");
    char why[700];
    int rc;

    if (only != NULL && only[0] != '\0')
        cmocka_set_test_filter(only);
    rc = cmocka_run_group_tests_name("plain", plain, NULL, NULL);
    /* The browser's tests skip only when no browser can run here; a browser that runs and a
     * page that misbehaves fail. */
    if (!cdp_usable(why, sizeof(why))) {
        fprintf(stderr, "test_dashboard: browser tests skipped: %s\n", why);
        return rc;
    }
    return rc | cmocka_run_group_tests_name("browser", browser, NULL, NULL);
}
