#!/usr/bin/env bash
# The front door: ./launch.sh [--launcher deepspeed|accelerate|torchrun] [--nproc N] [--master-port P] CONFIG [--set path=value ...]
#   hostfile (deepspeed): ./launch.sh --hostfile H [--include S | --exclude S | --num-nodes N]
#                         [--ssh-port P | --no-ssh --node-rank R] [--master-addr A] --master-port P CONFIG ...
#   one node of several (accelerate, torchrun): ./launch.sh --launcher L --num-nodes N --node-rank R
#                         --master-addr A --master-port P CONFIG ...
#
# Starts engine/main.py under the deepspeed launcher (default), `accelerate launch` or torchrun on
# every local GPU, or, on a machine without GPUs, on N CPU processes (default: 2, or 1 on a single
# core) talking over gloo. The deepspeed launcher cannot count CPU "devices", so --num_gpus is always
# passed; on CPU, accelerate starts one world of N processes only as ACCELERATE_USE_CPU=1 with
# --multi_gpu. Everything after CONFIG goes to the engine. The exact command is printed, and its exit
# code is this script's. With --hostfile the deepspeed launcher starts the hosts' slots over pdsh/ssh
# (every host must answer a non-interactive ssh first; PDSH_SSH_ARGS_APPEND options apply to the check
# too, and the engine's, NCCL_*, OMP_NUM_THREADS and .deepspeed_env variables reach every rank), or
# with --no-ssh one node per invocation. The hostfile is checked and the world size it implies
# validated against the config before anything starts.
#
# Signals: SIGTERM, SIGUSR1, SIGUSR2 and SIGINT to this script go to the ranks alone, not to the
# launcher (a second one too: the ranks take it as "stop now"); on trainer.signals they save and exit
# 75. The launcher then sees them end and exits; this script waits for it, and for ranks still saving
# should it have died first. Its exit code is 75 when every rank that recorded an exit code (in
# ENGINE_RANK_EXITS, a temporary directory) recorded 75, else the launcher's. Before any rank has
# started, a signal goes to the launcher's whole process tree. (engine/launch/signals.py)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

nproc_arg="" master_port="" launcher="deepspeed" hostfile="" node_rank="" master_addr="" no_ssh=0
include="" exclude="" num_nodes="" ssh_port=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --include) include="$2"; shift 2 ;;
    --exclude) exclude="$2"; shift 2 ;;
    --num-nodes) num_nodes="$2"; shift 2 ;;
    --no-ssh) no_ssh=1; shift ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --nproc) nproc_arg="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --ssh-port) ssh_port="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "launch.sh: unknown option $1 (options come before the config)" >&2; usage 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "launch.sh: missing CONFIG" >&2; usage 2; }
config="$1"; shift
[[ -f "$config" ]] || { echo "launch.sh: config file '$config' not found" >&2; exit 2; }

# Option combinations, checked before anything slow.
case "$launcher" in deepspeed|accelerate|torchrun) ;;
  *) echo "launch.sh: --launcher must be deepspeed, accelerate or torchrun, not '$launcher'" >&2; exit 2 ;;
esac
if [[ -n "$hostfile" ]]; then
  [[ "$launcher" == deepspeed ]] || { echo "launch.sh: --hostfile is for the deepspeed launcher; give $launcher --num-nodes, --node-rank and --master-addr" >&2; exit 2; }
  if [[ "$no_ssh" == 1 && ( -z "$node_rank" || -z "$master_addr" ) ]]; then
    echo "launch.sh: --no-ssh needs --node-rank and --master-addr" >&2; exit 2
  fi
elif [[ -n "$num_nodes" && "$num_nodes" -gt 1 ]]; then
  [[ "$launcher" != deepspeed ]] || { echo "launch.sh: several nodes under the deepspeed launcher need --hostfile" >&2; exit 2; }
  [[ -n "$node_rank" && -n "$master_addr" ]] || { echo "launch.sh: --num-nodes needs --node-rank and --master-addr" >&2; exit 2; }
fi
if [[ -z "$master_port" && ( -n "$hostfile" || -n "$num_nodes" ) ]]; then
  echo "launch.sh: several nodes need --master-port (every node must agree on it)" >&2; exit 2
fi

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ -n "$nproc_arg" ]]; then
  nproc="$nproc_arg"
elif [[ "$gpus" -gt 0 ]]; then
  nproc="$gpus"
else
  cores=$("$PYTHON" -c "import os; print(len(os.sched_getaffinity(0)))")
  nproc=$(( cores >= 2 ? 2 : 1 ))
