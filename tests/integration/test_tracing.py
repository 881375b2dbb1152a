"""One disaggregated request traced across router, prefill worker, KV transfer and decode worker.

A real cluster (router + 1 prefill + 1 decode worker as processes, the demo model, TCP KV transport)
runs with `tracing.exporter: file`: every process appends its spans as JSON lines to its own file in
one directory. The clients (gRPC and the OpenAI HTTP API) send a W3C `traceparent`; after the cluster stopped (each process flushes
its spans on exit), the test reads every file and checks the span tree of each request: one trace
id across the processes, each span under its parent, the attributes, and errors where a KV transfer
was corrupted on purpose (the first attempt of a request whose id starts with `retry-`).
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MAX_NEW = 8
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
RETRY_TRACE = "2" * 32
HTTP_TRACE = "3" * 32


def generate(address: str, prompt_ids: list[int], request_id: str, trace_id: str) -> tuple[list[int], pb.GenerateResponse]:
    metadata = (("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01"),)
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt_ids),
                                     sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        tokens, last = [], None
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=120, metadata=metadata):
            tokens.extend(response.chunk.token_ids)
            last = response
    return tokens, last


def read_spans(directory: Path) -> list[dict]:
    """Every exported span, from every process's file, with its process's service name."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            record["service"] = record["resource"]["attributes"]["service.name"]
            spans.append(record)
    return spans


class Tree:
    """One trace's spans, found by (service, name)."""

    def __init__(self, spans: list[dict], trace_id: str):
        self.spans = [s for s in spans if s["context"]["trace_id"] == "0x" + trace_id]
        self.by_id = {s["context"]["span_id"]: s for s in self.spans}

    def all(self, service: str, name: str) -> list[dict]:
        return sorted((s for s in self.spans if (s["service"], s["name"]) == (service, name)), key=lambda s: s["start_time"])

    def one(self, service: str, name: str) -> dict:
        (found,) = self.all(service, name)
        return found

    def parent(self, span: dict) -> dict:
        return self.by_id[span["parent_id"]]


@pytest.fixture(scope="module")
def traced(tmp_path_factory, demo_prompt_ids, hf_greedy):
    """Runs the requests, stops the cluster (spans flushed) and returns (results, spans)."""
    root = tmp_path_factory.mktemp("tracing")
    config = write_config(root / "pdserve.yaml", transport="tcp", router={"prefill_retries": 1},
                          kv_transfer={"faults": "corrupt:retry-*.0-*:3"},
                          tracing={"enabled": True, "exporter": "file", "directory": str(root / "spans")})
    jobs = {"clean-1": (CLIENT_TRACE, demo_prompt_ids[0]), "retry-1": (RETRY_TRACE, demo_prompt_ids[1])}
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        results = {rid: generate(cluster.router.address, ids, rid, trace_id) for rid, (trace_id, ids) in jobs.items()}
        for rid, (_, ids) in jobs.items():
            assert results[rid][0] == hf_greedy(tuple(ids), MAX_NEW), rid
        http = requests.post(cluster.http_url + "/v1/completions", timeout=120,
                             json={"model": "smollm2-135m", "prompt": demo_prompt_ids[2], "max_tokens": MAX_NEW, "temperature": 0},
                             headers={"traceparent": f"00-{HTTP_TRACE}-{CLIENT_SPAN}-01"})
        assert http.status_code == 200, http.text
        for path in ("/health", "/metrics"):  # untraced: probes and scrapes are no requests
            assert requests.get(cluster.http_url + path, timeout=10).status_code == 200
        cluster.assert_no_leaked_blocks()
    return results, read_spans(root / "spans"), {rid: len(ids) for rid, (_, ids) in jobs.items()}


