#!/usr/bin/env bash
# The integration suite against a thread-sanitizer build of traind (issue 5): every test
# starts the TSan daemon, and a data race makes it exit 66, which fails the test that stopped
# it. OpenBLAS's own threads are not instrumented; traind's are.
#   usage: tests/tsan.sh [BUILD_DIR]   (default build-tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-tsan}
[ -f "$dir/build.ninja" ] || meson setup "$dir" -Db_sanitize=thread -Dcuda=disabled -Dwerror=true >/dev/null
ninja -C "$dir" >/dev/null
export TSAN_OPTIONS="exitcode=66 halt_on_error=0 second_deadlock_stack=1"
meson test -C "$dir" --suite integration --print-errorlogs --no-rebuild
