"""`n` > 1: one prompt, n sequences. The prompt runs once; sequences 1..n-1 fork from sequence 0
with its full prompt blocks shared by reference count. Greedy: n copies of HF's output; seeded
sampling: reproducible and independent of the batch; preemption, abort and a decode engine that
received the prompt's KV work the same; no block leaks."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, InvalidRequestError, SamplingParams
from engine.sampler import Sample
from tests.conftest import assert_no_leaked_blocks, make_engine

MAX_NEW = 12


def run_groups(engine: Engine, max_steps: int = 10_000) -> dict[tuple[str, int], list[int]]:
    """Every (request id, sequence index)'s tokens, after each sequence finished exactly once."""
    tokens: dict[tuple[str, int], list[int]] = {}
    finished: set[tuple[str, int]] = set()
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens
        for out in engine.step():
            key = (out.request_id, out.index)
            assert key not in finished, f"{key} produced output after finishing"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(key)
    raise AssertionError("engine did not finish")


def test_greedy_n3_is_three_copies_of_hf(demo_model, demo_prompt_ids, hf_greedy):
    engine = make_engine(demo_model)
    for i, prompt in enumerate(demo_prompt_ids[:2]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW, n=3))
    out = run_groups(engine)
    assert sorted(out) == [(f"r{i}", j) for i in range(2) for j in range(3)]
    for i, prompt in enumerate(demo_prompt_ids[:2]):
        expected = hf_greedy(tuple(prompt), MAX_NEW)
        assert [out[(f"r{i}", j)] for j in range(3)] == [expected] * 3
    assert_no_leaked_blocks(engine)


def _sampled(demo_model, prompt, neighbours: list[list[int]]) -> list[list[int]]:
    engine = make_engine(demo_model)
    for i, other in enumerate(neighbours):
        engine.add_request(f"other{i}", other, SamplingParams(max_tokens=MAX_NEW, temperature=1.0))
    engine.add_request("s", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, n=3, ignore_eos=True))
    out = run_groups(engine)
    assert_no_leaked_blocks(engine)
    return [out[("s", j)] for j in range(3)]


def test_seeded_n3_is_reproducible_and_independent_of_neighbours(demo_model, demo_prompt_ids):
    prompt = demo_prompt_ids[1]
    alone = _sampled(demo_model, prompt, [])
    assert alone == _sampled(demo_model, prompt, demo_prompt_ids[2:4])
    assert len({tuple(t) for t in alone}) > 1, "the sequences drew the same tokens: seeds are not per sequence"
    engine = make_engine(demo_model)  # sequence 0 samples with the request's own seed, like n = 1
    engine.add_request("one", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True))
    assert run_groups(engine)[("one", 0)] == alone[0]
    assert_no_leaked_blocks(engine)


def _blocks_in_use_after_fork(demo_model, prompt, requests: list[SamplingParams]) -> tuple[Engine, int]:
    engine = make_engine(demo_model, enable_prefix_caching=False)
    for i, params in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # the prompt(s); forks join running
    engine.step()  # forks recompute their last prompt block, everyone decodes
    return engine, engine.blocks.num_blocks - engine.blocks.num_free_blocks


def test_fork_shares_the_prompt_blocks_and_frees_them(demo_model, demo_prompt_ids):
    prompt = max(demo_prompt_ids, key=len)
    group, shared_use = _blocks_in_use_after_fork(demo_model, prompt, [SamplingParams(max_tokens=MAX_NEW, n=3)])
    separate, separate_use = _blocks_in_use_after_fork(demo_model, prompt, [SamplingParams(max_tokens=MAX_NEW)] * 3)
    full = (len(prompt) - 1) // 16
    assert shared_use == separate_use - 2 * full
    seqs = sorted((s for s in group._requests.values()), key=lambda s: s.index)
    assert [s.index for s in seqs] == [0, 1, 2]
    assert seqs[1].block_ids[:full] == seqs[2].block_ids[:full] == seqs[0].block_ids[:full]
    assert all(group.blocks._ref_counts[b] == 3 for b in seqs[0].block_ids[:full])
    assert len(set(seqs[0].block_ids[full:]) | set(seqs[1].block_ids[full:]) | set(seqs[2].block_ids[full:])) == 3 * len(seqs[0].block_ids[full:])
    for engine in (group, separate):
        run_groups(engine)
        assert_no_leaked_blocks(engine)


