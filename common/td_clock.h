/* The clock every part of traind reads: one helper in place of a copy per file. Any thread. */
#ifndef TD_CLOCK_H
#define TD_CLOCK_H

#include <time.h>

/* Milliseconds on clock (CLOCK_MONOTONIC for durations and deadlines, CLOCK_REALTIME for
 * timestamps, CLOCK_PROCESS_CPUTIME_ID for CPU time), with the nanoseconds kept as a
 * fraction. */
double td_clock_ms(clockid_t clock);

/* td_clock_ms(CLOCK_MONOTONIC): durations and deadlines. */
double td_mono_ms(void);

/* Seconds since the epoch, with a fraction (CLOCK_REALTIME): the timestamps the store keeps. */
double td_wall_s(void);

#endif
