#!/usr/bin/env bash
# The GPU check: everything traind does on a GPU, in one run that reports every stage, for a GPU
# machine that may have none of traind's libraries and no compiler (issue 18).
#
#   .gpu/check.sh OUTDIR                   from the bundle scripts/gpu-pack.sh made: runs its
#                                          binaries with its own libraries; needs no compiler
#   tests/gpu/check.sh --build OUTDIR      on a GPU machine that has traind's build libraries:
#                                          builds with meson into build-gpu-check first
#
# The stages, in this order, each under its own time limit (timeout -k) inside an overall
# deadline of 8 minutes (DEADLINE_S), each run whatever happened before it:
#   preflight   the GPU, driver and runtime versions, cuBLAS and NCCL found or not, free GPU
#               memory, cores, memory, disk: everything missing, listed at once
#   unit        the unit tests the CUDA build touches: test_kernels, test_memest, test_device
#               (no GPU needed)
#   daemon-cpu  traind on cpu:1 from this build, end to end (submit, watch, metrics, the memory
#               guard, an injected sticky error and the re-exec): no GPU needed
#   gpu         the gpu suite (tests/test_gpu.c): every CUDA op against its CPU twin, the
#               trainer on CUDA, NCCL, the sticky error, the memory guard
#   profile     bench_gpu --profile: each class of work in a GPT-2 124M step (B 16, T 1024,
#               bf16) and a SensorLM base step, ms and % of the step, launches, MFU
#   daemon      traind --devices cuda:all end to end, as daemon-cpu, on the GPUs
#   sensorlm    a sensorlm of the base preset at the largest batch the memory guard allows
#   bench       bench_gpu: cuBLAS's bf16 GEMM, then GPT-2 124M through the trainer in bf16,
#               TF32 and fp32; every precision's loss must fall
# TD_CHECK_STAGES=gpu,bench runs only those (preflight always runs), for a second call after a
# fix. Each stage ends as one line of OUTDIR/summary.txt: "ok", "FAILED (why)", "skipped (why)"
# (a real exit 77: no GPU present), or "not reached (deadline)"; a failure adds its first
# error lines. OUTDIR ends up holding summary.txt and logs.tgz (every log, env.txt among them)
# and nothing else. Exits 0 when no stage failed; on a machine without a GPU the GPU stages
# are skipped, never failed.
set -u

HERE=$(cd "$(dirname "$0")" && pwd)
DEADLINE_S=${TD_CHECK_DEADLINE_S:-470} # seconds: 8 minutes, less a margin for the last lines
STAGES_ALL="unit daemon-cpu gpu profile daemon sensorlm bench"

usage() {
    echo "usage: $0 [--build] OUTDIR" >&2
    exit 2
}

# ---- the stage runner ------------------------------------------------------------------------

# What is left of the overall deadline, in seconds.
left() { echo $((DEADLINE - $(date +%s))); }

# limit SECONDS: SECONDS, or what is left before the deadline when that is less.
limit() {
    local l
    l=$(left)
    [ "$l" -lt 1 ] && l=1
    if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}

# wanted NAME: whether TD_CHECK_STAGES (comma list; empty: all) names the stage.
wanted() {
    [ -z "${TD_CHECK_STAGES:-}" ] && return 0
    case ",$TD_CHECK_STAGES," in *",$1,"*) return 0 ;; esac
    return 1
}

# line TEXT: one line of the summary, on the terminal too.
line() { echo "$*" | tee -a "$SUMMARY"; }

# why_failed LOG: the first lines of LOG that say what went wrong, indented.
why_failed() {
    grep -m 6 -E "FAILED|[Ee]rror|error:|panic|assert|Assertion|not found|did not|cannot|timed out|hung|Killed" \
        "$1" 2>/dev/null | cut -c1-200 | sed 's/^/    | /'
}

