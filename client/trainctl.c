/* trainctl: the command-line client of traind. This file holds main(): the global options,
 * the table of verbs with the flags each accepts and its help text, and the parsing of a
 * verb's arguments into a tc_opts. The verbs themselves live in verbs.c, watch.c, plot.c,
 * interop.c, sensor.c (which parses its own arguments) and completion.c; the last reads the
 * table through tc_verb_at() and tc_verb_flag_at(). */
#include <errno.h>
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"

/* Flags a verb may accept, bits of a uint64_t (an enum holds the first 31; the later ones are
 * macros). F_FORMAT, F_OUTFILE and F_OUTPATH share the names -o and --output: a read verb takes
 * an output format there (-o json, as kubectl does), plot the chart to write, export the model
 * file to write. F_SINCE and F_CREATED share --since: watch's is a step, ls's a time. */
enum {
    F_SET = 1,
    F_SINCE = 2,
    F_KEYS = 4,
    F_JSON = 8,
    F_CSV = 16,
    F_SUMMARY = 32,
    F_FORMAT = 64,
    F_OUTFILE = 128,
    F_OUTPATH = 256,
    F_TOKENS = 512,
    F_PROMPT = 1024,
    F_TEMPERATURE = 2048,
    F_SEED = 4096,
    F_DRY_RUN = 8192,
    F_STATE = 1 << 14,
    F_USER = 1 << 15,
    F_NAME = 1 << 16,
    F_CREATED = 1 << 17,
    F_LIMIT = 1 << 18,
    F_PANELS = 1 << 19,
    F_LOG = 1 << 20,
    F_DATA = 1 << 21,          /* classify, retrieve, probe */
    F_LABELS = 1 << 22,        /* classify */
    F_QUERY = 1 << 23,         /* retrieve */
    F_LISTEN = 1 << 24,        /* dashboard */
    F_TOP = 1 << 25,           /* retrieve */
    F_OLDER_THAN = 1 << 26,    /* prune */
    F_SORT = 1 << 27,          /* ls */
    F_EXPORT_FORMAT = 1 << 28, /* export */
    F_LS_FORMAT = 1 << 29,     /* ls */
    F_FOLLOW = 1 << 30         /* logs */
};
#define F_SELECTOR (1ull << 31) /* ls, cancel, prune */
#define F_EVAL     (1ull << 32) /* probe */
#define F_SHOTS    (1ull << 33) /* probe */

/* The positional arguments a verb takes. */
enum { ARG_NONE, ARG_JOB, ARG_JOBS, ARG_FILE, ARG_SHELL };

/* A flag: its name, its bit, what its value is (NULL when it takes none; the words are
 * tc_flag_desc's, read by the completion scripts) and one line for those scripts. */
typedef struct flag {
    const char *name;
    uint64_t bit;
    const char *value;
    const char *desc;
} flag;

static const flag flags[] = {
    {"--set", F_SET, "TEXT", "change one key of the job (KEY=VALUE)"},
    {"--since", F_SINCE, "STEP", "start from this step"},
    {"--since", F_CREATED, "TIME", "only jobs created since (2h, 7d, 2026-11-30)"},
    {"--state", F_STATE, "STATES", "only jobs in these states (running,queued)"},
    {"--user", F_USER, "USER", "only jobs submitted by this user (name or uid)"},
    {"--name", F_NAME, "GLOB", "only jobs whose name matches this pattern"},
    {"--limit", F_LIMIT, "N", "only the newest N jobs"},
    {"--keys", F_KEYS, "KEYS", "only these metrics (comma-separated)"},
    {"--panels", F_PANELS, NULL, "one panel per metric, stacked"},
    {"--log", F_LOG, NULL, "a logarithmic y axis"},
    {"--json", F_JSON, NULL, "JSON output"},
    {"--csv", F_CSV, NULL, "CSV output"},
    {"--summary", F_SUMMARY, NULL, "count, last, min and max per metric"},
    {"-o", F_FORMAT, "FORMAT", "output format"},
    {"--output", F_FORMAT, "FORMAT", "output format"},
    {"-o", F_OUTFILE, "FILE", "the chart to write (.png or .svg)"},
    {"--output", F_OUTFILE, "FILE", "the chart to write (.png or .svg)"},
    {"-o", F_OUTPATH, "FILE", "the model file to write"},
    {"--output", F_OUTPATH, "FILE", "the model file to write"},
    {"--tokens", F_TOKENS, "N", "tokens to generate (1 to 4096)"},
    {"--prompt", F_PROMPT, "TEXT", "the text to continue"},
    {"--temperature", F_TEMPERATURE, "NUMBER", "0 likeliest token, 1 the model as it is"},
    {"--seed", F_SEED, "N", "the same seed gives the same text"},
    {"--dry-run", F_DRY_RUN, NULL, "change nothing; show what would be done"},
    {"--listen", F_LISTEN, "TEXT", "the dashboard's address (127.0.0.1:8080)"},
    {"--older-than", F_OLDER_THAN, "DURATION", "only jobs that ended this long ago (30d, 12h)"},
    {"--data", F_DATA, "FILE", "the sensor shard whose windows to use"},
    {"--labels", F_LABELS, "TEXT", "the labels (NAME or NAME=PROMPT, comma-separated)"},
    {"--query", F_QUERY, "TEXT", "the text to find windows for"},
    {"--top", F_TOP, "N", "how many windows (1 to 100)"},
    {"--eval", F_EVAL, "FILE", "the sensor shard the probes are judged on"},
    {"--shots", F_SHOTS, "TEXT", "train windows a class, each row (1,5,10,all)"},
    {"--format", F_EXPORT_FORMAT, "FORMAT", "llmc or safetensors"},
    {"--format", F_LS_FORMAT, "FIELDS", "the columns (id,name,user,state,...)"},
    {"--sort", F_SORT, "FIELD", "order by this column (-FIELD: descending)"},
    {"--selector", F_SELECTOR, "LABELS", "only jobs with these labels (team=vision,...)"},
    {"-l", F_SELECTOR, "LABELS", "only jobs with these labels (team=vision,...)"},
    {"-f", F_FOLLOW, NULL, "follow: print new lines until the job ends"},
    {"--follow", F_FOLLOW, NULL, "follow: print new lines until the job ends"},
};

