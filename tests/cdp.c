/* A headless Chromium driven over the DevTools protocol through a pipe (cdp.h). Owns the
 * browser process (a process group of its own, so that its helpers go with it), its profile
 * directory and the two pipe ends; called from the test's one thread. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/cdp.h"
#include "tests/support.h"

#define CDP_REPLY_MS 60000  /* a reply the browser owes us; generous for a loaded machine */
#define CDP_CLOSE_MS 10000  /* how long Browser.close may take before the group is killed */
#define CDP_POLL_MS  50     /* between two evaluations of cdp_wait */
#define CDP_READ     65536  /* bytes read from the browser at a time */
#define CDP_FD_MAX   1024   /* descriptors the child closes before it runs Chromium */
#define CDP_PROBE_MS 120000 /* a headless start that prints about:blank, on a loaded machine */

struct cdp {
    pid_t pid;
    int to, from; /* our ends: commands to the browser's fd 3, replies from its fd 4 */
    char profile[256];
    char session[128];
    long long next_id;
    char *buf; /* bytes read and not yet taken, up to len */
    size_t len, cap;
    int exceptions;
    char first_exception[1024];
};

/* Writes all of len bytes at p to fd. */
static void write_all(int fd, const void *p, size_t len)
{
    const char *c = p;

    while (len > 0) {
        ssize_t n = write(fd, c, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            fail_msg("cannot write to the browser: %s", strerror(errno));
        c += n;
        len -= (size_t)n;
    }
}

/* Takes note of an event the page sent: exceptions are counted, the rest ignored. */
static void on_event(cdp *b, json_t *msg)
{
    const char *method = json_string_value(json_object_get(msg, "method"));
    json_t *d;
    const char *text;

    if (method == NULL || strcmp(method, "Runtime.exceptionThrown") != 0)
        return;
    d = json_object_get(json_object_get(msg, "params"), "exceptionDetails");
    text = json_string_value(json_object_get(json_object_get(d, "exception"), "description"));
    if (text == NULL)
        text = json_string_value(json_object_get(d, "text"));
    if (b->exceptions++ == 0)
        snprintf(b->first_exception, sizeof(b->first_exception), "%s", text ? text : "?");
    print_message("page exception: %s\n", text ? text : "?");
}

/* The next whole message from the browser (caller decrefs). */
static json_t *next_message(cdp *b)
{
    for (;;) {
        char *nul = b->len > 0 ? memchr(b->buf, '\0', b->len) : NULL;
        if (nul != NULL) {
            size_t n = (size_t)(nul - b->buf);
            json_error_t jerr;
            json_t *msg = json_loadb(b->buf, n, 0, &jerr);
            memmove(b->buf, nul + 1, b->len - n - 1);
            b->len -= n + 1;
            if (msg == NULL)
                fail_msg("the browser sent a message that is not JSON: %s", jerr.text);
            return msg;
        }
        if (b->cap - b->len < CDP_READ) {
            b->cap = b->cap * 2 + CDP_READ;
            b->buf = realloc(b->buf, b->cap);
            assert_non_null(b->buf);
        }
        struct pollfd p = {.fd = b->from, .events = POLLIN};
        if (poll(&p, 1, CDP_REPLY_MS) == 0)
            fail_msg("the browser did not answer within %d s", CDP_REPLY_MS / 1000);
        ssize_t r = read(b->from, b->buf + b->len, CDP_READ);
        if (r <= 0)
            fail_msg("the browser closed its DevTools pipe");
        b->len += (size_t)r;
    }
}

/* Sends method to the browser (session NULL) or the page, and returns its result. */
static json_t *send_cmd(cdp *b, const char *session, const char *method, json_t *params)
{
    long long id = ++b->next_id;
    json_t *msg = json_pack("{s:I, s:s, s:o}", "id", (json_int_t)id, "method", method, "params",
                            params != NULL ? params : json_object());
    char *text;

    assert_non_null(msg);
    if (session != NULL)
        json_object_set_new(msg, "sessionId", json_string(session));
    text = json_dumps(msg, JSON_COMPACT);
    json_decref(msg);
    assert_non_null(text);
    write_all(b->to, text, strlen(text) + 1); /* the NUL ends the message */
    free(text);
    for (;;) {
        json_t *reply = next_message(b), *result;
        json_t *rid = json_object_get(reply, "id");
        if (rid == NULL || json_integer_value(rid) != id) {
            on_event(b, reply);
            json_decref(reply);
            continue;
        }
        if (json_object_get(reply, "error") != NULL) {
            const char *m =
                json_string_value(json_object_get(json_object_get(reply, "error"), "message"));
            fail_msg("the browser refused %s: %s", method, m ? m : "?");
        }
        result = json_incref(json_object_get(reply, "result"));
        json_decref(reply);
        return result != NULL ? result : json_object();
    }
}

json_t *cdp_call(cdp *b, const char *method, json_t *params)
{
    return send_cmd(b, b->session, method, params);
}

/* The last non-empty line of the file at path into buf (empty when there is none). */
static void last_line(const char *path, char *buf, size_t size)
{
    char line[256];
    FILE *f = fopen(path, "r");

    buf[0] = '\0';
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] != '\0')
            snprintf(buf, size, "%s", line);
    }
    if (f != NULL)
        fclose(f);
}

