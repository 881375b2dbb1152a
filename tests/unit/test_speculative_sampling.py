"""Speculative decoding keeps the target distribution: sampled outputs (many seeds, a tiny model with an
8-token vocabulary) against the exact distribution enumerated from the model, by chi-square."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.engine_config import EngineConfig
from common.validation import ConfigError
from engine import SamplingParams
from engine.model_loader import LoadedModel
from engine.sequence import Sequence
from engine.speculative import NgramProposer, Proposal
from engine.speculative.speculator import may_speculate
from engine.speculative.switch import PROBE_EVERY, AcceptanceTracker, SpeculationSwitch, StepCostModel
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

VOCAB = 8
# every bigram over the vocabulary occurs in the prompt, so the n-gram proposer always has a proposal
PROMPT = [0] + [b for a in range(VOCAB) for b in (a, (a * 3 + 1) % VOCAB)] + [a for a in range(VOCAB)] * 2
NUM_SEEDS = 1200
CHI2_99_9 = {7: 24.32, 63: 103.4}
"""Chi-square critical values at p = 0.001 for 7 and 63 degrees of freedom."""


def _tiny() -> LoadedModel:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    return LoadedModel(model=LlamaForCausalLM(config).eval(), tokenizer=None, path="<in-memory>", dtype=torch.float32)


def _exact_joint(model, depth: int) -> torch.Tensor:
    """P(t1..t_depth | PROMPT) as a [VOCAB] * depth tensor, by enumerating every continuation."""
    joint = torch.ones(())
    for step in range(depth):
        prefixes = list(itertools.product(range(VOCAB), repeat=step))
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        with torch.inference_mode():
            probs = torch.softmax(model(ids).logits[:, -1].float(), dim=-1)
        joint = joint.unsqueeze(-1) * probs.view(*([VOCAB] * step), VOCAB)
    return joint


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * counts.sum()
    return float((((counts.flatten() - expected) ** 2) / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    loaded = _tiny()
    joint = _exact_joint(loaded.model, 4)  # before the engine switches the model to paged attention
    engine = make_engine(loaded, dtype="float32", max_num_seqs=NUM_SEEDS, max_num_batched_tokens=8192, num_kv_blocks=NUM_SEEDS * 3,
                         speculative={"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 2, "ngram_max": 2, "adaptive": False})
    for seed in range(NUM_SEEDS):
        engine.add_request(f"s{seed}", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True))
    outputs = run_to_completion(engine)
    stats = engine.stats()
    samples = torch.tensor([outputs[f"s{seed}"] for seed in range(NUM_SEEDS)])
    assert samples.shape == (NUM_SEEDS, 4)
    # both branches ran often: accepted proposals and rejected ones (then drawn from the residual)
    assert stats.spec_proposed_tokens >= NUM_SEEDS * 2
    rejected = stats.spec_proposed_tokens - stats.spec_accepted_tokens
    assert stats.spec_accepted_tokens >= 100 and rejected >= 100, stats
    for position in (1, 2, 3):  # tokens 2..4 come from verified steps
        marginal = joint.sum(dim=tuple(d for d in range(4) if d != position))
        counts = torch.bincount(samples[:, position], minlength=VOCAB).float()
        assert _chi2(counts, marginal) < CHI2_99_9[7], f"token {position + 1}: {counts.tolist()} vs {marginal.tolist()}"
    pair = joint.sum(dim=(0, 3))
    pair_counts = torch.bincount(samples[:, 1] * VOCAB + samples[:, 2], minlength=VOCAB * VOCAB).float()
    assert _chi2(pair_counts, pair) < CHI2_99_9[63]
    assert_no_leaked_blocks(engine)


def test_ngram_proposer_follows_the_latest_earlier_occurrence():
    proposer = NgramProposer(min_n=2, max_n=3)
    assert proposer.propose("r", [1, 2, 3, 4, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == Proposal([7, 5], "3-gram, seen going two ways")
    assert proposer.propose("r", [1, 2, 3, 4, 9, 2, 3], 5) == Proposal([4, 9, 2, 3], "2-gram, seen once")  # capped by the end
    assert proposer.propose("r", [1, 2, 3, 4], 3) is None
    assert proposer.propose("r", [6, 6, 6], 3) == Proposal([6], "2-gram, seen once")  # an occurrence overlapping the suffix
    assert proposer.propose("r", [5, 1, 2, 8, 1, 2, 8, 1, 2], 1).kind == "3-gram, seen once"
    bigrams = NgramProposer(min_n=2, max_n=2)
    assert bigrams.propose("r", [5, 1, 2, 8, 1, 2, 8, 1, 2], 1) == Proposal([8], "2-gram, seen going one way")


def test_acceptance_is_measured_per_kind_first_token_and_following_tokens_apart():
    acceptance = AcceptanceTracker(initial=0.5)
    assert acceptance.gains("new", 2) == [0.5, 0.25]
    for _ in range(40):
        acceptance.record("long match", 4, 4)
        acceptance.record("short match", 4, 0)
    long_first, long_next = acceptance.rates("long match")
    short_first, _ = acceptance.rates("short match")
    assert long_first > 0.9 and long_next > 0.9 and short_first < 0.1
    first_all, _ = acceptance.rates("never seen")
    assert 0.4 < first_all < 0.6, "an unseen kind starts at the rate over all kinds"
    acceptance.record("partly", 4, 2)  # first kept, second kept, third tried and rejected
    assert acceptance._kinds["partly"][0].kept == 1 and acceptance._kinds["partly"][1].tried == 2
    assert acceptance._kinds["partly"][1].kept == 1


def test_switch_verifies_the_kinds_that_pay_and_leaves_the_others():
    switch = SpeculationSwitch(adaptive=True)
    for tokens in (8, 16, 40) * 40:  # compute-bound: a verified token costs a fifth of a sequence's step
        switch.cost.record(tokens, 0, 0.010 + 0.001 * tokens)
    switch.cost.record(12, 1, 0.022 + 0.001)
    for _ in range(60):
        switch.acceptance.record("long", 3, 3)
        switch.acceptance.record("ambiguous", 3, 0)
    proposals = {"a": Proposal([1, 2, 3], "long"), "b": Proposal([1, 2, 3], "ambiguous")}
    assert switch.choose(8, 8, proposals) == {"a": 3}


def test_switch_measures_then_turns_speculation_off_when_verified_tokens_cost_more_than_they_bring():
    switch = SpeculationSwitch(adaptive=True)
    proposals = {f"r{i}": Proposal([1, 2, 3], "3-gram, seen once") for i in range(8)}
    assert switch.choose(8, 8, proposals) == {}, "plain steps are timed first"
    for tokens in (8, 16, 40):  # decode-bound: a plain step costs about the same whatever its size
        switch.cost.record(tokens, 0, 0.020)
    assert len(switch.choose(8, 8, proposals)) == 1, "then one sequence verifies, to measure the overhead"
    switch.cost.record(11, 1, 0.021)
    assert switch.choose(8, 8, proposals) == {rid: 3 for rid in proposals}
    for tokens in (8, 16, 40) * 40:  # compute-bound: time proportional to tokens (the averages converge)
        switch.cost.record(tokens, 0, 0.001 * tokens)
    assert switch.choose(8, 8, proposals) == {}
    for _ in range(8):
        switch.acceptance.record("3-gram, seen once", 3, 0)
    probes = [chosen for chosen in (switch.choose(8, 8, proposals) for _ in range(PROBE_EVERY)) if chosen]
    assert len(probes) == 1 and len(probes[0]) == 1, "every PROBE_EVERY idle steps one sequence speculates to re-measure acceptance"


def test_cost_model_interpolates_plain_steps_and_measures_the_verification_overhead():
    cost = StepCostModel()
    assert cost.curve() is None
    for tokens, seconds in ((2, 0.15), (6, 0.17), (10, 0.19)):
        cost.record(tokens, 0, seconds)
    plain = cost.curve()
    assert plain(6) == 0.17 and abs(plain(4) - 0.16) < 1e-9 and abs(plain(14) - 0.21) < 1e-9
    cost.record(14, 2, 0.31)
    assert abs(cost.overhead - 0.05) < 1e-9 and cost.curve()(14) == plain(14), "verifying steps do not enter the plain curve"


def test_speculator_declines_requests_it_cannot_verify_losslessly():
    assert may_speculate(Sequence("a", [1], SamplingParams()))
    for params in (SamplingParams(logprobs=0), SamplingParams(repetition_penalty=1.1), SamplingParams(min_tokens=2)):
        assert not may_speculate(Sequence("a", [1], params))


@pytest.mark.parametrize("section,field", [
    ({"method": "medusa"}, "engine.speculative.method"),
    ({"num_speculative_tokens": 0}, "engine.speculative.num_speculative_tokens"),
    ({"ngram_min": 3, "ngram_max": 2}, "engine.speculative.ngram_max"),
    ({"adaptive": "yes"}, "engine.speculative.adaptive"),
    ({"lookahead": 2}, "engine.speculative.lookahead"),
    ("ngram", "engine.speculative"),
])
def test_bad_speculative_config_names_the_field(section, field):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict({"speculative": section})
    assert err.value.field == field
    assert EngineConfig.from_dict({"speculative": {"method": "ngram", "num_speculative_tokens": 6}}).speculative.num_speculative_tokens == 6
    assert not EngineConfig().speculative.enabled
