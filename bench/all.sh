#!/usr/bin/env bash
# all.sh: every benchmark of bench/ with short lengths (about five minutes on a 2-core
# machine), each under a heading naming the command, then the figures the issues set goals
# for, side by side. `make bench` runs it. PyTorch's reference (pytorch_ref.py) runs next to
# the C benches when some python3 here can import torch, and is skipped with a note otherwise.
# Figures only: nothing here passes or fails on a number.
#   usage: bench/all.sh [BUILD_DIR]   (default build)
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d /tmp/bench_all.XXXXXX)
trap 'rm -rf "$out"' EXIT

# Runs a command under a heading, keeping its output in $out/NAME for the summary.
run() {
  local name=$1
  shift
  printf '\n== %s ==\n' "$*"
  "$@" 2>&1 | tee "$out/$name"
}

py=
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c 'import torch' 2>/dev/null; then
    py=$p
    break
  fi
done

# PyTorch runs three ways: with its default settings, as issue 3 states its figures; with
# OMP_WAIT_POLICY=passive (Debian's torch runs its own OpenMP threads and OpenBLAS's pthreads
# side by side, and OpenMP's spinning threads take the cores from OpenBLAS's on a 2-core
# machine; passive waiting removes most of that); and passive with the OpenBLAS kernels
# traind computes with. Both load the same OpenBLAS, which on a CPU newer than itself can pick
# its SSE3 kernels; traind then has it choose again (kernels/cpu.c, "OpenBLAS's kernels for
# this CPU") and says so, and PyTorch gets the same kernels through OPENBLAS_CORETYPE: that
# last run is PyTorch at its best here, the opponent the goals are stated against.
torch_ref() {
  local name=$1
  shift
  run "$name" "$py" "$here/pytorch_ref.py" "$@"
  run "${name}_passive" env OMP_WAIT_POLICY=passive "$py" "$here/pytorch_ref.py" "$@"
  torch_best "${name}_best" "$@"
}
torch_best() {
  local name=$1
  shift
  run "$name" env OMP_WAIT_POLICY=passive ${coretype:+OPENBLAS_CORETYPE=$coretype} \
    "$py" "$here/pytorch_ref.py" "$@"
}

# traind and PyTorch both on every core (threads = cores), in the same run.
cores=$(nproc)
run gpt "$build/bench/bench_gpt" 20 --threads "$cores"
# The kernel set traind's OpenBLAS computes with ("...; OpenBLAS SkylakeX (it chose Prescott ...")
# when traind had it choose again; empty when OpenBLAS's own choice stood.
coretype=$(grep -m1 -oE 'OpenBLAS [A-Za-z0-9]+ \(it chose' "$out/gpt" | cut -d' ' -f2 || true)
[ -z "$py" ] || torch_ref torch_gpt --gpt-steps 5 --mlp-steps 0 --threads "$cores"
run mlp "$build/bench/bench_mlp" 500
[ -z "$py" ] || torch_ref torch_mlp --gpt-steps 0 --mlp-steps 300
[ -n "$py" ] ||
  printf '\n== PyTorch reference: skipped (no python3 here imports torch; Debian: python3-torch) ==\n'
# sensorlm (issue 13): the tiny and small presets on a day of minutes (T 1440, C 10, 10x2
# patches: 720 tokens), PyTorch's same model at its best settings after each.
run slm_tiny "$build/bench/bench_sensorlm" --size tiny --threads "$cores"
[ -z "$py" ] || torch_best torch_slm_tiny --gpt-steps 0 --mlp-steps 0 --slm tiny --threads "$cores"
run slm_small "$build/bench/bench_sensorlm" --size small --threads "$cores"
[ -z "$py" ] || torch_best torch_slm_small --gpt-steps 0 --mlp-steps 0 --slm small --threads "$cores"
run gpt_metrics "$build/bench/bench_gpt" --metrics 24 --block 3
run gpt_world "$build/bench/bench_gpt" --world 2 16 --block 4
run rank "$here/bench_rank.sh" "$build" 20
run metrics "$build/bench/bench_metrics" 300000 4 3
run csv "$here/metrics_csv.sh" "$build" 100000 5

# The first number after a label on the line that has it.
num() {
  awk -v label="$2" '(i = index($0, label)) && !found {
      s = substr($0, i + length(label))
      if (match(s, /[-+]?[0-9.]+/)) { print substr(s, RSTART, RLENGTH); found = 1 }
    } END { if (!found) print "?" }' "$out/$1"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "?" }'; }

