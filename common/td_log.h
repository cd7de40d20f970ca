/* Logging to stderr. When stderr is the journal (systemd's JOURNAL_STREAM names its device
 * and inode), each line starts with journald's "<N>" priority prefix (sd-daemon(3)), which
 * journald turns into the record's priority and which the journal records its own time for.
 * Anywhere else (a terminal, a file, a pipe) a line starts with the local time and the level
 * in words: "2026-11-30 05:16:51.042 warning: ...". A message's further lines are indented by
 * two spaces (and carry the prefix too, for the journal). Any thread may log; each call
 * writes its lines with a single write(2). */
#ifndef TD_LOG_H
#define TD_LOG_H

enum { TD_LOG_ERR = 3, TD_LOG_WARNING = 4, TD_LOG_NOTICE = 5, TD_LOG_INFO = 6, TD_LOG_DEBUG = 7 };

/* Messages above this priority number are dropped. Default TD_LOG_INFO. */
void td_log_set_level(int level);
int td_log_level(void);

void td_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Whether lines go to the journal (with "<N>" prefixes): looked at on the first line, from
 * JOURNAL_STREAM and stderr as they are then. td_log_detect() looks again (after stderr was
 * redirected, or in a test that sets JOURNAL_STREAM). */
int td_log_to_journal(void);
void td_log_detect(void);

#define td_log_err(...)    td_log(TD_LOG_ERR, __VA_ARGS__)
#define td_log_warn(...)   td_log(TD_LOG_WARNING, __VA_ARGS__)
#define td_log_notice(...) td_log(TD_LOG_NOTICE, __VA_ARGS__)
#define td_log_info(...)   td_log(TD_LOG_INFO, __VA_ARGS__)
#define td_log_debug(...)  td_log(TD_LOG_DEBUG, __VA_ARGS__)

#endif
