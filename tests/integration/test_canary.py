"""The canary catches what every wire check accepts: a prefill worker that zeroes a request's KV before
taking its checksum (the test-only `forge` fault) hands the decode worker wrong KV that passes the
checksum; the client gets that output (the canary never changes what it sees), and the colocated
recompute of the same request finds the divergence and counts it. A clean request next to it agrees."""

from __future__ import annotations

import grpc
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

MAX_NEW = 12


def generate(address: str, request_id: str, prompt_ids: list[int]) -> list[int]:
    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt_ids),
                                 sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    with grpc.insecure_channel(address) as channel:
        return [t for r in pb_grpc.RouterStub(channel).Generate(request, timeout=300) for t in r.chunk.token_ids]


def shadow_counts(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("pdserve_shadow_checks_total", "pdserve_disagg_divergence_total"))}


def test_forged_kv_that_passes_the_checksum_is_caught_by_the_canary(tmp_path, demo_prompt_ids, hf_greedy):
    config = write_config(tmp_path / "pdserve.yaml", transport="tcp", router={"shadow_check_fraction": 1.0})
    env = {"prefill0": {"PDSERVE_KV_FAULTS": "forge:forged-*:0"}}
    with LocalCluster(config, num_prefill=1, num_decode=1, process_env=env) as cluster:
        clean = generate(cluster.router.address, "clean-1", demo_prompt_ids[0])
        forged = generate(cluster.router.address, "forged-1", demo_prompt_ids[1])
        wait_until(lambda: sum(v for k, v in shadow_counts(cluster.http_url).items() if k.startswith("pdserve_shadow_checks_total")) >= 2,
                   120, "the two shadow checks ended", interval=0.5)
        counts = shadow_counts(cluster.http_url)
        cluster.assert_no_leaked_blocks()
    assert clean == hf_greedy(tuple(demo_prompt_ids[0]), MAX_NEW)
    assert forged != hf_greedy(tuple(demo_prompt_ids[1]), MAX_NEW), "zeroed KV should change the output"
    assert counts['pdserve_shadow_checks_total{outcome="agreed"}'] == 1
    assert counts['pdserve_shadow_checks_total{outcome="diverged"}'] == 1
    assert counts["pdserve_disagg_divergence_total"] == 1