int cdp_usable(char *why, size_t size)
{
    const char *bin = ts_env_or("TD_CHROMIUM", "/usr/bin/chromium");
    char profile[] = "/tmp/td-chromium-probe.XXXXXX", err[300], user_dir[320], cmd[400];
    char line[256];
    int status = -1, fd;
    pid_t pid;

    if (access(bin, X_OK) != 0) {
        snprintf(why, size, "%s: %s (Debian's chromium; scripts/deps.sh installs it)", bin,
                 strerror(errno));
        return 0;
    }
    assert_non_null(mkdtemp(profile));
    snprintf(err, sizeof(err), "%s/stderr", profile);
    snprintf(user_dir, sizeof(user_dir), "--user-data-dir=%s", profile);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        setpgid(0, 0);
        fd = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 2) < 0 || (fd = open("/dev/null", O_RDWR)) < 0 || dup2(fd, 0) < 0 ||
            dup2(fd, 1) < 0)
            _exit(126);
        execl(bin, bin, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", user_dir, "--dump-dom", "about:blank", (char *)NULL);
        _exit(127);
    }
    for (long long until = ts_now_ms() + CDP_PROBE_MS; ts_now_ms() < until;) {
        if (waitpid(pid, &status, WNOHANG) == pid)
            break;
        usleep(100 * 1000);
    }
    if (status == -1) {
        kill(-pid, SIGKILL);
        waitpid(pid, &status, 0);
    }
    last_line(err, line, sizeof(line));
    snprintf(cmd, sizeof(cmd), "rm -rf %s", profile);
    if (system(cmd) != 0)
        print_message("could not remove %s\n", profile);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        fail_msg("%s --headless --dump-dom about:blank did not end within %d s", bin,
                 CDP_PROBE_MS / 1000);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 1;
    snprintf(why, size, "%s --headless cannot run (%s %d): %s", bin,
             WIFEXITED(status) ? "exit status" : "signal",
             WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
             line[0] != '\0' ? line : "it wrote nothing to stderr");
    return 0;
}

