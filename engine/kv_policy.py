"""KV admission policies (`engine.kv_policy`): when a request may take KV blocks.

`max_utilization` (the default) admits a request as soon as blocks for its next chunk are free and
lets it grow token by token; when the pool runs dry the scheduler preempts (recompute), lowest
priority and latest admitted first. `guaranteed_no_evict` admits a request only when the blocks its
whole life can need (prompt + max_tokens, plus those of the sequences an `n` > 1 group forks) are
free *after* what the requests already admitted may still take; an admitted request then always
finds its next block, so it is never preempted. Both the scheduler (waiting requests) and a decode
worker's reservation for KV arriving from a prefill worker ask the same `admits`. Tensor-free.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.engine_config import KV_POLICIES
from engine.block_manager import BlockManager
from engine.sequence import Sequence


class MaxUtilization:
    """Admission is the block manager's "is there room for the next chunk": nothing is promised."""

    def admits(self, seq: Sequence, holders: Iterable[Sequence]) -> bool:
        return True


class GuaranteedNoEvict:
    """Admit only what can run to its end without taking a block promised to an admitted request."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def admits(self, seq: Sequence, holders: Iterable[Sequence]) -> bool:
        """`holders`: the admitted requests that may still grow (running, or waiting for remote KV)."""
        promised = sum(self.still_needed(s) for s in holders)
        return self.blocks.num_free_blocks - promised >= self.still_needed(seq)

    def still_needed(self, seq: Sequence) -> int:
        """Blocks the sequence may still take: up to its final length, plus its pending forks' own
        (each shares the prompt's full blocks and takes at most blocks_for(max_tokens) + 1)."""
        final = seq.num_prompt_tokens + (1 if seq.prefill_only else seq.params.max_tokens)
        own = max(0, self.blocks.blocks_for_tokens(final) - len(seq.block_ids))
        return own + seq.forks_pending * (self.blocks.blocks_for_tokens(seq.params.max_tokens) + 1)


def make_kv_policy(name: str, blocks: BlockManager) -> MaxUtilization | GuaranteedNoEvict:
    if name == "guaranteed_no_evict":
        return GuaranteedNoEvict(blocks)
    if name == "max_utilization":
        return MaxUtilization()
    raise ValueError(f"unknown kv_policy {name!r} (known: {', '.join(KV_POLICIES)})")
