/* The slow half of the export, sample, classify, retrieve and probe requests: a job's training
 * config rebuilt for its checkpoints, and td_export_llmc(), td_export_safetensors(), td_sample()
 * or a sensorlm embedder over sensor shards (with a linear probe fitted on its embeddings, for
 * probe) run on libuv's threadpool, so that the loop thread never waits on a model file, a
 * generation, a forward pass or a fit.
 *
 * Threads: td_work_new(), td_work_start(), the done callback and td_work_free() run on the
 * loop thread; only the work itself runs on a threadpool thread, and it touches nothing but
 * its td_work (no store, no job table, no loop handle). */
#ifndef TD_WORK_H
#define TD_WORK_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/daemon.h"
#include "train/probe.h"

#define TD_SAMPLE_MAX_TOKENS     4096 /* tokens one sample request may ask for */
#define TD_SAMPLE_DEFAULT_TOKENS 256  /* tokens when the request names none */

#define TD_CLASSIFY_MAX_WINDOWS 4096 /* windows one classify reply carries (a page) */
#define TD_RETRIEVE_MAX_TOP                                       \
    100 /* windows one retrieve reply carries: 100 captions of at \
         * most 4096 bytes stay well inside a frame */
#define TD_RETRIEVE_DEFAULT_TOP 5
#define TD_CLASSIFY_MAX_LABELS  256  /* labels one classify request may name (a shard's limit) */
#define TD_LABEL_PROMPT_MAX     4096 /* bytes of one label's prompt or a retrieve query */
/* Windows of each of a probe's shards: every one's embedding is kept, 65536 x E floats (192 MiB
 * at E = 768). */
#define TD_PROBE_MAX_WINDOWS 65536
#define TD_PROBE_MAX_SHOTS   16 /* rows one probe request may ask for */

typedef enum {
    TD_WORK_EXPORT = 1, /* an llm.c model file */
    TD_WORK_SAMPLE = 2,
    TD_WORK_EXPORT_ST = 3, /* a safetensors file (gpt or sensorlm) */
    TD_WORK_CLASSIFY = 4,  /* sensorlm: zero-shot labels of a page of a shard's windows */
    TD_WORK_RETRIEVE = 5,  /* sensorlm: a shard's windows nearest a query */
    TD_WORK_PROBE = 6      /* sensorlm: linear probes on a shard's embeddings, scored on another */
} td_work_kind;

/* One window's result: classify's label (an index into the labels) and score, or retrieve's
 * score and caption (malloc'd). */
typedef struct td_work_hit {
    int64_t index; /* the window in the shard */
    int label;
    float score; /* s_i . u: the cosine similarity of the unit embeddings */
    char *caption;
} td_work_hit;

typedef struct td_work td_work;
typedef struct td_work_lanes td_work_lanes;

/* Why a work stopped before its end (td_work.cancel). */
enum {
    TD_WORK_GOING = 0,
    TD_WORK_GONE = 1,    /* its client hung up or closed the connection: nothing is sent */
    TD_WORK_TIMEOUT = 2, /* it ran past [limits] work_timeout_s */
    TD_WORK_STOPPING = 3 /* the daemon is stopping */
};

/* Called on the loop thread when the work has run (or failed): rc, err and the results. */
typedef void (*td_work_cb)(td_work *w);

/* Public because it embeds a libuv request (STYLE.md habit 2). */
struct td_work {
    uv_work_t req;
    td_work_kind kind;
    int64_t job;
    td_train_config cfg;    /* the job's config, checkpoint_dir set */
    char path[TD_PATH_MAX]; /* export: the temp file under the state directory */

    /* the caller's: set them before td_work_start() */
    void *ud;
    int64_t req_id;          /* the request this answers */
    char *prompt;            /* sample: malloc'd, NUL-terminated; td_work_free() frees it */
    int tokens;              /* sample: 1 to TD_SAMPLE_MAX_TOKENS */
    float temperature;       /* sample: >= 0, 0 is greedy */
    uint64_t seed;           /* sample */
    const atomic_int *stop;  /* the daemon's work_stop, set by td_work_new: an embedding pass stops
                              * when the daemon stops */
    int64_t uid, gid;        /* classify, retrieve, probe: the requester, whose rights open data */
    char *data;              /* classify, retrieve: the shard's absolute path (malloc'd); probe:
                              * the train shard's */
    char *eval;              /* probe: the valid shard's absolute path (malloc'd) */
    char **names, **prompts; /* classify: nlabels names and prompts (malloc'd), or 0 labels:
                              * the shard's own; probe (a result): the shards' label names */
    int nlabels;
    int64_t first; /* classify: the page's first window */
    int limit;     /* classify: windows at most (1 to TD_CLASSIFY_MAX_WINDOWS); retrieve: top K */

