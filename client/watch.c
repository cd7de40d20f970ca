/* trainctl watch: follows one job until it ends. It asks for the job's status first (the
 * spec gives the epoch count and batch size the progress line uses), then sends `watch` and
 * handles the rows, state and end frames that follow. Three ways to show them: a live
 * progress line on a terminal, redrawn at most TC_REDRAW_S apart, with evaluation results
 * printed above it as permanent lines; one plain line per event for a pipe; one JSON object
 * per row with --json. */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "client.h"

#define TC_BAR_WIDTH    20         /* characters of the bar itself */
#define TC_REDRAW_S     0.1        /* seconds between two redraws of the progress line, at least */
#define TC_RATE_WINDOW  64         /* (step, time) samples the steps/s estimate spans */
#define TC_LINE_MAX     512        /* bytes of a progress or evaluation line */
#define TC_DEFAULT_COLS 80         /* terminal width when it cannot be asked */
#define TC_GREEN        "\033[32m" /* the filled part of the bar */
#define TC_RESET        "\033[0m"
#define TC_CLEAR_LINE   "\r\033[2K"

enum { W_BAR, W_PLAIN, W_JSON };

typedef struct sample {
    int64_t step;
    double time;
} sample;

typedef struct watch {
    const tc_opts *o;
    tc_conn *c;
    int mode, color;
    char state[24];
    int64_t step, total;
    int64_t epochs, batch;   /* from the spec; 0 when it does not say */
    double loss, sps, epoch; /* latest train_loss, samples_per_s, epoch; NAN until seen */
    sample win[TC_RATE_WINDOW];
    size_t nwin, newest;    /* samples held, and the newest one's index */
    double drawn_at;        /* monotonic seconds of the last draw */
    int dirty;              /* the progress line shows less than is known */
    char eval[TC_LINE_MAX]; /* evaluation results of one step, gathered */
    size_t evallen;         /* bytes in eval; 0 when nothing is gathered */
    int64_t eval_step;      /* the step they are of */
    char shown_state[24];   /* plain mode: the last state line printed */
    int64_t shown_step, shown_total;
} watch;

