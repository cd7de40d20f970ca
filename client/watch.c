/* trainctl watch: follows one job until it ends. It asks for the job's status first (the
 * spec gives the epoch count, batch size, step limit and evaluation schedule the bars use),
 * then sends `watch` and handles the rows, state and end frames that follow. Three ways to
 * show them: two live bars on a terminal (train and valid), redrawn at most TC_REDRAW_S apart,
 * with each evaluation also printed above them as a permanent line; for a pipe, one line per
 * step as llm.c prints it (`step 12/300 | loss 2.31 | 86.2 ms | 5,930 tok/s | ETA 25s`), one
 * per evaluation and one per change of state; one JSON object per row with --json. The ETA and
 * ms/step come from exponential moving averages of the rows' own times: the seconds a step
 * takes, and apart from them the pause each evaluation makes, so that neither the last step
 * alone nor its compute time (samples_per_s leaves out the data, the store and the
 * evaluations) decides it. */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "common/td_clock.h"

#define TC_BAR_WIDTH    20         /* characters of a bar itself */
#define TC_BAR_MIN_COLS 40         /* narrower terminals get the text without the bars */
#define TC_REDRAW_S     0.1        /* seconds between two redraws of the bars, at least */
#define TC_STEP_ALPHA   0.1        /* the step time's moving average: about 20 steps */
#define TC_EVAL_ALPHA   0.5        /* the evaluation pause's: the last few */
#define TC_RATE_WARMUP  8          /* step samples before an outlier may be left out */
#define TC_PAUSE_FACTOR 20.0       /* a step 20x the average is a pause (a requeue, a full disk) */
#define TC_LINE_MAX     512        /* bytes of a bar's text or an evaluation line */
#define TC_PENDING_MAX  4096       /* bytes of evaluation lines waiting for the next redraw */
#define TC_DEFAULT_COLS 80         /* terminal width when it cannot be asked */
#define TC_GREEN        "\033[32m" /* the filled part of the train bar */
#define TC_CYAN         "\033[36m" /* the filled part of the valid bar */
#define TC_RESET        "\033[0m"
#define TC_CLEAR_LINE   "\r\033[2K"
#define TC_UP_CLEAR     "\033[1A\033[2K" /* up one line, and clear it */

enum { W_BAR, W_PLAIN, W_JSON };

/* What a plain line of one step gathers (W_PLAIN), each part once its row has come. */
enum { P_LOSS = 1, P_MS = 2, P_RATE = 4, P_MFU = 8, P_SKIP = 16 };

typedef struct plain_line {
    int64_t step; /* -1: nothing gathered */
    int have;     /* P_* */
    double loss, ms, rate, mfu;
    int tokens;             /* rate is tokens_per_s, not samples_per_s */
    int expect;             /* the parts the previous step's line had */
    char eval[TC_LINE_MAX]; /* the step's evaluation, "step 25/300 | valid_loss 2.1" */
    size_t evallen;         /* 0: none gathered */
    int64_t eval_step;
} plain_line;

typedef struct watch {
    const tc_opts *o;
    tc_conn *c;
    int mode, color;
    char state[24];
    int64_t step, total;
    int64_t epochs, batch;   /* from the spec; 0 when it does not say */
    int64_t max_steps;       /* from the spec; -1 when it does not say */
    int64_t eval_every;      /* from the spec; 0: at each epoch's end */
    int64_t steps_per_epoch; /* from the spec or the epoch rows; 0 until known */
    int has_test;            /* the job evaluates (and the watch asked for those rows) */
    double started, ended;   /* unix seconds; 0 when not yet */
    double loss, epoch;      /* latest train_loss, epoch; NAN until seen */
    int64_t rate_step;       /* the step of the last step sample; -1 before the first */
    double rate_time;        /* its row's time */
    double pause;            /* the evaluation pause after it (its evaluation rows' time) */
    double step_s;           /* moving average of seconds per step; NAN until measured */
    int nrate;               /* step samples in step_s */
    double eval_s;           /* moving average of an evaluation's pause; 0 until measured */
    int neval;
    plain_line pl;
    double drawn_at;              /* monotonic seconds of the last draw */
    int dirty;                    /* the bars show less than is known */
    int nlines;                   /* bar lines now on the screen: 0, 1 or 2 */
    char eval[TC_LINE_MAX];       /* evaluation results of one step, gathered */
    size_t evallen;               /* bytes in eval; 0 when nothing is gathered */
    int64_t eval_step;            /* the step they are of */
    char last[TC_LINE_MAX];       /* the valid bar: the last evaluation's "key value" pairs */
    size_t lastlen;               /* bytes in last */
    int64_t last_step;            /* its step; -1 before the first */
    char pending[TC_PENDING_MAX]; /* evaluation lines to print above the bars at the next draw */
    size_t npending;
    char shown_state[24]; /* plain mode: the last state line printed */
    int64_t shown_step, shown_total;
} watch;

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

