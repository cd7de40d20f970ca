/* Unit tests of common/td_text.h: what counts as text (UTF-8 without control characters), and
 * the escaping that makes any bytes safe to print or log. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "common/td_text.h"

/* td_text_check of a literal (len from sizeof, so NULs inside count). */
#define CHECK(lit, at) td_text_check(lit, sizeof(lit) - 1, at)

static void test_check(void **state)
{
    size_t at = 99;

    assert_int_equal(CHECK("", &at), TD_TEXT_OK);
    assert_int_equal(CHECK("plain job-1 \xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", &at),
                     TD_TEXT_OK);
    assert_int_equal(CHECK("a\nb", &at), TD_TEXT_CONTROL);
    assert_int_equal(at, 1);
    assert_int_equal(CHECK("ab\x1b[31m", &at), TD_TEXT_CONTROL);
    assert_int_equal(at, 2);
    assert_int_equal(CHECK("x\x7f", &at), TD_TEXT_CONTROL);
    assert_int_equal(CHECK("x\xc2\x9b", &at), TD_TEXT_CONTROL); /* C1: CSI */
    assert_int_equal(at, 1);
    assert_int_equal(CHECK("a\0b", &at), TD_TEXT_CONTROL);
    assert_int_equal(CHECK("\xff", &at), TD_TEXT_BAD_UTF8);
    assert_int_equal(at, 0);
    assert_int_equal(CHECK("ok\xc0\xaf", &at), TD_TEXT_BAD_UTF8); /* overlong '/' */
    assert_int_equal(at, 2);
    assert_int_equal(CHECK("\xed\xa0\x80", &at), TD_TEXT_BAD_UTF8);     /* a surrogate */
    assert_int_equal(CHECK("\xf4\x90\x80\x80", &at), TD_TEXT_BAD_UTF8); /* past U+10FFFF */
    assert_int_equal(CHECK("\xe2\x82", &at), TD_TEXT_BAD_UTF8);         /* cut short */
    assert_int_equal(CHECK("\xc2\xa0", NULL), TD_TEXT_OK);              /* NBSP is text */
}

static void test_escape(void **state)
{
    char out[64];
    size_t n;

    n = td_text_escape(out, sizeof(out), "evil\x1b[31m\n<0>x\xff\x07", 16, 0);
    assert_string_equal(out, "evil\\x1b[31m\\x0a<0>x\\xff\\x07");
    assert_int_equal(n, strlen(out));
    td_text_escape(out, sizeof(out), "line 1\nline 2\r", 14, TD_TEXT_KEEP_NEWLINES);
    assert_string_equal(out, "line 1\nline 2\\x0d");
    td_text_escape(out, sizeof(out),
                   "\xc2\x9b"
                   "2J \xc3\xa9",
                   7, 0);
    assert_string_equal(out, "\\xc2\\x9b2J \xc3\xa9");
    /* A malformed byte is escaped alone, and what follows it is read afresh. */
    td_text_escape(out, sizeof(out),
                   "\xe2\x82"
                   "A",
                   3, 0);
    assert_string_equal(out, "\\xe2\\x82A");
    /* Cut before what does not fit: never half an escape, never half a character. */
    td_text_escape(out, 6, "ab\x1b", 3, 0);
    assert_string_equal(out, "ab");
    td_text_escape(out, 4, "ab\xc3\xa9", 4, 0);
    assert_string_equal(out, "ab");
    td_text_escape(out, 5, "ab\xc3\xa9", 4, 0);
    assert_string_equal(out, "ab\xc3\xa9");
    assert_int_equal(td_text_escape(out, 1, "abc", 3, 0), 0);
    assert_string_equal(out, "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check),
        cmocka_unit_test(test_escape),
    };

    return cmocka_run_group_tests_name("text", tests, NULL, NULL);
}
