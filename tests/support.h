/* Test support for the integration tests: starting a real traind (TRAIND_BIN) on a temporary
 * socket and state directory, stopping it, killing the one a failed test left behind, and a
 * small blocking protocol client (connect, hello, requests, frames received with a timeout,
 * status, waiting for a state, watching a job to its end).
 *
 * Compiled into each integration test that uses it (tests/meson.build). Everything here runs
 * in the test process and may fail the current test through cmocka, except ts_can_connect(),
 * which forked children call too. */
#ifndef TS_SUPPORT_H
#define TS_SUPPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/proto.h"

#define TS_MAX_LOSSES 512 /* train_loss values ts_watch_to_end keeps, by step */

/* The daemon a failed test left behind, or -1: whoever starts a traind sets it, whoever reaps
 * one resets it, and ts_kill_leftover() kills what is left. */
extern pid_t ts_live_pid;

/* A traind started by ts_daemon_start(): its temporary directory and the paths in it. */
typedef struct ts_daemon {
    char dir[256];
    char sock[300];
    char db[300];
    pid_t pid;
} ts_daemon;

/* A blocking client: one connection, its frame reader and a writer for its next request. */
typedef struct ts_client {
    int fd;
    td_proto_reader *r;
    td_pw w;
    int64_t next_id;
} ts_client;

/* What ts_watch_to_end() saw of a job: its rows checked for order, and how it ended. */
typedef struct ts_watched {
    double losses[TS_MAX_LOSSES]; /* train_loss by step - 1 */
    int64_t train_loss_rows;
    int64_t last_step;
    int64_t dup_or_disorder; /* rows out of step order, train_loss steps skipped or repeated */
    double first_loss, last_loss;
    double test_accuracy; /* -1: no test_accuracy row */
    int64_t valid_step;   /* the last valid_loss row's step; -1: none */
    double valid_loss;
    int64_t rows;
    char final_state[16];
    char error[1024]; /* the end frame's error message; empty when none */
} ts_watched;

/* What each function does, and what it fails the test on, is said above it in support.c. */

/* Time, environment, processes. */
long long ts_now_ms(void);
const char *ts_env_or(const char *name, const char *dflt);
int ts_kill_leftover(void **state);
const char *ts_bin_for_user(const char *bin, uid_t uid, gid_t gid);
int ts_can_connect(const char *sock);
/* A connection to sock made as uid/gid by a child, its descriptor handed back (-1 when the
 * child could not connect); and every user let in to d's socket. */
int ts_connect_as(const char *sock, uid_t uid, gid_t gid);

/* A traind of the tests' own. */
void ts_daemon_start(ts_daemon *d, const char *devices);
void ts_daemon_start_in(ts_daemon *d, const char *devices);
void ts_daemon_start_conf(ts_daemon *d, const char *devices, const char *conf);
int ts_daemon_stop(ts_daemon *d);
void ts_daemon_kill9(ts_daemon *d);
int ts_log_count(const ts_daemon *d, const char *needle);
void ts_open_socket(const ts_daemon *d);
void ts_wait_log(const ts_daemon *d, const char *needle, int count, int timeout_s);

/* The connection. ts_client_recv's frame: caller frees with td_proto_frame_free(). */
int ts_client_connect(ts_client *c, const char *sock);
void ts_client_close(ts_client *c);
void ts_send_raw(ts_client *c, const void *p, size_t len);
void ts_client_send(ts_client *c);
td_proto_frame *ts_client_recv(ts_client *c);
void ts_connect_hello(ts_client *c, const char *sock);

/* Reading a frame's values. */
int ts_str_is(const td_pval *v, const char *s);
int64_t ts_get_i(const td_pval *m, const char *key);
void ts_get_s(const td_pval *m, const char *key, char *buf, size_t size);

/* Requests. ts_status's frame: caller frees with td_proto_frame_free(); *job points into it. */
int64_t ts_begin(ts_client *c, const char *type, uint32_t extra);
int64_t ts_send_job_request(ts_client *c, const char *type, int64_t job);
int64_t ts_submitted(ts_client *c);
td_proto_frame *ts_status(ts_client *c, int64_t id, const td_pval **job);
int64_t ts_job_status(ts_client *c, int64_t id, char *state, size_t size);
void ts_wait_state(ts_client *c, int64_t id, const char *want, int timeout_s);
void ts_wait_step(ts_client *c, int64_t id, int64_t step, int timeout_s);
void ts_wait_clients(ts_client *c, size_t n, int timeout_s);
void ts_watch_to_end(ts_client *c, int64_t id, ts_watched *out);

#endif
