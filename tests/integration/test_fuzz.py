"""Fuzzing the public API of a live router: no server error, no crash.

- HTTP: schemathesis generates requests for `/v1/completions` and `/v1/chat/completions` from the
  router's own OpenAPI schema (`/openapi.json`, which describes both request bodies), in its
  positive (fits the schema) and negative (breaks it) modes; every answer must pass the
  `not_a_server_error` check (no 5xx).
- gRPC: hypothesis builds `GenerateRequest`s with arbitrary field values (huge and negative
  numbers where the type allows, NaN/inf floats, random token ids and strings); every call ends OK,
  INVALID_ARGUMENT or RESOURCE_EXHAUSTED, never INTERNAL or UNKNOWN.

Generation stays cheap: a request the router would run gets `max_tokens` of at most 4 (the HTTP
test overrides the generated value; the gRPC strategy draws small values, plus a few huge ones that
validation refuses). After each fuzzer: the router is alive, still answers, and no KV block leaked.
"""

from __future__ import annotations

import grpc
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = "smollm2-135m"
MAX_FUZZ_TOKENS = 4
VOCAB = 49152  # the demo model's tokenizer
HTTP_EXAMPLES = 30  # per operation and generation mode
GRPC_EXAMPLES = 100
ACCEPTED_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ_SETTINGS = {"deadline": None, "derandomize": True, "database": None,
                 "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("fuzz") / "pdserve.yaml", transport="tcp",
                          router={"max_queued_requests": 16})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


# ---- HTTP (schemathesis) -------------------------------------------------------------------------
def cheap(case) -> None:
    """A generated body the server would run is made short: small max_tokens, the served model."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body.get(name), bool) and body[name] > MAX_FUZZ_TOKENS:
            body[name] = MAX_FUZZ_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    if isinstance(body.get("model"), str):
        body["model"] = MODEL  # else nearly every example stops at "model does not exist"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_api_fuzzed_from_its_openapi_schema(cluster, path):
    schema = schemathesis.openapi.from_url(cluster.http_url + "/openapi.json", timeout=10)
    operation = schema[path]["POST"]
    assert operation.body, f"{path}: the OpenAPI schema does not describe the request body"
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    statuses: dict[int, int] = {}
    session = requests.Session()

    @settings(max_examples=HTTP_EXAMPLES * 2, **FUZZ_SETTINGS)
    @given(case=strategy)
    def check(case) -> None:
        cheap(case)
        response = case.call(base_url=cluster.http_url, session=session, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, response.text[:500]

    check()
    assert statuses.get(200, 0) > 0, statuses  # the fuzzer reached generation, not only validation
    assert any(400 <= s < 500 for s in statuses), statuses
    _assert_healthy(cluster)


# ---- gRPC (hypothesis) ---------------------------------------------------------------------------
def _floats() -> st.SearchStrategy[float]:
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1.0, 1e-45, 3.4e38]))


def _u32() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1), st.sampled_from([0, 49151, 49152, 2**32 - 1]))


token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), _u32()), max_size=40)
texts = st.text(max_size=200)  # any Unicode the protobuf can carry (no lone surrogates)
roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=10))

# half the requests draw every sampling field from its valid range, half from anything the type holds
sane_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.integers(1, MAX_FUZZ_TOKENS),
    temperature=st.none() | st.floats(0, 2),
    top_p=st.none() | st.floats(0.01, 1),
    top_k=st.none() | st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.none() | st.floats(0.5, 2),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=5),
    min_tokens=st.integers(0, MAX_FUZZ_TOKENS),
)
wild_sampling = st.builds(
    pb.SamplingParams,
    # 0 (the server default, 256 tokens) is left out: it is valid and only slow
    max_tokens=st.one_of(st.integers(1, MAX_FUZZ_TOKENS), st.sampled_from([2**32 - 1, 10**6, 8191, 8192])),
    temperature=st.none() | _floats(),
    top_p=st.none() | _floats(),
    top_k=st.none() | st.integers(-(2**31), 2**31 - 1),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(_u32(), max_size=70),
    stop=st.lists(st.text(max_size=30), max_size=20),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.one_of(st.integers(0, 25), st.just(2**32 - 1)),
    presence_penalty=_floats(),
    frequency_penalty=_floats(),
    repetition_penalty=st.none() | _floats(),
    logit_bias=st.dictionaries(_u32(), _floats(), max_size=20),
    min_tokens=_u32(),
)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=300))),
        raw=draw(st.booleans()),
        model=draw(st.sampled_from(["", MODEL, "gpt-4o"])),
        skip_detokenize=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["token_ids", "text", "chat", None]))
    if kind == "token_ids":
        request.token_ids.ids.extend(draw(token_ids))
    elif kind == "text":
        request.text = draw(texts)
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(roles, texts), max_size=4)):
            request.chat.messages.add(role=role, content=content)
    request.sampling.CopyFrom(draw(st.one_of(sane_sampling, wild_sampling)))
    return request


def test_grpc_generate_fuzzed_with_hypothesis(cluster):
    seen: dict[str, int] = {}
    with grpc.insecure_channel(cluster.router.address) as channel:
        stub = pb_grpc.RouterStub(channel)

        @settings(max_examples=GRPC_EXAMPLES, **FUZZ_SETTINGS)
        @given(request=generate_requests())
        def check(request: pb.GenerateRequest) -> None:
            code, detail = _call(stub, request)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in ACCEPTED_CODES, f"{code.name}: {detail!r} for {request}"

        check()
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
    _assert_healthy(cluster)


def _call(stub: pb_grpc.RouterStub, request: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    try:
        responses = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    last = responses[-1]
    if last.finish_reason == pb.FINISH_REASON_ERROR:  # a failure after the stream started
        return grpc.StatusCode.INTERNAL, last.error.message
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
    assert last.usage.completion_tokens >= 1
    if request.sampling.max_tokens:
        assert last.usage.completion_tokens <= request.sampling.max_tokens
    return grpc.StatusCode.OK, ""


def _assert_healthy(cluster: LocalCluster) -> None:
    assert cluster.router.alive()
    resp = requests.post(cluster.http_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text
    cluster.assert_no_leaked_blocks()
