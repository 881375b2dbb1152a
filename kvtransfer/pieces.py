"""KV that moves in pieces between the ranks of tensor-parallel workers.

Sender side: `PieceSend` is one prefill rank's share of one prompt's KV, one transfer per decode
rank it shares heads with (`<transfer_id>#<its rank>`), each carrying just those heads. With TP = 1
on both sides that is a single piece holding every head: the same path serves every layout.

Receiver side:

A decode rank owns a contiguous range of KV heads (kvtransfer.sharding). When the prefill worker
has a different TP size, that range is filled by several prefill ranks, each sending the heads both
own as its own transfer `<transfer_id>#<k>` with `first_head` and `num_pieces` in its header.

Lifecycle of one group, owned by `PieceGroups` inside a `KVReceiver`:
1. `expect(transfer_id, ...)` registers the group (blocks, tokens, fingerprint) and its deadline.
2. A BEGIN for `<transfer_id>#<k>` becomes a piece: an ordinary expected transfer of the receiver
   (same checks, layers, checksums, trailer) landing into its heads of the same blocks.
3. The group resolves with one `ReceivedKV` when `num_pieces` pieces completed and together cover
   every head of the receiver (the first token is the piece's that holds head 0, sampled by
   prefill rank 0); it fails as soon as one piece fails, at its deadline, on `cancel` or when the
   receiver closes, and only once no write of any piece is outstanding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.config import KVTransferConfig
from engine.kv_cache import KVLayout
from kvtransfer import errors
from kvtransfer.errors import ErrorCode, KVTransferError
from kvtransfer.messages import KVEndpoint, ReceivedKV
from kvtransfer.sharding import HeadRange, check_compatible, head_range, pieces
from kvtransfer.wire import TransferHeader

if TYPE_CHECKING:
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSettings:
    """What a tensor-parallel worker's follower rank needs of the worker's config for its own KV
    endpoint (sender or receiver), handed to it when it starts."""

    kv: KVTransferConfig
    kv_secret: bytes


@dataclass(frozen=True)
class Destination:
    """Where a decode worker wants one prompt's KV: its ranks' receivers (one for TP = 1)."""

    transfer_id: str
    fingerprint: str
    endpoints: list[KVEndpoint]
    num_kv_heads: int
    """The model's KV heads, all ranks together."""
    held_tokens: int = 0
    """Leading prompt tokens whose KV the decode worker holds already (whole blocks): not sent."""


class PieceSend:
    """Prefill rank `rank` of `tp`: its heads of one prompt's KV from `destination.held_tokens` on, sent
    straight to the decode ranks that own them. `send_layer` takes this rank's K/V of those tokens
    (`[tokens, its heads, head_dim]`) and never blocks."""

    def __init__(self, sender: KVSender, destination: Destination, layout: KVLayout, num_tokens: int, rank: int = 0,
                 tp: int = 1, ack_timeout: float | None = None):
        """layout: the whole model's KV layout (every rank's heads); num_tokens: the whole prompt's."""
        heads = layout.num_kv_heads
        check_compatible((tp, heads), (len(destination.endpoints), destination.num_kv_heads))
        if destination.held_tokens % layout.block_size or not 0 <= destination.held_tokens < num_tokens:
            raise ValueError(f"held_tokens {destination.held_tokens} is not a whole number of blocks below the prompt's {num_tokens} tokens")
        self.start = destination.held_tokens
        """The first prompt position sent (the decode worker holds the ones before)."""
        mine = head_range(heads, tp, rank)
        every = pieces(heads, tp, len(destination.endpoints))
        base = TransferHeader.for_layout(f"{destination.transfer_id}#{rank}", layout, num_tokens - self.start, destination.fingerprint)
        self.parts: list[tuple[Any, slice | None]] = []
        for piece in (p for p in every if p.src == rank):
            header = dataclasses.replace(base, num_kv_heads=piece.heads.count, first_head=piece.heads.first,
                                         num_pieces=sum(1 for p in every if p.dst == piece.dst))
            local = slice(piece.heads.first - mine.first, piece.heads.end - mine.first)
            transfer = sender.begin(destination.endpoints[piece.dst], header, ack_timeout)
            self.parts.append((transfer, None if piece.heads == mine else local))

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for transfer, heads in self.parts:
            if heads is None:
                transfer.send_layer(layer, k, v)
            else:
                transfer.send_layer(layer, k[:, heads].contiguous(), v[:, heads].contiguous())

    def finish(self, first_token: int, logprob: float | None = None, top_logprobs: dict[int, float] | None = None) -> None:
        for transfer, _ in self.parts:
            transfer.finish(first_token, logprob, top_logprobs)

    async def wait(self, timeout: float | None = None) -> int:
        """Bytes sent, once every decode rank acknowledged (raises the first failure)."""
        acks = await asyncio.gather(*(transfer.wait(timeout) for transfer, _ in self.parts))
        return sum(ack.nbytes for ack in acks)

    @property
    def done(self) -> bool:
        return all(transfer.ack.done() for transfer, _ in self.parts)

    def abort(self, reason: str) -> None:
        for transfer, _ in self.parts:
            if not transfer.ack.done():
                transfer.abort(reason)


@dataclass(eq=False)
class PieceGroup:
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    fingerprint: str
    deadline: float
    future: asyncio.Future[ReceivedKV]
    timer: asyncio.TimerHandle | None = None
    num_pieces: int | None = None
    pieces: list[Any] = field(default_factory=list)
    done: list[tuple[HeadRange, ReceivedKV]] = field(default_factory=list)
    failed: bool = False


