"""`pdserve profile`: measure, on this machine, what the cluster simulator (sim/) needs, into one profile file.

    pdserve profile [--out sim/profiles/NAME.json] [--quick] [--threads 1] [--no-transfer] [--no-tier] [--no-sharing]

With the real engine (engine.Engine) on the demo model, one torch thread by default (a worker's share here):
  prefill   one step's wall time vs (new tokens, cached context): a prompt of `context` tokens is computed
            and cached first, then the same prefix + `tokens` new tokens runs in one step (budget >= tokens);
            median of --repeats.
  decode    one step's wall time vs (batch, context): `batch` requests with a prompt of `context` tokens each (as
            served requests have: a shared cached prompt kept the KV the batch reads in the CPU's caches), timed
            over 12 steps once all decode; median per point over --repeats passes of the whole grid.
  transfer  KV bytes through the kvtransfer protocol between two processes over loopback (tcp, and ucx when
            ucxx is installed): bench/kvmethods' ProtocolMethod, as `pdserve bench kvtransfer` measures it;
            latency + bytes / rate fitted by least squares over the sizes.
  tier      loading a prompt's blocks back from the memory tier (bench/experiments/kv_tier.py's measure): the
            first-token time of a prompt whose blocks all come back from the tier, per block (an upper bound:
            it includes computing the prompt's last token).
  host_sharing  a prefill step (256 new tokens; 128 after 256 cached) on one core, alone and beside a decoding
            engine in another process (16 requests at 256 tokens of context) pinned to the same core, then to
            another core; and a decode step (16 requests at 256 tokens of context) the same way beside a
            prefilling engine (256-token prompts): the ratios to alone, median of 3 rounds, at least 1 (fair
            sharing would be 2.0 and 1.0; two engines also share memory bandwidth and caches). Needs two CPUs.
The file names the machine (bench/measure.py machine_record), model, dtype, threads, KV layout and capacity.
--quick: tiny grids, one repeat, no transfer, tier or sharing (tests); a full run takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from sim.profile import PROFILE_KIND, SHIPPED, load_profile

log = logging.getLogger(__name__)

GRIDS = {
    "full": {"tokens": [16, 64, 128, 256, 512], "context": [0, 256, 512, 1024], "batch": [1, 2, 4, 8, 16], "decode_context": [16, 256, 512, 1024]},
    "quick": {"tokens": [16, 64], "context": [0, 64], "batch": [1, 2], "decode_context": [16, 64]},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="default: sim/profiles/cpu_<cpu>_<model>_<dtype>.json (e.g. cpu_epyc_avx2_smollm2_fp32.json)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's share of the cores)")
    parser.add_argument("--kv-cache-mb", type=int, default=128, help="the KV pool a worker gets (its capacity goes into the profile)")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the profiled workers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny grids, one repeat, no transfer or tier")
    parser.add_argument("--no-transfer", action="store_true")
    parser.add_argument("--no-tier", action="store_true")
    parser.add_argument("--no-sharing", action="store_true", help="skip host_sharing (the simulator then assumes fair sharing)")
    parser.add_argument("--gpu-estimate", action="store_true",
                        help="measure nothing: write the H200 + 8B-model profile estimated from bench/results/gpu_check_h200.json (its source says how)")
    return parser.parse_args(argv)


class Profiler:
    """One engine, reused for every grid point; every request is run to its end (no block held after a point)."""

    def __init__(self, args: argparse.Namespace, longest: int, kv_tokens: int = 0, kv_bytes_per_token: int = 0) -> None:
        """A pool of `args.kv_cache_mb` (what a worker gets), or one that holds `kv_tokens` when larger (a decode
        batch with a context each)."""
        from common.engine_config import EngineConfig
        from engine import Engine

        kv_mb = max(args.kv_cache_mb, -(-kv_tokens * kv_bytes_per_token // (1 << 20)) + 16)
        self.engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                          kv_cache_memory_mb=kv_mb, max_num_batched_tokens=max(4096, longest),
                                          max_model_len=longest + 64))
        self.rng = np.random.default_rng(0)
        self.ids = 0

    def prompt(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(100, self.engine.vocab_size, n)]

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        from common.sampling import SamplingParams

        self.ids += 1
        rid = f"p{self.ids}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def _drain(self) -> None:
        while self.engine.has_work():
            self.engine.step()

    def prefill(self, tokens: int, context: int) -> float:
        """Wall time of the step that computes `tokens` new tokens after `context` cached ones."""
        prefix = self.prompt(context)
        if context:
            self._add(prefix + self.prompt(1), 1)
            self._drain()
        self._add(prefix + self.prompt(tokens), 1)
        started = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - started
        self._drain()
        return seconds

    def decode(self, batch: int, context: int, steps: int) -> float:
        """Median wall time of a decode step of `batch` requests at `context` tokens each, each request with a
        context of its own, as served requests have (sharing one cached prefix, the batch read the same blocks, which
        stay in the CPU's caches: 8-30 % faster at 16 x 1,024 on a Zen 4 in bf16). The pool must hold batch x context."""
        pending = {self._add(self.prompt(context), steps + 3) for _ in range(batch)}
        while pending:  # the prompts, until every request has its first token
            pending -= {out.request_id for out in self.engine.step() if out.new_token_ids}
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - started)
        self._drain()
        return statistics.median(times)

    def close(self) -> None:
        self.engine.close()


