#!/usr/bin/env bash
# `make gpu-check`: scripts/gpu_check.py with the Python that has the machine's CUDA torch.
#
# Here (a .venv made by make): that venv. On a GPU machine with its own torch and no network: the
# system's python3, plus the few pure-Python wheels ddplab needs that such a machine lacks, installed
# without their dependencies from .gpu-wheels/ (made beforehand where the package index is reachable,
# by `make gpu-wheels`, and carried with the working tree). docs/gpus.md says which and why.
set -euo pipefail
cd "$(dirname "$0")/.."
# PYTHON=... picks one; else the project's venv when it has torch; else the machine's python3
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
# import name -> the wheel's package name
declare -A NEEDED=([omegaconf]=omegaconf [webdataset]=webdataset [braceexpand]=braceexpand [yaml]=PyYAML [pytest]=pytest [pytest_timeout]=pytest-timeout [safetensors]=safetensors [tqdm]=tqdm)
missing=()
for module in "${!NEEDED[@]}"; do
  "$PY" -c "import $module" 2>/dev/null || missing+=("${NEEDED[$module]}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ -d .gpu-wheels ]; then
    echo "gpu-check: installing ${missing[*]} from .gpu-wheels/ (no network, no dependencies)"
    "$PY" -m pip install --quiet --no-index --no-deps --find-links .gpu-wheels "${missing[@]}"
  else
    echo "gpu-check: error: ${missing[*]} missing for $PY; run 'make gpu-wheels' where the package index is reachable and bring .gpu-wheels/ along" >&2
    exit 2
  fi
fi
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_check.py "$@"
