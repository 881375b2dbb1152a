"""Request validation, sampling options, abort and the async front of the engine."""

from __future__ import annotations

import asyncio

import pytest

from engine import InvalidRequestError, ModelLoadError, SamplingParams
from engine.async_engine import AsyncEngine
from engine.model_loader import load_model
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion


@pytest.fixture
def engine(demo_model):
    eng = make_engine(demo_model, max_model_len=256)
    yield eng
    assert_no_leaked_blocks(eng)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], SamplingParams(), "prompt"),
        ([1, 2, 3], SamplingParams(max_tokens=300), "max_tokens"),
        ([1] * 250, SamplingParams(max_tokens=10), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], SamplingParams(temperature=-0.1), "temperature"),
        ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(top_k=-1), "top_k"),
        ([1, 2, 3], SamplingParams(seed=-5), "seed"),
        ([1, 2, 3], SamplingParams(logprobs=99), "logprobs"),
        ([1, 2, 3], SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
        ([1, 2, 3], SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
        ([1, 2, 3], SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        ([1, 2, 3], SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        ([1, -2, 3], SamplingParams(), "prompt_token_ids"),
        ([1, 10**7], SamplingParams(), "prompt_token_ids"),
    ],
)
def test_bad_request_names_the_field_and_leaks_nothing(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.field == field
    assert field in str(info.value)
    assert not engine.has_work()


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("same", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("same", [1, 2, 3], SamplingParams(max_tokens=2))
    assert info.value.field == "request_id"
    run_to_completion(engine)


def test_unknown_model_path_names_the_field(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path / "no-such-model"))
    assert info.value.field == "model"


def test_request_larger_than_kv_pool_is_rejected(demo_model):
    eng = make_engine(demo_model, num_kv_blocks=4)
    with pytest.raises(InvalidRequestError) as info:
        eng.add_request("big", [1] * 60, SamplingParams(max_tokens=10))
    assert info.value.field == "max_tokens"
    assert_no_leaked_blocks(eng)


def test_max_tokens_and_stop_token_ids(engine, demo_prompt_ids):
    prompt = demo_prompt_ids[0]
    engine.add_request("len", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    out = run_to_completion(engine)
    assert len(out["len"]) == 5
    stop_at = out["len"][2]
    engine.add_request("stop", prompt, SamplingParams(max_tokens=5, stop_token_ids=(stop_at,)))
    out2 = run_to_completion(engine)
    assert out2["stop"] == out["len"][: out["len"].index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_across_batches(engine, demo_prompt_ids):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    engine.add_request("alone", demo_prompt_ids[1], params)
    alone = run_to_completion(engine)["alone"]
    for i, p in enumerate(demo_prompt_ids[:4]):
        engine.add_request(f"other{i}", p, SamplingParams(max_tokens=12, temperature=1.0))
    engine.add_request("batched", demo_prompt_ids[1], params)
    batched = run_to_completion(engine)["batched"]
    assert alone == batched
    engine.add_request("greedy", demo_prompt_ids[1], SamplingParams(max_tokens=12))
    engine.add_request("topk1", demo_prompt_ids[1], SamplingParams(max_tokens=12, temperature=1.0, top_k=1))
    out = run_to_completion(engine)
    assert out["greedy"] == out["topk1"]


def test_logprobs(engine, demo_prompt_ids):
    engine.add_request("lp", demo_prompt_ids[0], SamplingParams(max_tokens=4, logprobs=3))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    lps = [lp for o in outputs for lp in o.logprobs]
    tops = [t for o in outputs for t in o.top_logprobs]
    assert len(lps) == 4 and all(lp <= 0 for lp in lps)
    for token, lp, top in zip([t for o in outputs for t in o.new_token_ids], lps, tops):
        assert len(top) == 3 and token in top and abs(top[token] - lp) < 1e-5  # greedy picks the top one


def test_abort_frees_blocks(engine, demo_prompt_ids):
    engine.add_request("a", demo_prompt_ids[3], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().free_blocks < engine.stats().total_blocks
    engine.abort("a")
    outs = engine.step()
    assert any(o.request_id == "a" and o.finished and o.finish_reason.value == "abort" for o in outs)


async def test_async_engine_streams_and_cancels(engine, demo_prompt_ids, hf_greedy):
    front = AsyncEngine(engine)
    front.start()
    try:
        async def collect(rid, ids, n):
            tokens = []
            async for out in front.generate(rid, ids, SamplingParams(max_tokens=n)):
                tokens.extend(out.new_token_ids)
            return tokens

        async def cancel_after(rid, ids, k):
            got = 0
            async for out in front.generate(rid, ids, SamplingParams(max_tokens=200, ignore_eos=True)):
                got += len(out.new_token_ids)
                if got >= k:
                    break  # leaving the stream aborts the request
            return got

        results = await asyncio.gather(
            collect("s0", demo_prompt_ids[0], 10),
            collect("s1", demo_prompt_ids[4], 10),
            cancel_after("c0", demo_prompt_ids[2], 3),
        )
        assert results[0] == hf_greedy(tuple(demo_prompt_ids[0]), 10)
        assert results[1] == hf_greedy(tuple(demo_prompt_ids[4]), 10)
        with pytest.raises(InvalidRequestError):
            async for _ in front.generate("bad", [], SamplingParams()):
                pass
        for _ in range(50):
            stats = await front.stats()
            if stats.free_blocks == stats.total_blocks:
                break
            await asyncio.sleep(0.05)
    finally:
        front.stop()
