/* The mailbox from workers and the store thread to the loop (mailbox.h). */
#include <stdlib.h>

#include "daemon/mailbox.h"

static void on_async(uv_async_t *h)
{
    td_mailbox *mb = h->data;

    mb->cb(mb->ud);
}

int td_mailbox_init(td_mailbox *mb, uv_loop_t *loop, td_mailbox_cb cb, void *ud)
{
    int rc;

    *mb = (td_mailbox){.cb = cb, .ud = ud};
    rc = uv_async_init(loop, &mb->async, on_async);
    if (rc != 0)
        return rc;
    pthread_mutex_init(&mb->mu, NULL);
    mb->async.data = mb;
    mb->open = 1;
    return 0;
}

void td_mailbox_post(td_mailbox *mb, td_event *ev)
{
    if (ev == NULL) {
        atomic_fetch_add(&mb->dropped, 1);
    } else {
        ev->next = NULL;
        pthread_mutex_lock(&mb->mu);
        if (mb->tail != NULL)
            mb->tail->next = ev;
        else
            mb->head = ev;
        mb->tail = ev;
        pthread_mutex_unlock(&mb->mu);
    }
    uv_async_send(&mb->async);
}

uint64_t td_mailbox_take_dropped(td_mailbox *mb)
{
    return atomic_exchange(&mb->dropped, 0);
}

void td_mailbox_wake(td_mailbox *mb)
{
    uv_async_send(&mb->async);
}

td_event *td_mailbox_take(td_mailbox *mb)
{
    td_event *ev;

    pthread_mutex_lock(&mb->mu);
    ev = mb->head;
    mb->head = mb->tail = NULL;
    pthread_mutex_unlock(&mb->mu);
    return ev;
}

void td_mailbox_close(td_mailbox *mb)
{
    td_event *ev;

    if (!mb->open)
        return;
    mb->open = 0;
    ev = td_mailbox_take(mb);
    while (ev != NULL) {
        td_event *next = ev->next;
        td_event_free(ev);
        ev = next;
    }
    uv_close((uv_handle_t *)&mb->async, NULL);
    pthread_mutex_destroy(&mb->mu);
}

void *(*td__event_calloc)(size_t n, size_t size) = calloc;

td_event *td_event_new(td_event_kind kind, int64_t job)
{
    td_event *ev = td__event_calloc(1, sizeof(*ev));

    if (ev != NULL) {
        ev->kind = kind;
        ev->job = job;
    }
    return ev;
}

void td_event_free(td_event *ev)
{
    free(ev);
}
