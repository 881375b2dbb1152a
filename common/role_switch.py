"""A worker's role, and switching it (prefill <-> decode) while its process keeps running.

A switchable worker (`python -m role_worker`) hosts one service per role over the same engine and
KV pool, all added to its gRPC server; only the active one admits calls (the others' `CallGate`s
stay closed: UNAVAILABLE). `RoleSwitch` owns the active role and its router registration.

Life of a switch (`WorkerAdmin.SwitchRole`, which the router forwards from `Registry.SwitchRole`):
  1. check the request (role known, no other switch under way, not the current role);
  2. stop heartbeating and deregister: the router stops routing to this worker at once;
  3. drain the old role's service: new calls that raced in are refused (UNAVAILABLE: the router
     retries them elsewhere), calls in flight finish;
  4. open the new role's gate and register with the new role; the call returns once the router
     accepted the registration: the router routes by the new role from then on.
Without a router (static workers) steps 2 and 4 only flip the gates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from common.registration import ROLES, RegistrationLoop
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ROLE_NAMES = {value: name for name, value in ROLES.items()}

Register = Callable[[str, Any], RegistrationLoop]
"""(role, service) -> a started registration loop for that role."""


class RoleSwitchError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class RoleSwitch:
    def __init__(self, role: str, services: dict[str, Any], drain_grace_s: float = 30.0):
        """`services`: the servicer of each role this process can take (each with `gate` and `drain`)."""
        self.role = role
        self.services = services
        self._register: Register | None = None
        self.drain_grace_s = drain_grace_s
        self.registration: RegistrationLoop | None = None
        self._lock = asyncio.Lock()
        for name, service in services.items():
            service.gate.draining = name != role

    @property
    def service(self) -> Any:
        return self.services[self.role]

    def start(self, register: Register | None) -> None:
        """Serve the current role; `register` (None: no router) registers it, now and after each switch."""
        self._register = register
        self._register_role()

    def _register_role(self) -> None:
        if self._register is not None:
            self.registration = self._register(self.role, self.service)

    async def _registered(self) -> None:
        """Wait (a few heartbeat intervals at most) until the router knows the new role."""
        if self.registration is not None:
            try:
                await asyncio.wait_for(self.registration.registered.wait(), 5 * self.registration.interval_s)
            except TimeoutError:
                log.warning("role %s: the router did not accept the registration yet; the loop keeps trying", self.role)

    async def stop(self) -> None:
        """Stop heartbeating and deregister (shutdown)."""
        if self.registration is not None:
            await self.registration.stop()
            self.registration = None

    async def drain(self, grace_s: float) -> None:
        await self.service.drain(grace_s)

    async def switch(self, role: str) -> pb.SwitchRoleResponse:
        if role not in self.services:
            raise RoleSwitchError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"role: must be one of {sorted(self.services)}, got {role!r}")
        if self._lock.locked():
            raise RoleSwitchError(grpc.StatusCode.FAILED_PRECONDITION, "role: another role switch is under way")
        if role == self.role:
            raise RoleSwitchError(grpc.StatusCode.FAILED_PRECONDITION, f"role: the worker is already a {role} worker")
        async with self._lock:
            return await self._switch(role)

    async def _switch(self, role: str) -> pb.SwitchRoleResponse:
        started = time.monotonic()
        previous = self.role
        log.info("role switch %s -> %s: deregistering and draining", previous, role)
        await self.stop()
        await self.service.drain(self.drain_grace_s)
        drained = time.monotonic()
        self.role = role
        self.service.gate.draining = False
        self._register_role()
        await self._registered()
        log.info("role switch %s -> %s done (drain %.2f s)", previous, role, drained - started)
        return pb.SwitchRoleResponse(previous_role=ROLES[previous], role=ROLES[role], drain_s=drained - started,
                                     switch_s=time.monotonic() - started)


class WorkerAdminService(pb_grpc.WorkerAdminServicer):
    """`pdserve.v1.WorkerAdmin` on a switchable worker's gRPC server (behind the cluster secret)."""

    def __init__(self, roles: RoleSwitch, worker_id: str):
        self.roles = roles
        self.worker_id = worker_id

    async def SwitchRole(self, request: pb.SwitchRoleRequest, context) -> pb.SwitchRoleResponse:
        if request.worker_id and request.worker_id != self.worker_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: this is worker {self.worker_id!r}, not {request.worker_id!r}")
        role = ROLE_NAMES.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role: must be ROLE_PREFILL or ROLE_DECODE")
        try:
            response = await self.roles.switch(role)
        except RoleSwitchError as exc:
            await context.abort(exc.code, str(exc))
        response.worker_id = self.worker_id
        return response
