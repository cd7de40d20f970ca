/* Helpers of the test_daemon_* integration tests (jobs_support.h): an MLP job on Fashion-MNIST
 * sent as a client sends it, a job watched to its failure, and a job's metric rows counted in
 * the daemon's SQLite file. Owns nothing between calls; called from the test process's one
 * thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tests/jobs_support.h"
#include "proto/proto.h"
#include "store/store.h"
#include "tests/support.h"

#define FMNIST "/usr/share/datasets/fashion-mnist"

/* A job as the client would send it, in msgpack. The test set is a slice of t10k so that
 * evaluation stays quick. */
static void write_mlp_job_ex(td_pw *w, const char *name, int layers1, int64_t max_steps,
                             int with_test, const tj_extra *x)
{
    uint32_t n = 7;
    int nfail = 0;

    if (x != NULL) {
        n += (x->devices > 0) + (x->fail_kind != NULL) + (x->checkpoint_every > 0);
        while (x->fail_kind != NULL && nfail < 4 && x->fail_devices[nfail] >= 0)
            nfail++;
    }
    td_pw_map(w, n);
    if (x != NULL && x->devices > 0) {
        td_pw_str(w, "devices");
        td_pw_int(w, x->devices);
    }
    if (x != NULL && x->checkpoint_every > 0) {
        td_pw_str(w, "checkpoint_every");
        td_pw_int(w, x->checkpoint_every);
    }
    if (x != NULL && x->fail_kind != NULL) {
        td_pw_str(w, "debug");
        td_pw_map(w, 1);
        td_pw_str(w, "fail");
        td_pw_map(w, 3);
        td_pw_str(w, "step");
        td_pw_int(w, x->fail_step);
        td_pw_str(w, "kind");
        td_pw_str(w, x->fail_kind);
        td_pw_str(w, "device");
        td_pw_array(w, (uint32_t)nfail);
        for (int i = 0; i < nfail; i++)
            td_pw_int(w, x->fail_devices[i]);
    }
    td_pw_str(w, "name");
    td_pw_str(w, name);
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, x != NULL && x->hidden2 > 0 ? 4 : 3);
    td_pw_int(w, 784);
    td_pw_int(w, layers1);
    if (x != NULL && x->hidden2 > 0)
        td_pw_int(w, x->hidden2);
    td_pw_int(w, 10);
    td_pw_str(w, "data");
    td_pw_map(w, with_test ? 3 : 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, FMNIST "/train-images-idx3-ubyte.gz");
    td_pw_str(w, "labels");
    td_pw_str(w, FMNIST "/train-labels-idx1-ubyte.gz");
    if (with_test) {
        td_pw_str(w, "test");
        td_pw_map(w, 2);
        td_pw_str(w, "images");
        td_pw_str(w, FMNIST "/t10k-images-idx3-ubyte.gz");
        td_pw_str(w, "labels");
        td_pw_str(w, FMNIST "/t10k-labels-idx1-ubyte.gz");
    }
    td_pw_str(w, "optim");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "adamw");
    td_pw_str(w, "lr");
    td_pw_double(w, 1e-3);
    td_pw_str(w, "batch_size");
    if (x != NULL && x->batch_auto)
        td_pw_str(w, "auto");
    else
        td_pw_int(w, x != NULL && x->batch > 0 ? x->batch : 64);
    td_pw_str(w, "max_steps");
    td_pw_int(w, max_steps);
    td_pw_str(w, "seed");
    td_pw_int(w, 7);
}

/* Submits and returns the job id, or the (negative) error code with msg filled. */
int64_t tj_submit(ts_client *c, const char *name, int layers1, int64_t max_steps, char *msg,
                  size_t msgsize)
{
    return tj_submit_ex(c, name, layers1, max_steps, NULL, msg, msgsize);
}

/* tj_submit() with the extra keys of x (NULL: none). */
int64_t tj_submit_ex(ts_client *c, const char *name, int layers1, int64_t max_steps,
                     const tj_extra *x, char *msg, size_t msgsize)
{
    td_proto_frame *f;
    const td_pval *root;
    int64_t r;

    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    write_mlp_job_ex(&c->w, name, layers1, max_steps, 1, x);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    if (ts_str_is(td_pv_get(root, "type"), "submitted")) {
        r = ts_get_i(root, "job_id");
    } else {
        assert_true(ts_str_is(td_pv_get(root, "type"), "error"));
        r = ts_get_i(root, "code");
        if (msg != NULL)
            ts_get_s(root, "message", msg, msgsize);
    }
    td_proto_frame_free(f);
    return r;
}

/* Watches job id to its end, which must be "failed" with exactly message; stage names the
 * check in the failure. */
void tj_expect_failure(ts_client *c, int64_t id, const char *message, const char *stage)
{
    ts_watched w;

    ts_watch_to_end(c, id, &w);
    assert_string_equal(w.final_state, "failed");
    if (strcmp(w.error, message) != 0)
        fail_msg("%s: expected error \"%s\", got \"%s\"", stage, message, w.error);
}

static int count_rows(void *ud, const td_metric_row *row)
{
    (*(int64_t *)ud)++;
    return 0;
}

/* Rows of key stored in SQLite for job, read straight from the database file. */
int64_t tj_stored_rows(const ts_daemon *d, int64_t job, const char *key)
{
    td_store *s;
    td_metric_cursor cur;
    td_error_t err;
    const char *keys[1] = {key};
    int64_t n = 0;
    size_t got;

    assert_int_equal(td_store_open(&s, d->db, &err), 0);
    td_metric_cursor_init(&cur, 0);
    do {
        assert_int_equal(
            td_store_metrics_page(s, job, &cur, keys, 1, 1000, count_rows, &n, &got, &err), 0);
    } while (got == 1000);
    td_store_close(s);
    return n;
}
