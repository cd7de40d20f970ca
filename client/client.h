/* trainctl's internal interface: the exit statuses, the parsed command line, the connection
 * to traind (conn.c), job files and JSON (jobjson.c), metric rows (rows.c), human output
 * (output.c), diagnostics (diag.c) and the verbs (verbs.c, watch.c, plot.c, completion.c).
 *
 * trainctl is a program, not a library, so its functions return what the process will exit
 * with: 0, or a sysexits(3) status after the function has already said why on stderr. That
 * keeps each failure's message next to the place that knows it, and main() has nothing left
 * to translate. Single-threaded; every function is called from main's thread. */
#ifndef TC_CLIENT_H
#define TC_CLIENT_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <jansson.h>

#include "proto/proto.h"

/* Exit statuses (sysexits.h numbers, written out so the contract is visible in one place). */
enum {
    TC_OK = 0,
    TC_FAILED = 1,       /* the job failed or was cancelled (watch), or traind refused, or
                          * the job would not fit its devices (submit --dry-run) */
    TC_USAGE = 64,       /* EX_USAGE: unknown verb or flag, missing or bad argument */
    TC_DATAERR = 65,     /* EX_DATAERR: the job file is not a valid job */
    TC_NOINPUT = 66,     /* EX_NOINPUT: the job file is missing or unreadable */
    TC_UNAVAILABLE = 69, /* EX_UNAVAILABLE: traind cannot be reached or went away */
    TC_OSERR = 71,       /* EX_OSERR: the dashboard cannot listen (its port is taken) */
    TC_TEMPFAIL = 75,    /* EX_TEMPFAIL: traind said EBUSY (its store is locked by another
                          * process): the same request may succeed if tried again */
    TC_CANTCREAT = 73,   /* EX_CANTCREAT: plot or export cannot write its output file */
    TC_PROTOCOL = 76,    /* EX_PROTOCOL: traind said something this client cannot read */
    TC_NOPERM = 77,      /* EX_NOPERM: traind said EPERM, or the socket refused us */
    TC_CONFIG = 78,      /* EX_CONFIG: the socket path cannot be a socket path */
    TC_INTERRUPTED = 130 /* 128 + SIGINT: the user stopped a watch or an export */
};

#define TC_DEFAULT_SOCKET    "/run/traind/traind.sock"
#define TC_REPLY_TIMEOUT_MS  60000 /* ms a request waits for a byte of its reply */
#define TC_SAMPLE_MAX_TOKENS 4096  /* tokens one sample may ask for (PROTOCOL.md) */
#define TC_RETRIEVE_MAX_TOP  100   /* windows one retrieve may ask for (PROTOCOL.md) */
#define TC_PROBE_MAX_SHOTS   16    /* rows one probe may ask for (PROTOCOL.md) */
#define TC_PROBE_MAX_K       65536 /* windows a class one probe row may take (PROTOCOL.md) */
#define TC_LS_NAME_GLOB_MAX  255   /* bytes of list's name pattern (PROTOCOL.md, "list") */

typedef struct tc_row tc_row;

