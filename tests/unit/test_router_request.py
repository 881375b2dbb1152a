"""The router core's one request type: what the gRPC front end makes of a GenerateRequest, and how
validation reads it (unset fields take the defaults, errors name the gRPC field)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from common.errors import InvalidRequestError
from common.sampling import SamplingParams
from proto.convert import sampling_from_proto, sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.grpc_api import request_from_proto
from router.progress import Progress, SequenceProgress, replayable
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
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(presence_penalty=2.5)), "sampling.presence_penalty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(frequency_penalty=math.inf)), "sampling.frequency_penalty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(repetition_penalty=0)), "sampling.repetition_penalty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(logit_bias={100: 1})), "sampling.logit_bias"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(logit_bias={5: -101})), "sampling.logit_bias[5]"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(max_tokens=4, min_tokens=5)), "sampling.min_tokens"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(n=17)), "sampling.n"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), priority=1001), "priority"),
])
def test_errors_name_the_grpc_field(request_, field):
    with pytest.raises(InvalidRequestError) as info:
        validate(request_)
    assert info.value.field == field


def test_logits_controls_travel_unchanged_router_to_workers():
    sampling = pb.SamplingParams(max_tokens=9, presence_penalty=0.3, frequency_penalty=-0.7, repetition_penalty=1.1,
                                 logit_bias={5: 2.5, 7: -100}, min_tokens=4)
    params = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=sampling)).params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.3, -0.7, 1.1)
    assert params.logit_bias == ((5, 2.5), (7, -100.0)) and params.min_tokens == 4
    assert sampling_from_proto(sampling_to_proto(params)) == params  # what the prefill and decode workers get
    assert sampling_from_proto(pb.SamplingParams(max_tokens=3)).repetition_penalty == 1.0  # unset: off


def test_priority_travels_to_every_decode_attempt():
    valid = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), priority=-40, sampling=pb.SamplingParams(max_tokens=4)))
    assert valid.priority == -40
    assert validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))).priority == 0  # unset: the default
    state = Progress("r", valid.prompt_ids, valid.params, 0.0, 60.0, [SequenceProgress(0, None)], priority=valid.priority)
    assert state.next_attempt().priority == -40
    state.sequences[0].generated = [3]
    assert state.next_attempt().priority == -40  # a migration keeps it


def test_a_retry_after_streamed_tokens_keeps_min_tokens_counting():
    state = Progress("r", [1, 2], SamplingParams(max_tokens=8, min_tokens=5), 0.0, 60.0, [SequenceProgress(0, None)])
    state.sequences[0].generated = [3, 4, 5]
    retry = state.next_attempt()
    assert list(retry.token_ids) == [1, 2, 3, 4, 5]
    assert (retry.sampling.max_tokens, retry.sampling.min_tokens) == (5, 2)
    state.sequences[0].generated = [3] * 7
    assert state.next_attempt().sampling.min_tokens == 0


def test_n_travels_router_to_workers_and_a_group_restarts_whole_with_a_pinned_seed():
    params = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(max_tokens=3, n=4))).params
    assert params.n == 4 and sampling_from_proto(sampling_to_proto(params)) == params
    assert validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))).params.n == 1  # unset: one sequence
    assert params.seed is None and replayable(params).seed is not None  # sampled group: a seed so a restart replays
    greedy = dataclasses.replace(params, temperature=0.0)
    assert replayable(greedy) is greedy and replayable(dataclasses.replace(params, n=1)).seed is None
    state = Progress("r", [1, 2], replayable(params), 0.0, 60.0, [SequenceProgress(i, None) for i in range(4)])
    state.next_attempt()
    state.sequences[2].generated = [9, 8]
    retry = state.next_attempt()
    assert list(retry.token_ids) == [1, 2] and retry.sampling.n == 4 and retry.sampling.max_tokens == 3
    assert retry.sampling.seed == state.params.seed
    assert state.sequences[2].replay([9]) == 1 and state.sequences[2].replay([8, 7]) == 1 and state.sequences[2].replay([6]) == 0