/* ---- what the bars know ---- */

/* Steps per second, from the moving average of the steps' times; NAN until measured. */
static double steps_per_s(const watch *wt)
{
    return wt->nrate > 0 && wt->step_s > 0 ? 1.0 / wt->step_s : NAN;
}

/* A step's row came at time t (step, its first row): the seconds since the last one, less the
 * evaluation pause that followed it, over the steps between, go into the step time's average
 * (a jump of k steps weighs as k samples), and the pause into the evaluation's. A step that
 * took TC_PAUSE_FACTOR times the average is a pause of the job's, not its pace: left out. */
static void step_sample(watch *wt, int64_t step, double t)
{
    double dt, x, w;
    int64_t k = step - wt->rate_step;

    if (wt->rate_step >= 0 && k > 0) {
        if (wt->pause > 0) {
            wt->eval_s =
                wt->neval == 0 ? wt->pause : wt->eval_s + TC_EVAL_ALPHA * (wt->pause - wt->eval_s);
            wt->neval++;
        }
        dt = t - wt->rate_time - wt->pause;
        x = dt / (double)k;
        if (dt > 0 && !(wt->nrate >= TC_RATE_WARMUP && x > TC_PAUSE_FACTOR * wt->step_s)) {
            w = 1.0 - pow(1.0 - TC_STEP_ALPHA, (double)k);
            wt->step_s = wt->nrate == 0 ? x : wt->step_s + w * (x - wt->step_s);
            wt->nrate++;
        }
    }
    wt->rate_step = step;
    wt->rate_time = t;
    wt->pause = 0;
}

/* Steps between two evaluations: eval_every, else an epoch; 0 while that is not known. */
static int64_t eval_period(const watch *wt)
{
    return wt->eval_every > 0 ? wt->eval_every : wt->steps_per_epoch;
}

/* Evaluations still to come after step: one per period, and always one at the last step. */
static int64_t evals_left(const watch *wt)
{
    int64_t p = eval_period(wt), n;

    if (!wt->has_test || wt->total <= wt->step)
        return 0;
    if (p <= 0)
        return 1;
    n = wt->total / p - wt->step / p;
    return n + (wt->total % p != 0);
}

/* Seconds left: the steps at the averaged rate, plus the evaluations the schedule still holds
 * at their averaged pause. NAN while the rate is not known. */
static double eta_s(const watch *wt)
{
    double rate = steps_per_s(wt);

    if (!(rate > 0) || wt->total <= wt->step)
        return NAN;
    return (double)(wt->total - wt->step) / rate + (double)evals_left(wt) * wt->eval_s;
}

/* Seconds since the job started, up to its end when it has ended. */
static double elapsed_s(const watch *wt)
{
    double end = wt->ended > 0 ? wt->ended : tc_now_real();

    return wt->started > 0 && end > wt->started ? end - wt->started : NAN;
}

static int term_cols(void)
{
    struct winsize ws;

    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0)
        return ws.ws_col;
    return TC_DEFAULT_COLS;
}

/* ---- drawing ---- */

/* "epoch 2/3", or "epoch 2.50" for a fractional one. */
static void epoch_text(const watch *wt, char *buf, size_t size, size_t *n)
{
    int64_t of = wt->epochs;

    if (!isfinite(wt->epoch))
        return;
    if (of <= 0 && wt->steps_per_epoch > 0 && wt->total > 0)
        of = (wt->total + wt->steps_per_epoch - 1) / wt->steps_per_epoch;
    if (wt->epoch == floor(wt->epoch))
        add(buf, size, n, "  epoch %.0f", wt->epoch);
    else
        add(buf, size, n, "  epoch %.2f", wt->epoch);
    if (of > 0)
        add(buf, size, n, "/%lld", (long long)of);
}

