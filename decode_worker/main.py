"""`python -m decode_worker`: the decode worker's parts, served by common/worker.py's `run_worker`.

Parts: an engine (torch threads from the pool's CPU share), a `KVReceiver` bound to
`kv_transfer.host` (`--kv-port`, 0: any free port; it checks transfer headers with the cluster
secret) whose port joins the ready line, and the `DecodeService`. With
`pools.decode.tensor_parallel_size` N the engine starts N-1 follower ranks, each receiving its own
KV heads on its own receiver (decode_worker.ranks). Closing stops the receiver, then the engine.
"""

from __future__ import annotations

import argparse
import asyncio

from common.config import PdserveConfig
from common.security import Security
from common.serving import ServerControl
from common.worker import WorkerParts, lose_worker, run_worker, worker_main
from decode_worker.ranks import AGENT, FollowerReceivers
from decode_worker.service import DecodeService
from engine import Engine
from engine.async_engine import AsyncEngine
from kvtransfer import FaultInjector, KVReceiver, KVSender, fingerprint
from kvtransfer.faults import FaultPoint
from kvtransfer.pieces import RankSettings
from kvtransfer.prefix import PrefixSource
from kvtransfer.sender import make_sender
from kvtransfer.sharding import head_range
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ROLE = "decode"


async def build(config: PdserveConfig, args: argparse.Namespace, worker_id: str, security: Security) -> WorkerParts:
    ranks = (AGENT, RankSettings(config.kv_transfer, security.kv_secret))
    engine = AsyncEngine(Engine(config.engine_for(ROLE), rank_agent=ranks, rank_launcher=args.rank_launcher), on_fatal=lose_worker)
    engine.start()
    # test hook, read once here: PDSERVE_TEST_FAULT_POINT
    return await decode_parts(config, engine, args.kv_port, worker_id, security, FaultPoint.from_env())


async def decode_parts(config: PdserveConfig, engine: AsyncEngine, kv_port: int, worker_id: str, security: Security,
                       fault_point: FaultPoint | None) -> WorkerParts:
    """The decode role over a started engine: its KV receiver listens on `kv_port` (0: any free port)."""
    kv = config.kv_transfer
    model_fingerprint = fingerprint(engine.global_layout, engine.model_config_json)
    heads = head_range(engine.global_layout.num_kv_heads, engine.tensor_parallel_size, 0)
    receiver = KVReceiver(engine.kv_cache, kv.transport, host=kv.host, port=kv_port, secret=security.kv_secret, heads=heads)
    await receiver.start()
    followers = FollowerReceivers(engine.ranks)
    senders: list[KVSender] = []  # made at the first prefix another worker pulls from here

    def sender() -> KVSender:
        if not senders:
            senders.append(make_sender(kv, security.kv_secret, FaultInjector.configured(kv.faults)))
        return senders[0]

    service = DecodeService(engine, receiver, model_fingerprint, worker_id, kv_timeout_s=kv.timeout_s, fault_point=fault_point,
                            followers=followers, follower_endpoints=await followers.endpoints(),
                            source=PrefixSource(engine, sender, model_fingerprint, fault_point))

    async def close() -> None:
        await receiver.close()
        for made in senders:
            await asyncio.to_thread(made.close)
        engine.stop()

    return WorkerParts(service, "pdserve.v1.DecodeWorker", pb_grpc.add_DecodeWorkerServicer_to_server, close,
                       ready={"kv_port": receiver.endpoint.port})


async def serve(config: PdserveConfig, args: argparse.Namespace, worker_id: str, control: ServerControl | None = None) -> None:
    await run_worker(ROLE, build, config, args, worker_id, control)


def main(argv: list[str] | None = None) -> int:
    return worker_main(ROLE, serve, argv)
