"""Experiment: what moving the KV cache costs a request, against prompt length.

    python -m bench.experiments.kv_transfer [--lengths 128 512 1024] [--repeats 3]

For each transport (ucx, tcp) and layer-wise streaming on/off (`kv_transfer.layerwise`), a prefill
worker (core 0) and a decode worker (core 1) run as real processes, each with one torch thread.
This script plays the router's part itself, so that it can read both sides' timings: it opens
`DecodeWorker.Decode` (admission: KV blocks + transfer id), calls `PrefillWorker.Prefill` with
that destination, and reads D's stream to its end. Per prompt (fresh random token ids, so no
prefix-cache hit) it records:

  prefill_only_s  `Prefill` with no destination (compute alone, same length, same worker)
  compute_s       P's prefill_compute_s with the transfer running (layer-wise: sends overlap it)
  exposed_s       P's kv_transfer_s: from the end of the forward to D's ack (what is left to send)
  to_decode_s     Prefill call -> D's first streamed token (the first token can run on D)
  after_forward_s to_decode_s - compute_s of the same request: from the end of P's forward to D's
                  first token (transfer left over + D commit + first chunk); same-request, so it is
                  not blurred by run-to-run prefill noise
  overhead_s      to_decode_s - prefill_only_s (separate requests: noisy on a shared machine)

The raw transport bandwidth between two processes (bench/kvtransfer.py's protocol benchmark, same
lengths) is stored next to it. Writes bench/results/kv_transfer.json and kv_transfer.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np

from bench.cluster import BenchCluster, bench_config
from bench.experiments import common

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32, K+V, every layer
VARIANTS = (("tcp", True), ("tcp", False), ("ucx", True), ("ucx", False))


class Probe:
    """Plays the router against one prefill and one decode worker, reading both sides' timings."""

    def __init__(self, prefill_channel, decode_channel, seed: int):
        from proto.pdserve.v1 import pdserve_pb2 as pb
        from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        self.pb = pb
        self.prefill, self.decode = pb_grpc.PrefillWorkerStub(prefill_channel), pb_grpc.DecodeWorkerStub(decode_channel)
        self.rng = np.random.default_rng(seed)
        self.sampling = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def prompt(self, n: int) -> list[int]:
        return self.rng.integers(1000, 30000, size=n).tolist()

    async def prefill_only(self, n: int) -> float:
        t = time.perf_counter()
        request = self.pb.PrefillRequest(request_id=uuid.uuid4().hex, token_ids=self.prompt(n), sampling=self.sampling)
        await self.prefill.Prefill(request, timeout=300)
        return time.perf_counter() - t

    async def transfer(self, n: int) -> dict[str, float]:
        import grpc

        pb = self.pb
        ids, rid = self.prompt(n), uuid.uuid4().hex
        call = self.decode.Decode(pb.DecodeRequest(request_id=rid, token_ids=ids, sampling=self.sampling), timeout=300)
        first = await call.read()
        assert first.WhichOneof("event") == "admission", first
        t0 = time.perf_counter()
        prefill = asyncio.ensure_future(self.prefill.Prefill(pb.PrefillRequest(
            request_id=rid, token_ids=ids, sampling=self.sampling, kv_destination=first.admission.kv_destination), timeout=300))
        first_token = d_timings = None
        while (msg := await call.read()) is not grpc.aio.EOF:
            event = msg.WhichOneof("event")
            if event == "chunk" and first_token is None:
                first_token = time.perf_counter() - t0
            elif event == "finished":
                if msg.finished.finish_reason == pb.FINISH_REASON_ERROR:
                    raise RuntimeError(f"decode failed: {msg.finished.error.message}")
                d_timings = msg.finished.timings
        response = await prefill
        return {
            "compute_s": response.timings.prefill_compute_s,
            "exposed_s": response.timings.kv_transfer_s,
            "to_decode_s": first_token,
            "decode_kv_wait_s": d_timings.kv_transfer_s if d_timings is not None else None,
            "kv_bytes": response.kv_bytes_sent,
        }


