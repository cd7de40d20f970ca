#!/usr/bin/env bash
# The integration suite against a thread-sanitizer build of traind (issue 5): every test
# starts the TSan daemon, and a data race makes it exit 66, which fails the test that stopped
# it. OpenBLAS's own threads are not instrumented; traind's are. A report that a library's
# own way of working makes false is suppressed in tests/tsan.supp, with its reason. Every
# report lands in BUILD_DIR/meson-logs/sanitizer/ (a daemon's stderr is its log in a temporary
# directory), is printed at the end, and fails the run even when no test saw the exit status 66.
#   usage: tests/tsan.sh [BUILD_DIR]   (default build-tsan)
#   TD_TSAN_TIMEOUT_MULTIPLIER=N scales every test's timeout by N instead of 10.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-tsan}
# Measured on 2 cores: a training step takes about 14 times as long as on the plain build
# (TSan checks every load and store of the C kernels' loops); tests that mostly wait take
# 1 to 5 times as long.
multiplier=${TD_TSAN_TIMEOUT_MULTIPLIER:-10}

if [ ! -f "$dir/build.ninja" ]; then
    echo "tsan: configuring the ThreadSanitizer tree ($dir, without CUDA)"
    if ! out=$(meson setup "$dir" -Db_sanitize=thread -Dcuda=disabled -Dwerror=true 2>&1); then
        echo "$out"
        exit 1
    fi
fi
echo "tsan: building the ThreadSanitizer tree ($dir)"
scripts/ninja-progress.sh "$dir"

# The reports are written where every user can write (test_service's children drop to
# another user, test_jobfiles runs trainctl as nobody): a sticky 1777 folder in /tmp, not under
# the checkout, which another user may not be able to enter (a clone under /root or in a
# mktemp -d folder). At the end they are moved to BUILD_DIR/meson-logs/sanitizer.
kept=$(cd "$dir" && pwd)/meson-logs/sanitizer
rm -rf "$kept"
mkdir -p "$kept"
reports=$(mktemp -d "${TMPDIR:-/tmp}/traind-tsan-reports.XXXXXX")
chmod 1777 "$reports"
# The suppressions too, for the same reason: a process that cannot read them stops at start.
supp=$(mktemp -d "${TMPDIR:-/tmp}/traind-tsan-supp.XXXXXX")
cp tests/tsan.supp "$supp/"
chmod 755 "$supp" && chmod 644 "$supp/tsan.supp"
# tests/tsan.supp holds the reports a library makes false, each with its reason.
export TSAN_OPTIONS="exitcode=66 halt_on_error=0 second_deadlock_stack=1 log_path=$reports/tsan \
suppressions=$supp/tsan.supp"
# Open MPI's memory patcher rewrites the entry points of mmap, munmap and their kin in the
# running process, which the sanitizer intercepts too; a thread that calls one while it is
# being rewritten can jump to a hook not yet set (a `traind rank` under srun died at start of
# "SEGV on unknown address 0x0, pc 0x0" once in a fresh make test). The patcher serves RDMA
# registration caches, which TCP (all these tests use) does not have; Open MPI's advice for
# sanitizer runs is to leave it out. The launchers pass the variable on to every rank.
export OMPI_MCA_memory=^patcher

echo "tsan: integration suite (timeouts x$multiplier)"
rc=0
meson test -C "$dir" --suite integration --print-errorlogs --no-rebuild \
    --timeout-multiplier "$multiplier" || rc=$?

shopt -s nullglob
for f in "$reports"/*; do mv "$f" "$kept/"; done
rmdir "$reports"
rm -rf "$supp"
found=("$kept"/*)
if [ ${#found[@]} -gt 0 ]; then
    echo "tsan: ${#found[@]} sanitizer report(s) in $kept:"
    for f in "${found[@]}"; do
        echo "---- $f"
        cat "$f"
    done
    [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