typedef struct verb {
    const char *name;
    int (*run)(const tc_opts *o);
    uint64_t flags; /* the F_ bits it accepts */
    int arg;        /* ARG_ */
    const char *usage;
    const char *brief; /* one line for trainctl --help */
    const char *help;  /* what it does and what each of its flags means */
    /* A verb with subcommands of its own (sensor) parses its arguments itself: run_args gets
     * those after the verb's name, and flag_names lists its flags for the completion script. */
    int (*run_args)(int argc, char **argv);
    const char *(*flag_names)(void);
} verb;

/* The help lines every read verb shares. */
#define TC_HELP_JSON                     \
    "  -o json     the same as --json\n" \
    "  -h, --help  show this help\n"

static const verb verbs[] = {
    {
        .name = "submit",
        .run = tc_submit,
        .flags = F_SET | F_DRY_RUN | F_JSON,
        .arg = ARG_FILE,
        .usage = "trainctl submit FILE [--set KEY=VALUE]... [--dry-run [--json]]",
        .brief = "submit a job; prints its id",
        .help = "Submits the job described by the JSON object in FILE (\"-\" reads\n"
                "standard input) and prints the new job's id alone on standard output.\n\n"
                "  --set KEY=VALUE  change one key of the job before it is sent; may be\n"
                "                   repeated. A dotted KEY reaches into nested objects\n"
                "                   (--set optim.lr=3e-4). VALUE is read as JSON when it\n"
                "                   is JSON (1, 3e-4, true, [784,10], \"text\", null), else\n"
                "                   taken as a string (--set name=baseline).\n"
                "  --dry-run        create no job: traind checks the job as it would a\n"
                "                   submit and prints its memory estimate per device\n"
                "                   (parameters, gradients, optimizer, activations and\n"
                "                   their attention share, workspace, total, in MiB)\n"
                "                   against the free memory of the devices it would get,\n"
                "                   the largest batch_size that fits and the one\n"
                "                   batch_size \"auto\" would take. Exits 0 when the job\n"
                "                   fits, 1 when it does not\n"
                "  --json           with --dry-run: the estimate as one JSON object\n"
                "  -h, --help       show this help\n",
    },
    {
        .name = "watch",
        .run = tc_watch,
        .flags = F_SINCE | F_KEYS | F_JSON | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl watch JOB [--since STEP] [--keys A,B] [--json|-o json]",
        .brief = "follow a job until it ends",
        .help = "Follows job JOB until it ends, then prints how it ended. On a terminal\n"
                "this is two live bars, redrawn at most 10 times a second: the train bar\n"
                "(step/total, elapsed, ETA, loss, s/step, epoch) and the valid bar (the\n"
                "last evaluation and its step, and how far the next one is); each\n"
                "evaluation is also printed above them. NO_COLOR turns colour off.\n"
                "Otherwise (a pipe) one line per step as llm.c prints it (\"step 12/300 |\n"
                "loss 2.31 | 86.2 ms | 5,930 tok/s | ETA 25s\"), one per evaluation and one\n"
                "per change of state (\"state running step 12/1407\"). The ETA and ms/step\n"
                "are moving averages of the rows' own times (trainctl(1)). Exits 0 when the\n"
                "job succeeded, 1 when it failed or was cancelled.\n\n"
                "  --since STEP  start from step STEP rather than from the job's first row\n"
                "  --keys A,B    only the metrics named (comma-separated)\n"
                "  --json        one JSON object per line for each row\n"
                "                ({\"job\",\"key\",\"step\",\"value\",\"time\"}), and a last\n"
                "                line {\"job\",\"state\",\"error\"} when the job ends\n"
                "  -o json       the same as --json\n"
                "  -h, --help    show this help\n",
    },
    {
        .name = "status",
        .run = tc_status,
        .flags = F_JSON | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl status JOB [--json|-o json|yaml]",
        .brief = "show one job",
        .help = "Shows job JOB: its state, progress, devices, times, error and latest\n"
                "metrics.\n\n"
                "  --json      print the whole job, with its spec, as one JSON object\n"
                "  -o yaml     the same as YAML\n" TC_HELP_JSON,
    },
    {
        .name = "describe",
        .run = tc_describe,
        .flags = 0,
        .arg = ARG_JOB,
        .usage = "trainctl describe JOB",
        .brief = "show the whole job, as a person reads it",
        .help = "Shows job JOB as kubectl describe shows a pod: its name, user, state (and\n"
                "for a queued job why it waits), priority, step, devices and times; its\n"
                "error with each failed device; its spec (as YAML); the last value of each\n"
                "metric; its checkpoints (step, size, when written); and its events, the\n"
                "last 20 lines of its log (the job's owner or root only).\n\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "ls",
        .run = tc_ls,
        .flags = F_STATE | F_USER | F_NAME | F_CREATED | F_LIMIT | F_JSON | F_FORMAT | F_LS_FORMAT |
                 F_SORT | F_SELECTOR,
        .arg = ARG_NONE,
        .usage = "trainctl ls [--state S,S] [--user USER] [--name GLOB] [--since TIME] "
                 "[--limit N] [--selector NAME=VALUE,...] [--format FIELDS] [--sort [-]FIELD] "
                 "[-o wide|json|yaml]",
        .brief = "list the jobs, all or those that match",
        .help = "Lists the jobs, oldest first: ID, NAME, USER, PRIORITY, STATE, REASON (why\n"
                "a queued job waits, as traind says: devices busy, priority (behind job N),\n"
                "user's limit ...), STEP, DEVICES, ELAPSED (how long it has run) and the\n"
                "latest loss and accuracy. traind applies the filters and sends only the\n"
                "jobs that match, a page at a time; a job must match every filter given.\n\n"
                "  --state S,S   only jobs in one of these states: queued, running,\n"
                "                succeeded, failed, cancelled (comma-separated)\n"
                "  --user USER   only jobs submitted by USER, a user name or a uid\n"
                "  --name GLOB   only jobs whose name matches GLOB: * any characters, ? one\n"
                "                character, [a-z] one of a class, [^x] one not in it;\n"
                "                case-sensitive. Quote it for the shell: --name 'sweep-*'\n"
                "  --since TIME  only jobs created at or after TIME: a time back from now\n"
                "                (30s, 90m, 2h, 7d, 2w, or 1h30m), or a local date and\n"
                "                time (2026-11-30, 2026-11-30 14:00, 2026-11-30T14:00:05)\n"
                "  --limit N     only the newest N of the jobs that match, still listed\n"
                "                oldest first\n"
                "  --selector NAME=VALUE,...  only jobs with all these labels (the job\n"
                "                file's labels; -l for short)\n"
                "  --format F,F  the columns, in order, from the fields id, name, user,\n"
                "                priority, state, reason, step, devices, elapsed, age,\n"
                "                created, started, ended, error, metrics\n"
                "  --sort FIELD  order by a field (numbers as numbers), -FIELD descending;\n"
                "                ties keep the id order. Applies to -o json and yaml too\n"
                "  -o wide       every field but none twice: also age, created, started,\n"
                "                ended and the error\n"
                "  --json        print a JSON array of the jobs, in the same order\n"
                "  -o json       the same as --json; -o yaml the jobs as YAML\n"
                "  -h, --help    show this help\n",
    },
    {
        .name = "cancel",
        .run = tc_cancel,
        .flags = F_STATE | F_USER | F_NAME | F_SELECTOR,
        .arg = ARG_JOBS,
        .usage = "trainctl cancel JOB [JOB]... | cancel [--name GLOB] [--state S,S] [--user USER] "
                 "[--selector NAME=VALUE,...]",
        .brief = "cancel jobs, by id or by what they match",
        .help = "Cancels each job JOB, or every queued or running job that matches the\n"
                "filters (as ls takes them; at least one). A queued job leaves the queue at\n"
                "once; a running job stops at its next step (trainctl watch JOB shows it\n"
                "end). Only the job's owner or root may cancel it (exit 77 otherwise). Prints\n"
                "a line per job; a job that cannot be cancelled (ended, not yours, no such\n"
                "job) is named on standard error and the others are cancelled still; the exit\n"
                "status is then the first failure's.\n\n"
                "  --name GLOB  jobs whose name matches GLOB (quote it: --name 'sweep-*')\n"
                "  --state S,S  jobs in these states: queued, running (default both)\n"
                "  --user USER  jobs submitted by USER, a user name or a uid\n"
                "  --selector NAME=VALUE,...  jobs with all these labels (-l for short)\n"
                "  -h, --help   show this help\n",
    },
    {
        .name = "rm",
        .run = tc_rm,
        .flags = F_JSON | F_FORMAT,
        .arg = ARG_JOBS,
        .usage = "trainctl rm JOB [JOB]... [--json|-o json]",
        .brief = "delete ended jobs with their metrics, logs and checkpoints",
        .help = "Deletes jobs JOB... (succeeded, failed or cancelled) with everything traind\n"
                "keeps of them: metric rows, log lines and checkpoints. All or none: a job\n"
                "that does not exist, is queued or running (cancel it first) or is not\n"
                "yours (only root deletes other users' jobs) is named and nothing is\n"
                "deleted. The jobs are gone for everyone at once; their rows go a batch at\n"
                "a time (a terminal shows how many jobs are left), and then the database\n"
                "gives their space back. Prints the jobs and the database's size before and\n"
                "after. A job's id is never given to another job.\n\n"
                "  --json      the reply as one JSON object\n" TC_HELP_JSON,
    },
    {
        .name = "prune",
        .run = tc_prune,
        .flags = F_OLDER_THAN | F_STATE | F_DRY_RUN | F_JSON | F_FORMAT | F_SELECTOR,
        .arg = ARG_NONE,
        .usage = "trainctl prune --older-than DURATION [--state S,S] [--selector NAME=VALUE,...] "
                 "[--dry-run] [--json|-o json]",
        .brief = "delete the jobs that ended long ago",
        .help = "Deletes, as rm does, every job that ended more than DURATION ago: yours,\n"
                "or everyone's when run by root. The database gives the space back and\n"
                "traind removes checkpoint directories of jobs that no longer exist.\n"
                "Prints the jobs (up to 20; --dry-run lists up to 1000), then how many went\n"
                "and the database's size before and after.\n\n"
                "  --older-than DURATION  jobs that ended at least this long ago: numbers\n"
                "                         each followed by s, m, h, d or w (30d, 12h, 90m,\n"
                "                         1h30m); required\n"
                "  --state S,S            only jobs in these states: succeeded, failed,\n"
                "                         cancelled (comma-separated); default all three\n"
                "  --selector NAME=VALUE,...  only jobs with all these labels (-l)\n"
                "  --dry-run              list what would be deleted; delete nothing\n"
                "  --json                 the reply as one JSON object\n"
                "  -o json                the same as --json\n"
                "  -h, --help             show this help\n",
    },
    {
        .name = "metrics",
        .run = tc_metrics,
        .flags = F_KEYS | F_CSV | F_JSON | F_SUMMARY | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl metrics JOB [--keys A,B] [--csv|--json|-o csv|json] [--summary]",
        .brief = "print a job's metrics",
        .help = "Prints every stored metric row of job JOB in (step, key) order, as CSV\n"
                "with the header job,key,step,value,time.\n\n"
                "  --keys A,B  only the metrics named (comma-separated)\n"
                "  --csv       CSV output (the default)\n"
                "  --json      a JSON array of {\"job\",\"key\",\"step\",\"value\",\"time\"}\n"
                "  -o FORMAT   csv or json, the same as --csv or --json\n"
                "  --summary   per metric: count, last value (at the highest step), min and\n"
                "              max; a table, or CSV with --csv, or a JSON array with --json\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "logs",
        .run = tc_logs,
        .flags = F_JSON | F_FORMAT | F_FOLLOW,
        .arg = ARG_JOB,
        .usage = "trainctl logs JOB [-f] [--json|-o json]",
        .brief = "print a job's lifecycle events and warnings",
        .help = "Prints what traind recorded about job JOB, oldest first (at most the last\n"
                "10,000 lines), one line each: local time, level (err, warning, notice,\n"
                "info) and message. A job that was cancelled:\n\n"
                "  2026-12-01 18:18:05 notice queued\n"
                "  2026-12-01 18:18:05 notice running on cpu:0\n"
                "  2026-12-01 18:18:11 notice cancel requested\n"
                "  2026-12-01 18:18:11 notice cancelled at step 77\n\n"
                "and the last line of one that failed:\n\n"
                "  2026-12-01 18:18:05 err failed: training worker on device 0 failed: "
                "loss is NaN at step 40\n\n"
                "A message of several lines (one per failed device) has its further lines\n"
                "indented under its first.\n\n"
                "  -f, --follow  go on printing new lines as traind records them, until the\n"
                "              job has ended and its last line is printed (Ctrl-C stops)\n"
                "  --json      a JSON array of {\"job\",\"time\",\"level\",\"level_name\",\n"
                "              \"message\"}; level is the syslog priority (3 to 6)\n" TC_HELP_JSON,
    },
    {
        .name = "plot",
        .run = tc_plot,
        .flags = F_KEYS | F_PANELS | F_LOG | F_OUTFILE,
        .arg = ARG_JOBS,
        .usage = "trainctl plot JOB [JOB]... [--keys A,B] [--panels] [--log] -o FILE.png|FILE.svg",
        .brief = "draw jobs' metrics against step as a PNG or SVG chart",
        .help = "Draws the metrics of one or more jobs against step on one chart, with a\n"
                "legend naming each line (\"job 3 train_loss\"): one job's metrics in colours\n"
                "of their own; several jobs each in one colour, a metric in one dash (solid,\n"
                "dashed, dotted, ...) for every job.\n"
                "Values that are not finite are left out. A series of more than 200\n"
                "points is drawn faintly, under its line smoothed over about 1% of its\n"
                "points; a series of at most 60 gets a dot at each point. An SVG keeps its\n"
                "text as text: titles, tick labels and legend can be selected and searched.\n\n"
                "  --keys A,B  the metrics to draw (comma-separated); by default train_loss\n"
                "              and whichever of test_loss, valid_loss, val_loss exist\n"
                "  --panels    one panel per metric, stacked, each with its own y axis and\n"
                "              legend, all sharing the step axis; the chart grows past 700\n"
                "              high when a panel would get less than 220. With several\n"
                "              jobs a job keeps its colour in every panel\n"
                "  --log       logarithmic y axes, labelled at powers of ten; values <= 0\n"
                "              are left out (trainctl says how many, per series)\n"
                "  -o FILE     where to write the chart: PNG when FILE ends in .png, SVG\n"
                "              when it ends in .svg; --output FILE is the same\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "info",
        .run = tc_info,
        .flags = F_JSON | F_FORMAT,
        .arg = ARG_NONE,
        .usage = "trainctl info [--json|-o json]",
        .brief = "show the daemon: version, devices, queue, store",
        .help = "Shows traind's version and protocol version, its devices with their free\n"
                "and total memory and the job running on each, the queued jobs in the order\n"
                "they will run, and the store's path and size.\n\n"
                "  --json      print the daemon's info reply as one JSON object\n" TC_HELP_JSON,
    },
    {
        .name = "completion",
        .run = tc_completion,
        .flags = 0,
        .arg = ARG_SHELL,
        .usage = "trainctl completion bash|zsh|fish",
        .brief = "print a shell completion script",
        .help = "Prints a completion script for trainctl in the shell's language: verbs,\n"
                "each verb's flags (zsh and fish: with what each does), the values of\n"
                "-o, --state, --user and --keys, and job ids (zsh and fish: with each\n"
                "job's name and state), asked from traind with trainctl ls. Load it with\n"
                "  bash: source <(trainctl completion bash)\n"
                "  zsh:  source <(trainctl completion zsh)\n"
                "  fish: trainctl completion fish | source\n"
                "An install puts them where each shell looks: bash-completion's\n"
                "completions/trainctl, zsh's site-functions/_trainctl and fish's\n"
                "vendor_completions.d/trainctl.fish under PREFIX/share.\n\n"
                "  -h, --help  show this help\n",
    },
    {
        .name = "export",
        .run = tc_export,
        .flags = F_OUTPATH | F_EXPORT_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl export JOB -o FILE|DIR/ [--format llmc|safetensors]",
        .brief = "write a job's latest checkpoint as an llm.c or safetensors model file",
        .help = "Writes the latest checkpoint of job JOB. -o DIR/ (a name ending in /, or\n"
                "a directory) writes DIR/model.safetensors and a DIR/config.json that loads\n"
                "it elsewhere: for a gpt job Hugging Face's GPT2Config, so that\n"
                "GPT2LMHeadModel.from_pretrained(DIR) takes it; for a sensorlm job every\n"
                "dimension. A FILE whose name ends in\n"
                ".safetensors (or --format safetensors) gets a safetensors file of a gpt\n"
                "job (Hugging Face GPT-2's names and layouts) or a sensorlm job (the\n"
                "README's parameter names, plus norm.mean and norm.std); any other name a\n"
                "gpt job's llm.c GPT-2 model file (fp32, version 3), which llm.c loads.\n"
                "Either is what a job's model.init_from starts from. A running job exports\n"
                "its latest checkpoint. trainctl writes the file itself, with your\n"
                "permissions: FILE.tmp first, renamed to FILE once whole. Prints where and\n"
                "how much on standard error.\n\n"
                "  -o FILE          the model file to write; --output FILE is the same\n"
                "  --format FORMAT  llmc or safetensors; default: safetensors when FILE\n"
                "                   ends in .safetensors, else llmc\n"
                "  -h, --help       show this help\n",
    },
    {
        .name = "sample",
        .run = tc_sample,
        .flags = F_TOKENS | F_PROMPT | F_TEMPERATURE | F_SEED,
        .arg = ARG_JOB,
        .usage = "trainctl sample JOB [--tokens N] [--prompt TEXT] [--temperature T] [--seed S]",
        .brief = "print text generated from a gpt job's latest checkpoint",
        .help = "Generates tokens from the latest checkpoint of job JOB, a gpt job, and\n"
                "prints them on standard output (the generated text only, not the prompt;\n"
                "a newline is added only on a terminal). A job on text data works in\n"
                "bytes: the output is exactly N bytes. A job on llm.c token shards prints\n"
                "token ids separated by spaces and takes its prompt the same way.\n\n"
                "  --tokens N       tokens to generate, 1 to 4096; default 256\n"
                "  --prompt TEXT    what the text continues; default a newline (text) or\n"
                "                   the last token id (tokens)\n"
                "  --temperature T  0 always takes the likeliest token, 1 (the default)\n"
                "                   samples the model as it is, above 1 more at random\n"
                "  --seed S         the same seed gives the same text again; default a\n"
                "                   new one each time, printed on standard error on a\n"
                "                   terminal\n"
                "  -h, --help       show this help\n",
    },
    {
        .name = "classify",
        .run = tc_classify,
        .flags = F_DATA | F_LABELS | F_JSON | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl classify JOB --data SHARD [--labels NAMES] [-o json]",
        .brief = "label each window of a sensor shard zero-shot with a sensorlm job",
        .help = "Classifies every window of the sensor shard SHARD with the latest\n"
                "checkpoint of job JOB, a sensorlm job, zero-shot: each window gets the\n"
                "label whose prompt's text embedding it scores highest with (the cosine\n"
                "similarity of the two unit embeddings, the score printed), as the job's\n"
                "zeroshot_accuracy does. Prints one line per window: its index in the\n"
                "shard, its label and the score. traind opens SHARD with your rights.\n\n"
                "  --data SHARD    the sensor shard (its T and C must be the model's)\n"
                "  --labels NAMES  comma-separated labels, each NAME or NAME=PROMPT; a\n"
                "                  NAME alone takes the prompt the shard gives a label of\n"
                "                  that name, else the name itself. Default: the shard's\n"
                "                  own labels and prompts\n"
                "  --json          one JSON object: {\"job\",\"data\",\"windows\",\"labels\":\n"
                "                  [{\"name\",\"prompt\"}],\"results\":[{\"index\",\"label\",\n"
                "                  \"score\"}]}\n" TC_HELP_JSON,
    },
    {
        .name = "retrieve",
        .run = tc_retrieve,
        .flags = F_DATA | F_QUERY | F_TOP | F_JSON | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl retrieve JOB --data SHARD --query TEXT [--top K] [-o json]",
        .brief = "find the windows of a sensor shard nearest a text, with a sensorlm job",
        .help = "Embeds the query TEXT and every window of the sensor shard SHARD with the\n"
                "latest checkpoint of job JOB, a sensorlm job, and prints the K windows\n"
                "that score highest with the query, best first: each window's index in\n"
                "the shard, its score (the cosine similarity) and its caption. traind\n"
                "opens SHARD with your rights.\n\n"
                "  --data SHARD  the sensor shard (its T and C must be the model's)\n"
                "  --query TEXT  what to look for (\"a morning run\")\n"
                "  --top K       how many windows, 1 to 100; default 5\n"
                "  --json        one JSON object: {\"job\",\"data\",\"query\",\"windows\",\n"
                "                \"results\":[{\"index\",\"score\",\"caption\"}]}\n" TC_HELP_JSON,
    },
    {
        .name = "probe",
        .run = tc_probe,
        .flags = F_DATA | F_EVAL | F_SHOTS | F_JSON | F_FORMAT,
        .arg = ARG_JOB,
        .usage = "trainctl probe JOB --data TRAIN --eval VALID [--shots 1,5,10,all] [-o json]",
        .brief = "few-shot: fit linear probes on a sensorlm job's embeddings, score them",
        .help = "Embeds every window of the sensor shards TRAIN and VALID with the latest\n"
                "checkpoint of job JOB, a sensorlm job, and for each shot count k fits a\n"
                "linear classifier (multinomial logistic regression, L2 1e-4 on the\n"
                "weights, at most 1000 L-BFGS iterations) on the unit sensor embeddings of\n"
                "the first k windows of each class of TRAIN, in file order; prints each\n"
                "fit's accuracy and macro-F1 on VALID's windows. A class with fewer than k\n"
                "windows gives all it has (SHORT counts them; a note names them). Both\n"
                "shards need the same labels. traind opens them with your rights.\n\n"
                "  --data TRAIN  the labelled sensor shard the probes are fitted on\n"
                "  --eval VALID  the labelled sensor shard they are judged on\n"
                "  --shots K,K   the rows: windows a class, 1 to 65536, or all; at most 16.\n"
                "                Default 1,5,10,all\n"
                "  --json        one JSON object: {\"job\",\"data\",\"eval\",\"step\",\n"
                "                \"embed_dim\",\"train_windows\",\"valid_windows\",\"l2\",\n"
                "                \"max_iterations\",\"labels\":[{\"name\",\"train\",\"valid\"}],\n"
                "                \"results\":[{\"shots\" (0: all),\"windows\",\"short\",\n"
                "                \"accuracy\",\"macro_f1\",\"iterations\",\"converged\",\n"
                "                \"loss\"}]}\n" TC_HELP_JSON,
    },
    {
        .name = "dashboard",
        .run = tc_dashboard,
        .flags = F_LISTEN,
        .arg = ARG_NONE,
        .usage = "trainctl dashboard [--listen HOST:PORT]",
        .brief = "serve a live web page of the jobs",
        .help = "Serves a web page of the jobs you can see: the job list, each job's metrics\n"
                "as live charts, its failure and its log, and several jobs on one chart.\n"
                "It asks traind over its socket as the other verbs do, so traind's\n"
                "permissions apply. Prints the page's URL, which holds a random token\n"
                "(other users of this machine cannot open the page without it), and\n"
                "runs until interrupted (Ctrl-C or SIGTERM).\n\n"
                "  --listen HOST:PORT  where to listen; default 127.0.0.1:8080 (loopback:\n"
                "                      only this machine). Another address is used only\n"
                "                      when named here, with a warning: anyone who can\n"
                "                      reach it and has the URL sees what you can see.\n"
                "                      Port 0 picks a free port. Without --listen, a\n"
                "                      taken 8080 moves on to the next free port.\n"
                "  -h, --help          show this help\n",
    },
    {
        .name = "sensor",
        .usage = "trainctl sensor synth|import ...",
        .brief = "make sensor shards here, without traind: synthetic days, or a CSV file",
        .run_args = tc_sensor,
        .flag_names = tc_sensor_flag_names,
    },
};

