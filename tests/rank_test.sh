#!/usr/bin/env bash
# `traind rank` under mpirun and srun on this box (issue 20): a job over processes computes
# what one process computes, bit for bit, whatever the layout and the launcher; a panic on one
# node is reported naming the node and device; a cancel stops every process at one step with a
# checkpoint; a resume on fewer processes from that checkpoint ends with the rows and weights
# of a run never stopped; the NCCL id reaches every process. Skips (77) when this build has no
# MPI or mpirun is missing; srun's part is skipped when tests/cluster cannot start here.
#   usage: tests/rank_test.sh BUILD_DIR
set -euo pipefail

build=$(cd "$1" && pwd)
traind="$build/daemon/traind"
command -v mpirun >/dev/null 2>&1 || { echo "skip: no mpirun (openmpi-bin)"; exit 77; }
probe=$("$traind" rank --spec /nonexistent 2>&1 || true)
if [[ "$probe" == *"built without MPI"* ]]; then
    echo "skip: this traind was built without MPI"
    exit 77
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/traind-rank.XXXXXX")
launched=()
cluster_up=0
cleanup() {
    for pid in "${launched[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    if [ "$cluster_up" = 1 ]; then
        "$(dirname "$0")/cluster/cluster.sh" stop "$work/cluster" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 143' TERM # so that cleanup runs when meson times the test out

# Two fake nodes on one host: TCP between them (shared memory between the processes of two
# "nodes" is what a real cluster would not have), and root allowed (tests run as root here).
export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
MPIRUN=(mpirun --bind-to none)

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# The job: a small MLP on Fashion-MNIST, 4 replicas' worth of batch, a checkpoint every 8
# steps; JOB_STEPS and JOB_EXTRA vary it.
job() {
    python3 - "$1" "$2" "${3:-}" <<'EOF'
import json, sys
out, steps, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3]
d = "/usr/share/datasets/fashion-mnist/"
j = {
    "name": "rank-test",
    "model": {"kind": "mlp", "layers": [784, 32, 10]},
    "data": {"kind": "idx", "shuffle": True,
             "train": {"images": d + "train-images-idx3-ubyte.gz",
                       "labels": d + "train-labels-idx1-ubyte.gz"},
             "test": {"images": d + "t10k-images-idx3-ubyte.gz",
                      "labels": d + "t10k-labels-idx1-ubyte.gz"}},
    "optim": {"kind": "adamw", "lr": 1e-3},
    "batch_size": 64, "max_steps": steps, "eval_every": 8, "eval_batches": 2,
    "checkpoint_every": 8, "seed": 7, "nodes": 2, "devices_per_node": 2, "min_nodes": 1,
}
if extra:
    j.update(json.loads(extra))
json.dump(j, open(out, "w"))
EOF
}

# The rows a run stored that do not depend on time: key, step, value to the last bit.
rows() {
    sqlite3 "$1/traind.db" "select k.name || ' ' || m.step || ' ' || printf('%.17g', m.value)
        from metrics m join metric_keys k on k.id = m.key
        where k.name not like '%ms%' and k.name not like '%per_s%' and k.name not like 'mfu'
        order by k.name, m.step"
}

[ -r /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] ||
    { echo "skip: no Fashion-MNIST (dataset-fashion-mnist)"; exit 77; }
command -v sqlite3 >/dev/null || { echo "skip: no sqlite3"; exit 77; }

# 1. The same bits on every layout: one process of cpu:4 (the daemon's own host reduce), 2
#    processes of cpu:2 and 4 of cpu:1 (MPI's ordered reduce).
job "$work/job.json" 24
"$traind" rank --spec "$work/job.json" --state "$work/p1" --devices cpu:4 2>"$work/p1.err" ||
    fail "1 x cpu:4: $(cat "$work/p1.err")"
"${MPIRUN[@]}" -np 2 "$traind" rank --spec "$work/job.json" --state "$work/p2" --devices cpu:2 \
    2>"$work/p2.err" || fail "2 x cpu:2: $(tail -5 "$work/p2.err")"
"${MPIRUN[@]}" -np 4 "$traind" rank --spec "$work/job.json" --state "$work/p4" --devices cpu:1 \
    2>"$work/p4.err" || fail "4 x cpu:1: $(tail -5 "$work/p4.err")"