# run_stage NAME LIMIT: runs this script's stage NAME as a child under timeout -k, its output
# into LOGS/NAME.log; the summary line from its exit status (77: skipped, the reason being the
# last line of its log that starts "skip: "; 124 or 137: cut at its limit).
run_stage() {
    local name=$1 own=$2 lim t0 rc why
    if [ "$name" != preflight ] && ! wanted "$name"; then
        return 0
    fi
    if [ "$(left)" -lt 5 ]; then
        line "$name: not reached (deadline)"
        STATUS=1
        return 0
    fi
    lim=$(limit "$own")
    t0=$(date +%s)
    timeout -k 5 "$lim" "$SELF" --stage "$name" >"$LOGS/$name.log" 2>&1 </dev/null
    rc=$?
    case $rc in
    0) line "$name: ok ($(($(date +%s) - t0)) s)" ;;
    77)
        why=$(grep "^skip: " "$LOGS/$name.log" | tail -1 | cut -c7-)
        line "$name: skipped (${why:-exit 77})"
        ;;
    124 | 137)
        line "$name: FAILED (hung: cut at its limit of $lim s; last lines below)"
        tail -4 "$LOGS/$name.log" | cut -c1-200 | sed 's/^/    | /' | tee -a "$SUMMARY"
        STATUS=1
        ;;
    *)
        why=$(grep "^fail: " "$LOGS/$name.log" | head -1 | cut -c7-)
        line "$name: FAILED (${why:-exit $rc}, $(($(date +%s) - t0)) s)"
        why_failed "$LOGS/$name.log" | tee -a "$SUMMARY"
        STATUS=1
        ;;
    esac
    # The figures a stage wants in the summary: its lines that start "figure: ".
    grep "^figure: " "$LOGS/$name.log" | cut -c9- | sed 's/^/    /' | tee -a "$SUMMARY"
    return 0
}

# skip REASON: ends a stage as skipped.
skip() {
    echo "skip: $*"
    exit 77
}

# fail REASON: ends a stage as failed, REASON its summary's word.
fail() {
    echo "fail: $*"
    exit 1
}

# has_gpu: whether the preflight saw a CUDA device.
has_gpu() { [ "$(cat "$WORK/ngpu" 2>/dev/null || echo 0)" -gt 0 ]; }

# tcall SECONDS ARGS...: trainctl under a time limit of its own, so that no call can hang a stage.
tcall() {
    local s=$1
    shift
    timeout -k 2 "$s" "$TRAINCTL" --socket "$SOCK" "$@"
}

# stop_daemon PID: SIGTERM, then SIGKILL after 20 s: a stage never waits on a daemon for ever.
stop_daemon() {
    kill -TERM "$1" 2>/dev/null
    for _ in $(seq 1 100); do
        kill -0 "$1" 2>/dev/null || break
        sleep 0.2
    done
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}

# start_daemon DEVICES LOG: traind on a fresh state directory, waiting for its socket.
start_daemon() {
    D=$(mktemp -d "$WORK/daemon_XXXXXX")
    SOCK=$D/traind.sock
    "$TRAIND" --socket "$SOCK" --state-dir "$D/state" --devices "$1" --log-level info \
        >"$2" 2>&1 &
    PID=$!
    for _ in $(seq 1 150); do
        [ -S "$SOCK" ] && return 0
        kill -0 "$PID" 2>/dev/null || break
        sleep 0.2
    done
    echo "traind did not open its socket; its log:"
    tail -20 "$2"
    return 1
}

# ---- the stages --------------------------------------------------------------------------------

