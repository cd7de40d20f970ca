/* The panic boundary of DESIGN.md. A device worker opens a boundary around a training step
 * (td_boundary_enter, then TD_TRY); code below it that meets a fatal problem calls td_panic(),
 * which records the code and message and longjmps back to the boundary. Outside any boundary
 * td_panic() aborts with the message, since there is nobody to recover (habit 9: panics are
 * for the worker boundary only; everywhere else, return an error).
 *
 * Rules for code below a boundary: memory comes from arenas owned above the boundary and
 * no lock is held across a call that may panic, so a jump leaks nothing. */
#ifndef TD_PANIC_H
#define TD_PANIC_H

#include <setjmp.h>

#include "common/td_errno.h"

typedef struct td_boundary {
    jmp_buf env;
    td_error_t err;
    struct td_boundary *prev;
} td_boundary;

/* The innermost boundary of the calling thread, or NULL. */
extern _Thread_local td_boundary *td__boundary_top;

/* Use as:
 *   td_boundary b;
 *   td_boundary_enter(&b);
 *   if (TD_TRY(&b)) { ... step ...; td_boundary_leave(&b); }
 *   else { ... b.err holds the panic; the boundary is already left ... }
 * or, where the panic is handled first, `if (TD_CAUGHT(&b)) { ... }` after the enter.
 * td_boundary_enter pushes b (clearing b.err). TD_TRY is true on entry; after a panic it is
 * false (TD_CAUGHT true), b is popped, and b.err holds the code and message.
 *
 * C11 7.13.1.1 allows setjmp only as the whole controlling expression of an if or a loop
 * (alone, negated, or compared with an integer constant) or as a whole expression statement;
 * anywhere else, a comma expression included, the behaviour is undefined.
 * So the boundary is entered by its own statement, and TD_TRY and TD_CAUGHT are each only the
 * whole condition of an if, as above. */
#define TD_TRY(b)    (setjmp((b)->env) == 0)
#define TD_CAUGHT(b) (setjmp((b)->env) != 0)

void td_boundary_enter(td_boundary *b);
void td_boundary_leave(td_boundary *b);

/* Does not return: jumps to the innermost boundary with code and message. */
_Noreturn void td_panic(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
