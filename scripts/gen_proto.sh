#!/usr/bin/env bash
# Regenerate proto/pdserve/v1/pdserve_pb2{,_grpc}.py and pdserve_pb2.pyi from the .proto.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PYTHON" -m proto.generate "$@"
