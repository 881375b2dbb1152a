"""bench/serve.py without processes: metrics on a fixed trace against an independent computation,
seeded arrival generators with the right mean rate, workloads and burst windows."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from bench import serve


# ---- an independent computation -----------------------------------------------------------------
def pct(values: list[float], p: float) -> float:
    """Linear-interpolated percentile written out by hand (numpy's default method)."""
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = int(math.floor(rank))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def record(index, start, chunks, end, tokens=None, ok=True, group="main", burst=None, prompt_tokens=10):
    tokens = tokens or [1] * len(chunks)
    return {
        "index": index, "group": group, "burst": burst, "scheduled_s": start, "prompt_len": prompt_tokens,
        "max_tokens": sum(tokens), "start_s": start, "end_s": end, "chunk_times_s": list(chunks),
        "chunk_tokens": list(tokens), "prompt_tokens": prompt_tokens, "output_tokens": sum(tokens), "ok": ok,
        "error": None if ok else "UNAVAILABLE: boom", "finish_reason": "FINISH_REASON_LENGTH" if ok else None,
        "server_timings": None,
    }


# start, chunk arrival times, end (seconds since the run started)
TRACE = [
    record(0, 0.00, [0.10, 0.15, 0.21, 0.30], 0.31),
    record(1, 0.05, [0.45, 0.50, 0.52, 0.60, 0.71, 0.75], 0.76),
    record(2, 0.20, [0.30], 0.30),                                # one token: no TPOT, no ITL
    record(3, 0.25, [0.35, 0.95, 1.00], 1.02, tokens=[1, 2, 1]),  # a chunk with two tokens
    record(4, 0.30, [], 0.40, ok=False),                          # failed: excluded
    record(5, 0.40, [0.48, 0.56, 0.64, 0.72, 0.80, 0.88, 0.96, 1.04, 1.12, 1.20], 1.21),
]


def independent(trace, slos_ms):
    ok = [r for r in trace if r["ok"] and r["chunk_times_s"]]
    ttft = [r["chunk_times_s"][0] - r["start_s"] for r in ok]
    e2e = [r["end_s"] - r["start_s"] for r in ok]
    tpot, itl, good = [], [], 0
    for r in ok:
        t = r["chunk_times_s"]
        n = sum(r["chunk_tokens"])
        this_tpot = 0.0
        if n > 1:
            this_tpot = (r["end_s"] - r["start_s"] - (t[0] - r["start_s"])) / (n - 1)
            tpot.append(this_tpot)
        for i in range(1, len(t)):
            itl.append(t[i] - t[i - 1])
        measured = {"ttft": t[0] - r["start_s"], "tpot": this_tpot, "e2el": r["end_s"] - r["start_s"]}
        good += all(measured[k] * 1000 <= v for k, v in slos_ms.items())
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": itl, "good": good, "completed": len(ok),
            "out": sum(sum(r["chunk_tokens"]) for r in ok), "in": sum(r["prompt_tokens"] for r in ok)}


SLOS = {"ttft": 150.0, "tpot": 90.0}


@pytest.fixture(scope="module")
def metrics():
    return serve.compute_metrics(TRACE, duration_s=1.21, slos_ms=SLOS)


@pytest.mark.parametrize("key,name", [("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2e", "e2el_ms")])
def test_latency_metrics_match_independent_computation(metrics, key, name):
    ref = [v * 1000 for v in independent(TRACE, SLOS)[key]]
    got = metrics[name]
    assert got["count"] == len(ref)
    assert got["mean"] == pytest.approx(mean(ref))
    assert got["median"] == pytest.approx(pct(ref, 50))
    assert got["p50"] == pytest.approx(pct(ref, 50))
    assert got["p90"] == pytest.approx(pct(ref, 90))
    assert got["p99"] == pytest.approx(pct(ref, 99))
    assert got["min"] == pytest.approx(min(ref)) and got["max"] == pytest.approx(max(ref))


def test_hand_checked_values(metrics):
    # request 0: TTFT 100 ms, E2E 310 ms, TPOT (310 - 100) / 3 = 70 ms
    # request 3: 4 tokens in 3 chunks -> TPOT (1020 - 100) / 3 ms; ITL has 2 gaps (600, 50 ms)
    ref = independent(TRACE, SLOS)
    assert ref["ttft"][0] == pytest.approx(0.10) and ref["tpot"][0] == pytest.approx(0.07)
    assert metrics["ttft_ms"]["min"] == pytest.approx(80.0)   # request 5
    assert metrics["itl_ms"]["max"] == pytest.approx(600.0)   # request 3's stall
    assert metrics["tpot_ms"]["count"] == 4                   # the one-token request has no TPOT
    assert metrics["itl_ms"]["count"] == 3 + 5 + 0 + 2 + 9


