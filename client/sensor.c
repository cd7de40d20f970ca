/* trainctl sensor: the local tools that make sensor shards (train/sensor.h) without a daemon.
 * `sensor synth` writes synthetic wearable days (synth.c); `sensor import` turns a CSV file
 * of one row per time step and one column per channel into shards. This file holds the verb's
 * own argument parsing (it has subcommands and flags no other verb shares), its help, and the
 * importer. Single-threaded, called from main's thread; returns exit statuses as client.h says. */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/client.h"
#include "train/sensor.h"

#define CSV_MAX_LINE        (1 << 20) /* bytes in one line of a CSV, captions or labels file */
#define MAX_DAYS            100000    /* synth --days: 100,000 days take 5.8 GB */
#define DEFAULT_CAPTION_LEN 256       /* bytes */
#define DEFAULT_VALID       0.1       /* fraction of days or windows in the valid shard */
#define MAX_NAME            64        /* bytes in an import's --name */

/* ---- arguments ----------------------------------------------------------------------------- */

enum { SYNTH = 1, IMPORT = 2 };

enum {
    O_OUT,
    O_DAYS,
    O_SEED,
    O_VALID,
    O_CAPTION_LEN,
    O_TIME_STEPS,
    O_PERIOD,
    O_NAME,
    O_CHANNELS,
    O_CAPTIONS,
    O_CAPTION_COLUMN,
    O_LABELS,
    O_LABEL_COLUMN,
    O_LABEL_NAMES,
    O_LABEL_PROMPT
};

static const struct {
    const char *name;
    int id;
    unsigned cmds; /* the subcommands that take it */
} options[] = {
    {"-o", O_OUT, SYNTH | IMPORT},
    {"--output", O_OUT, SYNTH | IMPORT},
    {"--days", O_DAYS, SYNTH},
    {"--seed", O_SEED, SYNTH},
    {"--valid", O_VALID, SYNTH | IMPORT},
    {"--caption-len", O_CAPTION_LEN, SYNTH | IMPORT},
    {"--time-steps", O_TIME_STEPS, IMPORT},
    {"--period", O_PERIOD, IMPORT},
    {"--name", O_NAME, IMPORT},
    {"--channels", O_CHANNELS, IMPORT},
    {"--captions", O_CAPTIONS, IMPORT},
    {"--caption-column", O_CAPTION_COLUMN, IMPORT},
    {"--labels", O_LABELS, IMPORT},
    {"--label-column", O_LABEL_COLUMN, IMPORT},
    {"--label-names", O_LABEL_NAMES, IMPORT},
    {"--label-prompt", O_LABEL_PROMPT, IMPORT},
};

#define NOPTIONS (sizeof(options) / sizeof(options[0]))

#define SYNTH_USAGE "trainctl sensor synth -o DIR --days N [--seed S] [--valid F] [--caption-len L]"
#define IMPORT_USAGE                                                                             \
    "trainctl sensor import FILE.csv -o DIR [--time-steps T] [--channels A,B,...]\n"             \
    "         [--captions FILE | --caption-column NAME] [--labels FILE | --label-column NAME]\n" \
    "         [--label-names A,B,...] [--label-prompt NAME=TEXT]... [--valid F]\n"               \
    "         [--caption-len L] [--period SECONDS] [--name NAME]"

static const char sensor_help[] =
    "usage: " SYNTH_USAGE "\n"
    "       " IMPORT_USAGE "\n\n"
    "Makes sensor shards, the data of a sensorlm job (data.kind \"sensor\"), here,\n"
    "without traind: synthetic wearable days (synth) or a CSV file (import). See\n"
    "'trainctl sensor synth --help' and 'trainctl sensor import --help'.\n";

static const char synth_help[] =
    "usage: " SYNTH_USAGE "\n\n"
    "Writes DIR/synth-train.bin and DIR/synth-valid.bin: N synthetic days of a\n"
    "wearable, one row a minute (1440 time steps) of 10 channels (heart_rate bpm,\n"
    "steps steps/min, skin_temp degC, eda uS, sleep_state 0 awake 1 light 2 deep 3\n"
    "REM, accel_mag g, altitude_change m/min, spo2 %, respiration breaths/min,\n"
    "hrv_rmssd ms; NaN where the watch lost a reading), each with a caption and the\n"
    "day's workout as its label (rest, walk, run, cycle, strength, swim, hike).\n"
    "Deterministic: the same seed gives the same bytes. Creates DIR if missing, and\n"
    "prints what it wrote on standard output. README.md, \"Sensor data\", says how\n"
    "the days, the channels and the captions are made.\n\n"
    "  -o DIR           the directory to write into; --output DIR is the same\n"
    "  --days N         days in all, 2 to 100000 (each takes 57.6 kB)\n"
    "  --seed S         a whole number >= 0; default 1\n"
    "  --valid F        the fraction of the days in the valid shard (of people\n"
    "                   not in the train shard), 0 < F < 1; default 0.1; at\n"
    "                   least one day in each\n"
    "  --caption-len L  the caption slot, 64 to 4096 bytes; default 256. A caption\n"
    "                   is cut at a clause boundary to fit\n"
    "  -h, --help       show this help\n";