/* The train bar's text: step/total, percent, elapsed, ETA, loss, s/step, epoch, state. */
static void train_text(const watch *wt, char *buf, size_t size)
{
    int running = strcmp(wt->state, "running") == 0;
    double rate = steps_per_s(wt), eta = eta_s(wt), el = elapsed_s(wt);
    char d[32];
    size_t n = 0;

    buf[0] = '\0';
    if (wt->total > 0)
        add(buf, size, &n, " %lld/%lld  %d%%", (long long)wt->step, (long long)wt->total,
            (int)(100 * (wt->step < wt->total ? wt->step : wt->total) / wt->total));
    else
        add(buf, size, &n, " step %lld", (long long)wt->step);
    if (isfinite(el)) {
        tc_fmt_duration(d, sizeof(d), el);
        add(buf, size, &n, "  elapsed %s", d);
    }
    if (running && isfinite(eta)) {
        tc_fmt_duration(d, sizeof(d), eta);
        add(buf, size, &n, "  ETA %s", d);
    }
    if (isfinite(wt->loss))
        add(buf, size, &n, "  loss %.4g", wt->loss);
    if (running && rate >= 1) /* a fast step reads better in ms than as 0.000631 s */
        add(buf, size, &n, "  %.3g ms/step", 1000 / rate);
    else if (running && rate > 0)
        add(buf, size, &n, "  %.3g s/step", 1 / rate);
    epoch_text(wt, buf, size, &n);
    if (!running)
        add(buf, size, &n, "  %s", wt->state);
}

/* The valid bar's text: the last evaluation and its step, and where the next one falls. */
static void valid_text(const watch *wt, char *buf, size_t size, int64_t next)
{
    size_t n = 0;

    buf[0] = '\0';
    if (wt->last_step >= 0)
        add(buf, size, &n, " step %lld: %s", (long long)wt->last_step, wt->last);
    else
        add(buf, size, &n, " no evaluation yet");
    if (next > wt->step && strcmp(wt->state, "running") == 0)
        add(buf, size, &n, "  (next at step %lld)", (long long)next);
}

/* How full the valid bar is (0..1): the way from the last scheduled evaluation to the next,
 * which *next is set to (0 when the schedule is not known). */
static double valid_fill(const watch *wt, int64_t *next)
{
    int64_t p = eval_period(wt), prev = p > 0 ? wt->step / p * p : 0;

    *next = p > 0 ? prev + p : wt->total;
    if (wt->total > 0 && *next > wt->total)
        *next = wt->total;
    if (wt->total > 0 && wt->step >= wt->total)
        return 1;
    if (*next <= prev || (p <= 0 && wt->total <= 0))
        return 0;
    return (double)(wt->step - prev) / (double)(*next - prev);
}

/* One bar line: "label [####------] text", cut to cols - 1 characters so it never wraps (the
 * text is ASCII, so bytes are characters); without the bar on a narrow terminal. */
static void bar_line(const watch *wt, const char *label, double fill, const char *color,
                     const char *text, int cols)
{
    char bar[TC_BAR_WIDTH + 1];
    int k = (int)(TC_BAR_WIDTH * (fill < 0 ? 0 : fill > 1 ? 1 : fill));
    int room = cols - 1 - (int)strlen(label) - (cols < TC_BAR_MIN_COLS ? 0 : TC_BAR_WIDTH + 3);

    if (room < 0)
        room = 0;
    if (cols < TC_BAR_MIN_COLS) {
        printf("%s%.*s", label, room, text);
        return;
    }
    memset(bar, '#', (size_t)k);
    memset(bar + k, '-', (size_t)(TC_BAR_WIDTH - k));
    bar[TC_BAR_WIDTH] = '\0';
    if (wt->color)
        printf("%s [%s%.*s" TC_RESET "%s]%.*s", label, color, k, bar, bar + k, room, text);
    else
        printf("%s [%s]%.*s", label, bar, room, text);
}

/* Clears the bars from the screen, leaving the cursor at the start of the first one's line. */
static void clear_bars(watch *wt)
{
    if (wt->nlines > 0)
        fputs(TC_CLEAR_LINE, stdout);
    if (wt->nlines > 1)
        fputs(TC_UP_CLEAR, stdout);
    wt->nlines = 0;
    tc_line_open = 0;
}

