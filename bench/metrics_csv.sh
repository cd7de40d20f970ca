#!/usr/bin/env bash
# metrics_csv.sh: `trainctl metrics JOB --csv` for ROWS rows next to the sqlite3 shell printing
# the same rows as CSV, in the same run. Figures only.
#   usage: bench/metrics_csv.sh [BUILD_DIR] [ROWS]   (defaults build, 100000)
set -euo pipefail
build=${1:-build}
rows=${2:-100000}
dir=$(mktemp -d /tmp/metrics_csv.XXXXXX)
trap 'kill $pid 2>/dev/null || true; rm -rf "$dir"' EXIT

# A store with one job of $rows metric rows (4 keys per step, as an MLP job records them).
"$build/daemon/traind" --socket "$dir/s" --state-dir "$dir" 2>/dev/null & pid=$!
for _ in $(seq 100); do [ -S "$dir/s" ] && break; sleep 0.05; done
kill $pid; wait $pid || true
sqlite3 "$dir/traind.db" <<SQL
INSERT INTO jobs(id, name, state, devices, created) VALUES (1, 'bench', 'succeeded', 1, 0);
INSERT INTO metric_keys(name) VALUES ('train_loss'), ('lr'), ('step_ms'), ('samples_per_s');
WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < $rows)
INSERT INTO metrics(job, key, step, value, time)
  SELECT 1, n % 4 + 1, n / 4 + 1, n * 0.001, 1700000000 + n * 0.01 FROM i;
SQL

"$build/daemon/traind" --socket "$dir/s" --state-dir "$dir" 2>/dev/null & pid=$!
for _ in $(seq 100); do [ -S "$dir/s" ] && break; sleep 0.05; done

t() { local s e; s=$(date +%s.%N); "$@" >/dev/null; e=$(date +%s.%N); awk "BEGIN{print $e - $s}"; }
tc=$(t "$build/client/trainctl" --socket "$dir/s" metrics 1 --csv)
sq=$(t sqlite3 -csv -header "$dir/traind.db" \
  "SELECT m.job, k.name AS key, m.step, m.value, m.time FROM metrics m
   JOIN metric_keys k ON k.id = m.key WHERE m.job = 1 ORDER BY m.step, m.key")
n=$("$build/client/trainctl" --socket "$dir/s" metrics 1 --csv | wc -l)
echo "rows: $((n - 1))"
echo "trainctl metrics --csv: ${tc} s"
echo "sqlite3 -csv:           ${sq} s"
echo "ratio trainctl/sqlite3: $(awk "BEGIN{printf \"%.2f\", $tc / $sq}")"