def test_one_request_is_one_trace_across_the_processes(traced):
    results, spans, prompt_len = traced
    assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    tree = Tree(spans, CLIENT_TRACE)
    # one span per step and nothing else: no span for the Stats polls that ran meanwhile
    assert sorted((s["service"], s["name"]) for s in tree.spans) == sorted([
        ("pdserve-router", "generate"), ("pdserve-router", "decode.admit"), ("pdserve-router", "prefill"),
        ("pdserve-prefill", "prefill"), ("pdserve-prefill", "kv.send"), ("pdserve-decode", "decode"), ("pdserve-decode", "kv.receive")])
    generate = tree.one("pdserve-router", "generate")
    assert generate["parent_id"] == "0x" + CLIENT_SPAN  # the client's traceparent continued
    attrs = generate["attributes"]
    assert attrs["pdserve.request_id"] == "clean-1" and attrs["pdserve.prompt_tokens"] == prompt_len["clean-1"]
    tokens, last = results["clean-1"]
    assert attrs["pdserve.outcome"] == "ok" and attrs["pdserve.completion_tokens"] == len(tokens)
    assert attrs["pdserve.finish_reason"] == pb.FinishReason.Name(last.finish_reason)
    router_prefill = tree.one("pdserve-router", "prefill")
    for child in (tree.one("pdserve-router", "decode.admit"), router_prefill, tree.one("pdserve-decode", "decode")):
        assert tree.parent(child) is generate, child["name"]
    prefill = tree.one("pdserve-prefill", "prefill")
    send, receive, decode = tree.one("pdserve-prefill", "kv.send"), tree.one("pdserve-decode", "kv.receive"), tree.one("pdserve-decode", "decode")
    assert tree.parent(prefill) is router_prefill and tree.parent(send) is prefill and tree.parent(receive) is decode
    assert send["attributes"]["pdserve.kv_bytes"] == receive["attributes"]["pdserve.kv_bytes"] == router_prefill["attributes"]["pdserve.kv_bytes"] > 0
    assert send["attributes"]["pdserve.kv_layers"] == 30 and send["attributes"]["pdserve.transport"] == "tcp"
    assert send["attributes"]["pdserve.transfer_id"] == receive["attributes"]["pdserve.transfer_id"]
    assert decode["attributes"]["pdserve.completion_tokens"] == len(tokens) and decode["attributes"]["pdserve.request_id"] == "clean-1.0"
    assert prefill["attributes"]["pdserve.prompt_tokens"] == prompt_len["clean-1"]
    assert all(s["status"]["status_code"] == "UNSET" for s in tree.spans)


def test_a_retried_prefill_shows_the_failed_attempt(traced):
    results, spans, _ = traced
    tree = Tree(spans, RETRY_TRACE)
    generate = tree.one("pdserve-router", "generate")
    assert generate["attributes"]["pdserve.outcome"] == "ok" and generate["status"]["status_code"] == "UNSET"
    first, second = tree.all("pdserve-router", "prefill")
    assert (first["attributes"]["pdserve.attempt"], second["attributes"]["pdserve.attempt"]) == (1, 2)
    assert first["status"]["status_code"] == "ERROR" and "CHECKSUM" in first["status"]["description"].upper()
    assert second["status"]["status_code"] == "UNSET"
    failed_prefill, ok_prefill = tree.all("pdserve-prefill", "prefill")
    assert tree.parent(failed_prefill) is first and tree.parent(ok_prefill) is second
    assert failed_prefill["status"]["description"].startswith("UNAVAILABLE: kv transfer failed")
    failed_send, ok_send = tree.all("pdserve-prefill", "kv.send")
    assert tree.parent(failed_send) is failed_prefill and failed_send["status"]["status_code"] == "ERROR"
    assert tree.parent(ok_send) is ok_prefill and ok_send["status"]["status_code"] == "UNSET"
    assert len(tree.all("pdserve-decode", "decode")) == 2 == len(tree.all("pdserve-router", "decode.admit"))
    assert results["retry-1"][1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def test_the_openai_api_continues_the_clients_trace_too(traced):
    _, spans, _ = traced
    tree = Tree(spans, HTTP_TRACE)
    generate = tree.one("pdserve-router", "generate")
    http = tree.parent(generate)  # FastAPI's own span of the HTTP request, under the client's span
    assert http["name"] == "POST /v1/completions" and http["parent_id"] == "0x" + CLIENT_SPAN
    assert http["attributes"]["http.response.status_code"] == 200 and generate["attributes"]["pdserve.outcome"] == "ok"
    assert tree.parent(tree.one("pdserve-decode", "decode")) is generate
    assert tree.parent(tree.parent(tree.one("pdserve-prefill", "kv.send"))) is tree.one("pdserve-router", "prefill")
    assert len(tree.spans) == 8
    assert not [s["name"] for s in spans if s["name"].startswith("GET ")]
