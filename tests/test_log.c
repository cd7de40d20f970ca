/* Unit tests of traind's log lines (common/td_common.c, td_log.h): journald's "<N>" prefixes
 * only when stderr is the journal (JOURNAL_STREAM names stderr's own device and inode), plain
 * lines with the local time and the level's word otherwise (unset, malformed, or naming
 * another file), continuation lines, escaping, and the level filter. stderr is pointed at a
 * temporary file for each case and read back. Single-threaded. */
#include <fcntl.h>
#include <regex.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/td_log.h"

typedef struct fixture {
    char path[256];
    int fd;    /* the file */
    int saved; /* the test's own stderr, while stderr is the file */
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));

    if (f == NULL)
        return -1;
    snprintf(f->path, sizeof(f->path), "/tmp/td_log_XXXXXX");
    f->fd = mkstemp(f->path);
    if (f->fd < 0)
        return -1;
    f->saved = -1;
    unsetenv("JOURNAL_STREAM");
    td_log_set_level(TD_LOG_INFO);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;

    close(f->fd);
    unlink(f->path);
    unsetenv("JOURNAL_STREAM");
    td_log_detect();
    free(f);
    return 0;
}

/* Points stderr at the file (and cmocka's messages with it: only td_log runs meanwhile). */
static void to_file(fixture *f)
{
    fflush(stderr);
    f->saved = dup(STDERR_FILENO);
    assert_true(f->saved >= 0);
    assert_true(dup2(f->fd, STDERR_FILENO) >= 0);
}

/* Gives the test its stderr back. */
static void back(fixture *f)
{
    assert_true(dup2(f->saved, STDERR_FILENO) >= 0);
    close(f->saved);
    f->saved = -1;
}

/* What was logged so far (the file's whole text) into buf. */
static const char *logged(const fixture *f, char *buf, size_t size)
{
    FILE *in = fopen(f->path, "r");
    size_t n;

    assert_non_null(in);
    n = fread(buf, 1, size - 1, in);
    buf[n] = '\0';
    fclose(in);
    return buf;
}

/* JOURNAL_STREAM set to dev:ino of the file at path. */
static void journal_is(const char *path)
{
    struct stat st;
    char v[64];

    assert_int_equal(stat(path, &st), 0);
    snprintf(v, sizeof(v), "%llu:%llu", (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    assert_int_equal(setenv("JOURNAL_STREAM", v, 1), 0);
    td_log_detect();
}

/* Whether text matches the extended regular expression re. */
static int matches(const char *text, const char *re)
{
    regex_t r;
    int ok;

    assert_int_equal(regcomp(&r, re, REG_EXTENDED | REG_NEWLINE | REG_NOSUB), 0);
    ok = regexec(&r, text, 0, NULL, 0) == 0;
    regfree(&r);
    return ok;
}

static void test_journal_gets_prefixes(void **state)
{
    fixture *f = *state;
    char buf[4096];

    to_file(f);
    journal_is(f->path);
    td_log_warn("disk %s is full", "/srv");
    td_log_notice("two\nlines");
    td_log_err("evil \x1b[2J name");
    back(f);
    td_log_detect(); /* the test's stderr, not the file, from here on */
    assert_false(td_log_to_journal());
    assert_string_equal(logged(f, buf, sizeof(buf)), "<4>disk /srv is full\n"
                                                     "<5>two\n"
                                                     "<5>  lines\n"
                                                     "<3>evil \\x1b[2J name\n");
}

static void test_plain_without_journal(void **state)
{
    fixture *f = *state;
    char buf[4096];

    to_file(f);
    td_log_detect(); /* JOURNAL_STREAM unset */
    td_log_warn("disk %s is full", "/srv");
    td_log_notice("two\nlines");
    td_log_debug("not shown at level info");
    back(f);
    logged(f, buf, sizeof(buf));
    assert_null(strchr(buf, '<'));
    assert_true(matches(buf, "^[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3} "
                             "warning: disk /srv is full$"));
    assert_true(matches(buf, "^[0-9-]{10} [0-9:.]{12} notice: two$"));
    assert_true(matches(buf, "^  lines$"));
    assert_null(strstr(buf, "not shown"));
}

/* The variable alone is not enough: it must name stderr itself. A program started from a
 * service's shell inherits JOURNAL_STREAM with its stderr somewhere else. */
static void test_other_stream_is_plain(void **state)
{
    fixture *f = *state;
    char buf[4096], other[64] = "/tmp/td_log_other_XXXXXX";
    int fd = mkstemp(other);

    assert_true(fd >= 0);
    close(fd);
    to_file(f);
    journal_is(other);
    td_log_info("to a file");
    setenv("JOURNAL_STREAM", "not numbers", 1);
    td_log_detect();
    td_log_info("bad variable");
    back(f);
    assert_int_equal(setenv("JOURNAL_STREAM", "1:2:3", 1), 0);
    td_log_detect();
    assert_false(td_log_to_journal());
    logged(f, buf, sizeof(buf));
    assert_null(strchr(buf, '<'));
    assert_true(matches(buf, " info: to a file$"));
    assert_true(matches(buf, " info: bad variable$"));
    unlink(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_journal_gets_prefixes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plain_without_journal, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_stream_is_plain, setup, teardown),
    };

    return cmocka_run_group_tests_name("log", tests, NULL, NULL);
}