/* Redraws: the evaluation lines gathered since the last draw go above, then the bars. */
static void draw(watch *wt)
{
    char text[TC_LINE_MAX];
    int cols = term_cols();
    int64_t next = 0;
    double fill;

    clear_bars(wt);
    fwrite(wt->pending, 1, wt->npending, stdout);
    wt->npending = 0;
    train_text(wt, text, sizeof(text));
    bar_line(wt, "train", wt->total > 0 ? (double)wt->step / (double)wt->total : 0, TC_GREEN, text,
             cols);
    wt->nlines = 1;
    if (wt->has_test) {
        fill = valid_fill(wt, &next);
        valid_text(wt, text, sizeof(text), next);
        fputc('\n', stdout);
        bar_line(wt, "valid", fill, TC_CYAN, text, cols);
        wt->nlines = 2;
    }
    fflush(stdout);
    tc_line_open = 1;
    wt->drawn_at = td_mono_ms() / 1e3;
    wt->dirty = 0;
}

/* Moves the gathered evaluation results to the lines printed above the bars at the next draw
 * (at once when too many wait, which only an evaluation at every step could cause). */
static void flush_eval(watch *wt)
{
    if (wt->evallen == 0)
        return;
    if (wt->npending + wt->evallen + 2 > sizeof(wt->pending))
        draw(wt);
    add(wt->pending, sizeof(wt->pending), &wt->npending, "%s\n", wt->eval);
    wt->evallen = 0;
    wt->dirty = 1;
}

/* Gathers an evaluation row into the line for its step, and into the valid bar's text. */
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
    if (wt->last_step != r->step) {
        wt->last_step = r->step;
        wt->lastlen = 0;
    }
    add(wt->last, sizeof(wt->last), &wt->lastlen, "%s%.*s %s", wt->lastlen ? "  " : "",
        (int)r->keylen, r->key, val);
}

/* ---- rows and frames ---- */

static int row_is(const tc_row *r, const char *key)
{
    return r->keylen == strlen(key) && memcmp(r->key, key, r->keylen) == 0;
}

/* What an evaluation row tells: that the job evaluates, and (after the step's own rows) how
 * long its evaluation paused it. */
static void track_eval(watch *wt, const tc_row *r)
{
    wt->has_test = 1;
    if (r->step == wt->rate_step && r->time - wt->rate_time > wt->pause)
        wt->pause = r->time - wt->rate_time;
}

/* The epoch row comes at each epoch's first step, so epoch e >= 2 at step s means epochs of
 * (s - 1) / (e - 1) steps. */
static void track_epoch(watch *wt, const tc_row *r)
{
    wt->epoch = r->value;
    if (wt->steps_per_epoch == 0 && r->value >= 2 && r->value == floor(r->value) && r->step > 1)
        wt->steps_per_epoch = (r->step - 1) / ((int64_t)r->value - 1);
}

/* Keeps what the bars show up to date with one row. */
static void track(watch *wt, const tc_row *r)
{
    int eval = tc_is_eval_key(r->key, r->keylen);

    if (row_is(r, "train_loss"))
        wt->loss = r->value;
    else if (row_is(r, "epoch"))
        track_epoch(wt, r);
    else if (eval)
        track_eval(wt, r);
    if (!eval && r->step > wt->rate_step)
        step_sample(wt, r->step, r->time);
    if (r->step > wt->step)
        wt->step = r->step;
    wt->dirty = 1;
}

/* ---- a pipe's lines ---- */

/* v rounded, with a comma every three digits: 5930.4 is "5,930". */
static void fmt_thousands(char *buf, size_t size, double v)
{
    char digits[32];
    size_t n = 0, len;
    int k = snprintf(digits, sizeof(digits), "%.0f", fabs(v) < 1e18 ? fabs(v) : 1e18);

    len = k > 0 ? (size_t)k : 0;
    buf[0] = '\0';
    if (v <= -0.5)
        add(buf, size, &n, "-");
    for (size_t i = 0; i < len; i++) {
        add(buf, size, &n, "%c", digits[i]);
        if ((len - 1 - i) % 3 == 0 && i + 1 < len)
            add(buf, size, &n, ",");
    }
}

/* "step 12/300", or "step 12" while the total is not known. */
static void step_text(const watch *wt, int64_t step, char *buf, size_t size, size_t *n)
{
    if (wt->total > 0)
        add(buf, size, n, "step %lld/%lld", (long long)step, (long long)wt->total);
    else
        add(buf, size, n, "step %lld", (long long)step);
}

