/* trainctl plot: draws metrics of one or more jobs against step on one chart, with cairo, as a
 * PNG (an image surface written with write_to_png) or an SVG (cairo's SVG surface). It asks
 * traind for each job's status (its name, and whether it exists) and its rows (the `metrics`
 * request), keeps every finite (step, value) pair per (job, key) series, then lays out the
 * chart: a title, a plot area with grid lines, tick labels and axis titles, one colour per
 * series, and a legend to the right of the plot area. Nothing is written until every row is in,
 * so a refused request never leaves a half-made file behind. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cairo-svg.h>
#include <cairo.h>

#include "client.h"

#define TC_PLOT_W            1200 /* chart width: pixels (PNG) or points (SVG) */
#define TC_PLOT_H            700  /* chart height, the same units */
#define TC_PLOT_MARGIN       24.0 /* around everything, same units */
#define TC_PLOT_MAX_SERIES   30   /* (job, key) series on one chart: what the legend can hold */
#define TC_PLOT_TICKS        7    /* about how many ticks an axis gets */
#define TC_PLOT_MARKER_MAX   60   /* series with at most this many points get a dot per point */
#define TC_PLOT_SMOOTH_MIN   200  /* series with more points get a smoothed line over them */
#define TC_PLOT_TITLE_ID_MAX 8    /* job ids named in the title before "..." */
#define TC_PLOT_DEFAULT_KEYS "train_loss,test_loss,valid_loss,val_loss"
#define TC_FONT              "sans-serif"

/* One colour per series, in order: matplotlib's tab10, made to stay apart on white. */
static const double palette[][3] = {
    {0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173}, {0.839, 0.153, 0.157},
    {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294}, {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498},
    {0.737, 0.741, 0.133}, {0.090, 0.745, 0.812},
};
#define NCOLORS (sizeof(palette) / sizeof(palette[0]))

typedef struct point {
    double x, y; /* step, value */
} point;

/* The rows of one key of one job, in step order. */
typedef struct series {
    int64_t job;
    size_t job_rank, key_rank; /* the job's place among JOB arguments, the key's in --keys */
    char *key;
    point *pts;
    size_t n, cap;
} series;

typedef struct plot {
    const tc_opts *o;
    const char *keys; /* the keys asked for, "a,b" */
    series *s;
    size_t ns;
    char title[512], ytitle[64];
    double x0, x1, y0, y1;           /* what the axes span, in steps and values */
    double left, top, right, bottom; /* the plot area on the surface */
    double legend_x, legend_w;
} plot;

/* What a metrics stream is being read for. */
typedef struct fetch {
    plot *p;
    int64_t job;
    size_t job_rank;
} fetch;

/* ---- reading the rows ---- */

/* The place of key in the comma-separated list, or the list's length when it is absent. */
static size_t key_rank(const char *keys, const char *key, size_t len)
{
    const char *p = keys, *end;
    size_t rank = 0;

    for (; *p != '\0'; p = *end != '\0' ? end + 1 : end, rank++) {
        end = strchrnul(p, ',');
        if ((size_t)(end - p) == len && memcmp(p, key, len) == 0)
            break;
    }
    return rank;
}

/* The series of (f->job, key), made when it is the first row of it. */
static int find_series(fetch *f, const tc_row *r, series **out)
{
    plot *p = f->p;
    series *s;
    size_t i;

    for (i = 0; i < p->ns; i++) {
        s = &p->s[i];
        if (s->job == f->job && strlen(s->key) == r->keylen &&
            memcmp(s->key, r->key, r->keylen) == 0) {
            *out = s;
            return TC_OK;
        }
    }
    if (p->ns == TC_PLOT_MAX_SERIES)
        return tc_err(TC_USAGE,
                      "more than %d series (job and key pairs) to draw on one chart; "
                      "name fewer jobs or --keys",
                      TC_PLOT_MAX_SERIES);
    s = &p->s[p->ns];
    *s = (series){.job = f->job, .job_rank = f->job_rank};
    s->key_rank = key_rank(p->keys, r->key, r->keylen);
    if ((s->key = strndup(r->key, r->keylen)) == NULL)
        return tc_err(TC_FAILED, "out of memory");
    p->ns++;
    *out = s;
    return TC_OK;
}

