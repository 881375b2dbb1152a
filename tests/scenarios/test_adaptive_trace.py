"""The shifting-trace experiment's machinery (bench/experiments/adaptive_trace.py) on a tiny trace.

One real `pdserve serve` (embedded Ray, the demo model) in the adaptive config: 1P/1D with
`autoscaler.adaptive.mode: adaptive`. The tiny three-phase trace is replayed through the router;
every request of the trace must be sent and complete, the per-phase counts must add up to the trace,
every KV block must be free again afterwards, and every event the poller collected must carry its
time on the trace's clock and its reason (a controller plan: its inputs too). The summary written
from the per-config file names the same trace. No assertion on speed or on goodput.
"""

from __future__ import annotations

import json

import pytest

from bench.experiments import adaptive_trace as at
from bench.experiments import common

pytestmark = pytest.mark.timeout(420)


def test_tiny_trace_through_the_adaptive_deployment(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    args = at.build_parser().parse_args(["--configs", "adaptive", "--phase-s", "8", "--scale", "0.08", "--load", "0.5",
                                         "--interval", "1", "--warmup", "1", "--seed", "2", "--log-dir", str(tmp_path / "logs")])
    specs, phase_of, kind_of = at.build_trace(at.PHASES, args.phase_s, args.scale, args.load, args.seed)
    assert len(set(phase_of)) == len(at.PHASES) and len(specs) >= 6
    result = at.run_config("adaptive", specs, phase_of, kind_of, args)

    metrics = result["metrics"]
    assert metrics["overall"]["sent"] == len(specs) and metrics["overall"]["completed"] == len(specs), metrics["overall"]
    assert metrics["overall"]["failed"] == 0
    assert sum(metrics[p]["sent"] for p in dict.fromkeys(phase_of)) == len(specs)
    assert sorted(r["index"] for r in result["requests"]) == list(range(len(specs)))
    assert all(r["slos_ms"]["tpot"] == (35.0 if kind_of[r["index"]].interactive else 250.0) for r in result["requests"])
    assert result["leaked_kv_blocks"] == {}, "every KV block is free again once the trace is done"
    assert result["cpu"]["deployment_cores"] > 0
    assert sum(len(ids) for ids in result["workers_at_end"].values()) >= 2
    for event in result["events"]:
        assert isinstance(event["t_s"], float) and event["reason"]
        if event["pool"] == "controller":
            assert {"prefill", "decode", "busy", "local_share"} <= set(event["inputs"]), event
    print(json.dumps([{k: e[k] for k in ("t_s", "pool", "from", "to", "reason") if k in e} for e in result["events"]], indent=1))

    common.save("adaptive_trace_adaptive", result)
    report = at.summarize(at.load_results(at.trace_id(specs)), {}, args, list(dict.fromkeys(phase_of)))
    assert list(report["results"]) == ["adaptive"] and report["acceptance"] is None
