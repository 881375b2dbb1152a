"""A tensor-parallel prefill worker's follower ranks, and rank 0's handle on them.

Rank 0 is the worker process (gRPC, scheduler, sampler, its own KVSender). Each of ranks 1..N-1
runs a `PrefillRank` (built in its rank process by engine.parallel.follower): its own KVSender,
sending its KV heads of every prompt straight to the decode ranks that own them. One prompt, as a
follower sees it (calls from rank 0 arrive in channel order, before and after the prompt's step):
  begin   the destination: open this rank's pieces (kvtransfer.pieces.PieceSend);
  step    the forward that completes the prompt hands each layer to this rank's LayerStreamer;
  finish  send the trailers, answer once the decode ranks acknowledged (bytes sent, or the error);
  abort   give up (prefill failed or cancelled).
Rank 0 drives them through `FollowerSends`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from common.engine_config import EngineConfig
from engine.parallel import TensorParallelGroup
from engine.parallel.messages import Call
from engine.runtime import Runtime
from kvtransfer.errors import ErrorCode
from kvtransfer.pieces import Destination, PieceSend, RankSettings, bytes_or_raise, outcome_of
from kvtransfer.sender import make_sender
from prefill_worker.streamer import LayerStreamer

AGENT = "prefill_worker.ranks:PrefillRank"

log = logging.getLogger(__name__)


class PrefillRank:
    def __init__(self, runtime: Runtime, rank: int, config: EngineConfig, settings: RankSettings):
        self.rank, self.tp = rank, config.tensor_parallel_size
        self.layout = dataclasses.replace(runtime.layout, num_kv_heads=runtime.layout.num_kv_heads * self.tp)
        self.settings = settings
        self.sender = make_sender(settings.kv, settings.kv_secret)
        self.sink = LayerStreamer()
        self._sends: dict[str, PieceSend] = {}

    def handle(self, call: Call, respond) -> None:
        verb, request_id = call.key
        if verb == "begin":
            destination, num_tokens = call.payload
            try:
                send = PieceSend(self.sender, destination, self.layout, num_tokens, self.rank, self.tp, self.settings.kv.timeout_s)
            except (ValueError, RuntimeError) as exc:  # answered at `finish`: no send for this request
                log.warning("rank %d: cannot send %s: %s", self.rank, request_id, exc)
                return
            self._sends[request_id] = send
            self.sink.track(request_id, send)
            return
        send = self._sends.pop(request_id, None)
        self.sink.forget(request_id)
        if send is None:
            if verb == "finish":
                respond(("error", int(ErrorCode.ABORTED), f"rank {self.rank} has no transfer for {request_id}"))
        elif verb == "abort":
            send.abort(call.payload)
        elif verb == "finish":
            send.finish(0)  # the first token travels in rank 0's pieces
            waited = asyncio.run_coroutine_threadsafe(send.wait(self.settings.kv.timeout_s), self.sender.loop)
            waited.add_done_callback(lambda done: respond(outcome_of(done)))

    def close(self) -> None:
        self.sender.close()


class FollowerSends:
    """Rank 0's handle on the follower ranks' sends (a worker with TP = 1 has none)."""

    def __init__(self, group: TensorParallelGroup | None):
        self.group = group

    def begin(self, request_id: str, destination: Destination, num_tokens: int) -> None:
        if self.group is not None:
            self.group.tell(("begin", request_id), {rank: (destination, num_tokens) for rank in self.group.followers})

    async def finish(self, request_id: str) -> int:
        """Bytes the followers sent, once every decode rank acknowledged; raises the first failure."""
        if self.group is None:
            return 0
        return bytes_or_raise(await self.group.ask(("finish", request_id), dict.fromkeys(self.group.followers)))

    def abort(self, request_id: str, reason: str) -> None:
        if self.group is not None:
            self.group.tell(("abort", request_id), dict.fromkeys(self.group.followers, reason))
