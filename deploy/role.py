"""`pdserve role WORKER prefill|decode [--router HOST:PORT | --address RAY]`: switch a running worker's role.

Under Ray (no `--router`) the CLI asks the controller (deploy/launcher.py), which calls the worker
actor's `switch_role` and moves its slot to the other pool. With `--router` (plain processes, e.g.
bench/cluster.py) the CLI calls `Registry.SwitchRole` on the router's internal port (its ready line's
`internal_address`, behind the cluster secret: `-c CONFIG` supplies `security`); the router forwards
it to the worker's `WorkerAdmin` (a `python -m role_worker` process), which drains its calls in
flight, deregisters, takes the new role and registers again. The command returns once the worker
serves its new role (docs/operations.md, "Role switching"). Exit 0 on success, 2 on a refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from common.config import ConfigError, load_config
from common.registration import ROLES
from common.security import Security
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


def add_command(sub: argparse._SubParsersAction) -> None:
    role = sub.add_parser("role", help="switch a worker's role: pdserve role WORKER prefill|decode --router HOST:PORT")
    role.add_argument("worker", help="the worker id (as `pdserve status` or the worker's ready line shows it)")
    role.add_argument("role", help="prefill or decode")
    role.add_argument("--router", default=None, metavar="HOST:PORT",
                      help="plain processes: the router's internal address (its ready line's internal_address)")
    role.add_argument("--address", default=None, help="Ray cluster address, without --router (default: auto)")
    role.add_argument("-c", "--config", default=None, help="YAML config whose `security` (cluster secret, TLS) the call uses")
    role.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the drain and the switch")
    role.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.role not in ROLES:
        print(f"pdserve role: role: must be one of {sorted(ROLES)}, got {args.role!r}", file=sys.stderr)
        return 2
    if args.router is None:
        from deploy import launcher  # Ray: loaded only for this path

        return launcher.switch_role(args)
    try:
        security = Security.from_config(load_config(args.config).security) if args.config else Security()
    except ConfigError as exc:
        print(f"pdserve role: invalid config: {exc}", file=sys.stderr)
        return 2
    try:
        reply = _switch(args.router, security, args.worker, args.role, args.timeout)
    except grpc.RpcError as exc:
        print(f"pdserve role: {exc.details()}", file=sys.stderr)
        return 2
    report({"worker_id": reply.worker_id, "previous_role": _name(reply.previous_role), "role": _name(reply.role),
            "drain_s": round(reply.drain_s, 3), "switch_s": round(reply.switch_s, 3)}, args.json)
    return 0


def report(result: dict, as_json: bool) -> None:
    print(json.dumps(result) if as_json else
          f"{result['worker_id']}: {result['previous_role']} -> {result['role']} "
          f"(drained in {result['drain_s']:.2f} s, switched in {result['switch_s']:.2f} s)")


def _switch(router: str, security: Security, worker_id: str, role: str, timeout: float) -> pb.SwitchRoleResponse:
    async def call() -> pb.SwitchRoleResponse:
        channel = security.channel(router)
        try:
            request = pb.SwitchRoleRequest(worker_id=worker_id, role=ROLES[role])
            return await pb_grpc.RegistryStub(channel).SwitchRole(request, timeout=timeout)
        finally:
            await channel.close()

    return asyncio.run(call())


def _name(role: int) -> str:
    return {value: name for name, value in ROLES.items()}[role]
