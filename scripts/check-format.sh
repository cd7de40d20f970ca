#!/usr/bin/env bash
# The formatting check of `make test` (STYLE.md habit 15): every C, header and CUDA file git
# knows must be exactly what clang-format makes of it under the committed .clang-format. Fails
# naming each file that is not; `clang-format -i FILE` formats one.
#   usage: scripts/check-format.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v clang-format >/dev/null; then
    echo "check-format: clang-format is missing (scripts/deps.sh installs it)" >&2
    exit 1
fi

# Tracked files and new ones not yet added; a file deleted in the working tree is skipped.
# Outside a git checkout (an unpacked tarball) every such file but the build trees'.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files --cached --others --exclude-standard -- '*.c' '*.h' '*.cu' |
                         sort -u)
else
    mapfile -t files < <(find . -path './build*' -prune -o -path './.*' -prune -o \
                              -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) -print |
                         sed 's|^\./||' | sort)
fi
bad=()
for f in "${files[@]}"; do
    [ -f "$f" ] || continue
    clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done

if [ ${#bad[@]} -gt 0 ]; then
    echo "check-format: ${#bad[@]} of ${#files[@]} files differ from what clang-format makes:" >&2
    printf '  %s\n' "${bad[@]}" >&2
    echo "check-format: fix with: clang-format -i ${bad[*]}" >&2
    exit 1
fi
echo "check-format: ${#files[@]} files formatted as .clang-format says"
