#!/usr/bin/env bash
# The front door: ./launch.sh [--launcher deepspeed|accelerate] [--nproc N] [--master-port P] CONFIG [--set path=value ...]
#
# Starts engine/main.py under the deepspeed launcher (default) or `accelerate launch` on every local
# GPU, or, on a machine without GPUs, on N CPU processes (default: 2, or 1 on a single core) talking
# over gloo. The deepspeed launcher cannot count CPU "devices", so --num_gpus is always passed; on
# CPU, accelerate starts one world of N processes only as ACCELERATE_USE_CPU=1 with --multi_gpu.
# Everything after CONFIG goes to the engine. The exact command is printed, and its exit code is
# this script's.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

nproc_arg="" master_port="" launcher="deepspeed"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --nproc) nproc_arg="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "launch.sh: unknown option $1 (options come before the config)" >&2; usage 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "launch.sh: missing CONFIG" >&2; usage 2; }
config="$1"; shift
[[ -f "$config" ]] || { echo "launch.sh: config file '$config' not found" >&2; exit 2; }

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
fi

# Validate once, before any process starts, for the world size and backend about to be launched.
backend=()
[[ "$launcher" == accelerate ]] && backend=(--set trainer.backend=accelerate)
"$PYTHON" -m engine validate "$config" --world-size "$nproc" "${backend[@]}" "$@" >/dev/null

case "$launcher" in
  deepspeed)
    cmd=(deepspeed --num_gpus "$nproc" --master_port "$master_port") ;;
  accelerate)
    if [[ "$gpus" -eq 0 && "$nproc" -gt 1 ]]; then
      export ACCELERATE_USE_CPU=1
      echo "+ export ACCELERATE_USE_CPU=1" >&2
    fi
    cmd=(accelerate launch --num_processes "$nproc" --main_process_port "$master_port")
    if [[ "$nproc" -gt 1 ]]; then cmd+=(--multi_gpu); elif [[ "$gpus" -eq 0 ]]; then cmd+=(--cpu); fi ;;
  *) echo "launch.sh: --launcher must be deepspeed or accelerate, not '$launcher'" >&2; exit 2 ;;
esac
cmd+=(engine/main.py --deepspeed_config "$config" "$@")
echo "+ ${cmd[*]}" >&2
exec "${cmd[@]}"
