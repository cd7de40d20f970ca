/* The wire protocol: length-prefixed msgpack frames (a 4-byte big-endian length, then one
 * msgpack map), a reader that checks every peer-supplied number against the limits below
 * before msgpack-c allocates anything, read-only accessors over a decoded frame, and a writer
 * that builds one frame. PROTOCOL.md beside this file is the reference for the messages.
 *
 * No thread of its own and no shared state: each td_proto_reader / td_proto_writer belongs
 * to one thread at a time. Used by the daemon's loop thread and by trainctl. */
#ifndef TD_PROTO_H
#define TD_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_PROTO_VERSION   1
#define TD_PROTO_MAX_FRAME (1u << 20)    /* bytes of one frame's body, without the prefix */
#define TD_PROTO_MAX_DEPTH 16            /* nested maps/arrays, the top map counting as 1 */
#define TD_PROTO_MAX_ITEMS 65536         /* elements of one array, or pairs of one map */
#define TD_PROTO_MAX_STR   (256u * 1024) /* bytes of one string or binary */
#define TD_PROTO_PREFIX    4             /* bytes of the length prefix */
#define TD_PROTO_MAX_HELLO 4096          /* bytes of a connection's first frame (its hello) */
#define TD_PROTO_MAX_KEYS  256           /* metric names one metrics or watch request names */
#define TD_PROTO_PAGE_MAX  1000          /* jobs of one list reply, lines of one logs reply */

/* A decoded value. Points into its frame; valid until that frame is freed. */
typedef struct msgpack_object td_pval;

typedef enum {
    TD_PV_NIL,
    TD_PV_BOOL,
    TD_PV_INT, /* signed or unsigned integer that fits in int64_t */
    TD_PV_FLOAT,
    TD_PV_STR,
    TD_PV_BIN,
    TD_PV_ARRAY,
    TD_PV_MAP,
    TD_PV_OTHER /* ext, or an unsigned integer above INT64_MAX */
} td_pv_type;

/* One decoded frame: its top value is always a map. Caller frees with td_proto_frame_free(). */
typedef struct td_proto_frame td_proto_frame;

/* ---- reading ---- */

/* Accumulates bytes from a stream and cuts them into frames. */
typedef struct td_proto_reader td_proto_reader;

/* Makes a reader; max_frame is the largest body accepted (0 means TD_PROTO_MAX_FRAME).
 * Caller frees with td_proto_reader_free(). */
int td_proto_reader_new(td_proto_reader **out, uint32_t max_frame);
void td_proto_reader_free(td_proto_reader *r);

/* Holds the first frame of the stream to first_max bytes instead of max_frame (when smaller):
 * a server reads a hello from a peer that has not yet shown it speaks the protocol, and such
 * a peer gets no more than a small frame's worth of memory (PROTOCOL.md, "Limits"). The
 * error then reads "frame of N bytes exceeds the limit of 4096 bytes before hello". Call it
 * before the first feed. */
void td_proto_reader_limit_first(td_proto_reader *r, uint32_t first_max);

/* Copies len bytes of stream data into the reader. Each frame's length prefix is checked
 * against max_frame as soon as its 4 bytes are in, before any of its body is kept; from an
 * oversized prefix on, the reader keeps nothing and td_proto_reader_next reports the error
 * once the frames before it are taken. The buffer holds only frames fed and not yet taken,
 * so a caller that takes every frame after each feed holds at most one partial frame
 * (prefix + max_frame bytes) plus its read size. Returns 0, or TD_ENOMEM. */
int td_proto_reader_feed(td_proto_reader *r, const void *data, size_t len);

/* Takes the next complete frame. Returns 1 and sets *out (caller frees) when a frame was
 * decoded, 0 when more bytes are needed, or a negative code (TD_E2BIG for a limit, TD_EPROTO
 * for bad msgpack, TD_ENOMEM) with err set naming what was wrong and where ("frame of 2000000
 * bytes exceeds the limit of 1048576 bytes", "map nested deeper than 16 levels, at byte 40",
 * "array of 4294967295 elements exceeds the limit of 65536, at byte 5", "top-level value is
 * an array, not a map", "truncated msgpack value at byte 17", ...; PROTOCOL.md "Limits" has
 * every form). After an error the stream cannot be resynchronised: every later call returns
 * the same error; the caller replies with an error frame and closes the connection. */
