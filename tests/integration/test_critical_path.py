"""The per-request critical path on real processes (router, prefill and decode workers), and the verdict.

A request's stages are measured where they happen (router, P, D) and must add up to its end-to-end
latency; the router's `other` remainder (RPC, network) stays within 5 % of it, on the disaggregated
and on the local-prefill path. Then two staged workloads against the same cluster, each judged over
its own window: short prompts one at a time (the split's transfer and extra hop are pure cost:
"does not pay"), and long prompts arriving while long answers decode ("pays").
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import grpc
import pytest
import requests

from bench.cluster import LocalCluster, write_config
from deploy.commands import format_critical_path
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.critical_path import MEASURED, STAGES

LOCAL_THRESHOLD = 16


def generate(address: str, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> tuple[list[int], pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling, skip_detokenize=True)
        tokens, last = [], None
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=300):
            tokens.extend(response.chunk.token_ids)
            last = response
    return tokens, last


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("cpath") / "pdserve.yaml", engine={"dtype": "float32"},
                          router={"local_prefill_threshold": LOCAL_THRESHOLD})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        # One request down each path first: a fresh cluster's first request also pays what no stage owns and
        # only it pays (gRPC channels and UCX endpoints opened, modules imported on first use), and the stages
        # are checked on requests that pay only their own work.
        for warm_up in (list(range(100, 100 + 2 * LOCAL_THRESHOLD)), list(range(100, 105))):
            generate(c.router.address, warm_up, 2, ignore_eos=True)
        yield c


def breakdown(cluster: LocalCluster, since: float) -> dict:
    window = time.monotonic() - since + 0.5
    return requests.get(cluster.http_url + "/v1/pdserve/critical_path", params={"window_s": window}, timeout=10).json()


def test_stages_add_up_to_e2e(cluster, demo_prompt_ids, hf_greedy):
    remote = [ids for ids in demo_prompt_ids[:3]]
    local = [ids[:10] for ids in demo_prompt_ids[3:5]]
    prompts = remote + local
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda ids: generate(cluster.router.address, ids, 12), prompts))
    for ids, (tokens, last) in zip(prompts, results):
        assert tokens == hf_greedy(tuple(ids), 12)
        t = last.timings
        stages = {s: getattr(t, f"{s}_s") for s in STAGES}
        assert t.local_prefill == (len(ids) <= LOCAL_THRESHOLD)
        assert all(stages[s] >= 0 for s in MEASURED), stages
        assert stages["prefill_compute"] > 0 and stages["decode"] > 0 and t.e2e_s > 0
        assert (stages["kv_transfer"] > 0) == (not t.local_prefill) and (stages["first_token"] > 0) == (not t.local_prefill)
        assert abs(sum(stages.values()) - t.e2e_s) < 1e-6
        # what the processes measured covers e2e but for the router's remainder: within 5 %
        assert abs(stages["other"]) <= 0.05 * t.e2e_s, stages
        assert t.ttft_s <= t.e2e_s and abs(t.decode_s + t.ttft_s - t.e2e_s) < 1e-6
    samples = cluster.metrics()
    for stage in STAGES:
        assert samples[("pdserve_request_stage_seconds_count", (("stage", stage),))] >= len(prompts)
    cluster.assert_no_leaked_blocks()


def test_verdict_short_prompts_does_not_pay(cluster, demo_prompt_ids):
    since = time.monotonic()
    for i in range(12):  # one at a time: nothing for a colocated worker to interfere with
        _, last = generate(cluster.router.address, demo_prompt_ids[i % 6], 2, ignore_eos=True)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
    report = breakdown(cluster, since)
    verdict = report["verdict"]
    print("\n".join(format_critical_path(report)))
    assert report["requests"] == 12 and verdict["requests"] == 12
    assert verdict["verdict"] == "does not pay", verdict
    assert verdict["deciding_stage"] in ("kv_transfer", "first_token", "decode_admission", "other")
    lines = format_critical_path(report)
    assert "DOES NOT PAY" in lines[-1] and verdict["deciding_stage"] in lines[-1]
    cluster.assert_no_leaked_blocks()


def test_verdict_long_prompts_against_decodes_pays(cluster, demo_prompt_ids):
    long_prompt = demo_prompt_ids[6] * 3  # ~470 tokens
    stop = threading.Event()

    def decoder(ids: list[int]) -> int:
        count = 0
        while not stop.is_set():
            assert generate(cluster.router.address, ids, 48, ignore_eos=True)[1].finish_reason == pb.FINISH_REASON_LENGTH
            count += 1
        return count

    since = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decodes = [pool.submit(decoder, ids) for ids in demo_prompt_ids[:2]]
        for i in range(6):  # long prompts, short answers, landing on the streams above
            assert generate(cluster.router.address, long_prompt[i:], 2, ignore_eos=True)[1].finish_reason == pb.FINISH_REASON_LENGTH
        stop.set()
        assert all(d.result() >= 1 for d in decodes)
    report = breakdown(cluster, since)
    verdict = report["verdict"]
    print("\n".join(format_critical_path(report)))
    assert verdict["verdict"] == "pays", verdict
    assert verdict["deciding_stage"] in ("decode", "prefill_compute")
    assert "PAYS" in format_critical_path(report)[-1]
    cluster.assert_no_leaked_blocks()


def test_openai_critical_path_extension(cluster):
    url = cluster.http_url + "/v1/completions"
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    plain = requests.post(url, json=body, timeout=120).json()
    assert "critical_path" not in plain and plain["choices"][0]["finish_reason"] in ("stop", "length")
    answer = requests.post(url, json={**body, "critical_path": True}, timeout=120).json()
    path = answer["critical_path"]
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
    assert abs(sum(path[f"{s}_s"] for s in STAGES) - path["e2e_s"]) < 1e-6 and path["prefill_compute_s"] > 0
    assert path["local_prefill"] is True  # 5 prompt tokens, under the threshold
    with requests.post(url, json={**body, "critical_path": True, "stream": True}, timeout=120, stream=True) as response:
        events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert ["critical_path" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["critical_path"]["e2e_s"] >= chunks[-1]["critical_path"]["decode_s"] > 0
    cluster.assert_no_leaked_blocks()
