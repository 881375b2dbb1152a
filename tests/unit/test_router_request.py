"""The router core's one request type: what the gRPC front end makes of a GenerateRequest, and how
validation reads it (unset fields take the defaults, errors name the gRPC field)."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.grpc_api import request_from_proto
from router.request import ChatPrompt, ChatTurn, RouterRequest, SamplingRequest, TextPrompt, TokenPrompt
from router.validation import Validator
from tests.unit.test_openai_schema import SETTINGS


class Vocab:
    def __len__(self) -> int:
        return 100


def validate(request: pb.GenerateRequest):
    return Validator(SETTINGS, Vocab()).validate(request_from_proto(request))


def test_grpc_request_becomes_the_internal_request():
    msg = pb.GenerateRequest(request_id="r", model="tiny", token_ids=pb.TokenIds(ids=[1, 2, 3]), skip_detokenize=True,
                             sampling=pb.SamplingParams(max_tokens=5, top_p=0.5, stop=["x"], logprobs=0))
    assert request_from_proto(msg) == RouterRequest(
        TokenPrompt([1, 2, 3]), SamplingRequest(max_tokens=5, top_p=0.5, stop=["x"], logprobs=0),
        request_id="r", model="tiny", skip_detokenize=True)
    assert request_from_proto(pb.GenerateRequest(text="hi", raw=True)).prompt == TextPrompt("hi", raw=True)
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    assert request_from_proto(chat).prompt == ChatPrompt([ChatTurn("user", "hi")])
    assert request_from_proto(pb.GenerateRequest()).prompt is None


def test_unset_sampling_takes_the_defaults():
    valid = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])))
    assert valid.prompt_ids == [1, 2] and valid.stop == []
    assert valid.params == SamplingParams(max_tokens=SETTINGS.max_model_len - 2, temperature=1.0)


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100])), "prompt.token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(temperature=math.nan)), "sampling.temperature"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(top_p=2.0)), "sampling.top_p"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(stop_token_ids=[100])), "sampling.stop_token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(max_tokens=500)), "sampling.max_tokens"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), model="other"), "model"),
])
def test_errors_name_the_grpc_field(request_, field):
    with pytest.raises(InvalidRequestError) as info:
        validate(request_)
    assert info.value.field == field