/* Keeps one row; values that are not finite have no place on a chart and are left out. */
static int on_row(void *ud, const tc_row *r)
{
    series *s = NULL;
    point *pts;
    int rc;

    if (!isfinite(r->value))
        return TC_OK;
    if ((rc = find_series(ud, r, &s)) != TC_OK)
        return rc;
    if (s->n == s->cap) {
        pts = realloc(s->pts, (s->cap ? 2 * s->cap : 256) * sizeof(*pts));
        if (pts == NULL)
            return tc_err(TC_FAILED, "out of memory");
        s->pts = pts;
        s->cap = s->cap ? 2 * s->cap : 256;
    }
    s->pts[s->n++] = (point){(double)r->step, r->value};
    return TC_OK;
}

/* Adds the job to the title: its name when it is the only job, else its id. */
static void title_add(plot *p, size_t rank, int64_t job, const char *name)
{
    size_t n = strlen(p->title), size = sizeof(p->title);

    if (p->o->njobs == 1)
        snprintf(p->title, size, "%s%sjob %lld", name, name[0] ? " \xe2\x80\x94 " : "",
                 (long long)job);
    else if (rank == 0)
        snprintf(p->title, size, "jobs %lld", (long long)job);
    else if (rank < TC_PLOT_TITLE_ID_MAX)
        snprintf(p->title + n, size - n, ", %lld", (long long)job);
    else if (rank == TC_PLOT_TITLE_ID_MAX)
        snprintf(p->title + n, size - n, ", ...");
}

/* The job's status (for its name) and then its rows. */
static int fetch_job(tc_conn *c, plot *p, size_t rank)
{
    fetch f = {.p = p, .job = p->o->jobs[rank], .job_rank = rank};
    td_proto_frame *st = NULL;
    char name[256];
    size_t before;
    int rc = tc_conn_job_request(c, "status", f.job, "job", &st);

    if (rc != TC_OK)
        return rc;
    tc_job_str(td_pv_get(td_proto_frame_root(st), "job"), "name", name, sizeof(name));
    td_proto_frame_free(st);
    title_add(p, rank, f.job, name);
    before = p->ns;
    rc = tc_conn_metrics(c, f.job, p->keys, on_row, &f);
    if (rc == TC_OK && p->ns == before && p->o->njobs > 1)
        tc_err(TC_OK, "job %lld has no finite values of %s; the chart leaves it out",
               (long long)f.job, p->keys);
    return rc;
}

static int by_job_then_key(const void *a, const void *b)
{
    const series *x = a, *y = b;

    if (x->job_rank != y->job_rank)
        return x->job_rank < y->job_rank ? -1 : 1;
    if (x->key_rank != y->key_rank)
        return x->key_rank < y->key_rank ? -1 : 1;
    return strcmp(x->key, y->key);
}

/* Every job's rows, in series sorted by job (as named) and key (as listed). */
static int fetch_all(plot *p)
{
    tc_conn *c = NULL;
    size_t i;
    int rc = tc_conn_open(&c, p->o->socket);

    for (i = 0; rc == TC_OK && i < p->o->njobs; i++)
        rc = fetch_job(c, p, i);
    tc_conn_close(c);
    if (rc == TC_OK && p->ns == 0)
        rc = tc_err(TC_FAILED, "nothing to plot: no finite values of %s in the job%s named",
                    p->keys, p->o->njobs > 1 ? "s" : "");
    if (rc == TC_OK)
        qsort(p->s, p->ns, sizeof(*p->s), by_job_then_key);
    return rc;
}

/* ---- scales and ticks ---- */

/* Ticks at round numbers (1, 2 or 5 times a power of ten) across [lo, hi]. */
typedef struct ticks {
    double first, step;
    int n, decimals, kilo;
} ticks;

