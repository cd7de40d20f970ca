/* Logging to stderr with journald's "<N>" priority prefixes (sd-daemon(3)): journald turns
 * the prefix into the record's priority, and a terminal shows it harmlessly. Any thread may
 * log; each call writes one line with a single write(2). */
#ifndef TD_LOG_H
#define TD_LOG_H

enum { TD_LOG_ERR = 3, TD_LOG_WARNING = 4, TD_LOG_NOTICE = 5, TD_LOG_INFO = 6, TD_LOG_DEBUG = 7 };

/* Messages above this priority number are dropped. Default TD_LOG_INFO. */
void td_log_set_level(int level);
int td_log_level(void);

void td_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define td_log_err(...)    td_log(TD_LOG_ERR, __VA_ARGS__)
#define td_log_warn(...)   td_log(TD_LOG_WARNING, __VA_ARGS__)
#define td_log_notice(...) td_log(TD_LOG_NOTICE, __VA_ARGS__)
#define td_log_info(...)   td_log(TD_LOG_INFO, __VA_ARGS__)
#define td_log_debug(...)  td_log(TD_LOG_DEBUG, __VA_ARGS__)

#endif