def test_throughput_and_goodput(metrics):
    ref = independent(TRACE, SLOS)
    assert metrics["completed"] == 5 and metrics["failed"] == 1
    assert metrics["request_throughput"] == pytest.approx(5 / 1.21)
    assert metrics["output_throughput"] == pytest.approx(ref["out"] / 1.21)
    assert metrics["total_token_throughput"] == pytest.approx((ref["out"] + ref["in"]) / 1.21)
    # ttft <= 150 and tpot <= 90: request 0 (100, 70), 2 (100, 0: one token), 5 (80, ~81.1) are good;
    # request 1 (TTFT 400) and 3 (TPOT ~306) are not
    assert ref["good"] == 3
    assert metrics["good_requests"] == 3
    assert metrics["goodput"] == pytest.approx(3 / 1.21)


def test_no_slos_no_goodput():
    m = serve.compute_metrics(TRACE, 1.0)
    assert m["goodput"] is None and m["good_requests"] is None


def test_empty_trace():
    m = serve.compute_metrics([record(0, 0.0, [], 0.1, ok=False)], 0.1)
    assert m["completed"] == 0 and m["ttft_ms"]["mean"] is None and m["itl_ms"]["p99"] is None


def test_e2el_slo():
    m = serve.compute_metrics(TRACE, 1.21, slos_ms={"e2el": 400.0})
    assert m["good_requests"] == 2  # requests 0 (310 ms) and 2 (100 ms)


