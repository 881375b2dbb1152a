"""The controller's adaptive step (`Monitor.adapt`, deploy/monitor.py) against a stand-in router actor: the plan's threshold
reaches the router, and the decision is an event with its inputs. (The Ray path: tests/scenarios/test_ray_deploy.py.)"""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from common.config import config_from_dict
from deploy import controller as controller_module
from deploy.controller import Controller, DeployOptions
from deploy.slots import WorkerSlot


class Ref:
    def __init__(self, value):
        self.value = value

    def future(self) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self.value)
        return done


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Ref(self.fn(*args))


class RouterStandIn:
    """Answers what the router actor answers the controller's adaptive step: summary(), set_local_prefill_threshold()."""

    def __init__(self, verdict: str, margin: float):
        self.threshold = 0
        self.summary = Method(lambda window_s=60.0: {"local_prefill_threshold": self.threshold, "critical_path": {
            "stages": {"prefill_queue": {"share": 0.1}}, "verdict": {"verdict": verdict, "margin": margin}}})
        self.set_local_prefill_threshold = Method(self._set)

    def _set(self, tokens: int) -> int:
        old, self.threshold = self.threshold, tokens
        return old


@pytest.fixture
def controller(monkeypatch) -> Controller:
    monkeypatch.setattr(controller_module, "Placement", lambda detached: None)  # no Ray cluster in a unit test
    config = config_from_dict({"autoscaler": {"enabled": True, "adaptive": {
        "mode": "adaptive", "hold_intervals": 2, "threshold_cooldown_s": 0, "local_prefill_step": 64}}})
    ctrl = Controller(config, DeployOptions())
    for role, pool in ctrl.pools.items():
        pool.workers[f"{role}-0"] = WorkerSlot(f"{role}-0", role, state="ready", stats={"total_kv_blocks": 100, "free_kv_blocks": 90})
        pool.target = 1
    return ctrl


def test_a_held_decision_moves_the_routers_threshold_and_is_logged_with_its_inputs(controller):
    controller.router = RouterStandIn("does not pay", -0.4)
    asyncio.run(controller.monitor.adapt(False))
    assert controller.router.threshold == 0 and not controller.events, "held for one interval"
    asyncio.run(controller.monitor.adapt(False))
    assert controller.router.threshold == 64
    (event,) = controller.events
    assert event["pool"] == "controller" and event["from"] == "1P/1D, local prefill <= 0 tokens"
    assert event["to"] == "1P/1D, local prefill <= 64 tokens" and "does not pay (-40.0%)" in event["reason"]
    assert event["inputs"]["verdict"] == "does not pay" and event["inputs"]["decode"]["kv_usage"] == pytest.approx(0.1)
    assert controller.policy.scalers["decode"] is controller.pools["decode"].autoscaler, "one loop: the pools' autoscalers are the policy's"


def test_the_per_pool_autoscaler_runs_alone_in_pools_mode(monkeypatch):
    monkeypatch.setattr(controller_module, "Placement", lambda detached: None)
    ctrl = Controller(config_from_dict({"autoscaler": {"enabled": True}}), DeployOptions())
    assert ctrl.policy is None and ctrl.pools["prefill"].autoscaler.role == "prefill"
