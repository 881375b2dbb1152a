#!/usr/bin/env bash
# The GPU device check (issue 14): ONE command for a lent GPU machine, < 8 minutes on one H200. It installs
# the carried wheels (where CUDA is and .whl/ is there: scripts/gpu_wheels.sh makes it, with .gpu_assets/), runs
# bench.gpu_check (writes $OUT/gpu_check.json after every section, so a timeout keeps what finished, and
# $OUT/gpu_check.txt), then the CUDA-guarded tests (tests/unit/test_engine_batched.py and
# test_triton_layers.py run their kernels, graphs and bit checks on the GPU there) into $OUT/pytest_cuda.log.
# On the device machine (run tool: carry [".whl", ".gpu_assets"]):  bash scripts/gpu_check.sh
# Here: scripts/gpu_check.sh --device cpu --quick   (tiny sizes, a few minutes: how it is tested)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}; export OUT; mkdir -p "$OUT"
PY=${PYTHON:-python3}
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
if [ "$CUDA" = 1 ] && [ -d .whl ] && [ -z "${PDSERVE_SKIP_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install" >&2; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
timeout --signal=TERM --kill-after=15 ${PDSERVE_GPU_CHECK_TIMEOUT:-420} "$PY" -m bench.gpu_check --out "$OUT" "$@" 2>&1 \
  | grep --line-buffered -v 'it/s\]\|tok/s\]' | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
echo "gpu check exit $status"
if [ "$CUDA" = 1 ]; then
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_engine_batched.py tests/unit/test_triton_layers.py \
    > "$OUT/pytest_cuda.log" 2>&1
  echo "CUDA tests exit $? ($(tail -1 "$OUT/pytest_cuda.log"))"
fi
echo "files: $(ls "$OUT" | tr '\n' ' ')"
exit "$status"