def test_preempted_forks_still_match_hf(demo_model, demo_prompt_ids, hf_greedy):
    prompt, other = demo_prompt_ids[0], demo_prompt_ids[1]
    per_seq = -(-(len(prompt) + MAX_NEW) // 16)
    engine = make_engine(demo_model, num_kv_blocks=per_seq + 2 * (-(-MAX_NEW // 16) + 1))  # the least a group of 3 may ask
    engine.add_request("p", prompt, SamplingParams(max_tokens=MAX_NEW, n=3))
    engine.add_request("q", other, SamplingParams(max_tokens=MAX_NEW, n=2))
    out = run_groups(engine)
    assert engine.stats().num_preemptions > 0, "the KV budget did not force a preemption"
    assert [out[("p", j)] for j in range(3)] == [hf_greedy(tuple(prompt), MAX_NEW)] * 3
    assert [out[("q", j)] for j in range(2)] == [hf_greedy(tuple(other), MAX_NEW)] * 2
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_finishes_every_sequence_of_the_group(demo_model, demo_prompt_ids, steps):
    engine = make_engine(demo_model)
    engine.add_request("a", demo_prompt_ids[2], SamplingParams(max_tokens=MAX_NEW, n=3))
    for _ in range(steps):
        engine.step()
    engine.abort("a")
    outs = engine.step()
    assert sorted(o.index for o in outs if o.finished and o.finish_reason.value == "abort") == [0, 1, 2]
    assert not engine.has_work()
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("n,max_tokens", [(0, 4), (17, 4), (16, 200)])
def test_bad_n_names_the_field(demo_model, n, max_tokens):
    engine = make_engine(demo_model, num_kv_blocks=64, max_model_len=256)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=max_tokens, n=n))
    assert info.value.field == "n"
    assert_no_leaked_blocks(engine)


def test_decode_engine_forks_a_received_prompt(demo_model, demo_prompt_ids, hf_greedy):
    """The prefill engine runs the prompt once (n ignored: prefill only) and samples sequence 0's first
    token; the decode engine receives one KV and forks the others from it."""
    prompt, params = demo_prompt_ids[3], SamplingParams(max_tokens=MAX_NEW, n=3)
    prefill = Engine(EngineConfig(model=demo_model.path, dtype="float32", max_model_len=256), loaded=demo_model)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = prefill.step()
    assert [(o.index, o.finished) for o in first] == [(0, True)]
    layers = prefill.prompt_kv("r")
    prefill.release("r")
    decode = make_engine(demo_model, max_model_len=256)
    blocks = decode.add_remote_request("r", prompt, params).block_ids
    for layer, (k, v) in enumerate(layers):
        decode.kv_cache.write_tokens(layer, blocks, k, v)
    head = decode.accept_first_token("r", Sample(first[0].new_token_ids[0]))
    decode.commit_remote_kv("r")
    out = run_groups(decode)
    out[("r", 0)] = head.new_token_ids + out.get(("r", 0), [])
    assert [out[("r", j)] for j in range(3)] == [hf_greedy(tuple(prompt), MAX_NEW)] * 3
    assert_no_leaked_blocks(prefill)
    assert_no_leaked_blocks(decode)


def test_max_num_seqs_counts_the_forks_of_a_group(demo_model, demo_prompt_ids):
    engine = make_engine(demo_model, max_num_seqs=3)
    engine.add_request("g", demo_prompt_ids[0], SamplingParams(max_tokens=4, n=3))
    engine.add_request("other", demo_prompt_ids[1], SamplingParams(max_tokens=4))
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert_no_leaked_blocks(engine)


def test_tensor_parallel_engine_forks_without_any_new_rank_command():
    """Forks are plain step items (shared block ids, the last prompt block recomputed): the followers
    need nothing new, and greedy sequences still equal HF through preemption."""
    from engine.testing.tiny_models import build_tiny_model
    from tests.unit.test_tensor_parallel import PROMPTS, hf_reference, tp_engine

    model = str(build_tiny_model(arch="qwen2"))
    prompts = PROMPTS[1:3]
    engine = tp_engine(model, 2, num_kv_blocks=14)
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=20, n=3))
        out = run_groups(engine)
        assert engine.stats().num_preemptions > 0, "14 blocks for 6 sequences must preempt"
        for i, expected in enumerate(hf_reference(model, prompts, 20)):
            assert [out[(f"r{i}", j)] for j in range(3)] == [expected] * 3
        assert_no_leaked_blocks(engine)
    finally:
        engine.close()
