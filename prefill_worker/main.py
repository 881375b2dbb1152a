"""`python -m prefill_worker`: the prefill worker's parts, served by common/worker.py's `run_worker`.

Parts: an engine in prefill-only use (torch threads from the pool's CPU share), a `KVSender`
(faults from `kv_transfer.faults`, transfer headers signed with the cluster secret) and the
`PrefillService`. Closing stops the sender's I/O thread, then the engine.
"""

from __future__ import annotations

import argparse
import asyncio

from common.config import PdserveConfig
from common.security import Security
from common.serving import ServerControl
from common.worker import WorkerParts, run_worker, worker_main
from engine import Engine
from engine.async_engine import AsyncEngine
from kvtransfer import FaultInjector, KVSender, fingerprint
from prefill_worker.service import PrefillService
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ROLE = "prefill"


async def build(config: PdserveConfig, args: argparse.Namespace, worker_id: str, security: Security) -> WorkerParts:
    engine = AsyncEngine(Engine(config.engine_for(ROLE)))
    engine.start()
    kv = config.kv_transfer
    model_fingerprint = fingerprint(engine.engine.layout, engine.engine.loaded.config.to_json_string())
    sender = KVSender(ack_timeout=kv.timeout_s, faults=FaultInjector.configured(kv.faults), secret=security.kv_secret)
    service = PrefillService(engine, sender, model_fingerprint, worker_id, layerwise=kv.layerwise, ack_timeout_s=kv.timeout_s)

    async def close() -> None:
        await asyncio.to_thread(sender.close)
        engine.stop()

    return WorkerParts(service, "pdserve.v1.PrefillWorker", pb_grpc.add_PrefillWorkerServicer_to_server, close)


async def serve(config: PdserveConfig, args: argparse.Namespace, worker_id: str, control: ServerControl | None = None) -> None:
    await run_worker(ROLE, build, config, args, worker_id, control)


def main(argv: list[str] | None = None) -> int:
    return worker_main(ROLE, serve, argv)
