/* Checkpoint files (ckpt.h): one job's state written crash-safely as dir/ckpt-STEP.bin (temp
 * file, fsync, rename, fsync of the directory), pruned to the newest few, and read back with
 * every size and checksum checked, so a torn file is skipped for the one before it. Owns no
 * state between calls; blocking I/O on the caller's thread. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "train/ckpt.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoints are written in host order and documented as little-endian"
#endif

#define FNV_PRIME  0x100000001b3ull
#define IO_CHUNK   (1u << 20) /* bytes per read, write and crc32 call (crc32 takes a uInt) */
#define MAX_LISTED (1 << 20)  /* checkpoint files in one directory */

/* Header offsets, in bytes. */
#define H_MAGIC      0
#define H_VERSION    4
#define H_HBYTES     8
#define H_NSECT      12
#define H_STEP       16
#define H_HASH       24
#define H_RNG        32
#define H_CURSOR     (H_RNG + 8 * TD_CKPT_RNG_WORDS)
#define H_SECTIONS   (H_CURSOR + 8 * TD_CKPT_CURSOR_WORDS)
#define H_SECT_BYTES (TD_CKPT_NAME_MAX + 8)
#define H_CRC        (TD_CKPT_HEADER_BYTES - 4)
#define TRAILER      8 /* bytes: crc32, end magic */

_Static_assert(H_SECTIONS + TD_CKPT_MAX_SECTIONS * H_SECT_BYTES <= H_CRC,
               "the header's sections must fit before its CRC");

uint64_t td_ckpt_hash(uint64_t h, const void *bytes, size_t n)
{
    const unsigned char *p = bytes;

    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= FNV_PRIME;
    }
    return h;
}

static uint32_t crc_update(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;

    while (len > 0) {
        uInt chunk = len > IO_CHUNK ? IO_CHUNK : (uInt)len;
        crc = (uint32_t)crc32(crc, p, chunk);
        p += chunk;
        len -= chunk;
    }
    return crc;
}

/* A full disk, a quota or a file size limit: the user's fix is room, not a bug report. */
static int io_error(td_error_t *err, int errnum, const char *path, const char *what)
{
    int code = errnum == ENOSPC || errnum == EDQUOT || errnum == EFBIG ? TD_EDISKFULL : TD_EIO;

    return td_error_set(err, code, "%s: %s: %s", path, what, strerror(errnum));
}

/* ---- the directory ------------------------------------------------------------------------- */

/* mkdir -p: each missing component, 0700: a checkpoint holds a job's weights, which only
 * the daemon (and, through it, the job's owner) may read. */
static int make_dir(const char *dir, td_error_t *err)
{
    char p[TD_CKPT_PATH_MAX];
    size_t len = strlen(dir);

    if (len == 0 || len >= sizeof(p))
        return td_error_set(err, TD_EINVAL, "checkpoint directory '%s': empty or too long", dir);
    memcpy(p, dir, len + 1);
    for (size_t i = 1; i <= len; i++) {
        if (p[i] != '/' && p[i] != '\0')
            continue;
        p[i] = '\0';
        if (mkdir(p, 0700) != 0 && errno != EEXIST)
            return io_error(err, errno, p, "cannot create the checkpoint directory");
        p[i] = i < len ? '/' : '\0';
    }
    return 0;
}

/* The step of a name `ckpt-DIGITS.bin`, or -1 for any other name. */
static int64_t step_of(const char *name)
{
    const char *p = name + 5;
    int64_t step = 0;

    if (strncmp(name, "ckpt-", 5) != 0 || *p < '0' || *p > '9')
        return -1;
    for (; *p >= '0' && *p <= '9'; p++) {
        if (step > (INT64_MAX - 9) / 10)
            return -1;
        step = step * 10 + (*p - '0');
    }
    return strcmp(p, ".bin") == 0 ? step : -1;
}

static int cmp_desc(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;

    return x < y ? 1 : x > y ? -1 : 0;
}

/* The steps of dir's checkpoint files, highest first, in *steps (caller frees). TD_ENOTFOUND
 * for no directory. */
