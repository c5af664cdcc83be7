#!/usr/bin/env bash
# Installs everything the engine and its tests need into the active Python, and nothing twice.
#
# torch is installed only when no suitable torch is present, pinned to 2.13.0 (a CPU wheel on
# machines that provide one locally): an unpinned torch would pull several GB of CUDA packages.
# deepspeed builds against that torch without build isolation, for the same reason.
# torchvision is never installed here: the registry's wheel is CUDA-only, fails to import next to
# a CPU torch and breaks transformers' vision imports. ResNet falls back to transformers' model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 1) else 1)
PY
then
  echo "setup: installing torch 2.13.0"
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi

if ! "$PYTHON" -c "import deepspeed" 2>/dev/null; then
  echo "setup: installing deepspeed against the present torch"
  "$PYTHON" -m pip install --quiet --no-build-isolation "deepspeed>=0.19,<0.20"
fi

"$PYTHON" -m pip install --quiet --no-build-isolation -e ".[dev]"
"$PYTHON" -c "import torch, deepspeed, transformers, datasets, accelerate; print(f'setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, datasets {datasets.__version__}, accelerate {accelerate.__version__}')"
