"""Speculative decoding (n-gram proposals verified in the packed batch) keeps greedy output == HF generate:
alone, in a mixed batch where some requests cannot speculate, under preemption, and with stop rules
landing inside a run of accepted tokens. Every test ends with no KV block leaked."""

from __future__ import annotations

import pytest

from common.tokenization import encode_prompt
from engine import SamplingParams, kernels
from engine.model_loader import load_model
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

MAX_NEW = 40
GROUNDED = [
    "Repeat the following code exactly, with the variable x renamed to y:\n"
    "def area(x):\n    total = x * x\n    if x > 10:\n        total = total + x\n    return total\n",
    "Copy this list back to me, one item per line: apples, pears, plums, cherries, apples, pears, plums.",
]
ALWAYS = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def grounded_ids(demo_model) -> list[list[int]]:
    return [encode_prompt(demo_model.tokenizer, p) for p in GROUNDED]


def _run(engine, prompts, params_of=lambda i: SamplingParams(max_tokens=MAX_NEW)):
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params_of(i))
    out = run_to_completion(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_batch_of_one_matches_hf_with_the_default_switch(demo_model, grounded_ids, hf_greedy):
    engine = make_engine(demo_model, dtype="float32", speculative={"method": "ngram"})
    [got] = _run(engine, grounded_ids[:1])
    assert got == hf_greedy(tuple(grounded_ids[0]), MAX_NEW)
    stats = engine.stats()
    assert stats.spec_steps > 0 and stats.spec_accepted_tokens > 0, stats
    assert stats.steps < MAX_NEW, "accepted proposals should save steps"
    assert_no_leaked_blocks(engine)


def test_mixed_batch_some_speculate_some_cannot(demo_model, demo_prompt_ids, grounded_ids, hf_greedy):
    prompts = grounded_ids + demo_prompt_ids[:4]
    with_logprobs = {1, 3}  # logprobs: these requests never speculate, and still get their logprobs
    engine = make_engine(demo_model, dtype="float32", speculative=ALWAYS)
    got = _run(engine, prompts, lambda i: SamplingParams(max_tokens=MAX_NEW, logprobs=0 if i in with_logprobs else None))
    for ids, tokens in zip(prompts, got):
        assert tokens == hf_greedy(tuple(ids), MAX_NEW)
    assert engine.stats().spec_accepted_tokens > 0
    assert_no_leaked_blocks(engine)


def test_preemption_with_speculation_matches_hf(demo_model, demo_prompt_ids, grounded_ids, hf_greedy):
    prompts = grounded_ids + demo_prompt_ids[:4]
    needed = sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts)
    longest = max(-(-(len(p) + MAX_NEW + 4) // 16) for p in prompts)
    engine = make_engine(demo_model, dtype="float32", num_kv_blocks=max(longest + 2, needed // 2), speculative=ALWAYS)
    for ids, tokens in zip(prompts, _run(engine, prompts)):
        assert tokens == hf_greedy(tuple(ids), MAX_NEW)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0, stats
    assert_no_leaked_blocks(engine)


def test_stop_rules_apply_token_by_token_inside_accepted_runs(demo_model, grounded_ids, hf_greedy):
    ids = grounded_ids[0]
    reference = hf_greedy(tuple(ids), MAX_NEW)
    stop_at = next(i for i in range(12, MAX_NEW) if reference[i] not in reference[:i])
    cases = [SamplingParams(max_tokens=max_tokens) for max_tokens in (13, 17, 22)]
    cases.append(SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(reference[stop_at],)))
    engine = make_engine(demo_model, dtype="float32", speculative=ALWAYS)
    got = _run(engine, [ids] * len(cases), lambda i: cases[i])
    assert got[:3] == [reference[:13], reference[:17], reference[:22]]
    assert got[3] == reference[: stop_at + 1]
    assert engine.stats().spec_accepted_tokens > 0
    assert_no_leaked_blocks(engine)


@pytest.mark.skipif(kernels.load() is None or not kernels.load().one_row_linear_available(),
                    reason="bf16 verifying rows sum as decodes through the C++ kernels, which need AVX512-BF16")
def test_bf16_verifying_rows_give_what_decoding_gives(demo_prompt_ids, grounded_ids):
    """In bf16 a row verifying proposals attends and runs its linear layers as one-token decodes of the same
    positions would (engine/kernels/paged_attention.cpp, engine.one_row_linear), so speculation changes
    no token: for a request alone (its plain steps have one row, its verifying steps several) and in a batch
    where some requests speculate and others cannot. The engines share one loaded model, as a cluster's do."""
    model = load_model("smollm2-135m", dtype="bfloat16")
    for prompts in (grounded_ids[:1], grounded_ids + demo_prompt_ids[:3]):
        plain = _run(make_engine(model), prompts)
        engine = make_engine(model, speculative=ALWAYS)
        assert _run(engine, prompts) == plain
        assert engine.stats().spec_accepted_tokens > 0
        assert_no_leaked_blocks(engine)
