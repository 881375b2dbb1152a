"""The engine's cumulative counters, the router's per-worker engine series, and the Grafana
dashboard's expressions against the names the router really exports."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"


@dataclass
class PoolEntry:
    """The fields of router.pool.Worker that `observe_workers` reads."""

    role: str
    worker_id: str
    stats: pb.WorkerStats | None
    healthy: bool = True
    draining: bool = False
    routed: int = 0


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_engine_counts_prompt_and_generated_tokens_and_step_time(demo_model, demo_prompt_ids):
    engine = make_engine(demo_model, max_num_batched_tokens=16)  # long prompts are chunked over several steps
    prompts = demo_prompt_ids[:3]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = run_to_completion(engine)
    stats = engine.stats()
    assert stats.prompt_tokens == sum(len(ids) for ids in prompts) - stats.prefix_hit_tokens  # a shared template prefix hits
    assert stats.generation_tokens == sum(len(t) for t in outputs.values()) == 12
    assert stats.steps > len(max(prompts, key=len)) // 16 and stats.step_seconds > 0
    # the steps that ran prompt chunks: every chunk of the longest prompt, and not the 3 decode-only steps after the last
    assert len(max(prompts, key=len)) // 16 <= stats.prompt_steps <= stats.steps - 3
    assert 0 < stats.prompt_step_seconds < stats.step_seconds
    # the same prompt again: its full cached blocks are not computed twice
    engine.add_request("again", prompts[0], SamplingParams(max_tokens=1))
    run_to_completion(engine)
    hits = engine.stats().prefix_hit_tokens - stats.prefix_hit_tokens
    assert hits > 0 and engine.stats().prompt_tokens == stats.prompt_tokens + len(prompts[0]) - hits
    assert_no_leaked_blocks(engine)


def test_worker_series_follow_the_pool():
    metrics = RouterMetrics()
    d0 = PoolEntry("decode", "d0", pb.WorkerStats(free_kv_blocks=30, total_kv_blocks=40, running_requests=3, queued_requests=2,
                                                  preemptions=1, prefix_cache_queried_tokens=64, prefix_cache_hit_tokens=32,
                                                  prompt_tokens=100, generation_tokens=50, steps=20, step_seconds=2.0,
                                                  prompt_steps=4, prompt_step_seconds=1.2))
    p0 = PoolEntry("prefill", "p0", pb.WorkerStats(total_kv_blocks=40, free_kv_blocks=40, kv_bytes_sent=4096))
    fresh = PoolEntry("decode", "d1", None)  # joined, no stats yet: no engine series
    metrics.observe_workers([d0, p0, fresh])
    got = samples(metrics)
    d0_labels = (("role", "decode"), ("worker", "d0"))
    assert got[("pdserve_kv_cache_usage_ratio", d0_labels)] == 0.25
    assert got[("pdserve_num_requests_running", d0_labels)] == 3
    assert got[("pdserve_num_requests_waiting", d0_labels)] == 2
    assert got[("pdserve_num_preemptions_total", d0_labels)] == 1
    assert got[("pdserve_prefix_cache_hits_total", d0_labels)] / got[("pdserve_prefix_cache_queries_total", d0_labels)] == 0.5
    assert (got[("pdserve_prompt_tokens_total", d0_labels)], got[("pdserve_generation_tokens_total", d0_labels)]) == (100, 50)
    assert (got[("pdserve_engine_step_seconds_sum", d0_labels)], got[("pdserve_engine_step_seconds_count", d0_labels)]) == (2.0, 20)
    assert (got[("pdserve_engine_prompt_step_seconds_sum", d0_labels)], got[("pdserve_engine_prompt_step_seconds_count", d0_labels)]) == (1.2, 4)
    assert got[("pdserve_worker_kv_sent_bytes_total", (("role", "prefill"), ("worker", "p0")))] == 4096
    assert not any(dict(labels).get("worker") == "d1" for name, labels in got if name.startswith("pdserve_num_"))

    metrics.observe_workers([p0])  # d0 left the pool
    workers = {dict(labels).get("worker") for _, labels in samples(metrics)}
    assert "p0" in workers and "d0" not in workers


SAMPLE_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exported_names() -> set[str]:
    """Every sample name a live router can export (labelled series not yet used included), its
    worker series too."""
    metrics = RouterMetrics()
    metrics.observe_workers([PoolEntry("decode", "d0", pb.WorkerStats(total_kv_blocks=1))])
    return {family.name + suffix for family in metrics.registry.collect() for suffix in SAMPLE_SUFFIXES[family.type]}


def test_dashboard_uses_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["targets"] and all(t["refId"] for t in p["targets"]) for p in panels)
    used = {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}
    names = exported_names()
    assert used - names == set(), f"the dashboard uses metrics the router does not export: {sorted(used - names)}"
    # what the dashboard is for: latency quantiles, per-stage TTFT, outcomes, engine load, cache, tokens, KV moved
    for needed in ("pdserve_ttft_seconds_bucket", "pdserve_itl_seconds_bucket", "pdserve_e2e_seconds_bucket",
                   "pdserve_request_stage_seconds_bucket", "pdserve_requests_total", "pdserve_kv_cache_usage_ratio",
                   "pdserve_num_requests_running", "pdserve_num_requests_waiting", "pdserve_num_preemptions_total",
                   "pdserve_prefix_cache_hits_total", "pdserve_generation_tokens_total", "pdserve_kv_transfer_bytes_total"):
        assert needed in used, needed
