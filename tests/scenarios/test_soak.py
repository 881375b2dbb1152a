"""Soak (slow): a bounded run of mixed traffic, 10 minutes by default.

    PDSERVE_SOAK_S=600 .venv/bin/pytest -m slow tests/scenarios/test_soak.py   # PDSERVE_SOAK_S=60 for a short try

12 closed-loop clients against a router admitting 8 (so some refusals too, retried after Retry-After), on 1 prefill + 1 decode
worker: prompts of ~5, ~200 and ~1000 tokens, max_tokens from 1 to 64, HTTP SSE and gRPC streaming
in equal parts, and about one request in six hung up by its client after a few chunks. At the end:
no lost request (each one finished with exactly its max_tokens tokens, was refused with 429 /
RESOURCE_EXHAUSTED, or was cancelled by its client; nothing else, nothing past its deadline), no
KV block leaked on any worker, the router's RSS grew < 200 MB over the second half, and the cluster
still answers. Results: bench/results/soak.json (outcomes per protocol, RSS min/max/last per
process, tokens/s per window).
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest
import requests

from router.openai.routes import RETRY_AFTER_S
from tests.scenarios.load_clients import Job, RssSampler, admission_limited_cluster, run_load
from tests.scenarios.test_overload import process_ids, write_report

DURATION_S = float(os.environ.get("PDSERVE_SOAK_S", "600"))
MAX_QUEUED = 8
CLIENTS = 12
PROMPT_WORDS = (5, 200, 1000)
MAX_TOKENS = (1, 8, 32, 64)
CANCEL_SHARE = 1 / 6
RSS_GROWTH_LIMIT_MB = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with admission_limited_cluster(tmp_path_factory.mktemp("soak"), MAX_QUEUED) as c:
        yield c


def soak_job(rng: random.Random) -> Job:
    words = rng.choice(PROMPT_WORDS)
    prompt = " ".join(rng.choice(["sea", "wind", "stone", "light", "river", "cloud"]) for _ in range(words))
    cancel_after = rng.randint(1, 4) if rng.random() < CANCEL_SHARE else None
    return Job(rng.choice(["http", "grpc"]), prompt, rng.choice(MAX_TOKENS), cancel_after)


@pytest.mark.slow
@pytest.mark.timeout(DURATION_S + 300)  # the load itself runs DURATION_S; the suite-wide 600 s limit would cut it
def test_soak_mixed_traffic_with_cancellations(cluster, results_dir):
    with RssSampler(process_ids(cluster)) as rss:
        result = asyncio.run(run_load(cluster.http_url, cluster.router.address, CLIENTS, DURATION_S, soak_job, seed=7,
                                      backoff_s=RETRY_AFTER_S))
    windows = _windows(DURATION_S)
    report = {
        "experiment": "soak",
        "config": {"duration_s": DURATION_S, "clients": CLIENTS, "max_queued_requests": MAX_QUEUED,
                   "prompt_words": PROMPT_WORDS, "max_tokens": MAX_TOKENS, "cancel_share": round(CANCEL_SHARE, 3),
                   "protocols": "half HTTP SSE, half gRPC streaming", "prefill_workers": 1, "decode_workers": 1,
                   "transport": "tcp"},
        **result.summary(),
        "tokens_per_s_by_window": {f"{a:.0f}-{b:.0f}s": round(result.tokens_per_s(a, b), 1) for a, b in windows},
        "rss_mb": rss.stats(),
        "router_rss_growth_second_half_mb": round(rss.growth_second_half("router"), 1),
        "rss_samples": rss.samples[:: max(1, len(rss.samples) // 120)],
    }
    write_report(results_dir / "soak.json", report)

    assert not result.errors(), json.dumps(report["errors"], indent=1)
    for protocol in ("http", "grpc"):
        assert result.count("ok", protocol) > 0 and result.count("cancelled", protocol) > 0, report["by_protocol"]
    assert report["router_rss_growth_second_half_mb"] < RSS_GROWTH_LIMIT_MB, report["rss_mb"]
    assert cluster.router.alive() and all(p.alive() for p in [*cluster.prefill, *cluster.decode])
    cluster.assert_no_leaked_blocks()
    resp = requests.post(cluster.http_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200, resp.text


def _windows(duration_s: float, count: int = 5) -> list[tuple[float, float]]:
    step = duration_s / count
    return [(i * step, (i + 1) * step) for i in range(count)]
