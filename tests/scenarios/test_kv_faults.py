"""Faults on the disaggregated path: a tampered KV payload, and a prefill worker killed mid-transfer."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import grpc
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

MAX_NEW = 12


def generate(address: str, prompt_ids: list[int], request_id: str = "") -> tuple[list[int], pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(
            request_id=request_id, token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
        )
        tokens, last = [], None
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=120):
            tokens.extend(response.chunk.token_ids)
            last = response
    return tokens, last


def test_tampered_payload_fails_only_that_request(tmp_path, demo_prompt_ids, hf_greedy):
    config = write_config(tmp_path / "c.yaml", transport="tcp", router={"prefill_retries": 0})
    env = {"prefill0": {"PDSERVE_KV_FAULTS": "corrupt:tamper-*:7"}}
    with LocalCluster(config, process_env=env) as cluster:
        jobs = [("tamper-1", demo_prompt_ids[3])] + [(f"ok-{i}", demo_prompt_ids[i]) for i in (0, 1, 4)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = dict(zip([j[0] for j in jobs], pool.map(lambda j: generate(cluster.router.address, j[1], j[0]), jobs)))
        tokens, last = results["tamper-1"]
        assert tokens == [], "tampered KV must never turn into text"
        assert last.finish_reason == pb.FINISH_REASON_ERROR
        assert "CHECKSUM" in last.error.message.upper(), last.error.message
        for rid, ids in jobs[1:]:
            assert results[rid][0] == hf_greedy(tuple(ids), MAX_NEW)
        # the decode worker keeps serving after the rejection
        assert generate(cluster.router.address, demo_prompt_ids[2])[0] == hf_greedy(tuple(demo_prompt_ids[2]), MAX_NEW)
        cluster.assert_no_leaked_blocks()


def test_prefill_killed_mid_transfer_is_retried_on_another(tmp_path, demo_prompt_ids, hf_greedy):
    config = write_config(tmp_path / "c.yaml", transport="tcp", kv_transfer={"timeout_s": 10})
    env = {"prefill0": {"PDSERVE_TEST_PAUSE_AFTER_LAYER": "10"}}
    with LocalCluster(config, num_prefill=2, process_env=env) as cluster:
        victim = cluster.prefill[0]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(generate, cluster.router.address, demo_prompt_ids[3])

            def paused() -> bool:
                assert not future.done(), future.result()
                return any("test hook: pausing" in line for line in victim.log_lines)

            wait_until(paused, 60, "the prefill worker reaches the pause point", interval=0.05)
            os.killpg(victim.popen.pid, signal.SIGKILL)
            victim.popen.wait(10)
            tokens, last = future.result(timeout=120)
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        assert tokens == hf_greedy(tuple(demo_prompt_ids[3]), MAX_NEW)
        metrics = requests.get(cluster.http_url + "/metrics", timeout=10).text
        retries = [line for line in metrics.splitlines() if line.startswith("pdserve_prefill_retries_total")]
        assert retries and float(retries[0].split()[-1]) >= 1
        cluster.assert_no_leaked_blocks()  # the decode worker freed the aborted transfer's blocks
