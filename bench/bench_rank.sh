#!/usr/bin/env bash
# bench_rank.sh: a GPT step of the fortunes example over two processes (mpirun -np 2, one
# device each, joined by MPI's ordered reduce: kernels/mpireduce.c) against the same job in one
# process on cpu:2 (the host reduce), in one run, on this machine: tokens/s of each, their ratio,
# and the all-reduce's share of a step (allreduce_ms / step_ms, the trainer's own timings, both
# medians over the timed steps). The two fake nodes of one host talk over loopback TCP, so the
# figure is an upper bound of the protocol's cost, not a network's (README, "Running on a
# cluster", puts figures on paper for real links). Figures only.
#   usage: bench/bench_rank.sh [BUILD_DIR] [STEPS]   (default build, 30)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
steps=${2:-30}
traind="$build/daemon/traind"
command -v mpirun >/dev/null 2>&1 || { echo "bench_rank: no mpirun (openmpi-bin): skipped"; exit 0; }
if [[ "$("$traind" rank --spec /nonexistent 2>&1 || true)" == *"built without MPI"* ]]; then
    echo "bench_rank: this traind was built without MPI: skipped"
    exit 0
fi
work=$(mktemp -d /tmp/bench_rank.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

here=$(cd "$(dirname "$0")" && pwd)
python3 - "$here/../examples/fortunes-gpt.json" "$work/job.json" "$steps" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
j.update({"max_steps": int(sys.argv[3]), "eval_every": 0, "checkpoint_every": 0,
          "nodes": 2, "devices_per_node": 1, "min_nodes": 1})
j.pop("eval_batches", None)
json.dump(j, open(sys.argv[2], "w"))
EOF

# The median of key over the steps after the first 5 (warm-up), from a run's store.
median() {
    sqlite3 "$1/traind.db" "select m.value from metrics m join metric_keys k on k.id = m.key
        where k.name = '$2' and m.step > 5 order by m.value" |
        awk '{v[NR] = $1} END {if (NR == 0) print "nan"; else print v[int((NR + 1) / 2)]}'
}

"$traind" rank --spec "$work/job.json" --state "$work/one" --devices cpu:2 2>"$work/one.err" ||
    { cat "$work/one.err" >&2; exit 1; }
mpirun --bind-to none -np 2 "$traind" rank --spec "$work/job.json" --state "$work/two" \
    --devices cpu:1 2>"$work/two.err" || { tail -5 "$work/two.err" >&2; exit 1; }

cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
echo "bench_rank: GPT fortunes example (4 layers, 256 wide, T 256, batch 8), $steps steps, on $(nproc) cores of $cpu"
for run in one two; do
    tps=$(median "$work/$run" tokens_per_s)
    step=$(median "$work/$run" step_ms)
    ar=$(median "$work/$run" allreduce_ms)
    label=$([ "$run" = one ] && echo "1 process, cpu:2 (host reduce)  " ||
        echo "2 processes x cpu:1 (mpirun)    ")
    awk -v l="$label" -v t="$tps" -v s="$step" -v a="$ar" 'BEGIN {
        share = (a == "nan" || s == 0) ? "n/a" : sprintf("%.1f%%", 100 * a / s)
        printf "  %s %9.0f tokens/s  %7.1f ms/step  all-reduce %s of the step\n", l, t, s, share }'
    eval "tps_$run=$tps"
done
awk -v a="$tps_two" -v b="$tps_one" 'BEGIN { printf "  ratio 2 processes / 1 process: %.2f\n", a / b }'
