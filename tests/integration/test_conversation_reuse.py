"""A multi-turn conversation through router, prefill and decode worker processes: the decode worker
holds the conversation's earlier turns, so each turn moves only the KV of what is new (at most its new
tokens and one block), `cached_tokens` reports the prefill worker's reuse on both APIs, and every turn's
greedy tokens equal HF's; with the KV streamed layer by layer and sent after the prompt. Under kv_aware with a
local-prefill threshold the decode worker prefills the later turns itself: only their new tokens, nothing moved."""

from __future__ import annotations

import grpc
import pytest
import requests

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from tests.conftest import wait_until

MAX_NEW = 24
BLOCK = 16
USER_TURNS = [
    "Name three colors of the rainbow.",
    "Which of them is the warmest?",
    "Write one sentence about it.",
    "Now say the same about the sea.",
    "Give the sea a short name.",
    "Thank you. Say goodbye.",
]


@pytest.fixture(scope="module", params=[True, False], ids=["layerwise", "after-prompt"])
def cluster(request, tmp_path_factory):
    """Both ways the prefill worker hands the KV over: layer by layer (GPU default), after the prompt (CPU default)."""
    config = write_config(tmp_path_factory.mktemp("conversation") / "pdserve.yaml", transport="ucx",
                          engine={"block_size": BLOCK}, router={"local_prefill_threshold": 0}, kv_transfer={"layerwise": request.param})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


def chat_turn(address: str, messages: list[dict]) -> tuple[list[int], list[int], pb.GenerateResponse]:
    """(prompt ids as the model saw them, generated ids, the last message) of one greedy chat request."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
    request = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    prompt, tokens, last = [], [], None
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=300):
            prompt = prompt or list(response.prompt_token_ids)
            tokens.extend(response.chunk.token_ids)
            last = response
    return prompt, tokens, last


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_each_turn_moves_only_its_new_tokens_and_reports_cached_tokens(cluster, demo_model, hf_greedy):
    messages: list[dict] = []
    seen: list[int] = []  # the previous turn's prompt and answer: what the decode worker computed
    bytes_per_token = None
    for turn, text in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": text})
        before_d = cluster.worker_stats(cluster.decode[0]).kv_bytes_received
        before_p = cluster.worker_stats(cluster.prefill[0])
        prompt, tokens, last = chat_turn(cluster.router.address, messages)
        after_d = cluster.worker_stats(cluster.decode[0]).kv_bytes_received
        after_p = cluster.worker_stats(cluster.prefill[0])
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
        assert tokens == hf_greedy(tuple(prompt), MAX_NEW), f"turn {turn}"

        moved_bytes = after_d - before_d
        new_tokens = len(prompt) - common_prefix(prompt, seen)
        timings = last.timings
        if turn == 0:
            assert timings.kv_blocks_reused == 0
            bytes_per_token = moved_bytes / len(prompt)
        else:
            assert timings.kv_blocks_reused > 0, f"turn {turn}: the decode worker held none of the conversation"
            assert moved_bytes <= (new_tokens + BLOCK) * bytes_per_token, (
                f"turn {turn}: {moved_bytes} B moved for {new_tokens} new tokens of {len(prompt)}")
        moved_tokens = len(prompt) - timings.kv_blocks_reused * BLOCK
        assert moved_bytes == moved_tokens * bytes_per_token
        assert timings.kv_blocks_moved == -(-moved_tokens // BLOCK)

        hits = after_p.prefix_cache_hit_tokens - before_p.prefix_cache_hit_tokens
        assert last.usage.cached_prompt_tokens == hits, f"turn {turn}: cached_tokens is what the prefill worker did not compute"
        assert (hits > 0) == (turn > 0)

        seen = prompt + tokens
        messages.append({"role": "assistant", "content": demo_model.tokenizer.decode(tokens, skip_special_tokens=True)})

    body = requests.post(cluster.http_url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m", "messages": messages[:-1], "max_tokens": MAX_NEW, "temperature": 0}).json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the prefill worker computed this very prompt in the last turn: every full block but the last token's
    assert cached == (body["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    cluster.assert_no_leaked_blocks()


LOCAL_THRESHOLD = 64
OPENING = ("Here is a long note to start our chat. The harbor town wakes before dawn; fishing boats leave one by one, "
           "gulls follow them out past the lighthouse, and the bakery on the corner opens its doors to the smell of bread. "
           "By noon the market is loud with traders, and by evening the whole town gathers on the pier to watch the sun go "
           "down. Name three colors of the rainbow.")


@pytest.fixture(scope="module")
def kv_aware_cluster(tmp_path_factory):
    """kv_aware with a local-prefill threshold: the decode worker prefills a turn itself when it holds all but
    at most LOCAL_THRESHOLD of the prompt's tokens (the workers register, so their KV events feed the index)."""
    config = write_config(tmp_path_factory.mktemp("local_turns") / "pdserve.yaml", transport="tcp", engine={"block_size": BLOCK},
                          router={"policy": "kv_aware", "local_prefill_threshold": LOCAL_THRESHOLD, "shadow_check_fraction": 0.0})
    with LocalCluster(config, num_prefill=1, num_decode=1, register=True) as c:
        yield c


