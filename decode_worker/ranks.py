"""A tensor-parallel decode worker's follower ranks, and rank 0's handle on them.

Rank 0 is the worker process (gRPC, scheduler, sampler, its own KVReceiver). Each of ranks 1..N-1
runs a `DecodeRank` (built in its rank process by engine.parallel.follower): a KVReceiver over its
own pool, which holds only its KV heads, on an event loop thread of its own. Calls from rank 0:
  endpoint  answer with the receiver's KVEndpoint (admissions advertise every rank's);
  expect    a prompt's pieces into these blocks (kvtransfer.pieces): answer once the receiver expects
            them (rank 0 sends the admission only then: the prefill worker's first piece may follow it
            at once);
  received  answer once the expected pieces landed (bytes) or failed (the error), and only once
            nothing writes into the blocks any more; rank 0 asks it after every `expect`;
  cancel    give up on one (client gone, prefill failed); before `received`, it forgets the transfer.
Rank 0 drives them through `FollowerReceivers`.
"""

from __future__ import annotations

import asyncio
import threading

from common.engine_config import EngineConfig
from engine.parallel import TensorParallelGroup
from engine.parallel.messages import Call
from engine.runtime import Runtime
from kvtransfer import ErrorCode, KVEndpoint, KVReceiver
from kvtransfer.pieces import RankSettings, bytes_or_raise, outcome_of
from kvtransfer.sharding import head_range

AGENT = "decode_worker.ranks:DecodeRank"


class DecodeRank:
    sink = None  # a decode rank hands no layers anywhere

    def __init__(self, runtime: Runtime, rank: int, config: EngineConfig, settings: RankSettings):
        tp = config.tensor_parallel_size
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"kv-receiver-rank{rank}", daemon=True).start()
        heads = head_range(runtime.layout.num_kv_heads * tp, tp, rank)
        self.receiver = KVReceiver(runtime.kv_cache, settings.kv.transport, host=settings.kv.host, secret=settings.kv_secret, heads=heads)
        asyncio.run_coroutine_threadsafe(self.receiver.start(), self.loop).result(60)
        self._expected: dict[str, asyncio.Future] = {}  # by transfer id, from `expect` to `received`; on self.loop only

    def handle(self, call: Call, respond) -> None:
        verb, transfer_id = call.key
        if verb == "endpoint":
            respond(self.receiver.endpoint)
        elif verb == "expect":
            self.loop.call_soon_threadsafe(self._expect, transfer_id, call.payload, respond)
        elif verb == "received":
            self.loop.call_soon_threadsafe(self._received, transfer_id, respond)
        elif verb == "cancel":
            self.loop.call_soon_threadsafe(self._cancel, transfer_id, call.payload)

    def _expect(self, transfer_id: str, payload: tuple, respond) -> None:
        block_ids, num_tokens, fingerprint, timeout = payload
        try:
            expected = self.receiver.expect_pieces(transfer_id, block_ids, num_tokens, fingerprint, timeout)
        except (ValueError, RuntimeError) as exc:
            respond(("error", int(ErrorCode.ABORTED), f"cannot expect {transfer_id}: {exc}"))
            return
        expected.add_done_callback(lambda done: done.cancelled() or done.exception())  # may end unasked (cancelled first)
        self._expected[transfer_id] = expected
        respond(("ok", 0))

    def _received(self, transfer_id: str, respond) -> None:
        expected = self._expected.pop(transfer_id, None)
        if expected is None:
            respond(("error", int(ErrorCode.ABORTED), f"{transfer_id} was never expected here"))
            return

        def answer(done: asyncio.Future) -> None:
            respond(("ok", done.result().nbytes) if done.exception() is None else outcome_of(done))

        expected.add_done_callback(answer)

    def _cancel(self, transfer_id: str, reason: str) -> None:
        # Still here only if rank 0 gave up before its admission went out: nothing can write into the blocks.
        self._expected.pop(transfer_id, None)
        self.receiver.cancel(transfer_id, reason)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.receiver.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class FollowerReceivers:
    """Rank 0's handle on the follower ranks' receivers (a worker with TP = 1 has none)."""

    def __init__(self, group: TensorParallelGroup | None):
        self.group = group

    async def endpoints(self) -> list[KVEndpoint]:
        if self.group is None:
            return []
        replies = await self.group.ask(("endpoint", None), dict.fromkeys(self.group.followers))
        return [replies[rank] for rank in self.group.followers]

    async def expect(self, transfer_id: str, block_ids: list[int], num_tokens: int, fingerprint: str, timeout: float) -> None:
        """Returns once every follower expects its pieces; raises the first failure."""
        if self.group is not None:
            payload = (block_ids, num_tokens, fingerprint, timeout)
            bytes_or_raise(await self.group.ask(("expect", transfer_id), dict.fromkeys(self.group.followers, payload)))

    async def received(self, transfer_id: str) -> int:
        """Bytes the followers received, once every one has its pieces; raises the first failure."""
        if self.group is None:
            return 0
        return bytes_or_raise(await self.group.ask(("received", transfer_id), dict.fromkeys(self.group.followers)))

    def cancel(self, transfer_id: str, reason: str = "cancelled by the decode worker") -> None:
        if self.group is not None:
            self.group.tell(("cancel", transfer_id), dict.fromkeys(self.group.followers, reason))