static const char import_help[] =
    "usage: " IMPORT_USAGE "\n\n"
    "Reads FILE.csv (a header row of column names, then one row per time step),\n"
    "cuts its rows into windows of T rows, and writes DIR/NAME-train.bin and, when\n"
    "it gets any windows, DIR/NAME-valid.bin. Fields are separated by commas and may\n"
    "be quoted (\"a, b\" with \"\" for a quote); an empty field, nan, NA or N/A is a\n"
    "missing reading; empty lines are skipped. Rows after the last whole window are\n"
    "dropped (and counted). The channels' mean and std are computed over the train\n"
    "windows, and the valid shard carries them too. Errors name FILE:LINE:COLUMN.\n"
    "FILE and the side files must be regular files (the input is read twice; not\n"
    "a pipe or standard input); a line is at most 1 MiB and holds no NUL byte.\n\n"
    "  -o DIR                the directory to write into (created if missing)\n"
    "  --time-steps T        rows per window, 1 to 65536; default 1440\n"
    "  --period SECONDS      seconds per row, recorded in the header; default 60\n"
    "  --name NAME           the shards' name; default FILE's name without .csv;\n"
    "                        1 to 64 bytes of A-Z a-z 0-9 . _ -, not starting\n"
    "                        with a dot\n"
    "  --channels A,B,...    the columns that are channels, in this order; default\n"
    "                        every column but the caption and label columns\n"
    "  --captions FILE       one caption per line, line i for window i\n"
    "  --caption-column NAME the caption of a window is the first non-empty\n"
    "                        value of this column among its rows\n"
    "                        (neither: the windows have empty captions)\n"
    "  --labels FILE         one label name per line, line i for window i\n"
    "  --label-column NAME   a window's label is the first non-empty value of this\n"
    "                        column among its rows; every window needs one\n"
    "  --label-names A,B,... the labels and their order (their numbers); default\n"
    "                        the names found, sorted; another name is an error\n"
    "  --label-prompt NAME=TEXT  the text a zero-shot classifier embeds for label\n"
    "                        NAME (up to 95 bytes); default the name; repeatable\n"
    "  --valid F             the fraction of the windows, the last ones, in the\n"
    "                        valid shard, 0 <= F < 1; default 0.1\n"
    "  --caption-len L       the caption slot, 1 to 4096 bytes; default 256; a\n"
    "                        longer caption is an error\n"
    "  -h, --help            show this help\n";

/* The space-separated names of every option, for the completion script. */
const char *tc_sensor_flag_names(void)
{
    static char names[512];

    if (names[0] == '\0') {
        size_t n = 0;
        for (size_t i = 0; i < NOPTIONS; i++)
            n += (size_t)snprintf(names + n, sizeof(names) - n, "%s%s", i ? " " : "",
                                  options[i].name);
    }
    return names;
}

typedef struct import_opts {
    const char *csv, *dir, *name, *channels, *captions, *caption_col, *labels, *label_col;
    const char *label_names;
    const char **prompts; /* NAME=TEXT, n_prompts of them */
    int n_prompts;
    int T, period;
} import_opts;

typedef struct sensor_args {
    int cmd; /* SYNTH or IMPORT */
    const char *usage, *help_name;
    tc_synth_opts synth;
    import_opts imp;
    int days_seen;
} sensor_args;

static int usage_err(const sensor_args *a, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static int usage_err(const sensor_args *a, const char *fmt, ...)
{
    va_list ap;

    fputs("trainctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nusage: %s\nTry 'trainctl sensor %s --help'.\n", a->usage, a->help_name);
    return TC_USAGE;
}

/* A whole decimal number in [lo, hi] filling the string. */
static int parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    long long v;

    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int parse_fraction(const char *s, double lo, int lo_open, double *out)
{
    char *end;
    double v;

    errno = 0;
    v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v) || v >= 1 || v < lo ||
        (lo_open && v == lo))
        return -1;
    *out = v;
    return 0;
}

/* Stores a string option's value. */
static int store_string(sensor_args *a, int id, const char *name, const char *v)
{
    if (v[0] == '\0')
        return usage_err(a, "%s needs a value", name);
    if (id == O_NAME)
        a->imp.name = v;
    else if (id == O_CHANNELS)
        a->imp.channels = v;
    else if (id == O_CAPTIONS)
        a->imp.captions = v;
    else if (id == O_CAPTION_COLUMN)
        a->imp.caption_col = v;
    else if (id == O_LABELS)
        a->imp.labels = v;
    else if (id == O_LABEL_COLUMN)
        a->imp.label_col = v;
    else
        a->imp.label_names = v;
    return TC_OK;
}

/* Stores one option's value. */
static int store(sensor_args *a, int id, const char *name, const char *v)
{
    int64_t n;

    switch (id) {
    case O_OUT:
        if (v[0] == '\0')
            return usage_err(a, "%s needs a directory", name);
        a->synth.dir = a->imp.dir = v;
        break;
    case O_DAYS:
        if (parse_int(v, 2, MAX_DAYS, &n) != 0)
            return usage_err(a, "--days needs a number from 2 to %d, not '%s'", MAX_DAYS, v);
        a->synth.days = n;
        a->days_seen = 1;
        break;
    case O_SEED:
        if (parse_int(v, 0, INT64_MAX, &n) != 0)
            return usage_err(a, "--seed needs a whole number >= 0, not '%s'", v);
        a->synth.seed = (uint64_t)n;
        break;
    case O_VALID:
        if (parse_fraction(v, 0, a->cmd == SYNTH, &a->synth.valid) != 0)
            return usage_err(a, "--valid needs a fraction %s 0 and below 1, not '%s'",
                             a->cmd == SYNTH ? "above" : "from", v);
        break;
    case O_CAPTION_LEN:
        if (parse_int(v, a->cmd == SYNTH ? 64 : 1, TD_SENSOR_MAX_CAPTION, &n) != 0)
            return usage_err(a, "--caption-len needs a number of bytes from %d to %d, not '%s'",
                             a->cmd == SYNTH ? 64 : 1, TD_SENSOR_MAX_CAPTION, v);
        a->synth.caption_len = (int)n;
        break;
    case O_TIME_STEPS:
        if (parse_int(v, 1, TD_SENSOR_MAX_T, &n) != 0)
            return usage_err(a, "--time-steps needs a number from 1 to %d, not '%s'",
                             TD_SENSOR_MAX_T, v);
        a->imp.T = (int)n;
        break;
    case O_PERIOD:
        if (parse_int(v, 0, TD_SENSOR_MAX_PERIOD, &n) != 0)
            return usage_err(a, "--period needs seconds from 0 to %d, not '%s'",
                             TD_SENSOR_MAX_PERIOD, v);
        a->imp.period = (int)n;
        break;
    case O_LABEL_PROMPT:
        if (strchr(v, '=') == NULL || v[0] == '=')
            return usage_err(a, "--label-prompt needs NAME=TEXT, not '%s'", v);
        a->imp.prompts[a->imp.n_prompts++] = v;
        break;
    default:
        return store_string(a, id, name, v);
    }
    return TC_OK;
}

