/* Metrics in the store: interning metric names as integer keys (with an in-memory cache on
 * the td_store), writing batches of samples with their per-(job, key) summary, and reading
 * them back a page at a time or as a summary. In the daemon the store thread writes and the
 * loop thread reads, each through its own td_store; a td_store is used by one thread.
 *
 * Summary semantics (metric_summary, kept in the same transaction as the rows):
 *   count      rows stored for (job, key); a replayed step replaces its row and adds nothing.
 *   last_step  the highest step stored.
 *   last       the value at last_step; replacing that step updates it, replacing an older
 *              step does not.
 *   min, max   over every number ever written for (job, key), including values that a
 *              replayed step later replaced: recomputing them would scan the key's rows on
 *              every replay, and a replay normally writes the same values again. NaN
 *              samples are stored (as NULL, read back NaN) but do not move min or max;
 *              both are NaN while the key has had no number.
 * The summary is accumulated in C over the batch and written as one UPSERT per (job, key)
 * pair the batch touched, not one per row. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_int.h"

#define KEYS_MIN_CAP 64 /* slots in the key cache when first used */
#define ACC_MIN_CAP  64 /* slots in the batch's summary table when first used */

/* ---- the key cache ---- */

/* FNV-1a: names are short and few, anything that spreads them will do. */
static uint32_t key_hash(const char *name)
{
    uint32_t h = 2166136261u;

    for (; *name != '\0'; name++)
        h = (h ^ (unsigned char)*name) * 16777619u;
    return h;
}

/* The slot for name: its entry, or the empty slot where it would go. */
static struct td__key_slot *key_slot(struct td__key_slot *keys, size_t cap, const char *name,
                                     uint32_t h)
{
    size_t i = h & (cap - 1);

    while (keys[i].id != 0 && (keys[i].hash != h || strcmp(keys[i].name, name) != 0))
        i = (i + 1) & (cap - 1);
    return &keys[i];
}

/* Doubles the cache, rehashing every entry. */
static int keys_grow(td_store *s)
{
    size_t cap = s->keys_cap == 0 ? KEYS_MIN_CAP : s->keys_cap * 2;
    struct td__key_slot *keys = calloc(cap, sizeof(*keys));
    size_t i;
    int ret = 0;

    if (keys == NULL) {
        ret = TD_ENOMEM;
        goto out;
    }
    for (i = 0; i < s->keys_cap; i++)
        if (s->keys[i].id != 0)
            *key_slot(keys, cap, s->keys[i].name, s->keys[i].hash) = s->keys[i];
    free(s->keys);
    s->keys = keys;
    s->keys_cap = cap;
out:
    return ret;
}

/* Remembers name -> id. Out of memory only costs a query next time, so it is not an error. */
static void keys_put(td_store *s, const char *name, uint32_t h, int id)
{
    struct td__key_slot *slot;

    /* Keep the table at most half full, so probes stay short. */
    if ((s->keys_used + 1) * 2 > s->keys_cap && keys_grow(s) < 0)
        goto out;
    slot = key_slot(s->keys, s->keys_cap, name, h);
    if (slot->id == 0) {
        slot->hash = h;
        slot->id = id;
        snprintf(slot->name, sizeof(slot->name), "%s", name);
        s->keys_used++;
    }
out:
    return;
}

void td__store_keys_clear(td_store *s)
{
    if (s->keys != NULL)
        memset(s->keys, 0, s->keys_cap * sizeof(*s->keys));
    s->keys_used = 0;
}

/* Sets *id to name's key id: from the cache, else from metric_keys, else (create) by
 * inserting it, which must happen inside the caller's write transaction. Sets *id to 0 when
 * the name is unknown and create is 0. */
