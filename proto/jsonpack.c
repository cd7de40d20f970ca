/* JSON text to msgpack (jsonpack.h). */
#include "proto/jsonpack.h"

/* The job's limits are the frame's: a deeper, longer or bigger job would be refused by
 * traind's reader with a message about frames; this one names the job instead. */
static int check_size(const json_t *v, int depth, td_error_t *err)
{
    size_t n = json_is_object(v) ? json_object_size(v) : json_is_array(v) ? json_array_size(v) : 0;

    if (depth > TD_PROTO_MAX_DEPTH)
        return td_error_set(err, TD_EJOB,
                            "the job nests objects and arrays deeper than traind accepts");
    if (n > TD_PROTO_MAX_ITEMS)
        return td_error_set(err, TD_EJOB,
                            "the job has an object or array of %zu items (the limit is %d)", n,
                            TD_PROTO_MAX_ITEMS);
    if (json_is_string(v) && json_string_length(v) > TD_PROTO_MAX_STR)
        return td_error_set(err, TD_EJOB, "the job has a string of %zu bytes (the limit is %u)",
                            json_string_length(v), TD_PROTO_MAX_STR);
    return 0;
}

static int object_to_pw(td_pw *w, json_t *v, int depth, td_error_t *err)
{
    const char *key;
    json_t *val;
    int rc;

    td_pw_map(w, (uint32_t)json_object_size(v));
    json_object_foreach(v, key, val)
    {
        td_pw_str(w, key);
        if ((rc = td_json_to_pw(w, val, depth + 1, err)) != 0)
            return rc;
    }
    return 0;
}

int td_json_to_pw(td_pw *w, const json_t *v, int depth, td_error_t *err)
{
    int rc = check_size(v, depth, err);

    if (rc != 0)
        return rc;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return object_to_pw(w, (json_t *)v, depth, err);
    case JSON_ARRAY:
        td_pw_array(w, (uint32_t)json_array_size(v));
        for (size_t i = 0; i < json_array_size(v) && rc == 0; i++)
            rc = td_json_to_pw(w, json_array_get(v, i), depth + 1, err);
        return rc;
    case JSON_STRING:
        td_pw_strn(w, json_string_value(v), json_string_length(v));
        return 0;
    case JSON_INTEGER:
        td_pw_int(w, json_integer_value(v));
        return 0;
    case JSON_REAL:
        td_pw_double(w, json_real_value(v));
        return 0;
    case JSON_TRUE:
    case JSON_FALSE:
        td_pw_bool(w, json_is_true(v));
        return 0;
    case JSON_NULL:
        td_pw_nil(w);
        return 0;
    }
    return 0;
}
