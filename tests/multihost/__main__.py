"""By hand: `python -m tests.multihost up [--hosts N] [--rate-gbps R] [-c CONFIG]`, `status`, `down`.

`up` builds N namespace hosts with a Ray node each (host i has the resource `host_<i>`; hosts
2..N also `decode_slot`), optionally runs `pdserve serve -c CONFIG` on host 1, prints the state
and stays in the foreground until Ctrl-C / SIGTERM, then removes everything. `down` removes what
a crashed `up` (or test) left: every namespace named pdmh-*, the processes in them, /tmp/pdmh.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from bench import net
from tests.multihost.cluster import STATE_FILE, HostSpec, MultiHostCluster, remove_leftovers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multihost")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create hosts + Ray (+ pdserve serve with -c); foreground until Ctrl-C")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate-gbps", type=float, default=None, help="link rate of every host (tc tbf)")
    up.add_argument("-c", "--config", default=None, help="pdserve config to serve on host 1")
    sub.add_parser("down", help="remove every namespace, process and temp dir of the harness")
    sub.add_parser("status", help="namespaces that exist and the recorded cluster")
    args = parser.parse_args(argv)
    if args.command == "down":
        print(json.dumps({"removed": remove_leftovers()}))
        return 0
    if args.command == "status":
        state = json.loads(STATE_FILE.read_text()) if STATE_FILE.exists() else None
        print(json.dumps({"namespaces": net.leftover_namespaces(), "cluster": state}, indent=2))
        return 0
    return _up(args)


def _up(args: argparse.Namespace) -> int:
    reason = net.cannot_make_namespaces()
    if reason:
        print(f"cannot build hosts: {reason}", file=sys.stderr)
        return 1
    specs = [HostSpec(resources={} if i == 0 else {"decode_slot": 1}, rate_gbps=args.rate_gbps) for i in range(args.hosts)]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # taken by sigwait below
    cluster = MultiHostCluster(specs).up()
    try:
        if args.config:
            cluster.serve(Path(args.config))
        print(STATE_FILE.read_text(), flush=True)
        print("hosts up; Ctrl-C or SIGTERM removes them", file=sys.stderr, flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
