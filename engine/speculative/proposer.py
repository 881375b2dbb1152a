"""Proposers: given a sequence's tokens, guess the next few without running the target model.

`Proposer` is the interface every method implements (the engine calls it once per decoding sequence
and step, with the tokens known so far). A `Proposal` carries the guessed tokens and their kind: how
they were found, which tells how far to trust them (the switch learns each kind's acceptance).
`NgramProposer` is model-free prompt lookup: it finds the latest earlier occurrence of the sequence's
last n tokens (longest n first) and proposes the tokens that followed it, which pays on input-grounded
answers (code edits, quotes, summaries that copy). Its kind is the match length and whether the
occurrence before that one went on with the same token: a long match, or a short one whose earlier
occurrences agree, is kept far more often than a short one seen going two ways (the speculative
benchmark's c4 requests, n-grams of 2-4, every proposal verified: the first token kept for 89 % of
4-grams seen once and 99 % of those seen going one way, for 23 % of 2-grams seen going two ways).
A draft-model proposer (a small model with the target's tokenizer, run in the same worker) would
implement the same `propose`; it would keep its own KV per sequence and drop it in `forget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    kind: str
    """How they were found (e.g. "3-gram, seen going two ways"); acceptance is measured per kind."""


class Proposer(Protocol):
    def propose(self, request_id: str, token_ids: list[int], k: int) -> Proposal | None:
        """Up to `k` tokens guessed to follow `token_ids` (prompt + output so far); None when there is no guess."""

    def forget(self, request_id: str) -> None:
        """The sequence finished or was preempted: drop what was kept for it."""


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request_id: str, token_ids: list[int], k: int) -> Proposal | None:
        length = len(token_ids)
        reversed_ids = token_ids[::-1]  # list.index searches forwards, in C: search the reversed list
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = reversed_ids[:n]
            at = _find(reversed_ids, tail, 1)
            if at is None:
                continue
            start = length - at  # index in token_ids just after the latest earlier occurrence
            before = _find(reversed_ids, tail, at + 1)
            if before is None:
                seen = "seen once"
            elif token_ids[length - before] == token_ids[start]:
                seen = "seen going one way"
            else:
                seen = "seen going two ways"
            return Proposal(token_ids[start : start + k], f"{n}-gram, {seen}")
        return None

    def forget(self, request_id: str) -> None:
        pass


def _find(haystack: list[int], needle: list[int], begin: int) -> int | None:
    """First index >= begin where `needle` occurs in `haystack`."""
    first, n = needle[0], len(needle)
    i = begin
    while True:
        try:
            i = haystack.index(first, i, len(haystack) - n + 1)
        except ValueError:
            return None
        if haystack[i : i + n] == needle:
            return i
        i += 1
