/* systemd's service notification protocol (sd_notify(3)) and its watchdog, written by hand
 * rather than linking libsystemd for one datagram: each message is "KEY=VALUE" lines sent
 * to the AF_UNIX datagram socket named by $NOTIFY_SOCKET (a path, or an abstract name
 * written with a leading '@'). Without $NOTIFY_SOCKET every call does nothing, so traind
 * behaves the same outside systemd. Loop thread only.
 *
 * The struct is public because it embeds a libuv timer; its fields are td_notify.c's. */
#ifndef TD_NOTIFY_H
#define TD_NOTIFY_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <uv.h>

#include "common/td_errno.h"

/* Says whether the daemon is well enough for the watchdog to be fed. Returns 1 when it is,
 * else 0 with a sentence in why saying what is stale. stale_ms is the watchdog interval:
 * anything silent for longer than that counts as stale. */
typedef int (*td_notify_health_cb)(void *ud, int64_t stale_ms, char *why, size_t size);

typedef struct td_notify {
    int fd; /* datagram socket, -1 when there is nobody to notify */
    struct sockaddr_un addr;
    socklen_t addr_len;
    int64_t watchdog_ms; /* $WATCHDOG_USEC in ms; 0 when systemd set no watchdog for us */
    uv_timer_t timer;
    int timer_open;
    uint64_t last_tick; /* uv_now() at the watchdog's last tick */
    int unhealthy;      /* the last tick held the ping back */
    int send_failed;    /* a failure was logged; the next success is logged too */
    td_notify_health_cb health;
    void *ud;
} td_notify;

/* Reads $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID and opens the socket. A variable
 * traind cannot use is logged and leaves notification (or the watchdog) off: the service
 * then fails by systemd's own start timeout, with the log saying why. */
void td_notify_open(td_notify *n);

/* Sends one message, e.g. "READY=1\nSTATUS=listening". Never blocks: a full socket drops
 * the message and logs it. Returns 0 (also when there is nobody to notify) or -errno. */
int td_notify_send(td_notify *n, const char *msg);

/* When systemd asked for a watchdog, starts a timer on loop that sends WATCHDOG=1 every half
 * interval while the loop itself keeps time and health(ud, ...) says the daemon is well.
 * The timer does not keep the loop alive. Borrows ud until td_notify_close(). */
int td_notify_watchdog_start(td_notify *n, uv_loop_t *loop, td_notify_health_cb health, void *ud);

/* Stops the watchdog timer and closes the socket. The timer's memory is in use until the
 * loop has run its close callback, so run the loop once more before freeing n. */
void td_notify_close(td_notify *n);

#endif
