/* Unit tests of train/device.h on the CPU: counting and opening cpu devices, a job's share of
 * the machine's memory, the GPU reserve that grows with a job's world, and the all-reduce
 * group a data-parallel run's replicas meet in (its barriers, its decision, its average, and
 * the abort that releases every waiting rank). CUDA's side of the same interface runs in the
 * gpu suite. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/device.h"
#include "kernels/kernels.h"
#include "common/td_panic.h"

static void test_cpu_count_and_open(void **state)
{
    td_device *d = NULL;
    td_error_t err = {0};
    double peak = -1;
    int n = 0;

    (void)state;
    assert_int_equal(td_device_count(TD_DEVICE_CPU, &n, &err), 0);
    assert_true(n >= 1);
    assert_int_equal(n, (int)sysconf(_SC_NPROCESSORS_ONLN));
    assert_true(td_device_kind_built(TD_DEVICE_CPU));
    assert_string_equal(td_device_kind_name(TD_DEVICE_CPU), "cpu");
    assert_string_equal(td_device_kind_name(TD_DEVICE_CUDA), "cuda");
    assert_ptr_equal(td_device_kernels(TD_DEVICE_CPU), td_kernels_cpu());
    assert_int_equal(td_device_open(&d, TD_DEVICE_CPU, 0, &err), 0);
    assert_non_null(d);
    assert_int_equal(td_device_kind_of(d), TD_DEVICE_CPU);
    /* a CPU has no precision switches and no datasheet peak: no mfu */
    assert_int_equal(td_device_prepare(d, 1, 1, &peak, &err), 0);
    assert_true(peak == 0.0);
    td_device_close(d);
    td_device_close(NULL);
}

/* A build without CUDA answers for cuda devices with the message the daemon shows. */
static void test_cuda_without_cuda(void **state)
{
    td_device *d = NULL;
    td_error_t err = {0};
    int n = -1;

    (void)state;
    if (td_device_kind_built(TD_DEVICE_CUDA))
        skip();
    assert_int_equal(td_device_count(TD_DEVICE_CUDA, &n, &err), TD_EINVAL);
    assert_string_equal(err.msg, "this traind was built without CUDA");
    assert_int_equal(n, 0);
    assert_int_equal(td_device_open(&d, TD_DEVICE_CUDA, 0, &err), TD_EINVAL);
    assert_null(d);
    assert_false(td_device_poisoned());
}

/* cpu devices share the machine's memory: a job on n of them gets MemAvailable over n each,
 * read once, and the first device is named. */
static void test_cpu_job_memory(void **state)
{
    int ords[3] = {0, 1, 2}, which = -1;
    size_t f1, t1, f3, t3, free_b, total_b;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(td_device_memory(TD_DEVICE_CPU, 0, &free_b, &total_b, &err), 0);
    assert_true(free_b > 0 && total_b >= free_b);
    assert_int_equal(td_device_job_memory(TD_DEVICE_CPU, ords, 1, &f1, &t1, &which, &err), 0);
    assert_int_equal(which, 0);
    assert_int_equal(td_device_job_memory(TD_DEVICE_CPU, ords, 3, &f3, &t3, &which, &err), 0);
    assert_int_equal(which, 0);
    assert_int_equal(t1, total_b);
    assert_int_equal(t3, total_b);
    /* MemAvailable moves between the readings: a third of one reading, within 5% of it */
    assert_true((double)f3 > 0.95 * (double)f1 / 3 && (double)f3 < 1.05 * (double)f1 / 3);
}

/* The GPU reserve: 1 GiB for one GPU, and NCCL's buffers on top for each further peer; what
 * is left never wraps below zero, and the worker's own context is added back. */
static void test_gpu_reserve_grows_with_world(void **state)
{
    size_t gib = (size_t)1 << 30;

    (void)state;
    assert_int_equal(td_device_gpu_reserve(1), TD_DEVICE_GPU_RESERVE);
    assert_int_equal(td_device_gpu_reserve(2), TD_DEVICE_GPU_RESERVE + TD_DEVICE_NCCL_PER_PEER);
    assert_int_equal(td_device_gpu_reserve(8), TD_DEVICE_GPU_RESERVE + 7 * TD_DEVICE_NCCL_PER_PEER);
    assert_true(td_device_gpu_reserve(8) > td_device_gpu_reserve(4));
    assert_int_equal(td_device_gpu_usable(80 * gib, 1),
                     80 * gib + TD_DEVICE_CUDA_CONTEXT_BYTES - TD_DEVICE_GPU_RESERVE);
    assert_int_equal(td_device_gpu_usable(80 * gib, 8),
                     80 * gib + TD_DEVICE_CUDA_CONTEXT_BYTES - td_device_gpu_reserve(8));
    assert_int_equal(td_device_gpu_usable(0, 1), 0);
    assert_int_equal(td_device_gpu_usable(gib / 2, 8), 0);
}

/* ---- the all-reduce group ---- */

#define WORLD  3
#define FLOATS 1001 /* not a multiple of WORLD: the shares are uneven */

