"""KV transfer between two processes in two network namespaces on one kernel (two pods on a node).

No Ray here: a receiver process in host B, a sender process in host A (tests/multihost/kv_peer.py).
With the default `ucx` transport the sender must not use UCX's shared-memory transports toward a
receiver in another namespace (they hung every transfer); and a transfer whose payload never
arrives (forced: the sender treats B as its own host) must fail within the receiver's timeout,
release what it held, and leave neither process hanging.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import net
from tests.multihost.cluster import remove_leftovers

pytestmark = pytest.mark.multihost
REPO = Path(__file__).parents[2]
TIMEOUT_S = 20.0  # covers the sender process starting (imports torch) after the receiver expects


@pytest.fixture
def two_hosts():
    remove_leftovers()
    network = net.Network(2).create()
    procs: list[subprocess.Popen] = []
    yield network, procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    network.destroy()
    assert not net.leftover_namespaces()


def peer(procs: list, host: int, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", net.host_ns(host), sys.executable, "-m", "tests.multihost.kv_peer", *args],
                            cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def transfer(procs: list, transport: str, *sender_flags: str) -> tuple[dict, dict]:
    """(receiver's result, sender's result) of one transfer B <- A."""
    receiver = peer(procs, 2, "recv", net.host_ip(2), transport, str(TIMEOUT_S))
    ready = json.loads(receiver.stdout.readline())
    sender = peer(procs, 1, "send", net.host_ip(2), str(ready["port"]), transport, *sender_flags)
    received = json.loads(receiver.stdout.readline())
    sent = json.loads(sender.communicate(timeout=90)[0].splitlines()[-1])
    receiver.communicate(timeout=30)  # closing its stdin lets it exit
    return received, sent


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_kv_crosses_namespaces_with_the_default_choice(two_hosts, transport):
    received, sent = transfer(two_hosts[1], transport)
    assert received["ok"] and received["error"] is None and received["pending"] == 0, received
    assert sent["ok"], sent


def test_payload_that_never_arrives_fails_within_the_timeout(two_hosts):
    received, sent = transfer(two_hosts[1], "ucx", "--same-host-scope")
    # whichever side's clock runs out first (receiver: timeout_s; sender: its 15 s ack timeout) ends it
    assert not received["ok"] and received["error"].split(":")[0] in ("TransferTimeout", "TransferAborted"), received
    assert received["elapsed_s"] < TIMEOUT_S + 5 and received["pending"] == 0, received  # settle_timeout 2 s at most
    assert not sent["ok"] and sent["error"], sent  # the sender is told; it does not hang either