/* The command line, as parsed by trainctl.c. Strings are borrowed from argv. */
typedef struct tc_opts {
    const char *socket; /* --socket, $TRAIND_SOCKET or TC_DEFAULT_SOCKET */
    const char *file;   /* submit: the job file ("-" for stdin) */
    const char **sets;  /* submit: each --set KEY=VALUE, in order */
    size_t nsets;       /* entries in sets */
    int64_t job;        /* the JOB argument; -1 when the verb takes none */
    int64_t *jobs;      /* plot: every JOB argument, in order */
    size_t njobs;       /* entries in jobs */
    const char *output; /* plot, export: -o FILE */
    const char *shell;  /* completion: the shell named */
    const char *keys;   /* --keys as given ("a,b"), or NULL */
    int64_t since;      /* --since, or -1 */
    int64_t tokens;     /* sample: --tokens, or -1 */
    const char *prompt; /* sample: --prompt, or NULL */
    double temperature; /* sample: --temperature, or -1 */
    int64_t seed;       /* sample: --seed, or -1 */
    int json, csv, summary;
    int dry_run;           /* submit: --dry-run */
    int follow;            /* logs: -f, --follow */
    int yaml;              /* ls, status: -o yaml */
    int wide;              /* ls: -o wide */
    const char *ls_format; /* ls: --format FIELDS, or NULL */
    const char *sort;      /* ls: --sort [-]FIELD, or NULL */
    const char *selector;  /* ls, cancel, prune: --selector NAME=VALUE,... (checked), or NULL */
    /* ls's filters (PROTOCOL.md, "list"); each absent unless given. */
    unsigned states;       /* --state: TC_STATE_ bits; 0: any state */
    int64_t uid;           /* --user as a uid, or -1 */
    const char *name_glob; /* --name GLOB, or NULL */
    double created_since;  /* --since as a unix time, or -1 */
    int64_t limit;         /* --limit: the newest N, or -1 for all */
    /* plot */
    int panels; /* --panels: one panel per key */
    int log_y;  /* --log: a logarithmic y axis */
    /* dashboard */
    const char *listen; /* --listen HOST:PORT, or NULL for 127.0.0.1:8080 */
    /* prune */
    double older_than; /* --older-than in seconds, or -1 */
    /* classify, retrieve, probe, export (tools.c, interop.c) */
    const char *data;                  /* --data SHARD (probe: the train shard) */
    const char *eval;                  /* probe: --eval SHARD, the valid shard */
    int64_t shots[TC_PROBE_MAX_SHOTS]; /* probe: --shots, 0 for all */
    int nshots;                        /* ... how many; 0: traind's default (1, 5, 10, all) */
    const char *labels;        /* classify: --labels as given ("rest,run=running day"), or NULL */
    const char *query;         /* retrieve: --query */
    int64_t top;               /* retrieve: --top, or -1 (traind's default, 5) */
    const char *export_format; /* export: --format llmc|safetensors, or NULL (from -o's name) */
} tc_opts;

/* Job states as --state bits, in the protocol's order; tc_state_names[i] is bit 1 << i. */
enum { TC_NSTATES = 5 };
extern const char *const tc_state_names[TC_NSTATES];

/* Nonzero while watch.c has a progress line without its newline on stdout; tc_err() ends
 * that line first so a diagnostic never lands in the middle of it. */
extern int tc_line_open;

/* Set by watch.c's SIGINT handler; a wait that it interrupts returns TC_INTERRUPTED. */
extern volatile sig_atomic_t tc_interrupted;

/* Prints "trainctl: <message>" on stderr and returns status. */
int tc_err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- conn.c: one connection to traind, blocking ---- */

typedef struct tc_conn tc_conn;

/* Connects to the socket at path and exchanges hello. Caller closes with tc_conn_close(). */
int tc_conn_open(tc_conn **out, const char *path);

/* A blocking Unix stream socket connected to path (close-on-exec); -1 with errno set on
 * failure (ENAMETOOLONG for a path too long for sun_path). tc_conn_open's and the
 * dashboard's connections both start here. */
int tc_connect_unix(const char *path);
void tc_conn_close(tc_conn *c);

/* Starts the next request: a map of npairs pairs (type and id included, which this writes).
 * The caller writes the other npairs - 2 pairs into the returned writer, then calls
 * tc_conn_send(). The writer is borrowed from the connection. */
td_pw *tc_conn_request(tc_conn *c, const char *type, uint32_t npairs);
int tc_conn_send(tc_conn *c);

/* Waits up to timeout_ms (-1: without limit) for the next frame answering the last request.
 * Returns 0 with *out set (caller frees with td_proto_frame_free()), or 0 with *out NULL when
 * the time ran out. An error frame from traind is printed and becomes its status: 65 for
 * EJOB, 76 for EPROTO and EVERSION, 77 for EPERM, else 1. */