# The versions and sizes a person needs to read a GPU report, and everything missing at once.
stage_preflight() {
    local missing="" fatal=0 smi ngpu rc
    # Its "figure: " lines are the log's and the summary's (run_stage copies them there).
    date -u
    uname -a
    if command -v nvidia-smi >/dev/null 2>&1; then
        smi=$(timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free \
            --format=csv,noheader 2>&1)
        echo "$smi" | sed "s/^/figure: nvidia-smi: /"
        timeout 20 nvidia-smi 2>&1 | sed -n '1,12p'
    else
        missing="$missing nvidia-smi;"
    fi
    echo "cuBLAS: ${CUBLAS_FOUND:-not found}"
    echo "NCCL: ${NCCL_FOUND:-not found}"
    [ -n "${CUBLAS_FOUND:-}" ] || missing="$missing cuBLAS (libcublas.so.13, libcublasLt.so.13);"
    [ -n "${NCCL_FOUND:-}" ] || missing="$missing NCCL (libnccl.so.2);"
    # The bundle's own probe (write_env ran it): what the CUDA runtime, cuBLAS and NCCL it loads
    # say, and each device.
    rc=$(cat "$WORK/probe.rc")
    ngpu=$(awk '/^devices: / { print $2 }' "$WORK/probe.txt")
    echo "${ngpu:-0}" >"$WORK/ngpu"
    sed 's/^/figure: /' "$WORK/probe.txt"
    echo "figure: cores $(nproc); $(free -m 2>/dev/null | awk 'NR == 2 { print "memory " $2 " MiB, " $7 " available" }'); $(df -h "$WORK" | awk 'END { print "disk " $4 " free" }')"
    if grep -q "too old" "$WORK/probe.txt"; then
        missing="$missing $(grep -m1 'too old' "$WORK/probe.txt");"
        fatal=1
    fi
    if [ "${ngpu:-0}" -eq 0 ]; then
        missing="$missing a CUDA device;"
    elif [ -z "${CUBLAS_FOUND:-}" ] || [ -z "${NCCL_FOUND:-}" ] || [ "$rc" -ne 0 ]; then
        fatal=1 # a GPU, and the libraries to use it are not all there
    fi
    echo "figure: missing:${missing:- nothing}"
    [ "$fatal" -eq 0 ] || fail "missing:$missing"
    return 0
}

# A test program: exit 0 passes, 77 skips, anything else fails; its cmocka counts as a figure.
run_test() {
    local name=$1 rc
    shift
    echo "== $name $*"
    "$@"
    rc=$?
    echo "== $name: exit $rc"
    return $rc
}

stage_unit() {
    local bad=""
    for t in test_kernels test_memest test_device; do
        run_test "$t" "$BIN/$t" || bad="$bad $t"
    done
    [ -z "$bad" ] || fail "failed:$bad"
}

# The gpu suite. A run with no device exits 77 (skipped); on a GPU machine it must pass: a
# single GPU skips the two-GPU NCCL test inside the suite, which cmocka counts apart from
# failures, so a skipped test never hides a failed one.
stage_gpu() {
    local rc
    has_gpu || skip "no GPU present"
    # NCCL's ranks here are threads of one process: its bootstrap needs only the loopback
    # interface, which NCCL skips unless told (the machine may have no other).
    NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$BIN/test_gpu"
    rc=$?
    echo "figure: gpu suite: $(grep -c '^\[       OK \]' "$LOGS/gpu.log" 2>/dev/null) ok, $(grep -c '^\[  FAILED  \] test' "$LOGS/gpu.log" 2>/dev/null) failed, $(grep -c '^\[  SKIPPED \] test' "$LOGS/gpu.log" 2>/dev/null) skipped"
    [ "$rc" -eq 77 ] && fail "the suite skipped although the preflight saw a GPU"
    [ "$rc" -eq 0 ] || fail "test_gpu exit $rc: $(grep '^\[  FAILED  \] test' "$LOGS/gpu.log" | head -3 | awk '{print $4}' | paste -sd, -)"
}

