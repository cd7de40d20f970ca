/* bench_prune: `prune` on a box's history, and how the daemon answers meanwhile.
 *
 * Builds a state directory with OLD jobs that ended 40 days ago, each with ROWS metric rows
 * (5 keys a step, as a training step records), 3 log lines, its spec and a checkpoint
 * directory holding one 4 KiB file, plus KEEP recent jobs; starts a real traind on it
 * (TRAIND_BIN, default build/daemon/traind) and sends `prune older_than 30 days` on one
 * connection while another sends `list {limit: 100, newest_first: true}` (the recent jobs)
 * over and over, each waiting for its reply. Prints the database's size before, right after
 * (pages in use) and once traind has stopped (the file, after the last checkpoint), the
 * prune's wall time, and the list's latency while idle and during the prune (median, 99th
 * percentile, worst). Figures only.
 *
 * With LIST 0 the second connection sends nothing during the prune: the prune's time alone.
 *
 * usage: bench_prune [OLD] [ROWS] [KEEP] [LIST] [DIR]
 *        (defaults 10000, 100, 100, 1, a new directory in /tmp) */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proto/proto.h"
#include "store/store.h"
#include "store/store_int.h" /* td__store_exec: a job's end time set back */
#include "common/td_clock.h"

#define KEYS        5 /* metric names a step records */
#define MAX_SAMPLES 100000
#define DAY         86400.0 /* seconds */

static const char *const key_names[KEYS] = {"train_loss", "lr", "grad_norm", "step_ms",
                                            "samples_per_s"};

static void die(const char *what, const char *why)
{
    fprintf(stderr, "bench_prune: %s: %s\n", what, why);
    exit(1);
}

/* ---- the history ---- */

/* A job's spec as a client sends it: an MLP on Fashion-MNIST, about 400 bytes of msgpack. */
static void write_spec(td_pw *w, const char *name)
{
    td_pw_map(w, 5);
    td_pw_str(w, "name");
    td_pw_str(w, name);
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, 3);
    td_pw_int(w, 784);
    td_pw_int(w, 256);
    td_pw_int(w, 10);
    td_pw_str(w, "data");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
    td_pw_str(w, "labels");
    td_pw_str(w, "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz");
    td_pw_str(w, "batch_size");
    td_pw_int(w, 64);
    td_pw_str(w, "max_steps");
    td_pw_int(w, 1000);
}

/* One job: inserted, its rows written, ended at `ended` (unix seconds), its checkpoint file. */
static void add_job(td_store *s, const char *dir, int64_t i, int64_t rows, double ended,
                    td_metric *m)
{
    char name[64], sql[128], path[700];
    static char four_k[4096];
    const void *spec;
    size_t len, n = 0;
    td_error_t err;
    int64_t id;
    td_pw w;
    FILE *f;

    snprintf(name, sizeof(name), "sweep-%lld", (long long)i);
    td_pw_init(&w);
    write_spec(&w, name);
    spec = td_pw_body(&w, &len);
    if (td_store_job_insert(s, name, 1, 0, 1000, spec, len, NULL, &id, &err) != 0)
        die("insert", err.msg);
    td_pw_free(&w);
    for (int64_t step = 1; (int64_t)n < rows; step++)
        for (int k = 0; k < KEYS && (int64_t)n < rows; k++, n++) {
            memset(&m[n], 0, sizeof(m[n]));
            m[n].job = id;
            snprintf(m[n].key, sizeof(m[n].key), "%s", key_names[k]);
            m[n].step = step;
            m[n].value = 1.0 / (double)step;
            m[n].time = ended - 60;
        }
    if (td_store_metrics_write(s, m, n, &err) != 0)
        die("metrics", err.msg);
    if (td_store_log(s, id, 5, "queued", &err) != 0 ||
        td_store_log(s, id, 5, "running on cpu:0", &err) != 0 ||
        td_store_job_set_state(s, id, TD_JOB_SUCCEEDED, NULL, 0, NULL, &err) != 0 ||
        td_store_log(s, id, 5, "succeeded at step 20", &err) != 0)
        die("job", err.msg);
    snprintf(sql, sizeof(sql), "UPDATE jobs SET ended = %.3f WHERE id = %lld", ended,
             (long long)id);
    if (td__store_exec(s, sql, &err) != 0)
        die("ended", err.msg);
    snprintf(path, sizeof(path), "%s/checkpoints/%lld", dir, (long long)id);
    mkdir(path, 0700);
    snprintf(path, sizeof(path), "%s/checkpoints/%lld/ckpt-20.bin", dir, (long long)id);
    f = fopen(path, "w");
    if (f == NULL || fwrite(four_k, 1, sizeof(four_k), f) != sizeof(four_k) || fclose(f) != 0)
        die(path, strerror(errno));
}

