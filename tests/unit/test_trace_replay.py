"""The trace replay's pieces without a cluster: trace parsing, window selection, scaling, token blocks per hash
id, time compression, the reuse bounds on hand-made traces with known answers, setups as data, scoring."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.cluster import bench_config
from bench.trace import report
from bench.trace.setups import BY_NAME, Setup
from bench.trace.workload import (
    BlockTokens,
    Scale,
    TraceRequest,
    compress_time,
    load_trace,
    lru_reuse,
    reuse_bound,
    select_window,
)

VOCAB = np.arange(100, 50000)


def req(ids, input_length, t=0, output_length=100) -> TraceRequest:
    return TraceRequest(t, input_length, output_length, tuple(ids))


def test_load_trace_reads_every_line_and_names_a_bad_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n\n'
                    '{"timestamp": 1500, "input_length": 10, "output_length": 0, "hash_ids": [0]}\n')
    assert load_trace(path) == [req([0, 1], 700, 0, 5), req([0], 10, 1500, 0)]
    path.write_text('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": []}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: hash_ids"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "output_length": 5, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="input_length"):
        load_trace(path)


def test_scaled_lengths_stay_inside_the_last_block_and_answers_are_clamped():
    scale = Scale(16)
    assert scale.prompt_len(req(range(14), 6955)) == 217  # 6955 x 16 / 512 = 217.3, 14 blocks
    assert scale.full_blocks(req(range(14), 6955)) == 13
    assert scale.prompt_len(req([0], 10)) == 1  # rounds to 0: every hash id keeps at least one token
    assert scale.prompt_len(req([0, 1, 2], 1024)) == 33  # 2 trace blocks' worth but 3 ids: one token in the third
    assert scale.prompt_len(req([0, 1], 5000)) == 32  # never past its ids' blocks
    assert [scale.output_len(req([0], 10, output_length=n)) for n in (343, 0, 5000)] == [11, 2, 64]
    assert Scale(16, output_scale=0.5, max_output=8).output_len(req([0], 10, output_length=10)) == 5


def test_equal_hash_ids_give_equal_token_prefixes():
    tokens = BlockTokens(VOCAB, 16, seed=3)
    a, b = tokens.prompt([0, 1, 2], 48), tokens.prompt([0, 1, 7, 8], 60)
    assert a[:32] == b[:32] and a[32:] != b[32:48]
    assert len(a) == 48 and len(b) == 60 and set(a + b) <= set(VOCAB.tolist())
    assert tokens.prompt([0, 1, 2], 37) == a[:37]  # a partial last block: the first tokens of its id's block
    assert BlockTokens(VOCAB, 16, seed=3).block(7) == tokens.block(7)  # a function of (seed, id), not of history
    assert BlockTokens(VOCAB, 16, seed=4).block(7) != tokens.block(7)
    assert tokens.block(0) != tokens.block(1)


def test_reuse_bound_of_a_hand_made_trace():
    trace = [
        req([1, 2, 3], 1536),     # 48 tokens, nothing seen
        req([1, 2, 4], 1536),     # [1, 2] seen: 2 blocks, 32 tokens
        req([1, 2, 3, 5], 1792),  # 56 tokens (3 full blocks + 8); [1, 2, 3] seen: 3 blocks, 48 tokens
        req([6], 100),            # 3 tokens, nothing
        req([1, 2, 3], 1536),     # all 3 blocks seen; a prompt computes at least one token: 47
        req([7, 8], 768),         # 24 tokens: block 8 partial
        req([7, 8, 9], 1536),     # ids [7, 8] seen, but 8 was never a full block: 1 block of tokens, 16
    ]
    bound = reuse_bound(trace, Scale(16))
    assert (bound["prompt_blocks"], bound["reusable_blocks"]) == (19, 10)
    assert bound["blocks"] == pytest.approx(10 / 19)
    assert (bound["prompt_tokens"], bound["reusable_tokens"]) == (48 + 48 + 56 + 3 + 48 + 24 + 48, 32 + 48 + 47 + 16)
    assert bound["tokens"] == pytest.approx(143 / 275)
    assert lru_reuse(trace, Scale(16), 1000)["reusable_tokens"] == 143  # room for everything: the unbounded bound
    # 3 blocks of room: request 2 evicts [1, 2, 3]'s third block ([1], [1,2] touched, [1,2,4] added)
    assert lru_reuse(trace[:3], Scale(16), 3)["reusable_tokens"] == 32 + 32
    assert reuse_bound([], Scale(16))["tokens"] == 0


def test_the_whole_mooncake_file_has_its_documented_reuse():
    from bench.experiments.trace_replay import DEFAULT_TRACE

    if not DEFAULT_TRACE.exists():
        pytest.skip(f"{DEFAULT_TRACE} is not on this machine")
    trace = load_trace(DEFAULT_TRACE)
    assert len(trace) == 12031
    assert reuse_bound(trace, Scale(16))["blocks"] == pytest.approx(0.366, abs=0.0005)  # the trace README's 36.6 %


def test_window_takes_whole_conversations_in_a_seeded_order():
    trace = [req([0, c, 100 + i], 1536, t=1000 * i) for i, c in enumerate([1, 2, 1, 3, 2, 1, 4, 5])]
    trace.append(req([0], 10, t=9000))
    picked = select_window(trace, requests=3, seed=0)
    assert len(picked) >= 3 and picked == sorted(picked, key=lambda r: r.timestamp_ms)
    conversations = {r.hash_ids[1] for r in picked if len(r.hash_ids) > 1}
    assert all(r in picked for r in trace if len(r.hash_ids) > 1 and r.hash_ids[1] in conversations)  # every turn of each
    assert picked == select_window(trace, requests=3, seed=0)
    assert {tuple(map(id, select_window(trace, requests=3, seed=s))) for s in range(8)} != {tuple(map(id, picked))}
    assert select_window(trace) == trace
    assert [r.timestamp_ms for r in select_window(trace, start_s=2, end_s=5)] == [2000, 3000, 4000]


def test_compressed_time_keeps_the_gaps_at_the_asked_rate():
    trace = [req([0], 10, t=t) for t in (5000, 6000, 9000, 25000)]
    arrivals, speedup = compress_time(trace, rate=0.6)
    assert arrivals[0] == 0 and (len(arrivals) - 1) / arrivals[-1] == pytest.approx(0.6)
    assert speedup == pytest.approx(20 / 5)  # 20 s of trace for 3 gaps at 0.6 req/s = 5 s
    assert np.diff(arrivals) == pytest.approx(np.diff([0, 1, 4, 20]) / speedup)
    assert compress_time([req([0], 10, t=7)] * 3, 1.0)[0] == [0.0, 0.0, 0.0]


def test_setups_run_only_when_their_parts_exist():
    base = bench_config()
    assert BY_NAME["round_robin"].unavailable(base) is None
    assert BY_NAME["prefix_aware"].config(base)["router"]["policy"] == "prefix_aware"
    missing = Setup("future", "no_such_policy", {"engine": {"no_such_field": 1}}).unavailable(base)
    assert "'no_such_policy' is not registered" in missing and "engine.no_such_field" in missing
    merged = Setup("x", "round_robin", {"engine": {"kv_cache_memory_mb": 7}}).config(base)
    assert merged["engine"]["kv_cache_memory_mb"] == 7 and merged["engine"]["max_num_seqs"] == base["engine"]["max_num_seqs"]
    assert base["engine"]["kv_cache_memory_mb"] != 7 and "policy" not in base["router"]  # the base is left alone
    routed = Setup("y", "prefix_aware", {"router": {"kv_pull": True}}).config(base)["router"]
    assert routed["policy"] == "prefix_aware" and routed["kv_pull"] and routed["host"] == base["router"]["host"]


def record(index, ttft, prompt_len=40, gaps=(0.05, 0.05)) -> dict:
    times = np.cumsum([ttft, *gaps]).tolist()
    return {"index": index, "ok": True, "start_s": 0.0, "end_s": times[-1], "chunk_times_s": times, "chunk_tokens": [1] * len(times),
            "prompt_tokens": prompt_len, "prompt_len": prompt_len, "output_tokens": len(times), "finish_reason": "FINISH_REASON_LENGTH",
            "cached_prompt_tokens": 8}


def test_score_counts_computed_tokens_bytes_and_goodput_and_compares_with_round_robin():
    bound = {"unbounded": {"tokens": 0.5}, "pool_capacity": {"tokens": 0.25}}
    workers = {"prefill0": {"prompt_tokens": 60, "kv_bytes_received": 0, "kv_bytes_sent": 900, "prefix_cache_hit_tokens": 20,
                            "preemptions": 0},
               "decode0": {"prompt_tokens": 0, "kv_bytes_received": 800, "kv_bytes_sent": 0, "prefix_cache_hit_tokens": 4, "preemptions": 1}}
    failed = {**record(2, 1.0, prompt_len=500), "ok": False, "error": "UNAVAILABLE", "chunk_times_s": []}
    base = {"requests": [record(0, 1.0), record(1, 3.0), failed], "workers": workers, "duration_s": 4.0}
    m = report.score(base, bound, {"ttft": 2000, "tpot": 100})
    assert (m["sent"], m["completed"], m["failed"]) == (3, 2, 1)
    assert (m["prompt_tokens"], m["prompt_tokens_computed"], m["reuse"]) == (80, 60, 0.25)  # the failed prompt: not sent
    assert (m["of_reuse_bound"], m["of_capacity_bound"]) == (0.5, 1.0)
    assert (m["kv_bytes_moved_per_request"], m["kv_bytes_sent_per_request"], m["router_cached_prompt_tokens"]) == (800 / 3, 300, 24)
    assert (m["good_requests"], m["goodput"], m["preemptions"]) == (1, 0.25, 1)
    # the sweep: TTFT 1 s and 3 s (both within TPOT 100 ms: gaps of 50 ms) meet an SLO of 3 s and 6 s, only 1 s meets 1 s and 2 s
    assert m["goodput_by_ttft_slo"] == {"500": 0.0, "1000": 0.25, "2000": 0.25, "3000": 0.5, "6000": 0.5}
    fast = report.score({**base, "requests": [record(0, 0.5), record(1, 1.0), failed]}, bound, {"ttft": 2000, "tpot": 100})
    results = {"round_robin": {"metrics": m}, "kv_aware+tier": {"metrics": fast}, "kv_aware": {"status": "not available: x"}}
    vs = report.compare(results)
    assert set(vs) == {"kv_aware+tier"}
    assert vs["kv_aware+tier"]["ttft_p50_speedup"] == pytest.approx(2.0 / 0.75) and vs["kv_aware+tier"]["goodput_ratio"] == 2.0
    verdict = report.acceptance(results, vs)
    assert verdict["checks"] == {"reuse_of_bound >= 0.9": False, "ttft_p50 >= 2x": True, "ttft_p99 better": True, "goodput >= 1.3x": True}
    assert not verdict["met"]
    assert not report.acceptance({"round_robin": {"metrics": m}}, {})["evaluated"]
    json.dumps(verdict)
    sweep = report.goodput_sweep({"results": results, "slos_ms": {"ttft": 2000, "tpot": 100}})
    assert sweep[2] == "| config | TTFT <= 0.5 s | TTFT <= 1 s | TTFT <= 2 s | TTFT <= 3 s | TTFT <= 6 s |"
    assert sweep[4] == "| round_robin | 0.00 | 0.25 | 0.25 | 0.50 | 0.50 |"
    assert sweep[5] == "| kv_aware+tier | 0.25 | 0.50 (2.00x) | 0.50 (2.00x) | 0.50 (1.00x) | 0.50 (1.00x) |"


def test_rescore_scores_the_saved_run_again_under_other_slos_and_says_so(tmp_path):
    from bench.experiments import trace_replay

    workers = {"prefill0": {"prompt_tokens": 60, "kv_bytes_received": 0, "kv_bytes_sent": 900, "prefix_cache_hit_tokens": 20,
                            "preemptions": 0}}
    bound = {"unbounded": {"tokens": 0.5}, "pool_capacity": {"tokens": 0.25}}
    slow, fast = [record(0, 1.0), record(1, 3.0)], [record(0, 0.5), record(1, 1.0)]
    results = {"round_robin": {"status": "ran", "workers": workers, "duration_s": 4.0},
               "kv_aware+tier": {"status": "ran", "workers": workers, "duration_s": 4.0}}
    for name, reqs in (("round_robin", slow), ("kv_aware+tier", fast)):
        results[name]["metrics"] = report.score({**results[name], "requests": reqs}, bound, {"ttft": 6000, "tpot": 100})
    out = tmp_path / "trace_replay.json"
    out.write_text(json.dumps({"command": "pdserve bench trace", "trace": {"reuse_bound": bound}, "params": {"slo_ttft": 6000, "slo_tpot": 100},
                               "slos_ms": {"ttft": 6000, "tpot": 100}, "results": results}))
    (tmp_path / "trace_replay_requests.json").write_text(json.dumps({"round_robin": slow, "kv_aware+tier": fast}))
    assert json.loads(out.read_text())["results"]["kv_aware+tier"]["metrics"]["goodput"] == 0.5
    assert trace_replay.main(["--rescore", "--out", str(out), "--slo-ttft", "2000"]) == 0
    again = json.loads(out.read_text())
    assert again["slos_ms"] == {"ttft": 2000.0, "tpot": 250.0} and again["rescored"]["slos_ms"]["ttft"] == 2000.0
    assert again["results"]["round_robin"]["metrics"]["goodput"] == 0.25  # TTFT 3 s no longer meets the SLO
    assert again["vs_round_robin"]["kv_aware+tier"]["goodput_ratio"] == 2.0 and again["command"] == "pdserve bench trace"
    assert again["acceptance"]["checks"]["goodput >= 1.3x"]
