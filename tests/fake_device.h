/* A stand-in for a GPU, for the engine's tests on a machine without one: a td_kernels table
 * whose memory is NOT host memory (host = 0) and whose pointers cannot be dereferenced. Its
 * alloc returns the heap address plus 2^62, a non-canonical x86-64 address, so any read or
 * write of its memory by the host faults at once; each op takes the offset back off every
 * pointer and runs the CPU table's op, and upload/download are memcpy through the same
 * translation. A trainer that computes on it therefore does exactly the CPU's arithmetic
 * (the same bits), and only through the table: the device path of train/ is exercised where
 * no CUDA runs. Counts its allocations and copies so tests can hold the step loop to none. */
#ifndef TD_TESTS_FAKE_DEVICE_H
#define TD_TESTS_FAKE_DEVICE_H

#include <stdint.h>

#include "kernels/kernels.h"

typedef struct fd_counters {
    int64_t allocs, frees, uploads, downloads;
} fd_counters;

/* The table; static, never NULL. */
const td_kernels *fd_kernels(void);

/* What the table has done so far (process-wide; tests run one at a time). */
fd_counters fd_counts(void);

/* From now on, the table's alloc succeeds n more times and then fails with TD_ENOMEM (as a
 * full GPU would); n < 0: never fails (the default). */
void fd_fail_allocs_after(int64_t n);

/* A device address as the host can read it (for a test's own checks). */
void *fd_host(const void *device);

#endif
