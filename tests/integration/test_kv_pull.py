"""Pull instead of recompute (router.kv_pull, kvtransfer/prefix.py), on real processes: two prefill
workers and a decode worker registered with the router, whose KV index knows which prefill worker holds
a prompt's prefix. The prefill worker the router picks pulls that prefix from the other one over
kvtransfer and computes only the rest (== HF); when the holder dies in the middle of the pull, the
prefix is computed and the request still succeeds."""

from __future__ import annotations

import grpc

from bench.cluster import LocalCluster, write_config
from common.block_hash import chain_hashes
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until
from tests.integration.test_disaggregated import generate

MAX_NEW = 8


def pull_cluster(tmp_path, process_env: dict | None = None) -> LocalCluster:
    config = write_config(tmp_path / "pull.yaml", transport="tcp", router={"kv_pull": True, "policy": "round_robin"})
    return LocalCluster(config, num_prefill=2, num_decode=1, register=True, process_env=process_env)


def holder_and_puller(cluster: LocalCluster) -> tuple:
    """(the prefill worker the router picks next but one, the one it picks next): round robin alternates,
    so a warm-up request shows which comes next."""
    before = [cluster.worker_stats(p).prompt_tokens for p in cluster.prefill]
    generate(cluster.router.address, list(range(500, 540)), 1)
    took = [cluster.worker_stats(p).prompt_tokens - b for p, b in zip(cluster.prefill, before)]
    first = cluster.prefill[took.index(max(took))]
    second = next(p for p in cluster.prefill if p is not first)
    return first, second


def warm(worker, prompt: list[int]) -> None:
    """A prefill with no destination: the worker's prefix cache holds the prompt (the decode worker does not)."""
    with grpc.insecure_channel(worker.address) as channel:
        pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(request_id="warm", token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1)), timeout=120)


def wait_indexed(cluster: LocalCluster, holder, prompt: list[int], timeout: float = 30.0) -> None:
    """Until the router's index lists every full block of `prompt` under `holder` (its KV events arrived)."""
    wanted = set(chain_hashes(prompt, 16))
    with grpc.insecure_channel(cluster.router.ready["internal_address"]) as channel:
        def indexed() -> bool:
            reply = pb_grpc.RegistryStub(channel).KVIndex(pb.KVIndexRequest(include_hashes=True), timeout=10)
            return wanted <= {h for w in reply.workers if w.worker_id == holder.ready["worker_id"] for h in w.block_hashes}

        wait_until(indexed, timeout, "the holder's blocks reached the router's index", interval=0.2)


def test_a_prefill_worker_pulls_a_prefix_the_other_one_holds(tmp_path, demo_prompt_ids, hf_greedy):
    context = (demo_prompt_ids[0] * 6)[:160]  # 10 blocks
    prompt = context + demo_prompt_ids[1]
    with pull_cluster(tmp_path) as cluster:
        _, puller = holder_and_puller(cluster)  # the next pick is the holder: warm it, then the puller gets the request
        holder = next(p for p in cluster.prefill if p is not puller)
        warm(holder, context)
        wait_indexed(cluster, holder, context)
        puller_before, holder_before = cluster.worker_stats(puller), cluster.worker_stats(holder)
        tokens, last = generate(cluster.router.address, prompt, MAX_NEW)
        puller_after, holder_after = cluster.worker_stats(puller), cluster.worker_stats(holder)
        assert tokens == hf_greedy(tuple(prompt), MAX_NEW)
        computed = puller_after.prompt_tokens - puller_before.prompt_tokens
        assert last.usage.cached_prompt_tokens == len(context), "the pulled prefix is what the puller did not compute"
        assert computed == len(prompt) - len(context), f"the puller computed {computed} of {len(prompt)} tokens"
        assert (puller_after.kv_pulls - puller_before.kv_pulls, puller_after.kv_pulled_tokens - puller_before.kv_pulled_tokens) == (1, len(context))
        assert puller_after.kv_pull_failures == puller_before.kv_pull_failures and puller_after.kv_pull_seconds > puller_before.kv_pull_seconds
        pulled_bytes = puller_after.kv_bytes_received - puller_before.kv_bytes_received
        assert pulled_bytes == holder_after.kv_bytes_sent - holder_before.kv_bytes_sent > 0, "the pulled bytes count on both sides"
        cluster.assert_no_leaked_blocks()


def test_a_holder_that_dies_mid_pull_costs_a_recompute_not_the_request(tmp_path, demo_prompt_ids, hf_greedy):
    context = (demo_prompt_ids[2] * 6)[:160]
    prompt = context + demo_prompt_ids[3]
    stall = {"PDSERVE_TEST_FAULT_POINT": "source.before_send:0:*:stall"}
    with pull_cluster(tmp_path, process_env={"prefill0": stall, "prefill1": stall}) as cluster:
        _, puller = holder_and_puller(cluster)
        holder = next(p for p in cluster.prefill if p is not puller)
        warm(holder, context)
        wait_indexed(cluster, holder, context)
        with grpc.insecure_channel(cluster.router.address) as channel:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
            responses = pb_grpc.RouterStub(channel).Generate(request, timeout=300)
            wait_until(lambda: any("test hook: pausing at source.before_send" in line for line in holder.log_lines), 120,
                       "the holder reached the pull")
            holder.popen.kill()
            messages = list(responses)
        tokens = [t for m in messages for t in m.chunk.token_ids]
        assert messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), messages[-1]
        assert tokens == hf_greedy(tuple(prompt), MAX_NEW)
        assert any("computing them" in line for line in puller.log_lines)
        stats = cluster.worker_stats(puller)
        assert (stats.kv_pulls, stats.kv_pull_failures) == (0, 1), "a failed pull counts as one, not as a pull"
        cluster.assert_no_leaked_blocks()
