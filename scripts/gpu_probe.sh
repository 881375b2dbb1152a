#!/usr/bin/env bash
# Short environment probe for the GPU device machine (< 90 s there): versions, carried wheels, imports,
# fp32 greedy == HF on CUDA, flex_attention compile, transformers continuous batching, a CUDA graph
# of one decode step, device memcpy GB/s, CUDA IPC between two processes. Writes $OUT/probe.json.
# Carry: .whl and .gpu_assets (made by scripts/gpu_wheels.sh). Runs on CPU too (CUDA checks SKIP).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu_out}; export OUT; mkdir -p "$OUT"
PY=${PYTHON:-python3}
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
for m in transformers triton cupy grpc google.protobuf; do
  "$PY" -c "import $m as x; print('$m', getattr(x, '__version__', '?'))" 2>&1 | tail -1
done
if [ -d .whl ] && [ -z "${PDSERVE_SKIP_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} && echo "wheels: installed into /tmp/site"
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
timeout 150 "$PY" -m bench.gpu.probe --out "$OUT"
echo "probe exit $?; json: $OUT/probe.json"
