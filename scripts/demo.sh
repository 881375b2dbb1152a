#!/usr/bin/env bash
# The newcomer demo (`make demo`): start `pdserve serve` on the demo model (an embedded Ray with a
# router, one prefill and one decode worker as actors; deploy/configs/local.yaml), send one request
# over gRPC with `pdserve generate --router` and one OpenAI-style HTTP request, then stop it all.
#   CONFIG=path/to.yaml bash scripts/demo.sh     another config
set -euo pipefail
cd "$(dirname "$0")/.."
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
PYTHON=${PYTHON:-.venv/bin/python}
CONFIG=${CONFIG:-deploy/configs/local.yaml}
LOG=$(mktemp -t pdserve-demo.XXXXXX)

"$PDSERVE" serve -c "$CONFIG" --grpc-port 0 --http-port 0 >"$LOG" 2>&1 &
SERVE_PID=$!
stop_server() {
    if kill -0 "$SERVE_PID" 2>/dev/null; then
        kill -TERM "$SERVE_PID"
        wait "$SERVE_PID" || true
    fi
}
trap stop_server EXIT

echo "starting: pdserve serve -c $CONFIG --grpc-port 0 --http-port 0   (log: $LOG)"
for _ in $(seq 1 300); do
    grep -q '^pdserve ready:' "$LOG" && break
    if ! kill -0 "$SERVE_PID" 2>/dev/null; then
        cat "$LOG"; echo "pdserve serve exited before it was ready" >&2; exit 1
    fi
    sleep 1
done
READY=$(grep '^pdserve ready:' "$LOG") || { cat "$LOG"; echo "pdserve serve was not ready in time" >&2; exit 1; }
echo "$READY"
GRPC=$(sed -E 's/.* grpc=([^ ]+).*/\1/' <<<"$READY")
HTTP=$(sed -E 's/.* http=([^ ]+).*/\1/' <<<"$READY")

echo
echo "\$ pdserve generate \"What is the capital of France?\" --router $GRPC --max-tokens 32"
"$PDSERVE" generate "What is the capital of France?" --router "$GRPC" --max-tokens 32

echo
echo "\$ curl $HTTP/v1/chat/completions -d '{\"model\": \"smollm2-135m\", \"messages\": [...], \"max_tokens\": 32}'"
curl -sS --fail-with-body "$HTTP/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32}' \
    | "$PYTHON" -m json.tool

echo
echo "stopping (SIGTERM: drain, then stop the actors and the embedded Ray)"
kill -TERM "$SERVE_PID"
wait "$SERVE_PID"
trap - EXIT
echo "done"
