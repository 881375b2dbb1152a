"""Experiment: what a fresh cluster's first request pays that later ones do not.

    python -m bench.experiments.first_request [--transports ucx tcp] [--requests 6] [--clusters 2]

For each KV transport, a fresh router + prefill + decode cluster (real processes, one torch thread
each) serves `--requests` disaggregated requests one after another (fresh random 64-token prompts,
4 tokens each, greedy), through the router's gRPC API. Per request it records the client's wall time
and the stages the processes measured (router.critical_path). The baseline is in the same run: the
same cluster's later requests. `cold_extra_s` = the first request's wall time minus the median of
the later ones, and the same per stage, so the stage that pays it shows (a transport's one-time setup
shows in prefill_compute: the prefill worker streams KV layer by layer during its forward).
`--clusters` fresh clusters per transport; each figure is reported per cluster. Writes
bench/results/first_request.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.cluster import BenchCluster, bench_config
from bench.experiments import common

PROMPT_TOKENS = 64
MAX_TOKENS = 4


def one_request(address: str, prompt: list[int]) -> dict[str, Any]:
    import grpc

    from proto.pdserve.v1 import pdserve_pb2 as pb
    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    from router.critical_path import STAGES

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), skip_detokenize=True,
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        started, last = time.perf_counter(), None
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=300):
            last = response
        wall = time.perf_counter() - started
    assert last is not None and not last.timings.local_prefill, "expected a disaggregated request"
    return {"wall_s": wall, **{stage: getattr(last.timings, f"{stage}_s") for stage in STAGES}}


def run_cluster(transport: str, requests: int, rng: np.random.Generator) -> dict[str, Any]:
    # no local prefill: every request goes P -> D; no prefix cache hits: fresh random prompts
    config = bench_config(transport, router={"local_prefill_threshold": 0})
    with BenchCluster(config, name=f"first-{transport}") as cluster:
        runs = [one_request(cluster.grpc_address, rng.integers(1000, 30000, size=PROMPT_TOKENS).tolist())
                for _ in range(requests)]
    first, later = runs[0], runs[1:]
    cold = {key: first[key] - statistics.median(r[key] for r in later) for key in first}
    return {"transport": transport, "requests": runs, "first_wall_s": first["wall_s"],
            "later_wall_median_s": statistics.median(r["wall_s"] for r in later),
            "cold_extra_s": cold["wall_s"], "cold_extra_by_stage_s": {k: v for k, v in cold.items() if k != "wall_s"}}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "first_request")
    p.add_argument("--transports", nargs="+", default=["ucx", "tcp"], choices=["ucx", "tcp"])
    p.add_argument("--requests", type=int, default=6, help="per cluster, the first included (at least 2)")
    p.add_argument("--clusters", type=int, default=2, help="fresh clusters per transport")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="ucx only, one cluster, 3 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.transports, args.clusters, args.requests = ["ucx"], 1, 3
    if args.requests < 2:
        p.error("--requests: at least 2 (the first and a later one to compare it with)")
    info, started = common.begin(args.quick)
    rng = np.random.default_rng(args.seed)
    results = [run_cluster(t, args.requests, rng) for t in args.transports for _ in range(args.clusters)]
    report = {"experiment": "first_request", "command": common.command_line(), "machine": info, "params": vars(args),
              "results": results}
    common.finish(info, started)
    common.save("first_request", report)
    for r in results:
        print(f"{r['transport']}: first {r['first_wall_s'] * 1000:.0f} ms, later median {r['later_wall_median_s'] * 1000:.0f} ms, "
              f"cold extra {r['cold_extra_s'] * 1000:.0f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
