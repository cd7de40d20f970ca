/* Token data for language models (data.h): reads text files and llm.c token shards into one
 * stream of uint16 tokens per td_data, splits it into train and valid, and fills (B, T) batches
 * of inputs and targets, in llm.c's order or shuffled by rows. Owns the text tokens, the shard
 * mappings and the shuffle's permutation; called from td_trainer_new() (open) and the step
 * loop (fill, advance), so it returns errors and never panics. Also home of the rights every
 * job file in train/ is opened with (data.h, "whose rights"): a per-thread access, set by the
 * thread that opens. */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "train/data.h"
#include "train/engine.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "llm.c shards are little-endian and are mapped as they are: a big-endian port must swap"
#endif

#define MAX_BATCH_TOKENS (1 << 30)             /* B*T: one int buffer of inputs, 4 GiB */
#define SHUFFLE_STREAM   0x6461746100000000ull /* "data" << 32, plus the epoch */
/* Bytes of text read at a time; the stop callback is polled between chunks. */
#define TEXT_CHUNK (1u << 20)

/* glibc's setgroups() sets every thread's groups (it signals them all); the system call sets
 * only the caller's, which is what a per-thread identity needs. 32-bit x86 names the call with
 * 32-bit gids setgroups32. */
#ifdef SYS_setgroups32
#define SYS_SETGROUPS SYS_setgroups32
#else
#define SYS_SETGROUPS SYS_setgroups
#endif

/* ---- whose rights a job's files are read with (data.h) ------------------------------------- */

/* The calling thread's access: set by td_data_access_begin, read by every open below. */
typedef struct access_state {
    int set;     /* between td_data_access_begin and td_data_access_end */
    int as_user; /* opens change identity (or, where they cannot, check the file) */
    uid_t uid;
    gid_t gid;
    gid_t groups[TD_DATA_MAX_GROUPS];
    int ngroups;
    int (*stop)(void *ud);
    void *ud;
} access_state;

static _Thread_local access_state cur;

/* The filesystem identity a thread had before it became the user, to go back to. */
typedef struct saved_ids {
    uid_t uid;
    gid_t gid;
    gid_t groups[TD_DATA_MAX_GROUPS];
    int ngroups;
} saved_ids;

/* uid's groups into s: gid (or its passwd entry's primary group) and its supplementary ones. */
static int user_groups(int64_t uid, int64_t gid, access_state *s, td_error_t *err)
{
    struct passwd pw, *found = NULL;
    char buf[4096];
    int n = TD_DATA_MAX_GROUPS;

    s->uid = (uid_t)uid;
    if (getpwuid_r((uid_t)uid, &pw, buf, sizeof(buf), &found) != 0 || found == NULL) {
        s->gid = gid >= 0 ? (gid_t)gid : TD_DATA_NOGROUP;
        s->groups[0] = s->gid;
        s->ngroups = 1;
        return 0;
    }
    s->gid = gid >= 0 ? (gid_t)gid : pw.pw_gid;
    if (getgrouplist(pw.pw_name, s->gid, s->groups, &n) < 0)
        return td_error_set(err, TD_EPERM, "uid %lld is in more than %d groups", (long long)uid,
                            TD_DATA_MAX_GROUPS);
    s->ngroups = n;
    return 0;
}

int td_data_access_begin(const td_data_access *a, td_error_t *err)
{
    access_state s;
    int rc;

    memset(&s, 0, sizeof(s));
    s.set = 1;
    s.stop = a->stop;
    s.ud = a->ud;
    if (a->uid >= 0 && (uid_t)a->uid != geteuid()) {
        rc = user_groups(a->uid, a->gid, &s, err);
        if (rc != 0)
            return rc;
        s.as_user = 1;
    }
    cur = s;
    return 0;
}

void td_data_access_end(void)
{
    memset(&cur, 0, sizeof(cur));
}

