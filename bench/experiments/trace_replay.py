"""Experiment: replay a real request trace (Mooncake format) against each routing / KV configuration.

    pdserve bench trace [--trace FILE] [--requests N | --duration S] [--rate R | --load F] [--configs ...] [--out PATH]
    (= python -m bench.experiments.trace_replay ...)

The workload (bench.trace.workload): the trace's requests in a trace-time range (default: all of it), whole
conversations taken in a seeded order until --requests are chosen (or rate x --duration once the rate is
known), replayed in arrival order; --tokens-per-block tokens per 512-token trace block (prompt lengths
scaled by the same factor, so one trace block is one 16-token engine block by default); answers scaled by
--output-scale (default the same factor) and clamped to [2, --max-output]; EOS ignored, greedy. Each hash id
names one seeded block of token ids drawn from the model's vocabulary without its special tokens, so equal
ids give equal prefixes; a partial last block takes the first tokens of its id's block. Time: the window's
gaps all divided by one speed-up so that the mean arrival rate is --rate, or --load x the rate the cluster
sustains, measured first (calibration: --calibration-requests other conversations of the trace, with other
token ids so that they warm no cache the trace uses, all sent at once to the first configuration's cluster).

Each configuration (bench.trace.setups: a routing policy plus config overrides) gets a fresh cluster of the
same shape (--prefill P + --decode D workers, each pinned to a core, registering with the router so that their
KV events feed its index; same engine config, KV pool --kv-cache-mb per worker): start, warm-up requests
(random ids), the workers' Stats, the replay through the router's gRPC Generate (one stamp per streamed chunk),
Stats again once every request is done, a check that every KV block is free again, stop. Configurations whose
parts do not exist yet are listed as "not available: <why>", never run as something else.

Reported per configuration: prompt tokens computed (the workers' cumulative `prompt_tokens`: tokens run
through the model, cache hits and received KV excluded), the reuse reached (1 - computed / prompt tokens)
and its share of the trace's own reuse bound (bench.trace.workload.reuse_bound: an unbounded cache of full
blocks) and of the bound with the pool's capacity (one LRU cache of one worker's pool, every request sent
to it), KV bytes moved per request (received by any worker), the router's `cached_prompt_tokens`, TTFT
p50/p99, ITL p99, TPOT and goodput (requests meeting TTFT <= --slo-ttft and TPOT <= --slo-tpot per second
of the run). Writes --out (JSON; the raw per-request stamps next to it, *_requests.json) and a PNG plot;
--docs rewrites the generated block of docs/trace_replay.md. --rescore sends nothing: it scores the run already at
--out again under other SLOs (same requests, same counters) and says so in the JSON (`rescored`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import history, serve
from bench.cluster import BenchCluster, bench_config
from bench.experiments import common
from bench.servebench.workload import random_ids
from bench.trace.report import BEGIN, DOC, END, PULL_COUNTERS, acceptance, compare, markdown, plot, score
from bench.trace.setups import BY_NAME, Setup
from bench.trace.workload import BlockTokens, Scale, TraceRequest, compress_time, load_trace, lru_reuse, reuse_bound, select_window

NAME = "trace_replay"
DEFAULT_TRACE = common.REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
DEFAULT_OUT = common.RESULTS / f"{NAME}.json"
HEARTBEAT_TIMEOUT_S = 30.0
"""router.heartbeat_timeout_s of every cluster: at the default 5 s, workers busy with seconds-long prefill steps on
a shared 2-core machine missed heartbeats, left rotation (requests failed: no healthy prefill worker) and their
KV index entries were dropped, which a benchmark of routing should not measure."""
LOCAL_PREFILL_THRESHOLD = 64
"""router.local_prefill_threshold of every configuration: a decode worker prefills a prompt itself when it would compute
at most 4 blocks of it (~90 ms of one step here, bf16), less than the prefill queue and the hop cost under load. The
same setting for every policy: round_robin and prefix_aware count the whole prompt (the window's 28-64 token
first turns), kv_aware only what the decode worker does not hold (a conversation's new turn)."""
SLO_TTFT_MS = 2000.0
"""The replay's TTFT SLO. The window's median prompt prefills alone in ~0.3 s here (bf16, sim/profiles), its longest
in ~1 s, so 2 s is ~6x the median's unloaded TTFT, an SLO scale of the kind serving evaluations set. At 6 s (the
default until the run at 83e0341) every configuration met it on 94-100 % of the requests and goodput only restated
the offered rate; the report also scores goodput over a range of TTFT SLOs (bench/trace/report.py)."""
COUNTERS = ("prompt_tokens", "kv_bytes_sent", "kv_bytes_received", "prefix_cache_hit_tokens", "prefix_cache_queried_tokens",
            "preemptions", "generation_tokens", *PULL_COUNTERS)


@dataclass
class Workload:
    """The chosen requests, scaled: prompts (token ids) and answer lengths, in arrival order."""

    requests: list[TraceRequest]
    prompts: list[list[int]]
    outputs: list[int]

    def specs(self, arrivals: list[float]) -> list[serve.RequestSpec]:
        return [serve.RequestSpec(i, len(p), o, a, prompt_ids=p) for i, (p, o, a) in enumerate(zip(self.prompts, self.outputs, arrivals))]


def build_workload(requests: list[TraceRequest], scale: Scale, tokens: BlockTokens) -> Workload:
    return Workload(requests, [tokens.prompt(r.hash_ids, scale.prompt_len(r)) for r in requests], [scale.output_len(r) for r in requests])


def model_vocabulary(model: str) -> np.ndarray:
    from transformers import AutoTokenizer

    from bench.trace.workload import vocabulary
    from engine.model_loader import resolve_model_path

    return vocabulary(AutoTokenizer.from_pretrained(resolve_model_path(model)))


# ---- one cluster -------------------------------------------------------------------------------
def replay(address: str, specs: list[serve.RequestSpec], max_concurrency: int | None = None) -> tuple[list[dict], float]:
    """Send `specs` at their arrival times through the router's gRPC Generate; (records as dicts, duration)."""
    args = argparse.Namespace(temperature=0.0, ignore_eos=True, seed=0, skip_detokenize=True, request_timeout=600.0)

    async def go() -> tuple[list, float]:
        backend = serve.GrpcBackend(address, None, args)
        try:
            return await serve.run_load(backend, specs, max_concurrency, progress=False)
        finally:
            await backend.close()

    records, duration = asyncio.run(go())
    return [asdict(r) for r in records], duration


def kv_index(cluster: BenchCluster) -> dict[str, Any]:
    """The router's KV index: per worker (role, blocks, exact), and the distinct blocks over all."""
    import grpc

    from proto.pdserve.v1 import pdserve_pb2 as pb
    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(cluster.router.ready["internal_address"]) as channel:
        reply = pb_grpc.RegistryStub(channel).KVIndex(pb.KVIndexRequest(), timeout=10)
    return {"workers": {w.worker_id: {"role": pb.Role.Name(w.role), "blocks": w.blocks, "exact": w.exact} for w in reply.workers},
            "distinct_blocks": reply.distinct_blocks}


def wait_registered(cluster: BenchCluster, timeout: float = 60.0) -> None:
    """Until every worker started is in the router's index (registered; the router serves once one decode worker is)."""
    deadline = time.monotonic() + timeout
    while len(kv_index(cluster)["workers"]) < len(cluster.prefill) + len(cluster.decode):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every worker registered with the router within {timeout:g} s: {kv_index(cluster)}")
        time.sleep(0.2)


def snapshot(cluster: BenchCluster) -> dict[str, dict[str, int]]:
    """Every worker's counters (and KV pool) now."""
    out = {}
    for proc in [*cluster.prefill, *cluster.decode]:
        s = cluster.worker_stats(proc)
        out[proc.name] = {k: getattr(s, k) for k in (*COUNTERS, "total_kv_blocks", "free_kv_blocks", "running_requests")}
    return out


def settle(cluster: BenchCluster, timeout: float = 30.0) -> dict[str, dict[str, int]]:
    """Stats once every worker is idle with all its KV blocks free, or at the timeout (then blocks are leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        now = snapshot(cluster)
        if all(s["free_kv_blocks"] == s["total_kv_blocks"] and not s["running_requests"] for s in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.3)


class CpuUse:
    """Cores' worth of CPU (CPU seconds per second) used between start and `stop()` by the cluster's processes, by
    this one (the load generator) and by everything else on the machine (/proc/stat's busy time minus both: other
    users' work, which a shared machine does not stop and which the configurations compared should not differ by)."""

    def __init__(self, pids: dict[str, int]):
        """`pids`: the cluster's processes by name (router, prefill0, ...); their children count with them."""
        self.pids = pids
        self.start = self._sample()

    def _sample(self) -> tuple[float, dict[str, float], float, float]:
        import psutil

        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
        busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
        processes = dict.fromkeys(self.pids, 0.0)
        for name, pid in self.pids.items():
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    t = proc.cpu_times()
                    processes[name] += t.user + t.system
            except psutil.Error:
                continue
        own = psutil.Process().cpu_times()
        return busy, processes, own.user + own.system, time.monotonic()

    def stop(self) -> dict[str, Any]:
        (busy0, processes0, own0, t0), (busy1, processes1, own1, t1) = self.start, self._sample()
        span = max(1e-9, t1 - t0)
        processes = {name: processes1[name] - processes0[name] for name in self.pids}
        cluster, own = sum(processes.values()), own1 - own0
        return {"cluster": round(cluster / span, 3), "load_generator": round(own / span, 3),
                "others": round(max(0.0, busy1 - busy0 - cluster - own) / span, 3),
                "by_process": {name: round(used / span, 3) for name, used in processes.items()}}


def check_fits(cluster: BenchCluster, workload: Workload, args: argparse.Namespace) -> None:
    """Every request of the window fits one worker's KV pool (else it could never be admitted)."""
    blocks = min(s["total_kv_blocks"] for s in snapshot(cluster).values())
    need = max(-(-(len(p) + o) // args.tokens_per_block) for p, o in zip(workload.prompts, workload.outputs))
    if need > blocks:
        raise SystemExit(f"--kv-cache-mb {args.kv_cache_mb}: a worker's KV pool holds {blocks} blocks, the window's longest "
                         f"request needs {need}; give a bigger pool or fewer --tokens-per-block")


def warmup(cluster: BenchCluster, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    specs = [serve.RequestSpec(i, 32, 4, 0.0, prompt_ids=random_ids(rng, 32, serve.DEFAULT_VOCAB)) for i in range(count)]
    replay(cluster.grpc_address, specs)


def calibrate(cluster: BenchCluster, workload: Workload) -> dict[str, Any]:
    """The rate the cluster sustains on this trace's requests: all sent at once, completed / duration."""
    records, duration = replay(cluster.grpc_address, workload.specs([0.0] * len(workload.prompts)))
    completed = sum(1 for r in records if r["ok"])
    return {"requests": len(records), "completed": completed, "duration_s": duration,
            "sustained_rate": completed / duration if duration > 0 else 0.0}


def run_setup(setup: Setup, base: dict[str, Any], args: argparse.Namespace, prepare) -> dict[str, Any]:
    """One configuration on a fresh cluster. `prepare(cluster)` returns the specs to replay (it may calibrate first)."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-trace-{setup.name.replace('+', '-')}-"))
    with BenchCluster(setup.config(base), args.prefill, args.decode, name=setup.name, log_dir=log_dir, register=True) as cluster:
        wait_registered(cluster)
        warmup(cluster, args.warmup, args.seed + 1000)
        specs = prepare(cluster)
        before = settle(cluster)
        loadavg_before = common.loadavg()
        cpu = CpuUse({"router": cluster.router.pid} | {f"prefill{i}": p.pid for i, p in enumerate(cluster.prefill)}
                     | {f"decode{i}": p.pid for i, p in enumerate(cluster.decode)})
        records, duration = replay(cluster.grpc_address, specs)
        cpu_cores = cpu.stop()
        loadavg_after = common.loadavg()
        after = settle(cluster)
        index = kv_index(cluster)
    leaked = {name: s["total_kv_blocks"] - s["free_kv_blocks"] for name, s in after.items()}
    delta = {name: {k: after[name][k] - before[name][k] for k in COUNTERS} for name in after}
    return {"status": "ran", "setup": setup.describe(), "duration_s": duration, "loadavg": [loadavg_before, loadavg_after],
            "cpu_cores": cpu_cores,
            "workers": delta, "kv_blocks_per_worker": {n: s["total_kv_blocks"] for n, s in after.items()},
            "leaked_kv_blocks": leaked, "kv_index_at_end": index, "log_dir": str(log_dir), "requests": records}


# ---- CLI ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench trace", description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake-format JSONL trace")
    p.add_argument("--configs", nargs="+", choices=list(BY_NAME), default=list(BY_NAME))
    p.add_argument("--requests", type=int, default=None, help="requests to replay (whole conversations, so a few more)")
    p.add_argument("--duration", type=float, default=150.0,
                   help="without --requests: replay about this many seconds per configuration (requests = rate x duration)")
    p.add_argument("--start-s", type=float, default=0.0, help="trace time (s) where the window starts")
    p.add_argument("--end-s", type=float, default=None, help="trace time (s) where the window ends (default: the trace's end)")
    p.add_argument("--rate", type=float, default=None, help="mean arrival rate (req/s); default: --load x the calibrated rate")
    p.add_argument("--load", type=float, default=0.8, help="share of the sustained rate to offer when calibrating")
    p.add_argument("--calibration-requests", type=int, default=16)
    p.add_argument("--tokens-per-block", type=int, default=16, help="tokens per 512-token trace block")
    p.add_argument("--output-scale", type=float, default=None, help="answer length factor (default: tokens-per-block / 512)")
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--kv-cache-mb", type=int, default=128, help="KV pool per worker (MB)")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--local-prefill-threshold", type=int, default=LOCAL_PREFILL_THRESHOLD,
                   help="router.local_prefill_threshold of every configuration (tokens; 0: every prompt disaggregated)")
    p.add_argument("--slo-ttft", type=float, default=SLO_TTFT_MS, help="TTFT SLO (ms)")
    p.add_argument("--slo-tpot", type=float, default=250.0, help="TPOT SLO (ms)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="conversation order and token ids")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON result (the plot: same name, .png)")
    p.add_argument("--docs", action="store_true", help="rewrite the generated block of docs/trace_replay.md")
    p.add_argument("--rescore", action="store_true",
                   help="run nothing: score the run already at --out (its *_requests.json too) again with these --slo-ttft/--slo-tpot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    common.setup_logging()
    if args.rescore:
        return rescore(Path(args.out), {"ttft": args.slo_ttft, "tpot": args.slo_tpot}, args.docs, argv)
    info, started = common.machine(), time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = load_trace(args.trace)
    scale = Scale(args.tokens_per_block, args.output_scale, max_output=args.max_output)
    vocab = model_vocabulary("smollm2-135m")
    base = bench_config(args.transport, engine={"kv_cache_memory_mb": args.kv_cache_mb, "max_num_batched_tokens": args.budget,
                                                "block_size": args.tokens_per_block})
    # the canary (router.shadow_check_fraction) recomputes a sample of requests on decode workers: work that is not the
    # configuration's, which the workers' prompt-token counters would charge to it
    base["router"].update(local_prefill_threshold=args.local_prefill_threshold, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, shadow_check_fraction=0.0)
    plan: dict[str, Any] = {"argv": sys.argv[1:] if argv is None else list(argv), "trace_requests": len(trace)}

    def prepare(cluster: BenchCluster) -> list[serve.RequestSpec]:
        """The first cluster fixes the window and the rate (calibrating when no --rate); later ones reuse them."""
        if "specs" not in plan:
            rate, how = args.rate, "--rate"
            if rate is None:
                sample = select_window(trace, args.start_s, args.end_s, args.calibration_requests, seed=args.seed + 1)
                calibration = calibrate(cluster, build_workload(sample, scale, BlockTokens(vocab, args.tokens_per_block, args.seed + 1)))
                rate = args.load * calibration["sustained_rate"]
                how = f"{args.load:g} x the {calibration['sustained_rate']:.3f} req/s sustained in calibration"
                plan["calibration"] = calibration
            count = args.requests or max(2, round(rate * args.duration))
            plan["window"] = select_window(trace, args.start_s, args.end_s, count, seed=args.seed)
            arrivals, speedup = compress_time(plan["window"], rate)
            plan["workload"] = build_workload(plan["window"], scale, BlockTokens(vocab, args.tokens_per_block, args.seed))
            plan["specs"] = plan["workload"].specs(arrivals)
            check_fits(cluster, plan["workload"], args)
            plan["time"] = {"rate": rate, "speedup": speedup, "how": how, "arrival_span_s": arrivals[-1] if arrivals else 0.0}
        return plan["specs"]

    results: dict[str, dict] = {}
    for name in args.configs:
        setup = BY_NAME[name]
        why = setup.unavailable(base)
        if why:
            results[name] = {"status": f"not available: {why}", "setup": setup.describe()}
            common.log.warning("%s: not available: %s", name, why)
            continue
        common.log.info("%s: starting", name)
        results[name] = run_setup(setup, base, args, prepare)
    if "window" not in plan:
        common.log.error("no configuration could run: %s", {n: r["status"] for n, r in results.items()})
        return 1
    report = summarize(results, plan, scale, base, args, info, started)
    requests = {n: r.pop("requests") for n, r in results.items() if "requests" in r}
    report["plot"] = plot({n: {**r, "requests": requests.get(n, [])} for n, r in results.items()}, report["trace"]["reuse_bound"],
                          out.with_suffix(".png"))
    report["plot"] = _relative(Path(report["plot"]))
    history.record(out, report, NAME)
    out.with_name(out.stem + "_requests.json").write_text(json.dumps(requests) + "\n")
    if args.docs:
        common.replace_doc_block(DOC, BEGIN, END, markdown(report))
    for name, r in results.items():
        m = r.get("metrics")
        print(f"{name}: " + (r["status"] if not m else f"computed {m['prompt_tokens_computed']}/{m['prompt_tokens']} prompt tokens "
              f"(reuse {m['reuse']:.3f}, {m['of_reuse_bound'] or 0:.2f} of the bound), KV {m['kv_bytes_moved_per_request'] / 1e6:.2f} MB/req, "
              f"TTFT p50 {m['ttft_ms']['p50']:.0f} p99 {m['ttft_ms']['p99']:.0f} ms, goodput {m['goodput']:.3f} req/s"), file=sys.stderr)
    return 0


def summarize(results: dict[str, dict], plan: dict[str, Any], scale: Scale, base: dict[str, Any], args: argparse.Namespace,
              info: dict[str, Any], started: float) -> dict[str, Any]:
    window, workload = plan["window"], plan["workload"]
    blocks = next((b for r in results.values() for b in (r.get("kv_blocks_per_worker") or {}).values()), None)
    bound = {"unbounded": reuse_bound(window, scale),
             "pool_capacity": {**lru_reuse(window, scale, blocks or 0), "capacity_blocks": blocks}}
    slos = {"ttft": args.slo_ttft, "tpot": args.slo_tpot}
    for r in results.values():
        if "requests" in r:
            r["metrics"] = score(r, bound, slos)
    comparisons = compare(results)
    return {
        "experiment": NAME, "command": "pdserve bench trace " + shlex.join(plan["argv"]),
        "machine": common.finish(info, started), "params": vars(args), "slos_ms": slos,
        "trace": {"path": args.trace, "requests_in_file": plan["trace_requests"], "window": {
            "start_s": args.start_s, "end_s": args.end_s, "requests": len(window), "seed": args.seed,
            "conversations": len({r.hash_ids[:2] if len(r.hash_ids) > 1 else i for i, r in enumerate(window)}),
            "trace_span_s": (window[-1].timestamp_ms - window[0].timestamp_ms) / 1000},
            "scale": {**asdict(scale), "factor": scale.factor}, "time": plan["time"], "calibration": plan.get("calibration"),
            "prompt_tokens": sum(map(len, workload.prompts)), "output_tokens": sum(workload.outputs), "reuse_bound": bound},
        "cluster": {"prefill": args.prefill, "decode": args.decode, "kv_cache_mb": args.kv_cache_mb, "kv_blocks_per_worker": blocks,
                    "block_size": args.tokens_per_block, "base_config": base},
        "results": results, "vs_round_robin": comparisons, "acceptance": acceptance(results, comparisons),
    }


def rescore(out: Path, slos: dict[str, float], docs: bool, argv: list[str] | None) -> int:
    """The run at `out` scored again under `slos` from its own per-request stamps and counters (no request is sent):
    its metrics, the comparison with round_robin and the acceptance are rewritten, the run's command, commit and
    machine kept, and `rescored` says with which command and SLOs."""
    report = json.loads(out.read_text())
    requests = json.loads(out.with_name(out.stem + "_requests.json").read_text())
    bound = report["trace"]["reuse_bound"]
    for name, result in report["results"].items():
        if name in requests:
            result["metrics"] = score({**result, "requests": requests[name]}, bound, slos)
    report["slos_ms"], report["params"]["slo_ttft"], report["params"]["slo_tpot"] = slos, slos["ttft"], slos["tpot"]
    report["vs_round_robin"] = compare(report["results"])
    report["acceptance"] = acceptance(report["results"], report["vs_round_robin"])
    report["rescored"] = {"command": "pdserve bench trace " + shlex.join(sys.argv[1:] if argv is None else argv),
                          "slos_ms": slos, "at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
    out.write_text(json.dumps(report, indent=1) + "\n")
    if docs:
        common.replace_doc_block(DOC, BEGIN, END, markdown(report))
    print(f"rescored {out} with TTFT <= {slos['ttft']:g} ms, TPOT <= {slos['tpot']:g} ms: {report['acceptance']}", file=sys.stderr)
    return 0


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(common.REPO))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