/* Prints the line of the step gathered in wt->pl, if it holds any of a line's parts. */
static void plain_flush_train(watch *wt)
{
    plain_line *pl = &wt->pl;
    char line[TC_LINE_MAX], num[40];
    double eta = eta_s(wt);
    size_t n = 0;

    if (pl->step >= 0 && pl->have != 0) {
        step_text(wt, pl->step, line, sizeof(line), &n);
        if (pl->have & P_LOSS)
            add(line, sizeof(line), &n, " | loss %.4g", pl->loss);
        else if (pl->have & P_SKIP)
            add(line, sizeof(line), &n, " | loss not finite (step skipped)");
        if (pl->have & P_MS)
            add(line, sizeof(line), &n, " | %.1f ms", pl->ms);
        if (pl->have & P_RATE) {
            fmt_thousands(num, sizeof(num), pl->rate);
            add(line, sizeof(line), &n, " | %s %s", num, pl->tokens ? "tok/s" : "samples/s");
        }
        if (pl->have & P_MFU)
            add(line, sizeof(line), &n, " | %.1f%% MFU", 100 * pl->mfu);
        if (strcmp(wt->state, "running") == 0 && isfinite(eta)) {
            tc_fmt_duration(num, sizeof(num), eta);
            add(line, sizeof(line), &n, " | ETA %s", num);
        }
        puts(line);
        pl->expect = pl->have;
    }
    pl->have = 0;
    pl->step = -1;
}

static void plain_flush_eval(watch *wt)
{
    if (wt->pl.evallen > 0)
        puts(wt->pl.eval);
    wt->pl.evallen = 0;
}

/* Flushes what is gathered: the step's line, then its evaluation's. */
static void plain_flush(watch *wt)
{
    plain_flush_train(wt);
    plain_flush_eval(wt);
}

/* Gathers a row into its step's line, or its evaluation's; a line is printed once a row of
 * another step (or the evaluation after it) shows that it is complete. */
static void plain_row(watch *wt, const tc_row *r)
{
    plain_line *pl = &wt->pl;
    int eval = tc_is_eval_key(r->key, r->keylen);

    if (pl->step >= 0 && (r->step != pl->step || eval))
        plain_flush_train(wt);
    if (pl->evallen > 0 && (r->step != pl->eval_step || !eval))
        plain_flush_eval(wt);
    if (eval) {
        if (pl->evallen == 0) {
            pl->eval_step = r->step;
            step_text(wt, r->step, pl->eval, sizeof(pl->eval), &pl->evallen);
        }
        add(pl->eval, sizeof(pl->eval), &pl->evallen, " | %.*s %.4g", (int)r->keylen, r->key,
            r->value);
        return;
    }
    pl->step = r->step;
    if (row_is(r, "train_loss")) {
        pl->loss = r->value;
        pl->have |= P_LOSS;
    } else if (row_is(r, "nan_skipped")) {
        pl->have |= P_SKIP;
    } else if (row_is(r, "step_ms")) {
        pl->ms = r->value;
        pl->have |= P_MS;
    } else if (row_is(r, "tokens_per_s") || row_is(r, "samples_per_s")) {
        pl->rate = r->value;
        pl->tokens = row_is(r, "tokens_per_s");
        pl->have |= P_RATE;
    } else if (row_is(r, "mfu")) {
        pl->mfu = r->value;
        pl->have |= P_MFU;
    }
}