int td_proto_reader_next(td_proto_reader *r, td_proto_frame **out, td_error_t *err);

/* Bytes fed and not yet taken as frames: what a reader holds. */
size_t td_proto_reader_buffered(const td_proto_reader *r);

/* Decodes one frame body (without prefix) with the same checks, against TD_PROTO_MAX_FRAME.
 * Returns 0 and sets *out (caller frees), or a negative code with err set and *out NULL.
 * Used by fuzz tests and by anyone holding a stored message (the daemon keeps submitted job
 * specs as msgpack). */
int td_proto_decode(const void *body, size_t len, td_proto_frame **out, td_error_t *err);

void td_proto_frame_free(td_proto_frame *f);

/* The frame's top map; never NULL for a decoded frame. */
const td_pval *td_proto_frame_root(const td_proto_frame *f);

/* The frame's body bytes (what td_proto_decode was given). Borrowed from the frame. */
const void *td_proto_frame_body(const td_proto_frame *f, size_t *len);

/* ---- accessors (all accept NULL and then answer "absent") ---- */

/* The value's type; TD_PV_NIL for NULL (an absent field reads as nil). */
td_pv_type td_pv_type_of(const td_pval *v);
/* Value for key in map m, or NULL when m is not a map or the key is absent. Keys are compared
 * bytewise; when a map repeats a key, the first one counts. */
const td_pval *td_pv_get(const td_pval *m, const char *key);
/* Integer value: 0 and *out set when v is TD_PV_INT (or a float with an exact integer
 * value), else TD_EINVAL. */
int td_pv_int(const td_pval *v, int64_t *out);
/* Number value: 0 when v is TD_PV_INT or TD_PV_FLOAT, else TD_EINVAL. */
int td_pv_double(const td_pval *v, double *out);
int td_pv_bool(const td_pval *v, int *out);
/* String: pointer into the frame (NOT NUL-terminated) and its length, or NULL if not a str. */
const char *td_pv_str(const td_pval *v, size_t *len);
/* Copies a string into buf (size bytes, NUL-terminated). 0, or TD_EINVAL when v is not a
 * string or contains a NUL byte (it would not survive as a C string), or TD_E2BIG when it
 * does not fit; on error buf (when size > 0) holds "". */
int td_pv_strcpy(const td_pval *v, char *buf, size_t size);
/* Array and map sizes and elements. Size 0 for a value of another type. */
size_t td_pv_len(const td_pval *v);
const td_pval *td_pv_at(const td_pval *arr, size_t i);
const td_pval *td_pv_key_at(const td_pval *map, size_t i);
const td_pval *td_pv_val_at(const td_pval *map, size_t i);

/* ---- writing ---- */

/* Builds one frame: the prefix is reserved on init and filled by td_pw_finish. Writer calls
 * never fail individually; an allocation failure is remembered and reported by finish.
 *
 * A map whose pairs are written one by one is opened with td_pw_map_open() and closed with
 * td_pw_map_close(): the writer counts its pairs and fills in the count when it closes (as
 * redis's setDeferredMapLen), so a field added or written only sometimes can never make the
 * count wrong. Inside such a map the writer follows every container (open holds them,
 * innermost last), so that it knows which values are the map's own. */
#define TD_PW_MAX_OPEN 64         /* containers open at once inside a counted map (levels) */
#define TD_PW_COUNTED  UINT64_MAX /* td_pw_open.want of a counted map */

typedef struct td_pw_open {
    size_t at;     /* a counted map's header: its offset in buf */
    uint64_t want; /* values a container with a count holds; TD_PW_COUNTED: a counted map */
    uint64_t seen; /* values written into it so far */
} td_pw_open;