/* min_step: 1 for steps, which are whole numbers; 0 for values. */
static void make_ticks(ticks *t, double lo, double hi, double min_step)
{
    double raw = (hi - lo) / TC_PLOT_TICKS, mag = pow(10, floor(log10(raw))), norm = raw / mag;

    t->step = fmax(min_step, (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag);
    t->first = ceil(lo / t->step - 1e-9) * t->step;
    t->n = (int)floor((hi - t->first) / t->step + 1e-9) + 1;
    t->decimals = t->step >= 1 ? 0 : (int)ceil(-log10(t->step) - 1e-9);
    t->kilo = t->step >= 1000 && fmod(t->step, 1000) == 0; /* 25k rather than 25000 */
}

static void tick_label(const ticks *t, int i, char *buf, size_t size)
{
    double v = t->first + i * t->step;

    if (fabs(v) < t->step * 1e-6)
        v = 0; /* not -0.000 */
    if (t->kilo && v != 0)
        snprintf(buf, size, "%.0fk", v / 1000);
    else
        snprintf(buf, size, "%.*f", t->decimals, v);
}

/* The ranges the axes span: every point, values padded by 5% so no line runs on the frame. */
static void data_ranges(plot *p)
{
    double pad;
    size_t i, j;

    p->x0 = p->y0 = INFINITY;
    p->x1 = p->y1 = -INFINITY;
    for (i = 0; i < p->ns; i++) {
        for (j = 0; j < p->s[i].n; j++) {
            p->x0 = fmin(p->x0, p->s[i].pts[j].x);
            p->x1 = fmax(p->x1, p->s[i].pts[j].x);
            p->y0 = fmin(p->y0, p->s[i].pts[j].y);
            p->y1 = fmax(p->y1, p->s[i].pts[j].y);
        }
    }
    if (p->x0 > 0 && p->x0 <= 0.2 * (p->x1 - p->x0))
        p->x0 = 0; /* a run that starts at step 1 reads better from 0 */
    if (p->x1 - p->x0 < 1) {
        p->x0 -= 1;
        p->x1 += 1;
    }
    pad = p->y1 > p->y0 ? 0.05 * (p->y1 - p->y0) : p->y0 != 0 ? fabs(p->y0) * 0.1 : 1;
    p->y0 -= pad;
    p->y1 += pad;
}

/* The y axis's title: the key when there is one, or what all the keys measure. */
static void y_title(plot *p)
{
    int one = 1, loss = 1, acc = 1;
    size_t i, len;

    for (i = 0; i < p->ns; i++) {
        len = strlen(p->s[i].key);
        one &= strcmp(p->s[i].key, p->s[0].key) == 0;
        loss &= len >= 4 && strcmp(p->s[i].key + len - 4, "loss") == 0;
        acc &= len >= 8 && strcmp(p->s[i].key + len - 8, "accuracy") == 0;
    }
    snprintf(p->ytitle, sizeof(p->ytitle), "%s",
             one    ? p->s[0].key
             : loss ? "loss"
             : acc  ? "accuracy"
                    : "value");
}

static double px(const plot *p, double x)
{
    return p->left + (x - p->x0) / (p->x1 - p->x0) * (p->right - p->left);
}

static double py(const plot *p, double y)
{
    return p->bottom - (y - p->y0) / (p->y1 - p->y0) * (p->bottom - p->top);
}

/* A coordinate on the middle of a pixel, so that a 1-unit line is one sharp pixel wide. */
static double crisp(double v)
{
    return floor(v) + 0.5;
}

/* ---- drawing ---- */

static void set_color(cairo_t *cr, const double *rgb)
{
    cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
}

static void set_font(cairo_t *cr, double size, int bold)
{
    cairo_select_font_face(cr, TC_FONT, CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, size);
}

static double text_width(cairo_t *cr, const char *s)
{
    cairo_text_extents_t e;

    cairo_text_extents(cr, s, &e);
    return e.x_advance;
}

/* Draws s with its anchor at (x, y): ax 0, 0.5 or 1 puts the left edge, the centre or the right
 * edge there; ay does the same from the font's ascent to its descent, so that labels of one
 * size line up whatever letters they hold. */
static void text_at(cairo_t *cr, double x, double y, const char *s, double ax, double ay)
{
    cairo_font_extents_t fe;

    cairo_font_extents(cr, &fe);
    cairo_move_to(cr, x - text_width(cr, s) * ax, y + fe.ascent - (fe.ascent + fe.descent) * ay);
    cairo_show_text(cr, s);
}

/* The widest y tick label, for the left margin. */
static double y_labels_width(cairo_t *cr, const plot *p)
{
    char label[64];
    double w = 0;
    ticks t;
    int i;

    make_ticks(&t, p->y0, p->y1, 0);
    for (i = 0; i < t.n; i++) {
        tick_label(&t, i, label, sizeof(label));
        w = fmax(w, text_width(cr, label));
    }
    return w;
}

static void legend_label(const series *s, char *buf, size_t size)
{
    snprintf(buf, size, "job %lld %s", (long long)s->job, s->key);
}

/* Places the plot area: room on the left for the y axis's labels and title, below for the x
 * axis's, above for the title, and on the right for the legend. */
static void layout(cairo_t *cr, plot *p)
{
    char label[512];
    double w = 0;
    size_t i;

    set_font(cr, 13, 0);
    for (i = 0; i < p->ns; i++) {
        legend_label(&p->s[i], label, sizeof(label));
        w = fmax(w, text_width(cr, label));
    }
    p->legend_w = fmin(w, TC_PLOT_W / 3.0) + 56; /* padding, the swatch and its gap */
    p->legend_x = TC_PLOT_W - TC_PLOT_MARGIN - p->legend_w;
    p->right = p->legend_x - 20;
    p->top = TC_PLOT_MARGIN + 40;
    p->bottom = TC_PLOT_H - TC_PLOT_MARGIN - 50;
    set_font(cr, 12, 0);
    p->left = TC_PLOT_MARGIN + 26 + y_labels_width(cr, p) + 12;
}

static void draw_x_axis(cairo_t *cr, const plot *p)
{
    char label[64];
    double x;
    ticks t;
    int i;

    make_ticks(&t, p->x0, p->x1, 1);
    set_font(cr, 12, 0);
    for (i = 0; i < t.n; i++) {
        x = crisp(px(p, t.first + i * t.step));
        cairo_set_source_rgb(cr, 0.90, 0.90, 0.90);
        cairo_move_to(cr, x, p->top);
        cairo_line_to(cr, x, p->bottom);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.25, 0.25, 0.25);
        cairo_move_to(cr, x, p->bottom);
        cairo_line_to(cr, x, p->bottom + 5);
        cairo_stroke(cr);
        tick_label(&t, i, label, sizeof(label));
        text_at(cr, x, p->bottom + 8, label, 0.5, 0);
    }
    set_font(cr, 14, 0);
    text_at(cr, (p->left + p->right) / 2, TC_PLOT_H - TC_PLOT_MARGIN, "step", 0.5, 1);
}

