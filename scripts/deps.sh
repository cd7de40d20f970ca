#!/usr/bin/env bash
# Installs what traind needs to build, test and run its demo, from Debian's archive, and
# nothing that is already there. Safe to run again. Needs root (or sudo) only when something
# is missing.
set -euo pipefail

packages=(
  meson ninja-build pkg-config gcc
  libuv1-dev         # the daemon's event loop
  libmsgpack-dev     # the wire format
  libsqlite3-dev sqlite3  # the store; the sqlite3 shell for users and benchmarks
  libcmocka-dev      # tests
  libopenblas-dev    # sgemm
  zlib1g-dev         # gzipped IDX datasets
  libjansson-dev     # trainctl: job files, --json
  libinih-dev        # traind: its configuration file
  scdoc              # the man pages (built when scdoc is found)
  libcairo2-dev      # trainctl plot: PNG and SVG charts
  dataset-fashion-mnist  # the demo's data
  fortunes           # English text for language-model jobs
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "deps: need root to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
