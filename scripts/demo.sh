#!/usr/bin/env bash
# make demo: starts traind in a temporary state directory, submits the default job, watches
# it live until it ends, then stops the daemon and says where the metrics are.
set -euo pipefail
build=${1:-build}
job=${DEMO_JOB:-examples/fashion-mnist-mlp.json}
state=$(mktemp -d /tmp/traind-demo.XXXXXX)
sock=$state/traind.sock

"$build/daemon/traind" --socket "$sock" --state-dir "$state" --devices cpu:1 \
  --log-level notice 2>"$state/traind.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done

export TRAIND_SOCKET=$sock
id=$("$build/client/trainctl" submit "$job")
echo "submitted $job as job $id; watching it (Ctrl-C stops watching, not the job)"
rc=0
"$build/client/trainctl" watch "$id" || rc=$?
"$build/client/trainctl" status "$id"
echo
echo "metrics: $state/traind.db   (sqlite3 $state/traind.db 'select * from metrics limit 5')"
echo "daemon log: $state/traind.log"
exit $rc
