#!/usr/bin/env bash
# The GPU device check (issue 14): one command, < 8 minutes on one H200, writes $OUT/gpu_check.json
# (rewritten after every section, so a timeout keeps what finished) and $OUT/gpu_check.txt.
# Carry .whl and .gpu_assets (scripts/gpu_wheels.sh makes them); on the device machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash scripts/gpu_check.sh
# Here: scripts/gpu_check.sh --device cpu --quick   (tiny sizes, a few minutes: how it is tested)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-$PWD/gpu_out}; export OUT; mkdir -p "$OUT"
PY=${PYTHON:-python3}
timeout --signal=TERM --kill-after=15 ${PDSERVE_GPU_CHECK_TIMEOUT:-500} "$PY" -m bench.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
echo "gpu check exit $status; files: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