/* Runs Chromium in the child: its fd 3 reads our commands, its fd 4 writes its replies. */
static void exec_browser(int cmd_r, int reply_w, const char *profile, int width, int height,
                         const char *log)
{
    const char *bin = ts_env_or("TD_CHROMIUM", "/usr/bin/chromium");
    char user_dir[300], size[64];
    int a = fcntl(cmd_r, F_DUPFD, 10), z = fcntl(reply_w, F_DUPFD, 10), fd;

    setpgid(0, 0);
    fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (a < 0 || z < 0 || fd < 0 || dup2(fd, 2) < 0 || dup2(a, 3) < 0 || dup2(z, 4) < 0)
        _exit(126);
    fd = open("/dev/null", O_RDWR);
    if (fd < 0 || dup2(fd, 0) < 0 || dup2(fd, 1) < 0)
        _exit(126);
    for (fd = 5; fd < CDP_FD_MAX; fd++)
        close(fd);
    snprintf(user_dir, sizeof(user_dir), "--user-data-dir=%s", profile);
    snprintf(size, sizeof(size), "--window-size=%d,%d", width, height);
    /* The flags Debian's chromium needs here: as root it needs --no-sandbox, and without the
     * background-networking ones it tries to reach Google's servers, which this machine's
     * network refuses. */
    execl(bin, bin, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
          "--no-first-run", "--disable-background-networking", "--disable-component-update",
          "--disable-sync", "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars",
          "--mute-audio", "--remote-debugging-pipe", user_dir, size, "about:blank", (char *)NULL);
    _exit(127);
}

cdp *cdp_start(int width, int height, const char *log)
{
    cdp *b = calloc(1, sizeof(*b));
    int cmd[2], reply[2];
    json_t *r;
    const char *s;

    assert_non_null(b);
    snprintf(b->profile, sizeof(b->profile), "/tmp/td-chromium.XXXXXX");
    assert_non_null(mkdtemp(b->profile));
    assert_int_equal(pipe(cmd), 0);
    assert_int_equal(pipe(reply), 0);
    b->pid = fork();
    assert_true(b->pid >= 0);
    if (b->pid == 0)
        exec_browser(cmd[0], reply[1], b->profile, width, height, log);
    close(cmd[0]);
    close(reply[1]);
    b->to = cmd[1];
    b->from = reply[0];
    fcntl(b->to, F_SETFD, FD_CLOEXEC);
    fcntl(b->from, F_SETFD, FD_CLOEXEC);
    signal(SIGPIPE, SIG_IGN); /* a browser that died is reported by the read, not a signal */

    r = send_cmd(b, NULL, "Target.createTarget", json_pack("{s:s}", "url", "about:blank"));
    s = json_string_value(json_object_get(r, "targetId"));
    assert_non_null(s);
    json_t *p = json_pack("{s:s, s:b}", "targetId", s, "flatten", 1);
    json_decref(r);
    r = send_cmd(b, NULL, "Target.attachToTarget", p);
    s = json_string_value(json_object_get(r, "sessionId"));
    assert_non_null(s);
    snprintf(b->session, sizeof(b->session), "%s", s);
    json_decref(r);
    json_decref(cdp_call(b, "Page.enable", NULL));
    json_decref(cdp_call(b, "Runtime.enable", NULL));
    json_decref(cdp_call(b, "Emulation.setDeviceMetricsOverride",
                         json_pack("{s:i, s:i, s:i, s:b}", "width", width, "height", height,
                                   "deviceScaleFactor", 1, "mobile", 0)));
    return b;
}

void cdp_stop(cdp *b)
{
    char cmd[320];
    int status;

    if (b == NULL)
        return;
    /* Browser.close's reply may never come: the browser closes the pipe as it exits. */
    char msg[] = "{\"id\":999999999,\"method\":\"Browser.close\",\"params\":{}}";
    if (write(b->to, msg, sizeof(msg)) < 0) {
        /* already gone: the wait below reaps it */
    }
    for (long long until = ts_now_ms() + CDP_CLOSE_MS; ts_now_ms() < until;) {
        if (waitpid(b->pid, &status, WNOHANG) == b->pid) {
            b->pid = -1;
            break;
        }
        usleep(50 * 1000);
    }
    if (b->pid > 0) {
        kill(-b->pid, SIGKILL);
        waitpid(b->pid, &status, 0);
    }
    close(b->to);
    close(b->from);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", b->profile);
    if (system(cmd) != 0)
        print_message("could not remove %s\n", b->profile);
    free(b->buf);
    free(b);
}