int tc_conn_recv(tc_conn *c, td_proto_frame **out, int timeout_ms);

/* --selector: the number of NAME=VALUE pairs in sel (checked by tc_selector_check), and
 * them written to w as the requests' labels map (PROTOCOL.md, "list"): the key "labels" and
 * the map. */
uint32_t tc_selector_count(const char *sel);
void tc_pw_selector(td_pw *w, const char *sel);
/* 0 when sel is NAME=VALUE[,NAME=VALUE]... (at most 16, names 1 to 63 bytes, values at most
 * 63); else -1 with what is wrong in why. */
int tc_selector_check(const char *sel, char *why, size_t size);

/* quiet: traind's error frames become their status without being printed (a request whose
 * refusal the caller reports its own way: describe's events of another user's job). */
void tc_conn_quiet(tc_conn *c, int quiet);

/* tc_conn_recv() within TC_REPLY_TIMEOUT_MS, requiring the frame's type to be type. */
int tc_conn_expect(tc_conn *c, const char *type, td_proto_frame **out);

/* Nonzero when traind's hello listed feature (PROTOCOL.md, hello: "dry_run", ...). */
int tc_conn_has(const tc_conn *c, const char *feature);

/* Sends {type, id, job_id: job} and waits for a reply of type reply (tc_conn_expect). */
int tc_conn_job_request(tc_conn *c, const char *type, int64_t job, const char *reply,
                        td_proto_frame **out);

/* What a metrics reply's end frame said of the keys asked for (PROTOCOL.md, "metrics"): the
 * names the job has no rows of, and the names it has, each as "a, b" (escaped, cut with
 * "..." when long). nmissing 0 when every key named has rows (or traind does not say). */
typedef struct tc_key_report {
    size_t nmissing;
    char missing[1024];
    char available[2048];
} tc_key_report;

/* Sends a metrics request for job (restricted to keys, "a,b", when not NULL) and calls
 * row(ud, row) for every row of the reply up to its end frame, then fills *report (when not
 * NULL) from the end frame. A nonzero return from row stops the stream and is returned. */
typedef int (*tc_row_fn)(void *ud, const tc_row *row);
int tc_conn_metrics(tc_conn *c, int64_t job, const char *keys, tc_row_fn row, void *ud,
                    tc_key_report *report);

/* Writes `keys` as an array of the non-empty names in the comma-separated list s. */
void tc_pw_keys(td_pw *w, const char *s);

/* Nonzero when v is a string equal to s. */
int tc_pv_is(const td_pval *v, const char *s);

/* ---- jobjson.c: job files, --set, JSON <-> msgpack ---- */

/* Reads the job file at path ("-": stdin). 66 when it cannot be opened or read, 65 when it
 * is not JSON or not an object. On success *out is a new reference the caller decrefs. */
int tc_job_load(const char *path, json_t **out);

/* Applies one --set KEY=VALUE to job: dotted keys go into nested objects (made as needed);
 * VALUE is parsed as JSON when it is JSON, else taken as a string. 64 on a bad argument. */
int tc_job_set(json_t *job, const char *assignment);

/* Makes the job's relative file paths (data.train, data.test, data.valid: a path, a glob, a
 * list of them or {images, labels}; model.init_from) absolute against the current directory,
 * where the user runs trainctl: traind refuses relative paths, since its own working directory
 * is nobody's. Globs stay globs; ".." and symlinks are left for traind's open to follow. */
int tc_job_resolve_paths(json_t *job);

/* Writes a JSON value as msgpack: objects as maps, arrays as arrays, integers as int, reals as
 * float64, strings as str, true/false as bool, null as nil. depth is v's depth in the frame
 * it will travel in (the frame's top map is 1). 65 when it exceeds the protocol's limits. */
int tc_json_to_pw(td_pw *w, const json_t *v, int depth);

