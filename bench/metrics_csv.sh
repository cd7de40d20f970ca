#!/usr/bin/env bash
# metrics_csv.sh: `trainctl metrics JOB --csv` for ROWS rows (issue 4: goal at most 2x the
# sqlite3 shell) next to the sqlite3 shell printing the same rows as CSV, in the same run.
# A store with one job of ROWS metric rows (4 keys per step, as an MLP job records them) is
# served by a real traind; each command runs once untimed (the page cache), then ROUNDS times
# each, in turn, and the median of each is printed with their ratio. Figures only.
#   usage: bench/metrics_csv.sh [BUILD_DIR] [ROWS] [ROUNDS]   (defaults build, 100000, 5)
set -euo pipefail
build=${1:-build}
rows=${2:-100000}
rounds=${3:-5}
dir=$(mktemp -d /tmp/metrics_csv.XXXXXX)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$dir"' EXIT

start_daemon() {
  "$build/daemon/traind" --socket "$dir/s" --state-dir "$dir" 2>/dev/null &
  pid=$!
  for _ in $(seq 100); do [ -S "$dir/s" ] && return; sleep 0.05; done
  echo "metrics_csv.sh: traind did not start" >&2
  exit 1
}

# The daemon creates the schema; the rows go in with it stopped.
start_daemon
kill $pid; wait $pid || true
sqlite3 "$dir/traind.db" <<SQL
INSERT INTO jobs(id, name, state, devices, created) VALUES (1, 'bench', 'succeeded', 1, 0);
INSERT INTO metric_keys(name) VALUES ('train_loss'), ('lr'), ('step_ms'), ('samples_per_s');
WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < $rows)
INSERT INTO metrics(job, key, step, value, time)
  SELECT 1, n % 4 + 1, n / 4 + 1, n * 0.001, 1700000000 + n * 0.01 FROM i;
SQL
start_daemon

trainctl_csv() { "$build/client/trainctl" --socket "$dir/s" metrics 1 --csv; }
sqlite3_csv() {
  sqlite3 -csv -header "$dir/traind.db" \
    "SELECT m.job, k.name AS key, m.step, m.value, m.time FROM metrics m
     JOIN metric_keys k ON k.id = m.key WHERE m.job = 1 ORDER BY m.step, m.key"
}
# Seconds one run of "$@" takes, its output thrown away.
t() { local s e; s=$(date +%s.%N); "$@" >/dev/null; e=$(date +%s.%N); awk "BEGIN{print $e - $s}"; }
median() { sort -g | awk '{v[NR] = $1} END {print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

n_tc=$(trainctl_csv | wc -l)
n_sq=$(sqlite3_csv | wc -l)
tc=()
sq=()
for _ in $(seq "$rounds"); do
  tc+=("$(t trainctl_csv)")
  sq+=("$(t sqlite3_csv)")
done
tcm=$(printf '%s\n' "${tc[@]}" | median)
sqm=$(printf '%s\n' "${sq[@]}" | median)
echo "rows: trainctl $((n_tc - 1)), sqlite3 $((n_sq - 1)) (a header line each); median of $rounds runs"
echo "trainctl metrics --csv: ${tcm} s   (runs: ${tc[*]})"
echo "sqlite3 -csv:           ${sqm} s   (runs: ${sq[*]})"
echo "ratio trainctl/sqlite3: $(awk "BEGIN{printf \"%.2f\", $tcm / $sqm}") (goal <= 2)"
