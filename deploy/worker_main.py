"""Entry point shared by `python -m prefill_worker` and `python -m decode_worker`.

Lifecycle: parse flags, load the YAML config once, build the engine (threads from the pool's CPU
share), start the KV endpoint (decode: receiver; prefill: sender; both sign or check transfer
headers with the cluster secret when one is set), start the gRPC server (TLS and the secret check
of deploy/security.py when configured), print
the ready line, optionally register with the router and heartbeat, serve until SIGTERM, drain, stop.
Under Ray (deploy/actors.py) the same `_serve` runs inside an actor with a `ServerControl`: the
ready info goes to the actor instead of stdout and the actor, not a signal, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import uuid

from deploy.config import PdserveConfig, load_config
from deploy.security import Security
from deploy.serving import ServerControl, announce_ready, configure_logging, create_server, serve_until_signalled, set_serving
from engine import Engine
from engine.async_engine import AsyncEngine
from engine.kv_sink import KVLayerSink
from kvtransfer.faults import FaultPoint
from prefill_worker.service import LayerStreamer

log = logging.getLogger(__name__)


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {role}_worker", description=f"pdserve {role} worker")
    parser.add_argument("-c", "--config", default=None, help="YAML config (default: deploy/configs/local.yaml)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument("--kv-port", type=int, default=0, help="decode: KV receiver port (0: any free port)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--router", default=None, help="router HOST:PORT to register with")
    parser.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


def build_engine(config: PdserveConfig, role: str, kv_sink: KVLayerSink | None = None) -> AsyncEngine:
    pool = getattr(config.pools, role)
    threads = config.engine.num_threads or pool.num_threads or max(1, int(pool.num_cpus))
    engine = Engine(dataclasses.replace(config.engine, num_threads=threads), kv_sink=kv_sink)
    front = AsyncEngine(engine)
    front.start()
    return front


def main(role: str, argv: list[str] | None = None) -> int:
    args = parse_args(role, argv)
    configure_logging(args.log_level)
    config = load_config(args.config)
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    asyncio.run(_serve(role, config, args, worker_id))
    return 0


async def _serve(role: str, config: PdserveConfig, args: argparse.Namespace, worker_id: str,
                 control: ServerControl | None = None) -> None:
    from kvtransfer import fingerprint
    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    security = Security.from_config(config.security)
    kv = config.kv_transfer
    fault_point = FaultPoint.from_env()  # test hook, read once here: PDSERVE_TEST_FAULT_POINT
    streamer = LayerStreamer(fault_point) if role == "prefill" and kv.layerwise else None
    engine = build_engine(config, role, kv_sink=streamer)
    model_fingerprint = fingerprint(engine.layout, engine.model_config_json)
    if role == "decode":
        from decode_worker.service import DecodeService
        from kvtransfer import KVReceiver

        receiver = KVReceiver(engine.kv_cache, kv.transport, host=kv.host, port=args.kv_port, secret=security.kv_secret)
        await receiver.start()
        service = DecodeService(engine, receiver, model_fingerprint, worker_id, kv_timeout_s=kv.timeout_s, fault_point=fault_point)
        service_name = "pdserve.v1.DecodeWorker"
        closers = [receiver.close]
    else:
        from kvtransfer import FaultInjector, KVSender
        from kvtransfer.codec import WirePolicy
        from prefill_worker.service import PrefillService

        sender = KVSender(ack_timeout=kv.timeout_s, faults=FaultInjector.configured(kv.faults), secret=security.kv_secret,
                          wire=WirePolicy(kv.wire_dtype, kv.compress_below_gbps))
        service = PrefillService(engine, sender, model_fingerprint, worker_id, streamer, kv.timeout_s, fault_point)
        service_name = "pdserve.v1.PrefillWorker"
        closers = [lambda: asyncio.to_thread(sender.close)]
    server, port, health_servicer = create_server(args.host, args.port, [service_name], security, protected=[service_name])
    if role == "decode":
        pb_grpc.add_DecodeWorkerServicer_to_server(service, server)
    else:
        pb_grpc.add_PrefillWorkerServicer_to_server(service, server)
    await server.start()
    await set_serving(health_servicer, [service_name], True)
    ready = {"role": role, "worker_id": worker_id, "grpc_port": port, "address": f"{args.host}:{port}"}
    if role == "decode":
        ready["kv_port"] = receiver.endpoint.port
    registration = None
    if args.router:
        from router.registry_client import RegistrationLoop

        registration = RegistrationLoop(args.router, role, worker_id, f"{args.host}:{port}", service, config.model_name, security)
        registration.start()
    if control is None:
        announce_ready(**ready)
    else:
        control.ready(ready, service=service, registration=registration)
    try:
        await serve_until_signalled(server, health_servicer, [service_name], service.drain,
                                    stop=control.stop if control is not None else None)
    finally:
        if registration is not None:
            await registration.stop()
        for close in closers:
            await close()
        engine.stop()