printf '\n== summary: the goals of issues 3, 4, 5 and 13, from the runs above ==\n'
# The number before UNIT on the first line of FILE that has one.
before() { grep -m1 -oE "[0-9]+ $2" "$out/$1" | grep -oE '^[0-9]+' || echo "?"; }
# The number (with its decimals) before UNIT on the first line of FILE that has one.
dbefore() { grep -m1 -oE "[0-9]+(\.[0-9]+)? $2" "$out/$1" | grep -oE '^[0-9.]+' || echo "?"; }
# ", PyTorch N: Rx; passive N: Rx; best N: Rx" for traind's figure $1 against the runs named $2.
against() {
  [ -n "$py" ] || return 0
  local t p b
  t=$(before "$2" "$3")
  p=$(before "$2_passive" "$3")
  b=$(before "$2_best" "$3")
  echo ", PyTorch $t: $(ratio "$1" "$t")x; passive $p: $(ratio "$1" "$p")x; at its best (passive, OPENBLAS_CORETYPE=${coretype:-its own}) $b: $(ratio "$1" "$b")x"
}
# The cores the run in FILE had ("N of M cores busy"), or "?".
busy() { grep -m1 -oE '[0-9.]+ of [0-9]+ cores busy' "$out/$1" 2>/dev/null | cut -d' ' -f1 || echo "?"; }
# traind's samples/s of sensorlm SIZE against PyTorch's at its best.
slm_line() {
  local t b
  t=$(dbefore "slm_$1" 'samples/s')
  printf 'sensorlm %s samples/s (goal >= 1.5x PyTorch at its best): traind %s' "$1" "$t"
  if [ -n "$py" ]; then
    b=$(dbefore "torch_slm_$1" 'samples/s')
    printf ', PyTorch (passive, OPENBLAS_CORETYPE=%s) %s: %sx' "${coretype:-its own}" "$b" "$(ratio "$t" "$b")"
  fi
  printf '; achieved / sgemm %s; cores busy: traind %s, PyTorch %s\n' \
    "$(num "slm_$1" 'achieved / sgemm')" "$(busy "slm_$1")" "$(busy "torch_slm_$1")"
}
gpt_tok=$(before gpt 'tokens/s')
echo "GPT tokens/s (goal >= 1.5x PyTorch at its best): traind $gpt_tok$(against "$gpt_tok" torch_gpt 'tokens/s'); cores busy: traind $(busy gpt), PyTorch at its best $(busy torch_gpt_best)"
slm_line tiny
slm_line small
echo "GPT achieved / sgemm GFLOP/s: $(num gpt 'achieved / sgemm:') (goal >= 0.5)"
mlp_s=$(before mlp 'samples/s')
echo "MLP samples/s (goal >= 2x PyTorch at its best): traind $mlp_s$(against "$mlp_s" torch_mlp 'samples/s')"
echo "metric pipeline / raw SQLite insert: $(num metrics "pipeline / raw (SQLite's defaults):") wall (goal >= 0.80)"
echo "GPT step, metrics on - off: $(num gpt_metrics 'on - off:')% (goal within 2%); at most $(
  grep -oE 'at most [0-9.]+%' "$out/gpt_metrics" | grep -oE '[0-9.]+%' || echo "?") counting the pipeline's own work"
echo "trainctl metrics --csv / sqlite3: $(num csv 'ratio trainctl/sqlite3:') (goal <= 2)"
echo "GPT cpu:2 / cpu:1 tokens/s: $(num gpt_world 'cpu:2 / cpu:1 tokens/s:'); all-reduce $(
  num gpt_world 'all-reduce') ms/step, $(num gpt_world 'ms/step (')% of the cpu:2 step"
echo "GPT 2 processes (mpirun) / 1 process, cpu:2 tokens/s: $(num rank 'ratio 2 processes / 1 process:')"
# A run that had fewer cores than the machine has shared them with other work, and its figures
# say as much about that work as about traind's.
echo "cores busy (of $(nproc)): GPT $(grep -m1 -oE '[0-9.]+ of [0-9]+ cores busy' "$out/gpt" |
  cut -d' ' -f1), metrics off/on $(grep -oE '[0-9.]+ of [0-9]+ cores busy' "$out/gpt_metrics" |
  cut -d' ' -f1 | paste -sd/), cpu:1/cpu:2 $(grep -oE '[0-9.]+ of [0-9]+ cores busy' \
  "$out/gpt_world" | cut -d' ' -f1 | paste -sd/)"