#define NVERBS (sizeof(verbs) / sizeof(verbs[0]))
#define NFLAGS (sizeof(flags) / sizeof(flags[0]))

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
          "Exit status: 0 success; 1 the job failed or was cancelled (watch), traind\n"
          "refused the request, the job would not fit (submit --dry-run), or plot found\n"
          "nothing to draw; 64 usage error; 65 invalid job file; 66 job file missing or\n"
          "unreadable; 69 traind unreachable (or too old for submit --dry-run); 71 the\n"
          "dashboard cannot listen (its port is taken); 73 plot,\n"
          "export or sensor cannot write its file; 75 traind busy, try again; 76\n"
          "protocol error; 77 permission denied; 78 the socket path is unusable; 130\n"
          "interrupted (watch, export).\n",
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

/* The flag named arg (len bytes): the one among the accepted bits when a name has several
 * meanings, else any, so that the caller can say it is not an option here. */
static const flag *find_flag(const char *arg, size_t len, uint64_t accepted)
{
    const flag *any = NULL;
    size_t i;

    for (i = 0; i < NFLAGS; i++) {
        if (strlen(flags[i].name) != len || memcmp(flags[i].name, arg, len) != 0)
            continue;
        if (flags[i].bit & accepted)
            return &flags[i];
        any = any != NULL ? any : &flags[i];
    }
    return any;
}

