/* The mailbox from the daemon's other threads to its loop (DESIGN.md, "Threads"): device
 * workers post that a job started, stepped or ended, the metric store thread that rows are
 * durable (or that it gave up on a job's rows). Posting takes a mutex and wakes the loop through
 * one uv_async_t; the loop takes every posted event at once, oldest first (libuv coalesces the
 * wake-ups, so the taker always drains the whole list).
 *
 * An event that cannot be allocated is not worth the daemon's life (STYLE.md habit 17), and
 * the events that must not be lost do not depend on it: a run reserves its STARTED, DONE and
 * STORE_FAILED events when it is created (run.h), where a failure is an error the loop
 * handles. What is left, PROGRESS and DURABLE, each says "look again" and a later one says it
 * too, so one that cannot be allocated is dropped and counted, and the loop logs the count.
 *
 * Threads: td_mailbox_post, td_mailbox_wake and td_event_new from any thread; the rest on the
 * loop thread. Public because it embeds a libuv handle (STYLE.md habit 2). */
#ifndef TD_MAILBOX_H
#define TD_MAILBOX_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "store/store.h"
#include "common/td_errno.h"

/* What workers and the store thread tell the loop. */
typedef enum {
    TD_EV_STARTED,      /* job began training: step and total_steps known */
    TD_EV_PROGRESS,     /* job finished a step: td_run_progress() has the step */
    TD_EV_DURABLE,      /* the store holds job's rows up to step */
    TD_EV_DONE,         /* job's run ended (state, err, sticky); its metrics are flushed */
    TD_EV_STORE_FAILED, /* the store thread could not store job's metric rows (err): it fails */
} td_event_kind;

typedef struct td_event {
    td_event_kind kind;
    int64_t job;
    int64_t step, total_steps;
    char state[TD_STORE_MAX_STATE];
    td_error_t err;
    int sticky; /* DONE of a failed job: a replica met a sticky CUDA error (or had one
                 * injected): the process's CUDA state is lost, the daemon re-executes */
    struct td_event *next;
} td_event;

/* Called on the loop thread after one or more posts (or wakes); it takes the events. */
typedef void (*td_mailbox_cb)(void *ud);

typedef struct td_mailbox {
    uv_async_t async;
    pthread_mutex_t mu; /* guards head and tail */
    td_event *head, *tail;
    td_mailbox_cb cb;
    void *ud;
    int open;
    atomic_ullong dropped; /* events that could not be allocated since the last take */
} td_mailbox;

/* Starts mb on loop; cb(ud) runs on the loop thread after posts. A libuv code on failure
 * (nothing to close then). */
int td_mailbox_init(td_mailbox *mb, uv_loop_t *loop, td_mailbox_cb cb, void *ud);

/* Appends ev and wakes the loop. Any thread; takes ev. ev NULL is an event td_event_new could
 * not allocate: it is counted (td_mailbox_take_dropped) and the loop woken to say so. */
void td_mailbox_post(td_mailbox *mb, td_event *ev);

/* How many events were dropped since the last call, and resets the count. Loop thread. */
uint64_t td_mailbox_take_dropped(td_mailbox *mb);

/* Wakes the loop without an event: cb runs at its next turn. Any thread. */
void td_mailbox_wake(td_mailbox *mb);

/* Every posted event, oldest first, as a list through next; NULL when none. The caller frees
 * each with td_event_free(). */
td_event *td_mailbox_take(td_mailbox *mb);

/* Closes the handle and frees the events still posted (nobody is left to handle them: the
 * store thread's last durable notices at shutdown). mb's memory must live until the loop has
 * run the close. Accepts a mailbox that was never opened. */
void td_mailbox_close(td_mailbox *mb);

/* A zeroed event, or NULL when out of memory (see above for what that costs). Any thread. */
td_event *td_event_new(td_event_kind kind, int64_t job);
void td_event_free(td_event *ev); /* accepts NULL */

/* For tests: the allocator td_event_new calls (calloc unless a test sets it), so that a test
 * can make allocations fail. Set it only while no other thread can be allocating an event. */
extern void *(*td__event_calloc)(size_t n, size_t size);

#endif
