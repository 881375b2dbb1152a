"""What travels on a tensor-parallel group's channel between rank 0 and each follower rank.

rank 0 -> follower: a `Step` to run (every rank runs the same one), a `Call` for the follower's
rank agent (the worker's per-rank KV endpoint: begin sends, expect pieces, ...), or `STOP`.
follower -> rank 0: a `Reply` to a call (none for calls sent with `tell`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from engine.kv_sink import SinkRequest
from engine.step import StepItem

STOP = None


@dataclass(frozen=True)
class Step:
    items: list[StepItem]
    sink_requests: list[SinkRequest] = field(default_factory=list)
    """The prompts whose KV every rank hands its sink layer by layer during this step."""


@dataclass(frozen=True)
class Call:
    key: Hashable
    payload: Any


@dataclass(frozen=True)
class Reply:
    key: Hashable
    rank: int
    value: Any
