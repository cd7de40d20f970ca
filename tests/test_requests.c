/* Unit test of the server's table of requests (daemon/server/server.c) against the reference
 * clients are written from (proto/PROTOCOL.md): every request the table dispatches has its
 * section under "Requests and replies", and every such section names a request the table
 * has. A section of a request is a level-3 heading that is one lowercase word ("### rm");
 * the section's other headings are sentences ("### Export, sample, ... keep the order of
 * replies"). PROTOCOL.md is found under $TD_SOURCE_ROOT (tests/meson.build sets it). */
#include <ctype.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/server/server.h"

#define MAX_DOCUMENTED 64 /* request sections PROTOCOL.md may have, for this test's array */
#define NAME_MAX_LEN   32 /* bytes of a request's name, NUL included */

/* The request sections of PROTOCOL.md's "Requests and replies", in its order, into names;
 * returns how many. */
static size_t documented(char (*names)[NAME_MAX_LEN])
{
    const char *root = getenv("TD_SOURCE_ROOT");
    char path[4096], line[512];
    size_t n = 0;
    int inside = 0;
    FILE *f;

    assert_non_null(root);
    snprintf(path, sizeof(path), "%s/proto/PROTOCOL.md", root);
    f = fopen(path, "r");
    if (f == NULL)
        fail_msg("cannot open %s", path);
    while (fgets(line, sizeof(line), f) != NULL) {
        size_t len = strcspn(line, "\r\n"), i = 4;
        line[len] = '\0';
        if (strncmp(line, "## ", 3) == 0)
            inside = strcmp(line, "## Requests and replies") == 0;
        if (!inside || strncmp(line, "### ", 4) != 0)
            continue;
        while (line[i] != '\0' && (islower((unsigned char)line[i]) || line[i] == '_'))
            i++;
        if (line[i] != '\0' || i == 4)
            continue; /* a sentence, not a request's name */
        assert_true(n < MAX_DOCUMENTED);
        assert_true(len - 4 < NAME_MAX_LEN);
        memcpy(names[n], line + 4, len - 4 + 1);
        n++;
    }
    fclose(f);
    return n;
}

static int in_table(const char *name)
{
    for (size_t i = 0; td_server_request(i) != NULL; i++)
        if (strcmp(td_server_request(i), name) == 0)
            return 1;
    return 0;
}

/* The two lists are the same set: each name of one is in the other, once. */
static void test_table_and_protocol_agree(void **state)
{
    char names[MAX_DOCUMENTED][NAME_MAX_LEN];
    size_t n = documented(names), ntable = 0;
    int bad = 0;

    for (; td_server_request(ntable) != NULL; ntable++) {
        const char *r = td_server_request(ntable);
        int found = 0;
        for (size_t i = 0; i < n; i++)
            found += strcmp(names[i], r) == 0;
        for (size_t j = 0; j < ntable; j++)
            if (strcmp(td_server_request(j), r) == 0) {
                print_error("request \"%s\" is in the server's table twice\n", r);
                bad = 1;
            }
        if (found != 1) {
            print_error("request \"%s\" is in the server's table but %s in PROTOCOL.md's "
                        "\"Requests and replies\"\n",
                        r, found == 0 ? "has no section" : "has several sections");
            bad = 1;
        }
    }
    for (size_t i = 0; i < n; i++)
        if (!in_table(names[i])) {
            print_error("PROTOCOL.md documents request \"%s\", which the server's table does "
                        "not have\n",
                        names[i]);
            bad = 1;
        }
    assert_int_equal(bad, 0);
    assert_int_equal(ntable, n);
    /* What the daemon has always answered is there (a table cut short would agree too). */
    assert_true(in_table("hello") && in_table("submit") && in_table("watch") && in_table("rm"));
    assert_null(td_server_request((size_t)-1));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_and_protocol_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
