"""Fault injection at the KV transfer level: every kind of damage is detected by a real receiver.

One sender, one receiver in this process, over the real transports (local, tcp, ucx). Each fault
kind ends the transfer with its typed error on both sides, leaves nothing pending on the
receiver, and the next clean transfer through the same sender still succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from common.config import config_from_dict
from common.validation import ConfigError
from engine.kv_cache import KVCache
from kvtransfer import (
    ChecksumMismatch,
    KVReceiver,
    KVSender,
    ShapeMismatch,
    TransferAborted,
    TransferHeader,
    TransferTimeout,
)
from kvtransfer.faults import Fault, FaultInjector, FaultKind, FaultPoint
from tests.unit.test_kvtransfer_transfer import DST_BLOCKS, FP, LAYOUT, SRC_BLOCKS, TRANSPORTS, N, filled_cache

SPEC = "delay:slow-*:1:300,drop:lost-*:2,truncate:short-*:1,corrupt:flip-*:3,cut:cut-*:2"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=TRANSPORTS)
async def rig(request: pytest.FixtureRequest):
    """(receiver, destination cache, sender with SPEC's faults, endpoint)."""
    dst = KVCache(LAYOUT, num_blocks=16)
    receiver = KVReceiver(dst, request.param, settle_timeout=2.0)
    endpoint = await receiver.start()
    sender = KVSender(connect_timeout=5.0, ack_timeout=10.0, faults=FaultInjector.parse(SPEC))
    yield receiver, dst, sender, endpoint
    await asyncio.to_thread(sender.close)
    await receiver.close()


async def transfer(rig, tid: str, timeout: float = 10.0, seed: int = 0):
    """Run one whole transfer; returns (receiver future, outgoing transfer)."""
    receiver, _, sender, endpoint = rig
    fut = receiver.expect(tid, DST_BLOCKS, N, FP, timeout=timeout)
    xfer = sender.begin(endpoint, TransferHeader.for_layout(tid, LAYOUT, N, FP))
    xfer.send_from_cache(filled_cache(seed), SRC_BLOCKS)
    xfer.finish(7)
    return fut, xfer


async def assert_still_serving(rig, tid: str) -> None:
    """A clean transfer after the fault lands exactly the source KV."""
    receiver, dst, _, _ = rig
    fut, xfer = await transfer(rig, tid, seed=5)
    assert (await asyncio.wait_for(fut, 10)).first_token == 7
    await xfer.wait(10)
    src = filled_cache(5)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(src.read_tokens(layer, SRC_BLOCKS, N)[0], dst.read_tokens(layer, DST_BLOCKS, N)[0])
    assert receiver.pending == 0


# --- spec parsing ---------------------------------------------------------------------------


def test_spec_parses_every_kind() -> None:
    injector = FaultInjector.parse(SPEC)
    assert injector is not None
    assert injector.faults == [
        Fault(FaultKind.DELAY, "slow-*", 1, 300),
        Fault(FaultKind.DROP, "lost-*", 2),
        Fault(FaultKind.TRUNCATE, "short-*", 1),
        Fault(FaultKind.CORRUPT, "flip-*", 3),
        Fault(FaultKind.CUT, "cut-*", 2),
    ]
    assert FaultInjector.parse("  ") is None
    # patterns may contain ':' (the layer is the last field)
    assert FaultInjector.parse("corrupt:a:b:4").faults == [Fault(FaultKind.CORRUPT, "a:b", 4)]


@pytest.mark.parametrize("bad", ["explode:*:1", "corrupt:*", "corrupt::3", "delay:*:1", "drop:*:x", "delay:*:1:soon"])
def test_bad_spec_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="PDSERVE_KV_FAULTS"):
        FaultInjector.parse(bad)


def test_plan_targets_layers_and_prefers_exact_ids() -> None:
    injector = FaultInjector.parse("drop:t-*:2,corrupt:t-9:1,delay:*:0:5")
    assert injector.plan("t-1", 1).drop is False
    assert injector.plan("t-1", 2).drop and injector.plan("t-1", 3).drop  # a drop loses the rest too
    assert injector.plan("t-9", 1).corrupt and not injector.plan("t-9", 2).drop  # exact id: only its own faults
    assert injector.plan("other", 0).delay_s == pytest.approx(0.005)
    assert injector.plan("other", 1) == injector.plan("nobody", 3)


def test_config_field_wins_over_env_and_is_validated() -> None:
    env = {"PDSERVE_KV_FAULTS": "corrupt:*:1"}
    assert FaultInjector.configured("", env).faults == [Fault(FaultKind.CORRUPT, "*", 1)]
    assert FaultInjector.configured("cut:x:0", env).faults == [Fault(FaultKind.CUT, "x", 0)]
    assert FaultInjector.configured("", {}) is None
    assert config_from_dict({"kv_transfer": {"faults": "drop:*:3"}}).kv_transfer.faults == "drop:*:3"
    assert config_from_dict({}).kv_transfer.faults == ""
    with pytest.raises(ConfigError) as err:
        config_from_dict({"kv_transfer": {"faults": "melt:*:3"}})
    assert err.value.field == "kv_transfer.faults"


