"""Penalties, logit_bias and min_tokens on a batch of logits rows, checked against transformers'
own logits processors on the same logits (presence/frequency: transformers has no processor with
OpenAI's formula, so the expected logits are computed from the formula directly), and their
validation. No model: random logits and hand-built sequences."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine import InvalidRequestError, SamplingParams
from engine.logits_processors import LogitsAdjuster
from engine.sampler import Sampler
from engine.sequence import Sequence

VOCAB = 64
EOS = (2, 7)


def seq(prompt: list[int], output: list[int], rid: str = "r", **params) -> Sequence:
    s = Sequence(rid, prompt, SamplingParams(max_tokens=32, **params))
    s.output_token_ids = list(output)
    return s


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def hf(processor, s: Sequence, row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([s.token_ids]), row.unsqueeze(0).clone())[0]


def test_no_adjustment_is_the_same_tensor_untouched():
    x = logits(3)
    seqs = [seq([1, 2], [3]), seq([4], []), seq([5, 5], [6, 6], temperature=0.7)]
    assert LogitsAdjuster(EOS).adjust(x, seqs) is x


def test_repetition_penalty_matches_hf_and_leaves_other_rows():
    x = logits(4, seed=1)
    seqs = [seq([1, 2, 3, 3], [9, 10], repetition_penalty=1.3), seq([1, 2, 3], [4]),
            seq([5, 6], [5, 40, 41], repetition_penalty=0.7), seq([11], [], repetition_penalty=2.0)]
    out = LogitsAdjuster(EOS).adjust(x, seqs)
    for i in (0, 2, 3):
        expected = hf(RepetitionPenaltyLogitsProcessor(seqs[i].params.repetition_penalty), seqs[i], x[i])
        assert torch.equal(out[i], expected), i
    assert torch.equal(out[1], x[1])
    assert not torch.equal(out[0], x[0]) and torch.equal(x, logits(4, seed=1)), "the input must stay the raw logits"


def test_min_tokens_matches_hf_min_new_tokens_until_reached():
    x = logits(3, seed=2)
    prompt = [1, 3, 5]
    seqs = [seq(prompt, [8, 9], min_tokens=4, stop_token_ids=(11,)), seq(prompt, [8, 9, 10, 12], min_tokens=4),
            seq(prompt, [], min_tokens=1, ignore_eos=True, stop_token_ids=(13,))]
    out = LogitsAdjuster(EOS).adjust(x, seqs)
    for i, banned in ((0, [*EOS, 11]), (1, list(EOS))):
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 4, banned)
        assert torch.equal(out[i], hf(processor, seqs[i], x[i])), i
    assert torch.isinf(out[0, [2, 7, 11]]).all() and torch.equal(out[1], x[1])  # reached: EOS allowed again
    assert torch.isinf(out[2, 13]) and torch.equal(out[2, list(EOS)], x[2, list(EOS)])  # ignore_eos: only stop ids


def test_logit_bias_matches_hf_sequence_bias():
    x = logits(2, seed=3)
    bias = {5: 3.5, 17: -100.0, 63: 0.25}
    seqs = [seq([1], [2, 3], logit_bias=bias), seq([1], [])]
    out = LogitsAdjuster(EOS).adjust(x, seqs)
    processor = SequenceBiasLogitsProcessor([[[tok], b] for tok, b in bias.items()])
    assert torch.equal(out[0], hf(processor, seqs[0], x[0]))
    assert torch.equal(out[1], x[1])


def test_presence_and_frequency_follow_openais_formula_over_output_tokens():
    x = logits(2, seed=4)
    s = seq([9, 9, 9], [4, 4, 4, 20, 9], presence_penalty=0.5, frequency_penalty=-0.3)
    out = LogitsAdjuster(EOS).adjust(x, [seq([1], [1, 1]), s])
    counts = torch.zeros(VOCAB)
    counts[[4, 20, 9]] = torch.tensor([3.0, 1.0, 1.0])  # the prompt's three 9s do not count
    assert torch.equal(out[1], x[1] - counts * -0.3 - (counts > 0).float() * 0.5)
    assert torch.equal(out[0], x[0])


def test_all_together_in_vllms_order():
    x = logits(1, seed=5)
    s = seq([1, 2], [2, 3, 3], repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5,
            logit_bias={3: 2.0, 30: 1.0}, min_tokens=5)
    expected = x[0].clone()
    expected[[3, 30]] += torch.tensor([2.0, 1.0])
    expected[list(EOS)] = float("-inf")
    expected = hf(RepetitionPenaltyLogitsProcessor(1.5), s, expected)
    expected[2] -= 0.5 * 1 + 1.0
    expected[3] -= 0.5 * 2 + 1.0
    assert torch.allclose(LogitsAdjuster(EOS).adjust(x, [s])[0], expected, atol=1e-6, rtol=0)


def test_sampler_greedy_takes_the_penalised_argmax_and_logprobs_stay_raw():
    x = logits(1, seed=6).repeat(2, 1)
    top = int(x[0].argmax())
    seqs = [seq([1], [top], rid="a", repetition_penalty=100.0 if x[0, top] > 0 else 0.01, logprobs=1), seq([1], [top], rid="b")]
    samples = Sampler(0, EOS).sample(x, seqs)
    assert samples[0].token_id != top and samples[1].token_id == top
    raw = torch.log_softmax(x[0], dim=-1)
    assert samples[0].logprob == pytest.approx(raw[samples[0].token_id].item())
    assert list(samples[0].top_logprobs) == [top]


def test_bf16_logits_give_the_float32_answers_with_or_without_a_float_copy():
    """Greedy rows over bf16 logits are read as they are; a step with a row that needs more (logprobs, a
    penalty) widens them first. Either way each row gets what float32 logits would give (first index on ties)."""
    x = logits(4, seed=3).to(torch.bfloat16)
    x[1, 10] = x[1, 40] = x[1].max() + 1  # a tie: the first index wins
    plain = [seq([1], [], rid=f"p{i}") for i in range(4)]
    expected = [int(t) for t in x.float().argmax(dim=-1)]
    assert [s.token_id for s in Sampler(0, EOS).sample(x, plain)] == expected
    assert expected[1] == 10
    mixed = plain[:3] + [seq([1], [], rid="lp", logprobs=2)]
    samples = Sampler(0, EOS).sample(x, mixed)
    assert [s.token_id for s in samples] == expected
    assert samples[3].logprob == pytest.approx(torch.log_softmax(x[3].float(), dim=-1)[expected[3]].item())


def test_sampled_rows_never_draw_a_masked_token():
    x = torch.zeros(1, VOCAB)
    x[0, list(EOS)] = 50.0  # EOS would win almost surely
    s, sampler = seq([1], [], min_tokens=3, temperature=1.0), Sampler(0, EOS)
    assert all(sampler.sample(x, [s])[0].token_id not in EOS for _ in range(20))
    s.output_token_ids = [1, 1, 1]  # min_tokens reached: EOS is almost sure again
    assert sampler.sample(x, [s])[0].token_id in EOS


@pytest.mark.parametrize("params, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 33}, "min_tokens"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 100.5}}, "logit_bias[3]"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias[3]"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
])
def test_bad_values_name_the_field(params, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=32, **params).validate(vocab_size=VOCAB)
    assert info.value.field == field


def test_logit_bias_is_stored_sorted_and_hashable():
    p = SamplingParams(logit_bias={9: 1.0, 2: -1.0})
    assert p.logit_bias == ((2, -1.0), (9, 1.0)) and p.adjusts_logits and hash(p) is not None
    assert not SamplingParams().adjusts_logits


def test_a_new_request_under_a_finished_ones_id_gets_its_own_prompt():
    x, adjuster = logits(1, seed=7), LogitsAdjuster(EOS)
    first, second = seq([1, 2], [], rid="same", repetition_penalty=1.5), seq([3, 4], [], rid="same", repetition_penalty=1.5)
    adjuster.adjust(x, [first])
    adjuster.forget("same")
    for s in (second, first):  # forgotten or not, the cached prompt belongs to one Sequence only
        assert torch.equal(adjuster.adjust(x, [s])[0], hf(RepetitionPenaltyLogitsProcessor(1.5), s, x[0]))
