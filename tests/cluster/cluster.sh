#!/usr/bin/env bash
# A two-node Slurm cluster on this one box, for the tests of jobs that span nodes (issue 20):
# its own munged (own key and socket), a slurmctld and two slurmds, "n1" and "n2", each on a
# TCP port picked free at start, all of it under DIR and one short run directory in /tmp.
# Nothing system-wide is read or written (/etc/slurm, /etc/munge, /run/munge, the system's
# munged, systemd), so it runs beside the system's Slurm and beside other copies of itself.
#   cluster.sh start DIR [OWNER_PID]
#       makes the cluster and waits until both nodes are idle, then writes DIR/env (lines
#       "export VAR=value" for a test to source or parse) and prints one line saying where it
#       is. With OWNER_PID, a watchdog stops the cluster once that process is gone, whatever
#       killed it. Every daemon's PID is in DIR/pids as soon as it is started, so that stop
#       cleans up after a start that failed or was interrupted.
#   cluster.sh stop DIR
#       kills the cluster's job steps (each slurmstepd and its session), then every daemon it
#       recorded (SIGTERM, SIGKILL after TD_CLUSTER_STOP_S), then any srun (or other client)
#       of this cluster still waiting, and removes the run directory; the logs stay in
#       DIR/log. Safe to run again, and on a DIR where start failed.
# TD_CLUSTER_TRACE=1 prints each phase's time; TD_CLUSTER_PORTS is for test_cluster.sh only.
# Exits 77 (skipped) with the reason when not root or when a program it needs is missing; 2 on
# a bad command line; 1 when the cluster did not come up (with the daemons' last log lines).
# tests/cluster/README.md says how a test uses it and what it does not prove.
set -euo pipefail

START_S=${TD_CLUSTER_START_S:-60} # seconds start waits for both nodes to be idle
STOP_S=${TD_CLUSTER_STOP_S:-10}   # seconds stop waits for a daemon after SIGTERM
TRIES=5                           # starts with fresh ports before giving up on a port race
NODES=(n1 n2)
SELF=$(cd "$(dirname "$0")" && pwd -P)/$(basename "$0")
T0=$(($(date +%s%N) / 1000000))

usage()
{
    echo "usage: $0 start DIR [OWNER_PID] | stop DIR" >&2
    exit 2
}

die()
{
    echo "cluster: $*" >&2
    exit 1
}

# The milliseconds since the epoch (deadlines, and the time start took).
now_ms()
{
    local t
    t=$(date +%s%N)
    echo $((t / 1000000))
}

# DIR as an absolute path, made when missing. Slurm's configuration and the env file take it
# unquoted, so it may hold only characters that need no quoting.
resolve_dir()
{
    [ -n "$1" ] || usage
    mkdir -p "$1"
    DIR=$(cd "$1" && pwd -P)
    case "$DIR" in
    *[!A-Za-z0-9._/+-]*) die "DIR may hold only letters, digits and ._/+- ($DIR)" ;;
    esac
    CONF=$DIR/etc/slurm.conf
    PIDS=$DIR/pids
}

# With TD_CLUSTER_TRACE=1, line $1 on stderr with the milliseconds since the script began.
trace()
{
    [ "${TD_CLUSTER_TRACE:-0}" = 1 ] || return 0
    echo "cluster: +$(($(now_ms) - T0)) ms: $*" >&2
}

# ---- processes

# Whether process $1 is alive (a zombie is not): stop waits on daemons it is not the parent of.
# The state is the field after the command name, which may hold spaces and parentheses.
alive()
{
    local stat
    [ -n "$1" ] || return 1
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    case "${stat%% *}" in
    "" | Z | X) return 1 ;;
    esac
    return 0
}

