"""One end of a KV transfer in its own namespace host, for tests/multihost/test_kv_namespaces.py.

    python -m tests.multihost.kv_peer recv HOST TRANSPORT TIMEOUT_S   (prints ready with its port, then result;
                                                                      exits when stdin closes)
    python -m tests.multihost.kv_peer send HOST PORT TRANSPORT [--same-host-scope]

The receiver expects transfer "t" of the unit tests' layout into fresh blocks and reports whether
it completed, the error otherwise, how long it took, whether the KV equals the sender's, and
how many transfers it still holds. `--same-host-scope` makes the sender treat the receiver as
on its own host (UCX with shared memory: what every release before the per-peer choice did).
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from common.serving import emit_event
from kvtransfer import KVEndpoint, KVReceiver, KVSender
from tests.unit.test_kvtransfer_transfer import DST_BLOCKS, FP, LAYOUT, SRC_BLOCKS, N, filled_cache, header


async def receive(host: str, transport: str, timeout: float) -> None:
    from engine.kv_cache import KVCache

    dst = KVCache(LAYOUT, num_blocks=16)
    async with KVReceiver(dst, transport, host=host, settle_timeout=2.0) as receiver:
        emit_event({"event": "ready", "port": receiver.endpoint.port})
        started = time.monotonic()
        result: dict = {"event": "result", "ok": False, "error": None}
        try:
            await receiver.expect("t", DST_BLOCKS, N, FP, timeout=timeout)
            src = filled_cache(0)
            result["ok"] = all(torch.equal(a, b) for layer in range(LAYOUT.num_layers)
                               for a, b in zip(src.read_tokens(layer, SRC_BLOCKS, N), dst.read_tokens(layer, DST_BLOCKS, N), strict=True))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result["error"] = f"{type(exc).__name__}: {exc}"
        result.update(elapsed_s=time.monotonic() - started, pending=receiver.pending)
        emit_event(result)
        await asyncio.to_thread(sys.stdin.readline)  # stay up until the sender has its answer


def send(host: str, port: int, transport: str, same_host: bool) -> None:
    if same_host:
        from kvtransfer.transport import ucx

        ucx.peer_scope = lambda _: ucx.SAME_HOST
    started = time.monotonic()
    result: dict = {"event": "result", "ok": False, "error": None}
    with KVSender(connect_timeout=5.0, ack_timeout=15.0) as sender:
        xfer = sender.begin(KVEndpoint(host, port, transport), header("t"))
        xfer.send_from_cache(filled_cache(0), SRC_BLOCKS)
        xfer.finish(first_token=1)
        try:
            xfer.result(30)
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{type(exc).__name__}: {exc}"
    result["elapsed_s"] = time.monotonic() - started
    emit_event(result)


def main() -> int:
    role, host = sys.argv[1], sys.argv[2]
    if role == "recv":
        asyncio.run(receive(host, sys.argv[3], float(sys.argv[4])))
    else:
        send(host, int(sys.argv[3]), sys.argv[4], "--same-host-scope" in sys.argv[5:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
