"""A transport's one-time setup happens when a worker starts, not in the first transfer."""

from __future__ import annotations

import asyncio

from kvtransfer import KVSender
from kvtransfer.transport import get_transport
from kvtransfer.transport.ucx import SAME_HOST, UcxWorker


def _ucx_worker_of(loop: asyncio.AbstractEventLoop) -> UcxWorker | None:
    return UcxWorker._by_loop.get(loop, {}).get(SAME_HOST)


def test_prepared_sender_has_its_ucx_worker_before_any_transfer():
    with KVSender() as sender:
        assert _ucx_worker_of(sender.loop) is None
        sender.prepare("ucx")
        worker = _ucx_worker_of(sender.loop)
        assert worker is not None and worker.address
        sender.prepare("ucx")  # once per loop
        assert _ucx_worker_of(sender.loop) is worker


def test_prepare_of_tcp_sets_up_nothing():
    with KVSender() as sender:
        sender.prepare("tcp")
        assert _ucx_worker_of(sender.loop) is None


async def test_a_ucx_listener_has_its_worker_before_the_first_connection():
    async def on_channel(channel) -> None:
        await channel.close()

    loop = asyncio.get_running_loop()
    assert _ucx_worker_of(loop) is None
    listener = await get_transport("ucx").listen("127.0.0.1", 0, on_channel)
    try:
        assert _ucx_worker_of(loop) is not None
    finally:
        await listener.close()
        _ucx_worker_of(loop).close()
