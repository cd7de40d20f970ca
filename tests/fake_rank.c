/* A stand-in for `traind rank` (proto/PROTOCOL.md, "Rank stream") that trains nothing, for
 * test_launch: it takes the rank's command line, reads the job's spec, and, on global rank 0,
 * writes the frames a rank writes: rank, started, a train_loss row and a progress frame per
 * step (step * 0.5 + 1, every 20 ms), done. Each process of the world takes its rank and size
 * from the launcher (mpirun's OMPI_COMM_WORLD_*, srun's SLURM_PROCID and SLURM_NTASKS).
 *
 * The job's name picks a behaviour, so that one daemon can run each:
 *   fake-ok       max_steps steps, then done succeeded; every process exits 0
 *   fake-wait     steps until SIGUSR1 (done cancelled, exit 2, after writing
 *                 CKPT/ckpt-S.bin) or SIGUSR2/SIGTERM (done interrupted, exit 3)
 *   fake-die      like fake-wait, but rank 1 kills itself with SIGKILL once rank 0 is past
 *                 step 3 (it reads CKPT/.fake-step)
 *   fake-fail     done failed at step 2 naming device 0 of node 1; exit 1
 *   fake-garbage  a frame that is not msgpack after the rank frame, then waits like fake-wait
 *   fake-usage    "traind rank: --spec: bad" on stderr, exit 64
 * Processes other than rank 0 wait for rank 0's CKPT/.fake-done (or a signal). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "proto/proto.h"

static volatile sig_atomic_t got;

static void on_signal(int sig)
{
    got = sig;
}

static int env_int(const char *a, const char *b, int dflt)
{
    const char *v = getenv(a);

    if (v == NULL)
        v = getenv(b);
    return v != NULL ? atoi(v) : dflt;
}

static void emit(td_pw *w)
{
    const char *frame;
    size_t len;

    if (td_pw_finish(w, &frame, &len) != 0 || fwrite(frame, 1, len, stdout) != len ||
        fflush(stdout) != 0)
        exit(1);
    td_pw_reset(w);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};

    nanosleep(&ts, NULL);
}

static void touch(const char *dir, const char *name, long value)
{
    char path[1200];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "w");
    if (f != NULL) {
        fprintf(f, "%ld\n", value);
        fclose(f);
    }
}

static long read_file(const char *dir, const char *name)
{
    char path[1200];
    long v = -1;
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "r");
    if (f != NULL) {
        if (fscanf(f, "%ld", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

static void done(td_pw *w, const char *state, long step, int code, const char *msg)
{
    td_pw_map_open(w);
    td_pw_str(w, "type");
    td_pw_str(w, "done");
    td_pw_str(w, "state");
    td_pw_str(w, state);
    td_pw_str(w, "step");
    td_pw_int(w, step);
    td_pw_str(w, "code");
    td_pw_int(w, code);
    td_pw_str(w, "message");
    td_pw_str(w, msg);
    td_pw_str(w, "failed");
    if (code != 0 && strcmp(state, "failed") == 0) {
        td_pw_array(w, 1);
        td_pw_map_open(w);
        td_pw_str(w, "node");
        td_pw_int(w, 1);
        td_pw_str(w, "node_name");
        td_pw_str(w, "fake1");
        td_pw_str(w, "device");
        td_pw_int(w, 0);
        td_pw_str(w, "code");
        td_pw_int(w, code);
        td_pw_str(w, "message");
        td_pw_str(w, "injected panic at step 2");
        td_pw_map_close(w);
    } else {
        td_pw_array(w, 0);
    }
    td_pw_map_close(w);
    emit(w);
}

int main(int argc, char **argv)
{
    const char *spec = NULL, *ckpt = ".";
    char name[64] = "", buf[1 << 16];
    long job = 1, steps = 10;
    int rank = env_int("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", 0);
    int size = env_int("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", 1);
    td_proto_frame *f = NULL;
    td_error_t err;
    FILE *sf;
    size_t n;
    td_pw w;

    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--spec") == 0)
            spec = argv[i + 1];
        else if (strcmp(argv[i], "--job") == 0)
            job = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--checkpoint-dir") == 0)
            ckpt = argv[i + 1];
    }
    if (argc < 2 || strcmp(argv[1], "rank") != 0 || spec == NULL ||
        (sf = fopen(spec, "rb")) == NULL) {
        fprintf(stderr, "traind rank: --spec: cannot read the spec\n");
        return 64;
    }
    n = fread(buf, 1, sizeof(buf), sf);
    fclose(sf);
    if (td_proto_decode(buf, n, &f, &err) != 0) {
        fprintf(stderr, "traind rank: --spec %s: %s\n", spec, err.msg);
        return 64;
    }
    td_pv_strcpy(td_pv_get(td_proto_frame_root(f), "name"), name, sizeof(name));
    {
        int64_t v;
        if (td_pv_int(td_pv_get(td_proto_frame_root(f), "max_steps"), &v) == 0)
            steps = (long)v;
    }
    td_proto_frame_free(f);
    if (strcmp(name, "fake-usage") == 0) {
        fprintf(stderr, "traind rank: --spec: bad\n");
        return 64;
    }
    signal(SIGUSR1, on_signal);
    signal(SIGUSR2, on_signal);
    signal(SIGTERM, on_signal);
    fprintf(stderr, "fake rank %d of %d (pid %d) for job %ld: %s\n", rank, size, (int)getpid(), job,
            name);
    if (rank != 0) {
        int die = strcmp(name, "fake-die") == 0 && rank == 1;
        while (!got && read_file(ckpt, ".fake-done") < 0) {
            if (die && read_file(ckpt, ".fake-step") > 3)
                kill(getpid(), SIGKILL);
            sleep_ms(10);
        }
        return got == SIGUSR1 ? 2 : got ? 3 : 0;
    }
    unlink(strcat(strcpy(buf, ckpt), "/.fake-done"));
    unlink(strcat(strcpy(buf, ckpt), "/.fake-step"));
    td_pw_init(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "type");
    td_pw_str(&w, "rank");
    td_pw_str(&w, "version");
    td_pw_int(&w, 1);
    td_pw_str(&w, "job");
    td_pw_int(&w, job);
    td_pw_str(&w, "nodes");
    td_pw_int(&w, size);
    td_pw_str(&w, "devices_per_node");
    td_pw_int(&w, 1);
    td_pw_str(&w, "world");
    td_pw_int(&w, size);
    td_pw_str(&w, "device_kind");
    td_pw_str(&w, "cpu");
    td_pw_str(&w, "node_names");
    td_pw_array(&w, (uint32_t)size);
    for (int i = 0; i < size; i++) {
        char nn[32];
        snprintf(nn, sizeof(nn), "fake%d", i);
        td_pw_str(&w, nn);
    }
    td_pw_map_close(&w);
    emit(&w);
    if (strcmp(name, "fake-garbage") == 0) {
        fwrite("\0\0\0\2\xc1\xc1", 1, 6, stdout);
        fflush(stdout);
    }
    td_pw_map_open(&w);
    td_pw_str(&w, "type");
    td_pw_str(&w, "started");
    td_pw_str(&w, "step");
    td_pw_int(&w, 0);
    td_pw_str(&w, "total_steps");
    td_pw_int(&w, steps);
    td_pw_map_close(&w);
    emit(&w);
    for (long s = 1;; s++) {
        int forever = strcmp(name, "fake-ok") != 0 && strcmp(name, "fake-fail") != 0;
        if (got) {
            touch(ckpt, "ckpt-0.bin", s - 1);
            done(&w, got == SIGUSR1 ? "cancelled" : "interrupted", s - 1,
                 got == SIGUSR1 ? -4212 : 0, got == SIGUSR1 ? "cancelled at step" : "");
            touch(ckpt, ".fake-done", 1);
            td_pw_free(&w);
            return got == SIGUSR1 ? 2 : 3;
        }
        if (strcmp(name, "fake-fail") == 0 && s == 2) {
            done(&w, "failed", 1, -4213,
                 "training worker on device 0 of node fake1 failed: injected panic at step 2");
            touch(ckpt, ".fake-done", 1);
            td_pw_free(&w);
            return 1;
        }
        if (!forever && s > steps)
            break;
        sleep_ms(20);
        td_pw_map_open(&w);
        td_pw_str(&w, "type");
        td_pw_str(&w, "metrics");
        td_pw_str(&w, "rows");
        td_pw_array(&w, 1);
        td_pw_array(&w, 3);
        td_pw_str(&w, "train_loss");
        td_pw_int(&w, s);
        td_pw_double(&w, (double)s * 0.5 + 1);
        td_pw_map_close(&w);
        emit(&w);
        td_pw_map_open(&w);
        td_pw_str(&w, "type");
        td_pw_str(&w, "progress");
        td_pw_str(&w, "step");
        td_pw_int(&w, s);
        td_pw_map_close(&w);
        emit(&w);
        touch(ckpt, ".fake-step", s);
    }
    done(&w, "succeeded", steps, 0, "");
    touch(ckpt, ".fake-done", 1);
    td_pw_free(&w);
    return 0;
}
