#!/usr/bin/env bash
# Packs the GPU check for a GPU machine that has CUDA's driver, cuBLAS and NCCL (often only as
# Python wheels) and none of traind's other libraries, no compiler and no package archive
# (issue 18; DESIGN.md, "The GPU machine"). Run here, on the CPU machine, where nvcc links:
#
#   scripts/gpu-pack.sh [DIR]        (default .gpu under the repository root, git-ignored)
#
# It builds, with CUDA (SASS for sm_80 and sm_90 plus sm_90's PTX, cudart linked statically:
# kernels/meson.build, -Dcudart=static), every binary the check runs, into TD_PACK_BUILD
# (default build-gpu; an existing CUDA build tree may be named instead, as make test does), then
# writes into DIR:
#   check.sh        tests/gpu/check.sh, which runs the bundle's stages there (needs bash, tar,
#                   gzip, coreutils; no compiler, no meson)
#   payload.tar.gz  bin/ (the binaries), lib/ (every shared library they load that is not
#                   glibc's, the driver's libcuda, cuBLAS's or NCCL's, as ldd resolves them
#                   here), share/licenses/ (each library's Debian copyright file), data/ (the
#                   text the daemon stages train on); check.sh unpacks it once, outside DIR
#   payload.sha256  the payload's sum, which check.sh verifies first
#   MANIFEST        one line a file of the payload: path, size in bytes, sha256, and which
#                   binaries need it; then one "system" line a library left to the GPU
#                   machine, with the binaries that need it
# and prints the bundle's size, and the size of what travels (the repository's tracked files
# and the bundle), which must stay well under the 64 MiB a device call carries.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/.gpu}
case $DIR in /*) ;; *) DIR=$PWD/$DIR ;; esac
cd "$ROOT"
BUILD=${TD_PACK_BUILD:-build-gpu}
BINS=(tests/test_gpu tests/test_kernels tests/test_memest tests/test_device bench/bench_gpu
      daemon/traind client/trainctl)
# The libraries the GPU machine supplies: glibc's own, the driver's, cuBLAS's and NCCL's. Every
# other library a binary loads travels in the bundle (tests/gpu/manifest.sh checks it).
SYSTEM_RE='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|librt\.so\.1|libpthread\.so\.0|libresolv\.so\.2|libutil\.so\.1|libcuda\.so\.1|libcublas\.so\.13|libcublasLt\.so\.13|libnccl\.so\.2)$'

die() {
    echo "gpu-pack: $*" >&2
    exit 1
}

"$ROOT/scripts/deps.sh"
command -v /usr/local/cuda/bin/nvcc >/dev/null 2>&1 || command -v nvcc >/dev/null 2>&1 ||
    die "no nvcc: the bundle is built where the CUDA toolkit is (/usr/local/cuda)"

# 1. the build
if [ ! -f "$BUILD/build.ninja" ]; then
    meson setup "$BUILD" -Dcuda=enabled -Dcudart=static -Dwerror=true >"$BUILD.setup.log" 2>&1 ||
        { cat "$BUILD.setup.log" >&2; die "meson setup $BUILD failed"; }
    rm -f "$BUILD.setup.log"
fi
ninja -C "$BUILD" "${BINS[@]}" >/dev/null || die "building ${BINS[*]} in $BUILD failed"
# (ldd's output is read whole first: under pipefail, a grep -q that stops reading early would
# make ldd's SIGPIPE the pipeline's status.)
for b in "${BINS[@]}"; do
    if [[ "$(ldd "$BUILD/$b")" == *libcudart.so* ]]; then
        die "$BUILD/$b loads libcudart.so: configure $BUILD with -Dcudart=static"
    fi
done
for b in tests/test_gpu daemon/traind bench/bench_gpu; do
    [[ "$(ldd "$BUILD/$b")" == *libcublas.so* ]] ||
        die "$BUILD/$b has no CUDA backend: configure $BUILD with -Dcuda=enabled"
done

# 2. the payload, staged
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/td_gpu_pack_XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/share/licenses" "$STAGE/data"
declare -A NEED=()   # soname -> the binaries that need it
declare -A SYSNEED=() # a library left to the GPU machine -> the binaries that need it
for b in "${BINS[@]}"; do
    name=$(basename "$b")
    # Symbols stay (a backtrace there names functions); debug sections go, a third of the size.
    objcopy --strip-debug "$BUILD/$b" "$STAGE/bin/$name"
    while read -r so path; do
        if [[ "$so" =~ $SYSTEM_RE ]]; then
            SYSNEED[$so]="${SYSNEED[$so]:+${SYSNEED[$so]},}$name"
            continue
        fi
        [ "$path" = "not" ] && die "$b: ldd finds no $so here"
        NEED[$so]="${NEED[$so]:+${NEED[$so]},}$name"
        if [ ! -e "$STAGE/lib/$so" ]; then
            cp -L "$path" "$STAGE/lib/$so"
            pkg=$(dpkg -S "$(readlink -f "$path")" 2>/dev/null | head -1 | cut -d: -f1) || pkg=""
            if [ -z "$pkg" ]; then
                pkg=$(dpkg -S "$path" 2>/dev/null | head -1 | cut -d: -f1) || pkg=""
            fi
            if [ -n "$pkg" ] && [ -f "/usr/share/doc/$pkg/copyright" ]; then
                cp "/usr/share/doc/$pkg/copyright" "$STAGE/share/licenses/$pkg.copyright"
            else
                die "no copyright file for $so ($path): cannot carry it without its licence"
            fi
        fi
    done < <(ldd "$BUILD/$b" | awk '/=>/ { print $1, $3; next } { n = split($1, p, "/"); print p[n], "-" }')
done
# The text the daemon stages train on: the project's own sources and prose, as the check's
# source mode reads them.
cat "$ROOT"/*/*.c "$ROOT"/*/*.h "$ROOT"/*.md >"$STAGE/data/text.txt"

# 3. the manifest and the archive
mkdir -p "$DIR"
rm -f "$DIR/payload.tar.gz" "$DIR/payload.sha256" "$DIR/MANIFEST" "$DIR/check.sh"
{
    echo "# traind GPU bundle: $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown), $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "# path size sha256 needed-by"
    (cd "$STAGE" && find . -type f | sed 's|^\./||' | LC_ALL=C sort) | while read -r f; do
        size=$(stat -c %s "$STAGE/$f")
        sum=$(sha256sum "$STAGE/$f" | cut -c1-64)
        case $f in
        lib/*) by=${NEED[${f#lib/}]} ;;
        bin/*) by=- ;;
        *) by=check.sh ;;
        esac
        echo "$f $size $sum $by"
    done
    for so in $(printf '%s\n' "${!SYSNEED[@]}" | LC_ALL=C sort); do
        echo "system $so - ${SYSNEED[$so]}"
    done
} >"$DIR/MANIFEST"
tar -czf "$DIR/payload.tar.gz" -C "$STAGE" .
sha256sum "$DIR/payload.tar.gz" | cut -c1-64 >"$DIR/payload.sha256"
cp "$ROOT/tests/gpu/check.sh" "$DIR/check.sh"
chmod 755 "$DIR/check.sh"

bundle=$(du -sb "$DIR" | cut -f1)
unpacked=$(du -sb "$STAGE" | cut -f1)
repo=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{ s += $1 } END { print s + 0 }')
echo "gpu-pack: $DIR: $((bundle / 1024)) KiB ($((unpacked / 1024)) KiB unpacked:" \
    "$(ls "$STAGE/bin" | wc -l) binaries, $(ls "$STAGE/lib" | wc -l) libraries)"
echo "gpu-pack: what travels: $(((bundle + repo) / 1024)) KiB with the repository's" \
    "$((repo / 1024)) KiB, of 65536"
[ $((bundle + repo)) -lt $((48 << 20)) ] || die "the bundle and the repository pass 48 MiB"
echo "gpu-pack: run there: .gpu/check.sh \$OUT (device run with carry [\".gpu\"])"
