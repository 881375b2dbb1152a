"""What the model runner is told about one request in a step: plain ints, no Sequence.

The scheduler decides (`ScheduledSeq`: a Sequence and how many of its tokens to compute); the
engine turns each decision into a `StepItem` for the runner. Being plain data, a step is also what a
tensor-parallel engine broadcasts from rank 0 to the other ranks, so every rank runs the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepItem:
    token_ids: list[int]
    """The tokens whose K/V this step computes."""
    start: int
    """Position of token_ids[0]: the request's tokens already in the KV cache."""
    block_ids: list[int]
    """The request's block table (at least the blocks covering start + len(token_ids) tokens)."""
    samples: bool
    """The step computes the request's last known token, so its logits row is returned."""
    num_proposed: int = 0
    """Speculative decoding: the last num_proposed token_ids are proposals to verify; logits rows are
    returned for the last known token and for each of them (1 + num_proposed rows)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
