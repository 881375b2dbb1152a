"""One open channel from a KV sender to one receiver, shared by every transfer to it.

Lifecycle: `KVSender` opens a `Connection` per receiver endpoint and caches it; each transfer
opens a stream on it (`open_stream`: a stream number and the future of the receiver's RESULT for
it) and closes it when done. A reader task routes RESULT frames to their stream's future until
the channel ends; then every unresolved future fails with `ChannelClosed` and the channel closes.
"""

from __future__ import annotations

import asyncio
import itertools

from kvtransfer.errors import ProtocolError
from kvtransfer.transport.base import Channel, ChannelClosed
from kvtransfer.wire import FrameKind, Result


class Connection:
    """An open channel to one receiver plus the RESULT futures of its streams."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.results: dict[int, asyncio.Future[Result]] = {}
        self._streams = itertools.count(1)
        self.reader = asyncio.get_running_loop().create_task(self._read_results())

    def open_stream(self) -> tuple[int, asyncio.Future[Result]]:
        stream = next(self._streams) & 0xFFFFFFFF
        result: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # may end unobserved
        self.results[stream] = result
        return stream, result

    def close_stream(self, stream: int) -> None:
        self.results.pop(stream, None)

    async def _read_results(self) -> None:
        error: BaseException = ChannelClosed("connection closed")
        try:
            while True:
                frame = await self.channel.recv()
                if frame.payload_nbytes:
                    await self.channel.discard_payload(frame)
                if frame.kind != FrameKind.RESULT:
                    raise ProtocolError(f"unexpected {frame.kind.name} frame from a receiver")
                result = self.results.get(frame.stream)
                if result is not None and not result.done():
                    result.set_result(Result.decode(frame.body))
        except (ChannelClosed, ProtocolError) as exc:
            error = exc
        finally:
            for result in self.results.values():
                if not result.done():
                    result.set_exception(ChannelClosed(f"connection to {self.channel.peer} lost: {error}"))
            await self.channel.close()

    async def close(self) -> None:
        await self.channel.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.reader), 5.0)
        except (TimeoutError, Exception):  # noqa: BLE001 - teardown
            self.reader.cancel()
