/* trainctl: the command-line client of traind. This file holds main(): the global options,
 * the table of verbs with the flags each accepts and its help text, and the parsing of a
 * verb's arguments into a tc_opts. The verbs themselves live in verbs.c and watch.c. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client.h"

/* Flags a verb may accept. */
enum { F_SET = 1, F_SINCE = 2, F_KEYS = 4, F_JSON = 8, F_CSV = 16, F_SUMMARY = 32 };

/* The one positional argument a verb takes. */
enum { ARG_NONE, ARG_JOB, ARG_FILE };

typedef struct flag {
    const char *name;
    unsigned bit;
    int takes_value;
} flag;

static const flag flags[] = {
    {"--set", F_SET, 1},   {"--since", F_SINCE, 1}, {"--keys", F_KEYS, 1},
    {"--json", F_JSON, 0}, {"--csv", F_CSV, 0},     {"--summary", F_SUMMARY, 0},
};

typedef struct verb {
    const char *name;
    int (*run)(const tc_opts *o);
    unsigned flags; /* the F_ bits it accepts */
    int arg;        /* ARG_ */
    const char *usage;
    const char *brief; /* one line for trainctl --help */
    const char *help;  /* what it does and what each of its flags means */
} verb;

static const verb verbs[] = {
    {
        .name = "submit",
        .run = tc_submit,
        .flags = F_SET,
        .arg = ARG_FILE,
        .usage = "trainctl submit FILE [--set KEY=VALUE]...",
        .brief = "submit a job; prints its id",
        .help = "Submits the job described by the JSON object in FILE (\"-\" reads\n"
                "standard input) and prints the new job's id alone on standard output.\n\n"
                "  --set KEY=VALUE  change one key of the job before it is sent; may be\n"
                "                   repeated. A dotted KEY reaches into nested objects\n"
                "                   (--set optim.lr=3e-4). VALUE is read as JSON when it\n"
                "                   is JSON (1, 3e-4, true, [784,10], \"text\", null), else\n"
                "                   taken as a string (--set name=baseline).\n"
                "  -h, --help       show this help\n",
    },
    {
        .name = "watch",
        .run = tc_watch,
        .flags = F_SINCE | F_KEYS | F_JSON,
        .arg = ARG_JOB,
        .usage = "trainctl watch JOB [--since STEP] [--keys A,B] [--json]",
        .brief = "follow a job until it ends",
        .help = "Follows job JOB until it ends, then prints how it ended. On a terminal\n"
                "this is a live progress line (step, loss, steps/s, ETA, epoch) with\n"
                "evaluation results printed above it; otherwise one line per metric row\n"
                "(\"step 12 train_loss 0.53\") and per state change (\"state running step\n"
                "12/1407\"). Exits 0 when the job succeeded, 1 when it failed or was\n"
                "cancelled.\n\n"
                "  --since STEP  start from step STEP rather than from the job's first row\n"
                "  --keys A,B    only the metrics named (comma-separated)\n"
                "  --json        one JSON object per line for each row\n"
                "                ({\"job\",\"key\",\"step\",\"value\",\"time\"}), and a last\n"
                "                line {\"job\",\"state\",\"error\"} when the job ends\n"
                "  -h, --help    show this help\n",
    },
    {
        .name = "status",
        .run = tc_status,
        .flags = F_JSON,
        .arg = ARG_JOB,
        .usage = "trainctl status JOB [--json]",
        .brief = "show one job",
        .help = "Shows job JOB: its state, progress, devices, times, error and latest\n"
                "metrics.\n\n"
                "  --json      print the whole job, with its spec, as one JSON object\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "ls",
        .run = tc_ls,
        .flags = F_JSON,
        .arg = ARG_NONE,
        .usage = "trainctl ls [--json]",
        .brief = "list the jobs",
        .help = "Lists the jobs, oldest first: id, name, state, step, devices, age and the\n"
                "latest loss and accuracy.\n\n"
                "  --json      print a JSON array of the jobs\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "cancel",
        .run = tc_cancel,
        .flags = 0,
        .arg = ARG_JOB,
        .usage = "trainctl cancel JOB",
        .brief = "cancel a job",
        .help = "Cancels job JOB. A queued job leaves the queue at once; a running job\n"
                "stops at its next step (trainctl watch JOB shows it end).\n\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "metrics",
        .run = tc_metrics,
        .flags = F_KEYS | F_CSV | F_JSON | F_SUMMARY,
        .arg = ARG_JOB,
        .usage = "trainctl metrics JOB [--keys A,B] [--csv|--json] [--summary]",
        .brief = "print a job's metrics",
        .help = "Prints every stored metric row of job JOB in (step, key) order, as CSV\n"
                "with the header job,key,step,value,time.\n\n"
                "  --keys A,B  only the metrics named (comma-separated)\n"
                "  --csv       CSV output (the default)\n"
                "  --json      a JSON array of {\"job\",\"key\",\"step\",\"value\",\"time\"}\n"
                "  --summary   per metric: count, last value (at the highest step), min and\n"
                "              max; a table, or CSV with --csv, or a JSON array with --json\n"
                "  -h, --help  show this help\n",
    },
};

