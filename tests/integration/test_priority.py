"""Request priority travels from both front ends through the real router to both pools.

A real cluster (router + 1 prefill + 1 decode worker as processes, the demo model, TCP KV transport)
exports its spans to files (`tracing.exporter: file`). A gRPC request with priority 7 and an OpenAI
completion with the extension field `priority: -3`, each under its own client trace: the prefill
worker's `prefill` span and the decode worker's `decode` span of each trace carry the priority the
worker received (`pdserve.priority`), the greedy output still equals HF, and no KV block leaks.
Refusals of bad values (both protocols, naming `priority`) are rows of tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import grpc
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.integration.test_tracing import CLIENT_SPAN, Tree, read_spans

MAX_NEW = 6
GRPC_TRACE, HTTP_TRACE = "7" * 32, "8" * 32


def test_priority_reaches_both_pools(tmp_path, demo_prompt_ids, hf_greedy):
    config = write_config(tmp_path / "pdserve.yaml", transport="tcp", engine={"dtype": "float32"},
                          tracing={"enabled": True, "exporter": "file", "directory": str(tmp_path / "spans")})
    prompt = demo_prompt_ids[3]
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        with grpc.insecure_channel(cluster.router.address) as channel:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), priority=7,
                                         sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
            metadata = (("traceparent", f"00-{GRPC_TRACE}-{CLIENT_SPAN}-01"),)
            responses = list(pb_grpc.RouterStub(channel).Generate(request, timeout=120, metadata=metadata))
        assert [t for r in responses for t in r.chunk.token_ids] == hf_greedy(tuple(prompt), MAX_NEW)
        http = requests.post(cluster.http_url + "/v1/completions", timeout=120,
                             json={"model": "smollm2-135m", "prompt": demo_prompt_ids[1], "max_tokens": MAX_NEW, "temperature": 0,
                                   "priority": -3},
                             headers={"traceparent": f"00-{HTTP_TRACE}-{CLIENT_SPAN}-01"})
        assert http.status_code == 200, http.text
        cluster.assert_no_leaked_blocks()
    spans = read_spans(tmp_path / "spans")
    for trace, priority in ((GRPC_TRACE, 7), (HTTP_TRACE, -3)):
        tree = Tree(spans, trace)
        for service, name in (("pdserve-prefill", "prefill"), ("pdserve-decode", "decode")):
            assert tree.one(service, name)["attributes"]["pdserve.priority"] == priority, (trace, service)