/* -o FORMAT for a read verb: json; csv where the verb has --csv; yaml for ls and status;
 * wide for ls (kubectl's). */
static int store_format(const verb *v, const char *val, tc_opts *o)
{
    int ls = v->run == tc_ls, status = v->run == tc_status;

    if (strcmp(val, "json") == 0)
        o->json = 1;
    else if (strcmp(val, "csv") == 0 && (v->flags & F_CSV))
        o->csv = 1;
    else if (strcmp(val, "yaml") == 0 && (ls || status))
        o->yaml = 1;
    else if (strcmp(val, "wide") == 0 && ls)
        o->wide = 1;
    else
        return usage_error(v, "-o takes %s, not '%s'",
                           ls                 ? "wide, json or yaml"
                           : status           ? "json or yaml"
                           : v->flags & F_CSV ? "csv or json"
                                              : "json",
                           val);
    return TC_OK;
}

/* -o FILE for plot: the format comes from the name. */
static int store_outfile(const verb *v, const char *val, tc_opts *o)
{
    size_t len = strlen(val);

    if (len < 5 ||
        (strcasecmp(val + len - 4, ".png") != 0 && strcasecmp(val + len - 4, ".svg") != 0))
        return usage_error(v, "-o needs a file name ending in .png or .svg, not '%s'", val);
    o->output = val;
    return TC_OK;
}