int td_data_should_stop(const char *path, td_error_t *err)
{
    if (cur.set && cur.stop != NULL && cur.stop(cur.ud))
        return td_error_set(err, TD_ECANCELLED,
                            "%s: reading stopped: the job was cancelled or traind is stopping",
                            path);
    return 0;
}

/* Back to the identity sv saved. */
static void become_self(const saved_ids *sv)
{
    setfsuid(sv->uid);
    setfsgid(sv->gid);
    syscall(SYS_SETGROUPS, (size_t)sv->ngroups, sv->groups);
}

/* The calling thread takes the user's groups, fsgid and fsuid, in that order (the groups and
 * the gid need CAP_SETGID, which a non-zero fsuid does not take away; it takes only the
 * filesystem capabilities, which is the point). 0, or -1 when this process may not (nothing
 * is left changed then). */
static int become_user(saved_ids *sv)
{
    sv->ngroups = getgroups(TD_DATA_MAX_GROUPS, sv->groups);
    if (sv->ngroups < 0)
        return -1;
    if (syscall(SYS_SETGROUPS, (size_t)cur.ngroups, cur.groups) != 0)
        return -1;
    sv->gid = (gid_t)setfsgid(cur.gid);
    sv->uid = (uid_t)setfsuid(cur.uid);
    /* setfsuid and setfsgid report no error; an invalid id (-1) asks for the current one. */
    if ((uid_t)setfsuid((uid_t)-1) != cur.uid || (gid_t)setfsgid((gid_t)-1) != cur.gid) {
        become_self(sv);
        return -1;
    }
    return 0;
}

/* Whether the user may read a file of st by its mode bits: the fallback where the thread
 * cannot become the user. */
static int user_may_read(const struct stat *st)
{
    if (st->st_uid == cur.uid)
        return (st->st_mode & S_IRUSR) != 0;
    for (int i = 0; i < cur.ngroups; i++)
        if (st->st_gid == cur.groups[i])
            return (st->st_mode & S_IRGRP) != 0;
    return (st->st_mode & S_IROTH) != 0;
}