/* Parses argv (after the subcommand) into a. */
static int parse_args(sensor_args *a, int argc, char **argv, int *help)
{
    int positional = 0;

    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i], *eq, *val;
        size_t len, k;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            *help = 1;
            return TC_OK;
        }
        if (arg[0] != '-' || arg[1] == '\0') {
            if (a->cmd != IMPORT || positional++)
                return usage_err(a, "unexpected argument '%s'", arg);
            a->imp.csv = arg;
            continue;
        }
        eq = strchr(arg, '=');
        len = eq != NULL ? (size_t)(eq - arg) : strlen(arg);
        for (k = 0; k < NOPTIONS; k++)
            if (strlen(options[k].name) == len && memcmp(options[k].name, arg, len) == 0)
                break;
        if (k == NOPTIONS || !(options[k].cmds & (unsigned)a->cmd))
            return usage_err(
                a, k == NOPTIONS ? "unknown option '%s'" : "'%s' is not an option here", arg);
        if (eq != NULL)
            val = eq + 1;
        else if (i + 1 < argc)
            val = argv[++i];
        else
            return usage_err(a, "'%s' needs a value", options[k].name);
        if (store(a, options[k].id, options[k].name, val) != TC_OK)
            return TC_USAGE;
    }
    if (a->synth.dir == NULL)
        return usage_err(a, "missing -o DIR (the directory to write the shards into)");
    if (a->cmd == SYNTH && !a->days_seen)
        return usage_err(a, "missing --days N");
    if (a->cmd == IMPORT && a->imp.csv == NULL)
        return usage_err(a, "missing FILE.csv");
    if (a->imp.captions != NULL && a->imp.caption_col != NULL)
        return usage_err(a, "--captions and --caption-column cannot be used together");
    if (a->imp.labels != NULL && a->imp.label_col != NULL)
        return usage_err(a, "--labels and --label-column cannot be used together");
    if (a->imp.labels == NULL && a->imp.label_col == NULL &&
        (a->imp.label_names != NULL || a->imp.n_prompts > 0))
        return usage_err(a, "--label-names and --label-prompt need --labels or --label-column");
    return TC_OK;
}

/* ---- reading lines and CSV fields ---------------------------------------------------------- */

typedef struct lines {
    FILE *f;
    const char *path;
    char *buf;
    size_t cap;
    int64_t no; /* the line just read, from 1 */
} lines;

/* What a file of that type is, for the refusal of one that is not a regular file. */
static const char *file_kind(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
                         : "not a file";
}

/* Opens path for reading: a regular file only. A FIFO, a device or a socket never ends or
 * cannot be read twice, so it is refused at once (opened non-blocking: a FIFO with no writer
 * does not hang the open). */
static int lines_open(lines *l, const char *path)
{
    struct stat st;
    int fd, flags;

    memset(l, 0, sizeof(*l));
    l->path = path;
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return tc_err(TC_NOINPUT, "%s: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return tc_err(TC_NOINPUT, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return tc_err(TC_NOINPUT,
                      "%s: not a regular file (%s); sensor import reads its input twice: save "
                      "it to a file first",
                      path, file_kind(st.st_mode));
    }
    flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    l->f = fdopen(fd, "r");
    if (l->f == NULL) {
        int e = errno;
        close(fd);
        return tc_err(TC_FAILED, "%s: %s", path, strerror(e));
    }
    return TC_OK;
}

static void lines_close(lines *l)
{
    if (l->f != NULL)
        fclose(l->f);
    free(l->buf);
    l->f = NULL;
    l->buf = NULL;
}

static int lines_rewind(lines *l)
{
    l->no = 0;
    if (fseek(l->f, 0, SEEK_SET) != 0)
        return tc_err(TC_NOINPUT, "%s: cannot read it twice (%s): give a file, not a pipe", l->path,
                      strerror(errno));
    return TC_OK;
}

/* The next line without its line end into l->buf (*len bytes); *eof at the end. The line
 * limit is enforced while reading: l->buf never holds more than CSV_MAX_LINE bytes, whatever
 * the file (a file of zeros with no newline is refused after CSV_MAX_LINE bytes). A NUL byte
 * in a line is refused with its line and column. */
static int lines_next(lines *l, size_t *len, int *eof)
{
    size_t n = 0;
    int c = 0;
    char *nul;

    if (l->buf == NULL) {
        l->buf = malloc(CSV_MAX_LINE + 1);
        if (l->buf == NULL)
            return tc_err(TC_FAILED, "out of memory");
        l->cap = CSV_MAX_LINE + 1;
    }
    errno = 0;
    while ((c = getc_unlocked(l->f)) != EOF && c != '\n') {
        if (n == CSV_MAX_LINE)
            return tc_err(TC_DATAERR, "%s:%lld: longer than %d bytes", l->path,
                          (long long)l->no + 1, CSV_MAX_LINE);
        l->buf[n++] = (char)c;
    }
    if (c == EOF && ferror(l->f))
        return tc_err(TC_NOINPUT, "%s: %s", l->path, strerror(errno));
    *eof = c == EOF && n == 0;
    if (*eof)
        return TC_OK;
    l->no++;
    while (n > 0 && l->buf[n - 1] == '\r')
        n--;
    l->buf[n] = '\0';
    if (l->no == 1 && n >= 3 && memcmp(l->buf, "\xef\xbb\xbf", 3) == 0) { /* a UTF-8 BOM */
        memmove(l->buf, l->buf + 3, n - 2);
        n -= 3;
    }
    if ((nul = memchr(l->buf, '\0', n)) != NULL)
        return tc_err(TC_DATAERR, "%s:%lld:%zu: a NUL byte", l->path, (long long)l->no,
                      (size_t)(nul - l->buf) + 1);
    *len = n;
    return TC_OK;
}

/* One line's fields, unquoted, each NUL-terminated in buf. */
typedef struct fields {
    char *buf;
    size_t buf_cap;
    char **f;
    int *col; /* the byte column each field starts at, from 1 */
    size_t n, cap;
} fields;

