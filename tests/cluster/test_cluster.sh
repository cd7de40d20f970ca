#!/usr/bin/env bash
# The two-node test cluster (tests/cluster/cluster.sh) works, as the meson test cluster:
#   1. it starts in a fresh directory, its watchdog owned by this script;
#   2. srun -N 2 runs one task on each node: n1 and n2 both answer;
#   3. srun --mpi=pmix -N 2 runs an MPI program (compiled here with mpicc) whose ranks
#      all-reduce their rank over both nodes: size 2, sum 1; and with two tasks a node, size 4,
#      sum 6 (shared memory between the two "nodes" of one host would hang or crash here);
#   4. mpirun -np 2 runs the same program without Slurm, from a hostfile of this host;
#   5. stop leaves no process of it: none of the PIDs it recorded, nothing whose command line
#      names its directories, and no run directory.
# Safe beside another copy of itself (its own ports, sockets and key): make test runs it on the
# plain, ASan and TSan trees at once. Keeps the cluster's directory (its logs) when it fails.
# Exits 77 when not root, or when Slurm, munge or Open MPI is not installed.
#   usage: tests/cluster/test_cluster.sh [BUILD_DIR]   (the cluster goes under it; else TMPDIR)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER=$HERE/cluster.sh
BASE=${1:-${TMPDIR:-/tmp}}
STEP_S=30 # seconds any one srun or mpirun may take (each takes under a second here)
fails=0

ok() { echo "ok: $*"; }
bad() {
    echo "FAILED: $*"
    fails=$((fails + 1))
}

# The settings of a Slurm job this may run inside are not for the test cluster.
for v in $(compgen -e); do
    case "$v" in SLURM_*) unset "$v" ;; esac
done

if [ "$(id -u)" -ne 0 ]; then
    echo "skipped: needs root (the test cluster's slurmd runs job steps as their user)"
    exit 77
fi
for p in mpicc mpirun srun; do
    if ! command -v "$p" >/dev/null 2>&1; then
        echo "skipped: $p not installed (scripts/deps.sh installs it)"
        exit 77
    fi
done

mkdir -p "$BASE/tests/cluster"
D=$(mktemp -d "$BASE/tests/cluster/test.XXXXXX")
RUN=""

