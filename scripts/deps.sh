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
  python3-prometheus-client  # tests/test_ops.c parses traind's Prometheus file with its parser
                             # (promtool, in the 96 MB prometheus package, also lints it when
                             # installed; not needed)
  python3-msgpack    # the Python client (python/traind), and its test
  python3-pandas     # the Python client's metrics as a DataFrame (optional for users; tested)
  python3-pip python3-venv  # tests: `pip install ./python` offline into a fresh venv
  clang-format       # make test's formatting check (scripts/check-format.sh, .clang-format)
  clang libclang-rt-14-dev  # libFuzzer and its sanitizers: make test's fuzz stage, make fuzz
  llvm               # llvm-symbolizer: file and line in a fuzzer's crash report
  libopenblas-dev    # sgemm
  zlib1g-dev         # gzipped IDX datasets
  libjansson-dev     # trainctl: job files, --json
  libinih-dev        # traind: its configuration file
  scdoc              # the man pages (built when scdoc is found)
  libcairo2-dev      # trainctl plot: PNG and SVG charts
  libmicrohttpd-dev  # trainctl dashboard: its HTTP server
  libjs-dygraphs     # trainctl dashboard: the page's charts (served from /usr/share/javascript)
  chromium           # tests: the dashboard loaded in headless Chromium (tests/test_dashboard.c)
  fonts-dejavu-core  # the text in Chromium's screenshot of the dashboard (doc/dashboard.png)
  zsh fish           # tests: trainctl's zsh and fish completion scripts, loaded and asked
  dataset-fashion-mnist  # the demo's data
  fortunes           # English text for language-model jobs
  openmpi-bin        # multi-node jobs: mpirun, and the MPI runtime under srun --mpi=pmix
  libopenmpi-dev     # multi-node jobs: MPI to build traind rank against; mpicc for tests/cluster
  munge              # the test cluster (tests/cluster/): its own munged, on its own key
  slurmctld          # the test cluster: its controller
  slurmd             # the test cluster: its two nodes, with mpi/pmix (slurm-wlm-basic-plugins)
  slurm-client       # the test cluster, and multi-node jobs: srun, sinfo, scancel
)
# Installing munge starts the system's munged (/run/munge, /etc/munge/munge.key); slurmctld and
# slurmd stay down while /etc/slurm/slurm.conf is missing. Neither is stopped or used here: the
# test cluster runs its own daemons on their own key, sockets and free ports, beside them.

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
