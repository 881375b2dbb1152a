"""Bad input, one table of kinds over both protocols: HTTP (OpenAI API) answers 400 (413, 415)
naming the field, gRPC answers INVALID_ARGUMENT (RESOURCE_EXHAUSTED for an oversized message)
naming the field; a few kinds are accepted on purpose (unknown fields are ignored, a missing model
means the served one). Overload is refused with 429 + Retry-After. Afterwards the cluster keeps
serving and no KV block leaks.

Each `Kind` lists its HTTP cases and its gRPC cases; a protocol where the kind cannot happen by
construction (a negative uint32, an `n` field gRPC does not have) says why in `not_grpc` /
`not_http`. docs/api.md ("Bad input") renders the same table.

One cluster for the module, with a router queue of 2 requests: the table never reaches admission
(it fails validation first), and the overload test needs the small queue."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import httpx2
import pytest
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.openai.body import MAX_BODY_BYTES
from router.validation import MAX_STOP_STRING_CHARS

MODEL = "smollm2-135m"
MAX_QUEUED = 2
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
GRPC_MAX_MESSAGE = 64 << 20  # the router's grpc.max_receive_message_length
INVALID, EXHAUSTED, OK = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OK

Body = dict | bytes | Callable[[int], "dict | bytes"]
GrpcRequest = dict | bytes | Callable[[int], "dict | bytes"]


@dataclass(frozen=True)
class Http:
    path: str
    body: Body  # a callable gets the model's context length
    param: str | None  # the field the error names (None: the body as a whole, or a header)
    text: str  # appears in the message (case-insensitive)
    status: int = 400
    content_type: str | None = "application/json"
    declared_length: int | None = None  # send this Content-Length (the server must refuse before reading)


@dataclass(frozen=True)
class Grpc:
    request: GrpcRequest  # GenerateRequest fields, or the message's wire bytes
    field: str | None  # the details start with it
    code: grpc.StatusCode = INVALID
    text: str = ""


@dataclass(frozen=True)
class Kind:
    name: str
    http: tuple[Http, ...] = ()
    grpc: tuple[Grpc, ...] = ()
    not_http: str = ""
    not_grpc: str = ""


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", **fields}


def gen(text: str = "hi", **sampling) -> dict:
    return {"text": text, "sampling": pb.SamplingParams(**sampling)}


def wire(**fields) -> bytes:
    return pb.GenerateRequest(**fields).SerializeToString()


STOPS_17 = [f"s{i}" for i in range(17)]
LONG_STOP = "x" * (MAX_STOP_STRING_CHARS + 1)
MESSAGE_FIELD_3_AS_VARINT = b"\x18\x05"  # `text` (field 3, a string) sent as an integer
TEXT_WITH_BAD_UTF8 = b"\x1a\x03\xff\xfe\x41"  # `text` holding bytes that are not UTF-8
UNKNOWN_FIELD_111 = b"\xf8\x06\x01"  # field 111 (unknown), varint 1

KINDS: list[Kind] = [
    # ---- types
    Kind("wrong-scalar-type",
         http=(Http(COMPLETIONS, completion(max_tokens="16"), "max_tokens", "integer"),
               Http(CHAT, chat(temperature="hot"), "temperature", "number"),
               Http(CHAT, chat(stream="yes"), "stream", "bool"),
               Http(COMPLETIONS, completion(max_tokens=2.5), "max_tokens", "integer")),
         grpc=(Grpc(MESSAGE_FIELD_3_AS_VARINT, "prompt", text="required"),)),
    Kind("wrong-container-type",
         http=(Http(CHAT, chat(messages="hi"), "messages", "list"),
               Http(CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "string"),
               Http(COMPLETIONS, completion(prompt=5), "prompt", "string"),
               Http(COMPLETIONS, completion(stop=[1, 2]), "stop", "string")),
         not_grpc="typed message: a field's type is fixed by the schema (a mistyped field number is 'wrong-scalar-type')"),
    Kind("body-not-an-object",
         http=(Http(COMPLETIONS, b'["Hello"]', None, "object"),),
         not_grpc="the body is always a GenerateRequest"),
    # ---- encodings
    Kind("not-json",
         http=(Http(CHAT, b'{"model": "smollm2-135m", "messages": [', None, "JSON"),
               Http(COMPLETIONS, b"", None, "JSON"),
               Http(COMPLETIONS, b"prompt=Hello", None, "JSON")),
         grpc=(Grpc(b"\xff\xff\xff\xff", "request", text="not a valid"),)),
    Kind("invalid-utf8",
         http=(Http(CHAT, b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "UTF-8"),
               Http(COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "\\ud800 lone surrogate"}', "prompt", "surrogate")),
         grpc=(Grpc(TEXT_WITH_BAD_UTF8, "request", text="UTF-8"),)),
    Kind("wrong-content-type",
         http=(Http(COMPLETIONS, completion(), None, "Content-Type", status=415, content_type="text/plain"),
               Http(CHAT, chat(), None, "Content-Type", status=415, content_type="application/x-www-form-urlencoded")),
         not_grpc="gRPC fixes the content type (application/grpc)"),
    # ---- unknown fields: ignored, as OpenAI does / as protobuf does
    Kind("unknown-fields-ignored",
         http=(Http(CHAT, chat(max_tokens=2, some_future_field={"x": 1}, metadata={"a": "b"}), None, "", status=200),
               Http(COMPLETIONS, completion(max_tokens=2, made_up=True), None, "", status=200)),
         grpc=(Grpc(wire(text="hi", sampling=pb.SamplingParams(max_tokens=2)) + UNKNOWN_FIELD_111, None, code=OK),)),
    # ---- model
    Kind("missing-model-is-the-served-one",
         http=(Http(COMPLETIONS, {"prompt": "Hello", "max_tokens": 2}, None, "", status=200),),
         grpc=(Grpc(gen(max_tokens=2), None, code=OK),)),
    Kind("wrong-model",
         http=(Http(CHAT, chat(model="gpt-4o"), "model", "gpt-4o"),),
         grpc=(Grpc({"model": "gpt-4o", "text": "hi"}, "model", text="gpt-4o"),)),
    # ---- prompt / messages
    Kind("missing-prompt",
         http=(Http(CHAT, {"model": MODEL}, "messages", "required"),
               Http(COMPLETIONS, {"model": MODEL}, "prompt", "required")),
         grpc=(Grpc({}, "prompt", text="required"),)),
    Kind("empty-prompt",
         http=(Http(COMPLETIONS, completion(prompt=""), "prompt", "empty"),
               Http(COMPLETIONS, completion(prompt=[]), "prompt", "empty")),
         grpc=(Grpc({"text": ""}, "prompt"), Grpc({"token_ids": pb.TokenIds(ids=[])}, "prompt.token_ids", text="empty"))),
    Kind("empty-messages",
         http=(Http(CHAT, chat(messages=[]), "messages", "at least one"),),
         grpc=(Grpc({"chat": pb.ChatMessages()}, "prompt.chat.messages", text="at least one"),)),
    Kind("bad-role",
         http=(Http(CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", "wizard"),),
         grpc=(Grpc({"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")])},
                    "prompt.chat.messages[0].role", text="wizard"),)),
    Kind("unsupported-content-part",
         http=(Http(CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                    "messages[0].content[0].type", "text"),),
         not_grpc="chat content is a plain string"),
    Kind("several-prompts",
         http=(Http(COMPLETIONS, completion(prompt=["a", "b"]), "prompt", "one prompt"),),
         not_grpc="one prompt per message by construction"),
    Kind("token-id-out-of-vocab",
         http=(Http(COMPLETIONS, completion(prompt=[1, 10**6]), "prompt", "< "),),
         grpc=(Grpc({"token_ids": pb.TokenIds(ids=[1, 10**6])}, "prompt.token_ids", text="< "),)),
    Kind("token-id-negative",
         http=(Http(COMPLETIONS, completion(prompt=[1, -5]), "prompt", "token ids"),),
         not_grpc="token ids are uint32"),
    Kind("too-many-token-ids",
         http=(Http(COMPLETIONS, lambda n: completion(prompt=[5] * (n + 1)), "prompt", "context length"),),
         grpc=(Grpc(lambda n: {"token_ids": pb.TokenIds(ids=[5] * (n + 1))}, "prompt", text="context length"),)),
    Kind("prompt-longer-than-context",
         http=(Http(COMPLETIONS, lambda n: completion(prompt="hello " * (n + 10)), "prompt", "context length"),
               Http(CHAT, lambda n: chat(messages=[{"role": "user", "content": "hello " * (n + 10)}]), "messages", "context length"),
               Http(COMPLETIONS, completion(prompt="x" * (4 << 20)), "prompt", "characters")),
         grpc=(Grpc(lambda n: gen("hello " * (n + 10)), "prompt", text="context length"),
               Grpc(gen("x" * (32 << 20)), "prompt.text", text="characters"))),
    Kind("oversized-message",
         http=(Http(COMPLETIONS, completion(), None, "bytes", status=413, declared_length=MAX_BODY_BYTES + 1),),
         grpc=(Grpc(gen("x" * GRPC_MAX_MESSAGE), None, code=EXHAUSTED, text="larger than max"),)),
    # ---- ranges
    Kind("n-out-of-range",
         http=(Http(CHAT, chat(n=17), "n", "[1, 16]"), Http(COMPLETIONS, completion(n=0), "n", "[1, 16]")),
         grpc=(Grpc(gen(n=17), "sampling.n", text="[1, 16]"),)),
    Kind("best-of",
         http=(Http(COMPLETIONS, completion(best_of=3), "best_of", "best_of=1"),),
         not_grpc="no `best_of` field"),
    Kind("unsupported-parameter",
         http=(Http(CHAT, chat(tools=[{"type": "function"}]), "tools[0]", "function"),
               Http(CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "chat template"),
               Http(COMPLETIONS, completion(echo=True), "echo", "not supported")),
         not_grpc="no such fields"),
    Kind("bad-structured-output",
         http=(Http(CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "wizard"}}}),
                    "response_format", "JSON schema"),
               Http(COMPLETIONS, completion(guided_grammar="root ::= missing"), "guided_grammar", "cannot be compiled"),
               Http(CHAT, chat(tool_choice="required"), "tool_choice", "needs tools")),
         grpc=(Grpc(gen(structured_output=pb.StructuredOutput(json_schema='{"type": "wizard"}')), "sampling.structured_output",
                    text="JSON schema"),
               Grpc(gen(structured_output=pb.StructuredOutput(grammar="root ::= missing")), "structured_output",
                    text="cannot be compiled"))),
    Kind("max-tokens-below-1",
         http=(Http(COMPLETIONS, completion(max_tokens=0), "max_tokens", "greater than or equal to 1"),
               Http(CHAT, chat(max_tokens=-5), "max_tokens", "greater than or equal to 1")),
         not_grpc="uint32; 0 means the server default"),
    Kind("max-tokens-beyond-context",
         http=(Http(CHAT, chat(max_tokens=10**12), "max_tokens", "context"),
               Http(CHAT, chat(max_completion_tokens=10**6), "max_completion_tokens", "context")),
         grpc=(Grpc(gen(max_tokens=10**9), "sampling.max_tokens", text="context"),)),
    Kind("prompt-plus-max-tokens-beyond-context",
         http=(Http(COMPLETIONS, lambda n: completion(prompt="Hello " * 8, max_tokens=n - 4), "max_tokens", "context"),
               Http(CHAT, lambda n: chat(max_completion_tokens=n - 4), "max_completion_tokens", "context")),
         grpc=(Grpc(lambda n: gen("Hello " * 8, max_tokens=n - 4), "sampling.max_tokens", text="context"),)),
    Kind("temperature-out-of-range",
         http=(Http(CHAT, chat(temperature=-0.5), "temperature", "greater than or equal to 0"),
               Http(COMPLETIONS, completion(temperature=2.5), "temperature", "less than or equal to 2")),
         grpc=(Grpc(gen(temperature=-0.5), "sampling.temperature", text=">= 0"),)),
    Kind("not-a-finite-number",
         http=(Http(COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', "temperature", "finite"),
               Http(COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "x", "top_p": Infinity}', "top_p", "finite")),
         grpc=(Grpc(gen(temperature=float("nan")), "sampling.temperature", text="finite"),
               Grpc(gen(temperature=float("inf")), "sampling.temperature", text="finite"),
               Grpc(gen(top_p=float("nan")), "sampling.top_p", text="finite"))),
    Kind("top-p-out-of-range",
         http=(Http(CHAT, chat(top_p=0), "top_p", "greater than 0"), Http(CHAT, chat(top_p=1.5), "top_p", "less than or equal to 1")),
         grpc=(Grpc(gen(top_p=0.0), "sampling.top_p", text="(0, 1]"), Grpc(gen(top_p=1.5), "sampling.top_p", text="(0, 1]"))),
    Kind("top-k-out-of-range",
         http=(Http(CHAT, chat(top_k=-2), "top_k", "greater than or equal to -1"),
               Http(CHAT, chat(top_k=2**31), "top_k", "less than or equal to")),
         grpc=(Grpc(gen(top_k=-3), "sampling.top_k", text=">= 0"),)),
    Kind("seed-out-of-range",
         http=(Http(COMPLETIONS, completion(seed=-1), "seed", "greater than or equal to 0"),
               Http(COMPLETIONS, completion(seed=2**64), "seed", "less than or equal to")),
         not_grpc="uint64 holds every valid seed"),
    Kind("logprobs-out-of-range",
         http=(Http(COMPLETIONS, completion(logprobs=50), "logprobs", "less than or equal to 20"),
               Http(CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
               Http(CHAT, chat(top_logprobs=2), "top_logprobs", "logprobs")),
         grpc=(Grpc(gen(logprobs=50), "sampling.logprobs", text="[0, 20]"),)),
    Kind("too-many-stop-strings",
         http=(Http(CHAT, chat(stop=STOPS_17), "stop", "at most 16"),),
         grpc=(Grpc(gen(stop=STOPS_17), "sampling.stop", text="at most 16"),)),
    Kind("stop-string-too-long",
         http=(Http(COMPLETIONS, completion(stop=["ok", LONG_STOP]), "stop[1]", "at most"),),
         grpc=(Grpc(gen(stop=[LONG_STOP]), "sampling.stop[0]", text="at most"),)),
    Kind("stop-token-id-out-of-vocab",
         http=(Http(COMPLETIONS, completion(stop_token_ids=[10**6]), "stop_token_ids", "< "),),
         grpc=(Grpc(gen(stop_token_ids=[10**6]), "sampling.stop_token_ids", text="< "),)),
    Kind("logits-controls-in-range",
         http=(Http(CHAT, chat(max_tokens=3, presence_penalty=-2, frequency_penalty=2, repetition_penalty=100,
                               logit_bias={"5": -100, "6": 100}, min_tokens=3, stop_token_ids=[7]), None, "", status=200),),
         grpc=(Grpc(gen(max_tokens=3, presence_penalty=2, frequency_penalty=-2, repetition_penalty=0.01,
                        logit_bias={5: 100.0}, min_tokens=3), None, code=OK),)),
    Kind("penalty-out-of-range",
         http=(Http(CHAT, chat(presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
               Http(COMPLETIONS, completion(frequency_penalty=-2.5), "frequency_penalty", "greater than or equal to -2"),
               Http(COMPLETIONS, completion(repetition_penalty=0), "repetition_penalty", "greater than or equal to 0.01")),
         grpc=(Grpc(gen(presence_penalty=2.5), "sampling.presence_penalty", text="[-2, 2]"),
               Grpc(gen(frequency_penalty=float("nan")), "sampling.frequency_penalty", text="finite"),
               Grpc(gen(repetition_penalty=0), "sampling.repetition_penalty", text="[0.01, 100]"))),
    Kind("logit-bias-invalid",
         http=(Http(CHAT, chat(logit_bias={"the": 1}), "logit_bias", "token ids"),
               Http(COMPLETIONS, completion(logit_bias={"1000000": 1}), "logit_bias", "not a token id"),
               Http(COMPLETIONS, completion(logit_bias={"5": 150}), "logit_bias.5", "less than or equal to 100"),
               Http(COMPLETIONS, completion(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "at most 300")),
         grpc=(Grpc(gen(logit_bias={10**6: 1}), "sampling.logit_bias", text="not a token id"),
               Grpc(gen(logit_bias={5: 150}), "sampling.logit_bias[5]", text="[-100, 100]"))),
    Kind("min-tokens-above-max-tokens",
         http=(Http(COMPLETIONS, completion(max_tokens=4, min_tokens=5), "min_tokens", "max_tokens=4"),
               Http(CHAT, chat(min_tokens=-1), "min_tokens", "greater than or equal to 0")),
         grpc=(Grpc(gen(max_tokens=4, min_tokens=5), "sampling.min_tokens", text="max_tokens=4"),)),
    Kind("priority-out-of-range",
         http=(Http(CHAT, chat(priority=1001), "priority", "less than or equal to 1000"),
               Http(COMPLETIONS, completion(priority="high"), "priority", "integer"),
               Http(COMPLETIONS, completion(priority=2.5), "priority", "integer"),
               Http(COMPLETIONS, completion(max_tokens=2, priority=-1000), None, "", status=200)),
         grpc=(Grpc({"text": "hi", "priority": 5000}, "priority", text="[-1000, 1000]"),
               Grpc({"text": "hi", "priority": -1001}, "priority", text="[-1000, 1000]"),
               Grpc({"text": "hi", "priority": 1000, "sampling": pb.SamplingParams(max_tokens=2)}, None, code=OK))),
    Kind("request-id-too-long",
         grpc=(Grpc({"request_id": "r" * 1000, "text": "hi"}, "request_id", text="at most"),),
         not_http="the server assigns the id"),
]

HTTP_CASES = [pytest.param(case, id=f"{k.name}-{i}") for k in KINDS for i, case in enumerate(k.http)]
GRPC_CASES = [pytest.param(case, id=f"{k.name}-{i}") for k in KINDS for i, case in enumerate(k.grpc)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("badinput") / "pdserve.yaml", transport="tcp",
                          router={"max_queued_requests": MAX_QUEUED})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def max_model_len(cluster) -> int:
    return requests.get(cluster.http_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.router.address, options=[("grpc.max_send_message_length", -1)]) as ch:
        yield ch


def test_the_table_covers_both_protocols():
    assert len(KINDS) >= 20
    both = [k.name for k in KINDS if k.http and k.grpc]
    assert len(both) >= 20, both
    for k in KINDS:
        assert k.http or k.not_http, f"{k.name}: no HTTP case and no reason"
        assert k.grpc or k.not_grpc, f"{k.name}: no gRPC case and no reason"


@pytest.mark.parametrize("case", HTTP_CASES)
def test_bad_http_input(cluster, max_model_len, case: Http):
    body = case.body(max_model_len) if callable(case.body) else case.body
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if case.declared_length is not None:
        status, payload = _post_declaring_length(cluster.http_url + case.path, data[:1024], case.declared_length)
    else:
        headers = {"Content-Type": case.content_type} if case.content_type else {}
        resp = requests.post(cluster.http_url + case.path, data=data, headers=headers, timeout=60)
        status, payload = resp.status_code, resp.text
    assert status == case.status, payload[:500]
    answer = json.loads(payload)
    if status == 200:
        assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["completion_tokens"] >= 1
        return
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == case.param, error
    assert case.text.lower() in error["message"].lower(), error
    if case.param:
        assert error["message"].startswith(case.param), error


@pytest.mark.parametrize("case", GRPC_CASES)
def test_bad_grpc_input(channel, max_model_len, case: Grpc):
    request = case.request(max_model_len) if callable(case.request) else case.request
    data = request if isinstance(request, bytes) else wire(**request)
    call = channel.unary_stream("/pdserve.v1.Router/Generate", request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString)
    try:
        responses = list(call(data, timeout=60))
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    else:
        code, details = OK, ""
        assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), responses[-1]
    assert code == case.code, f"{code.name}: {details[:300]}"
    assert case.text.lower() in details.lower(), details[:300]
    if case.field:
        assert details.startswith(case.field), details[:300]


def test_still_serving_and_no_block_leaked(cluster):
    assert _ok_chat(cluster.http_url)
    with grpc.insecure_channel(cluster.router.address) as ch:
        ok = list(pb_grpc.RouterStub(ch).Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)), timeout=60))
    assert ok[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert cluster.router.alive()
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


def _post_declaring_length(url: str, data: bytes, length: int) -> tuple[int, str]:
    """POST whose Content-Length announces `length` bytes but sends only `data`: a server that
    checks the announced size answers at once; one that waits for the body would time out here."""
    parts = urlsplit(url)
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head_text, _, body = raw.partition(b"\r\n\r\n")
    return int(head_text.split(b" ", 2)[1]), body.decode()


def _ok_chat(http_url: str) -> bool:
    resp = requests.post(http_url + CHAT, json=chat(max_tokens=3), timeout=60)
    body = resp.json()
    return resp.status_code == 200 and body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] >= 1
