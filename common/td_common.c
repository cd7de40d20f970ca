/* The pieces every part of traind shares: error texts, the panic boundary, logging, the
 * clock. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/td_clock.h"
#include "common/td_errno.h"
#include "common/td_log.h"
#include "common/td_panic.h"
#include "common/td_text.h"

const char *td_strerror(int code)
{
    switch (code) {
#define TD_ERRNO_TEXT(name, val, text) \
    case val:                          \
        return text;
        TD_ERRNO_MAP(TD_ERRNO_TEXT)
#undef TD_ERRNO_TEXT
    case 0:
        return "success";
    default:
        if (code < 0 && code > -4096)
            return strerror(-code);
        return "unknown error";
    }
}

const char *td_errname(int code)
{
    switch (code) {
#define TD_ERRNO_NAME(name, val, text) \
    case val:                          \
        return #name;
        TD_ERRNO_MAP(TD_ERRNO_NAME)
#undef TD_ERRNO_NAME
    case 0:
        return "OK";
    default:
        return "E?";
    }
}

int td_error_vset(td_error_t *err, int code, const char *fmt, va_list ap)
{
    if (err == NULL)
        return code;
    err->code = code;
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    return code;
}

int td_error_set(td_error_t *err, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    td_error_vset(err, code, fmt, ap);
    va_end(ap);
    return code;
}

void td_error_clear(td_error_t *err)
{
    if (err == NULL)
        return;
    err->code = 0;
    err->msg[0] = '\0';
}

_Thread_local td_boundary *td__boundary_top;

void td_boundary_enter(td_boundary *b)
{
    td_error_clear(&b->err);
    b->prev = td__boundary_top;
    td__boundary_top = b;
}

void td_boundary_leave(td_boundary *b)
{
    if (td__boundary_top == b)
        td__boundary_top = b->prev;
}

_Noreturn void td_panic(int code, const char *fmt, ...)
{
    td_boundary *b = td__boundary_top;
    va_list ap;

    va_start(ap, fmt);
    if (b == NULL) {
        /* No boundary: a bug in the caller, since panics are only for worker steps. */
        char what[1024];
        vsnprintf(what, sizeof(what), fmt, ap);
        td_log(2, "td_panic outside a boundary (%s): %s", td_strerror(code), what);
        abort();
    }
    td_error_vset(&b->err, code, fmt, ap);
    va_end(ap);
    td__boundary_top = b->prev;
    longjmp(b->env, 1);
}

static int log_level = TD_LOG_INFO;

void td_log_set_level(int level)
{
    log_level = level;
}

int td_log_level(void)
{
    return log_level;
}

/* Bytes of one log call's text before escaping, and after: every escape takes 4 bytes for 1. */
#define LOG_TEXT_MAX 2048
#define LOG_LINE_MAX (4 * LOG_TEXT_MAX)

/* Where stderr goes: -1 not looked at yet, 1 the journal, 0 anything else. */
static atomic_int log_journal = -1;

/* Whether stderr is the journal's stream. systemd sets JOURNAL_STREAM to "DEVICE:INODE" of the
 * stream it connects a service's stderr to (systemd.exec(5)); a program started from that
 * service's shell, or whose stderr was redirected since, inherits the variable but not the
 * stream, which is why both numbers must match stderr's own (as sd_journal_stream_fd's users
 * check them). */
static int stderr_is_journal(void)
{
    const char *v = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    int end = 0;

    if (v == NULL || sscanf(v, "%llu:%llu%n", &dev, &ino, &end) != 2 || v[end] != '\0' ||
        fstat(STDERR_FILENO, &st) != 0)
        return 0;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

void td_log_detect(void)
{
    atomic_store(&log_journal, stderr_is_journal());
}

int td_log_to_journal(void)
{
    int j = atomic_load(&log_journal);

    if (j < 0) {
        j = stderr_is_journal();
        atomic_store(&log_journal, j);
    }
    return j;
}

/* The words of --log-level (and syslog's for the levels above err). */
static const char *level_word(int level)
{
    static const char *const words[] = {"emerg",   "alert",  "crit", "err",
                                        "warning", "notice", "info", "debug"};

    return level >= 0 && level < 8 ? words[level] : "log";
}

/* Appends a line's start for level to line (size bytes) at *n: for the journal "<N>", which
 * journald turns into the record's priority (sd-daemon(3)), and, on a continuation, two
 * spaces; else, on a first line, the local time and the level's word ("2026-11-30
 * 05:16:51.042 warning: "), and two spaces on a continuation. */
static void log_prefix(char *line, size_t size, size_t *n, int level, int journal, int first)
{
    struct timespec ts;
    struct tm tm;
    int k = 0;

    if (journal) {
        k = snprintf(line + *n, size - *n, "<%d>%s", level, first ? "" : "  ");
    } else if (!first) {
        k = snprintf(line + *n, size - *n, "  ");
    } else {
        clock_gettime(CLOCK_REALTIME, &ts);
        localtime_r(&ts.tv_sec, &tm);
        k = (int)strftime(line + *n, size - *n, "%Y-%m-%d %H:%M:%S", &tm);
        k += snprintf(line + *n + k, size - *n - (size_t)k, ".%03ld %s: ", ts.tv_nsec / 1000000L,
                      level_word(level));
    }
    if (k > 0)
        *n += (size_t)k < size - *n ? (size_t)k : size - *n - 1;
}

void td_log(int level, const char *fmt, ...)
{
    char text[LOG_TEXT_MAX], esc[LOG_LINE_MAX], line[LOG_LINE_MAX + 512];
    size_t n = 0, len;
    va_list ap;
    int k, journal = td_log_to_journal();

    if (level > log_level)
        return;
    va_start(ap, fmt);
    k = vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    len = k < 0 ? 0 : (size_t)k < sizeof(text) ? (size_t)k : sizeof(text) - 1;
    /* Messages carry what clients sent (job names, paths): a control character in them must
     * not reach the terminal or start a journald record of its own with a forged "<0>". So
     * everything but newlines is escaped, and each further line of a message gets (for the
     * journal, the same priority and) an indent, which marks it as the continuation it is. */
    td_text_escape(esc, sizeof(esc), text, len, TD_TEXT_KEEP_NEWLINES);
    log_prefix(line, sizeof(line), &n, level, journal, 1);
    for (const char *p = esc; *p != '\0' && n + 8 < sizeof(line); p++) {
        line[n++] = *p;
        if (*p == '\n')
            log_prefix(line, sizeof(line), &n, level, journal, 0);
    }
    line[n++] = '\n';
    /* One write keeps lines from different threads whole. */
    if (write(STDERR_FILENO, line, n) < 0)
        return;
}

double td_clock_ms(clockid_t clock)
{
    struct timespec ts;

    clock_gettime(clock, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

double td_mono_ms(void)
{
    return td_clock_ms(CLOCK_MONOTONIC);
}

double td_wall_s(void)
{
    return td_clock_ms(CLOCK_REALTIME) / 1e3;
}
