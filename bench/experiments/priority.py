"""Experiment: request priority under overload, TTFT of high- vs low-priority requests.

    python -m bench.experiments.priority [--num-prompts 48] [--fraction 0.25]

A disaggregated cluster (1 prefill + 1 decode worker, one torch thread each, TCP KV transport) with a
small prefill token budget (--budget tokens per step) receives every request at once (request rate
inf): the prefill worker's waiting queue holds several steps of prompts, which its scheduler admits
by priority (higher first, FCFS within a priority). A seeded --fraction of the requests is sent with
priority --priority, the rest with 0. Writes bench/results/priority.json: the bench.serve report
(raw timestamps included) with `metrics_by_priority` per run, and a summary `priority_ttft_ms`.
"""

from __future__ import annotations

import sys

from bench import serve
from bench.cluster import BenchCluster, bench_config
from bench.experiments import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "priority")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", default="192:320")
    p.add_argument("--output-len", default="8:16")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--priority", type=int, default=10)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the workers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common.setup_logging()
    config = bench_config("tcp", engine={"max_num_batched_tokens": args.budget})
    with BenchCluster(config, num_prefill=1, num_decode=1, name="priority") as cluster:
        report = serve.run(["--grpc", cluster.grpc_address, "--label", "priority", "--num-prompts", str(args.num_prompts),
                            "--input-len", args.input_len, "--output-len", args.output_len, "--request-rate", "inf",
                            "--high-priority-fraction", str(args.fraction), "--high-priority", str(args.priority),
                            "--seed", str(args.seed), "--warmup", "2", "--no-progress"])
        report["cluster"] = cluster.describe()
    by_priority = report["runs"][0]["metrics_by_priority"]
    report["priority_ttft_ms"] = {prio: {k: m["ttft_ms"][k] for k in ("median", "p99")} | {"completed": m["completed"]}
                                  for prio, m in by_priority.items()}
    common.save("priority", report)
    print(report["priority_ttft_ms"], file=sys.stderr)
    return 0 if report["runs"][0]["metrics"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