static int key_id(td_store *s, const char *name, int create, int *id, td_error_t *err)
{
    uint32_t h = key_hash(name);
    struct td__key_slot *slot = s->keys_cap > 0 ? key_slot(s->keys, s->keys_cap, name, h) : NULL;
    sqlite3_stmt *st = NULL;
    int rc;
    int ret = 0;

    *id = 0;
    if (slot != NULL && slot->id != 0) {
        *id = slot->id;
        goto out;
    }
    ret = td__store_stmt(s, TD__ST_KEY_GET, "SELECT id FROM metric_keys WHERE name = ?1", &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        *id = sqlite3_column_int(st, 0);
    sqlite3_reset(st);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) {
        ret = td__store_fail(s, rc, "looking up a metric key", err);
        goto out;
    }
    if (*id == 0 && create) {
        ret = td__store_stmt(s, TD__ST_KEY_INSERT, "INSERT INTO metric_keys (name) VALUES (?1)",
                             &st, err);
        if (ret < 0)
            goto out;
        sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
        rc = sqlite3_step(st);
        sqlite3_reset(st);
        if (rc != SQLITE_DONE) {
            ret = td__store_fail(s, rc, "interning a metric key", err);
            goto out;
        }
        *id = (int)sqlite3_last_insert_rowid(s->db);
    }
    if (*id != 0)
        keys_put(s, name, h, *id);
out:
    return ret;
}

/* ---- the batch's summary table ---- */

static size_t acc_index(int64_t job, int key_id, size_t cap)
{
    uint64_t h = ((uint64_t)job * 0x9E3779B97F4A7C15u) ^ (uint64_t)(uint32_t)key_id;

    return (size_t)(h ^ (h >> 29)) & (cap - 1);
}

static struct td__summary_acc *acc_slot(struct td__summary_acc *acc, size_t cap, int64_t job,
                                        int key_id)
{
    size_t i = acc_index(job, key_id, cap);

    while (acc[i].used && (acc[i].job != job || acc[i].key_id != key_id))
        i = (i + 1) & (cap - 1);
    return &acc[i];
}

/* Doubles the table, rehashing every entry. */
static int acc_grow(td_store *s)
{
    size_t cap = s->acc_cap == 0 ? ACC_MIN_CAP : s->acc_cap * 2;
    struct td__summary_acc *acc = calloc(cap, sizeof(*acc));
    size_t i;
    int ret = 0;

    if (acc == NULL) {
        ret = TD_ENOMEM;
        goto out;
    }
    for (i = 0; i < s->acc_cap; i++)
        if (s->acc[i].used)
            *acc_slot(acc, cap, s->acc[i].job, s->acc[i].key_id) = s->acc[i];
    free(s->acc);
    s->acc = acc;
    s->acc_cap = cap;
out:
    return ret;
}

/* Folds one stored sample into the batch's summary; added says whether it made a new row. */
static int acc_add(td_store *s, const td_metric *m, int key_id, int added)
{
    struct td__summary_acc *a;
    int ret = 0;

    if ((s->acc_used + 1) * 2 > s->acc_cap && (ret = acc_grow(s)) < 0)
        goto out;
    a = acc_slot(s->acc, s->acc_cap, m->job, key_id);
    if (!a->used) {
        a->used = 1;
        a->job = m->job;
        a->key_id = key_id;
        a->added = 0;
        a->last_step = INT64_MIN;
        a->min = a->max = NAN;
        s->acc_used++;
    }
    a->added += added;
    if (m->step >= a->last_step) {
        a->last_step = m->step;
        a->last = m->value;
    }
    /* fmin/fmax return the other argument when one is NaN. */
    a->min = fmin(a->min, m->value);
    a->max = fmax(a->max, m->value);
out:
    return ret;
}

/* Binds a double, NaN as SQL NULL (which is what SQLite would store for it anyway). */
static void bind_num(sqlite3_stmt *st, int i, double v)
{
    if (isnan(v))
        sqlite3_bind_null(st, i);
    else
        sqlite3_bind_double(st, i, v);
}

/* Reads a REAL column, NULL as NaN. */
static double column_num(sqlite3_stmt *st, int col)
{
    return sqlite3_column_type(st, col) == SQLITE_NULL ? NAN : sqlite3_column_double(st, col);
}

