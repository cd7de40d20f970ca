/* trainctl plot: draws metrics of one or more jobs against step, as a PNG or an SVG. It asks
 * traind for each job's status (its name, and whether it exists) and its rows (the `metrics`
 * request), keeps every finite (step, value) pair per (job, key) series, then lays out the
 * chart: a title, one plot area (or with --panels one per key, stacked, sharing the x axis)
 * with grid lines, tick labels and axis titles, one colour per series, and a legend right of
 * each plot area. With --log the y axes are logarithmic. Nothing is written until every row is
 * in, so a refused request never leaves a half-made file behind.
 *
 * Drawing goes through a small canvas (lines, paths, rectangles, dots, text, a clip) with two
 * ends. A PNG is drawn with cairo on an image surface. An SVG is written here, element by
 * element: cairo's SVG surface turns every piece of text into glyph outlines (<symbol>s used
 * by <use>), so a chart's labels could be neither selected, searched nor read by a program,
 * and post-processing its output would mean matching glyph outlines back to letters. The
 * chart needs a small, fixed subset of SVG (line, path, rect, circle, text with a tspan for an
 * exponent, one clipPath per plot area), which is easier to write correctly than to recover;
 * the file is smaller too. Both ends share one layout: text is measured with cairo (the same
 * "sans-serif" face, a 1x1 image surface for the SVG) and an SVG's text is placed by its
 * anchor (text-anchor) and a baseline computed from cairo's font extents, so that a viewer
 * whose sans-serif is another font still centres and right-aligns labels where they belong. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cairo.h>

#include "client/client.h"
#include "common/td_text.h"

#define TC_PLOT_W            1200  /* chart width: pixels (PNG) or points (SVG) */
#define TC_PLOT_H            700   /* chart height without --panels, the same units */
#define TC_PLOT_MARGIN       24.0  /* around everything, same units */
#define TC_PLOT_TOP          64.0  /* from the top edge to the first plot area: margin and title */
#define TC_PLOT_BOTTOM       74.0  /* below the last plot area: x tick labels, "step", margin */
#define TC_PLOT_PANEL_H      220.0 /* with --panels: the least height of one panel's plot area */
#define TC_PLOT_PANEL_GAP    28.0  /* with --panels: between one panel and the next */
#define TC_PLOT_LEGEND_ROW   22.0  /* one legend line */
#define TC_PLOT_MAX_SERIES   30    /* (job, key) series on one chart: what the legend can hold */
#define TC_PLOT_TICKS        7     /* about how many ticks an axis gets */
#define TC_PLOT_MARKER_MAX   60    /* series with at most this many points get a dot per point */
#define TC_PLOT_SMOOTH_MIN   200   /* series with more points get a smoothed line over them */
#define TC_PLOT_TITLE_ID_MAX 8     /* job ids named in the title before "..." */
#define TC_PLOT_DEFAULT_KEYS "train_loss,test_loss,valid_loss,val_loss"
#define TC_FONT              "sans-serif"

/* One colour per series, in order: matplotlib's tab10, made to stay apart on white. */
static const double palette[][3] = {
    {0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173}, {0.839, 0.153, 0.157},
    {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294}, {0.890, 0.467, 0.761}, {0.498, 0.498, 0.498},
    {0.737, 0.741, 0.133}, {0.090, 0.745, 0.812},
};
#define NCOLORS (sizeof(palette) / sizeof(palette[0]))

/* With several jobs on one plot a job keeps one colour and each key its own dash: solid,
 * dashed, dotted, dash-dot, long dashes (on, off, ... lengths in points; 0 ends one). */
static const double dashes[][4] = {{0}, {7, 4}, {1.5, 3}, {8, 3, 1.5, 3}, {14, 5}};
#define NDASHES (sizeof(dashes) / sizeof(dashes[0]))

static const double white[3] = {1, 1, 1};
static const double grid_rgb[3] = {0.90, 0.90, 0.90};
static const double minor_rgb[3] = {0.955, 0.955, 0.955};
static const double axis_rgb[3] = {0.25, 0.25, 0.25};
static const double frame_rgb[3] = {0.80, 0.80, 0.80};
static const double ink_rgb[3] = {0.10, 0.10, 0.10};

typedef struct point {
    double x, y; /* step, value (its log10 with --log) */
} point;

/* The rows of one key of one job, in step order. */
typedef struct series {
    int64_t job;
    size_t job_rank, key_rank; /* the job's place among JOB arguments, the key's in --keys */
    char *key;
    point *pts;
    size_t n, cap;
    size_t nonpositive; /* --log: values <= 0 left out */
    size_t color;       /* its palette entry */
    size_t dash;        /* its dashes entry */
} series;

/* One plot area and its series, p->s[first .. first + n). */
typedef struct panel {
    size_t first, n;
    double y0, y1;      /* what its y axis spans: values, or their log10 with --log */
    double top, bottom; /* where it is on the surface */
    char ytitle[64];
} panel;

