#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time (make test, through meson test) or as long as
# asked (make fuzz), from its seed corpus in the tree.
#   usage: tests/fuzz/run.sh NAME FUZZER SOURCE_DIR [SECONDS]
# SECONDS defaults to $TD_FUZZ_SECONDS, else 12. New inputs that reach new code go to
# BUILD/fuzz-corpus/NAME (kept between runs; the seed corpus in the tree is only read), a
# crashing input to BUILD/fuzz-crashes/NAME/, where BUILD is the fuzzer's directory's tree.
# Exits 0 when the run found nothing, else 1 (libFuzzer's 77 for a crash would read as a
# skipped test to meson), after naming the saved input and how to replay it.
set -uo pipefail
name=$1
fuzzer=$(realpath "$2")
src=$(realpath "$3")
seconds=${4:-${TD_FUZZ_SECONDS:-12}}
build=$(dirname "$(dirname "$(dirname "$fuzzer")")") # BUILD/tests/fuzz/fuzz_NAME
corpus=$build/fuzz-corpus/$name
crashes=$build/fuzz-crashes/$name
mkdir -p "$corpus" "$crashes"

# The targets whose readers take paths write their inputs under here; removed however the run
# ends.
base=/tmp
[ -d /dev/shm ] && [ -w /dev/shm ] && base=/dev/shm
TD_FUZZ_TMP=$(mktemp -d "$base/traind-fuzz-run.XXXXXX") || exit 1
export TD_FUZZ_TMP
trap 'rm -rf "$TD_FUZZ_TMP"' EXIT

# Limits: an input may take 10 s and the process 2 GiB; one allocation over 256 MiB is
# reported as a bug (a size taken from the input and not checked), as is any leak.
opts=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256
      -artifact_prefix="$crashes/" -print_final_stats=1)
[ -f "$src/$name.dict" ] && opts+=(-dict="$src/$name.dict")
[ -f "$src/$name.options" ] && read -r -a extra <"$src/$name.options" && opts+=("${extra[@]}")
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

echo "fuzz $name: ${seconds} s, corpus $corpus + $src/corpus/$name"
stamp=$TD_FUZZ_TMP/start
touch "$stamp"
"$fuzzer" "${opts[@]}" "$corpus" "$src/corpus/$name" 2>&1
rc=$?
[ "$rc" -eq 0 ] && exit 0
echo "fuzz $name: FAILED (libFuzzer exit $rc)"
find "$crashes" -type f -newer "$stamp" | while read -r f; do
    echo "fuzz $name: the input is saved in $f"
    echo "fuzz $name: replay it with: $fuzzer $f"
done
exit 1
