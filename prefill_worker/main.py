"""`python -m prefill_worker`: the prefill worker's parts, served by common/worker.py's `run_worker`.

Parts: an engine in prefill-only use (torch threads from the pool's CPU share) whose KV layer
sink is the `LayerStreamer` (with `kv_transfer.layerwise`), a `KVSender` (faults from
`kv_transfer.faults`, transfer headers signed with the cluster secret) and the `PrefillService`.
With `pools.prefill.tensor_parallel_size` N the engine starts N-1 follower ranks, each sending its
own KV heads (prefill_worker.ranks). Closing stops the sender's I/O thread, then the engine.
"""

from __future__ import annotations

import argparse
import asyncio

from common.config import PdserveConfig
from common.security import Security
from common.serving import ServerControl
from common.worker import WorkerParts, lose_worker, run_worker, worker_main
from engine import Engine
from engine.async_engine import AsyncEngine
from kvtransfer import FaultInjector, KVReceiver, fingerprint
from kvtransfer.faults import FaultPoint
from kvtransfer.pieces import RankSettings
from kvtransfer.prefix import PrefixPuller, PrefixSource
from kvtransfer.sender import make_sender
from prefill_worker.ranks import AGENT
from prefill_worker.service import PrefillService
from prefill_worker.streamer import LayerStreamer
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ROLE = "prefill"


async def build(config: PdserveConfig, args: argparse.Namespace, worker_id: str, security: Security) -> WorkerParts:
    fault_point = FaultPoint.from_env()  # test hook, read once here: PDSERVE_TEST_FAULT_POINT
    streamer = LayerStreamer(fault_point) if config.kv_transfer.streams_layerwise(config.engine_for(ROLE).device) else None
    ranks = (AGENT, RankSettings(config.kv_transfer, security.kv_secret))
    engine = AsyncEngine(Engine(config.engine_for(ROLE), kv_sink=streamer, rank_agent=ranks, rank_launcher=args.rank_launcher),
                         on_fatal=lose_worker)
    engine.start()
    return await prefill_parts(config, engine, worker_id, security, streamer, fault_point)


async def prefill_parts(config: PdserveConfig, engine: AsyncEngine, worker_id: str, security: Security, streamer: LayerStreamer | None,
                  fault_point: FaultPoint | None) -> WorkerParts:
    """The prefill role over a started engine (built with `streamer` as its KV layer sink)."""
    kv = config.kv_transfer
    model_fingerprint = fingerprint(engine.global_layout, engine.model_config_json)
    sender = make_sender(kv, security.kv_secret, FaultInjector.configured(kv.faults))
    puller = None
    if engine.tensor_parallel_size == 1:  # its own receiver, for prefixes it pulls from other workers (kvtransfer.prefix)
        receiver = KVReceiver(engine.kv_cache, kv.transport, host=kv.host, secret=security.kv_secret)
        await receiver.start()
        puller = PrefixPuller(engine, receiver, model_fingerprint, security.channel, kv.timeout_s)
    source = PrefixSource(engine, lambda: sender, model_fingerprint, fault_point)
    service = PrefillService(engine, sender, model_fingerprint, worker_id, streamer, kv.timeout_s, fault_point, puller, source)

    async def close() -> None:
        if puller is not None:
            await puller.close()
        await asyncio.to_thread(sender.close)
        engine.stop()

    return WorkerParts(service, "pdserve.v1.PrefillWorker", pb_grpc.add_PrefillWorkerServicer_to_server, close)


async def serve(config: PdserveConfig, args: argparse.Namespace, worker_id: str, control: ServerControl | None = None) -> None:
    await run_worker(ROLE, build, config, args, worker_id, control)


def main(argv: list[str] | None = None) -> int:
    return worker_main(ROLE, serve, argv)
