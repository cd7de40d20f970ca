#!/bin/sh
# The GPU check of issue 6, for a machine with an NVIDIA GPU: builds traind with the CUDA
# backend in its own build folder, runs the gpu suite (every CUDA op against its CPU twin in
# fp32, TF32 and bf16, the table's memory ops, the trainer end to end on CUDA against the CPU
# and its checkpoint resume, NCCL, the sticky error, the memory guard), the unit tests that
# the CUDA build touches (kernels, the memory estimate), and bench_gpu (the device's cuBLAS
# bf16 GEMM figure, then GPT-2 124M's shape through the trainer in bf16, TF32 and fp32), traind
# end to end on the GPUs, and a sensorlm of the base preset at the largest batch that fits, and
# writes every log and figure into OUTDIR. About 3 to 5 minutes on one H200 with 16 cores.
# Each stage has its own time limit and none may run past an overall deadline of 470 s, so
# the whole stays under 8 minutes whatever hangs.
#
#   tests/gpu/check.sh [OUTDIR]      (default: build-gpu-check/report under the repository root)
#
# OUTDIR ends up holding: env.txt (GPU, driver, toolkit), build.log, test_gpu.log (the suite's
# full output: each op's largest error against its bound, the trainer's losses), meson-testlog.txt,
# unit.log, bench_gpu.log and bench_gpu.csv, and summary.txt with one line per stage and the
# bench's figures. Exits 0 when every stage passed (a skipped gpu suite or bench counts as a
# failure here: this script is for GPU machines).
set -u

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/build-gpu-check/report}
BUILD=${TD_CHECK_BUILD:-$ROOT/build-gpu-check} # the build folder; TD_CHECK_BUILD overrides
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
status=0
START=$(date +%s)
DEADLINE=$((START + 470)) # seconds: 8 minutes less a margin for the last lines

