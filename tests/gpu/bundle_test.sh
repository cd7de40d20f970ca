#!/usr/bin/env bash
# The GPU bundle, proved on this CPU machine (issue 18), as the meson test gpu_bundle:
#   1. scripts/gpu-pack.sh packs the build tree's binaries into BUILD/gpu-bundle-test;
#   2. the manifest covers every library ldd lists for every bundled binary, except the
#      allow-list (glibc, the driver's libcuda, cuBLAS, NCCL), and every file in it has the
#      size and sha256 the manifest says, and a licence; a manifest with one library taken out
#      is caught, so the check cannot pass on nothing;
#   3. the bundle alone runs: env -i PATH=/usr/bin:/bin .../check.sh OUT starts, runs every
#      stage that needs no GPU (unit, daemon-cpu: traind on cpu:1), says the GPU stages are
#      skipped because no GPU is present (not failed), and leaves only summary.txt and logs.tgz;
#   4. the same run again in a mount namespace (unshare --mount) where the build dependencies
#      are gone: /usr/include is an empty tmpfs, the compilers, meson, ninja and nvcc are
#      unusable, and every system copy of a library the bundle carries is covered by an empty
#      file, so that a library loaded from anywhere but the bundle fails to load; env.txt must
#      then show each carried library resolved inside the bundle. Skipped (with the reason)
#      where this process may not unshare.
# Exits 77 when the build has no CUDA (no nvcc here): there is nothing to pack.
#   usage: tests/gpu/bundle_test.sh BUILD_DIR CUDA(0|1)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "$1" && pwd)
if [ "${2:-0}" != 1 ]; then
    echo "this build has no CUDA backend (nvcc not found): no bundle to test"
    exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/td_bundle_test_XXXXXX")
chmod 755 "$T"
trap 'rm -rf "$T"' EXIT
DIR=$BUILD/gpu-bundle-test
fails=0

ok() { echo "ok: $*"; }
bad() {
    echo "FAILED: $*"
    fails=$((fails + 1))
}

# ---- 1. pack
if ! TD_PACK_BUILD=$BUILD "$ROOT/scripts/gpu-pack.sh" "$DIR" >"$T/pack.log" 2>&1; then
    cat "$T/pack.log"
    echo "FAILED: scripts/gpu-pack.sh"
    exit 1
fi
cat "$T/pack.log"
mkdir -p "$T/payload"
tar -xzf "$DIR/payload.tar.gz" -C "$T/payload" || { echo "FAILED: the payload does not unpack"; exit 1; }

# ---- 2. the manifest
ALLOW='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|librt\.so\.1|libpthread\.so\.0|libresolv\.so\.2|libutil\.so\.1|libcuda\.so\.1|libcublas\.so\.13|libcublasLt\.so\.13|libnccl\.so\.2)$'

# build_bin NAME: the build tree's executable a bundled binary was stripped from.
build_bin() { find "$BUILD" -maxdepth 3 -type f -name "$1" -perm -u+x | head -1; }

