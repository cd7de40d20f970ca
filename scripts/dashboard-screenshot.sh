#!/usr/bin/env bash
# Regenerates doc/dashboard.png, the README's picture of `trainctl dashboard`: builds
# BUILD_DIR (default build) and runs the browser test's live case (tests/test_dashboard.c: a
# real traind training Fashion-MNIST, the dashboard, headless Chromium), which writes its
# screenshot where $TD_DASHBOARD_SCREENSHOT points. Every run of the test writes a fresh one
# into its build tree (BUILD_DIR/dashboard.png); this one replaces the committed picture.
#   usage: scripts/dashboard-screenshot.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
scripts/deps.sh
[ -f "$build/build.ninja" ] || meson setup "$build" -Dwerror=true
ninja -C "$build"
# TD_DASHBOARD_SETTLE_S: seconds the job trains on the page before the picture.
TD_DASHBOARD_SCREENSHOT="$PWD/doc/dashboard.png" TD_TEST_FILTER=test_dashboard_live \
    TD_DASHBOARD_SETTLE_S=${TD_DASHBOARD_SETTLE_S:-45} \
    meson test -C "$build" test_dashboard --no-rebuild --print-errorlogs
echo "dashboard-screenshot: wrote doc/dashboard.png"