/* A decoded value as a new JSON value (NULL on allocation failure). Non-finite floats and
 * values JSON cannot hold become null; binary strings become hex text. */
json_t *tc_pv_to_json(const td_pval *v);

/* Prints v as JSON on stdout followed by a newline: indented when pretty, else one line. */
int tc_print_json(const td_pval *v, int pretty);
/* The same for a JSON value; borrows j. */
int tc_dump_json(const json_t *j, int pretty);
/* j as block YAML on f (-o yaml); borrows j. */
int tc_dump_yaml(FILE *f, const json_t *j);
/* A reply's top map as pretty JSON, without the protocol's own type and id. */
int tc_print_reply_json(const td_pval *root);

/* Prints the string as a JSON string literal (quotes and escapes included). */
void tc_json_str(FILE *f, const char *s, size_t len);

/* ---- rows.c: metric rows ---- */

/* One metric row, pointing into its frame. */
struct tc_row {
    const char *key;
    size_t keylen;
    int64_t step;
    double value, time;
};

/* Reads element i of a rows frame's `rows`. 76 (printed) when it is not a well-formed row. */
int tc_row_at(const td_pval *rows, size_t i, tc_row *out);

/* Prints a row as one line of JSON: {"job","key","step","value","time"}. */
void tc_row_json(FILE *f, int64_t job, const tc_row *row);

/* Streams a metrics reply into output; see rows.c. */
typedef struct tc_sink tc_sink;
int tc_sink_new(tc_sink **out, const tc_opts *o);
int tc_sink_add(tc_sink *s, const tc_row *row);
int tc_sink_finish(tc_sink *s);
void tc_sink_free(tc_sink *s);

/* ---- output.c: text for people ---- */

/* Getters over a JOB map with defaults for absent fields. tc_job_str escapes what it copies
 * (td_text_escape: control characters and malformed UTF-8 as \xNN), and tc_job_error keeps
 * only newlines, so a string some client gave traind cannot drive this user's terminal. */
int64_t tc_job_int(const td_pval *job, const char *key, int64_t dflt);
double tc_job_double(const td_pval *job, const char *key, double dflt);
void tc_job_str(const td_pval *job, const char *key, char *buf, size_t size);

/* Local time of a unix time as "2026-11-30 05:16:51", or "-" for 0 (not yet). */
void tc_fmt_time(char *buf, size_t size, double t);
/* "1m35s", "2h05m", "3d04h", "12s". */
void tc_fmt_duration(char *buf, size_t size, double seconds);
/* A metric value for a person: %.6g, or an integer without a decimal point. */
void tc_fmt_value(char *buf, size_t size, double v);

void tc_print_status(const td_pval *job);
/* ls (ls.c): the table of n JOB maps, the columns of format (field names, comma-separated:
 * tc_ls_default_format, tc_ls_wide_format), sorted by sort ([-]FIELD; NULL: as given). */
extern const char *const tc_ls_default_format, *const tc_ls_wide_format;
int tc_ls_print(const td_pval **jobs, size_t n, const char *format, const char *sort);
/* Sorts jobs as the table would (for -o json and yaml). */
int tc_ls_sort(const td_pval **jobs, size_t n, const char *sort);
/* 0 when every name in format is a field; else -1 with the first bad one in bad. */
int tc_ls_check_format(const char *format, char *bad, size_t size);
/* 0 when sort names a field (after an optional '-'). */
int tc_ls_check_sort(const char *sort);
/* The field names, "id, name, ...". */
void tc_ls_field_names(char *buf, size_t size);
/* `info` for a person, from the info reply's top map. */
void tc_print_info(const td_pval *info);
/* submit --dry-run's estimate reply, for a person: one line per part, in MiB. */
void tc_print_estimate(const td_pval *est);
/* "12.3 MiB" */
void tc_fmt_bytes(char *buf, size_t size, double bytes);
/* Unix time now, with a fraction. */
double tc_now_real(void);
/* The job's error message (or its code's text) into buf; empty when the job has none. */
void tc_job_error(const td_pval *job, char *buf, size_t size);
/* Nonzero for the keys of evaluation metrics: test_*, valid_*, val_*, and a sensorlm's
 * recall_at_*, text_recall_at_*, zeroshot_*. */