# Whether process $1 is the one this cluster started: its command line names DIR (every daemon
# is given a path under DIR), so a PID reused by another process since is left alone.
ours()
{
    local cmd
    alive "$1" || return 1
    cmd=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null) || return 1
    case "$cmd" in
    *"$DIR/"* | *"$DIR "*) return 0 ;;
    esac
    return 1
}

# Records daemon $1 as PID $2, before anything waits on it.
record()
{
    echo "$1 $2" >>"$PIDS"
}

# The PIDs recorded under the names $@ (all of them without a name).
recorded()
{
    [ -f "$PIDS" ] || return 0
    if [ $# -eq 0 ]; then
        awk '{ print $2 }' "$PIDS"
    else
        awk -v names=" $* " 'index(names, " " $1 " ") { print $2 }' "$PIDS"
    fi
}

# Drops the names $@ from DIR/pids.
forget()
{
    [ -f "$PIDS" ] || return 0
    awk -v names=" $* " '!index(names, " " $1 " ")' "$PIDS" >"$PIDS.new"
    mv "$PIDS.new" "$PIDS"
}

# The PIDs of the processes below $@ (children, theirs, ...), from one ps snapshot.
descendants()
{
    ps -eo pid=,ppid= | awk -v roots=" $* " '
        { parent[$1] = $2; pids[NR] = $1 }
        END {
            n = split(roots, r, " ")
            for (i = 1; i <= n; i++) mark[r[i]] = 1
            do {
                grew = 0
                for (i = 1; i <= NR; i++) {
                    p = pids[i]
                    if (!(p in mark) && (parent[p] in mark)) { mark[p] = 1; grew = 1; print p }
                }
            } while (grew)
        }'
}

# This process and its ancestors: never signalled, whatever they match.
ancestry()
{
    local p=$$
    while [ -n "$p" ] && [ "$p" -gt 1 ]; do
        echo "$p"
        p=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null) || break
    done
}

# Signals $1 to each live PID of $2.. that is not this process or one of its callers.
signal()
{
    local sig=$1 p
    shift
    for p in "$@"; do
        case " $SPARE " in *" $p "*) continue ;; esac
        if alive "$p"; then
            kill "-$sig" "$p" 2>/dev/null || true
        fi
    done
}

# Waits until none of the PIDs $2.. is alive or $1 seconds have passed; says whether all died.
wait_gone()
{
    local deadline p left
    deadline=$(($(now_ms) + $1 * 1000))
    shift
    while :; do
        left=0
        for p in "$@"; do
            case " $SPARE " in *" $p "*) continue ;; esac
            alive "$p" && left=1
        done
        [ "$left" -eq 0 ] && return 0
        [ "$(now_ms)" -lt "$deadline" ] || return 1
        sleep 0.05
    done
}