static int fields_push(fields *fs, char *s, int col)
{
    if (fs->n == fs->cap) {
        size_t cap = fs->cap ? fs->cap * 2 : 16;
        char **f = realloc(fs->f, cap * sizeof(*f));
        int *c = f != NULL ? realloc(fs->col, cap * sizeof(*c)) : NULL;
        if (f != NULL)
            fs->f = f;
        if (c == NULL)
            return tc_err(TC_FAILED, "out of memory");
        fs->col = c;
        fs->cap = cap;
    }
    fs->f[fs->n] = s;
    fs->col[fs->n] = col;
    fs->n++;
    return TC_OK;
}

/* Splits line s (len bytes) of l into fs. */
static int split_csv(const lines *l, const char *s, size_t len, fields *fs)
{
    size_t i = 0, o = 0;

    if (fs->buf_cap < len + 1) {
        char *b = realloc(fs->buf, len + 1);
        if (b == NULL)
            return tc_err(TC_FAILED, "out of memory");
        fs->buf = b;
        fs->buf_cap = len + 1;
    }
    fs->n = 0;
    for (;;) {
        size_t start = o;
        int col = (int)i + 1;
        if (s[i] == '"') {
            for (i++;; i++) {
                if (i >= len)
                    return tc_err(TC_DATAERR, "%s:%lld:%d: a quote that is never closed", l->path,
                                  (long long)l->no, col);
                if (s[i] == '"' && s[i + 1] == '"')
                    fs->buf[o++] = s[i++];
                else if (s[i] == '"')
                    break;
                else
                    fs->buf[o++] = s[i];
            }
            i++;
            if (i < len && s[i] != ',')
                return tc_err(TC_DATAERR, "%s:%lld:%zu: text after a closing quote", l->path,
                              (long long)l->no, i + 1);
        } else {
            for (; i < len && s[i] != ','; i++) {
                if (s[i] == '"')
                    return tc_err(TC_DATAERR,
                                  "%s:%lld:%zu: a quote inside a field that does not start with "
                                  "one",
                                  l->path, (long long)l->no, i + 1);
                fs->buf[o++] = s[i];
            }
        }
        fs->buf[o++] = '\0'; /* never past len + 1: each field's comma or quotes make room */
        if (fields_push(fs, fs->buf + start, col) != TC_OK)
            return TC_FAILED;
        if (i >= len)
            return TC_OK;
        i++; /* the comma; a line ending in one has an empty last field */
    }
}

static void fields_free(fields *fs)
{
    free(fs->buf);
    free(fs->f);
    free(fs->col);
}

/* s without leading and trailing spaces and tabs, in place. */
static char *trim(char *s)
{
    size_t n;

    while (*s == ' ' || *s == '\t')
        s++;
    n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    return s;
}

/* A reading: a finite float, or NaN for a missing one. -1 when it is neither. */
static int parse_reading(char *s, float *out)
{
    char *end;
    double v;

    s = trim(s);
    if (s[0] == '\0' || strcasecmp(s, "nan") == 0 || strcasecmp(s, "na") == 0 ||
        strcasecmp(s, "n/a") == 0) {
        *out = NAN;
        return 0;
    }
    errno = 0;
    v = strtod(s, &end);
    if (end == s || *end != '\0' || !isfinite(v) || fabs(v) > FLT_MAX)
        return -1;
    *out = (float)v;
    return 0;
}

/* ---- import -------------------------------------------------------------------------------- */

typedef struct importer {
    const import_opts *o;
    int caption_len;
    double valid;
    lines in;
    fields fs;
    size_t ncols;
    int C;
    int chan_col[TD_SENSOR_MAX_CHANNELS]; /* the column of each channel */
    char chan_name[TD_SENSOR_MAX_CHANNELS][TD_SENSOR_NAME_BYTES];
    int cap_col, lab_col; /* -1: none */
    int time_col;         /* a time column left out of the channels (no --channels); -1 */
    char time_name[64];
    int64_t rows, windows;
    /* labels: names (sorted, or --label-names' order), and each window's label */
    char *names[TD_SENSOR_MAX_LABELS];
    const char *prompts[TD_SENSOR_MAX_LABELS];
    int n_labels, fixed;
    int32_t *win_label; /* per window; grows in pass 1 */
    int64_t win_cap;
    int64_t win_line; /* the line the current window started at */
} importer;

static int find_label(const importer *im, const char *name)
{
    for (int k = 0; k < im->n_labels; k++)
        if (strcmp(im->names[k], name) == 0)
            return k;
    return -1;
}

/* A label name from the input (file:line:col in where): its index, adding it to the names
 * unless they are fixed by --label-names. */
static int intern_label(importer *im, char *name, const char *where, int *out)
{
    int k;

    name = trim(name);
    k = find_label(im, name);
    if (k >= 0) {
        *out = k;
        return TC_OK;
    }
    if (im->fixed)
        return tc_err(TC_DATAERR, "%s: label '%s' is not among --label-names", where, name);
    if (strlen(name) >= TD_SENSOR_NAME_BYTES)
        return tc_err(TC_DATAERR, "%s: label '%s' is longer than %d bytes", where, name,
                      TD_SENSOR_NAME_BYTES - 1);
    if (im->n_labels >= TD_SENSOR_MAX_LABELS)
        return tc_err(TC_DATAERR, "%s: more than %d different labels", where, TD_SENSOR_MAX_LABELS);
    im->names[im->n_labels] = strdup(name);
    if (im->names[im->n_labels] == NULL)
        return tc_err(TC_FAILED, "out of memory");
    *out = im->n_labels++;
    return TC_OK;
}

/* Records window w's label k (-1: none yet). */
static int set_window_label(importer *im, int64_t w, int k)
{
    if (w >= im->win_cap) {
        int64_t cap = im->win_cap ? im->win_cap * 2 : 64;
        int32_t *g = realloc(im->win_label, (size_t)cap * sizeof(*g));
        if (g == NULL)
            return tc_err(TC_FAILED, "out of memory");
        for (int64_t i = im->win_cap; i < cap; i++)
            g[i] = -1;
        im->win_label = g;
        im->win_cap = cap;
    }
    if (im->win_label[w] < 0)
        im->win_label[w] = k;
    return TC_OK;
}

