"""`n` > 1 through a real cluster (router + prefill + decode processes): the prompt is prefilled once
on P, its KV sent to D once, and D forks the n sequences. Greedy: n copies of HF's output, over gRPC
(streams demultiplexed by `chunk.index`) and the official `openai` client (n choices, streaming and
not); seeded sampling is reproducible; a short prompt D prefills itself works the same. No KV block
leaks."""

from __future__ import annotations

import grpc
import openai
import pytest

from bench.cluster import LocalCluster, write_config
from common.tokenization import encode_chat
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = "smollm2-135m"
MAX_NEW = 8
LOCAL_PREFILL_TOKENS = 6
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("nseq") / "pdserve.yaml", transport="tcp",
                          router={"local_prefill_threshold": LOCAL_PREFILL_TOKENS})
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


def generate_n(address: str, prompt_ids: list[int], n: int, max_tokens: int = MAX_NEW,
               **sampling) -> tuple[dict[int, list[int]], dict[int, pb.GenerateResponse]]:
    """Each sequence's tokens and last message, by index."""
    tokens: dict[int, list[int]] = {}
    finals: dict[int, pb.GenerateResponse] = {}
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=pb.SamplingParams(max_tokens=max_tokens, n=n, **sampling))
        for response in pb_grpc.RouterStub(channel).Generate(request, timeout=300):
            index = response.chunk.index
            assert index not in finals, f"sequence {index} streamed after its last message"
            tokens.setdefault(index, []).extend(response.chunk.token_ids)
            if response.finish_reason:
                assert response.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), response
                finals[index] = response
    assert sorted(finals) == list(range(n))
    return tokens, finals


def test_grpc_greedy_n3_is_three_copies_of_hf_with_one_kv_transfer(cluster, demo_prompt_ids, hf_greedy):
    prompt = demo_prompt_ids[0]
    p_before, d_before = cluster.worker_stats(cluster.prefill[0]), cluster.worker_stats(cluster.decode[0])
    tokens, finals = generate_n(cluster.router.address, prompt, 3, temperature=0.0)
    expected = hf_greedy(tuple(prompt), MAX_NEW)
    assert [tokens[i] for i in range(3)] == [expected] * 3
    assert [finals[i].usage.completion_tokens for i in range(3)] == [len(expected)] * 3
    p_after, d_after = cluster.worker_stats(cluster.prefill[0]), cluster.worker_stats(cluster.decode[0])
    assert p_after.prompt_tokens - p_before.prompt_tokens == len(prompt)  # P ran the prompt once
    sent = p_after.kv_bytes_sent - p_before.kv_bytes_sent
    assert sent > 0 and d_after.kv_bytes_received - d_before.kv_bytes_received == sent  # one transfer, received once
    cluster.assert_no_leaked_blocks()


def test_grpc_seeded_n3_is_reproducible(cluster, demo_prompt_ids):
    prompt = demo_prompt_ids[2]
    runs = [generate_n(cluster.router.address, prompt, 3, temperature=1.0, seed=11, ignore_eos=True)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(runs[0][i]) for i in range(3)}) > 1, "every sequence drew the same tokens"
    cluster.assert_no_leaked_blocks()


def test_local_prefill_n2_matches_hf(cluster, demo_prompt_ids, hf_greedy):
    prompt = demo_prompt_ids[0][:LOCAL_PREFILL_TOKENS]
    tokens, _ = generate_n(cluster.router.address, prompt, 2, temperature=0.0)
    assert [tokens[0], tokens[1]] == [hf_greedy(tuple(prompt), MAX_NEW)] * 2
    cluster.assert_no_leaked_blocks()


def test_openai_client_n3_completions_and_streamed_chat(cluster, demo_model, demo_prompt_ids, hf_greedy):
    tok = demo_model.tokenizer
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        resp = client.completions.create(model=MODEL, prompt=demo_prompt_ids[1], n=3, temperature=0, max_tokens=MAX_NEW)
        ids = hf_greedy(tuple(demo_prompt_ids[1]), MAX_NEW)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert [c.text for c in resp.choices] == [tok.decode(ids, skip_special_tokens=True)] * 3
        assert resp.usage.completion_tokens == 3 * len(ids)
        sampled = [[c.text for c in client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=5,
                                                               max_tokens=MAX_NEW).choices] for _ in range(2)]
        assert sampled[0] == sampled[1] and len(set(sampled[0])) > 1
        with pytest.raises(openai.BadRequestError) as refused:  # n x max_tokens beyond the decode worker's KV pool
            client.completions.create(model=MODEL, prompt="hi", n=16, max_tokens=1000)
        assert refused.value.body["param"] == "n" and "KV capacity" in refused.value.body["message"]
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=0, max_tokens=MAX_NEW,
                                                stream=True, stream_options={"include_usage": True})
        texts, finishes, usage = {0: "", 1: ""}, {}, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
    chat_ids = hf_greedy(tuple(encode_chat(tok, CHAT)), MAX_NEW)
    assert texts == {0: tok.decode(chat_ids, skip_special_tokens=True)} | {1: tok.decode(chat_ids, skip_special_tokens=True)}
    assert sorted(finishes) == [0, 1] and usage.completion_tokens == 2 * len(chat_ids)
    cluster.assert_no_leaked_blocks()


@pytest.fixture(scope="module")
def two_decoders(tmp_path_factory):
    config = write_config(tmp_path_factory.mktemp("nseq-migrate") / "pdserve.yaml", transport="tcp")
    with LocalCluster(config, num_prefill=1, num_decode=2, register=True) as c:
        yield c


def test_a_group_migrates_whole_when_its_decode_worker_dies(two_decoders, demo_prompt_ids):
    """Seeded n=3: killed mid-stream, the group restarts on the other decode worker, replays what it
    had streamed (dropped by the router) and continues: the client sees what an undisturbed run gives."""
    import os
    import signal
    import threading

    cluster, prompt, max_new = two_decoders, demo_prompt_ids[4], 64
    sampling = {"temperature": 1.0, "seed": 3, "ignore_eos": True}
    # P's prefix cache warm first: a prefill over cached blocks differs from a cold one in the last float
    # bits, which can flip a sampled token of sequence 0 (its prompt KV comes from P; the forks recompute theirs)
    generate_n(cluster.router.address, prompt, 1, 1, temperature=0.0)
    expected, _ = generate_n(cluster.router.address, prompt, 3, max_new, **sampling)
    first_token = threading.Event()
    outcome: dict = {}

    def stream() -> None:
        tokens: dict[int, list[int]] = {}
        with grpc.insecure_channel(cluster.router.address) as channel:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=max_new, n=3, **sampling))
            for response in pb_grpc.RouterStub(channel).Generate(request, timeout=300):
                tokens.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
                first_token.set()
                if response.finish_reason:
                    outcome.setdefault("finishes", []).append(response.finish_reason)
        outcome["tokens"] = tokens

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_token.wait(120)
    victim = max(cluster.decode, key=lambda proc: cluster.worker_stats(proc).running_requests)
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(10)
    thread.join(300)
    assert outcome["finishes"] == [pb.FINISH_REASON_LENGTH] * 3
    assert outcome["tokens"] == expected
    assert sum(v for (name, _), v in cluster.metrics().items() if name == "pdserve_migrations_total") >= 1, "nothing migrated"
    cluster.assert_no_leaked_blocks()
