"""Experiment: TTFT and KV transfer time against prompt length over a rate-limited link between two hosts.

    sudo python -m bench.experiments.kv_link_rate [--rates 1 10 25] [--lengths 256 1024 2048 4096] [--repeats 1]

Two hosts are network namespaces (bench/net.py): a prefill worker on host A
(198.18.0.1) and a decode worker on host B (198.18.0.2), real processes, one torch thread each,
KV over the default `ucx` transport, B's link limited with tc `tbf` to each rate in turn. This
process joins host A's namespace and plays the router (bench/experiments/kv_transfer.py's
`measure`: admission on D, Prefill on P with that destination, D's stream to its end). For each
configuration (layer-wise or whole, `wire_dtype` native or int8) and rate it records per length:
TTFT (`to_decode_s`: Prefill call -> D's first token), the prefill alone (`prefill_only_s`), and
the transfer-bound part `after_forward_s` (P's forward done -> D's first token, same request).
Then, with `wire_dtype: auto`, which wire dtype the sender chose at each rate (from the bytes
moved). Writes bench/results/kv_link_rate.json and kv_link_rate.png; everything it created is
removed at the end (namespaces, processes).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import net
from bench.cluster import bench_config, start_process, stop_process
from bench.experiments import common
from bench.experiments.kv_transfer import measure

CONFIGS = (("layerwise", True, "native"), ("layerwise", True, "int8"), ("whole", False, "native"), ("whole", False, "int8"))
_CLONE_NEWNET = 0x40000000


def enter_namespace(ns: str) -> None:
    """Move this process (single-threaded so far) into network namespace `ns`."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns}) failed")
    finally:
        os.close(fd)


def start_pair(workdir: Path, name: str, layerwise: bool, wire_dtype: str, max_len: int) -> tuple[Any, Any]:
    config = bench_config("ucx", engine={"max_num_batched_tokens": max(2048, max_len), "kv_cache_memory_mb": 512},
                          kv_transfer={"layerwise": layerwise, "wire_dtype": wire_dtype, "host": net.host_ip(2)})
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {"PYTHONPATH": str(common.REPO), "PDSERVE_LOG_LEVEL": "WARNING"}
    decode = start_process(f"decode-{name}", ["-m", "decode_worker", "-c", str(path), "--host", net.host_ip(2)], env,
                           timeout=300, prefix=["ip", "netns", "exec", net.host_ns(2)])
    prefill = start_process(f"prefill-{name}", ["-m", "prefill_worker", "-c", str(path), "--host", net.host_ip(1)], env,
                            timeout=300, prefix=["ip", "netns", "exec", net.host_ns(1)])
    return prefill, decode


def run_config(network: net.Network, workdir: Path, label: str, layerwise: bool, wire_dtype: str,
               args: argparse.Namespace) -> dict[str, Any]:
    name = f"{label}_{wire_dtype}"
    prefill, decode = start_pair(workdir, name, layerwise, wire_dtype, max(args.lengths))
    try:
        by_rate = {}
        for i, rate in enumerate(args.rates):
            network.set_rate(2, rate)
            common.log.info("%s at %g Gbit/s", name, rate)
            seed = args.seed + 1000 * i  # fresh prompts per rate: no prefix-cache hit on the same workers
            by_rate[str(rate)] = asyncio.run(measure(prefill.address, decode.address, args.lengths, args.repeats, seed))
        return {"variant": name, "layerwise": layerwise, "wire_dtype": wire_dtype, "by_rate": by_rate}
    finally:
        stop_process(prefill)
        stop_process(decode)