static void draw_y_axis(cairo_t *cr, const plot *p)
{
    char label[64];
    double y;
    ticks t;
    int i;

    make_ticks(&t, p->y0, p->y1, 0);
    set_font(cr, 12, 0);
    for (i = 0; i < t.n; i++) {
        y = crisp(py(p, t.first + i * t.step));
        cairo_set_source_rgb(cr, 0.90, 0.90, 0.90);
        cairo_move_to(cr, p->left, y);
        cairo_line_to(cr, p->right, y);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0.25, 0.25, 0.25);
        cairo_move_to(cr, p->left - 5, y);
        cairo_line_to(cr, p->left, y);
        cairo_stroke(cr);
        tick_label(&t, i, label, sizeof(label));
        text_at(cr, p->left - 8, y, label, 1, 0.5);
    }
    set_font(cr, 14, 0);
    cairo_save(cr);
    cairo_translate(cr, TC_PLOT_MARGIN, (p->top + p->bottom) / 2);
    cairo_rotate(cr, -M_PI / 2);
    text_at(cr, 0, 0, p->ytitle, 0.5, 0);
    cairo_restore(cr);
}

/* Moves or draws the path to one point. */
static void path_point(cairo_t *cr, const plot *p, const point *pt, int first)
{
    if (first)
        cairo_move_to(cr, px(p, pt->x), py(p, pt->y));
    else
        cairo_line_to(cr, px(p, pt->x), py(p, pt->y));
}

/* The series as a path. Where several points fall into one pixel column only the column's
 * first, lowest, highest and last points are drawn, in step order: the line looks the same and
 * an SVG of 100,000 steps stays small. */
static void path_series(cairo_t *cr, const plot *p, const series *s)
{
    size_t i = 0, j, lo, hi, pick[4], k;
    double col;

    while (i < s->n) {
        col = floor(px(p, s->pts[i].x));
        lo = hi = i;
        for (j = i; j < s->n && floor(px(p, s->pts[j].x)) == col; j++) {
            lo = s->pts[j].y < s->pts[lo].y ? j : lo;
            hi = s->pts[j].y > s->pts[hi].y ? j : hi;
        }
        pick[0] = i;
        pick[1] = lo < hi ? lo : hi;
        pick[2] = lo < hi ? hi : lo;
        pick[3] = j - 1;
        for (k = 0; k < 4; k++)
            if (k == 0 || pick[k] != pick[k - 1])
                path_point(cr, p, &s->pts[pick[k]], i == 0 && k == 0);
        i = j;
    }
}