static void on_row(watch *wt, const tc_row *r)
{
    track(wt, r);
    if (wt->mode == W_JSON) {
        tc_row_json(stdout, wt->o->job, r);
        fputc('\n', stdout);
    } else if (wt->mode == W_PLAIN) {
        plain_row(wt, r);
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

/* Takes state, step and total_steps from a state frame or a JOB map, and the start and end
 * times from a JOB map. A job seen to start running without a known start time started now. */
static void take_state(watch *wt, const td_pval *m)
{
    char state[sizeof(wt->state)];

    tc_job_str(m, "state", state, sizeof(state));
    if (state[0] != '\0')
        memcpy(wt->state, state, sizeof(state));
    wt->step = tc_job_int(m, "step", wt->step);
    wt->total = tc_job_int(m, "total_steps", wt->total);
    wt->started = tc_job_double(m, "started", wt->started);
    wt->ended = tc_job_double(m, "ended", wt->ended);
    if (wt->started <= 0 && strcmp(wt->state, "running") == 0)
        wt->started = tc_now_real();
    if (wt->epochs > 0 && wt->max_steps < 0 && wt->total > 0 && wt->total % wt->epochs == 0)
        wt->steps_per_epoch = wt->total / wt->epochs;
    wt->dirty = 1;
}

/* A state frame: in plain mode, the step's line once it has the parts the last one had (its
 * rows may come in more than one frame), and a line when the state changed. */
static void on_state(watch *wt, const td_pval *root)
{
    take_state(wt, root);
    if (wt->mode != W_PLAIN)
        return;
    if (wt->pl.step >= 0 && (wt->pl.have & wt->pl.expect) == wt->pl.expect)
        plain_flush_train(wt);
    if (strcmp(wt->state, wt->shown_state) == 0)
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
    if (wt->mode == W_PLAIN)
        plain_flush(wt);
    if (wt->mode == W_BAR) {
        draw(wt);
        fputc('\n', stdout);
        tc_line_open = 0;
        wt->nlines = 0;
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

/* How long the next wait may last: until the bars are due for a redraw. While the job runs
 * they are redrawn at least every second, so that elapsed time moves between rows. */
static int wait_ms(const watch *wt)
{
    double left;

    if (wt->mode != W_BAR)
        return -1;
    left = wt->drawn_at + (wt->dirty ? TC_REDRAW_S : 1.0) - td_mono_ms() / 1e3;
    return left > 0 ? (int)ceil(left * 1000) : 0;
}

static int follow(watch *wt)
{
    td_proto_frame *f = NULL;
    int rc = TC_OK, done = 0;

    while (rc == TC_OK && !done) {
        if (wt->mode == W_BAR && wait_ms(wt) == 0)
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

/* Nonzero when the comma-separated list names an evaluation metric. */
static int keys_have_eval(const char *keys)
{
    const char *p, *end;

    for (p = keys; *p != '\0'; p = *end != '\0' ? end + 1 : end) {
        end = strchrnul(p, ',');
        if (tc_is_eval_key(p, (size_t)(end - p)))
            return 1;
    }
    return 0;
}

/* What the spec says about the schedule: epochs, batch size, step limit, evaluations. */
static void take_spec(watch *wt, const td_pval *spec)
{
    const td_pval *data = td_pv_get(spec, "data");

    wt->epochs = tc_job_int(spec, "epochs", 1); /* README: the default is 1 */
    wt->batch = tc_job_int(spec, "batch_size", 0);
    wt->max_steps = tc_job_int(spec, "max_steps", -1);
    wt->eval_every = tc_job_int(spec, "eval_every", 0);
    /* an idx job's test split, a text job's valid_fraction, a sensor job's valid shards */
    wt->has_test =
        (td_pv_type_of(td_pv_get(data, "test")) == TD_PV_MAP || td_pv_get(data, "valid") != NULL ||
         tc_job_double(data, "valid_fraction", 0) > 0) &&
        (wt->o->keys == NULL || keys_have_eval(wt->o->keys));
}

/* Asks for the job's status: where it stands, and from its spec the schedule. */
static int fetch_status(watch *wt)
{
    td_proto_frame *f = NULL;
    const td_pval *job;
    int rc = tc_conn_job_request(wt->c, "status", wt->o->job, "job", &f);

    if (rc != TC_OK)
        return rc;
    job = td_pv_get(td_proto_frame_root(f), "job");
    take_spec(wt, td_pv_get(job, "spec"));
    take_state(wt, job);
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

/* The way to show the job: --json, else live bars on a terminal, else plain lines. On a
 * terminal, Ctrl-C ends the watch cleanly (the bars are finished) once; a second one kills. */
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
    watch wt = {.o = o,
                .loss = NAN,
                .epoch = NAN,
                .shown_step = -1,
                .max_steps = -1,
                .last_step = -1,
                .eval_step = -1,
                .rate_step = -1,
                .step_s = NAN,
                .pl = {.step = -1, .expect = P_LOSS | P_MS | P_RATE}};
    int rc;

    choose_mode(&wt);
    if ((rc = tc_conn_open(&wt.c, o->socket)) != TC_OK || (rc = fetch_status(&wt)) != TC_OK ||
        (rc = send_watch(&wt)) != TC_OK)
        goto out;
    if (wt.mode == W_BAR)
        draw(&wt);
    rc = follow(&wt);
    if (wt.mode == W_PLAIN)
        plain_flush(&wt);
    if (wt.mode == W_BAR && tc_line_open)
        draw(&wt); /* interrupted: the evaluations still waiting are printed too */
out:
    if (tc_line_open) {
        fputc('\n', stdout);
        tc_line_open = 0;
    }
    tc_conn_close(wt.c);
    return rc;
}