def test_fault_point_parse_fire_once_and_legacy_env(monkeypatch, caplog) -> None:
    point = FaultPoint.parse("decode.after_tokens:3:kill-*:mark")
    assert (point.point, point.count, point.pattern, point.stall) == ("decode.after_tokens", 3, "kill-*", False)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.faults"):
        point.reached("decode.after_tokens", "kill-1.0", 2)  # too early
        point.reached("decode.after_tokens", "other.0", 5)  # another request
        point.reached("decode.after_transfer", "kill-1.0", 5)  # another point
        assert not point.fired
        point.reached("decode.after_tokens", "kill-1.0", 3)
        point.reached("decode.after_tokens", "kill-2.0", 4)  # fires once per process
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["test hook: marking at decode.after_tokens 3"]

    slept: list[float] = []
    monkeypatch.setattr("kvtransfer.faults.time.sleep", slept.append)
    legacy = FaultPoint.from_env({"PDSERVE_TEST_PAUSE_AFTER_LAYER": "10"})
    assert legacy is not None and legacy.stall and legacy.count == 10
    legacy.reached("prefill.after_layer", "r.0", 10)
    assert slept == [3600]
    assert FaultPoint.from_env({}) is None and FaultPoint.from_env({"PDSERVE_TEST_PAUSE_AFTER_LAYER": "-1"}) is None
    with pytest.raises(ValueError, match="PDSERVE_TEST_FAULT_POINT"):
        FaultPoint.parse("decode.somewhere:1:*")


# --- each kind against a real receiver ------------------------------------------------------


async def test_delay_slows_but_the_transfer_succeeds(rig) -> None:
    _, _, sender, _ = rig
    started = time.monotonic()
    fut, xfer = await transfer(rig, "slow-1")
    assert (await asyncio.wait_for(fut, 10)).first_token == 7
    await xfer.wait(10)
    assert time.monotonic() - started >= 0.3  # the injected sleep happened (a lower bound, not a speed)
    assert sender.faults.fired == [("delay", "slow-1", 1)]


async def test_drop_times_out_on_the_receiver(rig) -> None:
    receiver, _, sender, _ = rig
    fut, xfer = await transfer(rig, "lost-1", timeout=1.0)
    with pytest.raises(TransferTimeout, match="2 layers verified"):
        await asyncio.wait_for(fut, 10)
    with pytest.raises(TransferTimeout):
        await xfer.wait(10)
    assert [f[0] for f in sender.faults.fired] == ["drop", "drop"]  # layers 2 and 3, then no trailer
    assert receiver.pending == 0
    await assert_still_serving(rig, "after-drop")


async def test_truncate_is_a_shape_error(rig) -> None:
    receiver = rig[0]
    fut, xfer = await transfer(rig, "short-1")
    with pytest.raises(ShapeMismatch, match="layer 1 carries"):
        await asyncio.wait_for(fut, 10)
    with pytest.raises(ShapeMismatch):
        await xfer.wait(10)
    assert receiver.stats.failed["SHAPE_MISMATCH"] == 1
    await assert_still_serving(rig, "after-truncate")


async def test_corrupt_is_a_checksum_error(rig) -> None:
    sender = rig[2]
    fut, xfer = await transfer(rig, "flip-1")
    with pytest.raises(ChecksumMismatch, match="layer 3"):
        await asyncio.wait_for(fut, 10)
    with pytest.raises(ChecksumMismatch):
        await xfer.wait(10)
    assert sender.faults.tampered == [("flip-1", 3)]
    await assert_still_serving(rig, "after-corrupt")


async def test_cut_is_a_connection_error_and_the_sender_reconnects(rig) -> None:
    receiver = rig[0]
    fut, xfer = await transfer(rig, "cut-1")
    with pytest.raises(TransferAborted, match="disconnected"):
        await asyncio.wait_for(fut, 10)
    with pytest.raises(TransferAborted, match="cut before layer 2"):
        await xfer.wait(10)
    assert receiver.pending == 0 and receiver.stats.failed["ABORTED"] == 1
    await assert_still_serving(rig, "after-cut")  # a fresh connection


async def test_faults_hit_only_matching_transfers_among_concurrent_ones(rig) -> None:
    receiver, dst, sender, endpoint = rig
    blocks = {"flip-2": [0, 1, 2, 3, 4], "ok-1": [5, 6, 7, 8, 9], "short-2": [10, 11, 12, 13, 14]}
    src = filled_cache(3)
    futs, xfers = {}, {}
    for tid, dst_blocks in blocks.items():
        futs[tid] = receiver.expect(tid, dst_blocks, N, FP, timeout=10)
        xfers[tid] = sender.begin(endpoint, TransferHeader.for_layout(tid, LAYOUT, N, FP))
    for tid in blocks:
        xfers[tid].send_from_cache(src, SRC_BLOCKS)
        xfers[tid].finish(1)
    results = dict(zip(futs, await asyncio.gather(*futs.values(), return_exceptions=True)))
    assert isinstance(results["flip-2"], ChecksumMismatch)
    assert isinstance(results["short-2"], ShapeMismatch)
    assert results["ok-1"].first_token == 1
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(src.read_tokens(layer, SRC_BLOCKS, N)[1], dst.read_tokens(layer, blocks["ok-1"], N)[1])
    assert receiver.pending == 0
