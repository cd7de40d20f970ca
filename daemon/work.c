/* Export and sample on libuv's threadpool (work.h): the loop thread rebuilds the job's config
 * and queues the work; a threadpool thread writes the llm.c file to a temp file under the
 * state directory (then opens and unlinks it, so that the bytes live only as long as the
 * descriptor the loop thread streams them from) or generates the sample; the loop thread gets
 * the result back in the done callback. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "work.h"

#define TOKEN_TEXT_MAX                                                      \
    12 /* bytes one token takes in a sample's text: a tokens job writes its \
        * id (at most 10 digits) and a space */

static unsigned export_serial; /* loop thread: tells concurrent exports' temp files apart */

/* err's message, now prefixed: "job 3: " + what it said. */
static int prefix_job(td_error_t *err, int64_t job)
{
    td_error_t was = *err;

    return td_error_set(err, was.code, "job %lld: %s", (long long)job, was.msg);
}

int td_work_new(td_work **out, td_daemon *d, const char *state_dir, td_work_kind kind, int64_t job,
                int64_t uid, td_error_t *err)
{
    td_work *w = calloc(1, sizeof(*w));
    td_train_config *cfg;
    int rc;

    *out = NULL;
    if (w == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    w->kind = kind;
    w->job = job;
    w->stop = td_daemon_stop_flag(d);
    w->fd = -1;
    cfg = &w->cfg;
    /* Export and sample read the checkpoints every run writes. A model can recite the text it
     * was trained on, so only the job's owner (or root) may (td_daemon_job_config checks). */
    rc = td_daemon_job_config(d, job, uid, cfg, err);
    if (rc == 0 && cfg->model != TD_MODEL_GPT)
        rc = td_error_set(err, TD_EINVAL, "job %lld is an %s job; only gpt jobs %s", (long long)job,
                          cfg->model == TD_MODEL_MLP ? "mlp" : "unknown",
                          kind == TD_WORK_EXPORT ? "export to llm.c files" : "can be sampled");
    if (rc == 0 && kind == TD_WORK_EXPORT &&
        snprintf(w->path, sizeof(w->path), "%s/export-%lld-%u.bin", state_dir, (long long)job,
                 ++export_serial) >= (int)sizeof(w->path))
        rc = td_error_set(err, TD_EINVAL, "the state directory's path is too long");
    if (rc != 0) {
        free(w);
        return rc;
    }
    *out = w;
    return 0;
}

/* Whether dir holds a checkpoint file (ckpt.h names them ckpt-STEP.bin), so that a job that
 * has none yet is told apart from one whose files cannot be read. */
static int has_checkpoint(const char *dir)
{
    DIR *dh = opendir(dir);
    struct dirent *e;
    int found = 0;

    if (dh == NULL)
        return 0;
    while (!found && (e = readdir(dh)) != NULL)
        found = strncmp(e->d_name, "ckpt-", 5) == 0;
    closedir(dh);
    return found;
}

/* The llm.c file, written to w->path, opened, and unlinked: a daemon that dies while it
 * streams leaves nothing behind. */
static void run_export(td_work *w)
{
    struct stat st;

    w->rc = td_export_llmc(&w->cfg, w->path, &w->err);
    if (w->rc != 0)
        return;
    w->fd = open(w->path, O_RDONLY | O_CLOEXEC);
    if (w->fd < 0 || fstat(w->fd, &st) != 0)
        w->rc = td_error_set(&w->err, TD_EIO, "%s: %s", w->path, strerror(errno));
    else
        w->size = (int64_t)st.st_size;
    unlink(w->path);
}

static void run_sample(td_work *w)
{
    size_t cap = (size_t)w->tokens * TOKEN_TEXT_MAX + 1;

    w->text = malloc(cap);
    if (w->text == NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "no memory for %zu bytes of text", cap);
        return;
    }
    w->rc = td_sample(&w->cfg, w->prompt != NULL ? w->prompt : "", w->tokens, w->temperature,
                      w->seed, w->stop, w->text, cap, &w->err);
    if (w->rc == TD_ECANCELLED) {
        td_error_t why = w->err;
        td_error_set(&w->err, w->rc, "%s: traind is stopping", why.msg);
    }
    if (w->rc != 0)
        return;
    /* A text job writes exactly one byte per token, NUL included (the text is NUL-terminated
     * right after the last token), so its length is the token count, not strlen's. */
    if (w->cfg.data == TD_DATA_TEXT && w->text[w->tokens] == '\0')
        w->text_len = (size_t)w->tokens;
    else
        w->text_len = strlen(w->text);
}

/* Threadpool thread. */
static void on_work(uv_work_t *req)
{
    td_work *w = req->data;

    if (!has_checkpoint(w->cfg.checkpoint_dir)) {
        w->rc = td_error_set(&w->err, TD_ENOTFOUND, "job %lld has no checkpoint yet",
                             (long long)w->job);
        return;
    }
    if (w->kind == TD_WORK_EXPORT)
        run_export(w);
    else
        run_sample(w);
    if (w->rc != 0)
        prefix_job(&w->err, w->job);
}

/* Loop thread. */
static void on_after_work(uv_work_t *req, int status)
{
    td_work *w = req->data;

    if (status != 0 && w->rc == 0)
        w->rc =
            td_error_set(&w->err, status, "job %lld: %s", (long long)w->job, uv_strerror(status));
    w->cb(w);
}

int td_work_start(td_work *w, uv_loop_t *loop, td_work_cb cb)
{
    w->cb = cb;
    w->req.data = w;
    return uv_queue_work(loop, &w->req, on_work, on_after_work);
}

void td_work_free(td_work *w)
{
    if (w == NULL)
        return;
    if (w->fd >= 0)
        close(w->fd);
    free(w->prompt);
    free(w->text);
    free(w);
}
