/* Job validation: turns a submitted job (the job file's object, as a decoded msgpack map)
 * into a td_jobspec, or refuses it with a message naming the field and why
 * ("model.layers[1]: must be a positive integer"). Unknown keys are refused too, so a typo
 * never silently falls back to a default. Pure: no I/O except checking that dataset files
 * exist and can be read. Called on the loop thread (submit, and at start for queued jobs). */
#ifndef TD_JOBSPEC_H
#define TD_JOBSPEC_H

#include "proto/proto.h"
#include "train/train.h"

#define TD_JOB_MAX_DEVICES      64        /* devices one job may ask for */
#define TD_JOB_MAX_BATCH        (1 << 20) /* rows of a job's batch_size, the largest accepted */
#define TD_JOB_MAX_NCCL_TIMEOUT 86400.0   /* seconds of nccl_timeout_s, the most accepted (a day) */
#define TD_JOB_MAX_NODES        256       /* nodes one job may span */

#define TD_JOB_MAX_LABELS 16 /* labels of one job */
#define TD_JOB_LABEL_MAX  63 /* bytes of a label's name, and of its value */

typedef struct td_jobspec {
    char name[128];
    int devices;  /* devices requested; default 1 */
    int priority; /* higher runs first; default 0 */
    /* A job that spans nodes (nodes > 1): one `traind rank` process per node, each training
     * on devices_per_node devices of its own; devices is then the local job's default (1) and
     * means nothing. For a job of one node, devices_per_node = devices. */
    int nodes;            /* default 1 */
    int devices_per_node; /* default 1 */
    int min_nodes;        /* the fewest a restart may run on; default nodes */
    int max_restarts;     /* relaunches after a rank's death; default 0 */
    td_train_config train;
    int batch_auto;        /* batch_size "auto": the memory guard picks the largest batch that
                            * fits the job's devices at its first start (train.batch_size is 0
                            * until then); the daemon then stores the choice in the job */
    double nccl_timeout_s; /* "nccl_timeout_s": seconds a collective may take before the job
                            * fails; 0: the daemon's default (traind.conf [cuda] nccl_timeout_s) */
    /* debug.fail, applied by the daemon to the replicas on the named devices */
    td_fail_kind fail_kind; /* TD_FAIL_NONE when the job has no debug.fail */
    int64_t fail_step;
    uint64_t fail_devices; /* bit d set: device d fails */
    uint64_t fail_nodes;   /* bit n set: node n's devices fail (every node: all bits) */
    /* debug.hold: the step after which the job waits until it is cancelled or interrupted;
     * -1 for none */
    int64_t hold_step;
    /* Whose rights the job's files are opened with (train/data.h, td_data_access), at every
     * open: at submit's checks, at the memory guard and when a run loads them, a resume after
     * a restart included. Not job-file keys: the daemon sets them from the submitter (uid and
     * the gid it connected with; after a restart, the stored uid, gid -1: its passwd entry's
     * primary group). -1 after td_jobspec_parse: unknown, and a run refuses to start. */
    int64_t uid, gid;
} td_jobspec;

/* Refuses a job holding a string, or a map key, that is not valid UTF-8 without control
 * characters (C0, DEL, C1): names and paths from a submitter end up on other users' terminals
 * and in traind's log. TD_EJOB naming the field and the byte, e.g. `name: must be text without
 * control characters (byte 3 is 0x0a)`. Submit checks this before td_jobspec_parse; jobs
 * stored before it was checked are still read. */
int td_jobspec_check_text(const td_pval *job, td_error_t *err);

/* Fills *out from job. Returns 0, or TD_EJOB with err naming the field. */
int td_jobspec_parse(const td_pval *job, td_jobspec *out, td_error_t *err);

/* td_jobspec_parse for a submit, on the loop: the same checks but what is at the file paths
 * (they must still be absolute), which td_jobspec_check_paths then checks off the loop, with
 * the same messages: nothing of a submitter's paths (a glob that walks a whole tree, a path on
 * a hung mount) is touched on the loop thread. */
int td_jobspec_parse_submit(const td_pval *job, td_jobspec *out, td_error_t *err);
int td_jobspec_check_paths(const td_jobspec *spec, td_error_t *err);

/* td_jobspec_parse for a job the daemon stored at submit, when only its configuration is
 * needed (export, sample): the same checks but for the files, which were readable then and
 * may have gone since (an ended job's dataset, deleted). */
int td_jobspec_parse_stored(const td_pval *job, td_jobspec *out, td_error_t *err);

/* Re-encodes the stored job map spec (msgpack, as submitted) with its "batch_size" set to
 * batch (replacing "auto"), into *out (malloc'd, *out_len bytes; caller frees). For the
 * daemon to store the batch an "auto" job was given, so a restart resumes with the same one.
 * TD_EPROTO for a spec that is not a map, TD_ENOMEM. */
int td_jobspec_set_batch(const void *spec, size_t len, int batch, void **out, size_t *out_len,
                         td_error_t *err);

/* Refuses a job naming a file its submitter could not read. The daemon (often root) opens
 * datasets and init_from files itself, so it checks, as the submitting user (uid, gid and the
 * user's supplementary groups), the read bit of each file and the search bit of every
 * directory on its resolved path. ACLs are not consulted: a file readable only through an
 * ACL is refused, never the reverse. uid 0 may read anything. TD_EPERM naming the field.
 * Then td_jobspec_check_files. This check names the field early; what protects the files is
 * that every later open is made with the user's rights (td_jobspec.uid). */
int td_jobspec_check_access(const td_jobspec *spec, int64_t uid, int64_t gid, td_error_t *err);

/* Reads the job's files as the user (uid, gid) would and checks them against the model, as
 * the start would (train.h td_train_check_files): every file regular, the headers' magics,
 * versions, counts and sizes, the labels' range against the last layer, init_from's
 * dimensions, the dataset's bytes in memory against TD_DATA_MAX_BYTES. TD_EJOB naming the
 * field, the file and what is wrong ("data.train.images: /x/labels.gz: magic 0x00000801 is an
 * IDX labels file, expected images (0x00000803)"); TD_EPERM for a file the user may not
 * open. */
int td_jobspec_check_files(const td_jobspec *spec, int64_t uid, int64_t gid, td_error_t *err);

#endif
