"""Prefix-aware routing sends requests that share a long prefix to one prefill worker; round robin does not."""

from __future__ import annotations

import grpc
import pytest

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc


@pytest.mark.parametrize("policy", ["prefix_aware", "round_robin"])
def test_shared_prefix_routing(policy, tmp_path, demo_model, hf_greedy):
    tok = demo_model.tokenizer
    shared = tok("You are a meticulous assistant. Keep answers short and factual. " * 10)["input_ids"]
    questions = ["What is 2 + 2?", "Name a colour.", "What is the capital of Italy?", "Say hello."]
    prompts = [shared + tok(" " + q)["input_ids"] for q in questions]
    config = write_config(tmp_path / "c.yaml", transport="tcp", router={"policy": policy})
    with LocalCluster(config, num_prefill=2, num_decode=1) as cluster:
        with grpc.insecure_channel(cluster.router.address) as channel:
            stub = pb_grpc.RouterStub(channel)
            for ids in prompts:
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
                tokens = [t for r in stub.Generate(request, timeout=120) for t in r.chunk.token_ids]
                assert tokens == hf_greedy(tuple(ids), 8)
        stats = [cluster.worker_stats(p) for p in cluster.prefill]
        used = [s for s in stats if s.prefix_cache_queried_tokens > 0]
        if policy == "prefix_aware":
            assert len(used) == 1, [s.prefix_cache_queried_tokens for s in stats]
            full_blocks = len(shared) // 16
            assert used[0].prefix_cache_hit_tokens >= 3 * (full_blocks - 1) * 16
        else:
            assert len(used) == 2, "round robin should spread the requests"
        cluster.assert_no_leaked_blocks()