fi
if [[ -z "$master_port" ]]; then
  # 29500, DeepSpeed's default, is often taken on shared machines.
  master_port=$("$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
elif [[ -z "$node_rank" || "$node_rank" == 0 ]]; then
  "$PYTHON" -c "import socket, sys; s=socket.socket(); s.bind(('', int(sys.argv[1])))" "$master_port" 2>/dev/null \
    || { echo "launch.sh: master port $master_port is in use on this node; pick another with --master-port" >&2; exit 2; }
fi

# Validate once, before any process starts, for the world size and backend about to be launched.
backend=()
[[ "$launcher" == accelerate ]] && backend=(--set trainer.backend=accelerate)
world=(--world-size "$(( nproc * ${num_nodes:-1} ))")
hosts=()
ssh_route=0
if [[ -n "$hostfile" ]]; then
  world=(--hostfile "$hostfile" --include "$include" --exclude "$exclude" --num-nodes "${num_nodes:--1}")
  hosts=(--hostfile "$hostfile")
  [[ -z "$include" ]] || hosts+=(--include "$include")
  [[ -z "$exclude" ]] || hosts+=(--exclude "$exclude")
  [[ -z "$num_nodes" ]] || hosts+=(--num_nodes "$num_nodes")
  if [[ "$no_ssh" == 1 ]]; then
    hosts+=(--no_ssh --node_rank "$node_rank")
  else
    # Our pre-flight checks every host the way pdsh will reach it; DeepSpeed's checks only the first.
    ssh_route=1
    world+=(--check-ssh)
    hosts+=(--no_ssh_check)
    [[ -z "$ssh_port" ]] || { world+=(--ssh-port "$ssh_port"); hosts+=(--ssh_port "$ssh_port"); }
  fi
  [[ -z "$master_addr" ]] || hosts+=(--master_addr "$master_addr")
fi
"$PYTHON" -m engine validate "$config" "${world[@]}" "${backend[@]}" "$@" >/dev/null

case "$launcher" in
  deepspeed)
    if [[ -n "$hostfile" ]]; then
      cmd=(deepspeed "${hosts[@]}" --master_port "$master_port")
    else
      cmd=(deepspeed --num_gpus "$nproc" --master_port "$master_port")
    fi ;;
  accelerate)
    if [[ "$gpus" -eq 0 && $(( nproc * ${num_nodes:-1} )) -gt 1 ]]; then
      export ACCELERATE_USE_CPU=1
      echo "+ export ACCELERATE_USE_CPU=1" >&2
    fi
    # accelerate's --num_processes counts every machine's processes.
    cmd=(accelerate launch --num_processes "$(( nproc * ${num_nodes:-1} ))" --main_process_port "$master_port")
    if [[ -n "$num_nodes" && "$num_nodes" -gt 1 ]]; then
      cmd+=(--num_machines "$num_nodes" --machine_rank "$node_rank" --main_process_ip "$master_addr")
    fi
    if [[ "$nproc" -gt 1 || "${num_nodes:-1}" -gt 1 ]]; then cmd+=(--multi_gpu); elif [[ "$gpus" -eq 0 ]]; then cmd+=(--cpu); fi ;;
  torchrun)
    cmd=(torchrun --nproc_per_node "$nproc" --master_port "$master_port")
    if [[ -n "$num_nodes" && "$num_nodes" -gt 1 ]]; then
      cmd+=(--nnodes "$num_nodes" --node_rank "$node_rank" --master_addr "$master_addr")
    fi ;;
esac
cmd+=(engine/main.py --deepspeed_config "$config" "$@")

# Each rank records its exit code here (engine/launch/signals.py); both files go when this script ends.
rank_exits=$(mktemp -d "${TMPDIR:-/tmp}/engine_exits.XXXXXX")
env_file=""
trap 'rm -rf "$rank_exits" ${env_file:+"$env_file"}' EXIT
export ENGINE_RANK_EXITS="$rank_exits"

if [[ "$ssh_route" == 1 ]]; then
  # Ranks started over ssh see a fresh login environment: hand DeepSpeed the variables they need.
  env_file=$(mktemp "${TMPDIR:-/tmp}/engine_env.XXXXXX")
  "$PYTHON" -m engine launch-env "$env_file" >&2
  export DS_ENV_FILE="$env_file"
  echo "+ export DS_ENV_FILE=$env_file" >&2
fi
echo "+ ${cmd[*]}" >&2

# A trapped signal ends `wait` early: wait again until $1 has ended, then return its status (bash
# keeps it for a second `wait`).
wait_for() {
  while kill -0 "$1" 2>/dev/null; do wait "$1" || true; done
  wait "$1"
}
forward() { "$PYTHON" -m engine.launch.signals forward "$launcher" "$1" || true; }

# bash starts a background command with SIGINT and SIGQUIT ignored: give the launcher their defaults.
( trap - INT QUIT; exec "${cmd[@]}" ) &
launcher=$!
for signal in TERM USR1 USR2 INT; do trap "forward $signal" "$signal"; done
rc=0
wait_for "$launcher" || rc=$?
# A launcher killed by a signal can leave ranks that are still saving: wait for them (signals now go
# to them, launcher 0), then exit with the job's code.
launcher=0
"$PYTHON" -m engine.launch.signals exit-code "$rank_exits" "$rc" &
rc=0
wait_for $! || rc=$?
exit "$rc"