static int list_steps(const char *dir, int64_t **steps, int *n, td_error_t *err)
{
    DIR *dp = opendir(dir);
    struct dirent *e;
    int cap = 0, rc = 0;

    *steps = NULL;
    *n = 0;
    if (dp == NULL && errno == ENOENT)
        return td_error_set(err, TD_ENOTFOUND, "%s: no checkpoint directory", dir);
    if (dp == NULL)
        return io_error(err, errno, dir, "cannot list checkpoints");
    while ((e = readdir(dp)) != NULL) {
        int64_t s = step_of(e->d_name);
        if (s < 0)
            continue;
        if (*n == cap) {
            int64_t *grown = cap < MAX_LISTED ? realloc(*steps, (size_t)(cap + 64) * 8) : NULL;
            if (grown == NULL) {
                rc = td_error_set(err, TD_ENOMEM, "%s: more than %d checkpoint files", dir, cap);
                break;
            }
            *steps = grown;
            cap += 64;
        }
        (*steps)[(*n)++] = s;
    }
    closedir(dp);
    if (rc != 0) {
        free(*steps);
        *steps = NULL;
        *n = 0;
        return rc;
    }
    if (*n > 1)
        qsort(*steps, (size_t)*n, sizeof(int64_t), cmp_desc);
    return 0;
}

int td_ckpt_list(const char *dir, td_ckpt_entry *out, int max, int *n, td_error_t *err)
{
    int64_t *steps = NULL;
    int all = 0, rc = list_steps(dir, &steps, &all, err);
    char path[TD_CKPT_PATH_MAX];
    struct stat st;

    *n = 0;
    if (rc == TD_ENOTFOUND)
        return 0;
    for (int i = 0; rc == 0 && i < all && *n < max; i++)
        if (snprintf(path, sizeof(path), "%s/ckpt-%lld.bin", dir, (long long)steps[i]) <
                (int)sizeof(path) &&
            stat(path, &st) == 0)
            out[(*n)++] = (td_ckpt_entry){.step = steps[i],
                                          .bytes = (int64_t)st.st_size,
                                          .mtime = (double)st.st_mtim.tv_sec +
                                                   (double)st.st_mtim.tv_nsec / 1e9};
    free(steps);
    return rc;
}

static int ckpt_path(char *out, size_t len, const char *dir, int64_t step, const char *prefix,
                     const char *suffix, td_error_t *err)
{
    int w = snprintf(out, len, "%s/%sckpt-%lld.bin%s", dir, prefix, (long long)step, suffix);

    if (w < 0 || (size_t)w >= len)
        return td_error_set(err, TD_EINVAL, "%s: checkpoint path too long", dir);
    return 0;
}

/* Deletes checkpoints of a step above `step` and all but the newest keep of the rest, and any
 * temp file a crash left. Failures are left for the next write. */
static void prune(const char *dir, int64_t step, int keep)
{
    static const char tmp_prefix[] = ".ckpt-";
    int64_t *steps = NULL;
    char path[TD_CKPT_PATH_MAX];
    int n = 0, kept = 0;
    DIR *dp;
    struct dirent *e;

    if (list_steps(dir, &steps, &n, NULL) != 0)
        return;
    for (int i = 0; i < n; i++) {
        int drop = steps[i] > step || (keep >= 1 && kept >= keep);
        if (!drop && steps[i] <= step)
            kept++;
        if (drop && ckpt_path(path, sizeof(path), dir, steps[i], "", "", NULL) == 0)
            unlink(path);
    }
    free(steps);
    dp = opendir(dir);
    if (dp == NULL)
        return;
    while ((e = readdir(dp)) != NULL) {
        size_t len = strlen(e->d_name);
        if (strncmp(e->d_name, tmp_prefix, sizeof(tmp_prefix) - 1) == 0 && len > 4 &&
            strcmp(e->d_name + len - 4, ".tmp") == 0 &&
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name) < (int)sizeof(path))
            unlink(path);
    }
    closedir(dp);
}

/* ---- writing ------------------------------------------------------------------------------- */

static void put32(unsigned char *h, size_t off, uint32_t v)
{
    memcpy(h + off, &v, 4);
}

