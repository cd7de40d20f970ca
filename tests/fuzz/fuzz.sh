#!/usr/bin/env bash
# The libFuzzer targets (tests/fuzz/README.md): builds their tree, a clang build with
# -Dfuzz=true under ASan+UBSan, then runs them.
#   usage: tests/fuzz/fuzz.sh [BUILD_DIR [SECONDS [TARGET...]]]   (default build-fuzz)
# Without SECONDS (make test): every target for TD_FUZZ_SECONDS (12 by default) seconds, as
# the tests of suite `libfuzzer`, side by side (meson test), so that they count in the closing
# line; about a minute on 2 cores. With SECONDS (make fuzz): the targets named (all by default)
# one after another, SECONDS each. Either way a target that fails names the input it saved and
# how to replay it, and the run exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-build-fuzz}
dir=${dir%/}

if ! command -v clang >/dev/null; then
    echo "fuzz: clang is missing (scripts/deps.sh installs clang and libclang-rt-14-dev)" >&2
    exit 1
fi
if [ ! -f "$dir/build.ninja" ]; then
    echo "fuzz: configuring the libFuzzer tree ($dir, clang, ASan+UBSan)"
    if ! out=$(CC=clang meson setup "$dir" -Dfuzz=true -Db_sanitize=address,undefined \
                   -Db_lundef=false -Dcuda=disabled -Dwerror=true 2>&1); then
        echo "$out"
        exit 1
    fi
fi
echo "fuzz: building the libFuzzer tree ($dir)"
scripts/ninja-progress.sh "$dir"

if [ $# -lt 2 ]; then
    echo "fuzz: every target for ${TD_FUZZ_SECONDS:-12} s"
    exec meson test -C "$dir" --suite libfuzzer --print-errorlogs --no-rebuild
fi
seconds=$2
shift 2
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    for f in tests/fuzz/fuzz_*.c; do
        f=${f#tests/fuzz/fuzz_}
        targets+=("${f%.c}")
    done
fi
rc=0
for t in "${targets[@]}"; do
    if [ ! -x "$dir/tests/fuzz/fuzz_$t" ]; then
        echo "fuzz: no target $t (tests/fuzz/fuzz_$t.c)" >&2
        rc=1
        continue
    fi
    tests/fuzz/run.sh "$t" "$dir/tests/fuzz/fuzz_$t" tests/fuzz "$seconds" || rc=1
done
exit "$rc"