/* A point marker in colour rgb, ringed in white so it stands out from the lines under it. */
static void dot(cairo_t *cr, double x, double y, const double *rgb)
{
    cairo_new_sub_path(cr);
    cairo_arc(cr, x, y, 4.4, 0, 2 * M_PI);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_fill(cr);
    cairo_arc(cr, x, y, 3.2, 0, 2 * M_PI);
    set_color(cr, rgb);
    cairo_fill(cr);
}

/* A series with few points (an evaluation's, mostly) is drawn thicker, with a dot per point. */
static int sparse(const series *s)
{
    return s->n <= TC_PLOT_MARKER_MAX;
}

/* A copy of s with each value replaced by the mean over a window of about 1% of its points
 * centred on it (so the line does not lag the way an exponential average does), using prefix
 * sums. Caller frees out->pts; NULL there when there is no memory, and the raw line is all. */
static void smooth(const series *s, series *out)
{
    size_t h = s->n / 200 > 2 ? s->n / 200 : 2, i, lo, hi;
    double *sum = malloc((s->n + 1) * sizeof(*sum));

    *out = *s;
    out->pts = sum != NULL ? malloc(s->n * sizeof(*out->pts)) : NULL;
    for (i = 0; out->pts != NULL && i < s->n; i++)
        sum[i + 1] = (i == 0 ? 0 : sum[i]) + s->pts[i].y;
    for (i = 0; out->pts != NULL && i < s->n; i++) {
        lo = i > h ? i - h : 0;
        hi = i + h < s->n ? i + h + 1 : s->n;
        out->pts[i] = (point){s->pts[i].x, (sum[hi] - (lo ? sum[lo] : 0)) / (double)(hi - lo)};
    }
    free(sum);
}

/* A series has so many points that the raw line is a band of noise: it is drawn faintly, with
 * its smoothed line over it. */
static int dense(const series *s)
{
    return s->n > TC_PLOT_SMOOTH_MIN;
}

static void stroke_series(cairo_t *cr, const plot *p, const series *s, const double *rgb,
                          double alpha, double width)
{
    cairo_set_source_rgba(cr, rgb[0], rgb[1], rgb[2], alpha);
    cairo_set_line_width(cr, width);
    path_series(cr, p, s);
    cairo_stroke(cr);
}

/* One layer of the chart: 0 the raw lines of the series with many points, 1 their smoothed
 * lines, 2 the sparse series with their dots, so that no layer hides a later one. */
static void draw_layer(cairo_t *cr, const plot *p, int layer)
{
    const series *s;
    series sm;
    size_t i, j;

    for (i = 0; i < p->ns; i++) {
        s = &p->s[i];
        if (sparse(s) != (layer == 2) || (layer == 1 && !dense(s)))
            continue;
        if (layer == 0)
            stroke_series(cr, p, s, palette[i % NCOLORS], dense(s) ? 0.22 : 1, 1.4);
        if (layer == 1) {
            smooth(s, &sm);
            if (sm.pts != NULL)
                stroke_series(cr, p, &sm, palette[i % NCOLORS], 1, 2.0);
            free(sm.pts);
        }
        if (layer == 2)
            stroke_series(cr, p, s, palette[i % NCOLORS], 1, 2.2);
        for (j = 0; layer == 2 && j < s->n; j++)
            dot(cr, px(p, s->pts[j].x), py(p, s->pts[j].y), palette[i % NCOLORS]);
    }
}

/* The series, layer by layer. Every point lies inside the axes' ranges; the clip, a marker's
 * radius wider than the plot area, only keeps a stray rounding from painting over the
 * margins. */
static void draw_series(cairo_t *cr, const plot *p)
{
    int layer;

    cairo_save(cr);
    cairo_rectangle(cr, p->left - 5, p->top - 5, p->right - p->left + 10, p->bottom - p->top + 10);
    cairo_clip(cr);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    cairo_set_line_cap(cr, CAIRO_LINE_CAP_ROUND);
    for (layer = 0; layer < 3; layer++)
        draw_layer(cr, p, layer);
    cairo_restore(cr);
}