/* -o FILE for export: any path but an empty one. */
static int store_outpath(const verb *v, const char *val, tc_opts *o)
{
    if (val[0] == '\0')
        return usage_error(v, "-o needs a file name");
    o->output = val;
    return TC_OK;
}

/* --temperature: a finite number >= 0. */
static int store_temperature(const verb *v, const char *val, tc_opts *o)
{
    char *end;
    double t;

    errno = 0;
    t = strtod(val, &end);
    if (errno != 0 || end == val || *end != '\0' || !isfinite(t) || t < 0)
        return usage_error(v, "--temperature needs a number >= 0, not '%s'", val);
    o->temperature = t;
    return TC_OK;
}

const char *const tc_state_names[TC_NSTATES] = {"queued", "running", "succeeded", "failed",
                                                "cancelled"};

/* --state: one or more state names, comma-separated, into o->states' bits. */
static int store_states(const verb *v, const char *val, tc_opts *o)
{
    const char *p = val, *end;
    size_t i, len;

    for (; *p != '\0'; p = *end != '\0' ? end + 1 : end) {
        end = strchrnul(p, ',');
        len = (size_t)(end - p);
        for (i = 0; i < TC_NSTATES; i++)
            if (strlen(tc_state_names[i]) == len && memcmp(tc_state_names[i], p, len) == 0)
                break;
        if (len == 0)
            continue;
        if (i == TC_NSTATES)
            return usage_error(v,
                               "--state takes queued, running, succeeded, failed or cancelled "
                               "(comma-separated), not '%.*s'",
                               (int)len, p);
        o->states |= 1u << i;
    }
    if (o->states == 0)
        return usage_error(v, "--state needs a state, not '%s'", val);
    return TC_OK;
}