# Stops the cluster whatever happened; keeps its directory only when something failed.
finish()
{
    local rc=$?
    trap - EXIT
    "$CLUSTER" stop "$D" || rc=1
    if { [ "$rc" -eq 0 ] || [ "$rc" -eq 77 ]; } && [ "$fails" -eq 0 ]; then
        rm -rf "$D"
    else
        echo "the cluster's logs: $D/log"
    fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

# ---- 1. start, its first try on a port that is taken (held here), as when another cluster
# starting at the same moment took it: start must try again on other ports.
python3 -c 'import socket, sys, time
s = socket.socket()
s.bind(("", 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(float(sys.argv[1]))' 120 >"$D/held_port" &
holder=$!
until [ -s "$D/held_port" ]; do
    kill -0 "$holder" 2>/dev/null || break
    sleep 0.02
done
held=$(cat "$D/held_port")
rc=0
TD_CLUSTER_PORTS="0 0 $held" "$CLUSTER" start "$D" "$$" >"$D/start.out" 2>&1 || rc=$?
kill "$holder"
cat "$D/start.out"
[ "$rc" -eq 0 ] || exit "$rc" # 77 when something it needs is missing
if grep -F "slurmd-n2 found its port taken" "$D/start.out" >/dev/null; then
    ok "start tried again on other ports when n2's port ($held) was taken"
else
    bad "start did not report n2's taken port $held"
fi
# shellcheck source=/dev/null # written by cluster.sh start
. "$D/env"
RUN=$(readlink "$D/run")
pids=$(awk '{ print $2 }' "$D/pids" | tr '\n' ' ')
ok "started: $(tr '\n' ' ' <"$D/pids")"

# ---- 2. one task on each node
# shellcheck disable=SC2016 # expanded by the task
out=$(timeout "$STEP_S" srun -N 2 --ntasks-per-node=1 sh -c 'echo "$SLURMD_NODENAME"' 2>&1 |
    sort | tr '\n' ' ') || true
if [ "$out" = "n1 n2 " ]; then
    ok "srun -N 2: both nodes answer ($out)"
else
    bad "srun -N 2 --ntasks-per-node=1: expected \"n1 n2\", got: $out"
fi

# ---- 3. MPI over srun --mpi=pmix
cat >"$D/mpi_sum.c" <<'EOF'
/* Each rank all-reduces its rank: rank R of N prints "rank R size N sum S NODE". */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    int rank, size, sum;
    const char *node = getenv("SLURMD_NODENAME");

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    printf("rank %d size %d sum %d %s\n", rank, size, sum, node ? node : "-");
    MPI_Finalize();
    return 0;
}
EOF
mpicc -o "$D/mpi_sum" "$D/mpi_sum.c"

# Checks that output $2 of command $1 is N ranks ($3) that all got the sum 0+1+..+N-1, the
# lines ($4, sorted) naming the nodes they ran on.
check_mpi()
{
    local what=$1 out=$2 n=$3 want=$4 got
    got=$(echo "$out" | awk -v n="$n" -v sum=$(($3 * ($3 - 1) / 2)) '
        $1 == "rank" && $4 == n && $6 == sum { print $1, $2, $7 }' | sort | tr '\n' ',')
    if [ "$got" = "$want" ]; then
        ok "$what: size $n, sum $(($3 * ($3 - 1) / 2)) on every rank"
    else
        bad "$what: expected $want, got: $out"
    fi
}

if ! timeout "$STEP_S" srun --mpi=list 2>&1 | awk '$1 == "pmix" { f = 1 } END { exit !f }'; then
    bad "srun has no mpi/pmix plugin: $(srun --mpi=list 2>&1 | tr '\n' ' ')"
fi
# Runs an MPI step into $out; once more when Open MPI itself crashed while its ranks opened
# their TCP connections (4.1's "failed to TCP connect ... Operation now in progress" and a
# segfault, seen on this box under the load of two test runs at once): its fault, not the
# cluster's, and said so.
mpi_step() {
    out=$(timeout "$STEP_S" "$@" 2>&1) || true
    case $out in
    *"failed to TCP connect"* | *"Process received signal"*)
        echo "note: Open MPI crashed setting up its TCP connections; once more: $(printf '%s' "$out" |
            head -n 3 | tr '\n' ' ')"
        out=$(timeout "$STEP_S" "$@" 2>&1) || true
        ;;
    esac
}
mpi_step srun --mpi=pmix -N 2 --ntasks-per-node=1 "$D/mpi_sum"
check_mpi "srun --mpi=pmix -N 2 --ntasks-per-node=1" "$out" 2 "rank 0 n1,rank 1 n2,"
mpi_step srun --mpi=pmix -N 2 --ntasks-per-node=2 "$D/mpi_sum"
check_mpi "srun --mpi=pmix -N 2 --ntasks-per-node=2" "$out" 4 \
    "rank 0 n1,rank 1 n1,rank 2 n2,rank 3 n2,"

# ---- 4. MPI over mpirun, without Slurm
echo "localhost slots=2" >"$D/hostfile"
mpi_step mpirun --hostfile "$D/hostfile" -np 2 "$D/mpi_sum"
check_mpi "mpirun -np 2" "$out" 2 "rank 0 -,rank 1 -,"

# ---- 5. stop, and nothing left
t0=$(date +%s%N)
"$CLUSTER" stop "$D"
ok "stopped in $((($(date +%s%N) - t0) / 1000000)) ms"
left=""
for p in $pids; do
    if [ -r "/proc/$p/stat" ]; then
        stat=$(cat "/proc/$p/stat" 2>/dev/null) || continue
        stat=${stat##*) }
        [ "${stat%% *}" = Z ] || left="$left $p"
    fi
done
# By command line (the daemons, the watchdog, a task of the program in D), and by an open file
# under either directory (a slurmstepd, whose command line is "slurmstepd: [JOB.STEP]").
for p in $(pgrep -f -- "$D" || true) $(pgrep -f -- "$RUN" || true) $(
    find /proc/[0-9]*/fd -maxdepth 1 \( -lname "$D/*" -o -lname "$RUN/*" \) 2>/dev/null |
        cut -d/ -f3 | sort -u
); do
    [ "$p" = "$$" ] || left="$left $p"
done
if [ -z "$left" ] && [ ! -e "$RUN" ] && [ ! -e "$D/env" ]; then
    ok "nothing of the cluster is left"
else
    bad "left after stop:${left:- none}; run directory $RUN: $(ls -d "$RUN" 2>&1)"
    ps -o pid,ppid,sid,args -p "$(echo "$left" | tr -s ' ' ',' | sed 's/^,//; s/,$//')" || true
fi

[ "$fails" -eq 0 ] || exit 1
