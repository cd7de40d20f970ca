/* Checking and escaping text that came from somebody else (td_text.h). No state. */
#include <stdint.h>
#include <stdio.h>

#include "common/td_text.h"

/* The well-formed UTF-8 character at s (n bytes left): its length (1 to 4) with *cp set, or 0
 * when the bytes there are not one (RFC 3629: no overlong forms, surrogates or code points
 * past U+10FFFF). */
static size_t utf8_char(const unsigned char *s, size_t n, uint32_t *cp)
{
    size_t len;
    uint32_t c, min;

    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] >= 0xC2 && s[0] <= 0xDF) {
        len = 2;
        c = s[0] & 0x1F;
        min = 0x80;
    } else if (s[0] >= 0xE0 && s[0] <= 0xEF) {
        len = 3;
        c = s[0] & 0x0F;
        min = 0x800;
    } else if (s[0] >= 0xF0 && s[0] <= 0xF4) {
        len = 4;
        c = s[0] & 0x07;
        min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))
        return 0;
    *cp = c;
    return len;
}

size_t td_text_char(const char *s, size_t n, uint32_t *cp)
{
    return n > 0 ? utf8_char((const unsigned char *)s, n, cp) : 0;
}

int td_text_is_control(uint32_t cp)
{
    return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F);
}

int td_text_check(const char *s, size_t len, size_t *at)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, n;
    uint32_t cp;

    while (i < len) {
        n = utf8_char(p + i, len - i, &cp);
        if (n == 0 || td_text_is_control(cp)) {
            if (at != NULL)
                *at = i;
            return n == 0 ? TD_TEXT_BAD_UTF8 : TD_TEXT_CONTROL;
        }
        i += n;
    }
    return TD_TEXT_OK;
}

size_t td_text_escape(char *out, size_t size, const char *s, size_t len, int flags)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, o = 0, n;
    uint32_t cp;

    if (size == 0)
        return 0;
    while (i < len) {
        n = utf8_char(p + i, len - i, &cp);
        if (n > 0 && (!td_text_is_control(cp) || (cp == '\n' && (flags & TD_TEXT_KEEP_NEWLINES)))) {
            if (o + n >= size)
                break;
            for (size_t k = 0; k < n; k++)
                out[o++] = (char)p[i + k];
            i += n;
            continue;
        }
        /* A control character is escaped byte by byte (a C1 control is two bytes), and so is
         * each byte of malformed UTF-8, one at a time, so that what follows it is read
         * afresh. */
        n = n == 0 ? 1 : n;
        if (o + 4 * n >= size)
            break;
        for (size_t k = 0; k < n; k++)
            o += (size_t)snprintf(out + o, size - o, "\\x%02x", p[i + k]);
        i += n;
    }
    out[o] = '\0';
    return o;
}