/* The column named name in the header, or -1. */
static int column_of(const fields *hdr, const char *name)
{
    for (size_t i = 0; i < hdr->n; i++)
        if (strcmp(hdr->f[i], name) == 0)
            return (int)i;
    return -1;
}

static int add_channel(importer *im, const fields *hdr, int c)
{
    const char *name = hdr->f[c];

    if (c == im->cap_col || c == im->lab_col)
        return tc_err(TC_USAGE, "--channels: '%s' is the caption or label column", name);
    for (int k = 0; k < im->C; k++)
        if (strcmp(im->chan_name[k], name) == 0)
            return tc_err(TC_DATAERR, "%s:1:%d: channel '%s' twice", im->in.path, hdr->col[c],
                          name);
    if (im->C >= TD_SENSOR_MAX_CHANNELS)
        return tc_err(TC_DATAERR, "%s:1: more than %d channels", im->in.path,
                      TD_SENSOR_MAX_CHANNELS);
    if (name[0] == '\0' || strlen(name) >= TD_SENSOR_NAME_BYTES)
        return tc_err(TC_DATAERR, "%s:1:%d: a channel's name must be 1 to %d bytes, not '%s'",
                      im->in.path, hdr->col[c], TD_SENSOR_NAME_BYTES - 1, name);
    for (const char *p = name; *p; p++)
        if (*p < 0x20 || *p > 0x7e)
            return tc_err(TC_DATAERR, "%s:1:%d: channel name '%s' is not printable ASCII",
                          im->in.path, hdr->col[c], name);
    snprintf(im->chan_name[im->C], sizeof(im->chan_name[0]), "%s", name);
    im->chan_col[im->C++] = c;
    return TC_OK;
}

/* "a, b, c": the header's columns, for a message naming one that is not there. */
static const char *column_list(const fields *hdr, char *buf, size_t size)
{
    size_t n = 0;

    buf[0] = '\0';
    for (size_t i = 0; i < hdr->n && n + 1 < size; i++) {
        int k = snprintf(buf + n, size - n, "%s'%s'", i ? ", " : "", hdr->f[i]);
        n = k > 0 && n + (size_t)k < size ? n + (size_t)k : size - 1;
    }
    return buf;
}

/* A column that holds the time, by its name (any case): time, timestamp, datetime, date, ts,
 * epoch, unix_time, unix_timestamp. Without --channels it is no channel. */
static int is_time_column(const char *name)
{
    static const char *const names[] = {"time", "timestamp", "datetime",  "date",
                                        "ts",   "epoch",     "unix_time", "unix_timestamp"};

    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcasecmp(name, names[i]) == 0)
            return 1;
    return 0;
}

/* Reads the header row: the columns and their roles. */
static int read_header(importer *im, fields *hdr)
{
    const import_opts *o = im->o;
    char cols[1024];
    size_t len;
    int eof, rc;

    do {
        if ((rc = lines_next(&im->in, &len, &eof)) != TC_OK)
            return rc;
    } while (!eof && len == 0);
    if (eof)
        return tc_err(TC_DATAERR, "%s: no header row", im->in.path);
    if ((rc = split_csv(&im->in, im->in.buf, len, hdr)) != TC_OK)
        return rc;
    for (size_t i = 0; i < hdr->n; i++)
        hdr->f[i] = trim(hdr->f[i]);
    im->ncols = hdr->n;
    im->cap_col = im->lab_col = -1;
    if (o->caption_col != NULL && (im->cap_col = column_of(hdr, o->caption_col)) < 0)
        return tc_err(TC_DATAERR,
                      "%s:1: no column named '%s' (--caption-column); the columns are %s",
                      im->in.path, o->caption_col, column_list(hdr, cols, sizeof(cols)));
    if (o->label_col != NULL && (im->lab_col = column_of(hdr, o->label_col)) < 0)
        return tc_err(TC_DATAERR, "%s:1: no column named '%s' (--label-column); the columns are %s",
                      im->in.path, o->label_col, column_list(hdr, cols, sizeof(cols)));
    im->time_col = -1;
    if (o->channels == NULL) {
        for (size_t i = 0; i < hdr->n; i++) {
            if ((int)i == im->cap_col || (int)i == im->lab_col)
                continue;
            if (im->time_col < 0 && is_time_column(hdr->f[i])) {
                im->time_col = (int)i;
                snprintf(im->time_name, sizeof(im->time_name), "%s", hdr->f[i]);
                continue;
            }
            if ((rc = add_channel(im, hdr, (int)i)) != TC_OK)
                return rc;
        }
    } else {
        char *list = strdup(o->channels), *save = NULL;
        rc = list == NULL ? tc_err(TC_FAILED, "out of memory") : TC_OK;
        for (char *t = list != NULL ? strtok_r(list, ",", &save) : NULL; t != NULL && rc == TC_OK;
             t = strtok_r(NULL, ",", &save)) {
            int c = column_of(hdr, trim(t));
            rc = c < 0 ? tc_err(TC_DATAERR,
                                "%s:1: no column named '%s' (--channels); the columns are %s",
                                im->in.path, t, column_list(hdr, cols, sizeof(cols)))
                       : add_channel(im, hdr, c);
        }
        free(list);
        if (rc != TC_OK)
            return rc;
    }
    if (im->C == 0)
        return tc_err(TC_DATAERR, "%s:1: no channel columns", im->in.path);
    return TC_OK;
}

/* Pass 1 over one data row (already split): checks its fields; collects labels from the label
 * column. row is the data row's index. */