def indexed_blocks(cluster: LocalCluster, worker_id: str) -> float:
    return sum(v for (name, labels), v in cluster.metrics().items()
               if name == "pdserve_kv_index_blocks" and dict(labels).get("worker") == worker_id)


def test_under_kv_aware_the_decode_worker_prefills_the_new_turns_of_its_conversation(kv_aware_cluster, demo_model, hf_greedy):
    cluster = kv_aware_cluster
    decode_id = cluster.worker_stats(cluster.decode[0]).worker_id
    messages = [{"role": "user", "content": OPENING}]
    for turn, text in enumerate(USER_TURNS[:3]):  # one disaggregated turn, then two on the decode worker
        if turn:
            messages.append({"role": "user", "content": text})
        before_d, before_p = cluster.worker_stats(cluster.decode[0]), cluster.worker_stats(cluster.prefill[0])
        prompt, tokens, last = chat_turn(cluster.router.address, messages)
        after_d, after_p = cluster.worker_stats(cluster.decode[0]), cluster.worker_stats(cluster.prefill[0])
        assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
        assert tokens == hf_greedy(tuple(prompt), MAX_NEW), f"turn {turn}"
        computed_d = after_d.prompt_tokens - before_d.prompt_tokens
        hits_d = after_d.prefix_cache_hit_tokens - before_d.prefix_cache_hit_tokens
        if turn == 0:  # longer than the threshold and held nowhere: disaggregated
            assert not last.timings.local_prefill and len(prompt) > LOCAL_THRESHOLD
            assert after_p.prompt_tokens - before_p.prompt_tokens == len(prompt)
            assert after_d.kv_bytes_received > before_d.kv_bytes_received
        else:  # the decode worker holds the conversation: it computes only the new turn, nothing moves
            assert last.timings.local_prefill, f"turn {turn}: {len(prompt)} tokens, {hits_d} held by the decode worker"
            assert after_p.prompt_tokens == before_p.prompt_tokens and after_d.kv_bytes_received == before_d.kv_bytes_received
            assert 0 < computed_d <= LOCAL_THRESHOLD and computed_d + hits_d == len(prompt)
            assert last.usage.cached_prompt_tokens == hits_d, f"turn {turn}: cached_tokens is what the decode worker did not compute"
        full_blocks = (len(prompt) - 1) // BLOCK
        wait_until(lambda n=full_blocks: indexed_blocks(cluster, decode_id) >= n, 15, f"the index holds turn {turn}'s blocks on {decode_id}")
        messages.append({"role": "assistant", "content": demo_model.tokenizer.decode(tokens, skip_special_tokens=True)})
    cluster.assert_no_leaked_blocks()
