"""Router behaviour with real workers: registry + health, drain, cancellation, decode migration, CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import REPO, LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until


def _request(ids, max_tokens, ignore_eos=False, request_id=""):
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
    )


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("resilience") / "c.yaml", transport="tcp")
    with LocalCluster(config, num_prefill=1, num_decode=2, register=True) as c:
        yield c


def test_registered_workers_make_router_serving(cluster):
    assert _health(cluster.router.address) == health_pb2.HealthCheckResponse.SERVING


def test_cancelled_streams_free_every_block(cluster, demo_prompt_ids):
    async def run() -> int:
        cancelled = 0
        async with grpc.aio.insecure_channel(cluster.router.address) as channel:
            stub = pb_grpc.RouterStub(channel)

            async def one(i: int) -> bool:
                call = stub.Generate(_request(demo_prompt_ids[i % 8], 200, ignore_eos=True))
                got = 0
                async for response in call:
                    got += len(response.chunk.token_ids)
                    if got >= 2:
                        call.cancel()
                        return True
                return False

            import asyncio

            results = await asyncio.gather(*(one(i) for i in range(16)), return_exceptions=True)
            cancelled = sum(1 for r in results if r is True)
        return cancelled

    import asyncio

    assert asyncio.run(run()) == 16
    cluster.assert_no_leaked_blocks()


def test_decode_worker_killed_mid_stream_migrates(cluster, demo_prompt_ids, hf_greedy):
    max_new = 48
    prompts = [demo_prompt_ids[i] for i in (1, 3, 5, 6)]
    results: dict[int, list[int]] = {}
    finish: dict[int, int] = {}
    started = threading.Barrier(len(prompts) + 1)

    def stream(i: int, ids: list[int]) -> None:
        with grpc.insecure_channel(cluster.router.address) as channel:
            tokens: list[int] = []
            first = True
            for response in pb_grpc.RouterStub(channel).Generate(_request(ids, max_new), timeout=180):
                tokens.extend(response.chunk.token_ids)
                if first and tokens:
                    first = False
                    started.wait(60)
                finish[i] = response.finish_reason
            results[i] = tokens

    threads = [threading.Thread(target=stream, args=(i, ids)) for i, ids in enumerate(prompts)]
    for t in threads:
        t.start()
    started.wait(120)  # every request has streamed tokens: now lose one decode worker
    victim = cluster.decode[0]
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    for t in threads:
        t.join(180)
    for i, ids in enumerate(prompts):
        assert finish.get(i) in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), (i, finish.get(i))
        assert results[i] == hf_greedy(tuple(ids), max_new), f"request {i} diverged after migration"
    cluster.assert_no_leaked_blocks()


def test_cli_generate_through_router(cluster, demo_model, hf_greedy):
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "What is the capital of France?", "--router", cluster.router.address,
         "--max-tokens", "16", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    result = json.loads(out.stdout)
    from common.tokenization import encode_prompt

    assert result["prompt_token_ids"] == encode_prompt(demo_model.tokenizer, "What is the capital of France?")
    assert result["token_ids"] == hf_greedy(tuple(result["prompt_token_ids"]), 16)
    assert result["text"] == demo_model.tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_router_drain_reports_not_serving_and_finishes_in_flight(cluster, demo_prompt_ids):
    """Runs last in this module: it stops the router."""
    outcome: dict = {}
    streaming = threading.Event()

    def long_request() -> None:
        with grpc.insecure_channel(cluster.router.address) as channel:
            tokens = []
            for response in pb_grpc.RouterStub(channel).Generate(_request(demo_prompt_ids[0], 120, ignore_eos=True), timeout=180):
                tokens.extend(response.chunk.token_ids)
                streaming.set()
                outcome["finish"] = response.finish_reason
            outcome["tokens"] = len(tokens)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert streaming.wait(120), "the long request never streamed a token"
    cluster.router.popen.send_signal(signal.SIGTERM)
    answers: list[bool] = []  # per poll: did the draining router say NOT_SERVING

    def settled() -> bool:  # it said so, or it is gone, or the request is done
        try:
            answers.append(_health(cluster.router.address) == health_pb2.HealthCheckResponse.NOT_SERVING)
        except grpc.RpcError:
            return True
        return answers[-1] or not thread.is_alive()

    wait_until(settled, 30, "the draining router answers NOT_SERVING")
    thread.join(120)
    assert any(answers)
    assert outcome.get("finish") == pb.FINISH_REASON_LENGTH and outcome.get("tokens") == 120
    assert cluster.router.popen.wait(30) == 0