static int check_row(importer *im, int64_t row)
{
    const fields *fs = &im->fs;
    char where[600];
    float v;
    int k, rc;

    if (fs->n != im->ncols)
        return tc_err(TC_DATAERR, "%s:%lld: %zu fields, but the header has %zu", im->in.path,
                      (long long)im->in.no, fs->n, im->ncols);
    for (int c = 0; c < im->C; c++)
        if (parse_reading(fs->f[im->chan_col[c]], &v) != 0)
            return tc_err(TC_DATAERR, "%s:%lld:%d: channel %s: '%s' is not a number%s", im->in.path,
                          (long long)im->in.no, fs->col[im->chan_col[c]], im->chan_name[c],
                          fs->f[im->chan_col[c]],
                          im->o->channels == NULL
                              ? " (every column is a channel: --channels names those that are)"
                              : "");
    if (im->cap_col >= 0 && strlen(fs->f[im->cap_col]) > (size_t)im->caption_len)
        return tc_err(TC_DATAERR,
                      "%s:%lld:%d: a caption of %zu bytes, longer than --caption-len %d",
                      im->in.path, (long long)im->in.no, fs->col[im->cap_col],
                      strlen(fs->f[im->cap_col]), im->caption_len);
    if (im->lab_col >= 0 && trim(fs->f[im->lab_col])[0] != '\0') {
        snprintf(where, sizeof(where), "%s:%lld:%d", im->in.path, (long long)im->in.no,
                 fs->col[im->lab_col]);
        if ((rc = intern_label(im, fs->f[im->lab_col], where, &k)) != TC_OK)
            return rc;
        return set_window_label(im, row / im->o->T, k);
    }
    return im->lab_col >= 0 ? set_window_label(im, row / im->o->T, -1) : TC_OK;
}

/* Pass 1: every row checked, rows and windows counted, the label column's names collected. */
static int first_pass(importer *im)
{
    size_t len;
    int eof, rc;

    for (;;) {
        if ((rc = lines_next(&im->in, &len, &eof)) != TC_OK)
            return rc;
        if (eof)
            break;
        if (len == 0)
            continue;
        if (im->rows % im->o->T == 0)
            im->win_line = im->in.no;
        if ((rc = split_csv(&im->in, im->in.buf, len, &im->fs)) != TC_OK ||
            (rc = check_row(im, im->rows)) != TC_OK)
            return rc;
        im->rows++;
        if (im->rows / im->o->T > TD_SENSOR_MAX_SAMPLES)
            return tc_err(TC_DATAERR, "%s:%lld: more than a shard's %d windows", im->in.path,
                          (long long)im->in.no, TD_SENSOR_MAX_SAMPLES);
        if (im->lab_col >= 0 && im->rows % im->o->T == 0 &&
            im->win_label[im->rows / im->o->T - 1] < 0)
            return tc_err(TC_DATAERR,
                          "%s: the window of lines %lld to %lld has no label in "
                          "column '%s'",
                          im->in.path, (long long)im->win_line, (long long)im->in.no,
                          im->o->label_col);
    }
    im->windows = im->rows / im->o->T;
    if (im->windows == 0)
        return tc_err(TC_DATAERR, "%s: %lld rows, fewer than one window of %d (--time-steps)",
                      im->in.path, (long long)im->rows, im->o->T);
    return TC_OK;
}

/* A captions or labels file: exactly one line per window. With labels, each line's label is
 * interned and recorded for its window. */
static int check_side_file(importer *im, const char *path, int is_labels)
{
    lines l;
    size_t len;
    int eof, rc, k;
    int64_t n = 0;
    char where[600];

    if ((rc = lines_open(&l, path)) != TC_OK)
        return rc;
    for (;;) {
        if ((rc = lines_next(&l, &len, &eof)) != TC_OK || eof)
            break;
        snprintf(where, sizeof(where), "%s:%lld", path, (long long)l.no);
        if (n >= im->windows) {
            n++;
            continue;
        }
        if (!is_labels && len > (size_t)im->caption_len) {
            rc = tc_err(TC_DATAERR, "%s: a caption of %zu bytes, longer than --caption-len %d",
                        where, len, im->caption_len);
            break;
        }
        if (is_labels && trim(l.buf)[0] == '\0') {
            rc = tc_err(TC_DATAERR, "%s: an empty label", where);
            break;
        }
        if (is_labels && ((rc = intern_label(im, l.buf, where, &k)) != TC_OK ||
                          (rc = set_window_label(im, n, k)) != TC_OK))
            break;
        n++;
    }
    lines_close(&l);
    if (rc == TC_OK && n != im->windows)
        rc = tc_err(TC_DATAERR, "%s: %lld lines, but %s has %lld windows of %d rows (%lld rows)",
                    path, (long long)n, im->in.path, (long long)im->windows, im->o->T,
                    (long long)im->rows);
    return rc;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The label names in their final order (sorted unless fixed), windows' labels renumbered to
 * it, and the prompts from --label-prompt. */
static int settle_labels(importer *im)
{
    char *before[TD_SENSOR_MAX_LABELS];
    int map[TD_SENSOR_MAX_LABELS];

    if (!im->fixed) {
        memcpy(before, im->names, sizeof(before));
        qsort(im->names, (size_t)im->n_labels, sizeof(im->names[0]), cmp_str);
        for (int k = 0; k < im->n_labels; k++)
            map[k] = find_label(im, before[k]);
        for (int64_t w = 0; im->win_label != NULL && w < im->windows; w++)
            im->win_label[w] = map[im->win_label[w]];
    }
    for (int i = 0; i < im->o->n_prompts; i++) {
        const char *p = im->o->prompts[i], *eq = strchr(p, '=');
        int k;
        char name[TD_SENSOR_NAME_BYTES];
        snprintf(name, sizeof(name), "%.*s", (int)(eq - p), p);
        k = (size_t)(eq - p) < sizeof(name) ? find_label(im, name) : -1;
        if (k < 0)
            return tc_err(TC_USAGE, "--label-prompt %s: no label named '%.*s'", p, (int)(eq - p),
                          p);
        if (strlen(eq + 1) >= TD_SENSOR_PROMPT_BYTES)
            return tc_err(TC_USAGE, "--label-prompt %s: the prompt is longer than %d bytes", p,
                          TD_SENSOR_PROMPT_BYTES - 1);
        im->prompts[k] = eq + 1;
    }
    return TC_OK;
}

/* --label-names: the fixed label list. */
static int fixed_labels(importer *im)
{
    char *list = strdup(im->o->label_names), *save = NULL;
    int rc = list == NULL ? tc_err(TC_FAILED, "out of memory") : TC_OK, k;

    for (char *t = list != NULL ? strtok_r(list, ",", &save) : NULL; t != NULL && rc == TC_OK;
         t = strtok_r(NULL, ",", &save)) {
        if (find_label(im, trim(t)) >= 0)
            rc = tc_err(TC_USAGE, "--label-names: '%s' twice", t);
        else
            rc = intern_label(im, t, "--label-names", &k);
    }
    free(list);
    im->fixed = 1;
    if (rc == TC_OK && im->n_labels == 0)
        rc = tc_err(TC_USAGE, "--label-names: no names");
    return rc == TC_DATAERR ? TC_USAGE : rc;
}

/* Both writers of an import. */
typedef struct outputs {
    td_sensor_writer *w[2]; /* train, valid (NULL: none) */
    char path[2][4096];
    int64_t n[2];
    int64_t counts[2][TD_SENSOR_MAX_LABELS];
} outputs;

static int open_outputs(importer *im, outputs *out)
{
    const char *split_name[2] = {"train", "valid"};
    const char *names[TD_SENSOR_MAX_LABELS];
    td_sensor_header h = {.T = im->o->T,
                          .C = im->C,
                          .caption_len = im->caption_len,
                          .n_labels = im->n_labels,
                          .period_s = im->o->period};
    td_error_t err = {0};
    int64_t nv = llround((double)im->windows * im->valid);

    /* At least one valid window when there are two or more (as synth's split): a few windows
     * still get a valid file, rather than none said nowhere. */
    if (nv == 0 && im->valid > 0 && im->windows >= 2)
        nv = 1;
    out->n[1] = nv >= im->windows ? im->windows - 1 : nv;
    out->n[0] = im->windows - out->n[1];
    for (int c = 0; c < im->C; c++)
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), "%s", im->chan_name[c]);
    for (int k = 0; k < im->n_labels; k++)
        names[k] = im->names[k];
    if (mkdir(im->o->dir, 0777) != 0 && errno != EEXIST)
        return tc_err(TC_CANTCREAT, "%s: cannot create the directory: %s", im->o->dir,
                      strerror(errno));
    for (int s = 0; s < 2; s++) {
        if (out->n[s] == 0)
            continue;
        if (snprintf(out->path[s], sizeof(out->path[s]), "%s/%s-%s.bin", im->o->dir, im->o->name,
                     split_name[s]) >= (int)sizeof(out->path[s]))
            return tc_err(TC_USAGE, "%s: the output's name is too long", im->o->dir);
        h.N = out->n[s];
        h.split = s == 0 ? TD_SENSOR_SPLIT_TRAIN : TD_SENSOR_SPLIT_VALID;
        if (td_sensor_writer_open(&out->w[s], out->path[s], &h, names, im->prompts, &err) != 0)
            return tc_err(err.code == TD_EINVAL ? TC_DATAERR : TC_CANTCREAT, "%s", err.msg);
    }
    return TC_OK;
}

