/* traind's error codes. Every function that can fail returns 0 or a negative code from this
 * list; libuv's codes (negated errno values, small magnitudes) pass through unchanged and
 * td_strerror() names them too. traind's own codes start at -4200 so they never collide
 * with an errno value. A message for a person travels with the code in td_error_t. */
#ifndef TD_ERRNO_H
#define TD_ERRNO_H

#include <stdarg.h>

/* X(name, value, text): the one list that makes the enum, td_strerror() and td_errname(). */
#define TD_ERRNO_MAP(X)                                                    \
    X(EINVAL, -4200, "invalid argument")                                   \
    X(ENOMEM, -4201, "out of memory")                                      \
    X(EIO, -4202, "I/O error")                                             \
    X(EPROTO, -4203, "protocol error")                                     \
    X(E2BIG, -4204, "too large")                                           \
    X(ENOTFOUND, -4205, "not found")                                       \
    X(EJOB, -4206, "invalid job")                                          \
    X(EDATA, -4207, "dataset error")                                       \
    X(ESHAPE, -4208, "shape mismatch")                                     \
    X(ENAN, -4209, "loss is not finite")                                   \
    X(ESTORE, -4210, "store error")                                        \
    X(EDISKFULL, -4211, "disk full")                                       \
    X(ECANCELLED, -4212, "cancelled")                                      \
    X(EPANIC, -4213, "training worker panicked")                           \
    X(ECUDA, -4214, "CUDA error")                                          \
    X(EPERM, -4215, "permission denied")                                   \
    X(ESTATE, -4216, "wrong state")                                        \
    X(EVERSION, -4217, "unsupported version")                              \
    X(ECLOSED, -4218, "closed")                                            \
    X(EWORKERS, -4219, "training workers failed")                          \
    X(EABORTED, -4220, "stopped because another device of the job failed") \
    X(EBUSY, -4221, "busy; try again")                                     \
    X(EMPI, -4222, "MPI error")

typedef enum {
#define TD_ERRNO_ENUM(name, val, text) TD_##name = (val),
    TD_ERRNO_MAP(TD_ERRNO_ENUM)
#undef TD_ERRNO_ENUM
} td_errno_t;

/* A code and a message for a person. msg is always NUL-terminated; empty when unset. */
typedef struct td_error {
    int code;
    char msg[1024];
} td_error_t;

/* Text for any code: traind's own, else the C library's for errno-range codes. Never NULL. */
const char *td_strerror(int code);

/* Symbolic name without the TD_ prefix ("EINVAL"), or "E?" for an unknown code. */
const char *td_errname(int code);

/* Sets err (when not NULL) to code and a printf-formatted message; returns code, so a
 * caller can write `return td_error_set(err, TD_EJOB, "model.layers[1]: ...")`. */
int td_error_set(td_error_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int td_error_vset(td_error_t *err, int code, const char *fmt, va_list ap);

/* Clears err to {0, ""}. */
void td_error_clear(td_error_t *err);

#endif
