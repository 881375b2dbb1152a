"""The OpenAI-compatible HTTP API on a real cluster (router + prefill + decode processes), driven by
the official `openai` client, sync and async, streaming and not. Greedy text equals HF `generate`;
leaving a stream early or timing out a request frees every KV block."""

from __future__ import annotations

import asyncio

import openai
import pytest
import requests
from transformers import LogitsProcessorList

from bench.cluster import LocalCluster, write_config
from common.tokenization import encode_chat
from tests.conftest import hf_generate
from tests.unit.test_engine_sampling_controls import OpenAIPenalties

MODEL = "smollm2-135m"
MAX_NEW = 16
COMPLETION_NEW = 8  # the code prompt never stops early: keep it short (decode is slow on a loaded 2-core box)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("openai") / "pdserve.yaml", transport="tcp")
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return cluster.http_url + "/v1"


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def async_client(base_url: str, **kwargs) -> openai.AsyncOpenAI:
    kwargs = {"max_retries": 0, "timeout": 120, **kwargs}
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", **kwargs)


def expected_greedy(tokenizer, hf_greedy, prompt_ids: list[int], n: int = MAX_NEW) -> tuple[str, list[int]]:
    ids = hf_greedy(tuple(prompt_ids), n)
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def expected_finish(tokenizer, ids: list[int]) -> str:
    return "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"


def test_models_lists_the_served_model(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert requests.get(base_url.removesuffix("/v1") + "/health", timeout=10).status_code == 200


def test_chat_completion_greedy_matches_hf(client, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    prompt_ids = encode_chat(tok, CHAT)
    text, ids = expected_greedy(tok, hf_greedy, prompt_ids)
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_NEW, user="ignored")
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == expected_finish(tok, ids)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert resp.usage.total_tokens == len(prompt_ids) + len(ids)
    assert choice.logprobs is None


def test_chat_logprobs(client, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    text, ids = expected_greedy(tok, hf_greedy, encode_chat(tok, CHAT))
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_NEW,
                                          logprobs=True, top_logprobs=2)
    entries = resp.choices[0].logprobs.content
    tokens = "".join(e.token for e in entries).removesuffix(tok.eos_token)  # the token, special or not
    assert entries and text == tokens
    for entry in entries:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token
    # the first token was sampled on the prefill worker: its logprob came in the KV trailer
    assert len(entries) == len(ids)


def test_chat_completion_streaming_sync(client, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    prompt_ids = encode_chat(tok, CHAT)
    text, ids = expected_greedy(tok, hf_greedy, prompt_ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=MAX_NEW,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected_finish(tok, ids)]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


async def test_completion_greedy_matches_hf_async(base_url, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    prompt_ids = tok(PROMPT)["input_ids"]
    text, ids = expected_greedy(tok, hf_greedy, prompt_ids, COMPLETION_NEW)
    async with async_client(base_url) as client:
        resp, stream, by_ids = await asyncio.gather(
            client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=COMPLETION_NEW),
            client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=COMPLETION_NEW, stream=True),
            client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=COMPLETION_NEW),
        )
        streamed = [chunk async for chunk in stream]
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == text and by_ids.choices[0].text == text
    assert resp.choices[0].finish_reason == expected_finish(tok, ids)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == [expected_finish(tok, ids)]


def test_stop_string_cuts_the_text(client, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    text, _ = expected_greedy(tok, hf_greedy, tok(PROMPT)["input_ids"], COMPLETION_NEW)
    stop = text.strip().split()[2]  # a word in the middle of the greedy continuation
    resp = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=COMPLETION_NEW, stop=[stop, "@@@"])
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_logits_controls_match_hf_through_the_cluster(cluster, client, demo_model, hf_reference, hf_greedy):
    """Penalties, min_tokens and logit_bias (vLLM extensions via extra_body) travel router -> P -> D
    and give HF generate's tokens with the same controls; each changes the plain greedy output."""
    tok = demo_model.tokenizer
    chat_ids = encode_chat(tok, CHAT)
    plain = hf_greedy(tuple(chat_ids), MAX_NEW)
    assert len(plain) < 12 and plain[-1] == tok.eos_token_id  # the answer stops early without min_tokens
    expected = hf_generate(hf_reference, chat_ids, MAX_NEW, repetition_penalty=1.3, min_new_tokens=12)
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_NEW,
                                          extra_body={"repetition_penalty": 1.3, "min_tokens": 12})
    assert resp.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert resp.usage.completion_tokens == len(expected) >= 12

    code_ids = tok(PROMPT)["input_ids"]
    banned = hf_greedy(tuple(code_ids), COMPLETION_NEW)[0]
    penalties = OpenAIPenalties(len(code_ids), presence=1.5, frequency=1.0)
    expected = hf_generate(hf_reference, code_ids, COMPLETION_NEW, sequence_bias=[[[banned], -100.0]],
                           logits_processor=LogitsProcessorList([penalties]))
    resp = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=COMPLETION_NEW,
                                     presence_penalty=1.5, frequency_penalty=1.0, logit_bias={str(banned): -100})
    assert resp.choices[0].text == tok.decode(expected, skip_special_tokens=True) and expected[0] != banned
    cluster.assert_no_leaked_blocks()


async def test_leaving_streams_early_frees_every_block(cluster, base_url):
    """16 streams, each closed after a few chunks: the router cancels D and P, no block leaks."""

    async def read_a_little(client: openai.AsyncOpenAI, i: int) -> int:
        kwargs = {"model": MODEL, "temperature": 0.8, "seed": i, "max_tokens": 200, "stream": True, "extra_body": {"ignore_eos": True}}
        if i % 2:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": f"Tell me a story #{i}"}], **kwargs)
        else:
            stream = await client.completions.create(prompt=f"Once upon a time, number {i}", **kwargs)
        seen = 0
        async with stream:
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
        return seen

    async with async_client(base_url) as client:
        seen = await asyncio.gather(*(read_a_little(client, i) for i in range(16)))
    assert seen == [3] * 16
    cluster.assert_no_leaked_blocks()
    assert _metric(cluster, "pdserve_router_queue_requests") == 0
    assert _metric(cluster, 'pdserve_requests_total{outcome="cancelled"}') >= 16


async def test_client_giving_up_cancels_the_request(cluster, base_url):
    """Non-streaming requests whose client times out, once during the prefill of a long prompt and
    once while decoding: the router notices the disconnect and cancels the work on P and D."""
    before = _metric(cluster, 'pdserve_requests_total{outcome="cancelled"}')
    long_prompt = "The history of the Roman Empire spans many centuries. " * 30  # ~300 tokens: a prefill >> 0.3 s here
    for prompt, timeout in ((long_prompt, 0.3), (PROMPT, 1.0)):
        async with async_client(base_url, timeout=timeout) as client:
            with pytest.raises(openai.APITimeoutError):
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, extra_body={"ignore_eos": True})
    cluster.assert_no_leaked_blocks()
    assert _metric(cluster, 'pdserve_requests_total{outcome="cancelled"}') == before + 2
    # and the service keeps serving
    async with async_client(base_url) as client:
        resp = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.usage.completion_tokens >= 1


def _metric(cluster, name: str) -> float:
    text = requests.get(cluster.http_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")
