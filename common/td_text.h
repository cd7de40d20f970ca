/* Text that came from somebody else: a job's name, a path in a job file, a request's type, a
 * log line. td_text_check() says whether such a string is one traind accepts (valid UTF-8
 * without control characters); td_text_escape() makes any bytes safe to print on a terminal or
 * to write into a log, whatever they hold. Pure functions on the caller's buffers: any thread. */
#ifndef TD_TEXT_H
#define TD_TEXT_H

#include <stddef.h>
#include <stdint.h>

/* What td_text_check() found. */
enum {
    TD_TEXT_OK = 0,
    TD_TEXT_BAD_UTF8 = 1, /* a byte that does not belong to a well-formed UTF-8 character */
    TD_TEXT_CONTROL = 2   /* a control character: C0 (U+0000 to U+001F), DEL, C1 (U+0080 to
                           * U+009F) */
};

/* Flags of td_text_escape(). */
#define TD_TEXT_KEEP_NEWLINES 1 /* '\n' passes through; every other control is escaped */

/* The well-formed UTF-8 character at s (n bytes left, n > 0): its length in bytes (1 to 4)
 * with *cp set to its code point, or 0 when the bytes there are not one. */
size_t td_text_char(const char *s, size_t n, uint32_t *cp);

/* Whether code point cp is a control character (C0, DEL, C1). */
int td_text_is_control(uint32_t cp);

/* Checks len bytes at s: TD_TEXT_OK, or what is wrong with *at (when not NULL) set to the
 * offset of the first offending byte. Well-formed UTF-8 means RFC 3629's: no overlong forms,
 * no surrogates, nothing past U+10FFFF. */
int td_text_check(const char *s, size_t len, size_t *at);

/* Writes len bytes at s into out (size bytes, always NUL-terminated when size > 0): well-formed
 * printable UTF-8 as it is, every control character and every byte of malformed UTF-8 as the
 * four characters \xNN (a C1 control's two bytes as two of them). What comes out is printable
 * UTF-8 that cannot move a terminal's cursor, change its colours or start a new log line. Not
 * reversible (a backslash stays a backslash): it is for people to read. When out is too small
 * the text is cut before the character or escape that does not fit. Returns the bytes written,
 * the NUL left out. */
size_t td_text_escape(char *out, size_t size, const char *s, size_t len, int flags);

#endif
