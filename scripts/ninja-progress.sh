#!/usr/bin/env bash
# Builds one meson tree with ninja, printing a progress line every STEP_EVERY steps (and the
# last) instead of ninja's hundred-odd, but every warning and error as ninja prints it: a long
# build is never silent, and never buries what went wrong. Exits with ninja's status.
#   usage: scripts/ninja-progress.sh BUILD_DIR
set -euo pipefail
dir=$1
STEP_EVERY=10 # ninja steps between progress lines

ninja -C "$dir" | awk -v every="$STEP_EVERY" '
    /^\[[0-9]+\/[0-9]+\] / {
        split(substr($1, 2, length($1) - 2), n, "/")
        if (n[1] % every == 0 || n[1] == n[2]) { print "  " $0; fflush() }
        next
    }
    { print; fflush() }'