#define NVERBS (sizeof(verbs) / sizeof(verbs[0]))
#define NFLAGS (sizeof(flags) / sizeof(flags[0]))

/* Set by watch.c while a progress line without its newline is on stdout. */
int tc_line_open;

int tc_err(int status, const char *fmt, ...)
{
    va_list ap;

    if (tc_line_open) {
        fputc('\n', stdout);
        fflush(stdout);
        tc_line_open = 0;
    }
    fputs("trainctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return status;
}

static void print_main_help(FILE *f)
{
    size_t i;

    fputs("usage: trainctl [--socket PATH] VERB [ARGS]\n"
          "       trainctl VERB --help\n\n"
          "Controls traind, the training daemon.\n\nVerbs:\n",
          f);
    for (i = 0; i < NVERBS; i++)
        fprintf(f, "  %s\n      %s\n", verbs[i].usage + strlen("trainctl "), verbs[i].brief);
    fputs("\nOptions:\n"
          "  --socket PATH  traind's control socket; default $TRAIND_SOCKET, else\n"
          "                 " TC_DEFAULT_SOCKET "\n"
          "  -h, --help     show this help\n"
          "  --version      show trainctl's version\n\n"
          "Exit status: 0 success; 1 the job failed or was cancelled (watch), or traind\n"
          "refused the request; 64 usage error; 65 invalid job file; 66 job file missing or\n"
          "unreadable; 69 traind unreachable; 76 protocol error.\n",
          f);
}

static void print_verb_help(const verb *v)
{
    printf("usage: %s\n\n%s", v->usage, v->help);
}

/* A usage error: the message, the usage line and where to read more, on stderr. */
static int usage_error(const verb *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int usage_error(const verb *v, const char *fmt, ...)
{
    va_list ap;

    fputs("trainctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (v != NULL)
        fprintf(stderr, "\nusage: %s\nTry 'trainctl %s --help'.\n", v->usage, v->name);
    else
        fputs("\nusage: trainctl [--socket PATH] VERB [ARGS]\nTry 'trainctl --help'.\n", stderr);
    return TC_USAGE;
}

/* Parses a non-negative decimal integer filling the whole string. */
static int parse_count(const char *s, int64_t *out)
{
    char *end;
    long long v;

    if (*s < '0' || *s > '9')
        return -1;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

/* KEY=VALUE where KEY is one or more non-empty names joined by dots. */
static int valid_key(const char *arg)
{
    size_t len = strcspn(arg, "=");
    size_t i;

    if (arg[len] != '=' || len == 0 || arg[0] == '.' || arg[len - 1] == '.')
        return 0;
    for (i = 1; i < len; i++)
        if (arg[i] == '.' && arg[i - 1] == '.')
            return 0;
    return 1;
}

static const flag *find_flag(const char *arg, size_t len)
{
    size_t i;

    for (i = 0; i < NFLAGS; i++)
        if (strlen(flags[i].name) == len && memcmp(flags[i].name, arg, len) == 0)
            return &flags[i];
    return NULL;
}

/* Stores one flag's value into o. */
static int store_flag(const verb *v, const flag *fl, const char *val, tc_opts *o)
{
    const char *p;

    switch (fl->bit) {
    case F_SET:
        if (!valid_key(val))
            return usage_error(v, "--set needs KEY=VALUE with a KEY like a.b.c, not '%s'", val);
        o->sets[o->nsets++] = val;
        break;
    case F_SINCE:
        if (parse_count(val, &o->since) != 0)
            return usage_error(v, "--since needs a step number, not '%s'", val);
        break;
    case F_KEYS:
        for (p = val; *p == ','; p++)
            ;
        if (*p == '\0')
            return usage_error(v, "--keys needs metric names, not '%s'", val);
        o->keys = val;
        break;
    case F_JSON:
        o->json = 1;
        break;
    case F_CSV:
        o->csv = 1;
        break;
    case F_SUMMARY:
        o->summary = 1;
        break;
    }
    return TC_OK;
}

/* Handles argv[*i], a flag, taking its value from "=VALUE" or the next argument. */
static int parse_flag(const verb *v, int argc, char **argv, int *i, tc_opts *o)
{
    const char *arg = argv[*i];
    const char *eq = strchr(arg, '=');
    size_t len = eq != NULL ? (size_t)(eq - arg) : strlen(arg);
    const flag *fl = find_flag(arg, len);

    if (fl == NULL || (v->flags & fl->bit) == 0)
        return usage_error(v, fl == NULL ? "unknown option '%s'" : "'%s' is not an option here",
                           arg);
    if (!fl->takes_value) {
        if (eq != NULL)
            return usage_error(v, "'%s' takes no value", fl->name);
        return store_flag(v, fl, NULL, o);
    }
    if (eq != NULL)
        return store_flag(v, fl, eq + 1, o);
    if (*i + 1 >= argc)
        return usage_error(v, "'%s' needs a value", fl->name);
    *i += 1;
    return store_flag(v, fl, argv[*i], o);
}

/* Takes the verb's positional argument. */
static int parse_positional(const verb *v, const char *arg, int *seen, tc_opts *o)
{
    if (v->arg == ARG_NONE || *seen)
        return usage_error(v, "unexpected argument '%s'", arg);
    *seen = 1;
    if (v->arg == ARG_FILE) {
        o->file = arg;
        return TC_OK;
    }
    if (parse_count(arg, &o->job) != 0)
        return usage_error(v, "JOB must be a job id (a number), not '%s'", arg);
    return TC_OK;
}

/* Parses the verb's arguments, argv[first..argc). Sets *help when --help was asked for. */
static int parse_verb_args(const verb *v, int argc, char **argv, int first, tc_opts *o, int *help)
{
    int i, seen = 0, rest = 0, rc = TC_OK;

    for (i = first; i < argc && rc == TC_OK && !*help; i++) {
        const char *a = argv[i];
        if (!rest && strcmp(a, "--") == 0)
            rest = 1;
        else if (!rest && (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0))
            *help = 1;
        else if (!rest && a[0] == '-' && a[1] != '\0')
            rc = parse_flag(v, argc, argv, &i, o);
        else
            rc = parse_positional(v, a, &seen, o);
    }
    if (rc != TC_OK || *help)
        return rc;
    if (v->arg != ARG_NONE && !seen)
        return usage_error(v, "missing %s", v->arg == ARG_JOB ? "JOB" : "FILE");
    if (o->csv && o->json)
        return usage_error(v, "--csv and --json cannot be used together");
    return TC_OK;
}

static const verb *find_verb(const char *name)
{
    size_t i;

    for (i = 0; i < NVERBS; i++)
        if (strcmp(verbs[i].name, name) == 0)
            return &verbs[i];
    return NULL;
}

/* Parses the options before the verb. Returns the verb's index in argv, or 0 when main has
 * nothing more to do (*rc then holds the exit status). */
static int parse_global(int argc, char **argv, tc_opts *o, int *rc)
{
    int i;

    for (i = 1; i < argc && argv[i][0] == '-'; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            print_main_help(stdout);
            return 0;
        } else if (strcmp(a, "--version") == 0) {
            printf("trainctl %s (protocol %d)\n", TD_VERSION, TD_PROTO_VERSION);
            return 0;
        } else if (strncmp(a, "--socket=", 9) == 0 && a[9] != '\0') {
            o->socket = a + 9;
        } else if (strcmp(a, "--socket") == 0 && i + 1 < argc && argv[i + 1][0] != '\0') {
            o->socket = argv[++i];
        } else {
            *rc = usage_error(
                NULL, strncmp(a, "--socket", 8) == 0 ? "'%s' needs a path" : "unknown option '%s'",
                a);
            return 0;
        }
    }
    if (i >= argc)
        *rc = usage_error(NULL, "no verb given");
    else if (find_verb(argv[i]) == NULL)
        *rc = usage_error(NULL, "unknown verb '%s'", argv[i]);
    return *rc == TC_OK && i < argc ? i : 0;
}

static const char *default_socket(void)
{
    const char *env = getenv("TRAIND_SOCKET");

    return env != NULL && env[0] != '\0' ? env : TC_DEFAULT_SOCKET;
}

int main(int argc, char **argv)
{
    tc_opts o = {.job = -1, .since = -1};
    const verb *v;
    int rc = TC_OK, help = 0, at;

    if (!isatty(STDOUT_FILENO))
        setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    at = parse_global(argc, argv, &o, &rc);
    if (at == 0)
        goto out;
    v = find_verb(argv[at]);
    o.sets = calloc((size_t)argc, sizeof(*o.sets));
    if (o.sets == NULL) {
        rc = tc_err(TC_FAILED, "out of memory");
        goto out;
    }
    if (o.socket == NULL)
        o.socket = default_socket();
    rc = parse_verb_args(v, argc, argv, at + 1, &o, &help);
    if (rc == TC_OK && help)
        print_verb_help(v);
    else if (rc == TC_OK)
        rc = v->run(&o);
out:
    free(o.sets);
    if (tc_flush_stdout() != TC_OK && rc == TC_OK)
        rc = TC_FAILED;
    return rc;
}
