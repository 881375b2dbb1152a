"""Hosts as Linux network namespaces on one virtual switch, and their removal.

Lifecycle: `Network(n).create()` makes a switch namespace `pdmh-sw` holding a bridge, then per
host i (1-based) a namespace `pdmh-h<i>` with loopback up and an `eth0` (the host end of a veth
pair whose other end is a bridge port in the switch namespace), address 198.18.0.<i>/24 (the
benchmarking range, RFC 2544: it exists only inside these namespaces). `set_rate(i, gbps)` puts
a tc `tbf` on both ends of host i's link (egress of each side), so traffic into and out of the
host is limited. `destroy()` kills every process still in a namespace (by pid, from
`ip netns pids`) and deletes the namespaces; deleting a namespace deletes its veth ends and the
bridge, so nothing stays in the root namespace. `remove_leftovers()` does the same for every
namespace whose name starts with the harness's prefix (after a crash).

The bridge lives in its own namespace rather than the root one so that the root namespace (the
machine's real network) never gains an interface or route, and one `ip netns del` removes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

PREFIX = "pdmh-"
SWITCH = PREFIX + "sw"
SUBNET = "198.18.0"


class NetworkError(RuntimeError):
    pass


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return result


def in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{ns}: {' '.join(cmd)}: {result.stderr.strip()}")
    return result


def cannot_make_namespaces() -> str:
    """Why hosts cannot be made here ('' when they can): not root, or no `ip netns`."""
    if os.geteuid() != 0:
        return f"multi-host tests need root (network namespaces); running as uid {os.geteuid()}"
    probe = PREFIX + "probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or 'ip netns add failed'}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


def host_ns(index: int) -> str:
    return f"{PREFIX}h{index}"


def host_ip(index: int) -> str:
    return f"{SUBNET}.{index}"


class Network:
    def __init__(self, hosts: int):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        self.hosts = hosts

    def create(self) -> Network:
        try:
            ip("netns", "add", SWITCH)
            ip("link", "set", "lo", "up", ns=SWITCH)
            ip("link", "add", "br0", "type", "bridge", ns=SWITCH)
            ip("link", "set", "br0", "up", ns=SWITCH)
            for i in range(1, self.hosts + 1):
                self._add_host(i)
        except Exception:
            self.destroy()
            raise
        return self

    def _add_host(self, i: int) -> None:
        ns, port = host_ns(i), f"p{i}"
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", ns=ns)
        # both ends are created inside the switch namespace, then one end moves to the host
        ip("link", "add", port, "type", "veth", "peer", "name", f"e{i}", ns=SWITCH)
        ip("link", "set", f"e{i}", "netns", ns, ns=SWITCH)
        ip("link", "set", f"e{i}", "name", "eth0", ns=ns)
        ip("addr", "add", f"{host_ip(i)}/24", "dev", "eth0", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)
        ip("link", "set", port, "master", "br0", ns=SWITCH)
        ip("link", "set", port, "up", ns=SWITCH)

    def set_rate(self, i: int, gbps: float | None) -> None:
        """Limit host i's link to `gbps` in each direction (None: no limit)."""
        for ns, dev in ((host_ns(i), "eth0"), (SWITCH, f"p{i}")):
            in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if gbps:
                rate_bit = int(gbps * 1e9)
                burst = max(rate_bit // 8 // 250, 64 * 1024)  # ~4 ms of traffic: tbf needs burst >= rate/HZ
                in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_bit}bit",
                      "burst", str(burst), "latency", "50ms")

    def set_link(self, i: int, up: bool) -> None:
        """Cut (or restore) host i's link at the switch: nothing reaches it, nothing leaves it."""
        ip("link", "set", f"p{i}", "up" if up else "down", ns=SWITCH)

    def namespaces(self) -> list[str]:
        return [SWITCH] + [host_ns(i) for i in range(1, self.hosts + 1)]

    def destroy(self) -> None:
        for ns in reversed(self.namespaces()):
            remove_namespace(ns)


def pids_in(ns: str) -> list[int]:
    result = ip("netns", "pids", ns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def kill_namespace_processes(ns: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
    """Send `sig` to every process in `ns` at once (a node dies); wait until they are gone.
    The calling process is spared (it may have entered `ns` itself, e.g. a benchmark driver)."""
    pids = [p for p in pids_in(ns) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while set(pids_in(ns)) - {os.getpid()} and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def remove_namespace(ns: str) -> None:
    existing = ip("netns", "list", check=False).stdout.split("\n")
    if not any(line.split(" ")[0] == ns for line in existing):
        return
    kill_namespace_processes(ns)
    ip("netns", "del", ns, check=False)


def leftover_namespaces() -> list[str]:
    listed = ip("netns", "list", check=False).stdout.splitlines()
    return [line.split(" ")[0] for line in listed if line.startswith(PREFIX)]


def remove_leftovers() -> list[str]:
    found = leftover_namespaces()
    for ns in sorted(found, reverse=True):  # hosts before the switch
        remove_namespace(ns)
    return found