# The daemon end to end on DEVICES with a gpt job of n_embd EMBD and seq_len SEQ.
daemon_check() {
    local devices=$1 embd=$2 seq=$3 log=$4 rc=0 ndev=1 ID BIG STK
    start_daemon "$devices" "$log" || return 1
    [ "$(cat "$WORK/ngpu" 2>/dev/null || echo 0)" -ge 2 ] && [ "${devices#cuda}" != "$devices" ] &&
        ndev=2
    cat >"$D/job.json" <<JOB
{"name": "gpu-check", "devices": $ndev,
 "model": {"kind": "gpt", "n_layer": 4, "n_head": 8, "n_embd": $embd, "seq_len": $seq, "vocab_size": 256},
 "data": {"kind": "text", "train": ["$DATA/text.txt"], "valid_fraction": 0.05},
 "optim": {"kind": "adamw", "lr": 3e-4, "grad_clip": 1.0},
 "batch_size": 16, "max_steps": 60, "eval_every": 30, "eval_batches": 4,
 "checkpoint_every": 30, "seed": 1}
JOB
    tcall 20 info || rc=1
    tcall 30 submit "$D/job.json" --dry-run || rc=1
    ID=$(tcall 30 submit "$D/job.json") || rc=1
    tcall "$(limit 120)" watch "$ID" --keys train_loss,mfu,gpu_mem_used_mb || rc=1
    tcall 20 status "$ID" || rc=1
    tcall 20 metrics "$ID" --summary || rc=1
    tcall 20 metrics "$ID" --keys train_loss --csv >"$D/loss.csv" || rc=1
    awk -F, '$2 == "train_loss" { if (n++ == 0) first = $4; last = $4 }
        END { printf "figure: %s train_loss: first %s, last %s\n", dev, first, last;
              exit !(n > 1 && last < first) }' dev="$devices" "$D/loss.csv" ||
        { echo "the job's train_loss did not fall"; rc=1; }
    if [ "${devices#cuda}" != "$devices" ]; then
        tcall 20 metrics "$ID" --keys mfu --csv | grep -q '^[0-9]' || { echo "no mfu rows"; rc=1; }
        tcall 20 metrics "$ID" --keys gpu_mem_used_mb --csv | grep -q '^[0-9]' ||
            { echo "no gpu_mem_used_mb rows"; rc=1; }
        tcall 20 metrics "$ID" --summary | grep -E "mfu|gpu_mem_used_mb|tokens_per_s" |
            sed 's/^/figure: /'
    fi
    # too large: 1048576 sequences
    BIG=$(tcall 30 submit "$D/job.json" --set batch_size=1048576 --set devices=1) || rc=1
    tcall 60 watch "$BIG" >"$D/big.txt" 2>&1
    cat "$D/big.txt"
    tcall 20 status "$BIG" | grep "does not fit on " | sed 's/^.*ENOMEM: */figure: the guard refused: /' | grep . ||
        { echo "the memory guard did not refuse the job"; rc=1; }
    # an injected sticky error: the job fails, traind re-executes itself and serves again
    STK=$(tcall 30 submit "$D/job.json" --set devices=1 --set max_steps=20 \
        --set 'debug={"fail": {"step": 5, "device": 0, "kind": "sticky"}}') || rc=1
    tcall 60 watch "$STK" >/dev/null 2>&1
    for _ in $(seq 1 100); do tcall 5 info >/dev/null 2>&1 && break; sleep 0.3; done
    tcall 20 info >/dev/null || { echo "traind does not answer after the re-exec"; rc=1; }
    tcall 20 status "$STK" | grep "sticky" || { echo "no sticky failure"; rc=1; }
    grep -q "re-exec" "$log" || { echo "traind did not re-execute itself"; rc=1; }
    stop_daemon "$PID"
    return $rc
}

stage_daemon_cpu() {
    daemon_check cpu:1 64 64 "$LOGS/traind-cpu.log" || fail "the daemon on cpu:1 (see daemon-cpu.log)"
}

stage_daemon() {
    has_gpu || skip "no GPU present"
    daemon_check cuda:all 512 512 "$LOGS/traind-cuda.log" || fail "the daemon on cuda:all (see daemon.log)"
}