/* Pass 2: the windows, into the writers. */
static int second_pass(importer *im, outputs *out)
{
    size_t len, cells = (size_t)im->o->T * (size_t)im->C;
    float *grid = malloc(cells * sizeof(float));
    char *cap = malloc((size_t)im->caption_len + 1);
    lines side = {0};
    td_error_t err = {0};
    int64_t row = 0, w = 0;
    int eof, rc, have_cap = 0;

    rc = grid == NULL || cap == NULL ? tc_err(TC_FAILED, "out of memory") : TC_OK;
    im->fixed = 1; /* the labels were settled by the first pass */
    if (rc == TC_OK && im->o->captions != NULL)
        rc = lines_open(&side, im->o->captions);
    if (rc == TC_OK)
        rc = lines_rewind(&im->in);
    for (int skip = 1; rc == TC_OK && skip;) /* the header row */
        if ((rc = lines_next(&im->in, &len, &eof)) == TC_OK)
            skip = !eof && len == 0;
    while (rc == TC_OK && w < im->windows) {
        int t = (int)(row % im->o->T), s;
        size_t cap_len = 0;
        if ((rc = lines_next(&im->in, &len, &eof)) != TC_OK)
            break;
        if (eof) {
            rc = tc_err(TC_DATAERR, "%s: the file changed while it was read", im->in.path);
            break;
        }
        if (len == 0)
            continue;
        if ((rc = split_csv(&im->in, im->in.buf, len, &im->fs)) != TC_OK ||
            (rc = check_row(im, row)) != TC_OK)
            break;
        for (int c = 0; c < im->C; c++)
            parse_reading(im->fs.f[im->chan_col[c]], &grid[(size_t)t * im->C + c]);
        if (t == 0)
            have_cap = 0;
        if (im->cap_col >= 0 && !have_cap && im->fs.f[im->cap_col][0] != '\0') {
            snprintf(cap, (size_t)im->caption_len + 1, "%s", im->fs.f[im->cap_col]);
            have_cap = 1;
        }
        row++;
        if (t != im->o->T - 1)
            continue;
        if (side.f != NULL) {
            if ((rc = lines_next(&side, &cap_len, &eof)) != TC_OK)
                break;
            snprintf(cap, (size_t)im->caption_len + 1, "%s", eof ? "" : side.buf);
            have_cap = 1;
        }
        cap_len = have_cap ? strlen(cap) : 0;
        s = w < out->n[0] ? 0 : 1;
        if (td_sensor_writer_add(out->w[s], grid, cap, cap_len,
                                 im->n_labels > 0 ? im->win_label[w] : -1, &err) != 0) {
            rc = tc_err(err.code == TD_EINVAL ? TC_DATAERR : TC_CANTCREAT, "%s", err.msg);
            break;
        }
        if (im->n_labels > 0)
            out->counts[s][im->win_label[w]]++;
        w++;
    }
    lines_close(&side);
    free(grid);
    free(cap);
    return rc;
}

