"""Penalties, logit_bias and min_tokens through the real engine (SmolLM2): greedy with each control
equals transformers' `generate` with the same control, token for token, all batched together with a
plain greedy request (also when the KV budget forces preemption by recompute); the disaggregated path (first token on a prefill-only engine, the rest on a
decode engine) gives the same tokens as one engine; no KV block leaks."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine import SamplingParams
from engine.sampler import Sample
from tests.conftest import assert_no_leaked_blocks, hf_generate, make_engine, run_to_completion

MAX_NEW = 24
MIN_TOKENS = 14


class OpenAIPenalties(LogitsProcessor):
    """presence/frequency penalties by OpenAI's formula over the generated tokens (transformers has
    no processor for them)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


@pytest.fixture(scope="module")
def cases(demo_prompt_ids, hf_greedy):
    """request id -> (prompt, engine params, HF generate kwargs)."""
    stops_early, repeats, code, biased, plain = (demo_prompt_ids[i] for i in (0, 3, 4, 5, 7))
    first = hf_greedy(tuple(biased), MAX_NEW)[0]
    penalties = OpenAIPenalties(len(code), presence=0.8, frequency=0.6)
    return {
        "repetition": (repeats, SamplingParams(max_tokens=MAX_NEW, repetition_penalty=1.3), {"repetition_penalty": 1.3}),
        "min_tokens": (stops_early, SamplingParams(max_tokens=MAX_NEW, min_tokens=MIN_TOKENS), {"min_new_tokens": MIN_TOKENS}),
        "logit_bias": (biased, SamplingParams(max_tokens=MAX_NEW, logit_bias={first: -100.0}),
                       {"sequence_bias": [[[first], -100.0]]}),
        "presence_frequency": (code, SamplingParams(max_tokens=MAX_NEW, presence_penalty=0.8, frequency_penalty=0.6),
                               {"logits_processor": LogitsProcessorList([penalties])}),
        "plain": (plain, SamplingParams(max_tokens=MAX_NEW), {}),
    }


@pytest.mark.parametrize("num_kv_blocks", [None, 12], ids=["roomy", "preempting"])
def test_each_control_matches_hf_generate_in_one_batch(demo_model, hf_reference, hf_greedy, cases, num_kv_blocks):
    engine = make_engine(demo_model, max_model_len=512, num_kv_blocks=num_kv_blocks)
    for rid, (prompt, params, _) in cases.items():
        engine.add_request(rid, prompt, params)
    out = run_to_completion(engine)
    assert (engine.stats().num_preemptions > 0) == (num_kv_blocks is not None)
    for rid, (prompt, _, hf_kwargs) in cases.items():
        assert out[rid] == hf_generate(hf_reference, prompt, MAX_NEW, **hf_kwargs), rid
        if rid != "plain":
            assert out[rid] != hf_greedy(tuple(prompt), MAX_NEW), f"{rid} did not change the output"
    eos = set(demo_model.eos_token_ids)
    plain_stop = hf_greedy(tuple(cases["min_tokens"][0]), MAX_NEW)
    assert len(plain_stop) < MIN_TOKENS and plain_stop[-1] in eos, "the prompt must stop early without min_tokens"
    assert len(out["min_tokens"]) >= MIN_TOKENS and not eos & set(out["min_tokens"][:MIN_TOKENS - 1])
    assert_no_leaked_blocks(engine)


def disaggregated(demo_model, prompt: list[int], params: SamplingParams) -> list[int]:
    """First token on a prefill-only engine, its KV copied into a decode engine that samples the rest."""
    prefill, decode = make_engine(demo_model, max_model_len=512), make_engine(demo_model, max_model_len=512)
    prefill.add_request("r", prompt, params, prefill_only=True)
    first = run_to_completion(prefill)["r"]
    layers = prefill.prompt_kv("r")
    prefill.release("r")
    blocks = decode.add_remote_request("r", prompt, params).block_ids
    for layer, (k, v) in enumerate(layers):
        decode.kv_cache.write_tokens(layer, blocks, k, v)
    out = decode.accept_first_token("r", Sample(first[0]))
    decode.commit_remote_kv("r")
    tokens = first + run_to_completion(decode).get("r", [])
    assert out.new_token_ids == first
    assert_no_leaked_blocks(prefill)
    assert_no_leaked_blocks(decode)
    return tokens


@pytest.mark.parametrize("rid", ["repetition", "min_tokens", "presence_frequency"])
def test_disaggregated_path_samples_what_one_engine_does(demo_model, hf_reference, cases, rid):
    prompt, params, hf_kwargs = cases[rid]
    assert disaggregated(demo_model, prompt, params) == hf_generate(hf_reference, prompt, MAX_NEW, **hf_kwargs)
