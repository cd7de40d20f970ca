/* Helpers shared by the test_daemon_* integration tests, on top of support.c's client: an MLP
 * job on Fashion-MNIST (784-N-10, or with a second hidden layer) written in msgpack as a client
 * sends it, with extra keys for devices, batch, checkpoints and injected faults; submitting it;
 * watching a job fail with an exact message; counting a job's metric rows straight from the
 * daemon's SQLite file. They fail the calling test through cmocka's assertions, so include
 * <cmocka.h> first. Tests that use them link proto/ and store/ (tests/meson.build). */
#ifndef TS_JOBS_SUPPORT_H
#define TS_JOBS_SUPPORT_H

#include <stddef.h>
#include <stdint.h>

#include "tests/support.h"

/* Extra keys of a test job: devices, and an injected fault. */
typedef struct tj_extra {
    int devices;              /* 0: leave the key out */
    int64_t fail_step;        /* with fail_kind */
    const char *fail_kind;    /* NULL: no debug.fail */
    int fail_devices[4];      /* device numbers, ended by -1 */
    int batch;                /* 0: 64 */
    int64_t checkpoint_every; /* 0: leave the key out */
    int hidden2;              /* a second hidden layer of this width; 0: none */
    int batch_auto;           /* batch_size "auto" (batch is then ignored) */
} tj_extra;

/* Submits an MLP job named name with a hidden layer of layers1, max_steps steps, batch 64,
 * seed 7; returns the job id, or the (negative) error code with msg (msgsize bytes, may be
 * NULL) filled. tj_submit_ex adds the keys of x (NULL: none). */
int64_t tj_submit(ts_client *c, const char *name, int layers1, int64_t max_steps, char *msg,
                  size_t msgsize);
int64_t tj_submit_ex(ts_client *c, const char *name, int layers1, int64_t max_steps,
                     const tj_extra *x, char *msg, size_t msgsize);

/* Watches job id to its end, which must be "failed" with exactly message; stage names the
 * check in the failure. */
void tj_expect_failure(ts_client *c, int64_t id, const char *message, const char *stage);

/* Rows of key stored in SQLite for job, read straight from the daemon's database file. */
int64_t tj_stored_rows(const ts_daemon *d, int64_t job, const char *key);

#endif