def summarize_length(base: list[float], runs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the repeats of one prompt length."""
    row = {key: statistics.median(r[key] for r in runs) for key in ("compute_s", "exposed_s", "to_decode_s", "decode_kv_wait_s")}
    row["prefill_only_s"] = statistics.median(base)
    row["overhead_s"] = row["to_decode_s"] - row["prefill_only_s"]
    row["after_forward_s"] = statistics.median(r["to_decode_s"] - r["compute_s"] for r in runs)
    row["kv_bytes"] = runs[0]["kv_bytes"]
    row["effective_gbps"] = row["kv_bytes"] / row["exposed_s"] / 1e9 if row["exposed_s"] > 0 else None
    row["runs"] = runs
    row["prefill_only_runs"] = base
    return row


async def measure(prefill_addr: str, decode_addr: str, lengths: list[int], repeats: int, seed: int) -> dict[str, Any]:
    import grpc

    async with grpc.aio.insecure_channel(prefill_addr) as pch, grpc.aio.insecure_channel(decode_addr) as dch:
        probe = Probe(pch, dch, seed)
        await probe.prefill_only(64)  # warm-up
        await probe.transfer(64)
        out: dict[str, Any] = {}
        for n in lengths:
            base = [await probe.prefill_only(n) for _ in range(repeats)]
            runs = [await probe.transfer(n) for _ in range(repeats)]
            row = out[str(n)] = summarize_length(base, runs)
            common.log.info("%5d tokens: prefill %.3f s, with transfer: compute %.3f exposed %.3f to-decode %.3f (+%.3f s)",
                            n, row["prefill_only_s"], row["compute_s"], row["exposed_s"], row["to_decode_s"], row["overhead_s"])
        return out


def run_variant(transport: str, layerwise: bool, args: argparse.Namespace) -> dict[str, Any]:
    config = bench_config(transport, engine={"max_num_batched_tokens": max(2048, max(args.lengths))},
                          kv_transfer={"layerwise": layerwise})
    name = f"{transport}_{'layerwise' if layerwise else 'after_forward'}"
    with BenchCluster(config, num_prefill=1, num_decode=1, name=name, router=False) as cluster:
        rows = asyncio.run(measure(cluster.prefill[0].address, cluster.decode[0].address, args.lengths, args.repeats, args.seed))
        return {"variant": name, "transport": transport, "layerwise": layerwise,
                "cluster": {k: v for k, v in cluster.describe().items() if k != "config"}, "by_length": rows}


def raw_bandwidth(lengths: list[int], repeats: int) -> dict[str, Any]:
    """bench/kvtransfer.py's two-process protocol benchmark (tcp and ucx) and memcpy, same lengths."""
    try:
        from bench import kvtransfer

        results = {"memcpy": kvtransfer.bench_memcpy(lengths, repeats)}
        results.update(kvtransfer.bench_protocol(kvtransfer.PROTOCOL_CONFIGS[0], lengths, repeats))
        return results
    except Exception as exc:  # another team's tool: report, don't fail the experiment
        common.log.warning("raw bandwidth benchmark failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _after_forward(row: dict[str, Any]) -> float:
    if "after_forward_s" in row:
        return row["after_forward_s"]
    return statistics.median(r["to_decode_s"] - r["compute_s"] for r in row["runs"])


def plot(report: dict[str, Any]) -> str:
    plt = common.pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for res in report["results"]:
        lengths = [int(n) for n in res["by_length"]]
        rows = list(res["by_length"].values())
        a1.plot(lengths, [r["exposed_s"] * 1000 for r in rows], "o-", label=res["variant"])
        a2.plot(lengths, [_after_forward(r) * 1000 for r in rows], "o-", label=res["variant"])
    a1.set_title("exposed KV transfer (P: forward done -> D's ack)", fontsize=9)
    a2.set_title("P's forward done -> D's first token (same request)", fontsize=9)
    common.style_axes((a1, a2), "prompt tokens", "ms")
    return common.save_figure(fig, "kv_transfer.png")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "kv_transfer")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", nargs="+", default=["tcp", "ucx"], choices=["tcp", "ucx"])
    p.add_argument("--no-raw", action="store_true", help="skip bench/kvtransfer.py's raw bandwidth run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="lengths 64 256, 1 repeat, no raw bandwidth")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.no_raw = [64, 256], 1, True
    info, started = common.begin(args.quick)
    results = [run_variant(t, lw, args) for t, lw in VARIANTS if t in args.transports]
    report = {
        "experiment": "kv_transfer",
        "command": common.command_line(),
        "machine": info,
        "params": vars(args),
        "kv_bytes_per_token": BYTES_PER_TOKEN,
        "results": results,
        "raw_bandwidth": None if args.no_raw else raw_bandwidth(args.lengths, max(args.repeats, 3)),
    }
    common.finish(info, started)
    report["plot"] = plot(report)
    common.save("kv_transfer", report)
    for res in results:
        print(res["variant"], {n: f"exposed {r['exposed_s'] * 1000:.0f} ms, forward end -> first token {r['after_forward_s'] * 1000:.0f} ms"
                               for n, r in res["by_length"].items()}, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
