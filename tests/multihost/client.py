"""A client process inside a namespace host: concurrent greedy gRPC Generate streams through the router.

Run as `ip netns exec <host> python -m tests.multihost.client ROUTER MAX_TOKENS [--sequential] < prompts.json`
(prompts: a JSON list of token-id lists). Prints `{"event": "streaming", "index": i}` when stream
i got its first token (a test kills a host after that), then one JSON line with every stream's
token ids, finish reason, error (null when none) and seconds taken. All streams run at once\n(one after another with --sequential).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc

from common.serving import emit_event
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


def run_stream(stub: pb_grpc.RouterStub, index: int, prompt: list[int], max_tokens: int, out: list[dict]) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), skip_detokenize=True,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    result = {"tokens": tokens, "finish": None, "error": None, "elapsed_s": 0.0}
    started = time.monotonic()
    try:
        for response in stub.Generate(request, timeout=600):
            if not tokens and response.chunk.token_ids:
                emit_event({"event": "streaming", "index": index})
            tokens.extend(response.chunk.token_ids)
            if response.finish_reason:
                result["finish"] = pb.FinishReason.Name(response.finish_reason)
                if response.HasField("error") and response.error.message:
                    result["error"] = response.error.message
    except grpc.RpcError as exc:
        result["error"] = f"{exc.code().name}: {exc.details()}"
    result["elapsed_s"] = time.monotonic() - started
    out[index] = result


def main() -> int:
    address, max_tokens = sys.argv[1], int(sys.argv[2])
    sequential = "--sequential" in sys.argv[3:]
    prompts = json.load(sys.stdin)
    out: list[dict] = [{} for _ in prompts]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        threads = [threading.Thread(target=run_stream, args=(stub, i, p, max_tokens, out)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
            if sequential:
                t.join()
        for t in threads:
            t.join()
    emit_event({"event": "done", "results": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