# uncovered MANIFEST: each soname a bundled binary's build counterpart loads that MANIFEST
# neither carries (lib/SONAME) nor leaves to the machine under the allow-list; one a line.
uncovered() {
    local man=$1 b so
    for b in "$T"/payload/bin/*; do
        b=$(basename "$b")
        src=$(build_bin "$b")
        [ -n "$src" ] || { echo "no build binary for $b"; continue; }
        ldd "$src" | awk '/=>/ { print $1; next } { n = split($1, p, "/"); print p[n] }' |
            while read -r so; do
                [[ "$so" =~ $ALLOW ]] && continue
                grep -q "^lib/$so " "$man" || echo "$b needs $so"
            done
    done
}

miss=$(uncovered "$DIR/MANIFEST")
[ -z "$miss" ] && ok "the manifest covers every library of every bundled binary" ||
    bad "not in the manifest: $miss"
n=$(grep -c '^lib/' "$DIR/MANIFEST")
[ "$n" -ge 10 ] && ok "$n libraries carried" || bad "only $n libraries in the manifest"
# The allow-list is what the machine supplies, nothing more: a "system" line names none else.
other=$(awk '$1 == "system" { print $2 }' "$DIR/MANIFEST" | grep -Ev "$ALLOW")
[ -z "$other" ] && ok "the libraries left to the GPU machine are glibc's, libcuda, cuBLAS, NCCL" ||
    bad "left to the machine but not allowed: $other"
# Every file of the payload is in the manifest with its size and sum, and only those.
nfiles=$(cd "$T/payload" && find . -type f | wc -l)
nman=$(grep -Evc '^(#|system )' "$DIR/MANIFEST")
[ "$nfiles" -eq "$nman" ] && ok "$nfiles files, each in the manifest" ||
    bad "$nfiles files in the payload, $nman in the manifest"
while read -r f size sum _; do
    case $f in '#'* | system) continue ;; esac
    [ -f "$T/payload/$f" ] || { bad "$f in the manifest, not in the payload"; continue; }
    [ "$(stat -c %s "$T/payload/$f")" = "$size" ] || bad "$f: size differs from the manifest"
    [ "$(sha256sum "$T/payload/$f" | cut -c1-64)" = "$sum" ] || bad "$f: sha256 differs"
done <"$DIR/MANIFEST"
nlic=$(ls "$T/payload/share/licenses" | wc -l)
[ "$nlic" -ge 5 ] && ok "$nlic licence files" || bad "only $nlic licence files"
# The check itself must catch a library that slipped out.
victim=$(grep -m1 '^lib/libuv' "$DIR/MANIFEST" | cut -d' ' -f1)
grep -v "^$victim " "$DIR/MANIFEST" >"$T/MANIFEST.cut"
cut_miss=$(uncovered "$T/MANIFEST.cut")
[[ "$cut_miss" == *"needs ${victim#lib/}"* ]] &&
    ok "a manifest without ${victim#lib/} is caught" || bad "a manifest without ${victim#lib/} passes"

# ---- 3. the bundle alone, from a clean environment
# check_run OUT LOG: the summary and the files a bundle-only CPU run must leave.
check_run() {
    local out=$1 rc=$2 s
    [ "$rc" -eq 0 ] && ok "check.sh exit 0" || bad "check.sh exit $rc"
    [ -f "$out/summary.txt" ] && [ -f "$out/logs.tgz" ] && ok "summary.txt and logs.tgz" ||
        bad "no summary.txt or logs.tgz in $out"
    [ "$(ls "$out" | wc -l)" -eq 2 ] && ok "nothing else in OUTDIR" || bad "OUTDIR holds: $(ls "$out")"
    for s in preflight unit daemon-cpu; do
        grep -q "^$s: ok" "$out/summary.txt" && ok "$s: ok" || bad "$s did not pass"
    done
    for s in gpu profile daemon sensorlm bench; do
        grep -q "^$s: skipped (no GPU present)" "$out/summary.txt" && ok "$s skipped, no GPU" ||
            bad "$s not skipped for want of a GPU"
    done
    grep -q "FAILED" "$out/summary.txt" && bad "a FAILED line in the summary"
    cat "$out/summary.txt"
}

env -i PATH=/usr/bin:/bin TMPDIR="$T" TD_GPU_UNPACK="$T/unpack1" "$DIR/check.sh" "$T/out1" \
    >"$T/run1.log" 2>&1
check_run "$T/out1" $?

# ---- 4. the same without the build dependencies
if [ "$(id -u)" -ne 0 ] || ! unshare --mount --propagation private true 2>/dev/null; then
    echo "the run without the build dependencies needs root and unshare --mount: not run"
else
    # Every system file a carried library resolves to here, and the tools a build needs.
    hide=()
    for b in "$T"/payload/bin/*; do
        src=$(build_bin "$(basename "$b")")
        while read -r so path; do
            [ -f "$T/payload/lib/$so" ] && hide+=("$(readlink -f "$path")")
        done < <(ldd "$src" | awk '/=>/ { print $1, $3 }')
    done
    for tool in cc gcc gcc-12 c99 clang meson ninja pkg-config pkgconf; do
        p=$(command -v "$tool" 2>/dev/null) && hide+=("$(readlink -f "$p")")
    done
    printf '%s\n' "${hide[@]}" | sort -u >"$T/hide.txt"
    : >"$T/empty"
    cat >"$T/hidden.sh" <<EOF
set -e
mount -t tmpfs none /usr/include
[ -d /usr/local/cuda/bin ] && mount -t tmpfs none /usr/local/cuda/bin
while read -r f; do mount --bind "$T/empty" "\$f"; done <"$T/hide.txt"
# proof that the build is impossible and the system copies are gone
if echo 'int main(void){return 0;}' | cc -x c - -o "$T/a.out" 2>/dev/null; then
    echo "a compiler still works in the namespace"; exit 3
fi
[ -z "\$(ls /usr/include)" ] || { echo "/usr/include still has files"; exit 3; }
if "$BUILD/daemon/traind" --version >/dev/null 2>&1; then
    echo "the build's own traind still finds its libraries outside the bundle"; exit 3
fi
set +e
env -i PATH=/usr/bin:/bin TMPDIR="$T" TD_GPU_UNPACK="$T/unpack2" "$DIR/check.sh" "$T/out2"
EOF
    unshare --mount --propagation private bash "$T/hidden.sh" >"$T/run2.log" 2>&1
    rc=$?
    if [ "$rc" -eq 3 ]; then
        bad "the namespace did not hide the build: $(tail -1 "$T/run2.log")"
    else
        echo "hidden in the namespace: $(wc -l <"$T/hide.txt") files, /usr/include, /usr/local/cuda/bin"
        check_run "$T/out2" "$rc"
        mkdir -p "$T/logs2"
        tar -xzf "$T/out2/logs.tgz" -C "$T/logs2"
        # every carried library resolved inside the bundle, nothing "not found"
        nf=$(grep "not found" "$T/logs2/logs/env.txt" | grep -v "libcuda.so.1")
        [ -z "$nf" ] && ok "every library found (libcuda aside: no driver here)" ||
            bad "a library not found: $nf"
        outside=$(awk '/=>/ { print $1, $3 }' "$T/logs2/logs/env.txt" | while read -r so path; do
            [ -f "$T/payload/lib/$so" ] && [ "${path#"$T/unpack2/"}" = "$path" ] && echo "$so from $path"
        done | sort -u)
        [ -z "$outside" ] && ok "every carried library loaded from the bundle" ||
            bad "loaded from outside the bundle: $outside"
    fi
fi

[ "$fails" -eq 0 ] || { echo "$fails checks FAILED"; exit 1; }
echo "every check passed"