rows "$work/p1" >"$work/p1.rows"
[ "$(grep -c '^train_loss ' "$work/p1.rows")" -eq 24 ] || fail "1 x cpu:4 stored no 24 losses"
for l in p2 p4; do
    rows "$work/$l" >"$work/$l.rows"
    cmp -s "$work/p1.rows" "$work/$l.rows" ||
        fail "$l: metric rows differ from cpu:4's: $(diff "$work/p1.rows" "$work/$l.rows" | head -4)"
    cmp -s "$work/p1/checkpoints/job-1/ckpt-24.bin" "$work/$l/checkpoints/job-1/ckpt-24.bin" ||
        fail "$l: the weights (checkpoint of step 24) differ from cpu:4's"
done
echo "ok: 1 x cpu:4, 2 x cpu:2 and 4 x cpu:1 store the same rows and weights, bit for bit"

# 2. A panic injected on node 1's device 0 at step 5: every process stops, exit 1, and the
#    report names the device and the node (node names: the host's, "#rank" where shared).
job "$work/fail.json" 24 '{"debug": {"fail": {"step": 5, "node": 1, "device": 0, "kind": "panic"}}}'
start=$(date +%s)
set +e
"${MPIRUN[@]}" -np 2 "$traind" rank --spec "$work/fail.json" --state "$work/f" --devices cpu:2 \
    2>"$work/f.err"