static void put64(unsigned char *h, size_t off, uint64_t v)
{
    memcpy(h + off, &v, 8);
}

static uint32_t get32(const unsigned char *h, size_t off)
{
    uint32_t v;

    memcpy(&v, h + off, 4);
    return v;
}

static uint64_t get64(const unsigned char *h, size_t off)
{
    uint64_t v;

    memcpy(&v, h + off, 8);
    return v;
}

static int check_sections(const td_ckpt_section *s, int n, td_error_t *err)
{
    if (n < 1 || n > TD_CKPT_MAX_SECTIONS || s == NULL)
        return td_error_set(err, TD_EINVAL, "%d checkpoint sections (1 to %d)", n,
                            TD_CKPT_MAX_SECTIONS);
    for (int i = 0; i < n; i++) {
        size_t len = s[i].name != NULL ? strlen(s[i].name) : 0;
        if (len == 0 || len >= TD_CKPT_NAME_MAX)
            return td_error_set(err, TD_EINVAL, "checkpoint section %d: name of %zu bytes", i, len);
        if (s[i].count > TD_CKPT_MAX_FLOATS)
            return td_error_set(err, TD_EINVAL, "checkpoint section '%s': %zu floats", s[i].name,
                                s[i].count);
    }
    return 0;
}

static void build_header(unsigned char *h, const td_ckpt_meta *meta, const td_ckpt_section *s,
                         int n)
{
    memset(h, 0, TD_CKPT_HEADER_BYTES);
    put32(h, H_MAGIC, TD_CKPT_MAGIC);
    put32(h, H_VERSION, TD_CKPT_VERSION);
    put32(h, H_HBYTES, TD_CKPT_HEADER_BYTES);
    put32(h, H_NSECT, (uint32_t)n);
    put64(h, H_STEP, (uint64_t)meta->step);
    put64(h, H_HASH, meta->config_hash);
    for (int i = 0; i < TD_CKPT_RNG_WORDS; i++)
        put64(h, H_RNG + 8 * (size_t)i, meta->rng[i]);
    for (int i = 0; i < TD_CKPT_CURSOR_WORDS; i++)
        put64(h, H_CURSOR + 8 * (size_t)i, (uint64_t)meta->cursor[i]);
    for (int i = 0; i < n; i++) {
        unsigned char *e = h + H_SECTIONS + (size_t)i * H_SECT_BYTES;
        memcpy(e, s[i].name, strlen(s[i].name));
        put64(e, TD_CKPT_NAME_MAX, (uint64_t)s[i].count);
    }
    put32(h, H_CRC, crc_update(0, h, H_CRC));
}