typedef struct rank_arg {
    td_group *g;
    int rank;
    float buf[FLOATS];
    int decisions; /* barriers that returned 0 */
    int decided;   /* what decide() wrote, as each rank saw it after the barrier */
    int failed;    /* the all-reduce panicked */
    td_error_t err;
} rank_arg;

static int decide(void *ud)
{
    return *(int *)ud;
}

/* A rank's all-reduce under a panic boundary of its own, as the trainer calls it. */
static int allreduce_caught(td_group *g, int rank, float *buf, size_t n, td_error_t *err)
{
    td_boundary b;

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_group_allreduce(g, rank, buf, n);
        td_boundary_leave(&b);
        return 0;
    }
    *err = b.err;
    return err->code;
}

static void *rank_main(void *arg)
{
    rank_arg *a = arg;
    int seven = 7;

    for (int i = 0; i < FLOATS; i++)
        a->buf[i] = (float)(a->rank * 1000 + i);
    td_error_t e;
    int decision = 0;

    if (td_group_barrier(a->g, a->rank, decide, &seven, &decision, &e) == 0)
        a->decisions++;
    a->decided = decision;
    a->failed = allreduce_caught(a->g, a->rank, a->buf, FLOATS, &a->err) != 0;
    td_group_leave(a->g, a->rank);
    return NULL;
}

/* Every rank sees the last arrival's decision, and every buffer ends as the mean of all, the
 * same bits on every rank (each element is summed in rank order by one rank). */
static void test_group_average(void **state)
{
    pthread_t th[WORLD];
    rank_arg *a = calloc(WORLD, sizeof(*a));
    td_group *g = NULL;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(td_group_new(&g, TD_DEVICE_CPU, WORLD, 30.0, &err), 0);
    for (int r = 0; r < WORLD; r++) {
        a[r].g = g;
        a[r].rank = r;
        assert_int_equal(td_group_join(g, r, NULL, NULL, &err), 0);
        pthread_create(&th[r], NULL, rank_main, &a[r]);
    }
    for (int r = 0; r < WORLD; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < WORLD; r++) {
        assert_int_equal(a[r].decisions, 1);
        assert_int_equal(a[r].decided, 7);
        assert_false(a[r].failed);
        for (int i = 0; i < FLOATS; i++) {
            float want =
                ((0.0f * 1000 + (float)i) + (1.0f * 1000 + (float)i) + (2.0f * 1000 + (float)i)) *
                (1.0f / WORLD);
            assert_true(a[r].buf[i] == want);
            assert_true(a[r].buf[i] == a[0].buf[i]);
        }
    }
    td_group_free(g);
    free(a);
}

typedef struct waiter {
    td_group *g;
    int barrier_rc;
    int reduce_rc;
    td_error_t err;
} waiter;

static void *wait_main(void *arg)
{
    waiter *w = arg;
    float buf[4] = {1, 2, 3, 4};

    int decision;
    td_error_t e;

    w->barrier_rc = td_group_barrier(w->g, 1, NULL, NULL, &decision, &e);
    w->reduce_rc = allreduce_caught(w->g, 1, buf, 4, &w->err);
    return NULL;
}

/* A rank that fails aborts the group: a peer waiting at a barrier is released at once, and
 * its all-reduce stops with TD_EABORTED rather than waiting for a rank that will never come. */
static void test_group_abort_releases(void **state)
{
    td_group *g = NULL;
    td_error_t err = {0};
    waiter w = {0};
    pthread_t th;

    (void)state;
    assert_int_equal(td_group_new(&g, TD_DEVICE_CPU, 2, 30.0, &err), 0);
    w.g = g;
    pthread_create(&th, NULL, wait_main, &w);
    usleep(50 * 1000); /* let it reach the barrier; the abort releases it either way */
    td_group_abort(g);
    pthread_join(th, NULL);
    assert_int_equal(w.barrier_rc, -1);
    assert_int_equal(w.reduce_rc, TD_EABORTED);
    assert_string_equal(w.err.msg, "stopped: another device of the job failed");
    int decision;
    assert_int_equal(td_group_barrier(g, 0, NULL, NULL, &decision, &err), -1);
    td_group_free(g);
    td_group_free(NULL);
}

static void test_group_refuses_bad_world(void **state)
{
    td_group *g = (td_group *)1;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(td_group_new(&g, TD_DEVICE_CPU, 0, 30.0, &err), TD_EINVAL);
    assert_null(g);
    assert_int_equal(td_group_new(&g, TD_DEVICE_CPU, TD_MAX_DEVICES + 1, 30.0, &err), TD_EINVAL);
    assert_null(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_count_and_open),
        cmocka_unit_test(test_cuda_without_cuda),
        cmocka_unit_test(test_cpu_job_memory),
        cmocka_unit_test(test_gpu_reserve_grows_with_world),
        cmocka_unit_test(test_group_average),
        cmocka_unit_test(test_group_abort_releases),
        cmocka_unit_test(test_group_refuses_bad_world),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