/* --user: a user name (getpwnam), or a uid as a number (which needs no passwd entry). */
static int store_user(const verb *v, const char *val, tc_opts *o)
{
    struct passwd *pw;
    int64_t uid;

    if (parse_count(val, &uid) == 0) {
        if (uid > UINT32_MAX)
            return usage_error(v, "--user: %s is not a uid (0 to 4294967295)", val);
        o->uid = uid;
        return TC_OK;
    }
    errno = 0;
    if ((pw = getpwnam(val)) == NULL)
        return usage_error(v, "--user: there is no user named '%s'%s%s", val,
                           errno != 0 ? ": " : "", errno != 0 ? strerror(errno) : "");
    o->uid = (int64_t)pw->pw_uid;
    return TC_OK;
}

/* A duration back from now: one or more numbers each followed by s, m, h, d or w ("1h30m").
 * Seconds into *out; -1 when s is not one. */
static int parse_ago(const char *s, double *out)
{
    static const char units[] = "smhdw";
    static const double secs[] = {1, 60, 3600, 86400, 7 * 86400};
    const char *u;
    double total = 0, n;
    char *end;

    if (*s == '\0')
        return -1;
    while (*s != '\0') {
        if (*s < '0' || *s > '9')
            return -1;
        errno = 0;
        n = strtod(s, &end);
        if (errno != 0 || end == s || *end == '\0' || (u = strchr(units, *end)) == NULL)
            return -1;
        total += n * secs[u - units];
        s = end + 1;
    }
    *out = total;
    return isfinite(total) ? 0 : -1;
}

/* A local date, with a time or not: 2026-11-30, 2026-11-30 14:00, 2026-11-30T14:00:05.
 * Unix seconds into *out; -1 when s is not one. */
static int parse_date(const char *s, double *out)
{
    static const char *const formats[] = {"%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S",
                                          "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M", "%Y-%m-%d"};
    struct tm tm;
    const char *end;
    time_t t;

    for (size_t i = 0; i < sizeof(formats) / sizeof(formats[0]); i++) {
        memset(&tm, 0, sizeof(tm));
        end = strptime(s, formats[i], &tm);
        if (end == NULL || *end != '\0')
            continue;
        tm.tm_isdst = -1; /* whatever daylight saving time says on that date */
        if ((t = mktime(&tm)) == (time_t)-1)
            return -1;
        *out = (double)t;
        return 0;
    }
    return -1;
}

