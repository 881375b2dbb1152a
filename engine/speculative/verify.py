"""Verification: which proposed tokens the target model keeps, and the one token it adds.

`rows` are the target's logits at the sequence's last known token and at each proposal (1 + k rows).
Greedy: keep proposals while each equals the argmax of the row before it, then add that row's argmax
(the correction, or the bonus after k kept). Sampled: rejection sampling against a deterministic
proposer (q is a point mass): keep proposal x with probability p(x) under the request's own sampling
distribution (temperature, top-k, top-p); on rejection draw from p with x removed, renormalised; this
keeps the output distributed exactly as plain sampling. Draws use the request's own generator.
"""

from __future__ import annotations

import torch

from engine.sampler import Sample, Sampler, greedy_tokens
from engine.sequence import Sequence


def verify(rows: torch.Tensor, seq: Sequence, proposal: list[int], sampler: Sampler) -> list[Sample]:
    """The tokens to append: the kept prefix of `proposal` and one more from the target."""
    if seq.params.greedy:
        best = greedy_tokens(rows)
        kept = 0
        while kept < len(proposal) and best[kept] == proposal[kept]:
            kept += 1
        return [Sample(t) for t in proposal[:kept] + [best[kept]]]
    probs = sampler.probs(rows.float().cpu(), seq.params)
    generator = sampler.generator(seq)
    for i, token in enumerate(proposal):
        residual = probs[i].clone()
        residual[token] = 0.0
        if torch.rand((), generator=generator).item() < probs[i, token].item() or residual.sum() <= 0:
            continue
        drawn = int(torch.multinomial(residual / residual.sum(), 1, generator=generator).item())
        return [Sample(t) for t in proposal[:i] + [drawn]]
    bonus = int(torch.multinomial(probs[len(proposal)], 1, generator=generator).item())
    return [Sample(t) for t in proposal + [bonus]]