static int finish_outputs(importer *im, outputs *out)
{
    float mean[TD_SENSOR_MAX_CHANNELS], std[TD_SENSOR_MAX_CHANNELS];
    td_error_t err = {0};

    td_sensor_writer_stats(out->w[0], mean, std);
    for (int s = 0; s < 2; s++)
        if (out->w[s] != NULL && td_sensor_writer_finish(out->w[s], mean, std, &err) != 0)
            return tc_err(TC_CANTCREAT, "%s", err.msg);
    printf("sensor import: %lld windows in %s", (long long)out->n[0], out->path[0]);
    if (out->n[1] > 0)
        printf(", %lld in %s", (long long)out->n[1], out->path[1]);
    if (out->n[1] == 0)
        printf(" and no valid file (%s)",
               im->valid > 0 ? "one window: the valid split needs two" : "--valid 0");
    printf("; %d channels (", im->C);
    for (int c = 0; c < im->C; c++)
        printf("%s%s", c ? ", " : "", im->chan_name[c]);
    printf("), %d rows a window", im->o->T);
    if (im->time_col >= 0)
        printf("; column '%s' taken as the time, not a channel", im->time_name);
    if (im->rows % im->o->T != 0)
        printf("; the last %lld rows dropped (less than a window)",
               (long long)(im->rows % im->o->T));
    if (im->n_labels > 0)
        printf("; labels (train+valid):");
    for (int k = 0; k < im->n_labels; k++)
        printf(" %s %lld+%lld", im->names[k], (long long)out->counts[0][k],
               (long long)out->counts[1][k]);
    printf("\n");
    return tc_flush_stdout();
}

/* The default name: FILE's base name without a .csv ending. */
static const char *default_name(const char *csv, char *buf, size_t size)
{
    const char *base = strrchr(csv, '/');
    size_t n;

    base = base != NULL ? base + 1 : csv;
    n = strlen(base);
    if (n > 4 && strcasecmp(base + n - 4, ".csv") == 0)
        n -= 4;
    snprintf(buf, size, "%.*s", (int)n, base);
    return buf;
}

/* A shard name is a name, not a path: 1 to MAX_NAME bytes of letters, digits, '.', '_' and
 * '-', not starting with a dot. 0 or -1. */
static int check_name(const char *name)
{
    size_t n = strlen(name);

    if (n == 0 || n > MAX_NAME || name[0] == '.')
        return -1;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9') || name[i] == '.' || name[i] == '_' ||
              name[i] == '-'))
            return -1;
    return 0;
}

static int sensor_import(const import_opts *o_in, int caption_len, double valid)
{
    import_opts o = *o_in;
    importer im;
    fields hdr = {0};
    outputs out;
    char name[256];
    int rc;

    memset(&im, 0, sizeof(im));
    memset(&out, 0, sizeof(out));
    if (o.name != NULL && check_name(o.name) != 0)
        return tc_err(TC_USAGE,
                      "--name '%s': a name is 1 to %d bytes of letters, digits, '.', '_' and '-', "
                      "not starting with a dot",
                      o.name, MAX_NAME);
    if (o.name == NULL && check_name(default_name(o.csv, name, sizeof(name))) != 0)
        return tc_err(TC_USAGE,
                      "%s: the default name '%s' is not 1 to %d bytes of letters, digits, '.', "
                      "'_' and '-' not starting with a dot: give --name",
                      o.csv, name, MAX_NAME);
    if (o.name == NULL)
        o.name = name;
    im.o = &o;
    im.caption_len = caption_len;
    im.valid = valid;
    if ((rc = lines_open(&im.in, o.csv)) != TC_OK)
        return rc;
    if (o.label_names != NULL && (rc = fixed_labels(&im)) != TC_OK)
        goto out;
    if ((rc = read_header(&im, &hdr)) != TC_OK || (rc = first_pass(&im)) != TC_OK)
        goto out;
    if (o.captions != NULL && (rc = check_side_file(&im, o.captions, 0)) != TC_OK)
        goto out;
    if (o.labels != NULL && (rc = check_side_file(&im, o.labels, 1)) != TC_OK)
        goto out;
    if ((rc = settle_labels(&im)) != TC_OK)
        goto out;
    if ((rc = open_outputs(&im, &out)) == TC_OK)
        rc = second_pass(&im, &out);
    if (rc == TC_OK)
        rc = finish_outputs(&im, &out);
out:
    for (int s = 0; s < 2; s++)
        td_sensor_writer_free(out.w[s]);
    for (int k = 0; k < im.n_labels; k++)
        free(im.names[k]);
    free(im.win_label);
    fields_free(&hdr);
    fields_free(&im.fs);
    lines_close(&im.in);
    return rc;
}

/* ---- the verb ------------------------------------------------------------------------------ */

int tc_sensor(int argc, char **argv)
{
    sensor_args a = {0};
    int help = 0, rc;

    if (argc < 1 || strcmp(argv[0], "-h") == 0 || strcmp(argv[0], "--help") == 0) {
        if (argc < 1) {
            fputs("trainctl: sensor needs synth or import\n", stderr);
            fputs(sensor_help, stderr);
            return TC_USAGE;
        }
        fputs(sensor_help, stdout);
        return TC_OK;
    }
    if (strcmp(argv[0], "synth") == 0) {
        a.cmd = SYNTH;
        a.usage = SYNTH_USAGE;
    } else if (strcmp(argv[0], "import") == 0) {
        a.cmd = IMPORT;
        a.usage = IMPORT_USAGE;
    } else {
        fprintf(stderr, "trainctl: sensor: unknown subcommand '%s'; synth or import\n", argv[0]);
        fputs(sensor_help, stderr);
        return TC_USAGE;
    }
    a.help_name = argv[0];
    a.synth.seed = 1;
    a.synth.valid = DEFAULT_VALID;
    a.synth.caption_len = DEFAULT_CAPTION_LEN;
    a.imp.T = 1440;
    a.imp.period = 60;
    a.imp.prompts = calloc((size_t)argc, sizeof(*a.imp.prompts));
    if (a.imp.prompts == NULL)
        return tc_err(TC_FAILED, "out of memory");
    rc = parse_args(&a, argc - 1, argv + 1, &help);
    if (rc == TC_OK && help)
        fputs(a.cmd == SYNTH ? synth_help : import_help, stdout);
    else if (rc == TC_OK && a.cmd == SYNTH)
        rc = tc_sensor_synth(&a.synth);
    else if (rc == TC_OK)
        rc = sensor_import(&a.imp, a.synth.caption_len, a.synth.valid);
    free(a.imp.prompts);
    return rc;
}
