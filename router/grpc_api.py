"""The public gRPC API: `pdserve.v1.Router/Generate`, served by `RouterApi` over a `RouterService`.

Life of one call: the request arrives in wire form (`GenerateBytes`: a body that does not parse is
INVALID_ARGUMENT); the API key is checked (UNAUTHENTICATED); the proto becomes a `RouterRequest`
(`request_from_proto`); `RouterService.stream` runs it, and its refusals map to status codes
(InvalidRequestError -> INVALID_ARGUMENT, Overloaded -> RESOURCE_EXHAUSTED, Unavailable ->
UNAVAILABLE, a bug -> INTERNAL). The client's deadline travels as `timeout_s`, its W3C trace context
(`traceparent` metadata), if any, as the parent of the request's spans.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from common.errors import InvalidRequestError
from common.tracing import incoming_context
from proto.convert import structured_from_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.admission import Overloaded, Unavailable
from router.request import ChatPrompt, ChatTurn, Prompt, RouterRequest, SamplingRequest, TextPrompt, TokenPrompt
from router.service import RouterService

log = logging.getLogger(__name__)

_STATUS = ((InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT), (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
           (Unavailable, grpc.StatusCode.UNAVAILABLE))


class RouterApi(pb_grpc.RouterServicer):
    def __init__(self, service: RouterService):
        self.service = service

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        metadata = dict(context.invocation_metadata() or ())
        if not self.service.settings.authorized(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or invalid API key (metadata 'authorization: Bearer KEY')")
        try:
            async for response in self.service.stream(request_from_proto(request), timeout_s=context.time_remaining(),
                                                      trace_parent=incoming_context(context)):
                yield response
        except (InvalidRequestError, Overloaded, Unavailable) as exc:
            await context.abort(next(code for kind, code in _STATUS if isinstance(exc, kind)), str(exc))
        except Exception:  # a bug, not the client's fault: INTERNAL with a log line, never a bare UNKNOWN
            log.exception("request %s: Generate failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the router log)")

    async def GenerateBytes(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """`Generate` for a request still in wire form: one that does not parse (bad UTF-8 in a
        string field, a truncated varint) is INVALID_ARGUMENT, where grpc's own parsing says UNKNOWN."""
        try:
            request = pb.GenerateRequest.FromString(data)
        except DecodeError as exc:
            self.service.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid pdserve.v1.GenerateRequest ({exc})")
        async for response in self.Generate(request, context):
            yield response


def request_from_proto(request: pb.GenerateRequest) -> RouterRequest:
    """The public message as the router core's request; no checks (validation does them)."""
    return RouterRequest(prompt=_prompt(request), sampling=_sampling(request.sampling), request_id=request.request_id,
                         model=request.model, skip_detokenize=request.skip_detokenize, priority=request.priority)


def _prompt(request: pb.GenerateRequest) -> Prompt | None:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return TokenPrompt(list(request.token_ids.ids))
    if kind == "text":
        return TextPrompt(request.text, raw=request.raw)
    if kind == "chat":
        return ChatPrompt([ChatTurn(m.role, m.content) for m in request.chat.messages])
    return None


def _sampling(msg: pb.SamplingParams) -> SamplingRequest:
    def given(name: str):
        return getattr(msg, name) if msg.HasField(name) else None

    return SamplingRequest(max_tokens=msg.max_tokens or None, temperature=given("temperature"), top_p=given("top_p"),
                           top_k=given("top_k"), seed=given("seed"), stop=list(msg.stop),
                           stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos, logprobs=given("logprobs"),
                           presence_penalty=msg.presence_penalty or None, frequency_penalty=msg.frequency_penalty or None,
                           repetition_penalty=given("repetition_penalty"), logit_bias=dict(msg.logit_bias),
                           min_tokens=msg.min_tokens, n=msg.n or None,
                           structured=structured_from_proto(msg.structured_output) if msg.HasField("structured_output") else None)


def add_router_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """Serves `pdserve.v1.Router` with requests parsed by `RouterApi.GenerateBytes` (see there)."""
    api = RouterApi(service)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            api.GenerateBytes, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Router", handlers),))
    server.add_registered_method_handlers("pdserve.v1.Router", handlers)
