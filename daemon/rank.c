/* `traind rank` (rank.h). The main thread parses the flags and the spec, joins the world,
 * proves the checkpoint directory is shared, starts the workers and the spanning run, then
 * turns the run's events into frames (stream mode) or store writes (--state) until DONE. The
 * metric hook runs on global rank 0's worker and only appends to a pending list, which the
 * loop writes out with each progress frame, so a slow reader of the stream blocks the loop,
 * never a worker inside a collective. Before a checkpoint, that worker writes the pending rows
 * out itself (on_flush): a checkpoint is never ahead of the rows that have left the process, so
 * a rank killed after it loses none that a resumed job would not compute again. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "daemon/jobspec.h"
#include "daemon/mailbox.h"
#include "daemon/metricq.h"
#include "daemon/rank.h"
#include "daemon/run.h"
#include "proto/jsonpack.h"
#include "store/store.h"
#include "common/td_log.h"

#define RANK_STREAM_VERSION 1
#define RANK_ROWS_PER_FRAME 4096 /* metric rows in one frame: well under the 1 MiB limit */

typedef struct rank_flags {
    const char *spec;
    const char *state;
    const char *ckpt;
    const char *devices;
    int64_t job;
} rank_flags;

typedef struct row {
    char key[64];
    int64_t step;
    double value;
} row;

typedef struct rank_proc {
    rank_flags f;
    uv_loop_t loop;
    uv_signal_t sig[4];
    td_mailbox mb;
    td_jobspec spec;
    void *spec_bytes; /* msgpack, as validated */
    size_t spec_len;
    td_device_kind kind;
    int local;
    td_worker workers[TD_MAX_DEVICES];
    td_run *run;
    int lead;      /* global rank 0: reports */
    int stream_fd; /* the rank stream (lead, no --state); -1 otherwise */
    /* guards the stream's writes, each frame whole, and stream_broken; held from taking the
     * pending rows to their last frame's write */
    pthread_mutex_t stream_mu;
    int stream_broken;
    td_pw w;  /* the loop's frames */
    td_pw fw; /* the worker's (on_flush) */
    /* the lead's pending metric rows, appended by its worker */
    pthread_mutex_t mu;
    row *rows;
    size_t nrows, caprows;
    /* --state */
    td_store *store;
    td_mq *mq;
    int64_t total_steps; /* from STARTED */
    int exit_code;
    int done;
} rank_proc;