static double now_mono(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void on_sigint(int sig)
{
    (void)sig;
    tc_interrupted = 1;
}

/* Appends printf output to buf (size bytes, *n used), truncating at the end. */
static void add(char *buf, size_t size, size_t *n, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void add(char *buf, size_t size, size_t *n, const char *fmt, ...)
{
    va_list ap;
    int k;

    if (*n + 1 >= size)
        return;
    va_start(ap, fmt);
    k = vsnprintf(buf + *n, size - *n, fmt, ap);
    va_end(ap);
    if (k > 0)
        *n = *n + (size_t)k < size ? *n + (size_t)k : size - 1;
}

/* Steps per second: from samples_per_s and the batch size when both are known, else from
 * the times of the rows over the last TC_RATE_WINDOW steps. NAN when neither is known. */
static double steps_per_s(const watch *wt)
{
    const sample *new, *old;

    if (isfinite(wt->sps) && wt->sps > 0 && wt->batch > 0)
        return wt->sps / (double)wt->batch;
    if (wt->nwin < 2)
        return NAN;
    new = &wt->win[wt->newest];
    old = &wt->win[(wt->newest + TC_RATE_WINDOW - (wt->nwin - 1)) % TC_RATE_WINDOW];
    if (new->time <= old->time)
        return NAN;
    return (double)(new->step - old->step) / (new->time - old->time);
}

static int term_cols(void)
{
    struct winsize ws;

    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        return ws.ws_col;
    return TC_DEFAULT_COLS;
}

/* The progress line's text after the bar. */
static void progress_text(const watch *wt, char *buf, size_t size)
{
    int running = strcmp(wt->state, "running") == 0;
    double rate = steps_per_s(wt);
    char eta[32];
    size_t n = 0;

    buf[0] = '\0';
    if (wt->total > 0)
        add(buf, size, &n, " step %lld/%lld  %d%%", (long long)wt->step, (long long)wt->total,
            (int)(100 * (wt->step < wt->total ? wt->step : wt->total) / wt->total));
    else if (wt->step > 0)
        add(buf, size, &n, " step %lld", (long long)wt->step);
    if (isfinite(wt->loss))
        add(buf, size, &n, "  loss %.4g", wt->loss);
    if (running && rate > 0)
        add(buf, size, &n, "  %.1f steps/s", rate);
    if (running && rate > 0 && wt->total > wt->step) {
        tc_fmt_duration(eta, sizeof(eta), (double)(wt->total - wt->step) / rate);
        add(buf, size, &n, "  ETA %s", eta);
    }
    if (isfinite(wt->epoch) && wt->epoch == floor(wt->epoch))
        add(buf, size, &n, "  epoch %.0f", wt->epoch);
    else if (isfinite(wt->epoch))
        add(buf, size, &n, "  epoch %.2f", wt->epoch);
    if (isfinite(wt->epoch) && wt->epochs > 0)
        add(buf, size, &n, "/%lld", (long long)wt->epochs);
    if (!running)
        add(buf, size, &n, "  %s", wt->state);
}

/* Redraws the progress line in place, cut to the terminal's width. */
static void draw(watch *wt)
{
    char text[TC_LINE_MAX], bar[TC_BAR_WIDTH + 1];
    int fill = 0, room = term_cols() - 1 - (TC_BAR_WIDTH + 2);
    int64_t step = wt->step < wt->total ? wt->step : wt->total;

    if (wt->total > 0 && step > 0)
        fill = (int)(TC_BAR_WIDTH * step / wt->total);
    memset(bar, '#', (size_t)fill);
    memset(bar + fill, '-', (size_t)(TC_BAR_WIDTH - fill));
    bar[TC_BAR_WIDTH] = '\0';
    progress_text(wt, text, sizeof(text));
    if (room < 0)
        room = 0;
    if (wt->color)
        printf(TC_CLEAR_LINE "[" TC_GREEN "%.*s" TC_RESET "%s]%.*s", fill, bar, bar + fill, room,
               text);
    else
        printf(TC_CLEAR_LINE "[%s]%.*s", bar, room, text);
    fflush(stdout);
    tc_line_open = 1;
    wt->drawn_at = now_mono();
    wt->dirty = 0;
}

/* Prints the gathered evaluation results as a permanent line above the progress line. */
static void flush_eval(watch *wt)
{
    if (wt->evallen == 0)
        return;
    printf("%s%s\n", tc_line_open ? TC_CLEAR_LINE : "", wt->eval);
    tc_line_open = 0;
    wt->evallen = 0;
    wt->dirty = 1;
}

/* Gathers an evaluation row into the line for its step. */
static void add_eval(watch *wt, const tc_row *r)
{
    char val[32];

    if (wt->evallen > 0 && wt->eval_step != r->step)
        flush_eval(wt);
    if (wt->evallen == 0) {
        wt->eval_step = r->step;
        add(wt->eval, sizeof(wt->eval), &wt->evallen, "step %lld", (long long)r->step);
    }
    tc_fmt_value(val, sizeof(val), r->value);
    add(wt->eval, sizeof(wt->eval), &wt->evallen, "  %.*s %s", (int)r->keylen, r->key, val);
}

static int row_is(const tc_row *r, const char *key)
{
    return r->keylen == strlen(key) && memcmp(r->key, key, r->keylen) == 0;
}

/* Keeps what the progress line shows up to date with one row. */
static void track(watch *wt, const tc_row *r)
{
    if (row_is(r, "train_loss"))
        wt->loss = r->value;
    else if (row_is(r, "samples_per_s"))
        wt->sps = r->value;
    else if (row_is(r, "epoch"))
        wt->epoch = r->value;
    if (r->step > wt->step)
        wt->step = r->step;
    if (wt->nwin == 0 || r->step > wt->win[wt->newest].step) {
        wt->newest = wt->nwin == 0 ? 0 : (wt->newest + 1) % TC_RATE_WINDOW;
        wt->win[wt->newest] = (sample){r->step, r->time};
        wt->nwin += wt->nwin < TC_RATE_WINDOW;
    }
    wt->dirty = 1;
}

static void on_row(watch *wt, const tc_row *r)
{
    char val[32];

    track(wt, r);
    if (wt->mode == W_JSON) {
        tc_row_json(stdout, wt->o->job, r);
        fputc('\n', stdout);
    } else if (wt->mode == W_PLAIN) {
        tc_fmt_value(val, sizeof(val), r->value);
        printf("step %lld %.*s %s\n", (long long)r->step, (int)r->keylen, r->key, val);
    } else if (tc_is_eval_key(r->key, r->keylen)) {
        add_eval(wt, r);
    }
}

static int on_rows(watch *wt, const td_pval *root)
{
    const td_pval *rows = td_pv_get(root, "rows");
    tc_row row;
    size_t i;
    int rc = TC_OK;

    if (td_pv_type_of(rows) != TD_PV_ARRAY)
        return tc_err(TC_PROTOCOL, "traind sent a rows frame without rows");
    for (i = 0; i < td_pv_len(rows) && rc == TC_OK; i++)
        if ((rc = tc_row_at(rows, i, &row)) == TC_OK)
            on_row(wt, &row);
    return rc;
}

/* Takes state, step and total_steps from a state frame or a JOB map. */
static void take_state(watch *wt, const td_pval *m)
{
    char state[sizeof(wt->state)];

    tc_job_str(m, "state", state, sizeof(state));
    if (state[0] != '\0')
        memcpy(wt->state, state, sizeof(state));
    wt->step = tc_job_int(m, "step", wt->step);
    wt->total = tc_job_int(m, "total_steps", wt->total);
    wt->dirty = 1;
}

static void on_state(watch *wt, const td_pval *root)
{
    take_state(wt, root);
    if (wt->mode != W_PLAIN || (strcmp(wt->state, wt->shown_state) == 0 &&
                                wt->step == wt->shown_step && wt->total == wt->shown_total))
        return;
    memcpy(wt->shown_state, wt->state, sizeof(wt->state));
    wt->shown_step = wt->step;
    wt->shown_total = wt->total;
    if (wt->total > 0)
        printf("state %s step %lld/%lld\n", wt->state, (long long)wt->step, (long long)wt->total);
    else
        printf("state %s step %lld\n", wt->state, (long long)wt->step);
}

/* --json's last line: {"job":1,"state":"failed","error":{...}} */
static int print_end_json(const watch *wt, const td_pval *job)
{
    json_t *obj = json_object(), *err = tc_pv_to_json(td_pv_get(job, "error"));
    int rc;

    if (obj == NULL || err == NULL || json_object_set_new(obj, "job", json_integer(wt->o->job)) ||
        json_object_set_new(obj, "state", json_string(wt->state)) ||
        json_object_set(obj, "error", err))
        rc = tc_err(TC_FAILED, "out of memory");
    else
        rc = tc_dump_json(obj, 0);
    json_decref(err);
    json_decref(obj);
    return rc;
}

/* Says how the job ended: a success on stdout, anything else on stderr. */
static void print_outcome(const watch *wt, const td_pval *job)
{
    long long id = (long long)wt->o->job;
    char text[1024];

    if (strcmp(wt->state, "succeeded") == 0) {
        tc_job_results(job, text, sizeof(text));
        if (wt->mode != W_JSON)
            printf("job %lld succeeded%s%s\n", id, text[0] ? ": " : "", text);
        return;
    }
    tc_job_error(job, text, sizeof(text));
    if (strcmp(wt->state, "failed") == 0)
        fprintf(stderr, "job %lld failed: %s\n", id, text[0] ? text : "no error was recorded");
    else if (strcmp(wt->state, "cancelled") == 0)
        fprintf(stderr, "job %lld cancelled\n", id);
    else
        fprintf(stderr, "job %lld: the watch ended while the job is %s\n", id, wt->state);
}

static int on_end(watch *wt, const td_pval *root)
{
    const td_pval *job = td_pv_get(root, "job");
    int rc = TC_OK;

    if (td_pv_type_of(job) != TD_PV_MAP)
        return tc_err(TC_PROTOCOL, "traind's end frame has no job map");
    take_state(wt, job);
    flush_eval(wt);
    if (wt->mode == W_BAR) {
        draw(wt);
        fputc('\n', stdout);
        tc_line_open = 0;
    }
    if (wt->mode == W_JSON)
        rc = print_end_json(wt, job);
    print_outcome(wt, job);
    if (rc == TC_OK && strcmp(wt->state, "succeeded") != 0)
        rc = TC_FAILED;
    return rc;
}

/* Handles one frame; sets *done at the end frame. */
static int on_frame(watch *wt, const td_proto_frame *f, int *done)
{
    const td_pval *root = td_proto_frame_root(f);
    const td_pval *type = td_pv_get(root, "type");

    if (tc_pv_is(type, "rows"))
        return on_rows(wt, root);
    if (tc_pv_is(type, "state")) {
        on_state(wt, root);
        return TC_OK;
    }
    if (tc_pv_is(type, "end")) {
        *done = 1;
        return on_end(wt, root);
    }
    return tc_err(TC_PROTOCOL, "traind sent an unexpected frame while watching");
}

/* How long the next wait may last: until the progress line is due for a redraw. */
static int wait_ms(const watch *wt)
{
    double left;

    if (wt->mode != W_BAR || !wt->dirty)
        return -1;
    left = wt->drawn_at + TC_REDRAW_S - now_mono();
    return left > 0 ? (int)ceil(left * 1000) : 0;
}

static int follow(watch *wt)
{
    td_proto_frame *f = NULL;
    int rc = TC_OK, done = 0;

    while (rc == TC_OK && !done) {
        if (wt->mode == W_BAR && wt->dirty && wait_ms(wt) == 0)
            draw(wt);
        if (tc_interrupted)
            return TC_INTERRUPTED;
        if ((rc = tc_conn_recv(wt->c, &f, wait_ms(wt))) != TC_OK || f == NULL)
            continue;
        rc = on_frame(wt, f, &done);
        td_proto_frame_free(f);
        f = NULL;
        if (!done && wt->mode == W_BAR)
            flush_eval(wt);
        else if (!done)
            fflush(stdout); /* a pipe sees each frame's lines as they come */
    }
    return rc;
}

/* Asks for the job's status: where it stands, and from its spec the epochs and batch size. */
static int fetch_status(watch *wt)
{
    td_proto_frame *f = NULL;
    const td_pval *job, *spec;
    td_pw *w = tc_conn_request(wt->c, "status", 3);
    int rc;

    td_pw_str(w, "job_id");
    td_pw_int(w, wt->o->job);
    if ((rc = tc_conn_send(wt->c)) != TC_OK || (rc = tc_conn_expect(wt->c, "job", &f)) != TC_OK)
        return rc;
    job = td_pv_get(td_proto_frame_root(f), "job");
    spec = td_pv_get(job, "spec");
    take_state(wt, job);
    wt->epochs = tc_job_int(spec, "epochs", 0);
    wt->batch = tc_job_int(spec, "batch_size", 0);
    td_proto_frame_free(f);
    return TC_OK;
}

static int send_watch(watch *wt)
{
    const tc_opts *o = wt->o;
    td_pw *w = tc_conn_request(wt->c, "watch", 3 + (o->keys != NULL) + (o->since >= 0));

    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    if (o->keys != NULL)
        tc_pw_keys(w, o->keys);
    if (o->since >= 0) {
        td_pw_str(w, "since");
        td_pw_int(w, o->since);
    }
    return tc_conn_send(wt->c);
}

/* The way to show the job: --json, else a live line on a terminal, else plain lines. On a
 * terminal, Ctrl-C ends the watch cleanly (the line is finished) once; a second one kills. */
static void choose_mode(watch *wt)
{
    const char *no_color = getenv("NO_COLOR");
    struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = SA_RESETHAND};

    wt->mode = wt->o->json ? W_JSON : isatty(STDOUT_FILENO) ? W_BAR : W_PLAIN;
    wt->color = wt->mode == W_BAR && (no_color == NULL || no_color[0] == '\0');
    if (wt->mode == W_BAR) {
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
    }
}

int tc_watch(const tc_opts *o)
{
    watch wt = {.o = o, .loss = NAN, .sps = NAN, .epoch = NAN, .shown_step = -1};
    int rc;

    choose_mode(&wt);
    if ((rc = tc_conn_open(&wt.c, o->socket)) != TC_OK || (rc = fetch_status(&wt)) != TC_OK ||
        (rc = send_watch(&wt)) != TC_OK)
        goto out;
    if (wt.mode == W_BAR)
        draw(&wt);
    rc = follow(&wt);
out:
    if (tc_line_open) {
        fputc('\n', stdout);
        tc_line_open = 0;
    }
    tc_conn_close(wt.c);
    return rc;
}
