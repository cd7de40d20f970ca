/* How trainctl tells the user that something went wrong: tc_err() and the progress line it
 * ends first (client.h). Every client file reports through these; main's thread only. */
#include <stdarg.h>
#include <stdio.h>

#include "client/client.h"

/* Set by watch.c while its bars, without a last newline, are on stdout. */
int tc_line_open;

int tc_err(int status, const char *fmt, ...)
{
    va_list ap;

    if (tc_line_open) {
        fputc('\n', stdout);
        fflush(stdout);
        tc_line_open = 0;
    }
    fputs("trainctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return status;
}
