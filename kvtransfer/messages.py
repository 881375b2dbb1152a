"""In-process messages the workers exchange with kvtransfer (dataclasses, no behaviour).

`KVEndpoint` mirrors proto `pdserve.v1.KVEndpoint`; `ReceivedKV` and `TransferAck` are the
outcomes of a transfer on the decode and prefill side; their timings feed `StageTimings`.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class TransferAck:
    """Prefill side: the receiver verified and stored the whole transfer."""

    transfer_id: str
    nbytes: int
    num_layers: int
    duration_s: float  # begin() -> RESULT OK