int tc_is_eval_key(const char *key, size_t len);
/* "key value  key value" for the job's evaluation metrics and train_loss, into buf. */
void tc_job_results(const td_pval *job, char *buf, size_t size);

/* Finishes stdout: 1 (printed) when it could not be written. */
int tc_flush_stdout(void);

/* ---- the verbs ---- */

int tc_submit(const tc_opts *o); /* and submit --dry-run */
int tc_status(const tc_opts *o);
int tc_ls(const tc_opts *o);
int tc_cancel(const tc_opts *o);
int tc_metrics(const tc_opts *o);
int tc_info(const tc_opts *o);
int tc_logs(const tc_opts *o);
int tc_watch(const tc_opts *o);
int tc_describe(const tc_opts *o);
int tc_plot(const tc_opts *o);
int tc_completion(const tc_opts *o);
int tc_export(const tc_opts *o);
int tc_sample(const tc_opts *o);
int tc_classify(const tc_opts *o); /* tools.c */
int tc_retrieve(const tc_opts *o);
int tc_probe(const tc_opts *o);
/* verbs_history.c: deleting ended jobs (rm: at most TC_RM_MAX_JOBS at once, PROTOCOL.md's
 * limit). */
#define TC_RM_MAX_JOBS 1000
int tc_rm(const tc_opts *o);
int tc_prune(const tc_opts *o);
/* dashboard/: the web dashboard, served until SIGINT or SIGTERM (dashboard/dashboard.h). */
int tc_dashboard(const tc_opts *o);

/* ---- sensor.c, synth.c: the local sensor-data tools (no daemon) ---- */

/* trainctl sensor: argv holds the arguments after "sensor" (the subcommand first). */
int tc_sensor(int argc, char **argv);
/* Its flags, space-separated, for the completion script. */
const char *tc_sensor_flag_names(void);

/* What `sensor synth` writes: days in all into dir, a fraction valid of them in the valid
 * shard, captions of at most caption_len bytes, from seed. */
typedef struct tc_synth_opts {
    const char *dir;
    int64_t days;
    uint64_t seed;
    double valid;
    int caption_len;
} tc_synth_opts;
int tc_sensor_synth(const tc_synth_opts *o);

/* ---- trainctl.c: the command table, as completion.c reads it ---- */

/* One verb: its name, its flags as one space-separated string ("--keys --json -o"), what its
 * positional argument is ("" for none, "JOB", "JOBS" for one or more, "FILE" or "SHELL"), and
 * what -o takes ("" when it has no -o, "json", "csv json", or "FILE"). */
typedef struct tc_verb_desc {
    const char *name;
    char flags[256];
    const char *arg;
    const char *output;
    const char *brief; /* one line: what the verb does */
} tc_verb_desc;

/* Fills *out for the i-th verb; -1 past the last one. */
int tc_verb_at(size_t i, tc_verb_desc *out);

/* One flag of a verb, for the completion scripts: its name ("--keys", "-o"), what its value
 * is ("" when it takes none; else a word for it: "FILE", "FORMAT" (the verb's -o values),
 * "KEYS", "STATES" and "USER" have values to offer; "STEP", "GLOB", "TIME", "N", "TEXT",
 * "NUMBER" and any other word none), and one line saying what it does. A verb that parses its
 * own flags (sensor) has none here; its names are in tc_verb_desc.flags. */
typedef struct tc_flag_desc {
    const char *name;
    const char *value;
    const char *desc;
} tc_flag_desc;

/* Fills *out for the j-th flag of the i-th verb (--help not included); -1 past the last. */
int tc_verb_flag_at(size_t i, size_t j, tc_flag_desc *out);

#endif
