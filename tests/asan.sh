#!/usr/bin/env bash
# The unit, fuzz and integration suites against an AddressSanitizer + UndefinedBehaviorSanitizer
# build (issue 11): out-of-bounds and use-after-free accesses, leaks at exit, and undefined
# behaviour (overflowing signed arithmetic, misaligned or null accesses, bad shifts), in the
# test programs and in every traind and trainctl they start, which inherit these settings.
# UBSan halts at its first report, so undefined behaviour fails the test like a crash does.
# Leaks that are a library's own are suppressed in tests/lsan.supp, each with its reason.
# Every report also lands in BUILD_DIR/meson-logs/sanitizer/ (a daemon's stderr is its log in a
# temporary directory), is printed at the end, and fails the run even when a test did not look
# at the exit status of the process that reported it.
#   usage: tests/asan.sh [BUILD_DIR]   (default build-asan)
#   TD_ASAN_TIMEOUT_MULTIPLIER=N scales every test's timeout by N instead of 4.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-asan}
# Measured on 2 cores: the suites take 2 to 4 times as long as on the plain build.
multiplier=${TD_ASAN_TIMEOUT_MULTIPLIER:-4}

if [ ! -f "$dir/build.ninja" ]; then
    echo "asan: configuring the ASan+UBSan tree ($dir, without CUDA)"
    # CUDA is left out: its code runs only on a GPU, and the plain build compiles it.
    if ! out=$(meson setup "$dir" -Db_sanitize=address,undefined -Dcuda=disabled \
                   -Dwerror=true 2>&1); then
        echo "$out"
        exit 1
    fi
fi
echo "asan: building the ASan+UBSan tree ($dir)"
scripts/ninja-progress.sh "$dir"

# The reports are written where every user can write (test_service's children drop to
# another user, test_jobfiles runs trainctl as nobody): a sticky 1777 folder in /tmp, not under
# the checkout, which another user may not be able to enter (a clone under /root or in a
# mktemp -d folder). At the end they are moved to BUILD_DIR/meson-logs/sanitizer.
kept=$(cd "$dir" && pwd)/meson-logs/sanitizer
rm -rf "$kept"
mkdir -p "$kept"
reports=$(mktemp -d "${TMPDIR:-/tmp}/traind-asan-reports.XXXXXX")
chmod 1777 "$reports"
# The suppressions too, for the same reason: a process that cannot read them stops at start.
supp=$(mktemp -d "${TMPDIR:-/tmp}/traind-asan-supp.XXXXXX")
cp tests/lsan.supp "$supp/"
chmod 755 "$supp" && chmod 644 "$supp/lsan.supp"
export ASAN_OPTIONS="log_path=$reports/asan:detect_leaks=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan"
# Open MPI's memory patcher rewrites mmap's and munmap's entry points, which ASan intercepts;
# the two conflict (Open MPI's issue 13069), and TCP, which these tests use, needs no patcher
# (tests/tsan.sh says more). The launchers pass the variable on to every rank.
export OMPI_MCA_memory=^patcher

echo "asan: unit, fuzz and integration suites (timeouts x$multiplier)"
rc=0
meson test -C "$dir" --suite unit --suite fuzz --suite integration --print-errorlogs \
    --no-rebuild --timeout-multiplier "$multiplier" || rc=$?

shopt -s nullglob
for f in "$reports"/*; do mv "$f" "$kept/"; done
rmdir "$reports"
rm -rf "$supp"
found=("$kept"/*)
if [ ${#found[@]} -gt 0 ]; then
    echo "asan: ${#found[@]} sanitizer report(s) in $kept:"
    for f in "${found[@]}"; do
        echo "---- $f"
        cat "$f"
    done
    [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
