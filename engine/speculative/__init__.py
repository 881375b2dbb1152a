"""Speculative decoding: propose a few tokens cheaply, verify them in one forward of the target model.

Lifecycle per step (driven by engine.engine through `Speculator`): after the scheduler has planned the
step, every decoding sequence that may speculate asks the proposer (`proposer`, e.g. n-gram prompt
lookup) for up to k tokens; the cost model (`switch`) keeps the proposals that pay at this step's
load; the sequence's blocks grow to hold them and its StepItem carries last token + proposals, whose
logits come back one row per position. `verify` accepts the longest matching prefix (greedy) or runs
rejection sampling (sampled), always adding one token of the target's own (the correction or the
bonus). The engine appends the accepted tokens one by one (stop rules apply to each), counts only
their KV as computed, and `Speculator.release_unused` frees blocks that now hold only rejected slots.
"""

from engine.speculative.proposer import NgramProposer, Proposal, Proposer
from engine.speculative.speculator import SpeculativeStats, Speculator

__all__ = ["NgramProposer", "Proposal", "Proposer", "Speculator", "SpeculativeStats"]
