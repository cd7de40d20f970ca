/* traind's configuration file: an INI file (read with inih) whose keys fill a td_config. The
 * keys, their sections and their defaults are listed in etc/traind.conf and traind(8).
 * Called from main() before anything starts; not thread-safe (getgrnam_r aside, nothing
 * here needs to be). */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "td_errno.h"

#define TD_MAX_CONNS 1024 /* connections open at once by default; more are closed at accept */

/* What the file and the command line say, after checking. */
typedef struct td_config {
    char socket_path[108];
    char state_dir[512];
    char db_path[600];
    td_device_kind dev_kind;          /* --devices: cpu:N or cuda:... (all of one kind) */
    int ncpu_devices;                 /* cpu:N's N */
    int cuda_all;                     /* cuda:all: every GPU the process sees, found at start */
    int cuda_devices[TD_MAX_DEVICES]; /* cuda:0,1: the CUDA ordinals, ascending */
    int ncuda_devices;
    double nccl_timeout_s;    /* [cuda] nccl_timeout_s: a job's collectives, unless the job says */
    int max_queued_per_user;  /* queued jobs one uid may have; 0 = unlimited */
    int max_devices_per_user; /* devices one uid's running jobs may hold; 0 = unlimited */
    int max_conns;            /* connections open at once, at most; default TD_MAX_CONNS */
    int max_queued;           /* queued jobs of all users together; 0 = unlimited */
    int log_level;            /* TD_LOG_ERR .. TD_LOG_DEBUG (td_log.h) */
    char socket_group[64];    /* the group given the socket it binds; "" = the daemon's own */
    int64_t socket_gid;       /* socket_group's gid, or -1 */
} td_config;

/* Fills cfg with the defaults: the socket in /run/traind, the state in /var/lib/traind, one
 * CPU device, TD_MAX_CONNS connections, no queue or per-user limits, log level info, the
 * socket left with the daemon's own group. */
void td_config_defaults(td_config *cfg);

/* Reads the INI file at path into cfg, over what cfg holds. A missing file is an error only
 * when must_exist is set (traind --config names it); otherwise it leaves cfg as it was and
 * sets *loaded to 0. On error returns TD_EINVAL with err->msg naming the file, the line and
 * the key, e.g. `/etc/traind/traind.conf:7: unknown key "sokcet" in [daemon]`; cfg may then
 * hold some of the file's values. */
int td_config_load(td_config *cfg, const char *path, int must_exist, int *loaded, td_error_t *err);

/* The value parsers the file and the command line share. Each returns 0, or -1 and a
 * sentence in why saying what was expected. */
int td_config_set_socket(td_config *cfg, const char *path, char *why, size_t size);
int td_config_set_state_dir(td_config *cfg, const char *dir, char *why, size_t size);
int td_config_set_devices(td_config *cfg, const char *spec, char *why, size_t size);
int td_config_set_log_level(td_config *cfg, const char *name, char *why, size_t size);
int td_config_set_group(td_config *cfg, const char *group, char *why, size_t size);

#endif