/* CPU seconds (user and system, every thread) process pid has used. */
static double cpu_s(pid_t pid)
{
    char path[64], buf[1024], *p;
    unsigned long long ut = 0, st = 0;
    FILE *f;
    size_t n;

    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    f = fopen(path, "r");
    if (f == NULL)
        return 0;
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* After the command's ")": state, then fields 4 to 13, then utime and stime. */
    p = strrchr(buf, ')');
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static int64_t file_size(const char *path)
{
    struct stat st;

    return stat(path, &st) == 0 ? (int64_t)st.st_size : 0;
}

/* ---- a client ---- */

typedef struct client {
    int fd;
    td_proto_reader *r;
    td_pw w;
    int64_t id;
} client;

static void client_open(client *c, const char *sock)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};

    memset(c, 0, sizeof(*c));
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    c->fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        die(sock, strerror(errno));
    if (td_proto_reader_new(&c->r, 0) != 0)
        die("reader", "out of memory");
    td_pw_init(&c->w);
}

static void client_begin(client *c, const char *type, uint32_t extra)
{
    td_pw_reset(&c->w);
    td_pw_map(&c->w, 2 + extra);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, ++c->id);
}

static void client_send(client *c)
{
    const char *frame;
    size_t len;

    if (td_pw_finish(&c->w, &frame, &len) != 0 || write(c->fd, frame, len) != (ssize_t)len)
        die("send", strerror(errno));
}

/* The next frame, waiting up to timeout_ms (-1: for ever); NULL when none came in time. */
static td_proto_frame *client_recv(client *c, int timeout_ms)
{
    char buf[65536];
    td_proto_frame *f = NULL;
    td_error_t err;

    for (;;) {
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        ssize_t n;
        int rc = td_proto_reader_next(c->r, &f, &err);
        if (rc < 0)
            die("frame", err.msg);
        if (rc == 1)
            return f;
        if (poll(&p, 1, timeout_ms) == 0)
            return NULL;
        n = read(c->fd, buf, sizeof(buf));
        if (n <= 0)
            die("read", n == 0 ? "traind closed the connection" : strerror(errno));
        td_proto_reader_feed(c->r, buf, (size_t)n);
    }
}

static int is_type(const td_proto_frame *f, const char *type)
{
    size_t len;
    const char *t = td_pv_str(td_pv_get(td_proto_frame_root(f), "type"), &len);

    return t != NULL && len == strlen(type) && memcmp(t, type, len) == 0;
}

static void hello(client *c)
{
    td_proto_frame *f;

    client_begin(c, "hello", 1);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    client_send(c);
    f = client_recv(c, -1);
    if (f == NULL || !is_type(f, "hello"))
        die("hello", "no hello reply");
    td_proto_frame_free(f);
}

