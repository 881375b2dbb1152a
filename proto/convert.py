"""Conversions between `pdserve.v1` messages and the request types of common/ (sampling, finish reason).

One place for the mapping, used by the router and both workers, so a field is validated and
defaulted the same way on every hop. Torch-free: the router and `pdserve generate --router` use it
without the engine. The engine's outputs and stats as messages: engine/messages.py.
"""

from __future__ import annotations

import grpc

from common.errors import InvalidRequestError
from common.request_types import FinishReason
from common.sampling import SamplingParams, StructuredOutput
from proto.pdserve.v1 import pdserve_pb2 as pb

DEFAULT_MAX_TOKENS = 256

_FINISH_TO_PROTO = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def sampling_from_proto(msg: pb.SamplingParams, field_prefix: str = "sampling") -> SamplingParams:
    """Proto -> validated SamplingParams; errors name `sampling.<field>`."""
    params = SamplingParams(
        max_tokens=msg.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(msg.logit_bias),
        min_tokens=msg.min_tokens,
        structured=structured_from_proto(msg.structured_output) if msg.HasField("structured_output") else None,
        n=msg.n or 1,
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{field_prefix}.{exc.field}", exc.message) from None
    return params


async def sampling_or_abort(msg: pb.SamplingParams, context: grpc.aio.ServicerContext) -> SamplingParams:
    """`sampling_from_proto` for a worker call: a bad field ends the call INVALID_ARGUMENT, naming it."""
    try:
        return sampling_from_proto(msg)
    except InvalidRequestError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def sampling_to_proto(params: SamplingParams, stop: list[str] | None = None) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(stop or []),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        n=params.n,
    )
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured))
    return msg


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind), tuple(msg.accepted_token_ids))


def structured_to_proto(constraint: StructuredOutput) -> pb.StructuredOutput:
    value = True if constraint.kind == "json_object" else constraint.spec
    return pb.StructuredOutput(**{constraint.kind: value}, accepted_token_ids=list(constraint.accepted))


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO.get(reason, pb.FINISH_REASON_UNSPECIFIED) if reason else pb.FINISH_REASON_UNSPECIFIED
