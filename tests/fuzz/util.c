/* The shared helpers of the libFuzzer targets (fuzz.h): the failing check, the input reader and
 * the scratch directory. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"

static char scratch[256]; /* the scratch directory, "" until made */

void tdf_fail(const char *file, int line, const char *what)
{
    fprintf(stderr, "%s:%d: check failed: %s\n", file, line, what);
    abort();
}

uint8_t tdf_u8(tdf_in *in)
{
    uint8_t v = 0;

    if (in->n > 0) {
        v = in->p[0];
        in->p++;
        in->n--;
    }
    return v;
}

uint16_t tdf_u16(tdf_in *in)
{
    uint16_t lo = tdf_u8(in);

    return (uint16_t)(lo | tdf_u8(in) << 8);
}

uint32_t tdf_u32(tdf_in *in)
{
    uint32_t lo = tdf_u16(in);

    return lo | (uint32_t)tdf_u16(in) << 16;
}

const uint8_t *tdf_bytes(tdf_in *in, size_t want, size_t *len)
{
    const uint8_t *p = in->p;

    *len = want < in->n ? want : in->n;
    in->p += *len;
    in->n -= *len;
    return p;
}

/* Empties and removes the scratch directory (it holds files only). */
static void remove_scratch(void)
{
    DIR *d;
    struct dirent *e;
    char path[512];

    if (scratch[0] == '\0' || (d = opendir(scratch)) == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", scratch, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(scratch);
}

const char *tdf_dir(void)
{
    const char *base = getenv("TD_FUZZ_TMP");
    struct stat st;

    if (scratch[0] != '\0')
        return scratch;
    if (base == NULL || base[0] == '\0')
        base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0
                   ? "/dev/shm"
                   : "/tmp";
    if (snprintf(scratch, sizeof(scratch), "%s/traind-fuzz-XXXXXX", base) >= (int)sizeof(scratch) ||
        mkdtemp(scratch) == NULL) {
        fprintf(stderr, "fuzz: cannot make a scratch directory under %s: %s\n", base,
                strerror(errno));
        abort();
    }
    atexit(remove_scratch);
    return scratch;
}

void tdf_path(char *path, size_t size, const char *name)
{
    TDF_CHECK(snprintf(path, size, "%s/%s", tdf_dir(), name) < (int)size);
}

void tdf_write(char *path, size_t size, const char *name, const void *p, size_t n)
{
    const char *b = p;
    int fd;

    tdf_path(path, size, name);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    TDF_CHECK(fd >= 0);
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        TDF_CHECK(w > 0);
        b += w;
        n -= (size_t)w;
    }
    TDF_CHECK(close(fd) == 0);
}