void cdp_navigate(cdp *b, const char *url)
{
    json_t *r = cdp_call(b, "Page.navigate", json_pack("{s:s}", "url", url));
    const char *err = json_string_value(json_object_get(r, "errorText"));

    if (err != NULL)
        fail_msg("cannot load %s: %s", url, err);
    json_decref(r);
}

/* Evaluates expr; an exception fails the test when fatal, else gives NULL. */
static json_t *evaluate(cdp *b, const char *expr, int fatal)
{
    json_t *r = cdp_call(
        b, "Runtime.evaluate",
        json_pack("{s:s, s:b, s:b}", "expression", expr, "returnByValue", 1, "awaitPromise", 1));
    json_t *ex = json_object_get(r, "exceptionDetails"), *v;

    if (ex != NULL && !fatal) {
        json_decref(r);
        return NULL;
    }
    if (ex != NULL) {
        const char *t =
            json_string_value(json_object_get(json_object_get(ex, "exception"), "description"));
        fail_msg("%s threw: %s", expr, t ? t : json_string_value(json_object_get(ex, "text")));
    }
    v = json_object_get(json_object_get(r, "result"), "value");
    v = v != NULL ? json_incref(v) : json_null();
    json_decref(r);
    return v;
}

json_t *cdp_eval(cdp *b, const char *expr)
{
    return evaluate(b, expr, 1);
}

long long cdp_eval_int(cdp *b, const char *expr)
{
    json_t *v = cdp_eval(b, expr);
    long long n = json_is_integer(v) ? (long long)json_integer_value(v)
                  : json_is_real(v)  ? (long long)json_real_value(v)
                  : json_is_true(v)  ? 1
                                     : 0;

    json_decref(v);
    return n;
}

void cdp_eval_str(cdp *b, const char *expr, char *buf, size_t size)
{
    json_t *v = cdp_eval(b, expr);

    snprintf(buf, size, "%s", json_is_string(v) ? json_string_value(v) : "");
    json_decref(v);
}

long long cdp_wait(cdp *b, const char *expr, int timeout_ms, const char *what)
{
    long long t0 = ts_now_ms();

    for (;;) {
        json_t *v = evaluate(b, expr, 0); /* what it reads may not be there yet: not yet */
        int ok = json_is_true(v) || (json_is_number(v) && json_number_value(v) != 0) ||
                 (json_is_string(v) && json_string_length(v) > 0) || json_is_object(v) ||
                 json_is_array(v);
        json_decref(v);
        if (ok)
            return ts_now_ms() - t0;
        if (ts_now_ms() - t0 > timeout_ms)
            fail_msg("the page did not show %s within %d s", what, timeout_ms / 1000);
        usleep(CDP_POLL_MS * 1000);
    }
}

/* Decodes base64 text (padding optional, no line breaks) into a new buffer. */
static unsigned char *from_base64(const char *s, size_t *len)
{
    size_t n = strlen(s), o = 0;
    unsigned char *out = malloc(n / 4 * 3 + 3);
    uint32_t acc = 0;
    int bits = 0;

    assert_non_null(out);
    for (size_t i = 0; i < n && s[i] != '='; i++) {
        const char *alpha = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        const char *p = strchr(alpha, s[i]);
        assert_non_null(p);
        acc = acc << 6 | (uint32_t)(p - alpha);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (unsigned char)(acc >> bits);
        }
    }
    *len = o;
    return out;
}

unsigned char *cdp_screenshot(cdp *b, size_t *len)
{
    json_t *r = cdp_call(b, "Page.captureScreenshot", json_pack("{s:s}", "format", "png"));
    const char *data = json_string_value(json_object_get(r, "data"));
    unsigned char *png;

    assert_non_null(data);
    png = from_base64(data, len);
    json_decref(r);
    return png;
}

int cdp_exceptions(cdp *b, char *buf, size_t size)
{
    if (buf != NULL)
        snprintf(buf, size, "%s", b->first_exception);
    return b->exceptions;
}