def measure_grids(args: argparse.Namespace, grid: dict[str, list[int]]) -> tuple[dict[str, Any], dict[str, Any]]:
    longest = max(max(grid["tokens"]) + max(grid["context"]), max(grid["decode_context"])) + 8
    profiler = Profiler(args, longest)
    try:
        profiler.prefill(16, 0)  # warm-up
        prefill = [[statistics.median(profiler.prefill(n, c) for _ in range(args.repeats)) for c in grid["context"]]
                   for n in grid["tokens"]]
        log.info("prefill grid done")
        layout, blocks = profiler.engine.layout, profiler.engine.blocks.num_blocks
        kv = {"block_size": layout.block_size, "num_layers": layout.num_layers,
              "kv_bytes_per_token": layout.num_layers * layout.bytes_per_token_per_layer, "kv_capacity_tokens": blocks * layout.block_size}
    finally:
        profiler.close()
    steps, passes = (3, 1) if args.quick else (12, args.repeats)
    profiler = Profiler(args, longest, kv_tokens=max(grid["batch"]) * (max(grid["decode_context"]) + steps + 8),
                        kv_bytes_per_token=kv["kv_bytes_per_token"])
    try:  # whole passes over the grid, a point's median across them: a VM's speed drifts over a pass's minute or two
        decode = np.median([[[profiler.decode(b, c, steps) for c in grid["decode_context"]] for b in grid["batch"]]
                            for _ in range(passes)], axis=0).tolist()
    finally:
        profiler.close()
    return ({"prefill": {"tokens": grid["tokens"], "context": grid["context"], "seconds": prefill},
             "decode": {"batch": grid["batch"], "context": grid["decode_context"], "seconds": decode}}, kv)


