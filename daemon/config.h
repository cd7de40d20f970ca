/* traind's configuration file: an INI file (read with inih) whose keys fill a td_config. The
 * keys, their sections and their defaults are listed in etc/traind.conf and traind(8).
 * Called from main() before anything starts; not thread-safe (getgrnam_r aside, nothing
 * here needs to be). */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#include <stddef.h>

#include "daemon.h"

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