static void say(const rank_proc *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A line on stderr, from global rank 0 only (every process says the same). */
static void say(const rank_proc *p, const char *fmt, ...)
{
    va_list ap;

    if (td_world_rank() != 0 && p != NULL)
        return;
    fputs("traind rank: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void usage(void)
{
    fputs("usage: traind rank --spec FILE [--job ID] [--state DIR] [--checkpoint-dir DIR]\n"
          "                   [--devices cpu:N|cuda:N]\n"
          "--devices defaults to the job's nodes x devices_per_node over the processes there\n"
          "are (devices_per_node where that does not divide).\n"
          "One process of a job that spans nodes, started by srun --mpi=pmix or mpirun, one per\n"
          "node. FILE is a job file (JSON) or the daemon's msgpack spec. Without --state, rank\n"
          "0 writes traind's frames on stdout (the rank stream, proto/PROTOCOL.md); with it,\n"
          "its metrics go into DIR/traind.db. Exit: 0 succeeded, 1 failed, 2 cancelled,\n"
          "3 interrupted, 64 usage.\n",
          stderr);
}

static int parse_flags(int argc, char **argv, rank_flags *f)
{
    static const struct option opts[] = {
        {"spec", required_argument, NULL, 's'},
        {"job", required_argument, NULL, 'j'},
        {"state", required_argument, NULL, 'S'},
        {"checkpoint-dir", required_argument, NULL, 'c'},
        {"devices", required_argument, NULL, 'd'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;

    *f = (rank_flags){.job = 1};
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case 's':
            f->spec = optarg;
            break;
        case 'S':
            f->state = optarg;
            break;
        case 'c':
            f->ckpt = optarg;
            break;
        case 'd':
            f->devices = optarg;
            break;
        case 'j':
            errno = 0;
            f->job = strtoll(optarg, &end, 10);
            if (errno != 0 || *end != '\0' || f->job < 1) {
                fprintf(stderr, "traind rank: --job %s: must be a positive integer\n", optarg);
                return -1;
            }
            break;
        case 'h':
            usage();
            exit(0);
        default:
            usage();
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "traind rank: unexpected argument: %s\n", argv[optind]);
        return -1;
    }
    if (f->spec == NULL) {
        fprintf(stderr, "traind rank: --spec FILE is required\n");
        return -1;
    }
    return 0;
}

/* Reads the spec file: JSON (its first byte past white space a '{') or msgpack, into msgpack
 * bytes (malloc'd). */
static int read_spec(const char *path, void **out, size_t *len, td_error_t *err)
{
    FILE *fp = fopen(path, "rbe");
    char *buf = NULL;
    size_t n = 0, cap = 0;
    size_t i = 0;

    *out = NULL;
    if (fp == NULL)
        return td_error_set(err, TD_EIO, "--spec %s: %s", path, strerror(errno));
    for (;;) {
        if (n == cap) {
            char *b = cap >= TD_PROTO_MAX_FRAME ? NULL : realloc(buf, cap ? cap * 2 : 65536);
            if (b == NULL) {
                fclose(fp);
                free(buf);
                return td_error_set(err, TD_E2BIG, "--spec %s: larger than a frame (%d bytes)",
                                    path, TD_PROTO_MAX_FRAME);
            }
            buf = b;
            cap = cap ? cap * 2 : 65536;
        }
        size_t got = fread(buf + n, 1, cap - n, fp);
        n += got;
        if (got == 0)
            break;
    }
    fclose(fp);
    while (i < n && (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\n' || buf[i] == '\r'))
        i++;
    if (i < n && buf[i] == '{') {
        json_error_t je;
        json_t *j = json_loadb(buf, n, 0, &je);
        td_pw w;
        const void *body;
        size_t blen;
        int rc;
        free(buf);
        if (j == NULL)
            return td_error_set(err, TD_EJOB, "--spec %s: line %d: %s", path, je.line, je.text);
        td_pw_init(&w);
        rc = td_json_to_pw(&w, j, 1, err);
        json_decref(j);
        body = rc == 0 ? td_pw_body(&w, &blen) : NULL;
        if (rc == 0 && body == NULL)
            rc = td_error_set(err, TD_ENOMEM, "out of memory reading --spec %s", path);
        if (rc == 0 && (*out = malloc(blen)) == NULL)
            rc = td_error_set(err, TD_ENOMEM, "out of memory reading --spec %s", path);
        if (rc == 0) {
            memcpy(*out, body, blen);
            *len = blen;
        }
        td_pw_free(&w);
        return rc;
    }
    *out = buf;
    *len = n;
    return 0;
}

/* The devices of each node: --devices, else the job's world (nodes x devices_per_node) spread
 * over the processes there are, so that a restart on fewer nodes keeps the world and its
 * bits (devices_per_node when it does not divide), of cuda when this build drives GPUs and
 * the node shows that many, else of cpu. */
static int plan_devices(rank_proc *p, td_error_t *err)
{
    int world = p->spec.nodes * p->spec.devices_per_node, procs = td_world_size();
    int n = world % procs == 0 && world / procs <= TD_MAX_DEVICES ? world / procs
                                                                  : p->spec.devices_per_node;
    int seen = 0;

    p->kind = TD_DEVICE_CPU;
    if (p->f.devices != NULL) {
        char kind[8];
        int used = 0;
        if (sscanf(p->f.devices, "%7[a-z]:%d%n", kind, &n, &used) != 2 ||
            p->f.devices[used] != '\0' || n < 1 || n > TD_MAX_DEVICES ||
            (strcmp(kind, "cpu") != 0 && strcmp(kind, "cuda") != 0))
            return td_error_set(err, TD_EINVAL,
                                "--devices %s: must be cpu:N or cuda:N, N from 1 to %d",
                                p->f.devices, TD_MAX_DEVICES);
        p->kind = strcmp(kind, "cuda") == 0 ? TD_DEVICE_CUDA : TD_DEVICE_CPU;
    } else if (td_device_kind_built(TD_DEVICE_CUDA) &&
               td_device_count(TD_DEVICE_CUDA, &seen, err) == 0 && seen >= n) {
        p->kind = TD_DEVICE_CUDA;
    }
    if (p->kind == TD_DEVICE_CUDA) {
        if (td_device_count(TD_DEVICE_CUDA, &seen, err) != 0)
            return err->code;
        if (seen < n)
            return td_error_set(err, TD_ECUDA, "--devices cuda:%d: node %s shows %d GPU(s)", n,
                                td_world_node_name(td_world_rank()), seen);
    }
    p->local = n;
    for (int i = 0; i < n; i++) {
        td_worker *w = &p->workers[i];
        w->index = i;
        w->kind = p->kind;
        w->device = i;
        snprintf(w->name, sizeof(w->name), "%s:%d", td_device_kind_name(w->kind), i);
    }
    return 0;
}

/* Validates the spec as submit would, as this process's user. */
static int load_spec(rank_proc *p, td_error_t *err)
{
    td_proto_frame *fr = NULL;
    int rc = read_spec(p->f.spec, &p->spec_bytes, &p->spec_len, err);

    if (rc != 0)
        return rc;
    rc = td_proto_decode(p->spec_bytes, p->spec_len, &fr, err);
    if (rc == 0)
        rc = td_jobspec_check_text(td_proto_frame_root(fr), err);
    if (rc == 0)
        rc = td_jobspec_parse(td_proto_frame_root(fr), &p->spec, err);
    td_proto_frame_free(fr);
    if (rc != 0)
        return rc;
    if (p->spec.batch_auto)
        return td_error_set(err, TD_EJOB,
                            "batch_size: \"auto\" is chosen by the daemon's memory guard; "
                            "traind rank needs a number of rows");
    if (p->spec.nodes > 1 && td_world_size() < p->spec.min_nodes)
        return td_error_set(err, TD_EJOB, "min_nodes: the job needs %d nodes and has %d",
                            p->spec.min_nodes, td_world_size());
    p->spec.uid = getuid();
    p->spec.gid = getgid();
    return 0;
}

/* mkdir -p of dir, mode 0750 for what it makes. */
static int make_dirs(const char *dir, td_error_t *err)
{
    char path[TD_PATH_MAX];

    if (snprintf(path, sizeof(path), "%s", dir) >= (int)sizeof(path))
        return td_error_set(err, TD_E2BIG, "--checkpoint-dir: longer than %d bytes",
                            TD_PATH_MAX - 1);
    for (char *s = path + 1; *s != '\0'; s++)
        if (*s == '/') {
            *s = '\0';
            if (mkdir(path, 0750) != 0 && errno != EEXIST)
                return td_error_set(err, TD_EIO, "cannot make %s: %s", path, strerror(errno));
            *s = '/';
        }
    if (mkdir(path, 0750) != 0 && errno != EEXIST)
        return td_error_set(err, TD_EIO, "cannot make %s: %s", path, strerror(errno));
    return 0;
}

/* Proves that every process sees the checkpoint directory rank 0 writes into: rank 0 makes it
 * and writes a nonce file; every process reads the nonce back. Each process's answer is
 * gathered, so that every one refuses naming the first node that could not. */
static int prove_shared(rank_proc *p, td_error_t *err)
{
    const char *dir = p->spec.train.checkpoint_dir;
    struct {
        uint64_t nonce;
        int32_t made;
        char why[TD_PATH_MAX + 1200];
    } share = {0};
    char path[TD_PATH_MAX + 64];
    int ok = 0, *oks, rc = 0;

    if (dir[0] == '\0')
        return 0;
    if (td_world_rank() == 0) {
        td_error_t e = {0};
        struct timespec ts;
        FILE *fp;
        clock_gettime(CLOCK_REALTIME, &ts);
        share.nonce = ((uint64_t)ts.tv_nsec << 32) ^ (uint64_t)ts.tv_sec ^ (uint64_t)getpid();
        snprintf(path, sizeof(path), "%s/.traind-shared-%016llx", dir,
                 (unsigned long long)share.nonce);
        if (make_dirs(dir, &e) != 0)
            snprintf(share.why, sizeof(share.why), "%s", e.msg);
        else if ((fp = fopen(path, "we")) == NULL)
            snprintf(share.why, sizeof(share.why), "cannot write %s: %s", path, strerror(errno));
        else {
            fprintf(fp, "%016llx\n", (unsigned long long)share.nonce);
            share.made = fclose(fp) == 0;
        }
    }
    if ((rc = td_world_bcast(&share, sizeof(share), err)) != 0)
        return rc;
    if (!share.made) {
        share.why[sizeof(share.why) - 1] = '\0';
        return td_error_set(err, TD_EIO, "--checkpoint-dir %s: %s", dir, share.why);
    }
    snprintf(path, sizeof(path), "%s/.traind-shared-%016llx", dir, (unsigned long long)share.nonce);
    {
        FILE *fp = fopen(path, "re");
        unsigned long long got = 0;
        ok = fp != NULL && fscanf(fp, "%llx", &got) == 1 && got == share.nonce;
        if (fp != NULL)
            fclose(fp);
    }
    oks = calloc((size_t)td_world_size(), sizeof(int));
    if (oks == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory proving --checkpoint-dir");
    rc = td_world_allgather(&ok, sizeof(ok), oks, err);
    for (int i = 0; rc == 0 && i < td_world_size(); i++)
        if (!oks[i])
            rc = td_error_set(err, TD_EIO,
                              "--checkpoint-dir %s: not shared with node %s (rank %d cannot "
                              "read the nonce rank 0 wrote); give a directory every node mounts",
                              dir, td_world_node_name(i), i);
    free(oks);
    /* every process has read it (or the job stops here): rank 0 removes it */
    if (rc == 0 && td_world_rank() == 0)
        unlink(path);
    return rc;
}

/* ---- the rank stream (global rank 0, no --state) ---- */

/* Writes w's frame on the stream, p->stream_mu held; a reader gone (EPIPE) is remembered, the
 * job goes on. */
static void write_frame(rank_proc *p, td_pw *w)
{
    const char *frame;
    size_t len, off = 0;

    if (p->stream_fd < 0 || p->stream_broken || td_pw_finish(w, &frame, &len) != 0)
        return;
    while (off < len) {
        ssize_t n = write(p->stream_fd, frame + off, len - off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            td_log_err("the rank stream cannot be written (%s): its reader is gone",
                       strerror(errno));
            p->stream_broken = 1;
            return;
        }
        off += (size_t)n;
    }
}

/* The loop's frame in p->w, whole. */
static void stream_send(rank_proc *p)
{
    pthread_mutex_lock(&p->stream_mu);
    write_frame(p, &p->w);
    pthread_mutex_unlock(&p->stream_mu);
}

static int on_metric(void *ud, const char *key, int64_t step, double value, td_error_t *err)
{
    rank_proc *p = ud;

    pthread_mutex_lock(&p->mu);
    if (p->nrows == p->caprows) {
        size_t cap = p->caprows ? p->caprows * 2 : 256;
        row *r = realloc(p->rows, cap * sizeof(*r));
        if (r == NULL) {
            pthread_mutex_unlock(&p->mu);
            return td_error_set(err, TD_ENOMEM, "out of memory queueing a metric row");
        }
        p->rows = r;
        p->caprows = cap;
    }
    snprintf(p->rows[p->nrows].key, sizeof(p->rows[p->nrows].key), "%s", key);
    p->rows[p->nrows].step = step;
    p->rows[p->nrows].value = value;
    p->nrows++;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* The pending metric rows, in frames of at most RANK_ROWS_PER_FRAME packed in w: written before
 * anyone else may take rows after them, so that whoever returns from here has every row taken
 * before its own out of the process. */
static void send_rows(rank_proc *p, td_pw *w)
{
    row *rows;
    size_t n;

    pthread_mutex_lock(&p->stream_mu);
    pthread_mutex_lock(&p->mu);
    rows = p->rows;
    n = p->nrows;
    p->rows = NULL;
    p->nrows = p->caprows = 0;
    pthread_mutex_unlock(&p->mu);
    for (size_t at = 0; at < n; at += RANK_ROWS_PER_FRAME) {
        size_t k = n - at < RANK_ROWS_PER_FRAME ? n - at : RANK_ROWS_PER_FRAME;
        td_pw_reset(w);
        td_pw_map(w, 2);
        td_pw_str(w, "type");
        td_pw_str(w, "metrics");
        td_pw_str(w, "rows");
        td_pw_array(w, (uint32_t)k);
        for (size_t i = at; i < at + k; i++) {
            td_pw_array(w, 3);
            td_pw_str(w, rows[i].key);
            td_pw_int(w, rows[i].step);
            td_pw_double(w, rows[i].value);
        }
        write_frame(p, w);
    }
    pthread_mutex_unlock(&p->stream_mu);
    free(rows);
}

/* td_run_args.flush: before a checkpoint, on the lead's worker. */
static void on_flush(void *ud)
{
    rank_proc *p = ud;

    send_rows(p, &p->fw);
}

static void send_hello(rank_proc *p)
{
    int procs = td_world_size();

    td_pw_reset(&p->w);
    td_pw_map(&p->w, 8);
    td_pw_str(&p->w, "type");
    td_pw_str(&p->w, "rank");
    td_pw_str(&p->w, "version");
    td_pw_int(&p->w, RANK_STREAM_VERSION);
    td_pw_str(&p->w, "job");
    td_pw_int(&p->w, p->f.job);
    td_pw_str(&p->w, "nodes");
    td_pw_int(&p->w, procs);
    td_pw_str(&p->w, "devices_per_node");
    td_pw_int(&p->w, p->local);
    td_pw_str(&p->w, "world");
    td_pw_int(&p->w, (int64_t)procs * p->local);
    td_pw_str(&p->w, "device_kind");
    td_pw_str(&p->w, td_device_kind_name(p->kind));
    td_pw_str(&p->w, "node_names");
    td_pw_array(&p->w, (uint32_t)procs);
    for (int i = 0; i < procs; i++)
        td_pw_str(&p->w, td_world_node_name(i));
    stream_send(p);
}

static void send_step(rank_proc *p, const char *type, int64_t step, int64_t total)
{
    td_pw_reset(&p->w);
    td_pw_map(&p->w, total >= 0 ? 3 : 2);
    td_pw_str(&p->w, "type");
    td_pw_str(&p->w, type);
    td_pw_str(&p->w, "step");
    td_pw_int(&p->w, step);
    if (total >= 0) {
        td_pw_str(&p->w, "total_steps");
        td_pw_int(&p->w, total);
    }
    stream_send(p);
}

static void send_log(rank_proc *p, const char *message)
{
    td_pw_reset(&p->w);
    td_pw_map(&p->w, 2);
    td_pw_str(&p->w, "type");
    td_pw_str(&p->w, "log");
    td_pw_str(&p->w, "message");
    td_pw_str(&p->w, message);
    stream_send(p);
}

/* The stream's word for a run's end state. */
static const char *end_word(const char *state)
{
    return strcmp(state, TD_JOB_QUEUED) == 0 ? "interrupted" : state;
}

static void send_done(rank_proc *p, const td_event *ev)
{
    int n = 0;
    const td_run_failed *f = td_run_failures(p->run, &n);
    td_run_failed local[TD_MAX_DEVICES];

    if (td_world_size() == 1) {
        /* a run of one process: its own replicas' failures */
        n = 0;
        for (int i = 0; i < td_run_world(p->run); i++)
            if (td_run_failure(p->run, i) != NULL)
                local[n++] = (td_run_failed){.node = 0,
                                             .device = td_run_worker(p->run, i)->device,
                                             .err = *td_run_failure(p->run, i)};
        f = local;
    }

    td_pw_reset(&p->w);
    td_pw_map(&p->w, 7);
    td_pw_str(&p->w, "type");
    td_pw_str(&p->w, "done");
    td_pw_str(&p->w, "state");
    td_pw_str(&p->w, end_word(ev->state));
    td_pw_str(&p->w, "step");
    td_pw_int(&p->w, ev->step);
    td_pw_str(&p->w, "code");
    td_pw_int(&p->w, ev->err.code);
    td_pw_str(&p->w, "name");
    td_pw_str(&p->w, ev->err.code != 0 ? td_errname(ev->err.code) : "");
    td_pw_str(&p->w, "message");
    td_pw_str(&p->w, ev->err.msg);
    td_pw_str(&p->w, "failed");
    td_pw_array(&p->w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        td_pw_map(&p->w, 5);
        td_pw_str(&p->w, "node");
        td_pw_int(&p->w, f[i].node);
        td_pw_str(&p->w, "node_name");
        td_pw_str(&p->w, td_world_node_name(f[i].node));
        td_pw_str(&p->w, "device");
        td_pw_int(&p->w, f[i].device);
        td_pw_str(&p->w, "code");
        td_pw_int(&p->w, f[i].err.code);
        td_pw_str(&p->w, "message");
        td_pw_str(&p->w, f[i].err.msg);
    }
    stream_send(p);
}

/* ---- the loop ---- */

static int exit_code_of(const char *state)
{
    if (strcmp(state, TD_JOB_SUCCEEDED) == 0)
        return TD_RANK_SUCCEEDED;
    if (strcmp(state, TD_JOB_CANCELLED) == 0)
        return TD_RANK_CANCELLED;
    if (strcmp(state, TD_JOB_QUEUED) == 0)
        return TD_RANK_INTERRUPTED;
    return TD_RANK_FAILED;
}

static void close_handles(rank_proc *p)
{
    for (int i = 0; i < 4; i++)
        uv_close((uv_handle_t *)&p->sig[i], NULL);
    td_mailbox_close(&p->mb);
}

/* The --state store's record of the job's end. */
static void store_end(rank_proc *p, const td_event *ev)
{
    td_error_t e;

    if (p->store == NULL)
        return;
    if (td_store_job_set_progress(p->store, p->f.job, ev->step, p->total_steps, &e) != 0 ||
        td_store_job_set_state(p->store, p->f.job, ev->state, NULL, ev->err.code,
                               ev->err.code ? ev->err.msg : NULL, &e) != 0)
        say(p, "the job's end could not be stored in %s: %s", p->f.state, e.msg);
}

static void on_events(void *ud)
{
    rank_proc *p = ud;
    td_event *ev = td_mailbox_take(&p->mb), *next;

    /* the mailbox hands over every event posted since the last take, oldest first */
    for (; ev != NULL; ev = next) {
        next = ev->next;
        switch (ev->kind) {
        case TD_EV_STARTED:
            p->total_steps = ev->total_steps;
            if (p->lead) {
                send_step(p, "started", ev->step, ev->total_steps);
                if (p->store != NULL) {
                    td_error_t e;
                    (void)td_store_job_set_progress(p->store, p->f.job, ev->step, ev->total_steps,
                                                    &e);
                }
            }
            break;
        case TD_EV_PROGRESS: {
            int64_t step = td_run_progress(p->run);
            if (p->lead) {
                send_rows(p, &p->w);
                send_step(p, "progress", step, -1);
            }
            break;
        }
        case TD_EV_DONE:
            if (p->lead) {
                send_rows(p, &p->w);
                send_done(p, ev);
                store_end(p, ev);
            }
            if (ev->err.code != 0 && p->lead)
                say(p, "job %lld %s: %s", (long long)p->f.job, end_word(ev->state), ev->err.msg);
            p->exit_code = exit_code_of(ev->state);
            p->done = 1;
            break;
        case TD_EV_STORE_FAILED:
            say(p, "metrics could not be stored: %s", ev->err.msg);
            break;
        default:
            break;
        }
        td_event_free(ev);
    }
    if (p->done)
        close_handles(p);
}

static void on_signal(uv_signal_t *h, int signum)
{
    rank_proc *p = h->data;

    if (p->run == NULL)
        return;
    if (signum == SIGUSR1)
        td_run_cancel(p->run);
    else
        td_run_interrupt(p->run);
}

static int start_loop(rank_proc *p, td_error_t *err)
{
    static const int sigs[4] = {SIGUSR1, SIGUSR2, SIGTERM, SIGINT};
    int rc = uv_loop_init(&p->loop);

    if (rc != 0)
        return td_error_set(err, TD_EIO, "uv_loop_init: %s", uv_strerror(rc));
    if (td_mailbox_init(&p->mb, &p->loop, on_events, p) != 0)
        return td_error_set(err, TD_ENOMEM, "cannot make the run's mailbox");
    for (int i = 0; i < 4; i++) {
        uv_signal_init(&p->loop, &p->sig[i]);
        p->sig[i].data = p;
        uv_signal_start(&p->sig[i], on_signal, sigs[i]);
    }
    return 0;
}

/* --state DIR: the store, its job row and the metric queue, on global rank 0. */
static int open_state(rank_proc *p, td_error_t *err)
{
    char db[TD_PATH_MAX + 16];
    int64_t id = 0;
    int rc;

    if (make_dirs(p->f.state, err) != 0)
        return err->code;
    snprintf(db, sizeof(db), "%s/traind.db", p->f.state);
    if ((rc = td_store_open(&p->store, db, err)) != 0)
        return rc;
    if ((rc = td_store_job_insert(p->store, p->spec.name, td_world_size() * p->local,
                                  p->spec.priority, (int64_t)getuid(), p->spec_bytes, p->spec_len,
                                  NULL, &id, err)) != 0)
        return rc;
    p->f.job = id;
    if ((rc = td_store_job_set_state(p->store, id, TD_JOB_RUNNING, "", 0, NULL, err)) != 0)
        return rc;
    return td_mq_start(&p->mq, db, 0, NULL, NULL, err);
}

/* Where checkpoints go: --checkpoint-dir, else STATE/checkpoints/job-ID, else none. The job id
 * of a --state run is the store's, known on rank 0 only: it is broadcast. */
static int checkpoint_place(rank_proc *p, td_error_t *err)
{
    char *dir = p->spec.train.checkpoint_dir;
    int rc = td_world_bcast(&p->f.job, sizeof(p->f.job), err);

    if (rc != 0)
        return rc;
    if (p->f.ckpt != NULL)
        rc = snprintf(dir, TD_PATH_MAX, "%s", p->f.ckpt) >= TD_PATH_MAX;
    else if (p->f.state != NULL)
        rc = snprintf(dir, TD_PATH_MAX, "%s/checkpoints/job-%lld", p->f.state,
                      (long long)p->f.job) >= TD_PATH_MAX;
    else
        dir[0] = '\0';
    return rc ? td_error_set(err, TD_E2BIG, "the checkpoint directory is longer than %d bytes",
                             TD_PATH_MAX - 1)
              : 0;
}

/* Every process's answer to a step of the set-up: if any failed, each stops with the first
 * failure's message (its own, or a peer's, named by node). */
static int agree(int rc, td_error_t *err)
{
    struct {
        int32_t code;
        char msg[sizeof(((td_error_t *)0)->msg)];
    } mine = {rc, ""}, *all;
    td_error_t e;
    int out = 0;

    if (td_world_size() == 1)
        return rc;
    snprintf(mine.msg, sizeof(mine.msg), "%s", rc ? err->msg : "");
    all = calloc((size_t)td_world_size(), sizeof(*all));
    if (all == NULL || td_world_allgather(&mine, sizeof(mine), all, &e) != 0) {
        free(all);
        return rc != 0 ? rc : TD_EMPI;
    }
    for (int i = 0; i < td_world_size() && out == 0; i++)
        if (all[i].code != 0) {
            all[i].msg[sizeof(all[i].msg) - 1] = '\0';
            out = all[i].code;
            if (i != td_world_rank())
                td_error_set(err, out, "node %s: %s", td_world_node_name(i), all[i].msg);
        }
    free(all);
    return out;
}

static int setup(rank_proc *p, td_error_t *err)
{
    int rc = load_spec(p, err);

    if ((rc = agree(rc, err)) != 0)
        return rc;
    rc = plan_devices(p, err);
    if ((rc = agree(rc, err)) != 0)
        return rc;
    p->lead = td_world_rank() == 0;
    rc = p->lead && p->f.state != NULL ? open_state(p, err) : 0;
    if ((rc = agree(rc, err)) != 0)
        return rc;
    if ((rc = checkpoint_place(p, err)) != 0 || (rc = prove_shared(p, err)) != 0)
        return rc;
    rc = start_loop(p, err);
    if ((rc = agree(rc, err)) != 0)
        return rc;
    rc = td_workers_start(p->workers, p->local, err);
    return agree(rc, err);
}

static int run_job(rank_proc *p, td_error_t *err)
{
    td_worker *ws[TD_MAX_DEVICES];
    td_run_args a;
    int rc;

    for (int i = 0; i < p->local; i++)
        ws[i] = &p->workers[i];
    a = (td_run_args){.job = p->f.job,
                      .spec = &p->spec,
                      .workers = ws,
                      .world = p->local,
                      .mailbox = &p->mb,
                      .mq = p->mq,
                      .metric = p->mq == NULL ? on_metric : NULL,
                      .flush = p->mq == NULL ? on_flush : NULL,
                      .metric_ud = p,
                      .nccl_timeout_s = p->spec.nccl_timeout_s > 0 ? p->spec.nccl_timeout_s : 600,
                      /* the daemon's default [metrics] disk_full_wait_s */
                      .disk_full_wait_s = 60,
                      /* one process alone runs as the daemon's own runs do (the host reduce) */
                      .spanning = td_world_size() > 1};
    rc = td_run_new(&p->run, &a, err);
    if (rc != 0)
        return rc;
    if (p->lead) {
        char note[256];
        send_hello(p);
        snprintf(note, sizeof(note), "%d node(s) x %s:%d; checkpoints in %s", td_world_size(),
                 td_device_kind_name(p->kind), p->local,
                 p->spec.train.checkpoint_dir[0] ? p->spec.train.checkpoint_dir : "(none)");
        send_log(p, note);
    }
    td_run_start(p->run);
    uv_run(&p->loop, UV_RUN_DEFAULT);
    return 0;
}

/* Under ASan, Open MPI's own allocations outlive MPI_Finalize (its teardown leaves them to the
 * process's exit, and unloads the plugins that made some, so no suppression can name them). So
 * a rank's leak check leaves out what its main thread allocates in MPI_Init, and runs before
 * MPI_Finalize, once traind has freed everything of its own, rather
 * than at exit: what traind leaks is still found, MPI's teardown is not judged. */
#if defined(__SANITIZE_ADDRESS__)
void __lsan_disable(void);
void __lsan_enable(void);
void __lsan_do_leak_check(void);
#define TD_LSAN_DISABLE() __lsan_disable()
#define TD_LSAN_ENABLE()  __lsan_enable()
#define TD_LSAN_CHECK()   __lsan_do_leak_check()
#else
#define TD_LSAN_DISABLE() ((void)0)
#define TD_LSAN_ENABLE()  ((void)0)
#define TD_LSAN_CHECK()   ((void)0)
#endif

int td_rank_main(int argc, char **argv)
{
    static rank_proc p;
    td_error_t err = {0};
    int rc;

    td_log_detect();
    if (parse_flags(argc, argv, &p.f) != 0)
        return TD_RANK_USAGE;
    TD_LSAN_DISABLE();
    rc = td_world_init(&argc, &argv, &err);
    TD_LSAN_ENABLE();
    if (rc != 0) {
        fprintf(stderr, "traind rank: cannot join the job's MPI world: %s\n", err.msg);
        return TD_RANK_USAGE;
    }
    signal(SIGPIPE, SIG_IGN);
    pthread_mutex_init(&p.mu, NULL);
    pthread_mutex_init(&p.stream_mu, NULL);
    td_pw_init(&p.w);
    td_pw_init(&p.fw);
    p.stream_fd = -1;
    p.exit_code = TD_RANK_FAILED;
    if (p.f.state == NULL) {
        /* The stream is global rank 0's stdout as the launcher gave it; everything else that
         * writes to fd 1 (a library's notice), on every process, goes to stderr instead: srun
         * and mpirun merge every task's stdout into the one the daemon reads frames from. */
        p.stream_fd = td_world_rank() == 0 ? fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3) : 0;
        if (p.stream_fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
            fprintf(stderr, "traind rank: cannot set up the rank stream: %s\n", strerror(errno));
            TD_LSAN_CHECK();
            td_world_finalize();
            return TD_RANK_USAGE;
        }
        if (td_world_rank() != 0)
            p.stream_fd = -1;
    }
    rc = setup(&p, &err);
    if (rc != 0) {
        say(&p, "%s", err.msg);
        TD_LSAN_CHECK();
        td_world_finalize();
        return rc == TD_EJOB || rc == TD_EINVAL || rc == TD_E2BIG ? TD_RANK_USAGE : TD_RANK_FAILED;
    }
    if (run_job(&p, &err) != 0) {
        say(&p, "%s", err.msg);
        p.exit_code = TD_RANK_FAILED;
    }
    td_run_free(p.run);
    td_workers_stop(p.workers, p.local);
    if (p.mq != NULL)
        td_mq_stop(p.mq);
    td_store_close(p.store);
    td_pw_free(&p.w);
    td_pw_free(&p.fw);
    if (p.stream_fd >= 0)
        close(p.stream_fd);
    TD_LSAN_CHECK();
    td_world_finalize();
    return p.exit_code;
}
