#!/usr/bin/env bash
# Installs everything the engine and its tests need into the active Python, and nothing twice.
#
#   scripts/setup.sh [--wheelhouse DIR]
#
# torch is installed only when no suitable torch is present, pinned to 2.13.0 (a CPU wheel on
# machines that provide one locally): an unpinned torch would pull several GB of CUDA packages.
# deepspeed builds against that torch without build isolation, for the same reason.
# torchvision is never installed here: the registry's wheel is CUDA-only, fails to import next to
# a CPU torch and breaks transformers' vision imports. ResNet falls back to transformers' model.
#
# --wheelhouse DIR installs from DIR alone (pip's --no-index), for nodes without network: DIR is
# built on a machine with the registry by scripts/wheelhouse.py. A torch already present is kept.
set -euo pipefail
PYTHON=${PYTHON:-python3}

WHEELHOUSE=""
while (($#)); do
  case "$1" in
    --wheelhouse) WHEELHOUSE=${2:?"--wheelhouse needs a directory"}; shift 2 ;;
    --wheelhouse=*) WHEELHOUSE=${1#*=}; shift ;;
    *) echo "usage: scripts/setup.sh [--wheelhouse DIR]" >&2; exit 2 ;;
  esac
done
if [[ -n $WHEELHOUSE ]]; then
  if [[ ! -d $WHEELHOUSE ]]; then
    echo "setup: the wheelhouse $WHEELHOUSE is not a directory" >&2
    exit 2
  fi
  # Absolute, as the user's shell read it, before the cd below.
  WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
fi
cd "$(dirname "$0")/.."

# pip install "$@"; from the wheelhouse alone when there is one, where a failure ends setup with a
# line saying what to rebuild, after pip's own message (which names a missing distribution).
pip_install() {
  if [[ -z $WHEELHOUSE ]]; then
    "$PYTHON" -m pip install --quiet "$@"
    return
  fi
  local log status=0
  log=$(mktemp)
  "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELHOUSE" "$@" 2>"$log" || status=$?
  cat "$log" >&2
  local missing
  missing=$(sed -n 's/.*No matching distribution found for \(.*\)$/\1/p' "$log" | head -n 1)
  rm -f "$log"
  if ((status == 0)); then
    return
  fi
  if [[ -z $missing ]]; then
    echo "setup: pip could not install $* from the wheelhouse $WHEELHOUSE (its message is above)" >&2
    exit 1
  fi
  local version rebuild
  version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  rebuild="python3 scripts/wheelhouse.py $WHEELHOUSE --python-version $version"
  if has_suitable_torch; then rebuild+=" --no-torch"; fi
  echo "setup: $missing is not in the wheelhouse $WHEELHOUSE;" \
    "rebuild the wheelhouse on a machine with the package registry: $rebuild" >&2
  exit 1
}

has_suitable_torch() {
  "$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 1) else 1)
PY
}

if ! has_suitable_torch; then
  echo "setup: installing torch 2.13.0"
  pip_install "torch==2.13.0"
fi

if [[ -n $WHEELHOUSE ]]; then
  # The editable install below runs without build isolation: its build backend must be here, and
  # a fresh Python 3.12 environment has no setuptools.
  pip_install "setuptools>=64" wheel
fi

if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  echo "setup: installing deepspeed against the present torch"
  pip_install --no-build-isolation "deepspeed>=0.19,<0.20"
fi

pip_install --no-build-isolation -e ".[dev]"

# libaio's headers, which DeepSpeed's async_io op builds against for NVMe offload (ZeRO-Infinity):
# installed where this user can (root and apt, and not offline); elsewhere one line says how. The op
# itself is built by a run's pre-flight, once per node, only when a config swaps to NVMe.
if [[ ! -e /usr/include/libaio.h ]]; then
  if [[ $EUID -eq 0 && -z $WHEELHOUSE ]] && command -v apt-get >/dev/null; then
    echo "setup: installing libaio-dev (NVMe offload)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q libaio-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libaio-dev >/dev/null; } ||
      echo "setup: could not install libaio-dev; NVMe offload needs it (apt-get install libaio-dev)" >&2
  else
    echo "setup: NVMe offload needs libaio's headers: apt-get install libaio-dev (or dnf install libaio-devel) as root"
  fi
fi
"$PYTHON" -c "import torch, deepspeed, transformers, datasets, accelerate, peft; print(f'setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, datasets {datasets.__version__}, accelerate {accelerate.__version__}, peft {peft.__version__}')"
