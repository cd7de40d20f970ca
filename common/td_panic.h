/* The panic boundary of DESIGN.md. A device worker opens a boundary with TD_TRY around a
 * training step; code below it that meets a fatal problem calls td_panic(), which records
 * the code and message and longjmps back to the boundary. Outside any boundary td_panic()
 * aborts with the message, since there is nobody to recover (habit 9: panics are for the
 * worker boundary only; everywhere else, return an error).
 *
 * Rules for code below a boundary: memory comes from arenas owned above the boundary and
 * no lock is held across a call that may panic, so a jump leaks nothing. */
#ifndef TD_PANIC_H
#define TD_PANIC_H

#include <setjmp.h>

#include "td_errno.h"

typedef struct td_boundary {
    jmp_buf env;
    td_error_t err;
    struct td_boundary *prev;
} td_boundary;

/* The innermost boundary of the calling thread, or NULL. */
extern _Thread_local td_boundary *td__boundary_top;

/* Use as:
 *   td_boundary b;
 *   if (TD_TRY(&b)) { ... step ...; td_boundary_leave(&b); }
 *   else { ... b.err holds the panic; the boundary is already left ... }
 * TD_TRY pushes b and is true on entry; after a panic it is false, b is popped, and b.err
 * holds the code and message. */
#define TD_TRY(b) (td__boundary_enter(b), setjmp((b)->env) == 0)

void td__boundary_enter(td_boundary *b);
void td_boundary_leave(td_boundary *b);

/* Does not return: jumps to the innermost boundary with code and message. */
_Noreturn void td_panic(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
