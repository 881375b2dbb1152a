"""Router, prefill worker and decode worker as three real processes; greedy output equals HF. The canary
(router/shadow.py) recomputes every disaggregated greedy request of the module colocated and finds no
divergence."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

MAX_NEW = 16


def generate(address: str, prompt_ids: list[int], max_tokens: int = MAX_NEW) -> tuple[list[int], pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
        tokens, last = [], None
        for response in stub.Generate(request, timeout=300):
            tokens.extend(response.chunk.token_ids)
            last = response
    return tokens, last


@pytest.fixture(scope="module", params=["ucx", "tcp"])
def cluster(request, tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp(request.param) / "pdserve.yaml", transport=request.param,
                          router={"shadow_check_fraction": 1.0})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


def test_greedy_through_router_matches_hf(cluster, demo_prompt_ids, hf_greedy):
    prompts = demo_prompt_ids[:8]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: generate(cluster.router.address, ids), prompts))
    for ids, (tokens, last) in zip(prompts, results):
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
        assert tokens == hf_greedy(tuple(ids), MAX_NEW)
    decode_stats = cluster.worker_stats(cluster.decode[0])
    prefill_stats = cluster.worker_stats(cluster.prefill[0])
    assert decode_stats.kv_bytes_received > 0 and prefill_stats.kv_bytes_sent > 0
    cluster.assert_no_leaked_blocks()


def test_decode_stream_sends_the_last_tokens_with_the_finish(cluster, demo_prompt_ids, hf_greedy):
    """A decode worker's last tokens travel in its finish message: a worker lost after streaming a stop
    token but before its finish would otherwise have the migrated request decode past the stop."""
    prompt = demo_prompt_ids[1]
    with grpc.insecure_channel(cluster.decode[0].address) as channel:
        request = pb.DecodeRequest(request_id="last-tokens", token_ids=prompt, local_prefill=True,
                                   sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        messages = list(pb_grpc.DecodeWorkerStub(channel).Decode(request, timeout=120))
    assert [m.WhichOneof("event") for m in messages] == ["chunk"] * (len(messages) - 1) + ["finished"]
    finished = messages[-1].finished
    assert finished.chunk.token_ids, "the finishing step's tokens come with the finish"
    tokens = [t for m in messages[:-1] for t in m.chunk.token_ids] + list(finished.chunk.token_ids)
    assert tokens == hf_greedy(tuple(prompt), MAX_NEW)
    assert finished.usage.completion_tokens == len(tokens)
    cluster.assert_no_leaked_blocks()


def test_metrics_expose_kv_bytes_and_request_stages(cluster, demo_prompt_ids):
    generate(cluster.router.address, demo_prompt_ids[0], max_tokens=4)
    text = requests.get(cluster.http_url + "/metrics", timeout=10).text
    transport = cluster.config_path.parent.name.rstrip("0123456789")
    kv_lines = [line for line in text.splitlines() if line.startswith("pdserve_kv_transfer_bytes_total{")]
    assert kv_lines and f'transport="{transport}"' in kv_lines[0] and float(kv_lines[0].split()[-1]) > 0
    for stage in ("prefill_compute", "kv_transfer", "decode_admission"):
        assert f'pdserve_request_stage_seconds_count{{stage="{stage}"}}' in text
    assert "pdserve_ttft_seconds_count" in text
    cluster.assert_no_leaked_blocks()


def test_canary_found_no_divergence(cluster):
    """Every greedy request above was recomputed colocated (shadow_check_fraction 1) and agreed with its
    disaggregated output. Runs after them: waits for the background checks to end first."""
    idle_polls = [0]

    def quiet() -> bool:  # the decode worker idle at three polls in a row: no check is still running
        stats = cluster.worker_stats(cluster.decode[0])
        idle_polls[0] = idle_polls[0] + 1 if stats.running_requests == stats.queued_requests == 0 else 0
        return idle_polls[0] >= 3

    wait_until(quiet, 120, "no shadow check is still running", interval=0.5)
    text = requests.get(cluster.http_url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("pdserve_")}
    assert values.get('pdserve_shadow_checks_total{outcome="agreed"}', 0) >= 1
    assert values.get('pdserve_shadow_checks_total{outcome="diverged"}', 0) == 0
    assert values["pdserve_disagg_divergence_total"] == 0
    cluster.assert_no_leaked_blocks()


def test_decode_worker_drains_on_sigterm(cluster, demo_prompt_ids):
    """Runs last in this module: SIGTERM the decode worker while a request is in flight."""
    import signal
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    outcome: dict = {}

    def long_request() -> None:
        with grpc.insecure_channel(cluster.router.address) as channel:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=demo_prompt_ids[0]), sampling=pb.SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            )
            responses = list(pb_grpc.RouterStub(channel).Generate(request, timeout=120))
        outcome["tokens"] = sum(len(r.chunk.token_ids) for r in responses)
        outcome["finish"] = responses[-1].finish_reason

    thread = threading.Thread(target=long_request)
    thread.start()
    decode = cluster.decode[0]
    wait_until(lambda: cluster.worker_stats(decode).running_requests > 0, 60, "the decode worker runs the request", interval=0.05)
    decode.popen.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(decode.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    thread.join(120)
    assert outcome == {"tokens": 100, "finish": pb.FINISH_REASON_LENGTH}
    assert decode.popen.wait(30) == 0