rc=$?
set -e
[ "$rc" -eq 1 ] || fail "a panic on node 1: exit $rc, not 1: $(tail -5 "$work/f.err")"
msg=$(sqlite3 "$work/f/traind.db" "select state || ': ' || err_msg from jobs")
[[ "$msg" =~ ^failed:\ training\ worker\ on\ device\ 0\ of\ node\ [^\ ]+#1\ failed:\ .*step\ 5 ]] ||
    fail "a panic on node 1 was stored as: $msg"
echo "ok: a panic on node 1 fails the job in $(($(date +%s) - start)) s: $msg"

# 3. Cancel: the job holds after step 3 (debug.hold) until it is cancelled; SIGUSR1 to mpirun
#    (which forwards it) stops every process at that step with a checkpoint; exit 2.
job "$work/long.json" 40 '{"debug": {"hold": {"step": 3}}}'
"${MPIRUN[@]}" -np 2 "$traind" rank --spec "$work/long.json" --state "$work/c" --devices cpu:2 \
    --checkpoint-dir "$work/shared" 2>"$work/c.err" &
mpirun_pid=$!
launched+=("$mpirun_pid")
deadline=$(($(date +%s) + 60))
until [ -f "$work/c/traind.db" ] &&
    [ "$(sqlite3 "$work/c/traind.db" "select coalesce(max(step), 0) from metrics" 2>/dev/null ||
        echo 0)" -ge 3 ]; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "the held job stored no step 3 within 60 s"
    kill -0 "$mpirun_pid" 2>/dev/null || fail "the held job ended early: $(tail -5 "$work/c.err")"
    sleep 0.1
done
kill -USR1 "$mpirun_pid"
set +e
wait "$mpirun_pid"
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "cancel: exit $rc, not 2: $(tail -5 "$work/c.err")"
state=$(sqlite3 "$work/c/traind.db" "select state || ': ' || err_msg from jobs")
[[ "$state" == "cancelled: cancelled at step "* ]] || fail "cancel stored: $state"
stopped=${state#cancelled: cancelled at step }
stopped=${stopped%%;*}
[ "$stopped" -eq 3 ] || fail "cancel stopped at step $stopped, not at the held step 3"
[ -f "$work/shared/ckpt-$stopped.bin" ] || fail "no checkpoint of step $stopped in the shared dir"
echo "ok: SIGUSR1 cancels every process at step $stopped with its checkpoint"

# 4. Resume on fewer processes: the cancelled job (without its hold) on one process, which
#    takes the job's whole world (2 nodes x 2 devices: cpu:4) when --devices is not given,
#    from the shared checkpoint, to its end; an uninterrupted 2 x cpu:2 run stores the same
#    rows from the resume on, and the same final weights.
job "$work/resume.json" 40
"$traind" rank --spec "$work/resume.json" --state "$work/r" \
    --checkpoint-dir "$work/shared" 2>"$work/r.err" || fail "resume: $(cat "$work/r.err")"
"${MPIRUN[@]}" -np 2 "$traind" rank --spec "$work/resume.json" --state "$work/u" --devices cpu:2 \
    2>"$work/u.err" || fail "uninterrupted: $(tail -5 "$work/u.err")"
rows "$work/r" | awk -v s="$stopped" '$2 > s' >"$work/r.rows"
rows "$work/u" | awk -v s="$stopped" '$2 > s' >"$work/u.rows"
[ "$(grep -c '^train_loss ' "$work/r.rows")" -eq $((40 - stopped)) ] ||
    fail "the resume stored $(grep -c '^train_loss ' "$work/r.rows") losses past step $stopped"
cmp -s "$work/r.rows" "$work/u.rows" ||
    fail "resume: rows differ from an uninterrupted run's: $(diff "$work/r.rows" "$work/u.rows" | head -4)"
cmp -s "$work/shared/ckpt-40.bin" "$work/u/checkpoints/job-1/ckpt-40.bin" ||
    fail "resume: the final weights differ from an uninterrupted run's"
echo "ok: resumed on 1 process from step $stopped, it ends with an uninterrupted run's rows and weights"

# 5. Through srun on tests/cluster's two-node Slurm cluster (when it can start here: root, with
#    Slurm and munge): 2 tasks (nodes n1, n2) of cpu:2 store cpu:4's rows and weights, bit for
#    bit, and name their nodes by Slurm's names.
src=$(cd "$(dirname "$0")/.." && pwd)
cl="$work/cluster"
mkdir -p "$cl"
set +e
"$src/tests/cluster/cluster.sh" start "$cl" "$$" >"$work/cluster.out" 2>&1
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
    cluster_up=1
    (
        # shellcheck disable=SC1091
        . "$cl/env"
        srun --mpi=pmix -N 2 --ntasks-per-node=1 "$traind" rank --spec "$work/job.json" \
            --state "$work/s2" --devices cpu:2 2>"$work/s2.err" ||
            fail "srun 2 x cpu:2: $(tail -5 "$work/s2.err")"
        srun --mpi=pmix -N 2 --ntasks-per-node=1 "$traind" rank --spec "$work/fail.json" \
            --state "$work/sf" --devices cpu:2 2>"$work/sf.err" && fail "srun: the panic job succeeded"
        true
    )
    cluster_up=0
    "$src/tests/cluster/cluster.sh" stop "$cl" >/dev/null 2>&1 || true
    rows "$work/s2" >"$work/s2.rows"
    cmp -s "$work/p1.rows" "$work/s2.rows" ||
        fail "srun: metric rows differ from cpu:4's: $(diff "$work/p1.rows" "$work/s2.rows" | head -4)"
    cmp -s "$work/p1/checkpoints/job-1/ckpt-24.bin" "$work/s2/checkpoints/job-1/ckpt-24.bin" ||
        fail "srun: the weights differ from cpu:4's"
    msg=$(sqlite3 "$work/sf/traind.db" "select err_msg from jobs")
    [ "$msg" = "training worker on device 0 of node n2 failed: injected panic at step 5" ] ||
        fail "srun: a panic on node 1 was stored as: $msg"
    echo "ok: through srun --mpi=pmix on n1 and n2, the same rows and weights; the panic named n2"
elif [ "$rc" -eq 77 ]; then
    echo "note: no Slurm cluster here ($(tail -1 "$work/cluster.out")): srun not tried"
else
    fail "the test cluster did not start: $(tail -5 "$work/cluster.out")"
fi

# 6. The NCCL bootstrap over MPI, in a CUDA build: global rank 0's ncclGetUniqueId reaches
#    every process by MPI_Bcast (no GPU needed to make or send an id).
if [ -x "$build/tests/rank_nccl" ]; then
    set +e
    out=$("${MPIRUN[@]}" -np 2 "$build/tests/rank_nccl" 2>&1)
    rc=$?
    set -e
    case $rc in
    0) echo "ok: $(grep rank_nccl: <<<"$out")" ;;
    77) echo "note: $(grep rank_nccl: <<<"$out")" ;;
    *) fail "the NCCL bootstrap: $out" ;;
    esac
fi
