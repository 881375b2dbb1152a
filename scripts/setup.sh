#!/usr/bin/env bash
# Create .venv with everything pdserve needs, then convert the demo model once.
# The CPU build of torch is installed first so that no multi-GB CUDA build is pulled on a CPU host;
# on a GPU host set PDSERVE_TORCH="torch==<version>" (a CUDA build) before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${PDSERVE_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/pdserve model fetch smollm2-135m >/dev/null
.venv/bin/python -m engine.kernels  # the C++ decode attention, compiled once for this CPU
echo "pdserve is set up in .venv (demo model cached)"
