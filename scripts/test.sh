#!/usr/bin/env bash
# `make test`: every check the README promises, each stage going on past a failed one so that
# one run reports everything:
#   1. the formatting check (scripts/check-format.sh), seconds;
#   2. the plain build (CUDA where nvcc is found, -Dwerror=true unless MESON_OPTS says
#      otherwise) and all its suites: unit, fuzz, integration, gpu (skipped without a GPU);
#   3. unit, fuzz and integration again on an ASan+UBSan build (tests/asan.sh);
#   4. integration again on a ThreadSanitizer build (tests/tsan.sh), its lines marked [tsan];
#   5. every libFuzzer target for 12 s on a clang ASan+UBSan build (tests/fuzz/fuzz.sh), about
#      a minute.
# Stage 4 is by far the longest (a training step costs 14 times what it does without TSan;
# 18 minutes of tests on 2 cores at a load of 4 to 5), and much of it keeps only one core
# busy, so it runs beside stages 1 to 3 and 5 rather than after them (which take longer
# still, together: README, "What make test runs"). TD_TEST_SERIAL=1 runs it after them.
# A long stage prints a line a minute naming the test program under way. Then, whatever
# failed, the closing line "tests: N passed, N failed, N skipped" (followed by the stages that
# failed, if any), then a line per failed stage naming the test programs that failed in it, and
# a non-zero exit when anything failed.
#   usage: scripts/test.sh [BUILD_DIR]   (default build; the sanitizer trees are BUILD_DIR-asan
#          and BUILD_DIR-tsan)   MESON_OPTS="..." configures a new BUILD_DIR (-Dwerror=true)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
build=${build%/}
read -r -a meson_opts <<<"${MESON_OPTS:--Dwerror=true}"
HEARTBEAT_S=60 # seconds between "still running" lines
failed=()
t0=$SECONDS

# The test programs of build tree $1 running now, by name, comma-separated.
running_tests()
{
    local abs
    [ -n "$1" ] || return 0
    abs=$(cd "$1" 2>/dev/null && pwd) || return 0
    ps -eo args= | awk -v p="$abs/tests/" 'index($1, p) == 1 { print substr($1, length(p) + 1) }' |
        sort -u | paste -sd, -
}

# Every HEARTBEAT_S, a line saying stage $1 (build tree $2) is still running since $3.
heartbeat()
{
    local now
    while sleep "$HEARTBEAT_S" </dev/null >/dev/null 2>&1; do
        now=$(running_tests "$2")
        echo "    ... $1: still running after $(((SECONDS - $3) / 60)) min${now:+ ($now)}"
    done
}

# Runs "$@" as the stage named $1 on build tree $2; returns its status.
stage()
{
    local name=$1 dir=$2 start=$SECONDS rc hb
    shift 2
    echo "==> $name"
    heartbeat "$name" "$dir" "$start" &
    hb=$!
    "$@"
    rc=$?
    kill "$hb" 2>/dev/null
    wait "$hb" 2>/dev/null
    if [ "$rc" -eq 0 ]; then
        echo "==> $name: ok ($((SECONDS - start)) s)"
    else
        echo "==> $name: FAILED ($((SECONDS - start)) s)"
    fi
    return "$rc"
}

plain_build()
{
    if [ ! -f "$build/build.ninja" ]; then
        echo "configuring $build: meson setup ${meson_opts[*]}"
        if ! out=$(meson setup "$build" "${meson_opts[@]}" 2>&1); then
            echo "$out"
            return 1
        fi
    fi
    scripts/ninja-progress.sh "$build"
}

tsan_name="ThreadSanitizer: integration ($build-tsan)"
tsan_stage()
{
    stage "$tsan_name" "$build-tsan" tests/tsan.sh "$build-tsan" 2>&1 | sed -u 's/^/[tsan] /'
}

# A results file left by an earlier run must not be counted if this run's build fails.
for d in "$build" "$build-asan" "$build-tsan" "$build-fuzz"; do
    rm -f "$d/meson-logs/testlog.json"
done

tsan_pid=
if [ "${TD_TEST_SERIAL:-0}" != 1 ]; then
    tsan_stage &
    tsan_pid=$!
fi
stage "format check" "" scripts/check-format.sh || failed+=("format check")
if stage "plain build ($build)" "$build" plain_build; then
    stage "plain suites ($build)" "$build" meson test -C "$build" --print-errorlogs --no-rebuild ||
        failed+=("plain suites")
else
    failed+=("plain build")
fi
asan_name="ASan+UBSan: unit, fuzz, integration ($build-asan)"
stage "$asan_name" "$build-asan" tests/asan.sh "$build-asan" || failed+=("ASan+UBSan")
stage "libFuzzer: every target ($build-fuzz)" "$build-fuzz" tests/fuzz/fuzz.sh "$build-fuzz" ||
    failed+=("libFuzzer")
if [ -n "$tsan_pid" ]; then
    echo "==> waiting for the ThreadSanitizer stage"
    wait "$tsan_pid" || failed+=("ThreadSanitizer")
else
    tsan_stage || failed+=("ThreadSanitizer")
fi

echo "==> all stages: $(((SECONDS - t0) / 60)) min $(((SECONDS - t0) % 60)) s"
args=()
for f in "${failed[@]}"; do
    args+=(--failed-stage "$f")
done
scripts/test-summary.py --build "plain suites" "$build" --build "ASan+UBSan" "$build-asan" \
    --build "ThreadSanitizer" "$build-tsan" --build "libFuzzer" "$build-fuzz" "${args[@]}"
