"""The engine's API for disaggregation, with real engines and no network in between: a prefill engine
hands every finished layer of a prompt's KV to the `KVLayerSink` it was built with; a decode engine
reserves blocks, takes that KV and the first token (with its logprobs), emits the token once as the
request's first output and decodes the rest. Greedy tokens equal HF `generate`; no block leaks."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.sampler import Sample
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

MAX_NEW = 8


class CollectingSink:
    """A KVLayerSink that keeps what the engine hands over, for the requests it was told to want."""

    def __init__(self, wanted: set[str]):
        self.wanted = wanted
        self.layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def wants(self, request_id: str) -> bool:
        return request_id in self.wanted

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layers.setdefault(request_id, {})[layer] = (k, v)


def prefill_engine(demo_model, sink: CollectingSink) -> Engine:
    return Engine(EngineConfig(model=demo_model.path, dtype="float32", max_model_len=256), loaded=demo_model, kv_sink=sink)


async def test_prefill_sink_then_remote_decode_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    prompt, params = demo_prompt_ids[0], SamplingParams(max_tokens=MAX_NEW, logprobs=2)
    sink = CollectingSink({"r"})
    p_engine, d_engine = prefill_engine(demo_model, sink), make_engine(demo_model, max_model_len=256)
    prefill, decode = AsyncEngine(p_engine), AsyncEngine(d_engine)
    prefill.start()
    decode.start()
    try:
        first = [out async for out in prefill.generate("r", prompt, params, prefill_only=True)][0]
        layers = await prefill.prompt_kv("r")
        assert sorted(sink.layers["r"]) == list(range(prefill.layout.num_layers)) == list(range(len(layers)))
        for layer, (k, v) in enumerate(layers):  # what streamed during the step is what stayed in the pool
            assert torch.equal(sink.layers["r"][layer][0], k) and torch.equal(sink.layers["r"][layer][1], v)
        await prefill.release("r")

        blocks = await decode.reserve_remote_kv("r", prompt, params)
        stream = decode.open_stream("r")
        for layer, (k, v) in enumerate(layers):
            decode.kv_cache.write_tokens(layer, blocks, k, v)  # what a KV receiver does
        sampled = Sample(first.new_token_ids[0], first.logprobs[0], first.top_logprobs[0])
        decode.commit_remote_kv("r", sampled)
        outputs = [out async for out in decode.generate_remote("r", stream)]
    finally:
        prefill.stop()
        decode.stop()
    assert outputs[0].new_token_ids == [sampled.token_id]  # the first token, once, with its logprobs
    assert outputs[0].logprobs == [sampled.logprob] and outputs[0].top_logprobs == [sampled.top_logprobs]
    tokens = [t for out in outputs for t in out.new_token_ids]
    assert tokens == hf_greedy(tuple(prompt), MAX_NEW)
    assert len([lp for out in outputs for lp in out.logprobs]) == len(tokens)
    assert outputs[-1].finished
    assert_no_leaked_blocks(p_engine)
    assert_no_leaked_blocks(d_engine)


def test_request_that_ends_at_its_first_token_frees_its_blocks(demo_model, demo_prompt_ids):
    engine = make_engine(demo_model, max_model_len=256)
    assert engine.add_remote_request("one", demo_prompt_ids[1], SamplingParams(max_tokens=1))
    out = engine.accept_first_token("one", Sample(42))
    engine.commit_remote_kv("one")
    assert out.new_token_ids == [42] and out.finished and out.finish_reason.value == "length"
    assert out.logprobs == []  # none asked for, none carried
    assert run_to_completion(engine) == {}
    assert_no_leaked_blocks(engine)


def test_sink_is_not_asked_for_requests_it_does_not_want(demo_model, demo_prompt_ids):
    sink = CollectingSink(set())
    engine = prefill_engine(demo_model, sink)
    engine.add_request("p", demo_prompt_ids[2], SamplingParams(max_tokens=1), prefill_only=True)
    assert run_to_completion(engine)["p"]
    assert sink.layers == {}
    engine.release("p")
    assert_no_leaked_blocks(engine)