/* Writes len bytes, chunk by chunk, folding them into *crc. */
static int write_all(int fd, const void *buf, size_t len, uint32_t *crc, const char *path,
                     td_error_t *err)
{
    const unsigned char *p = buf;

    while (len > 0) {
        size_t chunk = len > IO_CHUNK ? IO_CHUNK : len;
        ssize_t w = write(fd, p, chunk);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return io_error(err, errno, path, "cannot write");
        *crc = crc_update(*crc, p, (size_t)w);
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* The file's bytes into an open temp file, then fsync. */
static int write_body(int fd, const unsigned char *h, const td_ckpt_section *s, int n,
                      const char *path, td_error_t *err)
{
    uint32_t crc = 0, end = TD_CKPT_END_MAGIC;
    unsigned char trailer[TRAILER];
    int rc = write_all(fd, h, TD_CKPT_HEADER_BYTES, &crc, path, err);

    for (int i = 0; i < n && rc == 0; i++)
        rc = write_all(fd, s[i].data, s[i].count * sizeof(float), &crc, path, err);
    if (rc != 0)
        return rc;
    memcpy(trailer, &crc, 4);
    memcpy(trailer + 4, &end, 4);
    rc = write_all(fd, trailer, TRAILER, &crc, path, err);
    if (rc == 0 && fsync(fd) != 0)
        rc = io_error(err, errno, path, "cannot sync");
    return rc;
}

/* fsync of the directory, so the rename itself is durable. Some filesystems cannot sync a
 * directory (EINVAL): their rename is as durable as they make it. */
static int sync_dir(const char *dir, td_error_t *err)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = 0;

    if (fd < 0)
        return io_error(err, errno, dir, "cannot open to sync");
    if (fsync(fd) != 0 && errno != EINVAL)
        rc = io_error(err, errno, dir, "cannot sync");
    close(fd);
    return rc;
}

int td_ckpt_write(const char *dir, int keep, const td_ckpt_meta *meta,
                  const td_ckpt_section *sections, int n, char *path, size_t path_len,
                  td_error_t *err)
{
    unsigned char h[TD_CKPT_HEADER_BYTES];
    char tmp[TD_CKPT_PATH_MAX], final[TD_CKPT_PATH_MAX];
    int fd, rc;

    if (meta == NULL || meta->step < 0)
        return td_error_set(err, TD_EINVAL, "checkpoint of a negative step");
    for (int i = 0; i < n && sections != NULL; i++)
        if (sections[i].data == NULL && sections[i].count > 0)
            return td_error_set(err, TD_EINVAL, "checkpoint section %d: no data", i);
    rc = check_sections(sections, n, err);
    if (rc == 0)
        rc = ckpt_path(tmp, sizeof(tmp), dir, meta->step, ".", ".tmp", err);
    if (rc == 0)
        rc = ckpt_path(final, sizeof(final), dir, meta->step, "", "", err);
    if (rc == 0)
        rc = make_dir(dir, err);
    if (rc != 0)
        return rc;
    build_header(h, meta, sections, n);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600); /* the owner's only */
    if (fd < 0)
        return io_error(err, errno, tmp, "cannot create");
    rc = write_body(fd, h, sections, n, tmp, err);
    if (close(fd) != 0 && rc == 0)
        rc = io_error(err, errno, tmp, "cannot close");
    if (rc == 0 && rename(tmp, final) != 0)
        rc = io_error(err, errno, final, "cannot rename the temp file to");
    if (rc != 0) {
        unlink(tmp);
        return rc;
    }
    rc = sync_dir(dir, err);
    if (rc != 0)
        return rc;
    prune(dir, meta->step, keep);
    if (path != NULL && path_len > 0)
        snprintf(path, path_len, "%s", final);
    return 0;
}

/* ---- reading ------------------------------------------------------------------------------- */