/* Writes the batch's summary table into metric_summary, inside the batch's transaction. */
static int acc_flush(td_store *s, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    size_t i;
    int rc;
    int ret;

    /* In DO UPDATE, a bare column is the stored row and excluded.x the batch's. SQLite's
     * two-argument min()/max() are NULL when either side is, hence the coalesce. */
    ret = td__store_stmt(s, TD__ST_SUMMARY_UPSERT,
                         "INSERT INTO metric_summary (job, key, count, last_step, last, \"min\", "
                         "\"max\") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) "
                         "ON CONFLICT (job, key) DO UPDATE SET "
                         "count = count + excluded.count, "
                         "last = CASE WHEN excluded.last_step >= last_step THEN excluded.last "
                         "ELSE last END, "
                         "last_step = max(last_step, excluded.last_step), "
                         "\"min\" = coalesce(min(\"min\", excluded.\"min\"), \"min\", "
                         "excluded.\"min\"), "
                         "\"max\" = coalesce(max(\"max\", excluded.\"max\"), \"max\", "
                         "excluded.\"max\")",
                         &st, err);
    for (i = 0; ret == 0 && i < s->acc_cap; i++) {
        if (!s->acc[i].used)
            continue;
        sqlite3_bind_int64(st, 1, s->acc[i].job);
        sqlite3_bind_int(st, 2, s->acc[i].key_id);
        sqlite3_bind_int64(st, 3, s->acc[i].added);
        sqlite3_bind_int64(st, 4, s->acc[i].last_step);
        bind_num(st, 5, s->acc[i].last);
        bind_num(st, 6, s->acc[i].min);
        bind_num(st, 7, s->acc[i].max);
        rc = sqlite3_step(st);
        sqlite3_reset(st);
        if (rc != SQLITE_DONE)
            ret = td__store_fail(s, rc, "updating the metric summary (metric_summary upsert)", err);
    }
    return ret;
}

/* ---- writing ---- */

/* Checks every sample before the transaction opens: a key must be a non-empty string that
 * fits TD_STORE_MAX_KEY. */
static int batch_check(const td_metric *m, size_t n, td_error_t *err)
{
    size_t len;
    size_t i;
    int ret = 0;

    for (i = 0; i < n && ret == 0; i++) {
        len = strnlen(m[i].key, sizeof(m[i].key));
        if (len == 0 || len == sizeof(m[i].key))
            ret = td_error_set(err, TD_EINVAL,
                               "store: metric %zu of %zu (job %lld, step %lld): key is %s", i, n,
                               (long long)m[i].job, (long long)m[i].step,
                               len == 0 ? "empty" : "not NUL-terminated");
    }
    return ret;
}

/* Stores one sample: an insert that does nothing when (job, key, step) exists, then, for a
 * replayed step, an update. The common case, a new step, costs one statement. */
static int sample_write(td_store *s, sqlite3_stmt *ins, sqlite3_stmt *upd, const td_metric *m,
                        int key, int *added, const char **which)
{
    int rc;

    *which = "INSERT INTO metrics";

    sqlite3_bind_int64(ins, 1, m->job);
    sqlite3_bind_int(ins, 2, key);
    sqlite3_bind_int64(ins, 3, m->step);
    bind_num(ins, 4, m->value);
    bind_num(ins, 5, m->time);
    rc = sqlite3_step(ins);
    sqlite3_reset(ins);
    *added = rc == SQLITE_DONE && sqlite3_changes(s->db) > 0;
    if (rc == SQLITE_DONE && !*added) {
        *which = "UPDATE metrics (replayed step)";
        sqlite3_bind_int64(upd, 1, m->job);
        sqlite3_bind_int(upd, 2, key);
        sqlite3_bind_int64(upd, 3, m->step);
        bind_num(upd, 4, m->value);
        bind_num(upd, 5, m->time);
        rc = sqlite3_step(upd);
        sqlite3_reset(upd);
    }
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}