    int64_t shots[TD_PROBE_MAX_SHOTS]; /* probe: each row's windows a class, 0 for all */
    int nshots;

    /* the results, valid in the done callback */
    int rc; /* 0, or a negative code with err saying why ("job 3 has no checkpoint yet") */
    td_error_t err;
    int fd;       /* export: the llm.c file, open for reading and already unlinked; -1 */
    int64_t size; /* export: its bytes */
    char *text;   /* sample: what was generated (not the prompt), text_len bytes, which
                   * may hold NULs: a text job's tokens are raw bytes */
    size_t text_len;
    int64_t windows;   /* classify, retrieve: windows in the shard; probe: in the train shard */
    td_work_hit *hits; /* classify: the page's windows in order; retrieve: best first */
    int nhits;
    int64_t eval_windows;  /* probe: windows in the valid shard */
    int64_t step;          /* probe: the checkpoint's step */
    int embed_dim;         /* probe: E */
    int64_t *train_counts; /* probe: nlabels, each class's windows in the train shard */
    int64_t *eval_counts;  /* probe: ... and in the valid shard */
    td_probe_row rows[TD_PROBE_MAX_SHOTS]; /* probe: nshots, in the order of shots */

    td_work_cb cb;

    /* the lanes' (td_work_queue): set on the loop thread, read by the work between batches
     * of windows and between tokens; TD_WORK_GOING, or why it stops */
    atomic_int cancel;
    td_work_lanes *lanes;
    int lane;            /* TD_LANE_ */
    int running;         /* handed to the threadpool */
    uint64_t started_ms; /* uv_now when it was */
    td_work *qnext;      /* its lane's queue, or the lanes' running list */
};

/* The threadpool's size: UV_THREADPOOL_SIZE as the environment sets it, else TD_WORK_POOL
 * threads, which this sets for libuv; call before the loop's first use of the pool. */
#define TD_WORK_POOL         8
#define TD_WORK_POOL_RESERVE 2 /* threads no lane takes: submit's checks, the launcher, uv_fs */
int td_work_pool_size(void);

/* Lanes in front of the threadpool: exports have a lane of their own, so that no number of
 * long model requests (classify, retrieve, probe, sample) holds them up, and model requests
 * another; together they leave TD_WORK_POOL_RESERVE threads free. Within a lane the next work
 * taken is that of the uid with the fewest of its works running there (the oldest among
 * equals), so one user's many requests share the lane with another's one. A work that runs past
 * timeout_s (0: none) is stopped; once *stop is set (the daemon stopping) every one is. Loop
 * thread. */
enum { TD_LANE_MODEL = 0, TD_LANE_EXPORT = 1, TD_NLANES = 2 };
int td_work_lanes_new(td_work_lanes **out, uv_loop_t *loop, int pool, double timeout_s,
                      const atomic_int *stop, td_error_t *err);
/* Threads each lane may hold at once. */
int td_work_lane_threads(const td_work_lanes *l, int lane);
/* Queues w in its lane; it runs as soon as the lane has a thread for it, and cb comes back on
 * the loop thread once it ran, or once it was stopped before it began. Borrows w until cb. */
void td_work_queue(td_work_lanes *l, td_work *w, td_work_cb cb);
/* w's client has gone: it stops at its next check (between windows' batches, between
 * tokens, between a probe's iterations), or, still queued, never starts; its cb still comes. */
void td_work_cancel(td_work *w);
/* Stops every work (queued ones get their cb with TD_ECANCELLED now, running ones stop at
 * their next check and get theirs when they do) and closes the lanes' timer. */
void td_work_lanes_close(td_work_lanes *l);
/* After the loop has run to its end (every cb has come). Accepts NULL. */
void td_work_lanes_free(td_work_lanes *l);

/* Makes a work item for job on behalf of uid: its config (td_daemon_job_config: the job in
 * memory, or else the spec the store keeps, with checkpoint_dir where every run keeps them);
 * an export's temp file goes in state_dir. Loop thread. Errors: TD_ENOTFOUND for no such
 * job; TD_EPERM when uid is neither the job's owner nor root ("permission denied: job 3
 * belongs to alice": a model can recite its training text); TD_EINVAL for a job of the wrong
 * kind ("job 3 is an mlp job; only gpt jobs export to llm.c files"; safetensors: gpt or
 * sensorlm; classify, retrieve and probe: sensorlm); TD_EJOB for a stored spec
 * that no longer validates (a dataset that is gone); TD_ENOMEM. Caller frees with
 * td_work_free(). */
int td_work_new(td_work **out, td_daemon *d, const char *state_dir, td_work_kind kind, int64_t job,
                int64_t uid, td_error_t *err);

/* Closes the export's file, frees the prompt, the text, the paths, the labels, the hits, the
 * counts and w. Accepts NULL.
 * Never while w is queued (between td_work_start() and its callback). */
void td_work_free(td_work *w);

#endif