def fit_link(points: list[tuple[float, float]]) -> dict[str, float]:
    """latency + bytes / rate by least squares over (bytes, seconds); latency never below 0."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1) if len(points) > 1 else (y[0] / x[0], 0.0)
    if slope <= 0:
        slope, intercept = float(y.sum() / x.sum()), 0.0
    return {"latency_s": max(0.0, float(intercept)), "bytes_per_s": float(1 / slope),
            "points": [[int(b), float(s)] for b, s in points]}


def measure_transfer(repeats: int) -> dict[str, Any]:
    from bench.kvmethods.base import measure
    from bench.kvmethods.protocol import PROTOCOL_CONFIGS, ProtocolMethod

    tokens = [128, 512, 2048]
    results, _ = measure([ProtocolMethod(PROTOCOL_CONFIGS[0], tokens)], tokens, repeats)
    links = {}
    for name in ("tcp", "ucx"):
        if name in results:
            rows = results[name].values()
            links[name] = fit_link([(r["bytes"], r.get("seconds_median") or r["seconds_best"]) for r in rows])
    return links


def measure_tier(args: argparse.Namespace) -> dict[str, float]:
    from bench.experiments.kv_tier import BLOCK
    from bench.experiments.kv_tier import measure as tier_measure

    length = 256
    rows = tier_measure("memory", [length], 1, args.threads, np.random.default_rng(0), args.dtype)[str(length)]
    return {"kind": "memory", "load_s_per_block": rows["loaded_s"] / (length // BLOCK),
            "measured": rows, "prompt_tokens": length}


SHARING_STEPS = ((256, 0), (128, 256))
"""The prefill steps host_sharing times: (new tokens, cached context)."""
SHARING_DECODE = (16, 256)
"""The decode step host_sharing times, and the one its decoding neighbour repeats: (batch, context)."""
SHARING_KV_MB = 512
"""The pool of host_sharing's engines: room for SHARING_DECODE's contexts in float32."""


def co_runner(model: str, dtype: str, threads: int, ready: str, work: str = "decode") -> None:
    """host_sharing's neighbour, until killed: an engine decoding (`SHARING_DECODE`) or prefilling 256-token prompts."""
    profiler = Profiler(argparse.Namespace(model=model, dtype=dtype, threads=threads, kv_cache_mb=SHARING_KV_MB), 1024)
    Path(ready).write_text("ready")
    while True:
        if work == "decode":
            profiler.decode(*SHARING_DECODE, 20)
        else:
            profiler.prefill(256, 0)


@contextmanager
def neighbour(args: argparse.Namespace, cpu: int, work: str = "decode", timeout_s: float = 180.0) -> Iterator[None]:
    """A co_runner process pinned to `cpu`, decoding (or prefilling) from before the block starts until it ends."""
    ready = Path(f"/tmp/pdserve-profile-neighbour-{os.getpid()}-{cpu}")
    ready.unlink(missing_ok=True)
    code = (f"from bench.profile import co_runner; "
            f"co_runner({args.model!r}, {args.dtype!r}, {args.threads}, {str(ready)!r}, {work!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host_sharing: the neighbour engine did not start (exit {proc.returncode})")
            time.sleep(0.2)
        time.sleep(2.0)  # its decode steps under way
        yield
    finally:
        proc.kill()
        proc.wait(30)
        ready.unlink(missing_ok=True)


