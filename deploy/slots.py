"""The controller's book of its workers: one `WorkerSlot` per worker actor, one `Pool` per role.

Lifecycle of a slot: "starting" (placement group and actor being created, not yet registered
with the router) -> "ready" -> "draining" (scale-down or shutdown), then it leaves its pool. A role
switch (`pdserve role`) takes a ready slot through "switching" back to "ready", in the other pool.
`worker_status` renders a slot (with what the router says about it) for `pdserve status`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common.config import PoolConfig
from deploy.autoscaler import PoolAutoscaler

ROLES = ("prefill", "decode")


@dataclass
class WorkerSlot:
    worker_id: str
    role: str
    actor: Any = None
    pg: Any = None
    state: str = "starting"
    """starting -> ready (<-> switching) -> draining (then gone)."""
    info: dict = field(default_factory=dict)
    stats: dict | None = None
    stats_at: float = 0.0
    """time.monotonic() of the last Stats read (deploy/monitor.py)."""
    created: float = field(default_factory=time.time)


@dataclass
class Pool:
    role: str
    config: PoolConfig
    autoscaler: PoolAutoscaler
    target: int = 0
    workers: dict[str, WorkerSlot] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def active(self) -> list[WorkerSlot]:
        return [w for w in self.workers.values() if w.state != "draining"]

    def ready(self) -> list[WorkerSlot]:
        return [w for w in self.workers.values() if w.state == "ready"]


def worker_status(slot: WorkerSlot, seen: dict | None) -> dict:
    s = slot.stats or {}
    total = s.get("total_kv_blocks", 0)
    if slot.state != "ready":
        health = slot.state
    elif not s:
        health = "unhealthy"
    elif seen is None or not seen["healthy"]:
        health = "unregistered"
    else:
        health = "healthy"
    return {
        "id": slot.worker_id,
        "address": slot.info.get("address"),
        "kv_port": slot.info.get("kv_port"),
        "node_ip": slot.info.get("node_ip"),
        "pid": slot.info.get("pid"),
        "health": health,
        "uptime_s": round(time.time() - slot.created, 1),
        "in_flight": s.get("in_flight", 0),
        "queued_requests": s.get("queued_requests", 0),
        "queued_prompt_tokens": s.get("queued_prompt_tokens", 0),
        "running_requests": s.get("running_requests", 0),
        "free_kv_blocks": s.get("free_kv_blocks", 0),
        "total_kv_blocks": total,
        "kv_usage": round((total - s.get("free_kv_blocks", 0)) / total, 4) if total else 0.0,
        "kv_bytes_sent": s.get("kv_bytes_sent", 0),
        "kv_bytes_received": s.get("kv_bytes_received", 0),
    }
