"""Tensor-parallel workers behind the router, as real processes over UCX: every prefill rank sends
its KV heads straight to the decode ranks that own them, for prefill TP != decode TP. Greedy output
== HF `generate` on the unsplit model; the prefill worker sent every head of every prompt's tokens the
decode worker did not hold exactly once; no block leaked on any worker."""

from __future__ import annotations

import concurrent.futures

import grpc
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.cluster import LocalCluster, write_config
from engine.testing.tiny_models import build_tiny_model
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import hf_generate, wait_for
from tests.integration.test_disaggregated import generate

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
PROMPTS = [list(range(1, 9)), list(range(100, 160)), [7, 8, 9] * 12]


def run_cluster(tmp_path, model: str, prefill_tp: int, decode_tp: int, prompts: list[list[int]]) -> tuple[list, int, list[list[int]]]:
    """Greedy tokens per prompt, the KV bytes the prefill worker sent, and what of each prompt moved (the
    tokens past those the decode worker held already: prompts sharing a prefix may find it there)."""
    config = write_config(
        tmp_path / "tp.yaml", transport="ucx",
        engine={"model": model},
        pools={"prefill": {"tensor_parallel_size": prefill_tp}, "decode": {"tensor_parallel_size": decode_tp}},
    )
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda ids: generate(cluster.router.address, ids, MAX_NEW), prompts))
        sent = cluster.worker_stats(cluster.prefill[0]).kv_bytes_sent
        cluster.assert_no_leaked_blocks()
    for _, last in results:
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
    moved = [p[last.timings.kv_blocks_reused * 16:] for p, (_, last) in zip(prompts, results)]
    return [tokens for tokens, _ in results], sent, moved


def kv_bytes(model, prompts: list[list[int]]) -> int:
    """Every head of every prompt, once: K and V of each layer, fp32."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return sum(2 * c.num_hidden_layers * len(p) * c.num_key_value_heads * head_dim * 4 for p in prompts)


@pytest.fixture(scope="module")
def tiny():
    path = str(build_tiny_model(arch="qwen2"))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_prefill_and_decode_with_different_tp_match_hf(tmp_path, tiny, prefill_tp, decode_tp):
    path, reference = tiny
    got, sent, moved = run_cluster(tmp_path, path, prefill_tp, decode_tp, PROMPTS)
    assert got == [hf_generate(reference, p, MAX_NEW) for p in PROMPTS]
    assert sent == kv_bytes(reference, moved)


def test_demo_model_prefill_tp3_to_decode_tp1_matches_hf(tmp_path, demo_model, demo_prompt_ids, hf_greedy):
    prompts = demo_prompt_ids[:3]
    got, sent, moved = run_cluster(tmp_path, "smollm2-135m", 3, 1, prompts)
    assert got == [hf_greedy(tuple(p), MAX_NEW) for p in prompts]
    assert sent == kv_bytes(demo_model.model, moved)


def test_losing_one_rank_of_a_decode_worker_migrates_its_requests(tmp_path, tiny):
    """SIGKILL a follower rank of the decode worker serving a request mid-stream: that worker gives
    itself up at once (exit 70), the router moves the request to the other decode worker, which
    finishes it == HF; no block leaked on the workers left."""
    path, reference = tiny
    config = write_config(tmp_path / "tp.yaml", transport="ucx", engine={"model": path},
                          pools={"decode": {"tensor_parallel_size": 2}})
    hook = {"PDSERVE_TEST_FAULT_POINT": "decode.after_tokens:6:rankloss-*.0"}  # stalls D's gRPC loop, not its engine
    with LocalCluster(config, num_prefill=1, num_decode=2, process_env={"decode0": hook, "decode1": hook}) as cluster:
        prompt = PROMPTS[1]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(generate_with_id, cluster.router.address, "rankloss-1", prompt, 40)
            stalled = wait_for_stall(cluster.decode)
            follower = follower_rank(stalled)
            follower.kill()
            assert stalled.popen.wait(30) == 70, "the worker must give itself up when a rank dies"
            tokens, last = pending.result(timeout=120)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH, last
        assert tokens == hf_generate(reference, prompt, 40)
        survivor = next(d for d in cluster.decode if d is not stalled)
        assert cluster.worker_stats(survivor).running_requests == 0
        cluster.assert_no_leaked_blocks()


def generate_with_id(address: str, request_id: str, prompt: list[int], max_tokens: int):
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        tokens, last = [], None
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=120):
            tokens.extend(response.chunk.token_ids)
            last = response
    return tokens, last


def wait_for_stall(workers, timeout: float = 60.0):
    """The decode worker that reached the test hook."""
    def stalled():
        return next((w for w in workers if any("test hook: pausing at decode.after_tokens" in line for line in w.log_lines)), None)

    return wait_for(stalled, timeout, "a decode worker reached the hook")


def follower_rank(worker) -> psutil.Process:
    """The decode worker's rank-1 process (a spawned child; not the resource tracker)."""
    children = psutil.Process(worker.popen.pid).children(recursive=True)
    ranks = [c for c in children if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
    assert len(ranks) == 1, [c.cmdline() for c in children]
    return ranks[0]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2)])  # rank to rank into a split decode pool: the case pieces exist for
def test_a_conversation_moves_only_each_turns_new_tokens_rank_to_rank(tmp_path, tiny, prefill_tp, decode_tp):
    """Three turns, each the last turn's prompt and answer plus a new message: the tensor-parallel decode
    worker's ranks hold the earlier turns, so every rank receives only the KV of its heads past them
    (at most the new tokens and one block); greedy == HF on every turn."""
    path, reference = tiny
    config = write_config(tmp_path / "tp.yaml", transport="ucx", engine={"model": path},
                          pools={"prefill": {"tensor_parallel_size": prefill_tp}, "decode": {"tensor_parallel_size": decode_tp}})
    per_token = kv_bytes(reference, [[0]])
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        prompt, seen = PROMPTS[1], []
        for turn in range(3):
            before = cluster.worker_stats(cluster.decode[0]).kv_bytes_received
            tokens, last = generate(cluster.router.address, prompt, MAX_NEW)
            moved = cluster.worker_stats(cluster.decode[0]).kv_bytes_received - before
            assert tokens == hf_generate(reference, prompt, MAX_NEW), f"turn {turn}"
            held = last.timings.kv_blocks_reused * 16
            assert moved == (len(prompt) - held) * per_token
            if turn:
                assert held > 0 and len(prompt) - held <= len(prompt) - len(seen) + 16, f"turn {turn}: {held} of {len(prompt)} held"
            seen = prompt + tokens
            prompt = seen + list(range(300 + 10 * turn, 310 + 10 * turn))
        cluster.assert_no_leaked_blocks()
