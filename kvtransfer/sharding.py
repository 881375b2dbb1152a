"""Which KV heads each rank of a tensor-parallel worker owns, and which pieces move between ranks.

A worker with TP = N splits the model's H KV heads into N equal, contiguous ranges: rank r owns
heads [r*H/N, (r+1)*H/N). Between a prefill worker of TP = a and a decode worker of TP = b, prefill
rank r sends decode rank s exactly the heads both own (a "piece"), straight from its pool to
theirs: every head travels once, no rank gathers another's. With a = b each rank sends one piece to
its peer; with a = 1 one rank sends a piece to every decode rank; with b = 1 every prefill rank
sends one piece to the single decode rank.
"""

from __future__ import annotations

from dataclasses import dataclass


class IncompatibleLayouts(ValueError):
    """The two workers' head layouts cannot exchange KV (different models or head counts)."""


@dataclass(frozen=True, order=True)
class HeadRange:
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def overlap(self, other: HeadRange) -> HeadRange | None:
        first, end = max(self.first, other.first), min(self.end, other.end)
        return HeadRange(first, end - first) if end > first else None


def head_range(num_heads: int, tp: int, rank: int) -> HeadRange:
    if tp < 1 or num_heads % tp:
        raise IncompatibleLayouts(f"TP={tp} does not divide {num_heads} KV heads")
    per_rank = num_heads // tp
    return HeadRange(rank * per_rank, per_rank)


@dataclass(frozen=True)
class Piece:
    """What prefill rank `src` sends decode rank `dst`: global heads `heads`."""

    src: int
    dst: int
    heads: HeadRange


def pieces(num_heads: int, src_tp: int, dst_tp: int) -> list[Piece]:
    """Every piece between a TP = src_tp sender and a TP = dst_tp receiver of `num_heads` KV heads."""
    found = []
    for src in range(src_tp):
        mine = head_range(num_heads, src_tp, src)
        for dst in range(dst_tp):
            shared = mine.overlap(head_range(num_heads, dst_tp, dst))
            if shared is not None:
                found.append(Piece(src, dst, shared))
    return found


def check_compatible(src: tuple[int, int], dst: tuple[int, int]) -> None:
    """src, dst: (TP, KV heads) of the prefill and the decode worker. Raises IncompatibleLayouts with
    both sides named when their KV cannot move rank to rank."""
    (src_tp, src_heads), (dst_tp, dst_heads) = src, dst
    sides = f"prefill worker TP={src_tp} with {src_heads} KV heads, decode worker TP={dst_tp} with {dst_heads} KV heads"
    if src_heads != dst_heads:
        raise IncompatibleLayouts(f"KV head counts differ ({sides})")
    for tp in (src_tp, dst_tp):
        if tp < 1 or src_heads % tp:
            raise IncompatibleLayouts(f"TP={tp} does not divide the KV heads ({sides})")
