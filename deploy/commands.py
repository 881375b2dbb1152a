"""The Ray commands of the `pdserve` CLI (`serve`, `up`, `down`, `status`, `scale`), light half.

Their flags, the config they load and the helpers that need no cluster live here, so that the CLI
stays light (no Ray) for every other command. `run(args)` loads and validates the config of
`serve` / `up` first (a bad one exits 2 before Ray is even imported), then hands over to
deploy/launcher.py, which holds everything that talks to Ray. `status` first asks the controller's
loopback endpoint on this machine (deploy/status_endpoint.py: no Ray, well under a second).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from common.config import ConfigError, PdserveConfig, load_config
from deploy.status_endpoint import fetch_status

SHUTDOWN_GRACE_S = 30.0


def add_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run router + prefill + decode pools on Ray in the foreground")
    _config_flags(serve)
    serve.add_argument("--grpc-port", type=int, default=None, help="router gRPC port (default: router.grpc_port; 0: any free port)")
    serve.add_argument("--http-port", type=int, default=None, help="router HTTP port (default: router.http_port; 0: any free port)")
    serve.add_argument("--num-cpus", type=float, default=None, help="logical CPUs of the embedded Ray (default: what the config needs)")

    up = sub.add_parser("up", help="start pdserve detached on a running Ray cluster and return")
    _config_flags(up)
    up.add_argument("--grpc-port", type=int, default=None)
    up.add_argument("--http-port", type=int, default=None)

    down = sub.add_parser("down", help="drain and remove the pdserve deployment from the Ray cluster")
    down.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    down.add_argument("--grace", type=float, default=SHUTDOWN_GRACE_S, help="seconds requests in flight get to finish")

    status = sub.add_parser("status", help="router, pools and workers with health and load")
    status.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    status.add_argument("--json", action="store_true")

    scale = sub.add_parser("scale", help="resize pools: pdserve scale prefill=N decode=M")
    scale.add_argument("pools", nargs="+", metavar="ROLE=N")
    scale.add_argument("--address", default=None, help="Ray cluster address (default: auto)")
    scale.add_argument("--json", action="store_true")


def _config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", default=None, help="YAML config (default: deploy/configs/local.yaml)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: serve starts its own; up uses auto)")
    parser.add_argument("--bind-host", default=None,
                        help="host the servers bind to (default: 127.0.0.1 on an embedded Ray, else each node's IP)")


def run(args: argparse.Namespace) -> int:
    config = None
    if args.command in ("serve", "up"):
        config = load_or_report(args)
        if config is None:
            return 2
    if args.command == "status" and (report := fetch_status(args.address)) is not None:
        print(json.dumps(report, indent=2) if args.json else format_status(report))  # no Ray: deploy/status_endpoint.py
        return 0
    from deploy import launcher  # Ray: loaded only for these commands, and only after the config passed

    return launcher.run(args, config)


def load_or_report(args: argparse.Namespace) -> PdserveConfig | None:
    """The validated config with CLI port overrides, or None after printing the bad field."""
    try:
        return load_config(args.config).with_router_ports(getattr(args, "grpc_port", None), getattr(args, "http_port", None))
    except ConfigError as exc:
        print(f"pdserve: invalid config: {exc}", file=sys.stderr)
        return None


def logical_cpus(config: PdserveConfig) -> int:
    """CPUs the embedded Ray declares: enough for the router and every pool at max_replicas (a
    tensor-parallel worker holds one bundle per rank)."""
    pools = config.pools
    needed = config.router.num_cpus + sum(p.max_replicas * p.tensor_parallel_size * p.num_cpus for p in (pools.prefill, pools.decode))
    return max(os.cpu_count() or 1, math.ceil(needed))


def custom_resources(config: PdserveConfig) -> dict[str, float]:
    """Custom Ray resources the embedded (single) node declares: all that the config can ask for."""
    total: dict[str, float] = dict(config.router.resources)
    for pool in (config.pools.prefill, config.pools.decode):
        for name, amount in pool.resources.items():
            total[name] = total.get(name, 0.0) + pool.max_replicas * pool.tensor_parallel_size * amount
    return total


def parse_scale_targets(specs: list[str]) -> dict[str, int]:
    targets: dict[str, int] = {}
    for spec in specs:
        role, sep, value = spec.partition("=")
        if not sep or role not in ("prefill", "decode"):
            raise ValueError(f"{spec!r}: expected prefill=N or decode=N")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{spec!r}: N must be an integer") from None
        if n < 0:
            raise ValueError(f"{spec!r}: N must be >= 0")
        targets[role] = n
    return targets


def format_status(report: dict) -> str:
    r = report["router"]
    lines = [(f"router   grpc={r.get('grpc')}  http={r.get('http')}  internal={r.get('internal')}  {r.get('health')}  "
              f"in_flight={r.get('in_flight_requests', '?')}")]
    sec = report.get("security")
    if sec:
        lines.append(f"security authenticated ({sec['secret']})  tls={'on' if sec['tls'] else 'off'}")
    for role, pool in report["pools"].items():
        lines.append(f"{role:<8} {pool['replicas']} worker(s)  [min {pool['min_replicas']}, max {pool['max_replicas']}]")
        for w in pool["workers"]:
            lines.append(f"  {w['id']:<12} {w['address'] or '-':<22} {w['health']:<10} in_flight={w['in_flight']} "
                         f"queued={w['queued_requests']} ({w['queued_prompt_tokens']} tok) running={w['running_requests']} "
                         f"kv={100 * w['kv_usage']:.0f}%")
    lines.extend(format_kv_index(r.get("kv_index")))
    lines.extend(format_critical_path(r.get("critical_path")))
    scaler = report.get("autoscaler", {})
    lines.append(f"autoscaler {'on' if scaler.get('enabled') else 'off'}  mode {scaler.get('mode', 'pools')}")
    lines.extend(f"  now: {reason}" for reason in (scaler.get("adaptive") or {}).get("reasons", []))
    for event in report.get("events", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        lines.append(f"  {when} {event['pool']}: {event.get('from', '?')} -> {event.get('to', '?')} ({event['reason']})")
    return "\n".join(lines)


def format_kv_index(index: dict | None) -> list[str]:
    """The router's KV index (router.kv_index.KVIndex.summary): blocks, exactness and lag per worker."""
    if index is None:
        return []
    workers = index["workers"]
    exact = sum(1 for w in workers.values() if w["exact"])
    lines = [f"kv index {index['distinct_blocks']} distinct block(s), {exact}/{len(workers)} worker(s) exact"]
    for worker_id, w in sorted(workers.items()):
        lag = "no batch yet" if w["lag_s"] is None else f"lag {w['lag_s']:.1f} s"
        state = "exact" if w["exact"] else (f"INEXACT ({w['missing_batches']} batch(es) missing)" if w["missing_batches"]
                                            else "INEXACT (no snapshot yet)")
        lines.append(f"  {worker_id:<12} {w['role'] or '-':<8} {w['blocks']} block(s)  {state}  {lag}")
    return lines