typedef struct plot {
    const tc_opts *o;
    const char *keys; /* the keys asked for, "a,b" */
    series *s;
    size_t ns;
    panel pn[TC_PLOT_MAX_SERIES];
    size_t npanels;
    char title[512];
    double x0, x1;      /* what the x axis spans, in steps */
    double left, right; /* the plot areas' sides on the surface */
    double legend_x, legend_w;
    double height; /* the surface's */
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

/* Keeps one row. Values that are not finite have no place on a chart and are left out; so are
 * values <= 0 on a log axis, counted so that the user hears of them. */
static int on_row(void *ud, const tc_row *r)
{
    fetch *f = ud;
    series *s = NULL;
    point *pts;
    int rc;

    if (!isfinite(r->value))
        return TC_OK;
    if ((rc = find_series(f, r, &s)) != TC_OK)
        return rc;
    if (f->p->o->log_y && r->value <= 0) {
        s->nonpositive++;
        return TC_OK;
    }
    if (s->n == s->cap) {
        pts = realloc(s->pts, (s->cap ? 2 * s->cap : 256) * sizeof(*pts));
        if (pts == NULL)
            return tc_err(TC_FAILED, "out of memory");
        s->pts = pts;
        s->cap = s->cap ? 2 * s->cap : 256;
    }
    s->pts[s->n++] = (point){(double)r->step, f->p->o->log_y ? log10(r->value) : r->value};
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
    rc = tc_conn_metrics(c, f.job, p->keys, on_row, &f, NULL);
    if (rc == TC_OK && p->ns == before && p->o->njobs > 1)
        tc_err(TC_OK, "job %lld has no finite values of %s; the chart leaves it out",
               (long long)f.job, p->keys);
    return rc;
}

/* Drawing order: by job (as named) then key (as listed); with --panels by key, then job, so
 * that each panel's series lie together. */
static int by_job_then_key(const void *a, const void *b)
{
    const series *x = a, *y = b;

    if (x->job_rank != y->job_rank)
        return x->job_rank < y->job_rank ? -1 : 1;
    if (x->key_rank != y->key_rank)
        return x->key_rank < y->key_rank ? -1 : 1;
    return strcmp(x->key, y->key);
}

static int by_key_then_job(const void *a, const void *b)
{
    const series *x = a, *y = b;
    int c;

    if (x->key_rank != y->key_rank)
        return x->key_rank < y->key_rank ? -1 : 1;
    if ((c = strcmp(x->key, y->key)) != 0)
        return c;
    return x->job_rank < y->job_rank ? -1 : x->job_rank > y->job_rank;
}

/* Says which series lost values <= 0 to the log axis, and drops series left empty. */
static void drop_nonpositive(plot *p)
{
    size_t i, kept = 0;

    for (i = 0; i < p->ns; i++) {
        series *s = &p->s[i];
        if (s->nonpositive > 0)
            tc_err(TC_OK,
                   "job %lld %s: %zu value%s <= 0 left out: the log axis has no place for "
                   "%s",
                   (long long)s->job, s->key, s->nonpositive, s->nonpositive == 1 ? "" : "s",
                   s->nonpositive == 1 ? "it" : "them");
        if (s->n > 0) {
            p->s[kept++] = *s;
        } else {
            free(s->key);
            free(s->pts);
        }
    }
    p->ns = kept;
}

/* "nothing to plot: no finite values of train_loss,test_loss in job 2" (jobs 2, 3). */
static int nothing_to_plot(const plot *p)
{
    char jobs[256];
    size_t n = 0;

    jobs[0] = '\0';
    for (size_t i = 0; i < p->o->njobs && n + 24 < sizeof(jobs); i++)
        n += (size_t)snprintf(jobs + n, sizeof(jobs) - n, "%s%lld", i ? ", " : "",
                              (long long)p->o->jobs[i]);
    return tc_err(TC_FAILED, "nothing to plot: no finite values%s of %s in job%s %s",
                  p->o->log_y ? " above 0" : "", p->keys, p->o->njobs > 1 ? "s" : "", jobs);
}

/* Every job's rows, in series sorted for drawing. */
static int fetch_all(plot *p)
{
    tc_conn *c = NULL;
    size_t i;
    int rc = tc_conn_open(&c, p->o->socket);

    for (i = 0; rc == TC_OK && i < p->o->njobs; i++)
        rc = fetch_job(c, p, i);
    tc_conn_close(c);
    if (rc == TC_OK)
        drop_nonpositive(p);
    if (rc == TC_OK && p->ns == 0)
        rc = nothing_to_plot(p);
    if (rc == TC_OK)
        qsort(p->s, p->ns, sizeof(*p->s), p->o->panels ? by_key_then_job : by_job_then_key);
    return rc;
}

/* ---- the canvas: cairo draws a PNG; an SVG's elements are written here ---- */

typedef struct canvas {
    cairo_t *cr;  /* draws the PNG; for an SVG, only measures text */
    FILE *svg;    /* the SVG being written, or NULL */
    double size;  /* the font's size */
    int bold;     /* and weight */
    int clips;    /* clip paths made so far, for their ids */
    size_t npath; /* points of the path under way */
} canvas;

static int c255(double v)
{
    return (int)lround(fmin(fmax(v, 0), 1) * 255);
}

/* attr="#rrggbb" */
static void svg_color(const canvas *cv, const char *attr, const double *rgb)
{
    fprintf(cv->svg, " %s=\"#%02x%02x%02x\"", attr, c255(rgb[0]), c255(rgb[1]), c255(rgb[2]));
}

/* s as XML character data: escaped for people first (td_text_escape: no control characters
 * or malformed UTF-8, which XML does not allow either), then for XML. */
static void svg_text(const canvas *cv, const char *s)
{
    char esc[4 * 512 + 1];
    size_t n = td_text_escape(esc, sizeof(esc), s, strlen(s), 0), i = 0, len;
    uint32_t cp;

    while (i < n) {
        len = td_text_char(esc + i, n - i, &cp);
        if (cp == '&')
            fputs("&amp;", cv->svg);
        else if (cp == '<')
            fputs("&lt;", cv->svg);
        else if (cp == '>')
            fputs("&gt;", cv->svg);
        else if (cp == 0xFFFE || cp == 0xFFFF) /* not characters, for XML */
            fputs("&#xFFFD;", cv->svg);
        else
            fwrite(esc + i, 1, len, cv->svg);
        i += len;
    }
}

static void cv_line(canvas *cv, double x0, double y0, double x1, double y1, const double *rgb,
                    double width)
{
    if (cv->svg != NULL) {
        fprintf(cv->svg, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"", x0, y0, x1, y1);
        svg_color(cv, "stroke", rgb);
        fprintf(cv->svg, " stroke-width=\"%g\"/>\n", width);
        return;
    }
    cairo_set_source_rgb(cv->cr, rgb[0], rgb[1], rgb[2]);
    cairo_set_line_width(cv->cr, width);
    cairo_move_to(cv->cr, x0, y0);
    cairo_line_to(cv->cr, x1, y1);
    cairo_stroke(cv->cr);
}

/* A rectangle filled with fill and outlined (1 unit) with stroke; either may be NULL. */
static void cv_rect(canvas *cv, double x, double y, double w, double h, const double *fill,
                    const double *stroke)
{
    if (cv->svg != NULL) {
        fprintf(cv->svg, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\"", x, y, w, h);
        if (fill != NULL)
            svg_color(cv, "fill", fill);
        else
            fputs(" fill=\"none\"", cv->svg);
        if (stroke != NULL)
            svg_color(cv, "stroke", stroke);
        fputs(stroke != NULL ? " stroke-width=\"1\"/>\n" : "/>\n", cv->svg);
        return;
    }
    cairo_rectangle(cv->cr, x, y, w, h);
    if (fill != NULL) {
        cairo_set_source_rgb(cv->cr, fill[0], fill[1], fill[2]);
        cairo_fill_preserve(cv->cr);
    }
    if (stroke != NULL) {
        cairo_set_source_rgb(cv->cr, stroke[0], stroke[1], stroke[2]);
        cairo_set_line_width(cv->cr, 1);
        cairo_stroke(cv->cr);
    }
    cairo_new_path(cv->cr);
}

/* A polyline: its points one by one, then stroked. */
static void cv_path_to(canvas *cv, double x, double y)
{
    if (cv->svg != NULL)
        fprintf(cv->svg, "%s%.2f %.2f", cv->npath == 0 ? "<path d=\"M" : " L", x, y);
    else if (cv->npath == 0)
        cairo_move_to(cv->cr, x, y);
    else
        cairo_line_to(cv->cr, x, y);
    cv->npath++;
}

/* The lengths of dash pattern d (dashes[]), 0 for a solid line. */
static int dash_len(size_t d)
{
    int n = 0;

    while (n < 4 && dashes[d % NDASHES][n] > 0)
        n++;
    return n;
}

/* Strokes the polyline in rgb, with dash pattern d (0: solid). */
static void cv_path_stroke(canvas *cv, const double *rgb, double alpha, double width, size_t d)
{
    const double *on = dashes[d % NDASHES];
    int n = dash_len(d);

    if (cv->svg != NULL && cv->npath > 0) {
        fputc('"', cv->svg);
        svg_color(cv, "stroke", rgb);
        if (alpha < 1)
            fprintf(cv->svg, " stroke-opacity=\"%g\"", alpha);
        if (n > 0) {
            fputs(" stroke-dasharray=\"", cv->svg);
            for (int i = 0; i < n; i++)
                fprintf(cv->svg, "%s%g", i ? " " : "", on[i]);
            fputc('"', cv->svg);
        }
        fprintf(cv->svg, " stroke-width=\"%g\"/>\n", width);
    } else if (cv->svg == NULL) {
        cairo_set_source_rgba(cv->cr, rgb[0], rgb[1], rgb[2], alpha);
        cairo_set_line_width(cv->cr, width);
        cairo_set_dash(cv->cr, on, n, 0);
        cairo_stroke(cv->cr);
        cairo_set_dash(cv->cr, NULL, 0, 0);
    }
    cv->npath = 0;
}

/* A point marker in colour rgb, ringed in white so it stands out from the lines under it. */
static void cv_dot(canvas *cv, double x, double y, const double *rgb)
{
    if (cv->svg != NULL) {
        fprintf(cv->svg, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3.8\"", x, y);
        svg_color(cv, "fill", rgb);
        fputs(" stroke=\"#ffffff\" stroke-width=\"1.2\"/>\n", cv->svg);
        return;
    }
    cairo_new_sub_path(cv->cr);
    cairo_arc(cv->cr, x, y, 4.4, 0, 2 * M_PI);
    cairo_set_source_rgb(cv->cr, 1, 1, 1);
    cairo_fill(cv->cr);
    cairo_arc(cv->cr, x, y, 3.2, 0, 2 * M_PI);
    cairo_set_source_rgb(cv->cr, rgb[0], rgb[1], rgb[2]);
    cairo_fill(cv->cr);
}

/* Only what falls inside the rectangle is drawn, until cv_unclip(); lines are joined and
 * capped round meanwhile (the series are all that is drawn there). */
static void cv_clip(canvas *cv, double x, double y, double w, double h)
{
    if (cv->svg != NULL) {
        fprintf(cv->svg,
                "<clipPath id=\"area%d\"><rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" "
                "height=\"%.2f\"/></clipPath>\n<g clip-path=\"url(#area%d)\" fill=\"none\" "
                "stroke-linejoin=\"round\" stroke-linecap=\"round\">\n",
                cv->clips, x, y, w, h, cv->clips);
        cv->clips++;
        return;
    }
    cairo_save(cv->cr);
    cairo_rectangle(cv->cr, x, y, w, h);
    cairo_clip(cv->cr);
    cairo_set_line_join(cv->cr, CAIRO_LINE_JOIN_ROUND);
    cairo_set_line_cap(cv->cr, CAIRO_LINE_CAP_ROUND);
}

static void cv_unclip(canvas *cv)
{
    if (cv->svg != NULL)
        fputs("</g>\n", cv->svg);
    else
        cairo_restore(cv->cr);
}

static void cv_font(canvas *cv, double size, int bold)
{
    cv->size = size;
    cv->bold = bold;
    cairo_select_font_face(cv->cr, TC_FONT, CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cv->cr, size);
}

static double cv_width(canvas *cv, const char *s)
{
    cairo_text_extents_t e;

    cairo_text_extents(cv->cr, s, &e);
    return e.x_advance;
}

/* The baseline's offset from an anchor at ay: 0 puts the font's ascent line at the anchor,
 * 0.5 the middle of ascent and descent, 1 the descent line; so labels of one size line up
 * whatever letters they hold. */
static double baseline(canvas *cv, double ay)
{
    cairo_font_extents_t fe;

    cairo_font_extents(cv->cr, &fe);
    return fe.ascent - (fe.ascent + fe.descent) * ay;
}

/* <text x y ...> with the current font, anchored at ax (0 start, 0.5 middle, 1 end). */
static void svg_text_open(canvas *cv, double x, double y, double ax, const double *rgb)
{
    fprintf(cv->svg, "<text x=\"%.2f\" y=\"%.2f\" font-size=\"%g\"%s", x, y, cv->size,
            cv->bold ? " font-weight=\"bold\"" : "");
    if (ax > 0.25)
        fprintf(cv->svg, " text-anchor=\"%s\"", ax < 0.75 ? "middle" : "end");
    svg_color(cv, "fill", rgb);
}

/* Draws s with its anchor at (x, y): ax 0, 0.5 or 1 puts the left edge, the centre or the right
 * edge there, and ay places the baseline (baseline()). vertical turns it to read upwards,
 * about the anchor. */
static void cv_text(canvas *cv, double x, double y, const char *s, double ax, double ay,
                    const double *rgb, int vertical)
{
    double b = baseline(cv, ay);

    if (cv->svg != NULL) {
        if (vertical) {
            fprintf(cv->svg, "<g transform=\"translate(%.2f %.2f) rotate(-90)\">", x, y);
            x = y = 0;
        }
        svg_text_open(cv, x, y + b, ax, rgb);
        fputc('>', cv->svg);
        svg_text(cv, s);
        fputs(vertical ? "</text></g>\n" : "</text>\n", cv->svg);
        return;
    }
    cairo_save(cv->cr);
    cairo_set_source_rgb(cv->cr, rgb[0], rgb[1], rgb[2]);
    cairo_translate(cv->cr, x, y);
    if (vertical)
        cairo_rotate(cv->cr, -M_PI / 2);
    cairo_move_to(cv->cr, -cv_width(cv, s) * ax, b);
    cairo_show_text(cv->cr, s);
    cairo_restore(cv->cr);
}

/* 10 to the power k, as "10" with k raised and smaller: a log axis's tick label. */
#define TC_EXP_SCALE 0.72 /* the exponent's size over the label's */
#define TC_EXP_RISE  0.42 /* how far it is raised, in the label's font sizes */

static void power_text(int k, char *exp, size_t size)
{
    /* U+2212, the minus sign, rather than a hyphen */
    snprintf(exp, size, "%s%d", k < 0 ? "\xe2\x88\x92" : "", abs(k));
}

static double cv_power_width(canvas *cv, int k)
{
    double size = cv->size, w;
    char exp[16];

    power_text(k, exp, sizeof(exp));
    w = cv_width(cv, "10");
    cv_font(cv, size * TC_EXP_SCALE, cv->bold);
    w += cv_width(cv, exp);
    cv_font(cv, size, cv->bold);
    return w;
}

static void cv_power(canvas *cv, double x, double y, int k, double ax, double ay, const double *rgb)
{
    double size = cv->size, b = baseline(cv, ay), w = cv_power_width(cv, k);
    char exp[16];

    power_text(k, exp, sizeof(exp));
    if (cv->svg != NULL) {
        svg_text_open(cv, x, y + b, ax, rgb);
        fprintf(cv->svg, ">10<tspan dy=\"%.2f\" font-size=\"%g\">%s</tspan></text>\n",
                -TC_EXP_RISE * size, size * TC_EXP_SCALE, exp);
        return;
    }
    x -= w * ax;
    cairo_set_source_rgb(cv->cr, rgb[0], rgb[1], rgb[2]);
    cairo_move_to(cv->cr, x, y + b);
    cairo_show_text(cv->cr, "10");
    x += cv_width(cv, "10");
    cv_font(cv, size * TC_EXP_SCALE, cv->bold);
    cairo_move_to(cv->cr, x, y + b - TC_EXP_RISE * size);
    cairo_show_text(cv->cr, exp);
    cv_font(cv, size, cv->bold);
}

/* ---- scales and ticks ---- */

/* Ticks at round numbers (1, 2 or 5 times a power of ten) across [lo, hi]; on a log axis, at
 * whole powers of ten (every step-th), the values being their log10. */
typedef struct ticks {
    double first, step;
    int n, decimals, kilo, log;
} ticks;

/* min_step: 1 for steps, which are whole numbers; 0 for values. */
static void make_ticks(ticks *t, double lo, double hi, double min_step)
{
    double raw = (hi - lo) / TC_PLOT_TICKS, mag = pow(10, floor(log10(raw))), norm = raw / mag;

    t->log = 0;
    t->step = fmax(min_step, (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag);
    t->first = ceil(lo / t->step - 1e-9) * t->step;
    t->n = (int)floor((hi - t->first) / t->step + 1e-9) + 1;
    t->decimals = t->step >= 1 ? 0 : (int)ceil(-log10(t->step) - 1e-9);
    t->kilo = t->step >= 1000 && fmod(t->step, 1000) == 0; /* 25k rather than 25000 */
}

/* A log axis over [lo, hi] (log10 of values): every decade while there are few, else every
 * step-th, so that about TC_PLOT_TICKS are labelled. */
static void make_log_ticks(ticks *t, double lo, double hi)
{
    t->log = 1;
    t->step = fmax(1, ceil((floor(hi) - ceil(lo)) / TC_PLOT_TICKS));
    t->first = ceil(ceil(lo - 1e-9) / t->step) * t->step;
    t->n = (int)floor((hi - t->first) / t->step + 1e-9) + 1;
    t->decimals = t->kilo = 0;
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

static void panel_ticks(const plot *p, const panel *pn, ticks *t)
{
    if (p->o->log_y)
        make_log_ticks(t, pn->y0, pn->y1);
    else
        make_ticks(t, pn->y0, pn->y1, 0);
}

/* The x range, over every point: shared by every panel. */
static void x_range(plot *p)
{
    size_t i, j;

    p->x0 = INFINITY;
    p->x1 = -INFINITY;
    for (i = 0; i < p->ns; i++) {
        for (j = 0; j < p->s[i].n; j++) {
            p->x0 = fmin(p->x0, p->s[i].pts[j].x);
            p->x1 = fmax(p->x1, p->s[i].pts[j].x);
        }
    }
    if (p->x0 > 0 && p->x0 <= 0.2 * (p->x1 - p->x0))
        p->x0 = 0; /* a run that starts at step 1 reads better from 0 */
    if (p->x1 - p->x0 < 1) {
        p->x0 -= 1;
        p->x1 += 1;
    }
}

/* A panel's y range: its points' values padded by 5%, so no line runs on the frame; on a log
 * axis, out to whole decades, so that at least two powers of ten are labelled, and then 2%. */
static void y_range(const plot *p, panel *pn)
{
    double lo = INFINITY, hi = -INFINITY, pad;
    size_t i, j;

    for (i = pn->first; i < pn->first + pn->n; i++) {
        for (j = 0; j < p->s[i].n; j++) {
            lo = fmin(lo, p->s[i].pts[j].y);
            hi = fmax(hi, p->s[i].pts[j].y);
        }
    }
    if (p->o->log_y) {
        lo = floor(lo + 1e-6); /* 0.001 as a float is 10^-2.99999998 */
        hi = ceil(hi - 1e-6);
        if (hi <= lo) { /* one power of ten and nothing else: it in the middle */
            lo -= 1;
            hi += 1;
        }
        pad = 0.02 * (hi - lo);
    } else {
        pad = hi > lo ? 0.05 * (hi - lo) : lo != 0 ? fabs(lo) * 0.1 : 1;
    }
    pn->y0 = lo - pad;
    pn->y1 = hi + pad;
}

/* A panel's y axis title: with --panels its key; else the key when there is one, or what all
 * the keys measure. */
static void y_title(const plot *p, panel *pn)
{
    int one = 1, loss = 1, acc = 1;
    const series *s = &p->s[pn->first];
    size_t i, len;

    for (i = 0; i < pn->n; i++) {
        len = strlen(s[i].key);
        one &= strcmp(s[i].key, s[0].key) == 0;
        loss &= len >= 4 && strcmp(s[i].key + len - 4, "loss") == 0;
        acc &= len >= 8 && strcmp(s[i].key + len - 8, "accuracy") == 0;
    }
    snprintf(pn->ytitle, sizeof(pn->ytitle), "%s",
             one    ? s[0].key
             : loss ? "loss"
             : acc  ? "accuracy"
                    : "value");
}

/* The panels: one over every series, or with --panels one per key (the series are sorted by
 * key). Colours: one per series; with --panels and several jobs, one per job, the same in
 * every panel. */
static void make_panels(plot *p)
{
    size_t i, njobs = 0;

    p->npanels = 0;
    for (i = 0; i < p->ns; i++) {
        if (i == 0 || (p->o->panels && strcmp(p->s[i].key, p->s[i - 1].key) != 0))
            p->pn[p->npanels++] = (panel){.first = i};
        p->pn[p->npanels - 1].n++;
        njobs = p->s[i].job_rank + 1 > njobs ? p->s[i].job_rank + 1 : njobs;
    }
    /* One job: a colour per series. Several: a colour per job, and (on a plot of several keys)
     * a dash per key, the keys' order as --keys gives it. */
    for (i = 0; i < p->ns; i++) {
        size_t d = 0;
        for (size_t j = 0; j < p->ns && njobs > 1 && !p->o->panels; j++) {
            int before = p->s[j].key_rank < p->s[i].key_rank;
            for (size_t k = 0; before && k < j; k++) /* count each key once */
                before = p->s[k].key_rank != p->s[j].key_rank;
            d += before;
        }
        p->s[i].color = njobs > 1 ? p->s[i].job_rank : i;
        p->s[i].dash = d;
    }
    for (i = 0; i < p->npanels; i++) {
        y_range(p, &p->pn[i]);
        y_title(p, &p->pn[i]);
    }
}

static double px(const plot *p, double x)
{
    return p->left + (x - p->x0) / (p->x1 - p->x0) * (p->right - p->left);
}

static double py(const panel *pn, double y)
{
    return pn->bottom - (y - pn->y0) / (pn->y1 - pn->y0) * (pn->bottom - pn->top);
}

/* A coordinate on the middle of a pixel, so that a 1-unit line is one sharp pixel wide. */
static double crisp(double v)
{
    return floor(v) + 0.5;
}

/* A log axis's minor grid: 2 to 9 times each power of ten, while there are few decades; when
 * it spans one decade only, 2 and 5 times it are labelled too ("0.2", "0.5"), as plain
 * numbers. Returns the widest such label; draws nothing when draw is 0. */
static double minor_grid(canvas *cv, const plot *p, const panel *pn, int draw)
{
    double k, y, v, w = 0;
    char label[64];
    int m;

    if (pn->y1 - pn->y0 > 5)
        return 0;
    for (k = floor(pn->y0); k < pn->y1; k++) {
        for (m = 2; m < 10; m++) {
            v = k + log10(m);
            if (v <= pn->y0 || v >= pn->y1)
                continue;
            y = crisp(py(pn, v));
            if (draw)
                cv_line(cv, p->left, y, p->right, y, minor_rgb, 1);
            if (pn->y1 - pn->y0 > 1.5 || (m != 2 && m != 5))
                continue;
            snprintf(label, sizeof(label), "%.*f", k < 0 ? (int)-k : 0, m * pow(10, k));
            w = fmax(w, cv_width(cv, label));
            if (!draw)
                continue;
            cv_line(cv, p->left - 3, y, p->left, y, axis_rgb, 1);
            cv_text(cv, p->left - 8, y, label, 1, 0.5, axis_rgb, 0);
        }
    }
    return w;
}

/* ---- layout ---- */

/* The widest y tick label of a panel, for the left margin. */
static double y_labels_width(canvas *cv, const plot *p, const panel *pn)
{
    char label[64];
    double w = 0;
    ticks t;
    int i;

    panel_ticks(p, pn, &t);
    if (t.log)
        w = minor_grid(cv, p, pn, 0);
    for (i = 0; i < t.n; i++) {
        if (t.log) {
            w = fmax(w, cv_power_width(cv, (int)lround(t.first + i * t.step)));
        } else {
            tick_label(&t, i, label, sizeof(label));
            w = fmax(w, cv_width(cv, label));
        }
    }
    return w;
}

static void legend_label(const series *s, char *buf, size_t size)
{
    snprintf(buf, size, "job %lld %s", (long long)s->job, s->key);
}

static double legend_height(const panel *pn)
{
    return (double)pn->n * TC_PLOT_LEGEND_ROW + 16;
}

/* Places the plot areas: room on the left for the y axes' labels and titles, below for the x
 * axis's, above for the title, and on the right for the legends. Without --panels the chart
 * is TC_PLOT_W x TC_PLOT_H; with it the panels share that height when each gets at least
 * TC_PLOT_PANEL_H (and its legend's), else each gets that and the chart grows. */
static void layout(canvas *cv, plot *p)
{
    char label[512];
    double w = 0, y = TC_PLOT_TOP, h;
    size_t i;

    cv_font(cv, 13, 0);
    for (i = 0; i < p->ns; i++) {
        legend_label(&p->s[i], label, sizeof(label));
        w = fmax(w, cv_width(cv, label));
    }
    p->legend_w = fmin(w, TC_PLOT_W / 3.0) + 56; /* padding, the swatch and its gap */
    p->legend_x = TC_PLOT_W - TC_PLOT_MARGIN - p->legend_w;
    p->right = p->legend_x - 20;
    cv_font(cv, 12, 0);
    w = 0;
    for (i = 0; i < p->npanels; i++)
        w = fmax(w, y_labels_width(cv, p, &p->pn[i]));
    p->left = TC_PLOT_MARGIN + 26 + w + 12;
    if (!p->o->panels) {
        p->height = TC_PLOT_H;
        p->pn[0].top = TC_PLOT_TOP;
        p->pn[0].bottom = TC_PLOT_H - TC_PLOT_BOTTOM;
        return;
    }
    /* as high as the chart without --panels, or higher when the panels need it */
    h = (TC_PLOT_H - TC_PLOT_TOP - TC_PLOT_BOTTOM - TC_PLOT_PANEL_GAP * (double)(p->npanels - 1)) /
        (double)p->npanels;
    h = fmax(h, TC_PLOT_PANEL_H);
    for (i = 0; i < p->npanels; i++) {
        p->pn[i].top = y;
        p->pn[i].bottom = y + fmax(h, legend_height(&p->pn[i]));
        y = p->pn[i].bottom + TC_PLOT_PANEL_GAP;
    }
    p->height = ceil(y - TC_PLOT_PANEL_GAP + TC_PLOT_BOTTOM);
}

/* ---- drawing ---- */

/* The vertical grid lines of a panel; in the last panel also the x ticks, their labels and the
 * axis's title. */
static void draw_x_axis(canvas *cv, const plot *p, const panel *pn, int last)
{
    char label[64];
    double x;
    ticks t;
    int i;

    make_ticks(&t, p->x0, p->x1, 1);
    cv_font(cv, 12, 0);
    for (i = 0; i < t.n; i++) {
        x = crisp(px(p, t.first + i * t.step));
        cv_line(cv, x, pn->top, x, pn->bottom, grid_rgb, 1);
        if (!last)
            continue;
        cv_line(cv, x, pn->bottom, x, pn->bottom + 5, axis_rgb, 1);
        tick_label(&t, i, label, sizeof(label));
        cv_text(cv, x, pn->bottom + 8, label, 0.5, 0, axis_rgb, 0);
    }
    if (last) {
        cv_font(cv, 14, 0);
        cv_text(cv, (p->left + p->right) / 2, p->height - TC_PLOT_MARGIN, "step", 0.5, 1, axis_rgb,
                0);
    }
}

static void draw_y_axis(canvas *cv, const plot *p, const panel *pn)
{
    char label[64];
    double y;
    ticks t;
    int i;

    cv_font(cv, 12, 0);
    if (p->o->log_y)
        minor_grid(cv, p, pn, 1);
    panel_ticks(p, pn, &t);
    for (i = 0; i < t.n; i++) {
        y = crisp(py(pn, t.first + i * t.step));
        cv_line(cv, p->left, y, p->right, y, grid_rgb, 1);
        cv_line(cv, p->left - 5, y, p->left, y, axis_rgb, 1);
        if (t.log) {
            cv_power(cv, p->left - 8, y, (int)lround(t.first + i * t.step), 1, 0.5, axis_rgb);
        } else {
            tick_label(&t, i, label, sizeof(label));
            cv_text(cv, p->left - 8, y, label, 1, 0.5, axis_rgb, 0);
        }
    }
    cv_font(cv, 14, 0);
    cv_text(cv, TC_PLOT_MARGIN, (pn->top + pn->bottom) / 2, pn->ytitle, 0.5, 0, axis_rgb, 1);
}

/* The series as a path. Where several points fall into one pixel column only the column's
 * first, lowest, highest and last points are drawn, in step order: the line looks the same and
 * an SVG of 100,000 steps stays small. */
static void path_series(canvas *cv, const plot *p, const panel *pn, const series *s)
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
                cv_path_to(cv, px(p, s->pts[pick[k]].x), py(pn, s->pts[pick[k]].y));
        i = j;
    }
}

/* A series with few points (an evaluation's, mostly) is drawn thicker, with a dot per point. */
static int sparse(const series *s)
{
    return s->n <= TC_PLOT_MARKER_MAX;
}

/* A copy of s with each value replaced by the mean over a window of about 1% of its points
 * centred on it (so the line does not lag the way an exponential average does), using prefix
 * sums; on a log axis the values are logarithms, so this is a geometric mean. Caller frees
 * out->pts; NULL there when there is no memory, and the raw line is all. */
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

static void stroke_series(canvas *cv, const plot *p, const panel *pn, const series *s, double alpha,
                          double width)
{
    path_series(cv, p, pn, s);
    cv_path_stroke(cv, palette[s->color % NCOLORS], alpha, width, s->dash);
}

/* One layer of a panel: 0 the raw lines of the series with many points, 1 their smoothed
 * lines, 2 the sparse series with their dots, so that no layer hides a later one. */
static void draw_layer(canvas *cv, const plot *p, const panel *pn, int layer)
{
    const series *s;
    series sm;
    size_t i, j;

    for (i = pn->first; i < pn->first + pn->n; i++) {
        s = &p->s[i];
        if (sparse(s) != (layer == 2) || (layer == 1 && !dense(s)))
            continue;
        if (layer == 0)
            stroke_series(cv, p, pn, s, dense(s) ? 0.22 : 1, 1.4);
        if (layer == 1) {
            smooth(s, &sm);
            if (sm.pts != NULL)
                stroke_series(cv, p, pn, &sm, 1, 2.0);
            free(sm.pts);
        }
        if (layer == 2)
            stroke_series(cv, p, pn, s, 1, 2.2);
        for (j = 0; layer == 2 && j < s->n; j++)
            cv_dot(cv, px(p, s->pts[j].x), py(pn, s->pts[j].y), palette[s->color % NCOLORS]);
    }
}

/* A panel's series, layer by layer. Every point lies inside the axes' ranges; the clip, a
 * marker's radius wider than the plot area, only keeps a stray rounding from painting over
 * the margins. */
static void draw_series(canvas *cv, const plot *p, const panel *pn)
{
    int layer;

    cv_clip(cv, p->left - 5, pn->top - 5, p->right - p->left + 10, pn->bottom - pn->top + 10);
    for (layer = 0; layer < 3; layer++)
        draw_layer(cv, p, pn, layer);
    cv_unclip(cv);
}

/* A panel's legend: a framed box right of its plot area, one line per series in drawing
 * order. */
static void draw_legend(canvas *cv, const plot *p, const panel *pn)
{
    double x = p->legend_x, y;
    char label[512];
    size_t i;

    cv_rect(cv, crisp(x), crisp(pn->top), floor(p->legend_w), floor(legend_height(pn)), white,
            frame_rgb);
    cv_font(cv, 13, 0);
    for (i = pn->first; i < pn->first + pn->n; i++) {
        const series *s = &p->s[i];
        y = pn->top + 8 + TC_PLOT_LEGEND_ROW * ((double)(i - pn->first) + 0.5);
        cv_path_to(cv, x + 10, y);
        cv_path_to(cv, x + 34, y);
        cv_path_stroke(cv, palette[s->color % NCOLORS], 1, 2.5, s->dash);
        if (sparse(s))
            cv_dot(cv, x + 22, y, palette[s->color % NCOLORS]);
        legend_label(s, label, sizeof(label));
        cv_text(cv, x + 44, y, label, 0, 0.5, ink_rgb, 0);
    }
}

static void draw(canvas *cv, plot *p)
{
    size_t i;

    cv_rect(cv, 0, 0, TC_PLOT_W, p->height, white, NULL);
    for (i = 0; i < p->npanels; i++) {
        const panel *pn = &p->pn[i];
        draw_x_axis(cv, p, pn, i + 1 == p->npanels);
        draw_y_axis(cv, p, pn);
        cv_rect(cv, crisp(p->left), crisp(pn->top), floor(p->right - p->left),
                floor(pn->bottom - pn->top), NULL, axis_rgb);
        draw_series(cv, p, pn);
        draw_legend(cv, p, pn);
    }
    cv_font(cv, 18, 1);
    cv_text(cv, (p->left + p->right) / 2, TC_PLOT_MARGIN, p->title, 0.5, 0, ink_rgb, 0);
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

/* The SVG: its head, the drawing, its end. Its size is in points, as cairo's SVG surface gave
 * it, with user units of one point. */
static void write_svg(canvas *cv, plot *p, FILE *f)
{
    cv->svg = f;
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%dpt\" height=\"%.0fpt\" "
            "viewBox=\"0 0 %d %.0f\" font-family=\"%s\">\n<title>",
            TC_PLOT_W, p->height, TC_PLOT_W, p->height, TC_FONT);
    svg_text(cv, p->title);
    fputs("</title>\n", f);
    draw(cv, p);
    fputs("</svg>\n", f);
}

/* Lays the chart out, draws it for the file's format and writes it to f. */
static cairo_status_t render(plot *p, FILE *f)
{
    cairo_surface_t *sf = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1);
    cairo_t *measure = cairo_create(sf);
    canvas cv = {.cr = measure};
    cairo_status_t st;

    cairo_surface_destroy(sf); /* measure holds it */
    make_panels(p);
    x_range(p);
    layout(&cv, p);
    if (is_svg(p->o->output)) {
        write_svg(&cv, p, f);
        st = cairo_status(measure);
        cairo_destroy(measure);
        return st;
    }
    cairo_destroy(measure);
    sf = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, TC_PLOT_W, (int)p->height);
    cv.cr = cairo_create(sf);
    draw(&cv, p);
    st = cairo_status(cv.cr);
    cairo_destroy(cv.cr);
    if (st == CAIRO_STATUS_SUCCESS)
        st = cairo_surface_write_to_png_stream(sf, write_file, f);
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