limit() { # limit SECONDS: SECONDS, or what is left before the deadline when that is less
    left=$((DEADLINE - $(date +%s)))
    [ "$left" -lt 1 ] && left=1
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

stage() { # stage NAME RC: one line of the summary
    if [ "$2" -eq 0 ]; then
        echo "$1: ok" | tee -a "$SUMMARY"
    else
        echo "$1: FAILED (exit $2)" | tee -a "$SUMMARY"
        status=1
    fi
}

{
    date -u
    uname -a
    nvidia-smi 2>&1 || echo "nvidia-smi: not found"
    nvidia-smi topo -m 2>&1 || true
    /usr/local/cuda/bin/nvcc --version 2>&1 || nvcc --version 2>&1
    echo "cores: $JOBS"
} >"$OUT/env.txt" 2>&1

# 1. build: only what this check runs, so another part's unfinished work cannot stop it
T0=$(date +%s)
{
    if [ ! -f "$BUILD/build.ninja" ]; then
        meson setup "$BUILD" "$ROOT" -Dcuda=enabled -Dwerror=true -Dbuildtype=debugoptimized
    else
        meson setup --reconfigure "$BUILD" "$ROOT" -Dcuda=enabled -Dwerror=true
    fi &&
        timeout "$(limit 200)" ninja -C "$BUILD" -j "$JOBS" tests/test_gpu tests/test_memest \
            tests/test_kernels bench/bench_gpu daemon/traind client/trainctl
} >"$OUT/build.log" 2>&1
rc=$?
stage "build (-Dcuda=enabled, $(($(date +%s) - T0)) s)" $rc
if [ $rc -ne 0 ]; then
    tail -30 "$OUT/build.log"
    exit 1
fi

if [ "${TD_CHECK_STAGE:-all}" = all ]; then
# NCCL's ranks here are threads of one process: its bootstrap needs only the loopback interface,
# which NCCL skips unless told (the machine may have no other). Warnings go into the logs.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# 2. the gpu suite through meson (77 = skipped counts as a failure on a GPU machine), and the
#    executable's own output, which carries every op's figures
T0=$(date +%s)
timeout "$(limit 200)" meson test -C "$BUILD" --no-rebuild --suite gpu --print-errorlogs -v \
    >"$OUT/test_gpu.log" 2>&1
rc=$?
if grep -q "SKIP" "$OUT/test_gpu.log" && ! grep -q "^Ok: *1" "$OUT/test_gpu.log"; then
    echo "the gpu suite was skipped: no CUDA device seen" >>"$OUT/test_gpu.log"
    rc=77
fi
cp "$BUILD/meson-logs/testlog.txt" "$OUT/meson-testlog.txt" 2>/dev/null
stage "gpu suite ($(($(date +%s) - T0)) s)" $rc

# 3. the unit tests the CUDA build touches
T0=$(date +%s)
timeout "$(limit 60)" meson test -C "$BUILD" --no-rebuild --print-errorlogs test_kernels test_memest \
    >"$OUT/unit.log" 2>&1
stage "unit: test_kernels test_memest ($(($(date +%s) - T0)) s)" $?

# 4. the bench: the reference GEMM, then GPT-2 124M's shape through the trainer, the largest
#    batch that fits up to 16 rows of 1024 tokens, 3 warm-up and 20 timed steps per precision
T0=$(date +%s)
rm -f "$OUT/bench_gpu.csv"
echo "path,precision,batch,ms_per_step,tokens_per_s,tflops,mfu,first_loss,last_loss,gemm_tflops" \
    >"$OUT/bench_gpu.csv"
timeout "$(limit 150)" "$BUILD/bench/bench_gpu" --steps 20 --warmup 3 --csv "$OUT/bench_gpu.csv" \
    >"$OUT/bench_gpu.log" 2>&1
rc=$?
stage "bench_gpu ($(($(date +%s) - T0)) s)" $rc
grep -E "^(device 0|cuBLAS|GPT-2|the trainer|bf16 |tf32 |fp32 )" "$OUT/bench_gpu.log" |
    tee -a "$SUMMARY"
# A bench that ran fast but learned nothing is a failure: every precision's loss must fall
# from its first timed step to its last (columns 8 and 9 of bench_gpu.csv).
awk -F, 'NR > 1 && $8 != "" { n++; if (!($9 < $8)) { print "loss did not fall: " $0; bad = 1 } }
    END { if (n == 0) { print "bench_gpu.csv has no rows"; bad = 1 } exit bad }' \
    "$OUT/bench_gpu.csv" >"$OUT/bench_loss.txt" 2>&1
rc=$?
cat "$OUT/bench_loss.txt"
stage "bench_gpu: the loss falls in every precision" $rc
fi

# 5. the daemon on the GPUs, end to end: traind --devices cuda:all; a dry run; a gpt job on up
#    to two GPUs (NCCL when two) that must succeed with mfu and gpu_mem_used_mb recorded; a job
#    too large for the GPU refused at dispatch with the guard's numbers; a job with an injected
#    sticky error, after which traind re-executes itself and still serves. TD_CHECK_DEVICES
#    (default cuda:all) and TD_CHECK_STAGE=daemon (this stage alone) let the stage's own logic
#    be tried on a machine without a GPU: TD_CHECK_DEVICES=cpu:2 TD_CHECK_STAGE=daemon.
DEVICES=${TD_CHECK_DEVICES:-cuda:all}
EMBD=${TD_CHECK_EMBD:-512} # the job's n_embd and seq_len (smaller for a trial on a CPU)
SEQ=${TD_CHECK_SEQ:-512}
T0=$(date +%s)
daemon_check() {
    D=$(mktemp -d /tmp/td_gpu_daemon_XXXXXX)
    SOCK=$D/traind.sock
    TC="$BUILD/client/trainctl --socket $SOCK"
    cat "$ROOT"/*/*.c "$ROOT"/*/*.h "$ROOT"/*.md >"$D/text.txt"
    NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
    [ "${DEVICES#cpu:}" != "$DEVICES" ] && NGPU=${DEVICES#cpu:}
    [ "$NGPU" -ge 2 ] && NDEV=2 || NDEV=1
    "$BUILD/daemon/traind" --socket "$SOCK" --state-dir "$D/state" --devices "$DEVICES" \
        --log-level info >"$OUT/traind.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 100); do [ -S "$SOCK" ] && break; sleep 0.2; done
    cat >"$D/job.json" <<JOB
{"name": "gpu-check", "devices": $NDEV,
 "model": {"kind": "gpt", "n_layer": 4, "n_head": 8, "n_embd": $EMBD, "seq_len": $SEQ, "vocab_size": 256},
 "data": {"kind": "text", "train": ["$D/text.txt"], "valid_fraction": 0.05},
 "optim": {"kind": "adamw", "lr": 3e-4, "grad_clip": 1.0},
 "batch_size": 16, "max_steps": 60, "eval_every": 30, "eval_batches": 4,
 "checkpoint_every": 30, "seed": 1}
JOB
    rc=0
    $TC info || rc=1
    $TC submit "$D/job.json" --dry-run || rc=1
    ID=$($TC submit "$D/job.json") || rc=1
    timeout "$(limit 120)" $TC watch "$ID" --keys train_loss,mfu,gpu_mem_used_mb || rc=1
    $TC status "$ID" || rc=1
    $TC metrics "$ID" --summary || rc=1
    # the job learned: its last train_loss is below its first
    $TC metrics "$ID" --keys train_loss --csv >"$D/loss.csv" || rc=1
    awk -F, '$2 == "train_loss" { if (n++ == 0) first = $4; last = $4 }
        END { printf "train_loss: first %s, last %s\n", first, last; exit !(n > 1 && last < first) }' \
        "$D/loss.csv" || { echo "the job's train_loss did not fall"; rc=1; }
    if [ "${DEVICES#cuda}" != "$DEVICES" ]; then
        $TC metrics "$ID" --keys mfu --csv | grep -q '^[0-9]' || { echo "no mfu rows"; rc=1; }
        $TC metrics "$ID" --keys gpu_mem_used_mb --csv | grep -q '^[0-9]' ||
            { echo "no gpu_mem_used_mb rows"; rc=1; }
    fi
    # too large: 1048576 sequences of 512 tokens
    BIG=$($TC submit "$D/job.json" --set batch_size=1048576 --set devices=1) || rc=1
    timeout 60 $TC watch "$BIG" >"$D/big.txt" 2>&1
    cat "$D/big.txt"
    $TC status "$BIG" | grep -q "does not fit on " || { echo "guard did not refuse"; rc=1; }
    # an injected sticky error: the job fails, traind re-executes itself and serves again
    STK=$($TC submit "$D/job.json" --set devices=1 --set max_steps=20 \
        --set 'debug={"fail": {"step": 5, "device": 0, "kind": "sticky"}}') || rc=1
    timeout 60 $TC watch "$STK" >/dev/null 2>&1
    for _ in $(seq 1 100); do $TC info >/dev/null 2>&1 && break; sleep 0.3; done
    $TC info >/dev/null || { echo "traind does not answer after the re-exec"; rc=1; }
    $TC status "$STK" | grep "sticky" || { echo "no sticky failure"; rc=1; }
    grep -q "re-exec" "$OUT/traind.log" || { echo "traind did not re-execute itself"; rc=1; }
    kill -TERM "$PID" 2>/dev/null
    wait "$PID"
    rm -rf "$D"
    return $rc
}
if [ "${TD_CHECK_STAGE:-all}" != sensorlm ]; then
daemon_check >"$OUT/daemon.log" 2>&1
stage "daemon on $DEVICES ($(($(date +%s) - T0)) s)" $?
grep -E "mfu|gpu_mem_used_mb|tokens_per_s|does not fit|train_loss: first" "$OUT/daemon.log" | head -9 |
    tee -a "$SUMMARY"
fi

# 6. sensorlm, the base preset (ViT-B towers) on one GPU: 1200 synthetic days (1440 x 10 in 10 x 2
#    patches: 720 tokens a window; 1080 train windows, more than any batch the guard can choose
#    on a 141 GB GPU at about 1 GB a window), batch_size "auto" (the largest batch the memory
#    guard allows, at most 1024), bf16, 30 steps; prints the batch, samples/s and the loss, and fails unless
#    the job succeeds with its loss falling from its first step to its last. TD_CHECK_STAGE=sensorlm
#    runs this stage alone; TD_CHECK_DEVICES=cpu:1 TD_CHECK_SLM_SIZE=tiny TD_CHECK_SLM_BATCH=8
#    tries its logic on a CPU.
SLM_SIZE=${TD_CHECK_SLM_SIZE:-base}
SLM_BATCH=${TD_CHECK_SLM_BATCH:-'"auto"'}
SLM_DEVICES=${TD_CHECK_DEVICES:-cuda:all}
T0=$(date +%s)
slm_check() {
    D=$(mktemp -d /tmp/td_gpu_slm_XXXXXX)
    SOCK=$D/traind.sock
    TC="$BUILD/client/trainctl --socket $SOCK"
    $TC sensor synth -o "$D" --days 1200 --seed 1 || return 1
    "$BUILD/daemon/traind" --socket "$SOCK" --state-dir "$D/state" --devices "$SLM_DEVICES" \
        --log-level info >"$OUT/traind-sensorlm.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 100); do [ -S "$SOCK" ] && break; sleep 0.2; done
    cat >"$D/job.json" <<JOB
{"name": "sensorlm-$SLM_SIZE", "devices": 1,
 "model": {"kind": "sensorlm", "size": "$SLM_SIZE"},
 "data": {"kind": "sensor", "train": "$D/synth-train.bin", "valid": "$D/synth-valid.bin"},
 "optim": {"lr": 1e-4, "grad_clip": 1.0}, "precision": "bf16",
 "batch_size": $SLM_BATCH, "max_steps": 30, "eval_every": 30, "seed": 1}
JOB
    rc=0
    $TC submit "$D/job.json" --dry-run || rc=1
    ID=$($TC submit "$D/job.json") || rc=1
    timeout "$(limit 150)" $TC watch "$ID" --keys train_loss,samples_per_s,mfu >"$D/watch.txt" 2>&1 ||
        rc=1
    tail -5 "$D/watch.txt"
    $TC status "$ID" || rc=1
    $TC logs "$ID" | grep -i "batch" | head -3 | sed 's/^/log: /'
    $TC metrics "$ID" --summary || rc=1
    $TC metrics "$ID" --keys train_loss,samples_per_s --csv >"$D/m.csv" || rc=1
    awk -F, '$2 == "samples_per_s" && $3 > 3 { s += $4; n++ }
        END { if (n > 0) printf "sensorlm samples/s: %.1f (mean of steps 4..)\n", s / n }' "$D/m.csv"
    awk -F, '$2 == "train_loss" { if (k++ == 0) first = $4; last = $4 }
        END { printf "sensorlm train_loss: first %s, last %s\n", first, last; exit !(k > 1 && last < first) }' \
        "$D/m.csv" || { echo "the sensorlm's train_loss did not fall"; rc=1; }
    kill -TERM "$PID" 2>/dev/null
    wait "$PID"
    rm -rf "$D"
    return $rc
}
if [ "${TD_CHECK_STAGE:-all}" = all ] || [ "${TD_CHECK_STAGE:-all}" = sensorlm ]; then
    slm_check >"$OUT/sensorlm.log" 2>&1
    stage "sensorlm $SLM_SIZE on $SLM_DEVICES ($(($(date +%s) - T0)) s)" $?
    grep -E "would take|^log:|samples/s|train_loss: first|^fits" "$OUT/sensorlm.log" | head -8 |
        tee -a "$SUMMARY"
fi

echo "total: $(($(date +%s) - START)) s" | tee -a "$SUMMARY"

echo "logs and figures in $OUT"
exit $status