/* Writes every sample and folds it into the summary table, inside the open transaction. */
static int batch_rows(td_store *s, const td_metric *m, size_t n, td_error_t *err)
{
    sqlite3_stmt *ins = NULL;
    sqlite3_stmt *upd = NULL;
    char what[TD_STORE_MAX_KEY + 160];
    const char *which = "";
    size_t i;
    int key = 0;
    int added;
    int rc = SQLITE_OK;
    int ret;

    ret = td__store_stmt(s, TD__ST_METRIC_INSERT,
                         "INSERT INTO metrics (job, key, step, value, time) "
                         "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (job, key, step) DO NOTHING",
                         &ins, err);
    if (ret == 0)
        ret = td__store_stmt(s, TD__ST_METRIC_REPLACE,
                             "UPDATE metrics SET value = ?4, time = ?5 "
                             "WHERE job = ?1 AND key = ?2 AND step = ?3",
                             &upd, err);
    for (i = 0; i < n && ret == 0; i++) {
        ret = key_id(s, m[i].key, 1, &key, err);
        if (ret == 0)
            rc = sample_write(s, ins, upd, &m[i], key, &added, &which);
        if (ret == 0 && rc != SQLITE_OK) {
            snprintf(what, sizeof(what),
                     "%s, metrics[%zu] of %zu (job %lld, key \"%s\", step %lld)", which, i, n,
                     (long long)m[i].job, m[i].key, (long long)m[i].step);
            ret = td__store_fail(s, rc, what, err);
        }
        if (ret == 0 && acc_add(s, &m[i], key, added) < 0)
            ret = td_error_set(err, TD_ENOMEM, "store: out of memory summarising metrics");
    }
    return ret;
}

int td_store_metrics_write(td_store *s, const td_metric *m, size_t n, td_error_t *err)
{
    int ret = 0;

    if (n == 0)
        goto out;
    ret = batch_check(m, n, err);
    if (ret < 0)
        goto out;
    if (s->acc != NULL)
        memset(s->acc, 0, s->acc_cap * sizeof(*s->acc));
    s->acc_used = 0;
    ret = td__store_begin(s, err);
    if (ret < 0)
        goto out;
    ret = batch_rows(s, m, n, err);
    if (ret == 0)
        ret = acc_flush(s, err);
    if (ret == 0)
        ret = td__store_commit(s, err);
    /* On any failure nothing of the batch stays: err already holds SQLite's message, which
     * the ROLLBACK would replace. */
    if (ret < 0)
        td__store_rollback(s);
out:
    return ret;
}

/* ---- reading ---- */

/* Builds the JSON array of the key ids named in keys, for json_each(): "[3,7]". Names that
 * were never written match nothing and are left out; *found says how many matched. */
static int keys_json(td_store *s, const char *const *keys, size_t nkeys, char **out, size_t *found,
                     td_error_t *err)
{
    size_t cap = nkeys < (SIZE_MAX - 3) / 12 ? nkeys * 12 + 3 : 0; /* an int is <= 11 chars */
    char *buf = cap > 0 ? malloc(cap) : NULL;
    size_t len = 0;
    size_t i;
    int id = 0;
    int ret = 0;

    *found = 0;
    if (buf == NULL) {
        ret = td_error_set(err, TD_ENOMEM, "store: out of memory filtering %zu keys", nkeys);
        goto out;
    }
    buf[len++] = '[';
    for (i = 0; i < nkeys && ret == 0; i++) {
        if (keys[i] == NULL || strnlen(keys[i], TD_STORE_MAX_KEY) == TD_STORE_MAX_KEY)
            continue;
        ret = key_id(s, keys[i], 0, &id, err);
        if (ret == 0 && id != 0)
            len += (size_t)snprintf(buf + len, cap - len, "%s%d", *found > 0 ? "," : "", id);
        *found += ret == 0 && id != 0;
    }
    buf[len++] = ']';
    buf[len] = '\0';
out:
    if (ret < 0) {
        free(buf);
        buf = NULL;
    }
    *out = buf;
    return ret;
}

/* Delivers the rows of a bound page statement to cb, advancing c. */
static int page_rows(td_store *s, sqlite3_stmt *st, td_metric_cursor *c, td_metric_cb cb, void *ud,
                     size_t *ndone, td_error_t *err)
{
    td_metric_row row;
    const unsigned char *name;
    int rc;
    int ret = 0;

    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        name = sqlite3_column_text(st, 1);
        snprintf(s->row_key, sizeof(s->row_key), "%s", name != NULL ? (const char *)name : "");
        row.key = s->row_key;
        row.key_id = sqlite3_column_int(st, 0);
        row.step = sqlite3_column_int64(st, 2);
        row.value = column_num(st, 3);
        row.time = column_num(st, 4);
        c->step = row.step;
        c->key_id = row.key_id;
        (*ndone)++;
        if (cb(ud, &row) != 0) {
            rc = SQLITE_DONE;
            break;
        }
    }
    if (rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "reading a page of metrics", err);
    return ret;
}