int td_data_open_fd(const char *path, struct stat *st)
{
    int switched = 0, fd, e;
    saved_ids sv;

    if (cur.set && cur.as_user)
        switched = become_user(&sv) == 0;
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    e = errno;
    if (switched)
        become_self(&sv);
    if (fd < 0)
        return -e;
    if (fstat(fd, st) != 0) {
        e = errno;
        close(fd);
        return -e;
    }
    if (cur.set && cur.as_user && !switched && !user_may_read(st)) {
        close(fd);
        return -EACCES;
    }
    if (S_ISREG(st->st_mode))
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

const char *td_data_file_kind(unsigned mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return S_ISREG(mode) ? "a regular file" : "not a file";
}

int td_data_open_path(const char *path, int flags, int *fd, struct stat *st, td_error_t *err)
{
    int f = td_data_open_fd(path, st), rc = 0;

    *fd = -1;
    if (f == -EACCES || f == -EPERM)
        rc = td_error_set(err, TD_EPERM, "%s: %s", path, strerror(-f));
    else if (f < 0)
        rc = td_error_set(err,
                          !(flags & TD_OPEN_MODEL) ? TD_EDATA
                          : f == -ENOENT           ? TD_ENOTFOUND
                                                   : TD_EIO,
                          "%s: %s", path, strerror(-f));
    else if (!(flags & TD_OPEN_ANY) && !S_ISREG(st->st_mode))
        rc = td_error_set(err, TD_EDATA, "%s: not a regular file (%s)", path,
                          td_data_file_kind(st->st_mode));
    if (rc != 0 && f >= 0)
        close(f);
    else if (rc == 0)
        *fd = f;
    return rc;
}

int td_data_open_file(const char *path, int *fd, td_error_t *err)
{
    struct stat st;

    return td_data_open_path(path, 0, fd, &st, err);
}

int td_data_glob(const char *pattern, int flags, glob_t *g)
{
    int switched = 0, rc;
    saved_ids sv;

    if (cur.set && cur.as_user)
        switched = become_user(&sv) == 0;
    rc = glob(pattern, flags, NULL, g);
    if (switched)
        become_self(&sv);
    return rc;
}

/* One file's tokens, at [start, start + n) of the td_data's stream. */
typedef struct seg {
    const uint16_t *tok;
    int64_t n;
    int64_t start;
    char *path;
    void *map; /* a shard's mapping (NULL for text and empty shards) */
    size_t map_len;
} seg;

/* A split: the tokens [lo, lo + n) of the stream. */
typedef struct split {
    int64_t lo, n;
} split;

struct td_data {
    td_data_spec spec; /* train and valid pointers cleared: borrowed only by open */
    seg *segs;
    int n_segs;
    uint16_t *text; /* all text files' tokens, one array (NULL for shards) */
    int64_t total;  /* tokens in the stream */
    split train, valid;
    int64_t batches, valid_batches, rows;
    uint32_t *perm; /* rows entries when shuffling */
    int64_t perm_epoch;
    td_data_cursor cur;
    td_data_info info;
};

/* ---- reading files ----------------------------------------------------------------------- */

/* Files already read, by (device, inode): open addressing, a power-of-two table. */
typedef struct seen_set {
    struct {
        dev_t dev;
        ino_t ino;
        int used;
    } * slot;
    size_t cap;
} seen_set;

static int seen_init(seen_set *s)
{
    s->cap = 2u * TD_DATA_MAX_FILES;
    s->slot = calloc(s->cap, sizeof(*s->slot));
    return s->slot == NULL ? TD_ENOMEM : 0;
}

/* Adds (dev, ino); returns 1 when it was there already. */
static int seen_add(seen_set *s, dev_t dev, ino_t ino)
{
    size_t i = ((uint64_t)ino * 0x9e3779b97f4a7c15ull ^ (uint64_t)dev) & (s->cap - 1);

    while (s->slot[i].used) {
        if (s->slot[i].dev == dev && s->slot[i].ino == ino)
            return 1;
        i = (i + 1) & (s->cap - 1);
    }
    s->slot[i].used = 1;
    s->slot[i].dev = dev;
    s->slot[i].ino = ino;
    return 0;
}

/* What td_data_open() carries while it reads. */
typedef struct loader {
    td_data *d;
    seen_set seen;
    size_t text_cap;      /* tokens d->text has room for */
    unsigned char *chunk; /* TEXT_CHUNK bytes, read into and widened from */
    int files_in_split;
} loader;

static int add_seg(td_data *d, const char *path, int64_t n, seg **out, td_error_t *err)
{
    seg *s;

    if (d->n_segs >= TD_DATA_MAX_FILES)
        return td_error_set(err, TD_E2BIG, "%s: more than %d files", path, TD_DATA_MAX_FILES);
    if (d->n_segs % 64 == 0) {
        seg *grown = realloc(d->segs, (size_t)(d->n_segs + 64) * sizeof(*grown));
        if (grown == NULL)
            return td_error_set(err, TD_ENOMEM, "%s: no memory for the file list", path);
        d->segs = grown;
    }
    s = &d->segs[d->n_segs];
    memset(s, 0, sizeof(*s));
    s->path = strdup(path);
    if (s->path == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for the file list", path);
    s->n = n;
    s->start = d->total;
    d->n_segs++;
    d->total += n;
    *out = s;
    return 0;
}

/* Reads bytes [at, at + n) of fd's size bytes (by fstat) into buf. */
static int read_chunk(int fd, unsigned char *buf, size_t n, size_t at, size_t size,
                      const char *path, td_error_t *err)
{
    size_t got = 0;

    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return td_error_set(err, TD_EDATA, "%s: read error: %s", path, strerror(errno));
        if (r == 0)
            return td_error_set(err, TD_EDATA, "%s: file shrank while read: %zu of %zu bytes", path,
                                at + got, size);
        got += (size_t)r;
    }
    return 0;
}

/* Room in d->text for tokens tokens in all: exactly that, so that the text takes what the
 * memory estimate counts for it (2 bytes a byte), not a doubling's slack. */
static int reserve_text(loader *L, size_t tokens, const char *path, td_error_t *err)
{
    uint16_t *grown;

    if (tokens <= L->text_cap)
        return 0;
    grown = realloc(L->d->text, tokens * sizeof(uint16_t));
    if (grown == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for %zu tokens", path, tokens);
    L->d->text = grown;
    L->text_cap = tokens;
    return 0;
}

/* A text file: its bytes, widened to uint16, appended to d->text, TEXT_CHUNK bytes at a time
 * (the stop callback is polled before each). A file holding a NUL byte is binary: skipped
 * when a glob found it, refused when it was named. */
static int load_text(loader *L, int fd, const struct stat *st, const char *path, int globbed,
                     td_error_t *err)
{
    td_data *d = L->d;
    size_t size = (size_t)st->st_size;
    seg *s;
    int rc;

    if ((uint64_t)d->total + size > TD_DATA_MAX_TEXT_BYTES)
        return td_error_set(err, TD_E2BIG, "%s: more than %llu bytes of text in all", path,
                            (unsigned long long)TD_DATA_MAX_TEXT_BYTES);
    if (L->chunk == NULL && (L->chunk = malloc(TEXT_CHUNK)) == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for a %u-byte read buffer", path,
                            TEXT_CHUNK);
    if ((rc = reserve_text(L, (size_t)d->total + size, path, err)) != 0)
        return rc;
    for (size_t at = 0; at < size;) {
        size_t n = size - at < TEXT_CHUNK ? size - at : TEXT_CHUNK;
        const unsigned char *nul;
        if ((rc = td_data_should_stop(path, err)) != 0 ||
            (rc = read_chunk(fd, L->chunk, n, at, size, path, err)) != 0)
            return rc;
        nul = memchr(L->chunk, 0, n);
        if (nul != NULL && globbed) {
            d->info.skipped_binary++;
            return 0;
        }
        if (nul != NULL)
            return td_error_set(err, TD_EDATA, "%s: a NUL byte at offset %zu: binary, not text",
                                path, at + (size_t)(nul - L->chunk));
        for (size_t i = 0; i < n; i++)
            d->text[d->total + (int64_t)(at + i)] = L->chunk[i];
        at += n;
    }
    rc = add_seg(d, path, (int64_t)size, &s, err); /* s->tok set once d->text stops moving */
    if (rc == 0)
        L->files_in_split++;
    return rc;
}

/* An llm.c shard's header, read from fd, checked against the file's size: its token count. */
static int shard_header(int fd, const struct stat *st, const char *path, int64_t *out,
                        td_error_t *err)
{
    int32_t h[3];
    int64_t count, want;

    if (st->st_size < TD_DATA_SHARD_HEADER)
        return td_error_set(err, TD_EDATA,
                            "%s: %lld bytes, shorter than the %d-byte header of an llm.c token "
                            "shard",
                            path, (long long)st->st_size, TD_DATA_SHARD_HEADER);
    if (pread(fd, h, sizeof(h), 0) != (ssize_t)sizeof(h))
        return td_error_set(err, TD_EDATA, "%s: cannot read the header: %s", path, strerror(errno));
    if (h[0] != TD_DATA_SHARD_MAGIC)
        return td_error_set(err, TD_EDATA, "%s: bad magic %d, expected %d (llm.c token shard)",
                            path, h[0], TD_DATA_SHARD_MAGIC);
    if (h[1] != TD_DATA_SHARD_VERSION)
        return td_error_set(err, TD_EDATA, "%s: version %d, expected %d (llm.c token shard)", path,
                            h[1], TD_DATA_SHARD_VERSION);
    count = h[2];
    want = TD_DATA_SHARD_HEADER + 2 * count;
    if (count < 0 || want != st->st_size)
        return td_error_set(err, TD_EDATA,
                            "%s: header says %lld tokens (%lld bytes) but the file has %lld bytes",
                            path, (long long)count, (long long)want, (long long)st->st_size);
    *out = count;
    return 0;
}

int td_data_peek_shard(const char *path, int64_t *count, td_error_t *err)
{
    struct stat st;
    int fd, rc;

    *count = 0;
    if ((rc = td_data_open_file(path, &fd, err)) != 0)
        return rc;
    rc = fstat(fd, &st) != 0 ? td_error_set(err, TD_EDATA, "%s: %s", path, strerror(errno))
                             : shard_header(fd, &st, path, count, err);
    close(fd);
    return rc;
}

/* An llm.c shard: its header checked against its size, its tokens mapped read-only. */
static int load_shard(loader *L, int fd, const struct stat *st, const char *path, td_error_t *err)
{
    int64_t count = 0, want;
    void *map = NULL;
    seg *s;
    int rc = shard_header(fd, st, path, &count, err);

    if (rc != 0)
        return rc;
    want = TD_DATA_SHARD_HEADER + 2 * count;
    if (count > 0) {
        map = mmap(NULL, (size_t)want, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED)
            return td_error_set(err, TD_EDATA, "%s: cannot map %lld bytes: %s", path,
                                (long long)want, strerror(errno));
    }
    rc = add_seg(L->d, path, count, &s, err);
    if (rc != 0) {
        if (map != NULL)
            munmap(map, (size_t)want);
        return rc;
    }
    s->map = map;
    s->map_len = map != NULL ? (size_t)want : 0;
    s->tok = map != NULL ? (const uint16_t *)((const char *)map + TD_DATA_SHARD_HEADER) : NULL;
    L->files_in_split++;
    return 0;
}

/* One name from a pattern: opened as the thread's access says (without blocking, so a FIFO
 * cannot hold the worker), checked to be a regular file not read before, then read. */
static int load_file(loader *L, const char *path, int globbed, td_error_t *err)
{
    struct stat st;
    int fd, rc = 0;

    if ((rc = td_data_should_stop(path, err)) != 0)
        return rc;
    if ((rc = td_data_open_path(path, TD_OPEN_ANY, &fd, &st, err)) != 0)
        return rc;
    if (!S_ISREG(st.st_mode)) {
        if (globbed)
            L->d->info.skipped_other++;
        else
            rc = td_error_set(err, TD_EDATA, "%s: not a regular file (%s)", path,
                              td_data_file_kind(st.st_mode));
        goto out;
    }
    if (seen_add(&L->seen, st.st_dev, st.st_ino)) {
        L->d->info.skipped_duplicate++;
        goto out;
    }
    if (L->d->spec.format == TD_DATA_FORMAT_TEXT)
        rc = load_text(L, fd, &st, path, globbed, err);
    else
        rc = load_shard(L, fd, &st, path, err);
out:
    close(fd);
    return rc;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* One pattern: a plain path, or a glob whose matches are read in strcmp order. */
static int load_pattern(loader *L, const char *pattern, td_error_t *err)
{
    glob_t g;
    int rc;

    if (strpbrk(pattern, "*?[") == NULL)
        return load_file(L, pattern, 0, err);
    rc = td_data_glob(pattern, GLOB_NOSORT, &g);
    if (rc == GLOB_NOMATCH)
        return td_error_set(err, TD_EDATA, "no files match %s", pattern);
    if (rc == GLOB_NOSPACE)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for the matches", pattern);
    if (rc != 0)
        return td_error_set(err, TD_EDATA, "%s: cannot read a directory on the way", pattern);
    qsort(g.gl_pathv, g.gl_pathc, sizeof(char *), cmp_str);
    for (size_t i = 0; i < g.gl_pathc && rc == 0; i++)
        rc = load_file(L, g.gl_pathv[i], 1, err);
    globfree(&g);
    return rc;
}

/* A split's patterns, appended to the stream; *sp receives the tokens they added. */
static int load_split(loader *L, const char *name, const char *const *patterns, int n, split *sp,
                      td_error_t *err)
{
    td_data_info before = L->d->info;
    int rc;

    if (n > TD_DATA_MAX_PATTERNS)
        return td_error_set(err, TD_E2BIG, "%s: %d paths or globs (at most %d)", name, n,
                            TD_DATA_MAX_PATTERNS);
    sp->lo = L->d->total;
    L->files_in_split = 0;
    for (int i = 0; i < n; i++) {
        if (patterns[i] == NULL || patterns[i][0] == '\0')
            return td_error_set(err, TD_EINVAL, "%s[%d]: an empty path", name, i);
        rc = load_pattern(L, patterns[i], err);
        if (rc != 0)
            return rc;
    }
    if (L->files_in_split == 0)
        return td_error_set(
            err, TD_EDATA,
            "%s: no file read (skipped: %d binary, %d duplicate, %d not a regular file)", name,
            L->d->info.skipped_binary - before.skipped_binary,
            L->d->info.skipped_duplicate - before.skipped_duplicate,
            L->d->info.skipped_other - before.skipped_other);
    sp->n = L->d->total - sp->lo;
    return 0;
}

/* ---- batches ------------------------------------------------------------------------------- */

/* The segment holding stream token pos (pos < total): the last one starting at or before pos
 * with tokens. */
static const seg *seg_of(const td_data *d, int64_t pos)
{
    int lo = 0, hi = d->n_segs - 1;

    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (d->segs[mid].start <= pos)
            lo = mid;
        else
            hi = mid - 1;
    }
    while (d->segs[lo].n == 0 || pos >= d->segs[lo].start + d->segs[lo].n)
        lo++; /* past empty files sharing the start */
    return &d->segs[lo];
}

/* The T+1 tokens from stream token pos into one row: inp gets the first T, tgt the last T.
 * Walks across file boundaries. */
static int gather_row(const td_data *d, int64_t pos, int *inp, int *tgt, td_error_t *err)
{
    const seg *s = seg_of(d, pos);
    int T = d->spec.T;
    int vocab = d->spec.vocab;

    for (int t = 0; t <= T; t++, pos++) {
        int x;
        while (pos >= s->start + s->n)
            s++;
        x = s->tok[pos - s->start];
        if (vocab > 0 && x >= vocab)
            return td_error_set(err, TD_EDATA,
                                "%s: token %d at token %lld of the file is not below the "
                                "vocabulary size %d",
                                s->path, x, (long long)(pos - s->start), vocab);
        if (t < T)
            inp[t] = x;
        if (t > 0)
            tgt[t - 1] = x;
    }
    return 0;
}

static int check_rows(const td_data *d, int r0, int r1, const int *inp, const int *tgt,
                      td_error_t *err)
{
    if (r0 < 0 || r1 > d->spec.B || r0 >= r1)
        return td_error_set(err, TD_EINVAL, "rows [%d, %d) of a batch of %d", r0, r1, d->spec.B);
    if (inp == NULL || tgt == NULL)
        return td_error_set(err, TD_EINVAL, "no inputs or targets buffer");
    return 0;
}

/* Epoch e's permutation of the train rows: the identity, then Fisher-Yates from (seed, e). */
static void shuffle_rows(td_data *d, int64_t epoch)
{
    td_rng r;

    td_rng_seed(&r, d->spec.seed, SHUFFLE_STREAM + (uint64_t)epoch);
    for (int64_t i = 0; i < d->rows; i++)
        d->perm[i] = (uint32_t)i;
    for (int64_t i = d->rows - 1; i > 0; i--) {
        uint32_t j = td_rng_below(&r, (uint32_t)(i + 1));
        uint32_t tmp = d->perm[i];
        d->perm[i] = d->perm[j];
        d->perm[j] = tmp;
    }
    d->perm_epoch = epoch;
}

int td_data_fill(const td_data *d, int r0, int r1, int *inputs, int *targets, td_error_t *err)
{
    int64_t B = d->spec.B, T = d->spec.T, k = d->cur.batch;
    int rc = check_rows(d, r0, r1, inputs, targets, err);

    for (int b = r0; b < r1 && rc == 0; b++) {
        int64_t start = d->spec.shuffle ? (int64_t)d->perm[k * B + b] * T : k * B * T + b * T;
        rc = gather_row(d, d->train.lo + start, inputs + (b - r0) * T, targets + (b - r0) * T, err);
    }
    return rc;
}

void td_data_advance(td_data *d)
{
    if (++d->cur.batch < d->batches)
        return;
    d->cur.batch = 0;
    d->cur.epoch++;
    if (d->spec.shuffle)
        shuffle_rows(d, d->cur.epoch);
}

int td_data_next(td_data *d, int *inputs, int *targets, td_error_t *err)
{
    int rc = td_data_fill(d, 0, d->spec.B, inputs, targets, err);

    if (rc == 0)
        td_data_advance(d);
    return rc;
}

int td_data_valid_fill(const td_data *d, int64_t i, int r0, int r1, int *inputs, int *targets,
                       td_error_t *err)
{
    int64_t B = d->spec.B, T = d->spec.T;
    int rc = check_rows(d, r0, r1, inputs, targets, err);

    if (rc != 0)
        return rc;
    if (d->valid_batches == 0)
        return td_error_set(err, TD_EINVAL, "no valid split");
    if (i < 0 || i >= d->valid_batches)
        return td_error_set(err, TD_EINVAL, "valid batch %lld of %lld", (long long)i,
                            (long long)d->valid_batches);
    for (int b = r0; b < r1 && rc == 0; b++)
        rc = gather_row(d, d->valid.lo + i * B * T + b * T, inputs + (b - r0) * T,
                        targets + (b - r0) * T, err);
    return rc;
}

td_data_cursor td_data_tell(const td_data *d)
{
    return d->cur;
}

int td_data_seek(td_data *d, td_data_cursor c, td_error_t *err)
{
    if (c.epoch < 0 || c.batch < 0 || c.batch >= d->batches)
        return td_error_set(err, TD_EINVAL,
                            "data cursor (epoch %lld, batch %lld) outside an epoch of %lld "
                            "batches",
                            (long long)c.epoch, (long long)c.batch, (long long)d->batches);
    if (d->spec.shuffle && c.epoch != d->perm_epoch)
        shuffle_rows(d, c.epoch);
    d->cur = c;
    return 0;
}

void td_data_get_info(const td_data *d, td_data_info *info)
{
    *info = d->info;
}

/* ---- opening ------------------------------------------------------------------------------- */

static int check_spec(const td_data_spec *s, td_error_t *err)
{
    if (s->format != TD_DATA_FORMAT_TEXT && s->format != TD_DATA_FORMAT_SHARDS)
        return td_error_set(err, TD_EINVAL, "data format %d", (int)s->format);
    if (s->n_train < 1 || s->train == NULL)
        return td_error_set(err, TD_EINVAL, "no train paths");
    if (s->n_valid < 0 || (s->n_valid > 0 && s->valid == NULL))
        return td_error_set(err, TD_EINVAL, "bad valid paths");
    if (!(s->valid_fraction >= 0.0 && s->valid_fraction < 1.0))
        return td_error_set(err, TD_EINVAL, "valid_fraction %g is not in [0, 1)",
                            s->valid_fraction);
    if (s->B < 1 || s->T < 1 || (int64_t)s->B * s->T > MAX_BATCH_TOKENS)
        return td_error_set(err, TD_EINVAL, "batch of %d rows of %d tokens (B*T: 1 to %d)", s->B,
                            s->T, MAX_BATCH_TOKENS);
    if (s->vocab < 0)
        return td_error_set(err, TD_EINVAL, "vocabulary size %d", s->vocab);
    return 0;
}

/* Cuts valid off train when asked to, and checks that each split holds a batch. */
static int make_splits(td_data *d, td_error_t *err)
{
    int64_t BT = (int64_t)d->spec.B * d->spec.T;

    if (d->spec.n_valid == 0 && d->spec.valid_fraction > 0.0) {
        int64_t nv = (int64_t)((double)d->train.n * d->spec.valid_fraction);
        d->valid.lo = d->train.lo + d->train.n - nv;
        d->valid.n = nv;
        d->train.n -= nv;
    }
    if (d->train.n < BT + 1)
        return td_error_set(err, TD_EDATA, "train split: %lld tokens, a batch needs B*T+1 = %lld",
                            (long long)d->train.n, (long long)(BT + 1));
    if ((d->spec.n_valid > 0 || d->spec.valid_fraction > 0.0) && d->valid.n < BT + 1)
        return td_error_set(err, TD_EDATA, "valid split%s: %lld tokens, a batch needs B*T+1 = %lld",
                            d->spec.n_valid > 0 ? "" : " (valid_fraction of train)",
                            (long long)d->valid.n, (long long)(BT + 1));
    d->batches = (d->train.n - 1) / BT;
    d->valid_batches = d->valid.n > 0 ? (d->valid.n - 1) / BT : 0;
    d->info.train_tokens = d->train.n;
    d->info.valid_tokens = d->valid.n;
    d->info.batches = d->batches;
    d->info.valid_batches = d->valid_batches;
    d->info.files = d->n_segs;
    return 0;
}

static int make_perm(td_data *d, td_error_t *err)
{
    if (!d->spec.shuffle)
        return 0;
    d->rows = (d->train.n - 1) / d->spec.T;
    if (d->rows > TD_DATA_MAX_ROWS)
        return td_error_set(err, TD_E2BIG, "train split: %lld rows of %d tokens (at most %lld)",
                            (long long)d->rows, d->spec.T, (long long)TD_DATA_MAX_ROWS);
    d->perm = malloc((size_t)d->rows * sizeof(uint32_t));
    if (d->perm == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the shuffle of %lld rows",
                            (long long)d->rows);
    shuffle_rows(d, 0);
    return 0;
}

int td_data_open(td_data **out, const td_data_spec *spec, td_error_t *err)
{
    loader L = {0};
    td_data *d;
    int rc;

    *out = NULL;
    rc = check_spec(spec, err);
    if (rc != 0)
        return rc;
    d = calloc(1, sizeof(*d));
    if (d == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the dataset");
    d->spec = *spec;
    d->spec.train = NULL;
    d->spec.valid = NULL;
    L.d = d;
    rc = seen_init(&L.seen);
    if (rc != 0) {
        td_error_set(err, rc, "no memory for the file table");
        goto fail;
    }
    rc = load_split(&L, "train", spec->train, spec->n_train, &d->train, err);
    if (rc == 0 && spec->n_valid > 0)
        rc = load_split(&L, "valid", spec->valid, spec->n_valid, &d->valid, err);
    if (rc != 0)
        goto fail;
    for (int i = 0; i < d->n_segs && d->text != NULL; i++)
        d->segs[i].tok = d->text + d->segs[i].start; /* d->text has stopped moving */
    rc = make_splits(d, err);
    if (rc == 0)
        rc = make_perm(d, err);
    if (rc != 0)
        goto fail;
    free(L.seen.slot);
    free(L.chunk);
    *out = d;
    return 0;

fail:
    free(L.seen.slot);
    free(L.chunk);
    td_data_free(d);
    return rc;
}

void td_data_free(td_data *d)
{
    if (d == NULL)
        return;
    for (int i = 0; i < d->n_segs; i++) {
        if (d->segs[i].map != NULL)
            munmap(d->segs[i].map, d->segs[i].map_len);
        free(d->segs[i].path);
    }
    free(d->segs);
    free(d->text);
    free(d->perm);
    free(d);
}