# SIGTERM to the PIDs $2.., SIGKILL to those left after $1 seconds.
terminate()
{
    local grace=$1
    shift
    [ $# -gt 0 ] || return 0
    signal TERM "$@"
    wait_gone "$grace" "$@" && return 0
    kill_now "$@"
}

# SIGKILL to the PIDs $@, and waits for them to die.
kill_now()
{
    [ $# -gt 0 ] || return 0
    signal KILL "$@"
    wait_gone 5 "$@" || echo "cluster: still alive after SIGKILL: $*" >&2
}

# ---- job steps

# The cluster's slurmstepd processes. A slurmstepd rewrites its command line ("slurmstepd:
# [12.0]") and its environment, but it keeps its slurmd's log (under DIR) open, and its
# sockets are under the run directory: a slurmstepd with a descriptor on either is ours.
stepds()
{
    local d p f l comm
    for d in /proc/[0-9]*; do
        comm=""
        read -r comm 2>/dev/null <"$d/comm" || continue
        [ "$comm" = slurmstepd ] || continue
        p=${d#/proc/}
        for f in "$d"/fd/*; do
            l=$(readlink "$f" 2>/dev/null) || continue
            # RUN is empty once a stop has removed it (a second stop, the watchdog's): then it
            # must match nothing, not every path, or that stop kills other clusters' steps
            if [[ "$l" == "$DIR/"* || (-n "$RUN" && "$l" == "$RUN/"*) ]]; then
                echo "$p"
                break
            fi
        done
    done
}

# Every process of the cluster's job steps: each slurmstepd, the processes of its session
# (the tasks; proctrack/pgid leaves each in a process group of its own, but in the session
# slurmd's double fork made for the step), and anything below either.
step_processes()
{
    local steps sids
    steps=$(stepds | tr '\n' ' ')
    [ -n "${steps// /}" ] || return 0
    # shellcheck disable=SC2086 # a list of PIDs
    sids=$(ps -o sid= -p "${steps// /,}" 2>/dev/null | tr -s ' \n' ' ')
    {
        echo "$steps" | tr ' ' '\n'
        ps -eo pid=,sid= | awk -v sids=" $sids " 'index(sids, " " $2 " ") { print $1 }'
        # shellcheck disable=SC2086
        descendants $steps
    } | awk 'NF && !seen[$1]++'
}

# The Slurm clients of the cluster still running (an srun whose step was killed, or whose
# controller is gone, waits for ever and ignores SIGTERM): srun and its kin whose environment
# names this cluster's slurm.conf.
clients()
{
    local d comm
    for d in /proc/[0-9]*; do
        comm=""
        read -r comm 2>/dev/null <"$d/comm" || continue
        case "$comm" in
        srun | salloc | sbatch | sattach | sbcast | scontrol | sinfo | squeue | scancel | sstat) ;;
        *) continue ;;
        esac
        tr '\0' '\n' 2>/dev/null <"$d/environ" | grep -s -x -F "SLURM_CONF=$CONF" >/dev/null &&
            echo "${d#/proc/}"
    done
    return 0
}

# ---- start

# PORTS: $1 distinct TCP ports nothing listens on or holds now, below the kernel's range of
# ephemeral ports (where srun and every client's own end of a connection come from), at random.
# Proved free by binding each on every address, as slurmctld and slurmd will; not reserved, so
# start still retries when a daemon finds its port taken (by another cluster starting at the
# same moment). One python3 for them all: its start-up is most of the cost on a busy box.
free_ports()
{
    local lo hi
    read -r lo hi </proc/sys/net/ipv4/ip_local_port_range
    # 20000 up to the ephemeral range, or above it where the range starts too low.
    if [ "$lo" -gt 21000 ]; then
        hi=$((lo - 1))
        lo=20000
    else
        lo=$((hi + 1))
        hi=65535
    fi
    read -r -a PORTS < <(python3 -c '
import random, socket, sys
n, lo, hi = (int(a) for a in sys.argv[1:])
free = []
for port in random.sample(range(lo, hi + 1), min(500, hi - lo + 1)):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            continue
    free.append(port)
    if len(free) == n:
        break
print(*free)
' "$1" "$lo" "$hi" 2>/dev/null)
    [ ${#PORTS[@]} -eq "$1" ] || die "no $1 free TCP ports found between $lo and $hi"
}

# Runs a Slurm client ($@) against this cluster alone: none of the caller's SLURM_* settings
# (an allocation it runs in, a partition) reach it.
client()
{
    env -i PATH="$PATH" SLURM_CONF="$CONF" timeout 20 "$@"
}

# Starts daemon $1 (command $2..) in the foreground of a clean environment, its output in
# DIR/log/$1.out (which has what it says before its log file is open), and records it. It
# stays in the caller's process group, so that a test runner that kills the group on a
# timeout kills the daemons too.
daemon()
{
    local name=$1
    shift
    env -i PATH="$PATH" LANG=C "$@" </dev/null >"$DIR/log/$name.out" 2>&1 &
    record "$name" "$!"
    disown "$!" # no "Killed" from bash when stop_slurm kills it
}

# Checks that each program of $@ is installed; skips (77) naming the missing ones.
need()
{
    local p missing=()
    for p in "$@"; do
        command -v "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "cluster: skipped: not installed: ${missing[*]} (scripts/deps.sh installs them)"
    exit 77
}

# Writes DIR/etc/slurm.conf for controller port $1 and the nodes' ports $2...
write_conf()
{
    local ctld_port=$1 host cpus i
    shift
    host=$(hostname -s)
    cpus=$(nproc)
    {
        cat <<EOF
# A two-node test cluster on one box (tests/cluster/cluster.sh), all of it under
# $DIR and $RUN.
ClusterName=td$ctld_port
# slurmctld refuses to run on a host that is not its SlurmctldHost: this one, at loopback.
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/pid/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
# Per node (%n): the two slurmds share a host, and each must own its step sockets, its PMIx
# server directories (both under SlurmdSpoolDir) and its PMIx client directory (under TmpFS,
# spmix_appdir_UID_JOB.STEP: in one shared /tmp the second node's slurmstepd finds it exists
# and every --mpi=pmix step fails to launch). All under the short run directory: a Unix
# socket's path is limited to 108 bytes, and DIR may be a long build path.
SlurmdSpoolDir=$RUN/spool/%n
TmpFS=$RUN/tmp/%n
SlurmdPidFile=$DIR/pid/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
# Not /etc/slurm/plugstack.conf (the system's SPANK plugins); nothing.
PlugStackConfig=$DIR/etc/plugstack.conf
MailProg=/bin/true
# No cgroups: a process group per task, and no binding, since both nodes are the same CPUs.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
InactiveLimit=0
# Seconds between a step's SIGTERM and its SIGKILL (30 by default): a cancelled test job
# frees its nodes at once.
KillWait=2
# Job IDs start at a random number, so that two clusters side by side do not both run a job
# 1 (PMIx names a step's namespace slurm.pmix.JOB.STEP).
FirstJobId=$((RANDOM * 30 + 1000))
EOF
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$1 CPUs=$cpus"
            shift
        done
        echo "PartitionName=test Nodes=$(
            IFS=,
            echo "${NODES[*]}"
        ) Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
    : >"$DIR/etc/plugstack.conf"
}

# munged on its own key and socket, and waits (up to $1 ms since the epoch) for its socket.
start_munge()
{
    local deadline=$1
    mkdir -p "$DIR/munge"
    chmod 700 "$DIR/munge"
    rm -f "$DIR/munge/munge.key"
    mungekey --create --keyfile="$DIR/munge/munge.key" >/dev/null
    daemon munged munged --foreground --socket="$RUN/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/pid/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    until [ -S "$RUN/munge.socket" ]; do
        alive "$(recorded munged)" || fail_log munged "munged exited"
        [ "$(now_ms)" -lt "$deadline" ] || fail_log munged "munged made no socket in ${START_S} s"
        sleep 0.02
    done
}

# Says why start failed ($2), with the last lines daemon $1 wrote, and exits 1.
fail_log()
{
    local f
    echo "cluster: $2" >&2
    for f in "$DIR/log/$1.out" "$DIR/log/$1.log"; do
        [ -s "$f" ] || continue
        echo "--- $f" >&2
        tail -n 15 "$f" >&2
    done
    exit 1
}

# The nodes' states, one "NAME STATE" a line in node order ("n1 idle").
node_states()
{
    client sinfo --noheader --Node --format='%N %T' 2>/dev/null | sort
}

# Whether process $1 listens on TCP port $2: one of its descriptors is the socket that
# /proc/net/tcp lists as listening there (not merely someone's socket on that port).
listens()
{
    local inodes f link
    [ -n "$1" ] || return 1
    inodes=$(awk -v port="$(printf ':%04X' "$2")" '
        substr($2, length($2) - 4) == port && $4 == "0A" { printf " socket:[%s] ", $10 }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null)
    [ -n "$inodes" ] || return 1
    for f in /proc/"$1"/fd/*; do
        link=$(readlink "$f" 2>/dev/null) || continue
        case "$inodes" in
        *" $link "*) return 0 ;;
        esac
    done
    return 1
}

# Checks that the daemons $@ are alive. One that died because its port was taken sets RACE=1
# (and the caller starts again on other ports); one that died of anything else fails start.
check_alive()
{
    local n
    for n in "$@"; do
        alive "$(recorded "$n")" && continue
        if grep -s -l 'Address already in use' "$DIR/log/$n.log" "$DIR/log/$n.out" >/dev/null; then
            echo "cluster: $n found its port taken; starting again on other ports" >&2
            RACE=1
            return 0
        fi
        fail_log "$n" "$n exited during start"
    done
}

# Waits until each daemon $2.. listens on its port (DAEMON:PORT), up to $1 ms since the epoch;
# returns early with RACE=1 when one lost its port.
wait_listening()
{
    local deadline=$1 d left
    shift
    while :; do
        left=0
        for d in "$@"; do
            listens "$(recorded "${d%:*}")" "${d#*:}" || left=1
        done
        [ "$left" -eq 0 ] && return 0
        check_alive "${@%:*}"
        [ "$RACE" -eq 0 ] || return 0
        [ "$(now_ms)" -lt "$deadline" ] || fail_log "${1%:*}" "not listening after ${START_S} s: $*"
        sleep 0.02
    done
}

# Starts slurmctld and the slurmds on fresh ports and waits, up to $1 ms since the epoch, for
# every node to be idle. Sets RACE=1 and returns when a daemon could not bind its port (another
# cluster starting at the same moment took it); exits 1 on any other failure. The slurmds start
# once slurmctld listens, since a slurmd that finds no controller tries again only seconds
# later. On the first try ($2), TD_CLUSTER_PORTS ("CTLD N1 N2", 0 for a free one) names ports,
# unchecked: test_cluster.sh gives it one that is taken, to see start recover from the race.
start_slurm()
{
    local deadline=$1 want got n i given=() nodes=()
    RACE=0
    free_ports $((${#NODES[@]} + 1))
    if [ "$2" -eq 1 ] && [ -n "${TD_CLUSTER_PORTS:-}" ]; then
        read -r -a given <<<"$TD_CLUSTER_PORTS"
        if [ ${#given[@]} -ne ${#PORTS[@]} ] || [[ ! "${given[*]}" =~ ^[0-9\ ]+$ ]]; then
            die "TD_CLUSTER_PORTS is not ${#PORTS[@]} ports: $TD_CLUSTER_PORTS"
        fi
        for i in "${!given[@]}"; do
            [ "${given[$i]}" = 0 ] || PORTS[i]=${given[$i]}
        done
    fi
    rm -rf "$DIR/state" "$RUN/spool" "$RUN/tmp"
    mkdir -p "$DIR/state"
    for n in "${NODES[@]}"; do
        mkdir -p "$RUN/spool/$n" "$RUN/tmp/$n"
    done
    write_conf "${PORTS[@]}"
    trace "start: ports picked"
    daemon slurmctld slurmctld -D -f "$CONF"
    wait_listening "$deadline" "slurmctld:${PORTS[0]}"
    [ "$RACE" -eq 0 ] || return 0
    trace "start: slurmctld listens"
    for i in "${!NODES[@]}"; do
        daemon "slurmd-${NODES[$i]}" slurmd -D -N "${NODES[$i]}" -f "$CONF"
        nodes+=("slurmd-${NODES[$i]}:${PORTS[$((i + 1))]}")
    done
    wait_listening "$deadline" "${nodes[@]}"
    [ "$RACE" -eq 0 ] || return 0
    trace "start: slurmds listen"
    want=$(for n in "${NODES[@]}"; do echo "$n idle"; done)
    while :; do
        got=$(node_states)
        [ "$got" = "$want" ] && return 0
        check_alive slurmctld "${NODES[@]/#/slurmd-}"
        [ "$RACE" -eq 0 ] || return 0
        if [ "$(now_ms)" -ge "$deadline" ]; then
            echo "cluster: nodes not idle after ${START_S} s: $(echo "$got" | tr '\n' ' ')" >&2
            fail_log slurmctld "start timed out"
        fi
        sleep 0.05
    done
}

# Kills the Slurm daemons of a start that lost a port race, and forgets them. SIGKILL: there is
# nothing to save, and a slurmd still trying to register with a slurmctld that is gone answers
# SIGTERM only when it gives up, 10 s later.
stop_slurm()
{
    local pids p
    pids=""
    for p in $(recorded slurmctld "${NODES[@]/#/slurmd-}"); do
        pids="$pids $p $(descendants "$p" | tr '\n' ' ')"
    done
    SPARE=""
    # shellcheck disable=SC2086 # a list of PIDs
    kill_now $pids
    forget slurmctld "${NODES[@]/#/slurmd-}"
}

# Starts a process that waits for PID $1 to end and then stops the cluster. In a session of
# its own, so that whatever kills its owner's process group does not kill it too.
start_watchdog()
{
    local owner=$1
    alive "$owner" || die "owner $owner is not running"
    # shellcheck disable=SC2016 # the watchdog's own script, its arguments passed as $1..$3
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 0.5; done; exec "$2" stop "$3"' \
        watchdog "$owner" "$SELF" "$DIR" </dev/null >>"$DIR/log/watchdog.log" 2>&1 &
    record watchdog "$!"
}

# Writes DIR/env, whole or not at all: a test may take its existence for "the cluster is up".
write_env()
{
    local nodes
    nodes=$(
        IFS=,
        echo "${NODES[*]}"
    )
    # The tasks of both nodes run on one host under one hostname, so Open MPI must not share
    # memory between ranks it believes are on different nodes: the vader BTL names its segments
    # by host, job and local rank, and two nodes' local rank 0 meet (a step of two tasks per
    # node hangs or crashes). ob1 over TCP on loopback instead; loopback by name, since the TCP
    # BTL leaves 127.0.0.1 out by default and a box may have no other interface. (Debian's
    # openmpi-mca-params.conf already keeps UCX and OFI out; pml=ob1 holds where it does not.)
    cat >"$DIR/env.new" <<EOF
export TD_CLUSTER_DIR=$DIR
export TD_CLUSTER_NODES=$nodes
export SLURM_CONF=$CONF
export OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,tcp
export OMPI_MCA_btl_tcp_if_include=lo
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
EOF
    mv "$DIR/env.new" "$DIR/env"
}

# On a failed or interrupted start, stops whatever it had started.
start_failed()
{
    local rc=$?
    trap - EXIT
    [ "$rc" -eq 0 ] && return 0
    stop_all >/dev/null 2>&1 || true
    exit "$rc"
}

cmd_start()
{
    local t0 deadline try p owner=$2
    [ -n "$1" ] || usage
    [ -z "$owner" ] || [[ "$owner" =~ ^[0-9]+$ ]] || usage
    if [ "$(id -u)" -ne 0 ]; then
        echo "cluster: skipped: needs root (slurmd runs each job step as its user)"
        exit 77
    fi
    need munged mungekey slurmctld slurmd sinfo python3 setsid hostname
    resolve_dir "$1"
    for p in $(recorded); do
        ours "$p" && die "a cluster is already running in $DIR (cluster.sh stop $DIR)"
    done
    # What a start or a stop that was killed left behind: its run directory, a step.
    if [ -e "$DIR/run" ] || [ -f "$PIDS" ]; then
        stop_all
    fi
    t0=$(now_ms)
    deadline=$((t0 + START_S * 1000))
    trap start_failed EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    trap 'exit 129' HUP
    mkdir -p "$DIR/etc" "$DIR/log" "$DIR/pid"
    RUN=$(mktemp -d /tmp/td-cluster.XXXXXX)
    ln -sfn "$RUN" "$DIR/run"
    chmod 755 "$RUN" # munged wants its socket's directory open to all
    [ -z "$owner" ] || start_watchdog "$owner"
    start_munge "$deadline"
    trace "start: munged up"
    for try in $(seq "$TRIES"); do
        start_slurm "$deadline" "$try"
        trace "start: try $try on ports ${PORTS[*]}: $([ "$RACE" -eq 0 ] && echo up || echo lost a port)"
        [ "$RACE" -eq 0 ] && break
        stop_slurm
        trace "start: try $try stopped"
        [ "$try" -lt "$TRIES" ] || die "each port was taken before its daemon bound it ($TRIES tries)"
    done
    write_env
    trap - EXIT TERM INT HUP
    echo "cluster: up in $(($(now_ms) - t0)) ms in $DIR: slurmctld on port ${PORTS[0]}," \
        "slurmd ${NODES[*]} on ${PORTS[*]:1}"
}

# ---- stop

# Stops everything DIR/pids and DIR/run name, and removes the run directory.
stop_all()
{
    local procs pids group n p
    RUN=$(readlink "$DIR/run" 2>/dev/null || true)
    SPARE=" $(ancestry | tr '\n' ' ') "
    trace "stop: begin"
    # The job steps first, since a slurmstepd outlives its slurmd by design; SIGKILL at once,
    # since a slurmstepd ignores SIGTERM and nothing of a test's job is worth waiting for (a test
    # that wants its job to end cleanly cancels it first).
    procs=$(step_processes | tr '\n' ' ')
    # shellcheck disable=SC2086 # a list of PIDs
    kill_now $procs
    trace "stop: steps killed: ${procs:-none}"
    # Then the daemons, the nodes before the controller, munged last; each with whatever it
    # started (slurmctld's slurmscriptd), by the PIDs that are still the ones recorded.
    for group in "${NODES[*]/#/slurmd-}" slurmctld munged; do
        pids=""
        # shellcheck disable=SC2086 # a list of names
        for p in $(recorded $group); do
            ours "$p" || continue
            pids="$pids $p $(descendants "$p" | tr '\n' ' ')"
        done
        # shellcheck disable=SC2086
        terminate "$STOP_S" $pids
        trace "stop: $group stopped"
    done
    # The watchdog with its sleep, as the process group it leads; not when it is what runs this.
    for p in $(recorded watchdog); do
        ours "$p" || continue
        case "$SPARE" in *" $p "*) continue ;; esac
        kill -TERM -- "-$p" 2>/dev/null || true
        wait_gone "$STOP_S" "$p" || kill -KILL -- "-$p" 2>/dev/null || true
    done
    # A step that a slurmd started while the above ran, and the clients left waiting on it all.
    procs=$(step_processes | tr '\n' ' ')
    # shellcheck disable=SC2086
    kill_now $procs
    procs=$(clients | tr '\n' ' ')
    # shellcheck disable=SC2086
    kill_now $procs
    trace "stop: clients killed: ${procs:-none}"
    case "$RUN" in
    /tmp/td-cluster.*) rm -rf "$RUN" ;;
    esac
    rm -f "$DIR/run" "$DIR/env" "$PIDS"
}

cmd_stop()
{
    [ -d "$1" ] || return 0
    resolve_dir "$1"
    stop_all
}

case "${1:-}" in
start)
    case $# in 2 | 3) ;; *) usage ;; esac
    cmd_start "$2" "${3:-}"
    ;;
stop)
    [ $# -eq 2 ] || usage
    cmd_stop "$2"
    ;;
*) usage ;;
esac
