"""Bad input over HTTP (OpenAI API) and gRPC is refused with 400 / INVALID_ARGUMENT naming the field;
overload is refused with 429 + Retry-After; the cluster keeps serving and no KV block leaks.

One cluster for the module, with a router queue of 2 requests: the tables never reach admission
(they fail validation first), and the overload test needs the small queue."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2
import pytest
import requests

from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.cluster import LocalCluster, write_config

MODEL = "smollm2-135m"
MAX_QUEUED = 2
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("badinput") / "pdserve.yaml", transport="tcp",
                          router={"max_queued_requests": MAX_QUEUED})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def max_model_len(cluster) -> int:
    return requests.get(cluster.http_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", **fields}


# (id, path, body: dict | bytes, the field the error must name (None: the body as a whole), text in the message)
HTTP_CASES = [
    ("malformed-json", CHAT, b'{"model": "smollm2-135m", "messages": [', None, "JSON"),
    ("non-utf8-body", CHAT, b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "UTF-8"),
    ("body-not-an-object", COMPLETIONS, b'["Hello"]', None, "object"),
    ("empty-body", COMPLETIONS, b"", None, "JSON"),
    ("max-tokens-string", COMPLETIONS, completion(max_tokens="16"), "max_tokens", "integer"),
    ("temperature-string", CHAT, chat(temperature="hot"), "temperature", "number"),
    ("stream-string", CHAT, chat(stream="yes"), "stream", "bool"),
    ("messages-string", CHAT, chat(messages="hi"), "messages", "list"),
    ("content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "string"),
    ("prompt-number", COMPLETIONS, completion(prompt=5), "prompt", "string"),
    ("stop-numbers", COMPLETIONS, completion(stop=[1, 2]), "stop", "string"),
    ("missing-messages", CHAT, {"model": MODEL}, "messages", "required"),
    ("missing-prompt", COMPLETIONS, {"model": MODEL}, "prompt", "required"),
    ("unknown-model", CHAT, chat(model="gpt-4o"), "model", "gpt-4o"),
    ("empty-messages", CHAT, chat(messages=[]), "messages", "at least one"),
    ("empty-prompt", COMPLETIONS, completion(prompt=""), "prompt", "empty"),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", "wizard"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type", "text"),
    ("n-2", CHAT, chat(n=2), "n", "n=1"),
    ("max-tokens-zero", COMPLETIONS, completion(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), "max_tokens", "greater than or equal to 1"),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**12), "max_tokens", "context"),
    ("max-completion-tokens-huge", CHAT, chat(max_completion_tokens=10**6), "max_completion_tokens", "context"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), "temperature", "greater than or equal to 0"),
    ("temperature-above-2", COMPLETIONS, completion(temperature=2.5), "temperature", "less than or equal to 2"),
    ("temperature-nan", COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', "temperature", "finite"),
    ("top-p-zero", CHAT, chat(top_p=0), "top_p", "greater than 0"),
    ("top-p-above-1", CHAT, chat(top_p=1.5), "top_p", "less than or equal to 1"),
    ("seed-negative", COMPLETIONS, completion(seed=-1), "seed", "greater than or equal to 0"),
    ("logprobs-too-many", COMPLETIONS, completion(logprobs=50), "logprobs", "less than or equal to 20"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), "top_logprobs", "logprobs"),
    ("too-many-stops", CHAT, chat(stop=[f"s{i}" for i in range(17)]), "stop", "at most"),
    ("token-id-out-of-vocab", COMPLETIONS, completion(prompt=[1, 10**6]), "prompt", "< "),
    ("two-prompts", COMPLETIONS, completion(prompt=["a", "b"]), "prompt", "one prompt"),
]


def test_bad_http_input_is_400_naming_the_field(cluster, max_model_len):
    cases = HTTP_CASES + [  # the prompt itself leaves too little room: found by the router core after tokenizing
        ("prompt-plus-max-tokens", COMPLETIONS, completion(prompt="Hello " * 8, max_tokens=max_model_len - 4), "max_tokens", "context"),
        ("chat-plus-max-completion-tokens", CHAT, chat(max_completion_tokens=max_model_len - 4), "max_completion_tokens", "context"),
    ]
    failures = []
    for name, path, body, param, text in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = requests.post(cluster.http_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)
        try:
            error = resp.json()["error"]
            assert resp.status_code == 400
            assert error["type"] == "invalid_request_error" and error["param"] == param
            assert text.lower() in error["message"].lower()
            if param:
                assert error["message"].startswith(param)
        except (AssertionError, KeyError, ValueError):
            failures.append(f"{name}: {resp.status_code} {resp.text}")
    assert not failures, "\n".join(failures)
    assert _ok_chat(cluster.http_url)  # still serving
    cluster.assert_no_leaked_blocks()


GRPC_CASES = [
    ("unknown-model", {"model": "gpt-4o", "text": "hi"}, "model"),
    ("no-prompt", {}, "prompt"),
    ("empty-token-ids", {"token_ids": pb.TokenIds(ids=[])}, "prompt.token_ids"),
    ("token-id-out-of-vocab", {"token_ids": pb.TokenIds(ids=[1, 10**6])}, "prompt.token_ids"),
    ("empty-text", {"text": ""}, "prompt"),
    ("empty-chat", {"chat": pb.ChatMessages()}, "messages"),
    ("bad-role", {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")])}, "prompt.chat.messages[0].role"),
    ("temperature-negative", {"text": "hi", "sampling": pb.SamplingParams(temperature=-0.5)}, "sampling.temperature"),
    ("top-p-zero", {"text": "hi", "sampling": pb.SamplingParams(top_p=0.0)}, "sampling.top_p"),
    ("top-p-above-1", {"text": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    ("top-k-negative", {"text": "hi", "sampling": pb.SamplingParams(top_k=-3)}, "sampling.top_k"),
    ("max-tokens-beyond-context", {"text": "hi", "sampling": pb.SamplingParams(max_tokens=10**9)}, "sampling.max_tokens"),
    ("logprobs-too-many", {"text": "hi", "sampling": pb.SamplingParams(logprobs=50)}, "sampling.logprobs"),
    ("too-many-stops", {"text": "hi", "sampling": pb.SamplingParams(stop=[f"s{i}" for i in range(17)])}, "sampling.stop"),
]


def test_bad_grpc_input_is_invalid_argument_naming_the_field(cluster):
    failures = []
    with grpc.insecure_channel(cluster.router.address) as channel:
        stub = pb_grpc.RouterStub(channel)
        for name, fields, field in GRPC_CASES:
            try:
                list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))
                failures.append(f"{name}: accepted")
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or field not in exc.details():
                    failures.append(f"{name}: {exc.code().name} {exc.details()!r}")
        # a request the server cannot even parse is refused, and the server lives on
        garbage = channel.unary_stream("/pdserve.v1.Router/Generate", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError):
            list(garbage(b"\xff\xff\xff\xff", timeout=30))
        ok = list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)), timeout=60))
    assert not failures, "\n".join(failures)
    assert ok[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    cluster.assert_no_leaked_blocks()


async def test_overload_is_429_with_retry_after(cluster):
    """8 concurrent streams against a queue of 2: the excess are refused at once, the rest finish."""

    async def one(client: httpx2.AsyncClient, i: int) -> tuple[int, str | None, list[dict]]:
        body = completion(prompt=f"Count slowly from {i}:", max_tokens=32, stream=True, ignore_eos=True)
        async with client.stream("POST", cluster.http_url + COMPLETIONS, json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code, resp.headers.get("retry-after"), [json.loads(await resp.aread())]
            events = [line.removeprefix("data: ") async for line in resp.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return 200, None, [json.loads(e) for e in events[:-1]]

    async with httpx2.AsyncClient(timeout=120) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(8)))
    admitted = [events for status, _, events in results if status == 200]
    refused = [(retry, events[0]) for status, retry, events in results if status == 429]
    assert len(admitted) + len(refused) == 8, [r[0] for r in results]
    assert 1 <= len(admitted) <= MAX_QUEUED and len(refused) >= 8 - MAX_QUEUED
    for retry_after, body in refused:
        assert retry_after is not None and int(retry_after) >= 1
        assert set(body["error"]) == {"message", "type", "param", "code"}
    for events in admitted:
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["length"]
        assert sum(1 for e in events if e["choices"][0]["text"]) >= 1
    cluster.assert_no_leaked_blocks()
    assert _ok_chat(cluster.http_url)


def _ok_chat(http_url: str) -> bool:
    resp = requests.post(http_url + CHAT, json=chat(max_tokens=3), timeout=60)
    body = resp.json()
    return resp.status_code == 200 and body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
