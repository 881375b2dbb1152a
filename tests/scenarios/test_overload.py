"""Overload: 4x the router's admission limit, sustained (60 s by default, PDSERVE_OVERLOAD_S).

The router admits at most `max_queued_requests` = 8 requests at once; 32 closed-loop clients (half
HTTP streaming, half gRPC streaming, each asking for 16 tokens with ignore_eos) keep it full. The
excess must be refused at once (429 with Retry-After / RESOURCE_EXHAUSTED) and retried after a
short back-off; every admitted request must finish with exactly 16 tokens; no other outcome is
allowed. RSS of the router and the workers is sampled every second, and tokens/s of admitted
requests is measured over the first and the last 20 s. Results: overload.json in the results directory (tests/scenarios/conftest.py).

Asserted: refusals over both protocols, zero errors, the router's RSS grows < 200 MB over the second
half, admitted throughput non-zero in both windows (no speed is asserted), no KV block leaked.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import pytest
import requests

from bench.cluster import LocalCluster
from tests.scenarios.load_clients import Job, RssSampler, admission_limited_cluster, run_load

MAX_QUEUED = 8
CLIENTS = 4 * MAX_QUEUED
DURATION_S = float(os.environ.get("PDSERVE_OVERLOAD_S", "60"))
WINDOW_S = min(20.0, DURATION_S / 3)
MAX_TOKENS = 16
RSS_GROWTH_LIMIT_MB = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with admission_limited_cluster(tmp_path_factory.mktemp("overload"), MAX_QUEUED) as c:
        yield c


def overload_job(rng: random.Random) -> Job:
    protocol = rng.choice(["http", "grpc"])
    return Job(protocol, f"Count from {rng.randint(1, 999)} upwards:", MAX_TOKENS)


def test_four_times_the_admission_limit_for_a_minute(cluster, results_dir):
    with RssSampler(process_ids(cluster)) as rss:
        result = asyncio.run(run_load(cluster.http_url, cluster.router.address, CLIENTS, DURATION_S, overload_job))
    first, last = result.tokens_per_s(0, WINDOW_S), result.tokens_per_s(DURATION_S - WINDOW_S, DURATION_S)
    report = {
        "experiment": "overload",
        "config": {"max_queued_requests": MAX_QUEUED, "clients": CLIENTS, "duration_s": DURATION_S, "max_tokens": MAX_TOKENS,
                   "protocols": "half HTTP SSE, half gRPC streaming", "prefill_workers": 1, "decode_workers": 1,
                   "transport": "tcp"},
        **result.summary(),
        "admitted_tokens_per_s": {f"first_{WINDOW_S:.0f}s": round(first, 1), f"last_{WINDOW_S:.0f}s": round(last, 1)},
        "rss_mb": rss.stats(),
        "router_rss_growth_second_half_mb": round(rss.growth_second_half("router"), 1),
        "rss_samples": rss.samples,
    }
    write_report(results_dir / "overload.json", report)

    assert not result.errors(), json.dumps(report["errors"], indent=1)
    for protocol in ("http", "grpc"):
        assert result.count("refused", protocol) > 0, report["by_protocol"]
        assert result.count("ok", protocol) > 0, report["by_protocol"]
    assert first > 0 and last > 0, report["admitted_tokens_per_s"]
    assert report["router_rss_growth_second_half_mb"] < RSS_GROWTH_LIMIT_MB, report["rss_mb"]
    assert cluster.router.alive() and all(p.alive() for p in [*cluster.prefill, *cluster.decode])
    cluster.assert_no_leaked_blocks()
    resp = requests.post(cluster.http_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text  # admission is free again once the load stops


def process_ids(cluster: LocalCluster) -> dict[str, int]:
    return {"router": cluster.router.popen.pid, **{p.name: p.popen.pid for p in [*cluster.prefill, *cluster.decode]}}


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
