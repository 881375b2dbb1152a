"""The name of a KV block everywhere in the cluster: a hash of its tokens chained to its predecessor's.

A full block of `block_size` prompt tokens is named by `next_hash(parent, tokens)`, where `parent` is
the name of the block before it, or `ROOT` for a prompt's first block: equal names mean equal
prefixes (up to a 64-bit collision). The engine's prefix cache (engine/block_manager.py), the KV
events workers send the router, the router's index (router/kv_index.py) and its routing policies all
use these functions, so a name computed in one process means the same block in every other.

Stable across processes: the hash of a tuple of ints depends only on the ints (Python randomizes
the hashes of str and bytes, never of int), and the root is a fixed int, not None (whose hash
derives from an address in Python 3.11).

`BlockEvents` is what a worker's pool reports between two drains: blocks it stored (published in
its prefix cache) and evicted, in order, or a snapshot of everything it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = 0x5D_5E_72_76_65  # the parent of every prompt's first block
TIER_POOL = "pool"
"""Where a block lives: the worker's KV pool (the only tier so far; a host or disk tier gets its own name)."""


def next_hash(parent: int, tokens: Sequence[int]) -> int:
    """The name of the block holding `tokens` after the block named `parent` (`ROOT` for the first)."""
    return hash((parent, tuple(tokens)))


def chain_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The names of the full blocks of `token_ids`, first block first (at most `max_blocks`)."""
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes, parent = [], ROOT
    for start in range(0, count * block_size, block_size):
        parent = next_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class BlockEvents:
    """A pool's changes since the previous drain, oldest first: runs of (stored?, block hashes).
    With `snapshot`, `runs` is a single stored run of every block the pool holds, and replaces all
    that was reported before (sent after a registration, or when events were lost)."""

    runs: list[tuple[bool, list[int]]] = field(default_factory=list)
    snapshot: bool = False
    tier: str = TIER_POOL

    @classmethod
    def of(cls, events: list[tuple[bool, int]]) -> BlockEvents:
        """Group single (stored?, hash) events into runs, keeping their order."""
        runs: list[tuple[bool, list[int]]] = []
        for stored, block_hash in events:
            if runs and runs[-1][0] == stored:
                runs[-1][1].append(block_hash)
            else:
                runs.append((stored, [block_hash]))
        return cls(runs)

    @property
    def num_hashes(self) -> int:
        return sum(len(hashes) for _, hashes in self.runs)
