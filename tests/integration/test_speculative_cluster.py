"""Speculative decoding in the decode pool of a real cluster (router, prefill worker, decode worker as
processes): greedy output through the router equals HF, the decode worker verified and accepted
proposals (the prefill worker, which samples only first tokens, none), the router exports the
counters, and no KV block leaks on either side.

The cluster speculates at every step (`adaptive: false`): the default switch decides from step times
it measures, so whether it speculates on a loaded CI machine is not fixed, and a test of the cluster's
plumbing must not hang on it (tests/unit/test_engine_speculative.py covers the switch)."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from bench.cluster import LocalCluster, write_config
from common.tokenization import encode_prompt
from tests.integration.test_disaggregated import generate
from tests.unit.test_engine_speculative import ALWAYS, GROUNDED

MAX_NEW = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    engine = {"dtype": "float32", "speculative": ALWAYS}
    config = write_config(tmp_path_factory.mktemp("spec") / "pdserve.yaml", transport="tcp", engine=engine)
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


def test_greedy_with_speculation_through_the_router_matches_hf(cluster, demo_model, demo_prompt_ids, hf_greedy):
    prompts = [encode_prompt(demo_model.tokenizer, p) for p in GROUNDED] + demo_prompt_ids[:2]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: generate(cluster.router.address, ids, MAX_NEW), prompts))
    for ids, (tokens, _) in zip(prompts, results):
        assert tokens == hf_greedy(tuple(ids), MAX_NEW)
    decode = cluster.worker_stats(cluster.decode[0])
    prefill = cluster.worker_stats(cluster.prefill[0])
    assert decode.spec_steps > 0 and decode.spec_accepted_tokens > 0, decode
    assert prefill.spec_proposed_tokens == 0
    metrics = requests.get(cluster.http_url + "/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines() if line.startswith("pdserve_spec_accepted_tokens_total{") and 'role="decode"' in line]
    assert accepted and float(accepted[0].split()[-1]) > 0, accepted
    cluster.assert_no_leaked_blocks()