/* One list of the 100 newest jobs; its latency in ms. */
static double list_once(client *c)
{
    double t0 = td_mono_ms();
    td_proto_frame *f;

    client_begin(c, "list", 2);
    td_pw_str(&c->w, "limit");
    td_pw_int(&c->w, 100);
    td_pw_str(&c->w, "newest_first");
    td_pw_bool(&c->w, 1);
    client_send(c);
    f = client_recv(c, -1);
    if (f == NULL || !is_type(f, "jobs"))
        die("list", "no jobs reply");
    td_proto_frame_free(f);
    return td_mono_ms() - t0;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static void print_latency(const char *what, double *ms, size_t n)
{
    if (n == 0) {
        printf("  list latency %-14s no request\n", what);
        return;
    }
    qsort(ms, n, sizeof(*ms), by_value);
    printf("  list latency %-14s %zu requests: median %.1f ms, p99 %.1f ms, worst %.1f ms\n", what,
           n, ms[n / 2], ms[(size_t)((double)n * 0.99)], ms[n - 1]);
}

/* ---- the run ---- */

int main(int argc, char **argv)
{
    int64_t old = argc > 1 ? atoll(argv[1]) : 10000, rows = argc > 2 ? atoll(argv[2]) : 100;
    int64_t keep = argc > 3 ? atoll(argv[3]) : 100, listing = argc > 4 ? atoll(argv[4]) : 1;
    const char *bin = getenv("TRAIND_BIN") != NULL ? getenv("TRAIND_BIN") : "build/daemon/traind";
    static double idle_ms[100000], busy_ms[100000];
    size_t nidle = 0, nbusy = 0;
    char dir[256], db[300], sock[300], path[400];
    double now = td_wall_s(), t0, t_prune = 0, cpu0, cpu_prune;
    int64_t count = -1, before_bytes = 0, after_bytes = 0, db_before, progress = 0;
    td_metric *m = calloc(MAX_SAMPLES, sizeof(*m));
    td_proto_frame *f;
    td_store_space sp;
    td_error_t err;
    td_store *s;
    client a, b;
    pid_t pid;
    int status;

    if (m == NULL || rows > MAX_SAMPLES)
        die("rows", "at most 100000 a job");
    if (argc > 5)
        snprintf(dir, sizeof(dir), "%s", argv[5]);
    else
        snprintf(dir, sizeof(dir), "/tmp/bench-prune.XXXXXX");
    if ((argc > 5 ? mkdir(dir, 0700) : (mkdtemp(dir) == NULL ? -1 : 0)) != 0)
        die(dir, strerror(errno));
    snprintf(db, sizeof(db), "%s/traind.db", dir);
    snprintf(sock, sizeof(sock), "%s/traind.sock", dir);
    snprintf(path, sizeof(path), "%s/checkpoints", dir);
    mkdir(path, 0700);

    t0 = td_mono_ms();
    if (td_store_open(&s, db, &err) != 0)
        die(db, err.msg);
    for (int64_t i = 0; i < old + keep; i++)
        add_job(s, dir, i, rows, i < old ? now - 40 * DAY : now - 3600, m);
    if (td_store_space_get(s, &sp, &err) != 0)
        die("space", err.msg);
    td_store_close(s);
    db_before = file_size(db);
    printf("bench_prune: %lld jobs of %lld metric rows (5 keys a step), 3 log lines and a 4 KiB "
           "checkpoint each, ended 40 days ago, and %lld recent jobs; built in %.1f s\n",
           (long long)old, (long long)rows, (long long)keep, (td_mono_ms() - t0) / 1000.0);
    printf("  database: %.1f MiB (%lld pages of %lld bytes, auto_vacuum %d)\n",
           (double)db_before / (1 << 20), (long long)sp.pages, (long long)sp.page_bytes,
           sp.auto_vacuum);

    pid = fork();
    if (pid == 0) {
        snprintf(path, sizeof(path), "%s/traind.log", dir);
        if (freopen(path, "a", stderr) == NULL)
            _exit(126);
        execl(bin, bin, "--socket", sock, "--state-dir", dir, "--devices", "cpu:1", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 200 && access(sock, F_OK) != 0; i++)
        usleep(50 * 1000);
    usleep(500 * 1000); /* the start's own sweep of the checkpoints */
    client_open(&a, sock);
    client_open(&b, sock);
    hello(&a);
    hello(&b);
    for (int i = 0; i < 50; i++)
        idle_ms[nidle++] = list_once(&b);

    client_begin(&a, "prune", 1);
    td_pw_str(&a.w, "older_than");
    td_pw_double(&a.w, 30 * DAY);
    t0 = td_mono_ms();
    cpu0 = cpu_s(pid);
    client_send(&a);
    while (count < 0) {
        if (listing && nbusy < sizeof(busy_ms) / sizeof(busy_ms[0]))
            busy_ms[nbusy++] = list_once(&b);
        while ((f = client_recv(&a, listing ? 0 : -1)) != NULL) {
            if (is_type(f, "deleted")) {
                t_prune = td_mono_ms() - t0;
                td_pv_int(td_pv_get(td_proto_frame_root(f), "count"), &count);
                td_pv_int(td_pv_get(td_proto_frame_root(f), "db_bytes_before"), &before_bytes);
                td_pv_int(td_pv_get(td_proto_frame_root(f), "db_bytes_after"), &after_bytes);
            } else if (is_type(f, "progress")) {
                progress++;
            } else {
                die("prune", "an error frame");
            }
            td_proto_frame_free(f);
            if (count >= 0)
                break;
        }
    }
    cpu_prune = cpu_s(pid) - cpu0;
    print_latency("while idle:", idle_ms, nidle);
    print_latency("during prune:", busy_ms, nbusy);
    kill(pid, SIGTERM);
    waitpid(pid, &status, 0);
    printf("  prune: %lld jobs (%lld metric rows) in %.2f s of wall time, %.0f jobs/s; traind "
           "used %.2f s of CPU meanwhile%s; %lld progress frames\n",
           (long long)count, (long long)(count * rows), t_prune / 1000.0,
           (double)count / (t_prune / 1000.0), cpu_prune, listing ? " (the lists' included)" : "",
           (long long)progress);
    printf("  database: %.1f MiB before, %.1f MiB in use after (the reply's figures); the file "
           "%.1f MiB before, %.1f MiB once traind stopped\n",
           (double)before_bytes / (1 << 20), (double)after_bytes / (1 << 20),
           (double)db_before / (1 << 20), (double)file_size(db) / (1 << 20));
    printf("  state directory left in %s\n", dir);
    free(m);
    return 0;
}