/* The legend: a framed box right of the plot area, one line per series in drawing order. */
static void draw_legend(cairo_t *cr, const plot *p)
{
    double row = 22, h = p->ns * row + 16, x = p->legend_x, y;
    char label[512];
    size_t i;

    cairo_rectangle(cr, crisp(x), crisp(p->top), floor(p->legend_w), floor(h));
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_fill_preserve(cr);
    cairo_set_source_rgb(cr, 0.80, 0.80, 0.80);
    cairo_stroke(cr);
    set_font(cr, 13, 0);
    for (i = 0; i < p->ns; i++) {
        y = p->top + 8 + row * (i + 0.5);
        set_color(cr, palette[i % NCOLORS]);
        cairo_set_line_width(cr, 2.5);
        cairo_move_to(cr, x + 10, y);
        cairo_line_to(cr, x + 34, y);
        cairo_stroke(cr);
        if (sparse(&p->s[i]))
            dot(cr, x + 22, y, palette[i % NCOLORS]);
        cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
        legend_label(&p->s[i], label, sizeof(label));
        text_at(cr, x + 44, y, label, 0, 0.5);
    }
}

static void draw(cairo_t *cr, plot *p)
{
    data_ranges(p);
    y_title(p);
    layout(cr, p);
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    cairo_set_line_width(cr, 1);
    draw_x_axis(cr, p);
    draw_y_axis(cr, p);
    cairo_set_source_rgb(cr, 0.25, 0.25, 0.25);
    cairo_rectangle(cr, crisp(p->left), crisp(p->top), floor(p->right - p->left),
                    floor(p->bottom - p->top));
    cairo_stroke(cr);
    draw_series(cr, p);
    cairo_set_line_width(cr, 1);
    draw_legend(cr, p);
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    set_font(cr, 18, 1);
    text_at(cr, (p->left + p->right) / 2, TC_PLOT_MARGIN, p->title, 0.5, 0);
}

/* ---- writing the file ---- */

static cairo_status_t write_file(void *closure, const unsigned char *data, unsigned int len)
{
    return fwrite(data, 1, len, closure) == len ? CAIRO_STATUS_SUCCESS : CAIRO_STATUS_WRITE_ERROR;
}

static int is_svg(const char *path)
{
    size_t len = strlen(path);

    return len >= 4 && strcasecmp(path + len - 4, ".svg") == 0;
}

/* Draws onto the surface for the file's format and writes it to f. */
static cairo_status_t render(plot *p, FILE *f)
{
    cairo_surface_t *sf;
    cairo_status_t st;
    cairo_t *cr;

    if (is_svg(p->o->output))
        sf = cairo_svg_surface_create_for_stream(write_file, f, TC_PLOT_W, TC_PLOT_H);
    else
        sf = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, TC_PLOT_W, TC_PLOT_H);
    cr = cairo_create(sf);
    draw(cr, p);
    st = cairo_status(cr);
    cairo_destroy(cr);
    if (st == CAIRO_STATUS_SUCCESS && !is_svg(p->o->output))
        st = cairo_surface_write_to_png_stream(sf, write_file, f);
    cairo_surface_finish(sf); /* an SVG is written out here */
    if (st == CAIRO_STATUS_SUCCESS)
        st = cairo_surface_status(sf);
    cairo_surface_destroy(sf);
    return st;
}

/* Creates the output file and writes the chart into it. */
static int write_chart(plot *p)
{
    const char *path = p->o->output;
    FILE *f = fopen(path, "wb");
    cairo_status_t st;
    int rc = TC_OK;

    if (f == NULL)
        return tc_err(TC_CANTCREAT, "cannot create %s: %s", path, strerror(errno));
    st = render(p, f);
    if (st == CAIRO_STATUS_WRITE_ERROR || ferror(f))
        rc = tc_err(TC_CANTCREAT, "cannot write %s: %s", path, strerror(errno));
    else if (st != CAIRO_STATUS_SUCCESS)
        rc = tc_err(TC_FAILED, "cannot draw %s: %s", path, cairo_status_to_string(st));
    if (fclose(f) != 0 && rc == TC_OK)
        rc = tc_err(TC_CANTCREAT, "cannot write %s: %s", path, strerror(errno));
    return rc;
}

int tc_plot(const tc_opts *o)
{
    plot p = {.o = o, .keys = o->keys != NULL ? o->keys : TC_PLOT_DEFAULT_KEYS};
    size_t i;
    int rc = TC_OK;

    p.s = calloc(TC_PLOT_MAX_SERIES, sizeof(*p.s));
    if (p.s == NULL)
        rc = tc_err(TC_FAILED, "out of memory");
    if (rc == TC_OK)
        rc = fetch_all(&p);
    if (rc == TC_OK)
        rc = write_chart(&p);
    for (i = 0; i < p.ns; i++) {
        free(p.s[i].key);
        free(p.s[i].pts);
    }
    free(p.s);
    return rc;
}
