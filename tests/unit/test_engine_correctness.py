"""Greedy outputs of the engine equal transformers' generate, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engine import SamplingParams, prompt_attention
from engine.model_loader import LoadedModel
from tests.conftest import assert_no_leaked_blocks, hf_generate, make_engine, run_to_completion

MAX_NEW = 24


def _run_batch(engine, prompts, max_tokens=MAX_NEW, **params):
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, **params))
    out = run_to_completion(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


def _check_against_hf(results, prompts, hf_greedy, max_tokens=MAX_NEW):
    for ids, got in zip(prompts, results):
        assert got == hf_greedy(tuple(ids), max_tokens)


def test_batch_of_mixed_lengths_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    lengths = sorted(len(p) for p in demo_prompt_ids)
    assert lengths[0] < 40 and lengths[-1] > 120, "prompts must have mixed lengths"
    engine = make_engine(demo_model)
    _check_against_hf(_run_batch(engine, demo_prompt_ids), demo_prompt_ids, hf_greedy)
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("kernel_attends_prompts", [True, False], ids=["prompts-as-kernel-rows", "prompts-through-sdpa"])
def test_whole_prompts_through_either_attention_path_match_hf(demo_model, demo_prompt_ids, hf_greedy, monkeypatch, kernel_attends_prompts):
    """engine.prompt_attention picks one path per machine; both must give transformers' tokens."""
    monkeypatch.setattr(prompt_attention, "kernel_attends_prompts", lambda *args: kernel_attends_prompts)
    engine = make_engine(demo_model)
    assert engine.runner.batched or engine.runner.prompts_apart is not kernel_attends_prompts
    _check_against_hf(_run_batch(engine, demo_prompt_ids), demo_prompt_ids, hf_greedy)
    assert_no_leaked_blocks(engine)


def test_forced_chunked_prefill_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    engine = make_engine(demo_model, max_num_batched_tokens=24)
    _check_against_hf(_run_batch(engine, demo_prompt_ids), demo_prompt_ids, hf_greedy)
    assert engine.stats().steps > sum(len(p) for p in demo_prompt_ids) // 24, "prompts were not chunked"
    assert_no_leaked_blocks(engine)


def test_forced_preemption_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    needed = sum(-(-(len(p) + MAX_NEW) // 16) for p in demo_prompt_ids)
    longest = max(-(-(len(p) + MAX_NEW) // 16) for p in demo_prompt_ids)
    engine = make_engine(demo_model, num_kv_blocks=max(longest + 2, needed // 2))
    _check_against_hf(_run_batch(engine, demo_prompt_ids), demo_prompt_ids, hf_greedy)
    assert engine.stats().num_preemptions > 0, "the KV budget did not force a preemption"
    assert_no_leaked_blocks(engine)


@pytest.mark.parametrize("kernel_attends_prompts", [True, False], ids=["chunks-as-kernel-rows", "chunks-through-sdpa"])
def test_prefix_cache_reuses_blocks_and_matches_hf(demo_model, hf_greedy, monkeypatch, kernel_attends_prompts):
    """The second prompt's chunk after the cached prefix (over 16 tokens) goes by the machine's measured choice."""
    monkeypatch.setattr(prompt_attention, "kernel_attends_prompts", lambda *args: kernel_attends_prompts)
    tok = demo_model.tokenizer
    shared = tok("You are a careful assistant. Answer briefly and precisely. " * 8)["input_ids"]
    first = shared + tok(" Question: what is 2 + 2?")["input_ids"]
    second = shared + tok(" Question: name a colour that a clear sky has at noon, and one that a ripe lemon has.")["input_ids"]
    assert len(second) - (len(shared) // 16) * 16 > 16
    engine = make_engine(demo_model)
    assert engine.runner.batched or engine.runner.prompts_apart is not kernel_attends_prompts
    engine.add_request("first", first, SamplingParams(max_tokens=12))
    run_to_completion(engine)
    assert engine.stats().prefix_hit_tokens == 0
    engine.add_request("second", second, SamplingParams(max_tokens=12))
    out = run_to_completion(engine)
    hits = engine.stats().prefix_hit_tokens
    assert hits >= (len(shared) // 16 - 1) * 16, f"only {hits} prefix tokens reused of {len(shared)}"
    assert out["second"] == hf_greedy(tuple(second), 12)
    assert_no_leaked_blocks(engine)


def _tiny(model_cls, config_cls, **extra) -> LoadedModel:
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    model = model_cls(config).eval()
    return LoadedModel(model=model, tokenizer=None, path="<in-memory>", dtype=torch.float32)


@pytest.mark.parametrize(
    "model_cls,config_cls",
    [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)],
    ids=["llama", "qwen2"],
)
def test_tiny_random_models_match_hf(model_cls, config_cls):
    loaded = _tiny(model_cls, config_cls)
    if config_cls is Qwen2Config:
        assert loaded.model.model.layers[0].self_attn.q_proj.bias is not None
    reference_config = config_cls.from_dict(loaded.model.config.to_dict())
    reference_config._attn_implementation = "sdpa"
    reference = model_cls(reference_config).eval()
    reference.load_state_dict(loaded.model.state_dict())
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (3, 17, 40, 90)]
    engine = make_engine(loaded, max_num_batched_tokens=32)
    results = _run_batch(engine, prompts, max_tokens=16, ignore_eos=True)
    for ids, got in zip(prompts, results):
        assert got == hf_generate(reference, ids, 16)
    assert_no_leaked_blocks(engine)
