/* The pieces every part of traind shares: error texts, the panic boundary, logging, the
 * clock. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_clock.h"
#include "td_errno.h"
#include "td_log.h"
#include "td_panic.h"

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

void td__boundary_enter(td_boundary *b)
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
        fprintf(stderr, "<2>td_panic outside a boundary (%s): ", td_strerror(code));
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
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

void td_log(int level, const char *fmt, ...)
{
    char line[2048];
    va_list ap;
    int n;

    if (level > log_level)
        return;
    n = snprintf(line, sizeof(line), "<%d>", level);
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* One write keeps lines from different threads whole. */
    if (write(STDERR_FILENO, line, (size_t)n) < 0)
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