void td_metric_cursor_init(td_metric_cursor *c, int64_t since_step)
{
    /* Key ids start at 1, so "after (since_step, 0)" is every row from since_step on. */
    c->step = since_step;
    c->key_id = 0;
}

/* The page query: rows after (step, key) in the order of the metrics_by_step index, whose
 * range starts at step = ?2, so a page reads at most one step's rows that it skips. The
 * CROSS JOIN keeps metrics as the outer loop, in index order, so LIMIT stops the scan. */
#define PAGE_SQL(filter)                                                        \
    "SELECT m.key, k.name, m.step, m.value, m.time FROM metrics AS m "          \
    "CROSS JOIN metric_keys AS k ON k.id = m.key "                              \
    "WHERE m.job = ?1 AND m.step >= ?2 AND (m.step > ?2 OR m.key > ?3) " filter \
    "ORDER BY m.step, m.key LIMIT ?4"

int td_store_metrics_page(td_store *s, int64_t job, td_metric_cursor *c, const char *const *keys,
                          size_t nkeys, size_t limit, td_metric_cb cb, void *ud, size_t *ndone,
                          td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    char *ids = NULL;
    size_t found = 0;
    int ret = 0;

    *ndone = 0;
    if (nkeys > 0 && keys == NULL) {
        ret = td_error_set(err, TD_EINVAL, "store: %zu metric keys but no array", nkeys);
        goto out;
    }
    if (nkeys > 0) {
        ret = keys_json(s, keys, nkeys, &ids, &found, err);
        if (ret < 0 || found == 0) /* none of the names exists: nothing to deliver */
            goto out;
        ret = td__store_stmt(s, TD__ST_PAGE_KEYS,
                             PAGE_SQL("AND m.key IN (SELECT value FROM json_each(?5)) "), &st, err);
    } else {
        ret = td__store_stmt(s, TD__ST_PAGE_ALL, PAGE_SQL(""), &st, err);
    }
    if (ret < 0 || limit == 0)
        goto out;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, c->step);
    sqlite3_bind_int(st, 3, c->key_id);
    sqlite3_bind_int64(st, 4, limit > INT64_MAX ? INT64_MAX : (int64_t)limit);
    if (ids != NULL)
        sqlite3_bind_text(st, 5, ids, -1, SQLITE_STATIC);
    ret = page_rows(s, st, c, cb, ud, ndone, err);
out:
    /* Resetting ends the statement's read transaction, so the WAL can checkpoint. */
    if (st != NULL) {
        sqlite3_reset(st);
        sqlite3_clear_bindings(st);
    }
    free(ids);
    return ret;
}

int td_store_metrics_summary(td_store *s, int64_t job, td_summary_cb cb, void *ud, td_error_t *err)
{
    td_metric_summary row;
    const unsigned char *name;
    sqlite3_stmt *st = NULL;
    int rc = SQLITE_DONE;
    int ret;

    ret = td__store_stmt(s, TD__ST_SUMMARY_READ,
                         "SELECT k.name, m.count, m.last_step, m.last, m.\"min\", m.\"max\" "
                         "FROM metric_summary AS m JOIN metric_keys AS k ON k.id = m.key "
                         "WHERE m.job = ?1 ORDER BY k.name",
                         &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, job);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        name = sqlite3_column_text(st, 0);
        snprintf(s->row_key, sizeof(s->row_key), "%s", name != NULL ? (const char *)name : "");
        row.key = s->row_key;
        row.count = sqlite3_column_int64(st, 1);
        row.last_step = sqlite3_column_int64(st, 2);
        row.last = column_num(st, 3);
        row.min = column_num(st, 4);
        row.max = column_num(st, 5);
        if (cb(ud, &row) != 0) {
            rc = SQLITE_DONE;
            break;
        }
    }
    if (rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "reading the metric summary", err);
    sqlite3_reset(st);
out:
    return ret;
}