# ---- arrivals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 3.0])
def test_arrivals_have_the_mean_rate_and_shape(burstiness):
    rate, n = 5.0, 40_000
    times = serve.arrival_times(n, rate, burstiness, np.random.default_rng(7))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert (n - 1) / times[-1] == pytest.approx(rate, rel=0.03)
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson (k=1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded():
    a = serve.arrival_times(100, 2.0, 1.0, np.random.default_rng(1))
    b = serve.arrival_times(100, 2.0, 1.0, np.random.default_rng(1))
    c = serve.arrival_times(100, 2.0, 1.0, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(serve.arrival_times(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))


# ---- workloads ---------------------------------------------------------------------------------
def args_for(*argv):
    return serve.build_parser().parse_args(["--grpc", "x:1", *argv])


def test_random_workload_is_seeded_and_in_range():
    args = args_for("--num-prompts", "50", "--input-len", "8:32", "--output-len", "4:6", "--seed", "3")
    a = serve.build_workload(args, 2.0, as_text=False)
    b = serve.build_workload(args, 2.0, as_text=False)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.arrival_s for s in a] == [s.arrival_s for s in b]
    for s in a:
        assert 8 <= s.prompt_len <= 32 and len(s.prompt_ids) == s.prompt_len and 4 <= s.output_len <= 6
        assert all(serve.DEFAULT_VOCAB[0] <= t < serve.DEFAULT_VOCAB[1] for t in s.prompt_ids)
    text = serve.build_workload(args, 2.0, as_text=True)
    assert all(len(s.prompt_text.split()) == s.prompt_len for s in text)


def test_bursts_are_injected_at_their_times():
    args = args_for("--num-prompts", "4", "--burst-at", "1.5", "--burst-at", "4", "--burst-size", "3",
                    "--burst-prompt-len", "100", "--burst-output-len", "2")
    specs = serve.build_workload(args, math.inf, as_text=False)
    bursts = [s for s in specs if s.group == "burst"]
    assert len(specs) == 10 and len(bursts) == 6
    assert sorted({(s.burst, s.arrival_s) for s in bursts}) == [(0, 1.5), (1, 4.0)]
    assert all(len(s.prompt_ids) == 100 and s.output_len == 2 for s in bursts)


def test_prefix_workload_shares_prefixes():
    args = args_for("--dataset", "prefix", "--num-prompts", "6", "--num-prefixes", "2", "--prefix-len", "16", "--input-len", "4")
    specs = serve.build_workload(args, math.inf, as_text=False)
    assert specs[0].prompt_ids[:16] == specs[2].prompt_ids[:16] == specs[4].prompt_ids[:16]
    assert specs[0].prompt_ids[:16] != specs[1].prompt_ids[:16]
    assert all(len(s.prompt_ids) == s.prompt_len == 20 for s in specs)


def test_high_priority_fraction_marks_a_seeded_share_and_leaves_other_draws_alone():
    plain = serve.build_workload(args_for("--num-prompts", "40", "--seed", "5"), 2.0, as_text=False)
    args = args_for("--num-prompts", "40", "--seed", "5", "--high-priority-fraction", "0.25", "--high-priority", "9",
                    "--burst-at", "1", "--burst-size", "2")
    specs = serve.build_workload(args, 2.0, as_text=False)
    main = [s for s in specs if s.group == "main"]
    assert sorted(s.priority for s in main) == [0] * 30 + [9] * 10
    assert all(s.priority == 0 for s in specs if s.group == "burst")
    assert [s.priority for s in serve.build_workload(args, 2.0, as_text=False)] == [s.priority for s in specs]
    assert [s.prompt_ids for s in main] == [s.prompt_ids for s in plain] and all(s.priority == 0 for s in plain)


def test_chat_mix_covers_its_classes():
    args = args_for("--dataset", "chat", "--num-prompts", "400")
    lens = [s.prompt_len for s in serve.build_workload(args, math.inf, as_text=False)]
    assert min(lens) >= 8 and max(lens) <= 1024
    assert sum(n < 64 for n in lens) > 120 and sum(n >= 256 for n in lens) > 20


def test_parsers_reject_bad_values():
    with pytest.raises(argparse.ArgumentTypeError):
        serve.parse_range("10:5")
    with pytest.raises(argparse.ArgumentTypeError):
        serve.parse_slos(["latency:5"])
    assert serve.parse_slos(["ttft:500", "e2e:2000"]) == {"ttft": 500.0, "e2el": 2000.0}


# ---- bursts ------------------------------------------------------------------------------------
def test_burst_itl_splits_gaps_by_window():
    main0 = record(0, 0.0, [0.1, 0.2, 0.3, 0.4, 1.4, 1.5, 1.6], 1.6)
    main1 = record(1, 0.0, [0.15, 0.25, 0.35, 0.45, 1.45, 1.55], 1.55)
    burst = [record(2, 0.5, [1.3, 1.35], 1.35, group="burst", burst=0),
             record(3, 0.5, [1.2, 1.25], 1.25, group="burst", burst=0)]
    trace = [main0, main1, *burst]
    windows = serve.burst_windows(trace)
    assert windows == [{"burst": 0, "start_s": 0.5, "end_s": 1.3}]
    split = serve.burst_itl(trace, windows)
    assert split["steady_from_s"] == pytest.approx(0.15)
    # inside: the two gaps spanning [0.5, 1.3] (1000 ms each); outside: the rest from 0.15 s on
    assert split["inside_ms"]["count"] == 2 and split["inside_ms"]["median"] == pytest.approx(1000.0)
    # main0: .2-.3 .3-.4 1.4-1.5 1.5-1.6 (.1-.2 starts before steady state); main1: .15-.25 .25-.35 .35-.45 1.45-1.55
    assert split["outside_ms"]["count"] == 8
    assert split["outside_ms"]["p99"] == pytest.approx(100.0)
    assert split["p99_ratio"] == pytest.approx(10.0)
    # before the window: .2-.3 .3-.4 (main0), .15-.25 .25-.35 .35-.45 (main1); after: 1.4-1.5 1.5-1.6 1.45-1.55
    assert split["before_ms"]["count"] == 5 and split["after_ms"]["count"] == 3
    assert split["p99_ratio_vs_before"] == pytest.approx(10.0)


def test_openai_chunks_are_stamped():
    backend = serve.OpenAIBackend("http://127.0.0.1:1/v1", "m", args_for())
    rec = serve.RequestRecord(0, "main", None, 0.0, 5, 3)
    backend._absorb({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, rec, 0.1)  # no text: no token
    backend._absorb({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}, rec, 0.2)
    backend._absorb({"choices": [{"index": 0, "delta": {"content": " b"}, "finish_reason": "length"}]}, rec, 0.3)
    backend._absorb({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}, rec, 0.4)
    assert rec.chunk_times_s == [0.2, 0.3] and rec.chunk_tokens == [1, 1]
    assert rec.output_tokens == 3 and rec.prompt_tokens == 5 and rec.finish_reason == "length"
    backend._absorb({"error": {"message": "overloaded"}}, rec, 0.5)
    assert rec.error == "overloaded"


def test_cli_dispatches_bench_serve(capsys):
    from deploy.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--help"])
    assert exc.value.code == 0
    assert "--request-rate" in capsys.readouterr().out


def test_file_workload_replays_requests(tmp_path):
    path = tmp_path / "w.json"
    path.write_text('[{"prompt_ids": [5, 6, 7], "output_len": 4}, {"prompt": "a b", "output_len": 2}, {"prompt_ids": [1], "output_len": 1}]')
    args = args_for("--dataset", "file", "--dataset-path", str(path), "--num-prompts", "0")
    specs = serve.build_workload(args, math.inf, as_text=False)
    assert [(s.prompt_ids, s.prompt_text, s.output_len) for s in specs] == [([5, 6, 7], None, 4), (None, "a b", 2), ([1], None, 1)]
    args = args_for("--dataset", "file", "--dataset-path", str(path), "--num-prompts", "2")
    assert len(serve.build_workload(args, 1.0, as_text=False)) == 2


# ---- experiment plumbing (no processes) --------------------------------------------------------
def test_docs_section_is_replaced_in_place(tmp_path):
    from bench.experiments import report

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Engine\n\nengine numbers\n")
    report.update_doc(f"{report.BEGIN}\n## Serving\nfirst\n{report.END}\n", doc)
    report.update_doc(f"{report.BEGIN}\n## Serving\nsecond\n{report.END}\n", doc)
    text = doc.read_text()
    assert "## Engine\n\nengine numbers" in text and "second" in text and "first" not in text
    assert text.count("## Serving") == 1
    doc.write_text(text + "\n## KV transfer\n\nkv numbers\n")
    report.update_doc(f"{report.BEGIN}\n## Serving\nthird\n{report.END}\n", doc)
    text = doc.read_text()
    assert "kv numbers" in text and "engine numbers" in text and "third" in text and "second" not in text


def test_workers_get_one_core_each():
    from bench.cluster import BenchCluster, bench_config

    pinned = BenchCluster(bench_config(), num_prefill=1, num_decode=1, pin=True, cores=[0, 1])
    assert [pinned._core(0), pinned._core(1)] == [0, 1]
    assert BenchCluster(bench_config(), pin=False)._core(0) is None
    assert bench_config("ucx", engine={"num_threads": 1})["engine"]["num_threads"] == 1


# ---- the load runner, against a fake backend ---------------------------------------------------
class FakeBackend:
    """Streams one token every `step` seconds; remembers the peak number of requests in flight."""

    def __init__(self, step: float = 0.01):
        self.step, self.in_flight, self.peak = step, 0, 0

    async def send(self, spec, rec, clock):
        import asyncio

        rec.start_s, rec.sent = clock(), True
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            for _ in range(spec.output_len):
                await asyncio.sleep(self.step)
                rec.chunk_times_s.append(clock())
                rec.chunk_tokens.append(1)
            rec.output_tokens, rec.ok, rec.finish_reason = spec.output_len, True, "FINISH_REASON_LENGTH"
        finally:
            self.in_flight -= 1
            rec.end_s = clock()


def test_runner_caps_concurrency_and_keeps_arrival_times():
    import asyncio

    backend = FakeBackend()
    specs = [serve.RequestSpec(i, 4, 3, arrival_s=0.02 * i, prompt_ids=[1] * 4) for i in range(8)]
    records, duration = asyncio.run(serve.run_load(backend, specs, max_concurrency=2, progress=False))
    assert backend.peak == 2 and len(records) == 8 and all(r.ok for r in records)
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in records)
    assert duration == pytest.approx(max(r.end_s for r in records) - min(r.start_s for r in records))


def test_runner_stops_main_requests_after_the_bursts():
    import asyncio
    from dataclasses import asdict

    backend = FakeBackend()
    main = [serve.RequestSpec(i, 4, 1000, arrival_s=0.0, prompt_ids=[1] * 4) for i in range(3)]
    late = [serve.RequestSpec(3, 4, 5, arrival_s=5.0, prompt_ids=[1] * 4)]  # never sent
    burst = [serve.RequestSpec(4, 64, 2, arrival_s=0.05, prompt_ids=[1] * 64, group="burst", burst=0)]
    records, _ = asyncio.run(serve.run_load(backend, main + late + burst, None, progress=False, stop_after_bursts=0.1))
    by_index = {r.index: r for r in records}
    assert sorted(by_index) == [0, 1, 2, 4]
    assert by_index[4].ok
    for i in range(3):
        assert by_index[i].finish_reason == serve.CANCELLED and not by_index[i].ok and len(by_index[i].chunk_times_s) > 5
    raw = [asdict(r) for r in records]
    m = serve.compute_metrics(raw, 1.0)
    assert (m["completed"], m["failed"], m["cancelled"]) == (1, 0, 3)
    split = serve.burst_itl(raw, serve.burst_windows(raw))
    assert split["inside_ms"]["count"] + split["outside_ms"]["count"] > 15  # cancelled streams still give ITL