typedef struct td_pw {
    char *buf;
    size_t len, cap;
    int failed; /* 0, or the negative code td_pw_finish will return */
    int nopen;  /* open containers in open; 0 outside every counted map */
    td_pw_open open[TD_PW_MAX_OPEN];
} td_pw;

void td_pw_init(td_pw *w);
void td_pw_reset(td_pw *w); /* empties it for a new frame, keeps the buffer */
void td_pw_free(td_pw *w);

void td_pw_map(td_pw *w, uint32_t npairs);
/* Opens a map whose pairs the writer counts (above); write keys and values, then close it. */
void td_pw_map_open(td_pw *w);
/* Closes the innermost counted map, giving it the count of pairs written into it, in the
 * smallest form msgpack has for it (the bytes are those td_pw_map with that count writes).
 * The frame fails with TD_EINVAL (td_pw_finish) when no counted map is open, when a container
 * inside it is not complete, or when it holds a key without a value. */
void td_pw_map_close(td_pw *w);
void td_pw_array(td_pw *w, uint32_t n);
/* An array of n values already encoded in p (len bytes): one value. */
void td_pw_array_raw(td_pw *w, uint32_t n, const void *p, size_t len);
void td_pw_str(td_pw *w, const char *s); /* NULL writes nil */
void td_pw_strn(td_pw *w, const char *s, size_t len);
void td_pw_bin(td_pw *w, const void *p, size_t len);
void td_pw_int(td_pw *w, int64_t v);
void td_pw_double(td_pw *w, double v);
void td_pw_bool(td_pw *w, int v);
void td_pw_nil(td_pw *w);
/* Copies one already-encoded msgpack value (e.g. a stored job spec) verbatim. */
void td_pw_raw(td_pw *w, const void *p, size_t len);
/* Writes a decoded value back out (deep copy). A hand-built tree deeper than 64 levels
 * fails the frame with TD_E2BIG (a decoded one is at most TD_PROTO_MAX_DEPTH deep). */
void td_pw_val(td_pw *w, const td_pval *v);

/* Fills the length prefix. On success *frame and *len (prefix included) describe w->buf, which
 * the writer still owns: borrowed until the next call on w (a write, reset or free may move
 * or reuse it). Calling it again without writing in between gives the same frame. TD_ENOMEM
 * after an allocation failure, TD_E2BIG when the body exceeds TD_PROTO_MAX_FRAME or a string
 * or binary was longer than 4 GiB (or containers nested past TD_PW_MAX_OPEN inside a counted
 * map), TD_EINVAL when a counted map was left open or closed wrongly (td_pw_map_close); then
 * *frame is NULL and *len 0. */
int td_pw_finish(td_pw *w, const char **frame, size_t *len);

/* The encoded body bytes so far, without the prefix (for storing a value as msgpack).
 * Borrowed from w like td_pw_finish's frame; NULL (and *len 0) after a failed write or while
 * a counted map is open. */
const void *td_pw_body(const td_pw *w, size_t *len);

/* Builds a whole error frame: empties w (td_pw_reset), writes {type:"error", id, code,
 * name: td_errname(code), message} and fills the prefix. Get the bytes with td_pw_finish,
 * which then only returns them. A NULL or empty message becomes td_strerror(code); control
 * characters but newlines and malformed UTF-8 in it are escaped (td_text_escape), so the
 * message is always UTF-8 whatever a client sent; past 4096 bytes it is cut at a character
 * boundary. */
void td_proto_write_error(td_pw *w, int64_t id, int code, const char *message);

/* Writes a decoded value as JSON text: strings with quote, backslash and control characters
 * escaped (controls as \u00XX), valid UTF-8 as is and each invalid byte as \ufffd; floats as
 * "%.17g" with ".0" added to whole values, non-finite ones as null; bin and ext data as
 * strings of lowercase hex; a map key that is not a string as a string of its JSON text; NULL
 * as null. Returns a malloc'd NUL-terminated string the caller frees, or NULL on allocation
 * failure. Used to keep a readable copy of job specs in SQLite. */
char *td_pv_to_json(const td_pval *v);

#endif
