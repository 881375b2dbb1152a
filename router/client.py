"""Client helpers for the router's gRPC API (used by `pdserve generate --router`).

One blocking channel per call: TLS when the router serves TLS (`tls_ca_file` verifies its
certificate; `tls=True` alone trusts the system roots), plaintext otherwise; `api_key` is sent as
`authorization: Bearer KEY` when the router requires API keys (router.api_keys)."""

from __future__ import annotations

import grpc

from common.errors import EngineError
from common.sampling import SamplingParams
from common.security import sync_channel
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


class RouterError(EngineError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def generate_via_router(address: str, prompt: str, params: SamplingParams, raw: bool = False, timeout: float = 300.0,
                        *, tls: bool = False, tls_ca_file: str = "", tls_server_name: str = "", api_key: str = "") -> dict:
    request = pb.GenerateRequest(text=prompt, raw=raw, sampling=sampling_to_proto(params))
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    text, token_ids, prompt_token_ids = [], [], []
    with sync_channel(address, tls, tls_ca_file, tls_server_name) as channel:
        stub = pb_grpc.RouterStub(channel)
        try:
            for response in stub.Generate(request, timeout=timeout, metadata=metadata):
                prompt_token_ids.extend(response.prompt_token_ids)
                text.append(response.chunk.text)
                token_ids.extend(response.chunk.token_ids)
                if response.finish_reason == pb.FINISH_REASON_ERROR:
                    raise RouterError(pb.ErrorCode.Name(response.error.code), response.error.message)
        except grpc.RpcError as exc:
            raise RouterError(exc.code().name, exc.details()) from None
    return {"text": "".join(text), "token_ids": token_ids, "prompt_token_ids": prompt_token_ids}
