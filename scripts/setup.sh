#!/usr/bin/env bash
# Create .venv (if missing) and install hicache with its dev tools.
# A machine that already has a CUDA torch keeps it: the venv sees system site-packages
# when HICACHE_SYSTEM_TORCH=1, or when `python3 -c 'import torch'` works with CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
     || [ "${HICACHE_SYSTEM_TORCH:-0}" = 1 ]; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # CPU build from local disk where it is offered; any torch >= 2.4 works.
  .venv/bin/pip install -q "torch==2.13.0" || .venv/bin/pip install -q "torch>=2.4"
fi
EXTRAS=dev
if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  EXTRAS=dev,cuda  # cuda-python: the layered restore's strided DMAs
fi
.venv/bin/pip install -q -e ".[$EXTRAS]" 2>&1 | grep -v -E "^WARNING: Location" || true
.venv/bin/python -c 'import hicache, transitions, hypothesis' 