def measure_sharing(args: argparse.Namespace, rounds: int = 3) -> dict[str, Any] | None:
    """The host_sharing section (see the module docstring): per round and per step kind, the steps alone (before
    and after), beside a neighbour of the other kind on the same core, then on another core; the median ratio over
    the rounds (a single round's other-core ratio spread 0.97-1.12 on a 2-core VM). Prefill's ratios are
    `same_core` / `other_core`, decode's `decode_same_core` / `decode_other_core`. None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    profiler = Profiler(argparse.Namespace(**{**vars(args), "kv_cache_mb": SHARING_KV_MB}), 1024)
    kinds = {  # step kind: (its ratios' key prefix, the neighbour's work, the timed steps)
        "prefill": ("", "decode", lambda: [statistics.median(profiler.prefill(n, c) for _ in range(args.repeats + 2))
                                           for n, c in SHARING_STEPS]),
        "decode": ("decode_", "prefill", lambda: [profiler.decode(*SHARING_DECODE, 20)]),
    }
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    try:
        for kind, (prefix, work, timed) in kinds.items():
            timed()  # warm-up: the first steps of each shape run slower
            for _ in range(rounds):
                before, beside = timed(), {}
                for name, cpu in (("same_core", cpus[0]), ("other_core", cpus[1])):
                    with neighbour(args, cpu, work):
                        beside[prefix + name] = timed()
                alone = [(a + b) / 2 for a, b in zip(before, timed())]  # before and after: the machine's drift in between
                runs[kind].append({"alone_s": alone, **{f"{k}_s": v for k, v in beside.items()},
                                   **{k: statistics.mean(t / a for t, a in zip(v, alone)) for k, v in beside.items()}})
    finally:
        profiler.close()
        os.sched_setaffinity(0, own)
    # a median below 1 is the machine's drift between the timings alone and beside (rounds keep the raw ratios)
    ratios = {key: round(max(1.0, statistics.median(r[key] for r in runs[kind])), 3)
              for kind, (prefix, _, _) in kinds.items() for key in (prefix + "same_core", prefix + "other_core")}
    return {**ratios, "steps": [list(s) for s in SHARING_STEPS], "decode_step": list(SHARING_DECODE),
            "rounds": runs["prefill"], "decode_rounds": runs["decode"], "cpus": cpus[:2],
            "neighbour": "prefill steps: an engine decoding 16 requests at 256 tokens of context; decode steps: an engine "
                         "prefilling 256-token prompts; each in its own process"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_estimate:
        out = args.out or SHIPPED / "gpu_h200_llama8b_bf16_estimate.json"
        out.write_text(json.dumps(gpu_estimate(), indent=1) + "\n")
        load_profile(out)
        print(out)
        return 0
    from bench.measure import machine_record

    if args.quick:
        args.repeats, args.no_transfer, args.no_tier, args.no_sharing = 1, True, True, True
    started, load_before = time.time(), os.getloadavg()
    grids, kv = measure_grids(args, GRIDS["quick" if args.quick else "full"])
    links = {} if args.no_transfer else measure_transfer(args.repeats)
    if not links:
        links = {"loopback_assumed": {"latency_s": 0.001, "bytes_per_s": 1e9}}
    machine = machine_record()
    profile = {
        "kind": PROFILE_KIND, "version": 1, "estimate": False,
        "source": ("measured by `pdserve profile" + (" --quick" if args.quick else "") + "` on this machine with the real engine; "
                   + ("transfer: the kvtransfer protocol over loopback" if "loopback_assumed" not in links
                      else "transfer NOT measured (--no-transfer): 1 GB/s + 1 ms assumed")),
        "created_unix": int(started), "duration_s": round(time.time() - started, 1),
        "load_average_1_5_15m": {"start": [round(x, 2) for x in load_before], "end": [round(x, 2) for x in os.getloadavg()]},
        "machine": machine, "model": args.model, "dtype": args.dtype, "device": "cpu", "threads": args.threads,
        "max_num_batched_tokens": args.budget, **kv, **grids, "transfer": links,
        "tp_scaling": {"1": 1.0},
    }
    if not args.no_tier:
        profile["tier"] = measure_tier(args)
    if not args.no_sharing and (sharing := measure_sharing(args)) is not None:
        profile["host_sharing"] = sharing
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(args.dtype, args.dtype)
    out = args.out or SHIPPED / f"cpu_{_cpu_name(machine)}_{args.model.split('-')[0]}_{dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    load_profile(out)  # what the simulator will read
    print(out)
    return 0


def _cpu_name(machine: dict) -> str:
    model = str(machine.get("cpu", "cpu")).lower()
    vendor = "epyc" if "epyc" in model else "xeon" if "xeon" in model else "cpu"
    features = machine.get("cpu_features") or []
    return f"{vendor}_{'amx' if 'amx' in ' '.join(features) else features[-1] if features else 'generic'}"



# ---- a GPU profile stated as an estimate -------------------------------------------------------
H200_CHECK = Path(__file__).parent / "results" / "gpu_check_h200.json"
LLAMA_8B = {"name": "Llama-3.1-8B", "params": 8.03e9, "layers": 32, "hidden": 4096, "kv_heads": 8, "head_dim": 128, "bytes": 2}
ASSUMED = {"prefill_mfu": 0.4, "bf16_dense_flops": 989e12, "step_overhead_s": 0.002, "hbm_bytes": 141e9, "hbm_usable": 0.9,
           "rdma_bytes_per_s": 50e9, "rdma_latency_s": 50e-6, "tp_efficiency": {"1": 1.0, "2": 0.9, "4": 0.8, "8": 0.7}}


def gpu_estimate(check_path: Path = H200_CHECK, model: dict = LLAMA_8B) -> dict[str, Any]:
    """An H200 profile of an 8B model from the H200 device check's measured figures (1B shape, bf16) and stated scaling."""
    check = json.loads(check_path.read_text())
    step = check["sections"]["decode_step"]
    hbm = step["hbm_gbps_measured"] * 1e9
    fractions = sorted((int(b), v["fraction_of_bound"]["engine_step"]) for b, v in step["batches"].items())
    kv_per_token = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * model["bytes"]
    weights = model["params"] * model["bytes"]

    def fraction(batch: int) -> float:
        return float(np.interp(batch, [b for b, _ in fractions], [f for _, f in fractions]))

    def decode_s(batch: int, context: int) -> float:
        return (weights + kv_per_token * batch * context) / hbm / fraction(batch)

    def prefill_s(tokens: int, context: int) -> float:
        flops = 2 * model["params"] * tokens + 4 * model["layers"] * model["hidden"] * tokens * (context + tokens / 2)
        return ASSUMED["step_overhead_s"] + flops / (ASSUMED["bf16_dense_flops"] * ASSUMED["prefill_mfu"])

    tokens, context = [1, 512, 2048, 8192, 16384], [0, 8192, 32768, 131072]
    batch, dcontext = [1, 8, 32, 128, 256], [512, 8192, 32768, 131072]
    staged = check["sections"]["kv_transfer"]["host_staged"]["staged_gbps"] * 1e9
    capacity = int((ASSUMED["hbm_bytes"] * ASSUMED["hbm_usable"] - weights) / kv_per_token)
    return {
        "kind": PROFILE_KIND, "version": 1, "estimate": True,
        "source": (
            f"ESTIMATE, not measured on this model. Measured ({check_path.name}, NVIDIA H200, pdserve's engine, a 1B Llama shape in bf16): "
            f"HBM copy rate {hbm / 1e9:.0f} GB/s; decode engine_step fractions of the HBM bound {dict(fractions)} (batch: fraction); "
            f"host-staged KV copy {staged / 1e9:.1f} GB/s. Assumed: the model is {model['name']} ({model['params']:.3g} params, bf16); "
            f"a decode step reads the weights and every request's KV at the measured fraction of the measured HBM rate "
            f"(interpolated in batch); a prefill step costs {ASSUMED['step_overhead_s'] * 1000:g} ms + its FLOPs (2 x params x tokens "
            f"+ 4 x layers x hidden x tokens x (context + tokens/2)) at {ASSUMED['prefill_mfu']:.0%} of {ASSUMED['bf16_dense_flops'] / 1e12:g} "
            f"TFLOPS; KV capacity per GPU = {ASSUMED['hbm_usable']:.0%} of {ASSUMED['hbm_bytes'] / 1e9:g} GB minus the weights (TP t: x t, "
            f"weights not divided: conservative); links: 'rdma' one 400 Gb/s NIC per GPU ({ASSUMED['rdma_bytes_per_s'] / 1e9:g} GB/s, "
            f"{ASSUMED['rdma_latency_s'] * 1e6:g} us, assumed), 'host_staged' the measured staged copy; TP t divides a step's time by "
            f"t x efficiency {ASSUMED['tp_efficiency']} (assumed: all-reduce cost) and multiplies each worker's link rate by t (a NIC per GPU)."),
        "created_unix": int(time.time()), "machine": check["machine"], "model": model["name"], "dtype": "bfloat16", "device": "cuda",
        "threads": None, "max_num_batched_tokens": 8192, "block_size": 16, "num_layers": model["layers"],
        "kv_bytes_per_token": kv_per_token, "kv_capacity_tokens": capacity,
        "prefill": {"tokens": tokens, "context": context, "seconds": [[prefill_s(n, c) for c in context] for n in tokens]},
        "decode": {"batch": batch, "context": dcontext, "seconds": [[decode_s(b, c) for c in dcontext] for b in batch]},
        "transfer": {"rdma": {"latency_s": ASSUMED["rdma_latency_s"], "bytes_per_s": ASSUMED["rdma_bytes_per_s"]},
                     "host_staged": {"latency_s": 1e-4, "bytes_per_s": staged}},
        "tp_scaling": ASSUMED["tp_efficiency"], "assumptions": ASSUMED,
    }


if __name__ == "__main__":
    raise SystemExit(main())