class PieceGroups:
    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self._groups: dict[str, PieceGroup] = {}

    @property
    def pending(self) -> int:
        return len(self._groups)

    def has(self, transfer_id: str) -> bool:
        return transfer_id in self._groups

    def expect(self, transfer_id: str, block_ids: list[int], num_tokens: int, fingerprint: str, timeout: float) -> asyncio.Future[ReceivedKV]:
        loop = asyncio.get_running_loop()
        group = PieceGroup(transfer_id, list(block_ids), num_tokens, fingerprint, time.monotonic() + timeout, loop.create_future())
        group.timer = loop.call_later(timeout, self._fail, group, errors.TransferTimeout(f"pieces not complete after {timeout:.3g}s", transfer_id))
        self._groups[transfer_id] = group
        return group.future

    def piece_for(self, header: TransferHeader) -> Any:
        """The receiver's transfer for a BEGIN naming a piece of an expected group, else None."""
        group_id, sep, _ = header.transfer_id.rpartition("#")
        group = self._groups.get(group_id) if sep else None
        if group is None or group.failed:
            return None
        if group.num_pieces is None:
            group.num_pieces = header.num_pieces
        if header.num_pieces != group.num_pieces or len(group.pieces) >= group.num_pieces:
            self._fail(group, errors.ShapeMismatch(f"piece {header.transfer_id} says {header.num_pieces} pieces, "
                                                   f"the group has {group.num_pieces}", group.transfer_id))
            return None
        remaining = max(0.001, group.deadline - time.monotonic())
        piece = self.receiver._register(header.transfer_id, group.block_ids, group.num_tokens, group.fingerprint, remaining)
        piece.group = group
        group.pieces.append(piece)
        heads = HeadRange(header.first_head, header.num_kv_heads)
        piece.future.add_done_callback(lambda fut: self._on_piece(group, heads, fut))
        return piece

    def cancel(self, transfer_id: str, reason: str) -> bool:
        group = self._groups.get(transfer_id)
        if group is None:
            return False
        self._fail(group, errors.TransferAborted(reason, transfer_id))
        return True

    def close(self) -> None:
        for group in list(self._groups.values()):
            self._fail(group, errors.TransferAborted("receiver is closing", group.transfer_id))

    def _on_piece(self, group: PieceGroup, heads: HeadRange, fut: asyncio.Future[ReceivedKV]) -> None:
        if fut.cancelled() or group.failed:
            return
        error = fut.exception()
        if error is not None:
            self._fail(group, error if isinstance(error, KVTransferError) else errors.TransferAborted(str(error), group.transfer_id))
            return
        group.done.append((heads, fut.result()))
        if len(group.done) == group.num_pieces:
            self._complete(group)

    def _complete(self, group: PieceGroup) -> None:
        self._forget(group)
        covered = sorted(heads for heads, _ in group.done)
        mine = self.receiver.heads
        contiguous = all(a.end == b.first for a, b in zip(covered, covered[1:]))
        if not (contiguous and covered[0].first == mine.first and covered[-1].end == mine.end):
            error = errors.ShapeMismatch(f"pieces cover heads {covered}, this rank owns {mine}", group.transfer_id)
            group.failed = True
            self._answer(group, error.code, str(error))
            group.future.set_exception(error)
            return
        results = [kv for _, kv in sorted(group.done, key=lambda item: item[0].first)]
        merged = dataclasses.replace(results[0], transfer_id=group.transfer_id, nbytes=sum(r.nbytes for r in results),
                                     transfer_s=max(r.transfer_s for r in results))
        self._answer(group, ErrorCode.OK, "")
        if not group.future.done():
            group.future.set_result(merged)

    def _answer(self, group: PieceGroup, code: ErrorCode, message: str) -> None:
        """Tell the sender of every completed piece how its group ended (held back until now)."""
        for piece in group.pieces:
            if piece.completed and piece.channel is not None:
                self.receiver._reply(piece.channel, piece.stream, code, message)

    def _fail(self, group: PieceGroup, error: KVTransferError) -> None:
        if group.failed or group.future.done():
            return
        log.warning("KV transfer failed: %s", error)
        group.failed = True
        self._forget(group)
        self._answer(group, error.code, f"another piece of {group.transfer_id} failed: {error}")
        for piece in group.pieces:
            self.receiver._fail(piece, errors.TransferAborted(f"another piece of {group.transfer_id} failed: {error}", piece.transfer_id))
        self.receiver._track(asyncio.get_running_loop().create_task(self._settle(group, error)))

    async def _settle(self, group: PieceGroup, error: KVTransferError) -> None:
        """Fail the group's future once every piece has settled (no write into the blocks outstanding)."""
        await asyncio.gather(*(piece.future for piece in group.pieces), return_exceptions=True)
        if not group.future.done():
            group.future.set_exception(error)

    def _forget(self, group: PieceGroup) -> None:
        if group.timer is not None:
            group.timer.cancel()
        if self._groups.get(group.transfer_id) is group:
            del self._groups[group.transfer_id]


# --- outcomes of a follower rank's sends or receptions, as plain data across the rank channel ------

def outcome_of(done: Any) -> tuple:
    """("ok", bytes) or ("error", code, message) of a finished future of bytes moved."""
    error = done.exception()
    if error is None:
        return ("ok", done.result())
    code = error.code if isinstance(error, KVTransferError) else ErrorCode.ABORTED
    return ("error", int(code), str(error))


def bytes_or_raise(outcomes: dict[int, tuple]) -> int:
    """Total bytes of every rank's ("ok", bytes) outcome; the first rank's failure as its KVTransferError."""
    total = 0
    for rank, outcome in sorted(outcomes.items()):
        if outcome[0] != "ok":
            raise errors.error_from_code(outcome[1], f"rank {rank}: {outcome[2]}")
        total += outcome[1]
    return total
