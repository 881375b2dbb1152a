"""Per-request adjustments of a step's logits before the sampler picks tokens.

`LogitsAdjuster.adjust(logits, seqs)` returns the logits the sampler draws from (row i is
`seqs[i]`'s): the input itself when no request of the step asks for an adjustment (the plain path
does no work), otherwise a copy whose adjusted rows had, in this order (vLLM's order):
  1. logit_bias added,
  2. EOS (unless ignore_eos) and stop_token_ids set to -inf while fewer than min_tokens were generated,
  3. repetition_penalty over the tokens of the prompt and the output (HF's RepetitionPenaltyLogitsProcessor:
     positive logits divided, negative ones multiplied),
  4. frequency_penalty x count and presence_penalty x (count > 0) subtracted, counting the output tokens
     only (OpenAI's formula).
Each step is one batched tensor operation over the rows that need it, built from flat (row, token)
index lists; nothing here loops over the vocabulary. The model's raw logits are left untouched
(the sampler's logprobs come from them).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch

from engine.sequence import Sequence


class LogitsAdjuster:
    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
        if not rows:
            return logits
        picked = [seqs[i] for i in rows]
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        _add_bias(sub, [seq.params.logit_bias for seq in picked])
        _mask(sub, [self._banned(seq) for seq in picked])
        _repetition_penalty(sub, picked)
        _presence_frequency_penalty(sub, picked)
        return logits.index_copy(0, index, sub)

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            return ()
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return eos + seq.params.stop_token_ids


def _pairs(per_row: list[Iterable[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, column) indices of `per_row[r]`'s entries, for one index_put_ over the batch."""
    lists = [list(ids) for ids in per_row]
    rows = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(ids) for ids in lists]))
    cols = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
    return rows.to(device), cols.to(device)


def _add_bias(sub: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> None:
    if not any(biases):
        return
    rows, cols = _pairs([[tok for tok, _ in bias] for bias in biases], sub.device)
    values = torch.tensor([b for bias in biases for _, b in bias], dtype=sub.dtype, device=sub.device)
    sub.index_put_((rows, cols), values, accumulate=True)


def _mask(sub: torch.Tensor, banned: list[tuple[int, ...]]) -> None:
    if not any(banned):
        return
    rows, cols = _pairs(banned, sub.device)
    sub[rows, cols] = float("-inf")


def _repetition_penalty(sub: torch.Tensor, seqs: list[Sequence]) -> None:
    penalties = [seq.params.repetition_penalty for seq in seqs]
    if all(p == 1.0 for p in penalties):
        return
    rows, cols = _pairs([seq.token_ids if p != 1.0 else () for seq, p in zip(seqs, penalties)], sub.device)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=sub.device)
    seen[rows, cols] = True
    penalty = torch.tensor(penalties, dtype=sub.dtype, device=sub.device).unsqueeze(1)
    sub.copy_(torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub))


def _presence_frequency_penalty(sub: torch.Tensor, seqs: list[Sequence]) -> None:
    presence = [seq.params.presence_penalty for seq in seqs]
    frequency = [seq.params.frequency_penalty for seq in seqs]
    if not any(presence) and not any(frequency):
        return
    used = [seq.output_token_ids if p or f else () for seq, p, f in zip(seqs, presence, frequency)]
    rows, cols = _pairs(used, sub.device)
    counts = torch.zeros_like(sub)
    counts.index_put_((rows, cols), torch.ones(rows.numel(), dtype=sub.dtype, device=sub.device), accumulate=True)
    as_column = {"dtype": sub.dtype, "device": sub.device}
    sub -= counts * torch.tensor(frequency, **as_column).unsqueeze(1)
    sub -= (counts > 0).to(sub.dtype) * torch.tensor(presence, **as_column).unsqueeze(1)