# sensorlm, the base preset (ViT-B towers) on one GPU: 1200 synthetic days (1440 x 10 in 10 x 2
# patches: 720 tokens a window; 1080 train windows, more than any batch the guard can choose on
# a 141 GB GPU at about 1 GB a window), batch_size "auto" (the largest batch the memory guard
# allows), bf16, 30 steps; fails unless the job succeeds with its loss falling.
stage_sensorlm() {
    local rc=0 ID
    has_gpu || skip "no GPU present"
    slm_data || fail "trainctl sensor synth failed"
    start_daemon cuda:all "$LOGS/traind-sensorlm.log" || fail "traind did not start"
    cat >"$D/job.json" <<JOB
{"name": "sensorlm-base", "devices": 1,
 "model": {"kind": "sensorlm", "size": "base"},
 "data": {"kind": "sensor", "train": "$WORK/slm/synth-train.bin", "valid": "$WORK/slm/synth-valid.bin"},
 "optim": {"lr": 1e-4, "grad_clip": 1.0}, "precision": "bf16",
 "batch_size": "auto", "max_steps": 30, "eval_every": 30, "seed": 1}
JOB
    tcall 30 submit "$D/job.json" --dry-run || rc=1
    ID=$(tcall 30 submit "$D/job.json") || rc=1
    tcall "$(limit 150)" watch "$ID" --keys train_loss,samples_per_s,mfu >"$D/watch.txt" 2>&1 || rc=1
    tail -5 "$D/watch.txt"
    tcall 20 status "$ID" || rc=1
    tcall 20 logs "$ID" | grep -i "batch" | head -3 | sed 's/^/figure: log: /'
    tcall 20 metrics "$ID" --keys train_loss,samples_per_s --csv >"$D/m.csv" || rc=1
    awk -F, '$2 == "samples_per_s" && $3 > 3 { s += $4; n++ }
        END { if (n > 0) printf "figure: sensorlm samples/s: %.1f (mean of steps 4..)\n", s / n }' "$D/m.csv"
    awk -F, '$2 == "train_loss" { if (k++ == 0) first = $4; last = $4 }
        END { printf "figure: sensorlm train_loss: first %s, last %s\n", first, last;
              exit !(k > 1 && last < first) }' "$D/m.csv" ||
        { echo "the sensorlm's train_loss did not fall"; rc=1; }
    stop_daemon "$PID"
    [ "$rc" -eq 0 ] || fail "the sensorlm job (see sensorlm.log)"
}

# The synthetic sensor shards the sensorlm and profile stages train on, made once.
slm_data() {
    [ -f "$WORK/slm/synth-train.bin" ] && return 0
    mkdir -p "$WORK/slm"
    timeout 120 "$TRAINCTL" sensor synth -o "$WORK/slm" --days 1200 --seed 1
}

stage_profile() {
    local rc
    has_gpu || skip "no GPU present"
    slm_data || fail "trainctl sensor synth failed"
    # The GEMM reference runs too: the profile's MFU stands next to cuBLAS's own bf16 rate.
    "$BENCH_GPU" --profile --steps 10 --warmup 3 --slm-data "$WORK/slm/synth-train.bin" \
        >"$WORK/profile.txt" 2>&1
    rc=$?
    cat "$WORK/profile.txt"
    # The tables go into the summary: every line from "cuBLAS" and each "profile:" block.
    grep -E "^(device 0|cuBLAS)" "$WORK/profile.txt" | sed 's/^/figure: /'
    sed -n '/^profile: /,/^$/p' "$WORK/profile.txt" | grep . | sed 's/^/figure: /'
    [ "$rc" -eq 0 ] || fail "bench_gpu --profile exit $rc"
}

stage_bench() {
    local rc
    has_gpu || skip "no GPU present"
    echo "path,precision,batch,ms_per_step,tokens_per_s,tflops,mfu,first_loss,last_loss,gemm_tflops" \
        >"$LOGS/bench_gpu.csv"
    "$BENCH_GPU" --steps 20 --warmup 3 --csv "$LOGS/bench_gpu.csv"
    rc=$?
    grep -E "^(device 0|cuBLAS|GPT-2|bf16 |tf32 |fp32 )" "$LOGS/bench.log" | sed 's/^/figure: /'
    [ "$rc" -eq 0 ] || fail "bench_gpu exit $rc"
    # A bench that ran fast but learned nothing is a failure: every precision's loss must fall
    # from its first timed step to its last (columns 8 and 9 of bench_gpu.csv).
    awk -F, 'NR > 1 && $8 != "" { n++; if (!($9 < $8)) { print "loss did not fall: " $0; bad = 1 } }
        END { if (n == 0) { print "bench_gpu.csv has no rows"; bad = 1 } exit bad }' \
        "$LOGS/bench_gpu.csv" || fail "a precision's loss did not fall"
}

# ---- where the binaries and libraries are ------------------------------------------------------

