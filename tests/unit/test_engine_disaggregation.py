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

    def __init__(self, wanted: dict[str, int]):
        self.wanted = wanted
        """request id -> the first prompt position wanted"""
        self.layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def wanted_from(self, request_id: str) -> int | None:
        return self.wanted.get(request_id)

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layers.setdefault(request_id, {})[layer] = (k, v)


def prefill_engine(demo_model, sink: CollectingSink) -> Engine:
    return Engine(EngineConfig(model=demo_model.path, dtype="float32", max_model_len=256), loaded=demo_model, kv_sink=sink)


async def test_prefill_sink_then_remote_decode_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    prompt, params = demo_prompt_ids[0], SamplingParams(max_tokens=MAX_NEW, logprobs=2)
    sink = CollectingSink({"r": 0})
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
        assert first.prompt_kv is None, "streamed layer by layer: no copy taken at the step's end"
        await prefill.release("r")

        reserved = await decode.reserve_remote_kv("r", prompt, params)
        assert reserved.held_tokens == 0  # a cold pool holds nothing of it
        blocks = reserved.block_ids
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


def test_without_a_sink_the_prompt_step_hands_out_the_prompts_kv(demo_model, demo_prompt_ids):
    """The KV sent after the prompt (no layer sink, the CPU default) comes with the prompt's first output, read in
    that step: the sender does not wait for the engine's next step. It is what the pool holds."""
    engine = make_engine(demo_model, max_model_len=256)
    engine.add_request("p", demo_prompt_ids[2], SamplingParams(max_tokens=1), prefill_only=True)
    engine.add_request("g", demo_prompt_ids[3], SamplingParams(max_tokens=2))
    outputs = {out.request_id: out for out in engine.step()}
    assert outputs["g"].prompt_kv is None, "only a prefill-only request's KV is handed out"
    handed, pool = outputs["p"].prompt_kv, engine.prompt_kv("p")
    assert len(handed) == engine.layout.num_layers
    assert all(torch.equal(hk, pk) and torch.equal(hv, pv) and hk.shape[0] == len(demo_prompt_ids[2]) for (hk, hv), (pk, pv) in zip(handed, pool))
    run_to_completion(engine)
    engine.release("p")
    assert_no_leaked_blocks(engine)


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
    sink = CollectingSink({})
    engine = prefill_engine(demo_model, sink)
    engine.add_request("p", demo_prompt_ids[2], SamplingParams(max_tokens=1), prefill_only=True)
    assert run_to_completion(engine)["p"]
    assert sink.layers == {}
    engine.release("p")
    assert_no_leaked_blocks(engine)


def _prefill_and_hand_over(prefill: Engine, sink: CollectingSink, decode: Engine, request_id: str, prompt: list[int],
                           params: SamplingParams) -> tuple[int, int, int]:
    """One prompt through a prefill engine into a decode engine that reuses the leading blocks it holds:
    the sink is asked only for the KV past them, which is written where a KV receiver writes it.
    Returns (tokens the decode engine held, tokens handed over, the first token)."""
    reserved = decode.add_remote_request(request_id, prompt, params)
    sink.wanted[request_id] = reserved.held_tokens
    prefill.add_request(request_id, prompt, params, prefill_only=True)
    first = run_to_completion(prefill)[request_id]
    layers = sink.layers.pop(request_id)
    for layer, (k, v) in layers.items():
        decode.kv_cache.write_tokens(layer, reserved.incoming_block_ids, k, v)
    prefill.release(request_id)
    decode.accept_first_token(request_id, Sample(first[0]))
    decode.commit_remote_kv(request_id)
    return reserved.held_tokens, layers[0][0].shape[0], first[0]


def test_decode_engine_reuses_a_conversations_earlier_turn_and_receives_only_the_rest(demo_model, demo_prompt_ids, hf_greedy):
    """Turn 2 = turn 1's prompt + its answer + a new message: the decode engine still holds turn 1's blocks
    (prefix cache), so only the KV after them arrives, and the tokens still equal HF's."""
    sink = CollectingSink({})
    prefill, decode = prefill_engine(demo_model, sink), make_engine(demo_model, max_model_len=256, dtype="float32")
    block = decode.blocks.block_size
    params = SamplingParams(max_tokens=MAX_NEW)
    turn1 = demo_prompt_ids[0]
    held, handed, first = _prefill_and_hand_over(prefill, sink, decode, "t1", turn1, params)
    answer1 = [first] + run_to_completion(decode)["t1"]
    assert (held, handed) == (0, len(turn1))
    turn2 = turn1 + answer1 + demo_prompt_ids[1]
    held, handed, first = _prefill_and_hand_over(prefill, sink, decode, "t2", turn2, params)
    answer2 = [first] + run_to_completion(decode)["t2"]
    assert held == (len(turn1) + MAX_NEW - 1) // block * block > 0  # every full block turn 1 computed (its last token was never fed)
    assert handed == len(turn2) - held
    assert answer2 == hf_greedy(tuple(turn2), MAX_NEW)
    assert decode.stats().free_blocks == decode.stats().total_blocks
    assert_no_leaked_blocks(prefill)
    assert_no_leaked_blocks(decode)