/* ls --since: a duration back from now, or a local date and time. */
static int store_created(const verb *v, const char *val, tc_opts *o)
{
    double ago;

    if (parse_ago(val, &ago) == 0)
        o->created_since = fmax(0, tc_now_real() - ago);
    else if (parse_date(val, &o->created_since) == 0)
        o->created_since = fmax(0, o->created_since);
    else
        return usage_error(v,
                           "--since needs a time back from now (30s, 90m, 2h, 7d, 2w) or a "
                           "date (2026-11-30, 2026-11-30 14:00), not '%s'",
                           val);
    return TC_OK;
}

/* ls --name: a pattern of 1 to 255 bytes (the protocol's bounds). */
static int store_name(const verb *v, const char *val, tc_opts *o)
{
    size_t len = strlen(val);

    if (len == 0 || len > TC_LS_NAME_GLOB_MAX)
        return usage_error(v, "--name needs a pattern of 1 to %d bytes", TC_LS_NAME_GLOB_MAX);
    o->name_glob = val;
    return TC_OK;
}

/* probe --shots: 1 to TC_PROBE_MAX_SHOTS comma-separated counts, each 1 to TC_PROBE_MAX_K or
 * "all" (0). */
static int store_shots(const verb *v, const char *val, tc_opts *o)
{
    const char *p = val;

    o->nshots = 0;
    for (;;) {
        size_t len = strcspn(p, ",");
        char item[16];
        int64_t k = -1;
        if (o->nshots == TC_PROBE_MAX_SHOTS)
            return usage_error(v, "--shots: at most %d counts", TC_PROBE_MAX_SHOTS);
        snprintf(item, sizeof(item), "%.*s", (int)(len < sizeof(item) ? len : sizeof(item) - 1), p);
        if (len < sizeof(item) && strcmp(item, "all") == 0)
            k = 0;
        else if (len >= sizeof(item) || parse_count(item, &k) != 0 || k < 1 || k > TC_PROBE_MAX_K)
            return usage_error(v, "--shots needs counts from 1 to %d or all (1,5,10,all), not '%s'",
                               TC_PROBE_MAX_K, val);
        o->shots[o->nshots++] = k;
        if (p[len] == '\0')
            return TC_OK;
        p += len + 1;
    }
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
    case F_FORMAT:
        return store_format(v, val, o);
    case F_OUTFILE:
        return store_outfile(v, val, o);
    case F_OUTPATH:
        return store_outpath(v, val, o);
    case F_TOKENS:
        if (parse_count(val, &o->tokens) != 0 || o->tokens < 1 || o->tokens > TC_SAMPLE_MAX_TOKENS)
            return usage_error(v, "--tokens needs a number from 1 to %d, not '%s'",
                               TC_SAMPLE_MAX_TOKENS, val);
        break;
    case F_PROMPT:
        o->prompt = val;
        break;
    case F_TEMPERATURE:
        return store_temperature(v, val, o);
    case F_SEED:
        if (parse_count(val, &o->seed) != 0)
            return usage_error(v, "--seed needs a whole number >= 0, not '%s'", val);
        break;
    case F_DRY_RUN:
        o->dry_run = 1;
        break;
    case F_STATE:
        return store_states(v, val, o);
    case F_USER:
        return store_user(v, val, o);
    case F_NAME:
        return store_name(v, val, o);
    case F_CREATED:
        return store_created(v, val, o);
    case F_LIMIT:
        if (parse_count(val, &o->limit) != 0 || o->limit < 1)
            return usage_error(v, "--limit needs a number of jobs >= 1, not '%s'", val);
        break;
    case F_PANELS:
        o->panels = 1;
        break;
    case F_FOLLOW:
        o->follow = 1;
        break;
    case F_SELECTOR: {
        char why[200];
        if (tc_selector_check(val, why, sizeof(why)) != 0)
            return usage_error(v, "--selector: %s", why);
        o->selector = val;
        break;
    }
    case F_LS_FORMAT: {
        char bad[64], names[256];
        if (tc_ls_check_format(val, bad, sizeof(bad)) != 0) {
            tc_ls_field_names(names, sizeof(names));
            return usage_error(v, "--format: no field '%s'; the fields are %s", bad, names);
        }
        o->ls_format = val;
        break;
    }
    case F_SORT: {
        char names[256];
        if (tc_ls_check_sort(val) != 0) {
            tc_ls_field_names(names, sizeof(names));
            return usage_error(v, "--sort: no field '%s'; the fields are %s", val, names);
        }
        o->sort = val;
        break;
    }
    case F_LOG:
        o->log_y = 1;
        break;
    case F_LISTEN:
        o->listen = val;
        break;
    case F_DATA:
        if (val[0] == '\0')
            return usage_error(v, "--data needs a file name");
        o->data = val;
        break;
    case F_LABELS:
        o->labels = val;
        break;
    case F_QUERY:
        if (val[0] == '\0')
            return usage_error(v, "--query needs some text");
        o->query = val;
        break;
    case F_EVAL:
        if (val[0] == '\0')
            return usage_error(v, "--eval needs a file name");
        o->eval = val;
        break;
    case F_SHOTS:
        return store_shots(v, val, o);
    case F_TOP:
        if (parse_count(val, &o->top) != 0 || o->top < 1 || o->top > TC_RETRIEVE_MAX_TOP)
            return usage_error(v, "--top needs a number from 1 to %d, not '%s'",
                               TC_RETRIEVE_MAX_TOP, val);
        break;
    case F_EXPORT_FORMAT:
        if (strcmp(val, "llmc") != 0 && strcmp(val, "safetensors") != 0)
            return usage_error(v, "--format takes llmc or safetensors, not '%s'", val);
        o->export_format = val;
        break;
    case F_OLDER_THAN:
        if (parse_ago(val, &o->older_than) != 0)
            return usage_error(v, "--older-than needs a duration (30d, 12h, 90m, 1h30m), not '%s'",
                               val);
        break;
    }
    return TC_OK;
}

/* Handles argv[*i], a flag, taking its value from "=VALUE" or the next argument; a short
 * flag (-o) also takes it attached (-ojson). */
