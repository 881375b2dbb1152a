"""The router's /metrics on a real cluster (router + prefill + decode processes, workers registered):
request outcomes count exactly what the clients saw, whatever the API; every worker's engine series
is there, moves under load, and leaves with its worker."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from bench.cluster import LocalCluster, stop_process, write_config
from common.sampling import SamplingParams
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.client import generate_via_router
from tests.conftest import wait_for, wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
OUTCOMES = ("ok", "invalid", "overloaded", "error", "cancelled")
ENGINE_GAUGES = ("pdserve_kv_cache_usage_ratio", "pdserve_num_requests_running", "pdserve_num_requests_waiting")
ENGINE_COUNTERS = ("pdserve_num_preemptions_total", "pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total",
                   "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total", "pdserve_engine_step_seconds_count",
                   "pdserve_engine_step_seconds_sum")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("metrics") / "pdserve.yaml", transport="tcp")
    with LocalCluster(config, num_prefill=1, num_decode=1, register=True) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def outcomes(cluster) -> dict[str, float]:
    samples = cluster.metrics()
    return {o: samples[("pdserve_requests_total", (("outcome", o),))] for o in OUTCOMES}


def worker_series(cluster, role: str) -> dict[str, float]:
    """{metric name: value} of the one worker of `role` (its engine series)."""
    found = {name: value for (name, labels), value in cluster.metrics().items() if dict(labels).get("role") == role
             and name in (*ENGINE_GAUGES, *ENGINE_COUNTERS)}
    return found


def test_outcomes_match_what_clients_saw(cluster, client):
    before = outcomes(cluster)
    short = {"model": MODEL, "temperature": 0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}
    # finished normally: HTTP not streaming, HTTP streaming (read to the end), gRPC
    assert client.completions.create(prompt=PROMPT, **short).choices[0].finish_reason == "length"
    assert client.chat.completions.create(messages=CHAT, **short).choices[0].finish_reason == "length"
    for create, kwargs in ((client.completions.create, {"prompt": PROMPT}), (client.chat.completions.create, {"messages": CHAT})):
        with create(stream=True, **kwargs, **short) as stream:
            finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
    reply = generate_via_router(cluster.router.address, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(reply["token_ids"]) == 4
    # refused: a bad field over HTTP (400) and over gRPC (INVALID_ARGUMENT)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    with grpc.insecure_channel(cluster.router.address) as channel, pytest.raises(grpc.RpcError) as refused:
        list(pb_grpc.RouterStub(channel).Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(top_p=2.0)), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # clients that hang up mid-stream, over HTTP and over gRPC
    with client.completions.create(prompt=PROMPT, stream=True, **{**short, "max_tokens": 300}) as stream:
        for seen, _ in enumerate(stream, 1):
            if seen == 2:
                break
    with grpc.insecure_channel(cluster.router.address) as channel:
        long = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True))
        call = pb_grpc.RouterStub(channel).Generate(long, timeout=120)
        assert next(call).chunk.token_ids and next(call).chunk.token_ids
        call.cancel()
    expected = {"ok": 5, "invalid": 2, "overloaded": 0, "error": 0, "cancelled": 2}
    def delta() -> dict:
        return {o: outcomes(cluster)[o] - before[o] for o in OUTCOMES}

    wait_until(lambda: delta() == expected, 30, "the outcomes were counted (the router counts a hang-up when it notices it)", interval=0.2)
    assert delta() == expected
    cluster.assert_no_leaked_blocks()


def test_worker_gauges_move_under_load(cluster, client):
    idle = {role: worker_series(cluster, role) for role in ("prefill", "decode")}
    for role, series in idle.items():
        assert set(series) == {*ENGINE_GAUGES, *ENGINE_COUNTERS}, f"{role}: {sorted(series)}"

    # Long enough to span several heartbeats (the router's worker series are what the last one carried) on a fast CPU.
    long_tokens = 160

    def long_stream(i: int) -> str | None:
        """The stream's finish reason (its chunks may carry several tokens each: text is sent in whole characters)."""
        with client.completions.create(model=MODEL, prompt=f"{PROMPT} # variant {i}", max_tokens=long_tokens, temperature=0.7, seed=i,
                                       stream=True, extra_body={"ignore_eos": True}) as stream:
            return [chunk.choices[0].finish_reason for chunk in stream if chunk.choices][-1]

    scrapes = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_stream, i) for i in range(4)]
        while not all(f.done() for f in futures):
            scrapes.append(worker_series(cluster, "decode"))
            time.sleep(0.5)
        assert [f.result() for f in futures] == ["length"] * 4
    busy = [s for s in scrapes if s["pdserve_num_requests_running"] > 0]
    assert len(busy) >= 2, f"decode never seen running in {len(scrapes)} scrapes"
    assert all(s["pdserve_kv_cache_usage_ratio"] > 0 for s in busy)
    generated = [s["pdserve_generation_tokens_total"] for s in busy]
    assert generated == sorted(generated) and generated[-1] > generated[0], "generation tokens did not move between scrapes"

    def idle_decode() -> dict | None:
        series = worker_series(cluster, "decode")
        return None if series["pdserve_num_requests_running"] else series

    after = wait_for(idle_decode, 15, "the next heartbeats brought the decode worker's idle values", interval=0.3)
    assert after["pdserve_num_requests_running"] == 0 and after["pdserve_kv_cache_usage_ratio"] == 0
    assert after["pdserve_generation_tokens_total"] >= idle["decode"]["pdserve_generation_tokens_total"] + 4 * (long_tokens - 1)
    assert after["pdserve_engine_step_seconds_count"] > idle["decode"]["pdserve_engine_step_seconds_count"]
    prefill = worker_series(cluster, "prefill")
    assert prefill["pdserve_prompt_tokens_total"] > idle["prefill"]["pdserve_prompt_tokens_total"]
    assert prefill["pdserve_prefix_cache_queries_total"] > idle["prefill"]["pdserve_prefix_cache_queries_total"]
    assert prefill["pdserve_generation_tokens_total"] >= idle["prefill"]["pdserve_generation_tokens_total"] + 4
    cluster.assert_no_leaked_blocks()


def test_a_worker_that_leaves_drops_its_series(cluster):
    """Runs last: the prefill worker drains and deregisters; its series go, the decode worker's stay."""
    assert worker_series(cluster, "prefill")
    stop_process(cluster.prefill[0])
    wait_until(lambda: worker_series(cluster, "prefill") == {}, 15, "the stopped prefill worker's series were gone", interval=0.3)
    assert worker_series(cluster, "prefill") == {}
    assert set(worker_series(cluster, "decode")) == {*ENGINE_GAUGES, *ENGINE_COUNTERS}
