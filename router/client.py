"""Client helpers for the router's gRPC API (used by `pdserve generate --router`)."""

from __future__ import annotations

import grpc

from engine.errors import EngineError
from engine.sampling import SamplingParams
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


class RouterError(EngineError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def generate_via_router(address: str, prompt: str, params: SamplingParams, raw: bool = False, timeout: float = 300.0) -> dict:
    request = pb.GenerateRequest(text=prompt, raw=raw, sampling=sampling_to_proto(params))
    text, token_ids, prompt_token_ids = [], [], []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        try:
            for response in stub.Generate(request, timeout=timeout):
                prompt_token_ids.extend(response.prompt_token_ids)
                text.append(response.chunk.text)
                token_ids.extend(response.chunk.token_ids)
                if response.finish_reason:
                    if response.finish_reason == pb.FINISH_REASON_ERROR:
                        raise RouterError(pb.ErrorCode.Name(response.error.code), response.error.message)
        except grpc.RpcError as exc:
            raise RouterError(exc.code().name, exc.details()) from None
    return {"text": "".join(text), "token_ids": token_ids, "prompt_token_ids": prompt_token_ids}
