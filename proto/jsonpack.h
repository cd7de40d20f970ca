/* JSON text to msgpack, for the tools that read job files written by people: trainctl (its
 * job files) and `traind rank` (its --spec, when it is a JSON job file). The only part of
 * proto/ that uses jansson, in a library of its own, so that the daemon proper does not. */
#ifndef TD_JSONPACK_H
#define TD_JSONPACK_H

#include <jansson.h>

#include "proto/proto.h"

/* Writes v to w as msgpack (objects as maps, in their order; integers, reals, strings,
 * booleans, null), refusing what traind's frame reader would refuse, by name: nesting deeper
 * than TD_PROTO_MAX_DEPTH, an object or array of more than TD_PROTO_MAX_ITEMS items, a
 * string longer than TD_PROTO_MAX_STR. depth is v's own level in the frame. TD_EJOB. */
int td_json_to_pw(td_pw *w, const json_t *v, int depth, td_error_t *err);

#endif