# find_lib NAME DIRS...: the first DIR holding NAME.
find_lib() {
    local name=$1 d
    shift
    for d in "$@"; do
        [ -n "$d" ] && [ -e "$d/$name" ] && { echo "$d"; return 0; }
    done
    return 1
}

# The folders that may hold cuBLAS and NCCL: the toolkit's, the driver's mount, the system's,
# then every nvidia/*/lib of the wheels under the first python3 on PATH. Asked before
# LD_LIBRARY_PATH names the bundle's libraries, which python3 must not load.
lib_candidates() {
    local t
    for t in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        [ -n "$t" ] && echo "$t/lib64" && echo "$t/lib"
    done
    echo /usr/lib/x86_64-linux-gnu
    if command -v python3 >/dev/null 2>&1; then
        timeout 30 python3 -c 'import nvidia, os
for p in nvidia.__path__:
    for d, _, fs in os.walk(p):
        if any(f.startswith(("libcublas", "libnccl")) for f in fs): print(d)' 2>/dev/null
    fi
}

# Finds cuBLAS and NCCL; sets CUBLAS_DIR, NCCL_DIR and CUBLAS_FOUND, NCCL_FOUND (for people).
locate_cuda_libs() {
    local cands
    mapfile -t cands < <(lib_candidates)
    CUBLAS_DIR=$(find_lib libcublas.so.13 "${cands[@]}") &&
        find_lib libcublasLt.so.13 "$CUBLAS_DIR" >/dev/null || CUBLAS_DIR=""
    NCCL_DIR=$(find_lib libnccl.so.2 "${cands[@]}") || NCCL_DIR=""
    [ -n "$CUBLAS_DIR" ] && CUBLAS_FOUND="$(readlink -f "$CUBLAS_DIR/libcublas.so.13")"
    [ -n "$NCCL_DIR" ] && NCCL_FOUND="$(readlink -f "$NCCL_DIR/libnccl.so.2")"
    export CUBLAS_DIR NCCL_DIR CUBLAS_FOUND NCCL_FOUND
}

# The bundle: checks the payload against its sha256 and unpacks it once, into a folder named by
# that sum (outside .gpu, which stays small enough to travel).
unpack_bundle() {
    local sum
    sum=$(sha256sum "$HERE/payload.tar.gz" | cut -c1-64)
    if [ "$sum" != "$(cut -c1-64 "$HERE/payload.sha256")" ]; then
        echo "check.sh: $HERE/payload.tar.gz does not match payload.sha256: pack it again" >&2
        exit 1
    fi
    U=${TD_GPU_UNPACK:-${TMPDIR:-/tmp}}/traind-gpu-${sum:0:12}
    if [ ! -f "$U/.unpacked" ]; then
        rm -rf "$U" && mkdir -p "$U" && tar -xzf "$HERE/payload.tar.gz" -C "$U" &&
            touch "$U/.unpacked" || {
            echo "check.sh: cannot unpack the bundle into $U" >&2
            exit 1
        }
    fi
    BIN=$U/bin
    DATA=$U/data
    LD_LIBRARY_PATH=$U/lib
}