def format_critical_path(cp: dict | None) -> list[str]:
    """The router's critical-path breakdown (router.critical_path.CriticalPathWindow.breakdown) and verdict."""
    if not cp:
        return []
    lines = [f"critical path  last {cp['window_s']:g} s: {cp['requests']} request(s), {cp['local_prefill']} prefilled locally"]
    if cp["stages"]:
        lines.append(f"  {'stage':<18}{'p50 ms':>9}{'mean ms':>9}{'share':>8}")
        for stage, f in cp["stages"].items():
            lines.append(f"  {stage:<18}{f['p50_s'] * 1e3:>9.1f}{f['mean_s'] * 1e3:>9.1f}{f['share']:>8.1%}")
        lines.append(f"  e2e p50 {cp['e2e']['p50_s'] * 1e3:.0f} ms  ttft p50 {cp['ttft']['p50_s'] * 1e3:.0f} ms  "
                     f"itl mean {cp['itl']['mean_s'] * 1e3:.1f} ms")
    verdict = cp["verdict"]
    if verdict.get("split"):
        split = verdict["split"]
        lines.append(f"  split estimate: ITL {split['itl_s'] * 1e3:.1f} ms, TTFT {split['ttft_s'] * 1e3:.0f} ms, "
                     f"one prefill worker {split['prefill_busy']:.0%} busy")
    lines.append(f"disaggregation: {verdict['verdict'].upper()}  ({verdict['reason']})")
    return lines