static int parse_flag(const verb *v, int argc, char **argv, int *i, tc_opts *o)
{
    const char *arg = argv[*i];
    const char *eq = strchr(arg, '=');
    size_t len = eq != NULL ? (size_t)(eq - arg) : strlen(arg);
    const flag *fl;

    if (arg[1] != '-' && len > 2) {
        len = 2;
        eq = arg + 1; /* the value, eq + 1, starts right after the flag's letter */
    }
    fl = find_flag(arg, len, v->flags);

    if (fl == NULL || (v->flags & fl->bit) == 0)
        return usage_error(v, fl == NULL ? "unknown option '%s'" : "'%s' is not an option here",
                           arg);
    if (fl->value == NULL) {
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

static int has_job(const tc_opts *o, int64_t job)
{
    size_t i;

    for (i = 0; i < o->njobs; i++)
        if (o->jobs[i] == job)
            return 1;
    return 0;
}

/* Takes one of the verb's positional arguments. */
static int parse_positional(const verb *v, const char *arg, int *seen, tc_opts *o)
{
    if (v->arg == ARG_NONE || (*seen && v->arg != ARG_JOBS))
        return usage_error(v, "unexpected argument '%s'", arg);
    *seen = 1;
    if (v->arg == ARG_FILE) {
        o->file = arg;
        return TC_OK;
    }
    if (v->arg == ARG_SHELL) {
        o->shell = arg;
        if (strcmp(arg, "bash") == 0 || strcmp(arg, "zsh") == 0 || strcmp(arg, "fish") == 0)
            return TC_OK;
        return usage_error(v, "no completion for '%s'; bash, zsh or fish", arg);
    }
    if (parse_count(arg, &o->job) != 0)
        return usage_error(v, "JOB must be a job id (a number), not '%s'", arg);
    if (!has_job(o, o->job)) /* plot 3 3 draws job 3 once */
        o->jobs[o->njobs++] = o->job;
    return TC_OK;
}

static const char *arg_name(int arg)
{
    static const char *const names[] = {"", "JOB", "JOBS", "FILE", "SHELL"};

    return names[arg];
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
    if (v->run == tc_cancel && seen &&
        (o->states || o->uid >= 0 || o->name_glob != NULL || o->selector != NULL))
        return usage_error(v, "cancel takes job ids or filters, not both");
    if (v->run == tc_cancel && (o->states & ~(1u | 2u)) != 0)
        return usage_error(v, "--state: only queued and running jobs can be cancelled");
    if (v->run == tc_cancel && !seen &&
        (o->states || o->uid >= 0 || o->name_glob != NULL || o->selector != NULL))
        return TC_OK; /* the jobs the filters match */
    if (v->arg != ARG_NONE && !seen)
        return usage_error(v, "missing %s", v->arg == ARG_JOBS ? "JOB" : arg_name(v->arg));
    if (o->csv && o->json)
        return usage_error(v, "--csv and --json cannot be used together");
    if ((v->flags & F_DRY_RUN) && o->json && !o->dry_run && v->run == tc_submit)
        return usage_error(v, "--json needs --dry-run (a submit prints only the job's id)");
    if ((v->flags & F_OUTFILE) && o->output == NULL)
        return usage_error(v, "missing -o FILE (a .png or .svg file to write)");
    if ((v->flags & F_OUTPATH) && o->output == NULL)
        return usage_error(v, "missing -o FILE (the model file to write)");
    if ((v->flags & F_DATA) && o->data == NULL)
        return usage_error(v, "missing --data SHARD (the sensor shard)");
    if ((v->flags & F_QUERY) && o->query == NULL)
        return usage_error(v, "missing --query TEXT");
    if ((v->flags & F_EVAL) && o->eval == NULL)
        return usage_error(v, "missing --eval SHARD (the sensor shard to judge the probes on)");
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

int tc_verb_at(size_t i, tc_verb_desc *out)
{
    size_t f, n = 0;
    int k;

    if (i >= NVERBS)
        return -1;
    out->name = verbs[i].name;
    out->brief = verbs[i].brief;
    out->arg = arg_name(verbs[i].arg);
    out->output = verbs[i].flags & (F_OUTFILE | F_OUTPATH) ? "FILE"
                  : !(verbs[i].flags & F_FORMAT)           ? ""
                  : verbs[i].flags & F_CSV                 ? "csv json"
                  : verbs[i].run == tc_ls                  ? "wide json yaml"
                  : verbs[i].run == tc_status              ? "json yaml"
                                                           : "json";
    out->flags[0] = '\0';
    for (f = 0; f < NFLAGS; f++) {
        if ((verbs[i].flags & flags[f].bit) == 0)
            continue;
        k = snprintf(out->flags + n, sizeof(out->flags) - n, "%s ", flags[f].name);
        n = k > 0 && n + (size_t)k < sizeof(out->flags) ? n + (size_t)k : n;
    }
    if (verbs[i].flag_names != NULL) {
        k = snprintf(out->flags + n, sizeof(out->flags) - n, "%s ", verbs[i].flag_names());
        n = k > 0 && n + (size_t)k < sizeof(out->flags) ? n + (size_t)k : n;
    }
    snprintf(out->flags + n, sizeof(out->flags) - n, "--help");
    return 0;
}

int tc_verb_flag_at(size_t i, size_t j, tc_flag_desc *out)
{
    size_t f;

    if (i >= NVERBS)
        return -1;
    for (f = 0; f < NFLAGS; f++) {
        if ((verbs[i].flags & flags[f].bit) == 0 || j-- > 0)
            continue;
        out->name = flags[f].name;
        out->value = flags[f].value != NULL ? flags[f].value : "";
        out->desc = flags[f].desc;
        return 0;
    }
    return -1;
}

int main(int argc, char **argv)
{
    tc_opts o = {.job = -1,
                 .since = -1,
                 .tokens = -1,
                 .temperature = -1,
                 .seed = -1,
                 .uid = -1,
                 .created_since = -1,
                 .limit = -1,
                 .older_than = -1,
                 .top = -1};
    const verb *v;
    int rc = TC_OK, help = 0, at;

    if (!isatty(STDOUT_FILENO))
        setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    at = parse_global(argc, argv, &o, &rc);
    if (at == 0)
        goto out;
    v = find_verb(argv[at]);
    if (v->run_args != NULL) {
        rc = v->run_args(argc - at - 1, argv + at + 1);
        goto out;
    }
    o.sets = calloc((size_t)argc, sizeof(*o.sets));
    o.jobs = calloc((size_t)argc, sizeof(*o.jobs));
    if (o.sets == NULL || o.jobs == NULL) {
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
    free(o.jobs);
    if (tc_flush_stdout() != TC_OK && rc == TC_OK)
        rc = TC_FAILED;
    return rc;
}