def auto_choice(network: net.Network, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Bytes moved per 1024-token transfer with wire_dtype auto (the first ones measure the link)."""
    out = {}
    for rate in args.rates:
        prefill, decode = start_pair(workdir, f"auto_{rate}", False, "auto", 1024)  # whole: the link rate is what the sender waits on
        try:
            network.set_rate(2, rate)
            rows = asyncio.run(measure(prefill.address, decode.address, [1024], 3, args.seed))["1024"]
            out[str(rate)] = {"kv_bytes_per_transfer": [r["kv_bytes"] for r in rows["runs"]],
                              "chose": "int8" if rows["runs"][-1]["kv_bytes"] < 1024 * 30 * 2 * 3 * 64 * 4 else "native"}
        finally:
            stop_process(prefill)
            stop_process(decode)
    return out


def crossover(results: list[dict[str, Any]], rates: list[float], lengths: list[int]) -> dict[str, Any]:
    """native / int8 of the transfer-bound part and of TTFT, per layer-wise mode, rate and length."""
    rows: dict[str, Any] = {}
    by = {r["variant"]: r for r in results}
    for mode in ("layerwise", "whole"):
        native, int8 = by.get(f"{mode}_native"), by.get(f"{mode}_int8")
        if native is None or int8 is None:
            continue
        for rate in rates:
            for n in lengths:
                a, b = native["by_rate"][str(rate)][str(n)], int8["by_rate"][str(rate)][str(n)]
                rows[f"{mode} {rate:g}Gbps {n}"] = {
                    "transfer_bound_speedup": a["after_forward_s"] / b["after_forward_s"],
                    "ttft_speedup": a["to_decode_s"] / b["to_decode_s"],
                }
    return rows


def plot(report: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["params"]["rates"]
    fig, axes = plt.subplots(2, len(rates), figsize=(4.2 * len(rates), 7), squeeze=False)
    for col, rate in enumerate(rates):
        for res in report["results"]:
            rows = res["by_rate"][str(rate)]
            lengths = [int(n) for n in rows]
            style = "o-" if res["wire_dtype"] == "native" else "s--"
            axes[0][col].plot(lengths, [r["to_decode_s"] * 1000 for r in rows.values()], style, label=res["variant"])
            axes[1][col].plot(lengths, [r["after_forward_s"] * 1000 for r in rows.values()], style, label=res["variant"])
        axes[0][col].set_title(f"TTFT at {rate:g} Gbit/s", fontsize=9)
        axes[1][col].set_title(f"forward end -> first token at {rate:g} Gbit/s", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = common.RESULTS / "kv_link_rate.png"
    fig.savefig(path, dpi=100)
    plt.close("all")
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.experiments.kv_link_rate", description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1, 10, 25], help="link rates in Gbit/s")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="rates 1 25, lengths 256 1024, 1 repeat")
    p.add_argument("--auto-only", action="store_true", help="only what `wire_dtype: auto` chooses per rate (kv_link_rate_auto.json)")
    args = p.parse_args(argv)
    if args.quick:
        common.use_quick_results()
        args.rates, args.lengths, args.repeats = [1, 25], [256, 1024], 1
    reason = net.cannot_make_namespaces()
    if reason:
        print(f"kv_link_rate: {reason}", file=sys.stderr)
        return 1
    common.setup_logging()
    started, info = time.time(), common.machine()
    net.remove_leftovers()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on SIGTERM too
    network = net.Network(2).create()
    try:
        enter_namespace(net.host_ns(1))
        with tempfile.TemporaryDirectory(prefix="pdserve-linkrate-") as tmp:
            results = [] if args.auto_only else [run_config(network, Path(tmp), *c, args) for c in CONFIGS]
            auto = auto_choice(network, Path(tmp), args)
    finally:
        network.destroy()
    report = {"experiment": "kv_link_rate", "command": common.command_line(), "machine": info, "params": vars(args),
              "results": results, "auto": auto, "speedup_int8": crossover(results, args.rates, args.lengths)}
    common.finish(info, started)
    report["plot"] = None if args.auto_only else plot(report)
    common.save("kv_link_rate_auto" if args.auto_only else "kv_link_rate", report)
    for key, row in report["speedup_int8"].items():
        print(f"{key}: transfer-bound x{row['transfer_bound_speedup']:.2f}, TTFT x{row['ttft_speedup']:.2f}", file=sys.stderr)
    print("auto:", {r: a["chose"] for r, a in auto.items()}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
