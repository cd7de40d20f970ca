/* sd_notify(3) by hand: the notification datagram and the watchdog timer. Loop thread only.
 *
 * The watchdog is fed only when two things are fresh: the loop (a tick that comes later
 * than the watchdog interval means the loop was stuck that long) and whatever the health
 * callback checks (traind: the heartbeat of every busy worker). So a hung worker or a
 * stuck loop stops the pings, and systemd restarts the daemon, which requeues the jobs. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/notify.h"
#include "common/td_log.h"

#define USEC_PER_MS 1000

/* Parses a decimal unsigned integer that fills all of s; -1 when s is not one. */
static long long parse_ull(const char *s)
{
    char *end;
    unsigned long long v;

    if (s == NULL || s[0] < '0' || s[0] > '9')
        return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v > (unsigned long long)INT64_MAX)
        return -1;
    return (long long)v;
}

/* Fills n's address from $NOTIFY_SOCKET. Returns 0, or -1 after logging why not. */
static int notify_address(td_notify *n, const char *name)
{
    size_t len = strlen(name);

    memset(&n->addr, 0, sizeof(n->addr));
    n->addr.sun_family = AF_UNIX;
    if ((name[0] != '/' && name[0] != '@') || len < 2 || len >= sizeof(n->addr.sun_path)) {
        td_log_warn("NOTIFY_SOCKET=%s is not a socket path or @name traind can use; "
                    "systemd will not hear from it",
                    name);
        return -1;
    }
    memcpy(n->addr.sun_path, name, len);
    /* An abstract name is written with '@' and sent with a leading NUL and no trailing one. */
    if (name[0] == '@')
        n->addr.sun_path[0] = '\0';
    n->addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
    return 0;
}

/* Sets watchdog_ms from $WATCHDOG_USEC when $WATCHDOG_PID, if set, is this process. */
static void watchdog_interval(td_notify *n)
{
    const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
    long long us = parse_ull(usec), p = parse_ull(pid);

    if (usec == NULL)
        return;
    if (pid != NULL && p != (long long)getpid()) {
        td_log_debug("WATCHDOG_PID=%s is not this process; no watchdog", pid);
        return;
    }
    if (us <= 0) {
        td_log_warn("WATCHDOG_USEC=%s is not a positive number of microseconds; no watchdog", usec);
        return;
    }
    n->watchdog_ms = us / USEC_PER_MS > 0 ? us / USEC_PER_MS : 1;
}

void td_notify_open(td_notify *n)
{
    const char *name = getenv("NOTIFY_SOCKET");

    memset(n, 0, sizeof(*n));
    n->fd = -1;
    if (name == NULL || name[0] == '\0' || notify_address(n, name) != 0)
        return;
    n->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (n->fd < 0) {
        td_log_warn("cannot open a socket to notify systemd: %s", strerror(errno));
        return;
    }
    watchdog_interval(n);
}

int td_notify_send(td_notify *n, const char *msg)
{
    ssize_t sent;
    int rc = 0;

    if (n->fd < 0)
        return 0;
    /* MSG_DONTWAIT: the loop must never wait for systemd; systemd's socket has megabytes of
     * buffer, so a message is dropped only when systemd itself is stuck. */
    sent = sendto(n->fd, msg, strlen(msg), MSG_DONTWAIT | MSG_NOSIGNAL,
                  (const struct sockaddr *)&n->addr, n->addr_len);
    if (sent < 0) {
        rc = -errno;
        if (!n->send_failed)
            td_log_warn("cannot notify systemd (%.*s): %s", (int)strcspn(msg, "\n"), msg,
                        strerror(errno));
        n->send_failed = 1;
    } else if (n->send_failed) {
        td_log_notice("notifying systemd works again");
        n->send_failed = 0;
    }
    return rc;
}

/* A watchdog tick: ping when the loop and the daemon are fresh, and log each change. */
static void on_watchdog(uv_timer_t *t)
{
    td_notify *n = t->data;
    uint64_t now = uv_now(t->loop), late = now - n->last_tick;
    char why[256] = "";
    int well;

    if (late > (uint64_t)n->watchdog_ms) {
        snprintf(why, sizeof(why), "the event loop did not turn for %llu ms",
                 (unsigned long long)late);
        well = 0;
    } else {
        well = n->health == NULL || n->health(n->ud, n->watchdog_ms, why, sizeof(why));
    }
    n->last_tick = now;
    if (well)
        td_notify_send(n, "WATCHDOG=1");
    if (!well && !n->unhealthy)
        td_log_warn("watchdog: not pinging systemd (WatchdogSec=%lld ms): %s",
                    (long long)n->watchdog_ms, why);
    else if (well && n->unhealthy)
        td_log_notice("watchdog: healthy again, pinging systemd");
    n->unhealthy = !well;
}

int td_notify_watchdog_start(td_notify *n, uv_loop_t *loop, td_notify_health_cb health, void *ud)
{
    uint64_t every;
    int rc;

    if (n->fd < 0 || n->watchdog_ms == 0)
        return 0;
    rc = uv_timer_init(loop, &n->timer);
    if (rc != 0)
        return rc;
    n->timer_open = 1;
    n->timer.data = n;
    n->health = health;
    n->ud = ud;
    n->last_tick = uv_now(loop);
    every = (uint64_t)n->watchdog_ms / 2 > 0 ? (uint64_t)n->watchdog_ms / 2 : 1;
    rc = uv_timer_start(&n->timer, on_watchdog, every, every);
    /* The daemon ends when its own handles are closed; the watchdog must not hold it up. */
    uv_unref((uv_handle_t *)&n->timer);
    td_log_debug("watchdog: pinging systemd every %llu ms while healthy",
                 (unsigned long long)every);
    return rc;
}

void td_notify_close(td_notify *n)
{
    if (n->timer_open) {
        uv_close((uv_handle_t *)&n->timer, NULL);
        n->timer_open = 0;
    }
    if (n->fd >= 0)
        close(n->fd);
    n->fd = -1;
}