# The source build of --build: only what the check runs.
source_build() {
    local root build
    root=$(cd "$HERE/../.." && pwd)
    build=${TD_CHECK_BUILD:-$root/build-gpu-check}
    {
        if [ ! -f "$build/build.ninja" ]; then
            meson setup "$build" "$root" -Dcuda=enabled -Dwerror=true
        fi &&
            ninja -C "$build" tests/test_gpu tests/test_memest tests/test_kernels tests/test_device \
                bench/bench_gpu daemon/traind client/trainctl
    } >"$LOGS/build.log" 2>&1 || {
        line "build: FAILED (see build.log)"
        tail -20 "$LOGS/build.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
        return 1
    }
    line "build: ok"
    mkdir -p "$WORK/bin" "$WORK/data"
    for b in tests/test_gpu tests/test_memest tests/test_kernels tests/test_device bench/bench_gpu \
        daemon/traind client/trainctl; do
        ln -sf "$build/$b" "$WORK/bin/"
    done
    cat "$root"/*/*.c "$root"/*/*.h "$root"/*.md >"$WORK/data/text.txt"
    BIN=$WORK/bin
    DATA=$WORK/data
    LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
}

# Which file each binary loads for each library, as the dynamic linker resolves them now, and
# the versions the libraries report (bench_gpu --probe, which loads them as the stages will).
write_env() {
    timeout 30 "$BENCH_GPU" --probe >"$WORK/probe.txt" 2>&1
    echo $? >"$WORK/probe.rc"
    {
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        for b in "$BIN"/*; do
            echo "== $(basename "$b")"
            ldd "$b" 2>&1 | sed 's/^\s*/  /'
        done
        echo "== loaded (soname path version)"
        for so in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
            p=$(ldd "$BIN/test_gpu" "$BIN/traind" 2>/dev/null | awk -v s="$so" '$1 == s { print $3; exit }')
            [ -z "$p" ] && p=$(ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s { print $NF; exit }')
            case $so in
            libcuda.so.1) v=$(grep "^driver: " "$WORK/probe.txt" | cut -c9-) ;;
            libcublas*) v=$(grep "^cuBLAS: " "$WORK/probe.txt" | cut -c9-) ;;
            libnccl*) v=$(grep "^NCCL: " "$WORK/probe.txt" | cut -c7-) ;;
            esac
            if [ -n "$p" ] && [ -e "$p" ]; then
                echo "loaded: $so $(readlink -f "$p") (${v:-version unknown})"
            else
                echo "loaded: $so not found"
            fi
        done
    } >"$LOGS/env.txt" 2>&1
}

# ---- main --------------------------------------------------------------------------------------

SELF=$HERE/$(basename "$0")
if [ "${1:-}" = "--stage" ]; then
    # A child of run_stage: one stage, with the parent's environment.
    fn=stage_${2//-/_}
    "$fn"
    exit $?
fi

MODE=bundle
if [ "${1:-}" = "--build" ]; then
    MODE=build
    shift
fi
[ $# -le 1 ] || usage
OUT=${1:-$PWD/gpu-check-report}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/td_gpu_check_XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
rm -f "$OUT/logs.tgz"
STATUS=0
START=$(date +%s)
DEADLINE=$((START + DEADLINE_S))
export SELF WORK LOGS SUMMARY DEADLINE

# Whatever happens, every log goes into logs.tgz and the work folder goes.
finish() {
    tar -czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
    rm -rf "$WORK"
}
trap finish EXIT

line "traind GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $MODE mode, on $(uname -n)"
locate_cuda_libs
if [ "$MODE" = bundle ]; then
    if [ ! -f "$HERE/payload.tar.gz" ]; then
        echo "check.sh: no bundle beside this script: run scripts/gpu-pack.sh here, then" \
            ".gpu/check.sh OUTDIR; or tests/gpu/check.sh --build OUTDIR where traind's" \
            "libraries are installed" >&2
        exit 2
    fi
    unpack_bundle
else
    source_build || exit 1
fi
for d in "$CUBLAS_DIR" "$NCCL_DIR" /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -n "$d" ] && [ -d "$d" ] && LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
export LD_LIBRARY_PATH BIN DATA
export TRAIND=$BIN/traind TRAINCTL=$BIN/trainctl BENCH_GPU=$BIN/bench_gpu
write_env
grep "^loaded: " "$LOGS/env.txt" | sed 's/^/    /' | tee -a "$SUMMARY"

run_stage preflight 40
[ "$(cat "$WORK/ngpu" 2>/dev/null || echo 0)" -gt 0 ] || line "    (no GPU present: the GPU stages are skipped)"
for s in $STAGES_ALL; do
    case $s in
    unit) run_stage unit 90 ;;
    daemon-cpu) run_stage daemon-cpu 90 ;;
    gpu) run_stage gpu 180 ;;
    profile) run_stage profile 120 ;;
    daemon) run_stage daemon 100 ;;
    sensorlm) run_stage sensorlm 120 ;;
    bench) run_stage bench 120 ;;
    esac
done
line "total: $(($(date +%s) - START)) s; $([ $STATUS -eq 0 ] && echo "no stage failed" || echo "a stage FAILED")"
echo "summary and logs in $OUT (summary.txt, logs.tgz)"
exit $STATUS
