"""`RoleSwitch` keeps exactly one role's gate open, drains the old role before opening the new one,
refuses bad switches naming the field; the router's pool replaces an entry whose role changed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.role_switch import RoleSwitch, RoleSwitchError
from common.serving import CallGate
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.pool import WorkerPool


class Service:
    """The part of a worker service a switch uses: its gate and `drain`."""

    def __init__(self, role: str):
        self.gate = CallGate(role)

    async def drain(self, grace_s: float) -> None:
        await self.gate.drain()


async def test_switch_drains_the_old_role_then_opens_the_new_one():
    services = {"prefill": Service("prefill"), "decode": Service("decode")}
    roles = RoleSwitch("decode", services)
    roles.start(None)
    assert not services["decode"].gate.draining and services["prefill"].gate.draining
    services["decode"].gate.in_flight = 1  # a decode call in flight
    switching = asyncio.ensure_future(roles.switch("prefill"))
    await asyncio.sleep(0.1)
    assert not switching.done() and services["decode"].gate.draining and services["prefill"].gate.draining
    with pytest.raises(RoleSwitchError, match="another role switch"):
        await roles.switch("decode")
    services["decode"].gate.leave()
    reply = await asyncio.wait_for(switching, 5)
    assert (reply.previous_role, reply.role) == (pb.ROLE_DECODE, pb.ROLE_PREFILL)
    assert roles.role == "prefill" and not services["prefill"].gate.draining and services["decode"].gate.draining


async def test_bad_switches_name_the_field():
    roles = RoleSwitch("decode", {"prefill": Service("prefill"), "decode": Service("decode")})
    roles.start(None)
    with pytest.raises(RoleSwitchError, match="role: must be one of") as unknown:
        await roles.switch("colocated")
    assert unknown.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RoleSwitchError, match="role: the worker is already a decode worker") as same:
        await roles.switch("decode")
    assert same.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_pool_replaces_a_worker_that_registers_with_another_role():
    pool = WorkerPool()
    pool.add("w", "decode", "127.0.0.1:1")
    worker = pool.add("w", "prefill", "127.0.0.1:1")
    assert worker.role == "prefill" and isinstance(worker.stub, pb_grpc.PrefillWorkerStub)
    assert [w.worker_id for w in pool.candidates("prefill")] == ["w"] and not pool.candidates("decode")
    await pool.close()