/* Reads exactly len bytes at the file's offset, folding them into *crc. */
static int read_exact(int fd, void *buf, size_t len, uint32_t *crc, const char *path,
                      td_error_t *err)
{
    unsigned char *p = buf;

    while (len > 0) {
        size_t chunk = len > IO_CHUNK ? IO_CHUNK : len;
        ssize_t r = read(fd, p, chunk);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return td_error_set(err, TD_EIO, "%s: read error: %s", path, strerror(errno));
        if (r == 0)
            return td_error_set(err, TD_EDATA, "%s: truncated while read", path);
        if (crc != NULL)
            *crc = crc_update(*crc, p, (size_t)r);
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

/* Opens path and reads and checks its header into h; *size is the file's size. */
static int open_checked(const char *path, unsigned char *h, int *fd_out, int64_t *size,
                        td_error_t *err)
{
    struct stat st;
    uint32_t magic, crc;
    int fd = open(path, O_RDONLY | O_CLOEXEC), rc;

    *fd_out = -1;
    if (fd < 0 && errno == ENOENT)
        return td_error_set(err, TD_ENOTFOUND, "%s: No such file or directory", path);
    if (fd < 0)
        return td_error_set(err, TD_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) {
        rc = td_error_set(err, TD_EIO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    *size = st.st_size;
    if (st.st_size < TD_CKPT_HEADER_BYTES) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: truncated: %lld bytes, shorter than the %d-byte header", path,
                          (long long)st.st_size, TD_CKPT_HEADER_BYTES);
        goto fail;
    }
    rc = read_exact(fd, h, TD_CKPT_HEADER_BYTES, NULL, path, err);
    if (rc != 0)
        goto fail;
    magic = get32(h, H_MAGIC);
    if (magic == __builtin_bswap32(TD_CKPT_MAGIC))
        rc = td_error_set(err, TD_EDATA, "%s: written on a machine of the other byte order", path);
    else if (magic != TD_CKPT_MAGIC)
        rc =
            td_error_set(err, TD_EDATA, "%s: bad magic 0x%08x, expected 0x%08x (traind checkpoint)",
                         path, magic, TD_CKPT_MAGIC);
    else if (get32(h, H_VERSION) != TD_CKPT_VERSION)
        rc = td_error_set(err, TD_EVERSION, "%s: checkpoint version %u, expected %d", path,
                          get32(h, H_VERSION), TD_CKPT_VERSION);
    else if ((crc = crc_update(0, h, H_CRC)) != get32(h, H_CRC))
        rc = td_error_set(err, TD_EDATA,
                          "%s: header checksum mismatch: stored 0x%08x, computed 0x%08x", path,
                          get32(h, H_CRC), crc);
    else if (get32(h, H_HBYTES) != TD_CKPT_HEADER_BYTES || get32(h, H_NSECT) < 1 ||
             get32(h, H_NSECT) > TD_CKPT_MAX_SECTIONS)
        rc = td_error_set(err, TD_EDATA, "%s: bad header: %u header bytes, %u sections", path,
                          get32(h, H_HBYTES), get32(h, H_NSECT));
    if (rc != 0)
        goto fail;
    *fd_out = fd;
    return 0;

fail:
    close(fd);
    return rc;
}

/* The header's meta and sections; the names come out NUL-terminated, counts checked. */
static int parse_header(const unsigned char *h, td_ckpt_meta *meta, td_ckpt_section_info *info,
                        int *n, const char *path, td_error_t *err)
{
    *n = (int)get32(h, H_NSECT);
    meta->step = (int64_t)get64(h, H_STEP);
    meta->config_hash = get64(h, H_HASH);
    for (int i = 0; i < TD_CKPT_RNG_WORDS; i++)
        meta->rng[i] = get64(h, H_RNG + 8 * (size_t)i);
    for (int i = 0; i < TD_CKPT_CURSOR_WORDS; i++)
        meta->cursor[i] = (int64_t)get64(h, H_CURSOR + 8 * (size_t)i);
    for (int i = 0; i < *n; i++) {
        const unsigned char *e = h + H_SECTIONS + (size_t)i * H_SECT_BYTES;
        memcpy(info[i].name, e, TD_CKPT_NAME_MAX);
        info[i].name[TD_CKPT_NAME_MAX - 1] = '\0';
        info[i].count = get64(e, TD_CKPT_NAME_MAX);
        if (info[i].count > TD_CKPT_MAX_FLOATS)
            return td_error_set(err, TD_EDATA, "%s: section %d: %llu floats (at most %llu)", path,
                                i, (unsigned long long)info[i].count,
                                (unsigned long long)TD_CKPT_MAX_FLOATS);
    }
    return 0;
}

int td_ckpt_peek(const char *path, td_ckpt_meta *meta, td_ckpt_section_info *sections, int *n,
                 td_error_t *err)
{
    unsigned char h[TD_CKPT_HEADER_BYTES];
    int64_t size;
    int fd, rc = open_checked(path, h, &fd, &size, err);

    if (rc != 0)
        return rc;
    close(fd);
    return parse_header(h, meta, sections, n, path, err);
}

/* The file's sections against the caller's; then its size against what they add up to. */
static int match_sections(const td_ckpt_section_info *have, int n_have, const td_ckpt_section *want,
                          int n, int64_t size, const char *path, td_error_t *err)
{
    uint64_t floats = 0;
    int64_t expect;

    if (n_have != n)
        return td_error_set(err, TD_ESHAPE, "%s: %d sections, expected %d", path, n_have, n);
    for (int i = 0; i < n; i++) {
        if (strcmp(have[i].name, want[i].name) != 0 || have[i].count != want[i].count)
            return td_error_set(err, TD_ESHAPE,
                                "%s: section %d is '%s' of %llu floats, expected '%s' of %zu "
                                "floats",
                                path, i, have[i].name, (unsigned long long)have[i].count,
                                want[i].name, want[i].count);
        floats += have[i].count;
    }
    expect = TD_CKPT_HEADER_BYTES + (int64_t)floats * 4 + TRAILER;
    if (size < expect)
        return td_error_set(err, TD_EDATA, "%s: truncated: %lld bytes, the header says %lld", path,
                            (long long)size, (long long)expect);
    if (size > expect)
        return td_error_set(err, TD_EDATA, "%s: %lld bytes, the header says %lld", path,
                            (long long)size, (long long)expect);
    return 0;
}

/* The floats of one section into data, or through a scratch buffer when data is NULL. */
static int read_section(int fd, const td_ckpt_section *s, uint32_t *crc, const char *path,
                        td_error_t *err)
{
    float scratch[4096];
    size_t left = s->count;

    if (s->data != NULL)
        return read_exact(fd, s->data, s->count * sizeof(float), crc, path, err);
    while (left > 0) {
        size_t chunk = left > 4096 ? 4096 : left;
        int rc = read_exact(fd, scratch, chunk * sizeof(float), crc, path, err);
        if (rc != 0)
            return rc;
        left -= chunk;
    }
    return 0;
}

int td_ckpt_read(const char *path, td_ckpt_meta *meta, const td_ckpt_section *sections, int n,
                 td_error_t *err)
{
    unsigned char h[TD_CKPT_HEADER_BYTES], trailer[TRAILER];
    td_ckpt_section_info have[TD_CKPT_MAX_SECTIONS];
    td_ckpt_meta m;
    int64_t size = 0;
    uint32_t crc, stored, end;
    int n_have = 0, fd, rc = check_sections(sections, n, err);

    if (rc != 0)
        return rc;
    rc = open_checked(path, h, &fd, &size, err);
    if (rc != 0)
        return rc;
    rc = parse_header(h, &m, have, &n_have, path, err);
    if (rc == 0)
        rc = match_sections(have, n_have, sections, n, size, path, err);
    crc = crc_update(0, h, TD_CKPT_HEADER_BYTES);
    for (int i = 0; i < n && rc == 0; i++)
        rc = read_section(fd, &sections[i], &crc, path, err);
    if (rc == 0)
        rc = read_exact(fd, trailer, TRAILER, NULL, path, err);
    close(fd);
    if (rc != 0)
        return rc;
    memcpy(&stored, trailer, 4);
    memcpy(&end, trailer + 4, 4);
    if (stored != crc || end != TD_CKPT_END_MAGIC)
        return td_error_set(err, TD_EDATA, "%s: checksum mismatch: stored 0x%08x, computed 0x%08x",
                            path, stored, crc);
    *meta = m;
    return 0;
}

int td_ckpt_load_latest(const char *dir, td_ckpt_meta *meta, const td_ckpt_section *sections, int n,
                        td_ckpt_found *found, td_error_t *err)
{
    int64_t *steps = NULL;
    char path[TD_CKPT_PATH_MAX];
    td_error_t first = {0};
    int count = 0, skipped = 0, rc;

    if (found != NULL)
        memset(found, 0, sizeof(*found));
    rc = list_steps(dir, &steps, &count, err);
    if (rc != 0)
        return rc;
    if (count == 0) {
        free(steps);
        return td_error_set(err, TD_ENOTFOUND, "%s: no checkpoint", dir);
    }
    for (int i = 0; i < count; i++) {
        td_error_t e = {0};
        rc = ckpt_path(path, sizeof(path), dir, steps[i], "", "", &e);
        if (rc == 0)
            rc = td_ckpt_read(path, meta, sections, n, &e);
        if (rc == 0)
            break;
        if (rc != TD_EDATA && rc != TD_ENOTFOUND) {
            if (err != NULL)
                *err = e;
            free(steps);
            return rc;
        }
        if (skipped++ == 0)
            first = e;
    }
    free(steps);
    if (found != NULL) {
        found->skipped = skipped;
        snprintf(found->skip_msg, sizeof(found->skip_msg), "%s", first.msg);
        if (rc == 0)
            snprintf(found->path, sizeof(found->path), "%s", path);
    }
    if (rc != 0)
        return td_error_set(err, TD_EDATA, "%s: no intact checkpoint (%d skipped; the newest: %s)",
                            dir, skipped, first.msg);
    return 0;
}
