"""bfloat16: the engine's greedy output against transformers' `generate` in bfloat16 on the same model.

bf16 keeps 8 bits: two implementations that sum in different orders round some outputs one step apart, and
a near tie between the top two tokens downstream then flips, so the continuations part. The engine sums as
transformers does on a CPU where that order was measured (SUMS_AS_TORCH_BF16: AVX512-BF16 without AMX):
its paged attention as torch's CPU flash attention (engine/kernels/paged_attention.cpp) and its batched
decode rows as torch's linear sums a lone row (engine.one_row_linear). The eight demo prompts run together.
Acceptance (issue #17): at least 90 % of the held-in prompts identical over 32 tokens; every other
prompt's first divergence is a tie under HF (both tokens' logprobs within MAX_TIE_GAP), and is printed.
Both sides stop at EOS (with `ignore_eos` the engine may emit EOS where HF's `min_new_tokens` forbids it).
Both are hard assertions where the sums are reproduced (measured: 8/8 identical, an AMD EPYC with
AVX512-BF16); elsewhere an identical share under 90 % is reported as XFAIL with its figures (before the
sums followed torch's: 4/8 to 6/8 identical on such EPYCs, at gaps of 0.0 to 0.25 nats).
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.model_loader import load_model
from tests.conftest import SUMS_AS_TORCH_BF16, assert_no_leaked_blocks, make_engine, run_to_completion

MAX_NEW = 32
MIN_IDENTICAL = 0.9
MAX_TIE_GAP = 0.25
"""Nats between HF's token and the engine's at the first divergence, under HF, at most. The logits are
bf16, whose spacing is 0.125 for |logit| in [16, 32): a tie is a difference of one or two such steps."""


@pytest.fixture(scope="module")
def bf16_model():
    return load_model("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def hf_bf16(bf16_model):
    """A separate copy in bf16 with transformers' own attention (the engine patches its instance)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16_model.path, dtype=torch.bfloat16).eval()


@torch.inference_mode()
def hf_bf16_greedy(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy `generate` and the log-probabilities it chose each token from."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=MAX_NEW,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return out.sequences[0, len(ids):].tolist(), logprobs


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def test_engine_bf16_matches_hf_bf16_greedy(bf16_model, hf_bf16, demo_prompt_ids):
    engine = make_engine(bf16_model)
    assert engine.config.dtype == "bfloat16" and engine.kv_cache.layout.dtype == torch.bfloat16
    for i, ids in enumerate(demo_prompt_ids):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=MAX_NEW))
    out = run_to_completion(engine)
    identical, gaps = 0, []
    for i, ids in enumerate(demo_prompt_ids):
        ours, (theirs, logprobs) = out[f"r{i}"], hf_bf16_greedy(hf_bf16, ids)
        at = first_divergence(ours, theirs)
        if at is None:
            identical += 1
            continue
        hf_lp, our_lp = float(logprobs[at, theirs[at]]), float(logprobs[at, ours[at]])
        gaps.append(hf_lp - our_lp)
        print(f"prompt {i}: first divergence at token {at}: HF {theirs[at]} logprob {hf_lp:.4f}, "
              f"engine {ours[at]} logprob {our_lp:.4f} (gap {hf_lp - our_lp:.4f} nats)")
    print(f"{identical}/{len(demo_prompt_ids)} prompts identical over {MAX_NEW} tokens")
    assert all(0 <= g <= MAX_TIE_GAP for g in gaps), f"a divergence that is no tie under HF: gaps {gaps}"
    assert_no_leaked_blocks(engine)
    if identical < MIN_IDENTICAL * len(demo_prompt_ids):
        assert not SUMS_AS_TORCH_BF16, f"{identical}/{len(demo_prompt_ids)} prompts identical on a CPU whose sums are reproduced; gaps {gaps}"
        # Another CPU: every divergence is a tie (asserted above); the share is reported (XFAIL, with the figures).
        pytest.xfail(f"{identical}/{len(demo_prompt_ids)} prompts identical (< {MIN_IDENTICAL:.0%}); divergence gaps {gaps} nats")
