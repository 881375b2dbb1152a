"""OpenAI API request parsing and response shapes, in process (a fake router core, no model)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from common.errors import InvalidRequestError
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.admission import Overloaded, Unavailable
from router.http_app import build_app
from router.metrics import RouterMetrics
from router.openai.body import parse_body
from router.openai.convert import param_from_service, prepare
from router.openai.errors import OpenAIError, loc_to_param
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.request import ChatPrompt, RouterRequest
from router.settings import RouterSettings

SETTINGS = RouterSettings(model_name="tiny", max_model_len=128, transport="local")


def parsed(schema, **body):
    return prepare(parse_body(json.dumps(body).encode(), schema), SETTINGS)


def error_of(schema, body: dict | bytes) -> OpenAIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(OpenAIError) as info:
        prepare(parse_body(raw, schema), SETTINGS)
    assert info.value.status == 400
    return info.value


def test_chat_request_becomes_a_chat_prompt():
    prep = parsed(ChatCompletionRequest, model="tiny", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ], max_completion_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", logprobs=True, top_logprobs=2,
        stream=True, stream_options={"include_usage": True}, user="u", some_future_field={"x": 1})
    req = prep.request
    assert isinstance(req.prompt, ChatPrompt) and req.model == "tiny" and req.request_id
    assert [(m.role, m.content) for m in req.prompt.messages] == [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.logprobs) == (7, 0.0, 0.5, 3, ["\n"], 2)
    assert prep.stream and prep.include_usage and prep.max_tokens_param == "max_completion_tokens"
    assert prep.id.startswith("chatcmpl-")


def test_completion_defaults_follow_openai():
    prep = parsed(CompletionRequest, model="tiny", prompt="Hello")
    req = prep.request
    assert req.prompt.text == "Hello" and req.prompt.raw
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0 and req.sampling.logprobs is None
    assert not prep.stream and prep.id.startswith("cmpl-")
    assert parsed(CompletionRequest, prompt=["Hi"]).request.prompt.text == "Hi"  # model may be left out
    assert list(parsed(CompletionRequest, prompt=[1, 2, 3]).request.prompt.ids) == [1, 2, 3]
    assert list(parsed(CompletionRequest, prompt=[[4, 5]]).request.prompt.ids) == [4, 5]
    chat = parsed(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}]).request.sampling
    assert chat.max_tokens is None  # chat: the server default


@pytest.mark.parametrize("schema, body, param", [
    (CompletionRequest, b"\xff", None),
    (CompletionRequest, b"{", None),
    (CompletionRequest, b"[1" * 100000, None),
    (CompletionRequest, b"null", None),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.0}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature"),
    (CompletionRequest, {"prompt": "x", "echo": True}, "echo"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of"),
    (CompletionRequest, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    (CompletionRequest, {"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    (CompletionRequest, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias.5"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    (CompletionRequest, {"prompt": [-1]}, "prompt"),
    (CompletionRequest, {"prompt": []}, "prompt"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 128}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (ChatCompletionRequest, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": ["hi"]}, "messages[0]"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    (CompletionRequest, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}},
     "response_format"),
    (CompletionRequest, {"prompt": "x", "guided_regex": "[a-"}, "guided_regex"),
    (CompletionRequest, {"prompt": "x", "guided_json": "{nope"}, "guided_json"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "model": "other"}, "model"),
])
def test_bad_requests_name_the_field(schema, body, param):
    error = error_of(schema, body)
    assert error.param == param
    assert error.body()["error"]["type"] == "invalid_request_error"
    if param:
        assert error.message.startswith(param + ":")


@pytest.mark.parametrize("body", [
    {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": [""]}, {"prompt": [[1], [2]]}, {"prompt": [[]]},
    {"prompt": "x", "suffix": "y"},
])
def test_the_schema_refuses_what_prepare_refuses(body):
    """A schema-driven client (or fuzzer) that follows /openapi.json sends what is served: each body here is
    refused by `prepare` and by the schema alike."""
    import jsonschema

    error_of(CompletionRequest, body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, CompletionRequest.model_json_schema())


def test_logits_controls_reach_the_router_request():
    chat = parsed(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], presence_penalty=1,
                  frequency_penalty=-0.5, logit_bias={"5": 2, "17": -100.0}, repetition_penalty=1.2, min_tokens=3,
                  stop_token_ids=[9]).request.sampling
    assert (chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (1.0, -0.5, 1.2)
    assert chat.logit_bias == {5: 2.0, 17: -100.0} and chat.min_tokens == 3 and chat.stop_token_ids == [9]
    plain = parsed(CompletionRequest, prompt="x").request.sampling
    assert plain.params(16) == parsed(CompletionRequest, prompt="x", presence_penalty=0, logit_bias={}).request.sampling.params(16)
    assert not plain.params(16).adjusts_logits


def test_field_names_from_the_router_core():
    chat = parsed(ChatCompletionRequest, messages=[{"role": "user", "content": "x"}], max_completion_tokens=3)
    completion = parsed(CompletionRequest, prompt="x")
    assert param_from_service("sampling.max_tokens", chat) == "max_completion_tokens"
    assert param_from_service("sampling.max_tokens", completion) == "max_tokens"
    assert param_from_service("sampling.top_k", completion) == "top_k"
    assert param_from_service("prompt.token_ids", completion) == "prompt"
    assert param_from_service("prompt.chat.messages[1].role", chat) == "messages[1].role"
    assert param_from_service("messages", chat) == "messages"
    assert loc_to_param(("body", "messages", 0, "content", "list[ContentPart]", 1)) == ("messages[0].content", True)


# ---- the app in process, against a scripted router core -------------------------------------------
class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


class FakePool:
    def has_role(self, role):
        return True


class FakeService:
    def __init__(self, script):
        self.settings, self.metrics, self.pool, self.tokenizer = SETTINGS, RouterMetrics(), FakePool(), FakeTokenizer()
        self.script = script
        self.seen: list[RouterRequest] = []

    async def stream(self, request, timeout_s=None, trace_parent=None):
        self.seen.append(request)
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


def chunk(text, ids, finish=0, **kw):
    logprobs = [pb.Logprob(token_id=i, logprob=-0.5, top=[pb.TopLogprob(token_id=i, logprob=-0.5)]) for i in ids]
    return pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=ids, text=text, logprobs=logprobs), finish_reason=finish, **kw)


GOOD = [chunk("Hel", [1], prompt_token_ids=[7, 8, 9]), chunk("", [2]),
        chunk("lo", [3], pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=3, completion_tokens=3))]


def client_for(script) -> tuple[TestClient, FakeService]:
    service = FakeService(script)
    return TestClient(build_app(service)), service


def sse_events(text: str) -> list:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_response_shape():
    client, _ = client_for(GOOD)
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 1}).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Hello", "finish_reason": "length", "logprobs": {
        "tokens": ["<1>", "<2>", "<3>"], "token_logprobs": [-0.5] * 3,
        "top_logprobs": [{"<1>": -0.5}, {"<2>": -0.5}, {"<3>": -0.5}], "text_offset": [0, 3, 6]}}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 6


def test_chat_stream_shape_with_usage():
    client, _ = client_for(GOOD)
    resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                     "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in events[1:-1]] == [{"content": "Hel"}, {"content": "lo"}]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, "length"]
    assert all(e["object"] == "chat.completion.chunk" and e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 6


@pytest.mark.parametrize("raised, status, param", [
    (InvalidRequestError("sampling.max_tokens", "too long"), 400, "max_tokens"),
    (InvalidRequestError("prompt.chat.messages[0].role", "bad"), 400, "messages[0].role"),
    (Overloaded("full"), 429, None),
    (Unavailable("draining"), 503, None),
])
def test_refusals_before_the_first_token(raised, status, param):
    client, _ = client_for([raised])
    for stream in (False, True):
        resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream})
        assert resp.status_code == status
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert (resp.headers.get("retry-after") == "1") == (status == 429)


def test_failure_mid_stream_is_an_error_event():
    failed = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ERROR, error=pb.Error(code=pb.ERROR_CODE_UNAVAILABLE, message="worker lost"))
    client, _ = client_for([GOOD[0], failed])
    resp = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["text"] == "Hel" and events[-1]["error"]["message"] == "worker lost"
    resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "worker lost"


def test_models_and_unknown_routes():
    client, _ = client_for([])
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/other").status_code == 404
    resp = client.get("/v1/nothing")
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = client.get("/v1/completions")
    assert resp.status_code == 405 and "error" in resp.json()
    assert client.get("/health").status_code == 200 and b"pdserve_requests_total" in client.get("/metrics").content
