"""KV transfer between real processes on 127.0.0.1 (tcp and ucx), SmolLM2-135M KV shapes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvtransfer.loopback import Peer, PeerSpec

pytestmark = pytest.mark.timeout(120)

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
FAULTS = {"PDSERVE_KV_FAULTS": "corrupt:tampered:7"}


def spec(transport: str, **env: str) -> PeerSpec:
    return PeerSpec(transport=transport, num_blocks=160, env=dict(env), **SMOLLM2)


def plan(endpoint, tid: str, num_tokens: int, seed: int, **extra) -> dict:
    return {"endpoint": endpoint, "tid": tid, "num_tokens": num_tokens, "seed": seed, "first_token": seed, **extra}


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def peers(request: pytest.FixtureRequest) -> Iterator[tuple[str, Peer, Peer]]:
    """A receiver and a sender (with fault injection for transfer id 'tampered')."""
    transport = request.param
    receiver = Peer("receiver", spec(transport))
    sender = Peer("sender", spec(transport, **FAULTS))
    try:
        receiver.start()
        sender.start()
        yield transport, receiver, sender
    finally:
        sender.stop()
        receiver.stop()
    assert not sender.alive and not receiver.alive


def test_concurrent_transfers_land_intact(peers) -> None:
    _, receiver, sender = peers
    endpoint = receiver.ready
    cases = {
        "long": (1000, list(range(0, 63))),  # contiguous blocks: received in place
        "frag": (37, [100, 90, 91, 70]),  # scattered blocks
        "short": (16, [150]),
    }
    for tid, (n, blocks) in cases.items():
        receiver.call("expect", tid, blocks, n, 60.0)
    out = sender.call("send", [plan(endpoint, tid, n, seed=i) for i, (tid, (n, _)) in enumerate(cases.items())])
    for (tid, _), sent in zip(cases.items(), out["transfers"]):
        got = receiver.call("result", tid, 30.0)
        assert sent["ok"] and got["ok"], (sent, got)
        assert got["kv_crc"] == sent["kv_crc"], tid
    stats = receiver.call("stats")
    assert stats["completed"] >= 3 and stats["pending"] == 0


def test_tampered_payload_is_rejected_then_connection_still_works(peers) -> None:
    _, receiver, sender = peers
    endpoint = receiver.ready
    receiver.call("expect", "tampered", list(range(0, 32)), 500, 60.0)
    out = sender.call("send", [plan(endpoint, "tampered", 500, seed=5)])["transfers"][0]
    got = receiver.call("result", "tampered", 30.0)
    assert not got["ok"] and got["error"] == "ChecksumMismatch" and "layer 7" in got["message"]
    assert not out["ok"] and out["error"] == "ChecksumMismatch"
    receiver.call("expect", "after-tamper", list(range(0, 32)), 500, 60.0)
    out = sender.call("send", [plan(endpoint, "after-tamper", 500, seed=6)])["transfers"][0]
    got = receiver.call("result", "after-tamper", 30.0)
    assert out["ok"] and got["ok"] and got["kv_crc"] == out["kv_crc"]


def test_sender_killed_mid_transfer(peers) -> None:
    transport, receiver, _ = peers
    endpoint = receiver.ready
    victim = Peer("sender", spec(transport))
    try:
        victim.start()
        receiver.call("expect", "doomed", list(range(0, 64)), 1024, 60.0)
        victim.post("send", [plan(endpoint, "doomed", 1024, seed=9, layer_delay_s=0.1)])
        time.sleep(1.0)  # a few layers are through
        victim.kill()
        killed_at = time.monotonic()
        got = receiver.call("result", "doomed", 30.0)
        assert not got["ok"] and got["error"] == "TransferAborted", got
        assert time.monotonic() - killed_at < 10.0  # detected from the connection, not the 60 s deadline
    finally:
        victim.stop()
    stats = receiver.call("stats")
    assert stats["pending"] == 0 and stats["failed"].get("ABORTED", 0) >= 1


def test_receiver_killed_mid_transfer(peers) -> None:
    transport, _, sender = peers
    victim = Peer("receiver", spec(transport))
    try:
        endpoint = victim.start()
        victim.call("expect", "orphan", list(range(0, 64)), 1024, 60.0)
        sender.post("send", [plan(endpoint, "orphan", 1024, seed=3, layer_delay_s=0.1, timeout=30.0)])
        time.sleep(1.0)
        victim.kill()
        out = sender.wait_reply(40.0)["transfers"][0]
        assert not out["ok"] and out["error"] == "TransferAborted", out
    finally:
        victim.stop()
    assert sender.alive  # the sender survives its peer's death
