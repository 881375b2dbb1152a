"""`pdserve bench trace` end to end on a hand-made six-request trace: a real 1 prefill + 2 decode cluster (router and
workers as processes, demo model, KV over tcp) replays three two-turn conversations spaced so that each turn finishes
before the next arrives. The JSON must account for every request, compute no fewer prompt tokens than the trace's
reuse bound allows and fewer than it sent (the prefill worker's cache serves the earlier turns), and leak no block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.trace.workload import Scale, load_trace, reuse_bound

CONVERSATIONS = [  # (arrival ms, input tokens, hash ids): 512 trace tokens per id, 16 tokens each here
    (0, 2048, [0, 1, 2, 3]),
    (1000, 1536, [0, 10, 11]),
    (2000, 1024, [0, 20]),
    (3000, 1300, [0, 20, 21]),
    (4000, 3072, [0, 1, 2, 3, 4, 5]),
    (5000, 2560, [0, 10, 11, 12, 13]),
]


def pdserve_cmd() -> list[str]:
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "deploy.cli"]


def test_trace_replay_on_a_real_cluster(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 100, "hash_ids": ids}) + "\n"
                             for t, n, ids in CONVERSATIONS))
    out = tmp_path / "replay.json"
    cmd = [*pdserve_cmd(), "bench", "trace", "--trace", str(trace), "--requests", "6", "--rate", "1", "--configs", "round_robin",
           "--warmup", "1", "--kv-cache-mb", "64", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    run = report["results"]["round_robin"]
    m = run["metrics"]
    bound = reuse_bound(load_trace(trace), Scale(16))
    assert bound["prompt_tokens"] == 64 + 48 + 32 + 41 + 96 + 80
    assert (m["sent"], m["completed"], m["failed"]) == (6, 6, 0)
    assert m["prompt_tokens"] == bound["prompt_tokens"] == report["trace"]["prompt_tokens"]
    assert bound["prompt_tokens"] - bound["reusable_tokens"] <= m["prompt_tokens_computed"] < bound["prompt_tokens"]
    assert 0 < m["of_reuse_bound"] <= 1
    assert m["kv_bytes_moved_per_request"] > 0 and m["ttft_ms"]["p50"] > 0 and m["goodput"] is not None
    assert report["trace"]["time"]["rate"] == 1 and report["trace"]["window"]["requests"] == 6
    assert run["leaked_kv_blocks"] == {"prefill0": 0, "decode0": 0, "decode1": 0}
    assert run["cpu_cores"]["cluster"] > 0 and run["cpu_cores"]["others"] >= 0
    assert len(json.loads((tmp_path / "replay_requests.json").read_text())["round_robin"]) == 6
    assert (tmp_path / "replay.png").stat().st_size > 0
    assert json.loads((tmp_path / "history.jsonl").read_text().splitlines()[-1])["experiment"] == "trace_replay"
