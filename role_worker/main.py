"""`python -m role_worker`: a worker that can switch role (prefill <-> decode) without a restart.

Parts: one engine (the starting role's pool's CPU share; built with the `LayerStreamer` as its KV
layer sink, which acts only on the prompts the prefill service tracks), one KV pool, and both roles
over them: the prefill worker's `KVSender` + `PrefillService` and the decode worker's `KVReceiver`
(listening for the whole life of the process, so its endpoint never changes) + `DecodeService`.
common/worker.py's `run_worker` serves both services and `pdserve.v1.WorkerAdmin`; its `RoleSwitch`
keeps one active and registered (docs/operations.md, "Role switching").
Tensor parallelism is refused (`pools.<role>.tensor_parallel_size` must be 1): a switch would have
to move the follower ranks' KV endpoints too. Closing stops the sender, the receiver, then the engine.
"""

from __future__ import annotations

import argparse

from common.config import PdserveConfig
from common.security import Security
from common.serving import ServerControl
from common.validation import ConfigError
from common.worker import WorkerParts, lose_worker, run_worker, worker_main
from decode_worker.main import decode_parts
from engine import Engine
from engine.async_engine import AsyncEngine
from kvtransfer.faults import FaultPoint
from prefill_worker.main import prefill_parts
from prefill_worker.streamer import LayerStreamer

ROLES = ("prefill", "decode")


def require_single_rank(config: PdserveConfig) -> None:
    for role in ROLES:
        if getattr(config.pools, role).tensor_parallel_size != 1:
            raise ConfigError(f"pools.{role}.tensor_parallel_size", "must be 1 for a role-switching worker (python -m role_worker)")


def builder(role: str):
    """`run_worker`'s build for a worker starting as `role`."""
    async def build(config: PdserveConfig, args: argparse.Namespace, worker_id: str, security: Security) -> WorkerParts:
        require_single_rank(config)
        # whatever role it starts in, its KV receiver listens from the start
        security.require_secret_for([config.kv_transfer.host], config.security.allow_unauthenticated, f"role worker {worker_id}")
        fault_point = FaultPoint.from_env()  # test hook, read once here: PDSERVE_TEST_FAULT_POINT
        streamer = LayerStreamer(fault_point) if config.kv_transfer.streams_layerwise(config.engine_for(role).device) else None
        engine = AsyncEngine(Engine(config.engine_for(role), kv_sink=streamer), on_fatal=lose_worker)
        engine.start()
        every = {"prefill": await prefill_parts(config, engine, worker_id, security, streamer, fault_point),
                 "decode": await decode_parts(config, engine, args.kv_port, worker_id, security, fault_point)}

        async def close() -> None:
            for part in every.values():
                await part.close()  # each stops its KV endpoint, then the shared engine (stopping twice is a no-op)

        first = every[role]
        others = {name: part for name, part in every.items() if name != role}
        return WorkerParts(first.service, first.service_name, first.add_to_server, close, first.ready, others)

    return build


async def serve(role: str, config: PdserveConfig, args: argparse.Namespace, worker_id: str, control: ServerControl | None = None) -> None:
    await run_worker(role, builder(role), config, args, worker_id, control)


def main(argv: list[str] | None = None) -> int:
    """`--role` picks the starting role; every other flag is the workers' (common/worker.py)."""
    parser = argparse.ArgumentParser(prog="python -m role_worker", add_help=False)
    parser.add_argument("--role", choices=ROLES, required=True, help="the role to start in")
    known, rest = parser.parse_known_args(argv)
    return worker_main(known.role, lambda config, args, worker_id: serve(known.role, config, args, worker_id), rest)
