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
Each step is one batched tensor operation on the (row, token) pairs it concerns, built from flat
index lists: the cost grows with the tokens of the adjusted requests, not with batch x vocabulary. The model's raw logits are left untouched
(the sampler's logprobs come from them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.sequence import Sequence


class LogitsAdjuster:
    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._prompt_ids: dict[str, tuple[Sequence, torch.Tensor]] = {}
        """A request's distinct prompt token ids, kept until `forget` (for repetition_penalty)."""

    def forget(self, request_id: str) -> None:
        self._prompt_ids.pop(request_id, None)

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
        if not rows:
            return logits
        out = logits.clone()
        picked = [seqs[i] for i in rows]
        _add_bias(out, rows, [seq.params.logit_bias for seq in picked])
        _mask(out, rows, [self._banned(seq) for seq in picked])
        self._repetition_penalty(out, rows, picked)
        _presence_frequency_penalty(out, rows, picked)
        return out

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            return ()
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return eos + seq.params.stop_token_ids

    def _repetition_penalty(self, out: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """On the (row, token) pairs only; a token seen twice is written twice with the same value."""
        penalties = [seq.params.repetition_penalty for seq in seqs]
        if all(p == 1.0 for p in penalties):
            return
        seen_ids = [torch.cat((self._distinct_prompt_ids(seq), _ids(seq.output_token_ids))) if p != 1.0 else _ids(())
                    for seq, p in zip(seqs, penalties)]
        flat_rows, cols = _pairs(rows, seen_ids, out.device)
        penalty = _per_row(penalties, flat_rows, out, rows)
        seen = out[flat_rows, cols]
        out[flat_rows, cols] = torch.where(seen < 0, seen * penalty, seen / penalty)

    def _distinct_prompt_ids(self, seq: Sequence) -> torch.Tensor:
        owner, ids = self._prompt_ids.get(seq.request_id, (None, None))
        if owner is not seq:
            ids = torch.unique(_ids(seq.prompt_token_ids))
            self._prompt_ids[seq.request_id] = (seq, ids)
        return ids


def _ids(ids: Iterable[int]) -> torch.Tensor:
    return torch.tensor(ids if isinstance(ids, (list, tuple)) else list(ids), dtype=torch.long)


def _pairs(rows: list[int], per_row: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, column) indices of `per_row[i]`'s token ids in row `rows[i]`, for one indexing op."""
    counts = torch.tensor([ids.numel() for ids in per_row])
    flat_rows = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), counts)
    return flat_rows.to(device), torch.cat(per_row).to(device)


def _per_row(values: list[float], rows: torch.Tensor, like: torch.Tensor, index: list[int]) -> torch.Tensor:
    """`values[i]` (the value of row `index[i]`) for each entry of the flat `rows`."""
    table = torch.zeros(like.shape[0], dtype=like.dtype)
    table[index] = torch.tensor(values, dtype=like.dtype)
    return table.to(like.device)[rows]


def _add_bias(out: torch.Tensor, rows: list[int], biases: list[tuple[tuple[int, float], ...]]) -> None:
    if not any(biases):
        return
    flat_rows, cols = _pairs(rows, [_ids(tok for tok, _ in bias) for bias in biases], out.device)
    values = torch.tensor([b for bias in biases for _, b in bias], dtype=out.dtype, device=out.device)
    out.index_put_((flat_rows, cols), values, accumulate=True)


def _mask(out: torch.Tensor, rows: list[int], banned: list[tuple[int, ...]]) -> None:
    if not any(banned):
        return
    out[_pairs(rows, [_ids(ids) for ids in banned], out.device)] = float("-inf")


def _presence_frequency_penalty(out: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """logit - count x frequency - presence, on each distinct (row, token) of the outputs."""
    presence = [seq.params.presence_penalty for seq in seqs]
    frequency = [seq.params.frequency_penalty for seq in seqs]
    if not any(presence) and not any(frequency):
        return
    used = [_ids(seq.output_token_ids if p or f else ()) for seq, p, f in zip(seqs, presence, frequency)]
    flat_rows, cols = _pairs(rows, used, out.device)
    vocab = out.shape[1]
    distinct, counts = torch.unique(flat_rows * vocab + cols, return_counts=True)
    hit_rows, hit_cols = distinct // vocab, distinct % vocab
    penalised = out[hit_rows, hit_cols] - counts.to(out.dtype) * _per_row(frequency, hit_rows, out, rows)
    out[hit_rows, hit_cols] = penalised - _per_row(presence, hit_rows, out, rows)
