"""In-process messages the workers exchange with kvtransfer (dataclasses, no behaviour).

`KVEndpoint` mirrors proto `pdserve.v1.KVEndpoint`; `ReceivedKV` and `TransferAck` are the
outcomes of a transfer on the decode and prefill side; their timings feed `StageTimings`.
`ReceiverStats` and `SenderStats` are the running totals each side keeps (worker `Stats`, tests).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVEndpoint:
    """Where a receiver listens (what a decode worker advertises)."""

    host: str
    port: int
    transport: str


@dataclass(frozen=True)
class ReceivedKV:
    """Decode side: a completed transfer; every layer is in the blocks and verified."""

    transfer_id: str
    first_token: int
    num_tokens: int
    nbytes: int
    wait_s: float  # expect() -> BEGIN
    transfer_s: float  # BEGIN -> verified
    first_logprob: float | None = None  # set when the request asked for logprobs
    first_top_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferAck:
    """Prefill side: the receiver verified and stored the whole transfer."""

    transfer_id: str
    nbytes: int
    num_layers: int
    duration_s: float  # begin() -> RESULT OK


@dataclass
class ReceiverStats:
    bytes_received: int = 0
    """KV bytes of completed transfers."""
    layers_landed: int = 0
    """Layers written and verified, of completed and unfinished transfers (progress)."""
    completed: int = 0
    failed: Counter[str] = field(default_factory=Counter)


@dataclass
class SenderStats:
    bytes_sent: int = 0
    acked: int = 0
    failed: int = 0
