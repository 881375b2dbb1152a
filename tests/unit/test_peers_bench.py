"""`pdserve bench peers`' harness (bench/peers/, bench/experiments/peers.py) without vLLM: vLLM is never installed by
make test or CI, so the peer's offline runner script runs here against a stub `vllm` package, while pdserve's
runner is the real one on the real demo model. The rest is the report logic on hand-made results: the per-thread
scaling, "pdserve best", the serving ratios and the criterion, the docs' tables and row, the plot. No speed is
asserted."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench.engine_workload import Settings, make_workload
from bench.experiments import peers as experiment
from bench.peers import report
from bench.peers.install import EXCLUDED, PeerEnv
from bench.peers.offline import agreement, export_workload, run_offline
from bench.peers.serving import Load, client_args, level_specs, level_summary, vllm_env
from common.model_files import resolve_model_path

STUB_VLLM = '''
"""A stand-in for vLLM's offline API: each request's output is its prompt's first token, n times."""
__version__ = "0.0-stub"


class SamplingParams:
    def __init__(self, max_tokens, min_tokens=0, ignore_eos=False, temperature=1.0, detokenize=True):
        assert min_tokens == max_tokens and ignore_eos and temperature == 0.0 and not detokenize
        self.max_tokens = max_tokens


class _Sched:
    max_num_batched_tokens, max_num_seqs = 2048, 256


class _Config:
    scheduler_config = _Sched()


class _Engine:
    vllm_config = _Config()


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]


class LLM:
    def __init__(self, model, tokenizer, dtype, seed, max_model_len, disable_log_stats):
        self.llm_engine = _Engine()

    def generate(self, prompts, params, use_tqdm=False):
        return [_Output([p["prompt_token_ids"][0]] * s.max_tokens) for p, s in zip(prompts, params)]
'''


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("smollm2-135m"))


def test_the_exported_workload_is_the_engine_benchmarks(tmp_path, model_dir):
    work = export_workload(Settings(), model_dir, tmp_path / "w.json")
    assert json.loads((tmp_path / "w.json").read_text()) == work
    # issue #46's workload: seed 0, 64 requests, 19,468 prompt and 9,170 output tokens
    assert (len(work["prompts"]), sum(map(len, work["prompts"])), sum(work["output_lens"])) == (64, 19468, 9170)
    assert max(len(p) + n for p, n in zip(work["prompts"], work["output_lens"])) <= work["max_model_len"]
    from transformers import AutoTokenizer

    special = set(AutoTokenizer.from_pretrained(model_dir).all_special_ids)
    assert not special & {t for p in work["prompts"] for t in p}
    again = make_workload(Settings(), 49152, special)
    assert again.prompts == work["prompts"] and again.output_lens == work["output_lens"]


class StubPeer(PeerEnv):
    """The peer env with this interpreter for its python (the stub `vllm` comes in through PYTHONPATH)."""

    @property
    def python(self) -> Path:
        return Path(sys.executable)


def test_offline_runs_both_runners_and_compares_their_outputs(tmp_path, model_dir, monkeypatch):
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(STUB_VLLM)
    (tmp_path / "stub" / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")]))
    work = export_workload(Settings(num_requests=3, prompt_len=(8, 24), output_len=(3, 6)), model_dir, tmp_path / "w.json")
    rows = run_offline(StubPeer(tmp_path / "peer"), tmp_path / "w.json", tmp_path, ["float32"], [1])
    [row] = rows
    assert (row["dtype"], row["threads"]) == ("float32", 1)
    for side in ("pdserve", "vllm"):
        assert row[side]["tokens"] == sum(work["output_lens"]) and row[side]["tokens_per_s"] > 0
        assert "output_token_ids" not in row[side]
    assert row["vllm"]["version"] == "0.0-stub" and row["vllm"]["config"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert row["pdserve"]["config"]["num_threads"] == 1
    assert row["pdserve_over_vllm"] == pytest.approx(row["pdserve"]["tokens_per_s"] / row["vllm"]["tokens_per_s"], rel=1e-2, abs=1e-3)
    assert row["agreement"]["identical_requests"] < 1  # the stub repeats the prompt's first token: greedy pdserve does not


def test_agreement_counts_identical_outputs_and_common_prefixes():
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [5, 6]]) == {"identical_requests": 0.5, "mean_common_prefix": 0.75}
    assert agreement([[7]], [[8]])["mean_common_prefix"] == 0


def test_vllm_is_bound_to_the_first_cores_and_gets_its_preloads(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    peer = PeerEnv(tmp_path)
    assert vllm_env(peer, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert vllm_env(peer, None)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # vLLM's own binding (the default serving target)
    env = vllm_env(peer, 4)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "lib" / "libiomp5.so"))
    assert not peer.installed()  # no marker: ensure() would build it
    peer.python.parent.mkdir(parents=True)
    peer.python.write_text("")
    peer.marker.write_text(json.dumps({"vllm": "0.31.0", "torch_spec": "torch==2.13.0+cpu"}))
    assert not peer.installed()  # another version: rebuilt
    assert set(EXCLUDED) == {"torchvision", "torchaudio", "torchcodec"}


def test_every_target_gets_the_same_prompts_and_only_pdserve_the_critical_path():
    load = Load(requests=3, prompt_len=16, output_len=4)

    def prompts(level_index: int) -> list[list[int]]:
        return [s.prompt_ids for s in level_specs(load, level_index)]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)  # no level hits another's prefix cache
    assert all(len(p) == 16 for p in prompts(0)) and len(prompts(0)) == 3
    assert {s.output_len for s in level_specs(load, 0)} == {4} and {s.arrival_s for s in level_specs(load, 0)} == {0.0}
    assert client_args(True).extra_body == {"critical_path": True} and client_args(False).extra_body == {}
    assert client_args(False).ignore_eos and client_args(False).temperature == 0


def _record(start: float, first: float, gap: float, n: int, path: dict | None = None) -> dict:
    times = [start + first + gap * i for i in range(n)]
    return {"ok": True, "chunk_times_s": times, "start_s": start, "end_s": times[-1], "output_tokens": n, "prompt_tokens": 16,
            "prompt_len": 16, "finish_reason": "length", "error": None, "server_timings": path}


def test_a_level_summary_has_throughput_latencies_and_the_critical_path():
    path = {"router_queue_s": 0.1, "decode_admission_s": 0.0, "prefill_queue_s": 0.2, "prefill_compute_s": 0.3, "kv_transfer_s": 0.01,
            "first_token_s": 0.02, "ttft_s": 0.7, "local_prefill": False}
    records = [_record(0.0, 0.5, 0.05, 11, path), _record(0.0, 1.5, 0.05, 11, path)]
    s = level_summary(4, records, duration=2.0)
    assert (s["concurrency"], s["completed"], s["failed"]) == (4, 2, 0)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 11.0
    assert s["ttft_ms"]["median"] == pytest.approx(1000.0) and s["itl_ms"]["p99"] == pytest.approx(50.0)
    assert s["critical_path_ms"]["prefill_queue"]["median"] == pytest.approx(200.0)
    assert s["local_prefill_fraction"] == 0
    failed = {**_record(0.0, 0.5, 0.05, 3), "ok": False, "error": "HTTP 429: busy"}
    assert level_summary(1, [failed], 1.0)["errors"] == ["HTTP 429: busy"]


def _level(c: int, tok_s: float, ttft_p99: float, itl_p99: float) -> dict:
    return {"concurrency": c, "request_throughput": tok_s / 128, "output_throughput": tok_s, "failed": 0,
            "ttft_ms": {"median": ttft_p99 / 2, "p99": ttft_p99}, "itl_ms": {"median": itl_p99 / 2, "p99": itl_p99}}


TARGETS = [
    {"target": "vllm", "kind": "vllm", "levels": [_level(1, 30, 300, 40), _level(16, 200, 3000, 100)]},
    # colocated: the fastest at 1 stream, but 1p1d's geometric mean over the levels is higher
    {"target": "colocated", "kind": "pdserve", "levels": [_level(1, 40, 250, 30), _level(16, 100, 5000, 90)]},
    {"target": "1p1d", "kind": "pdserve", "levels": [_level(1, 33, 280, 35), _level(16, 220, 3500, 60)]},
]


def test_best_is_the_configuration_with_the_best_throughput_over_all_levels():
    assert report.best_of(TARGETS, "pdserve") == "1p1d"
    assert report.best_of(TARGETS[:1], "pdserve") is None
    bound = {"target": "vllm_all_cores", "kind": "vllm", "levels": [_level(1, 20, 400, 60), _level(16, 250, 2000, 90)]}
    assert report.best_of([*TARGETS, bound], "vllm") == "vllm"  # geometric mean 77.5 against 70.7
    assert report.serving_ratios(TARGETS, "1p1d", None) == []
    ratios = report.serving_ratios(TARGETS, "1p1d", "vllm")
    assert [r["concurrency"] for r in ratios] == [1, 16]
    assert ratios[0] == {"concurrency": 1, "throughput": 1.1, "ttft_p99": round(280 / 300, 3), "itl_p99": 0.875, "met": True}
    assert ratios[1]["throughput"] == 1.1 and ratios[1]["ttft_p99"] == round(3500 / 3000, 3) and not ratios[1]["met"]


def _offline_row(dtype: str, threads: int, ours: float, theirs: float) -> dict:
    return {"dtype": dtype, "threads": threads, "pdserve": {"tokens_per_s": ours}, "vllm": {"tokens_per_s": theirs},
            "pdserve_over_vllm": round(ours / theirs, 3), "agreement": {"identical_requests": 1.0, "mean_common_prefix": 1.0}}


OFFLINE = [_offline_row("float32", 1, 130, 100), _offline_row("float32", 2, 200, 160), _offline_row("bfloat16", 1, 260, 180)]


def test_scaling_is_most_threads_over_one_thread_per_dtype_and_runner():
    assert report.scaling(OFFLINE) == {"float32": {"threads": 2, "pdserve": round(200 / 130, 3), "vllm": 1.6}}


def _report(quick: bool = False) -> dict:
    rep = {"command": "pdserve bench peers", "date": "2026-12-06", "params": {"quick": quick},
           "machine": {"cpus": 2, "cpu": "AMD EPYC", "cpu_features": ["avx2"], "git_commit": "abc1234", "loadavg_start": [0.1], "loadavg_end": [1.9],
                       "duration_s": 10.0},
           "versions": {"vllm": "0.32.0", "vllm_torch": "2.13.0+cpu", "vllm_transformers": "5.19.0", "pdserve_torch": "2.13.0+cpu"},
           "offline": {"workload": {"num_requests": 64, "total_prompt_tokens": 19468, "total_output_tokens": 9170, "seed": 0},
                       "rows": OFFLINE, "scaling": report.scaling(OFFLINE)},
           "serving": {"load": {"requests": 64, "prompt_len": 256, "output_len": 128, "dtype": "float32"}, "targets": TARGETS,
                       "best": "1p1d", "peer_best": "vllm", "ratios": report.serving_ratios(TARGETS, "1p1d", "vllm")}}
    rep["verdict"] = report.verdict(rep)
    return rep


def test_the_verdict_applies_issue_46s_criteria():
    v = _report()["verdict"]
    assert v == {"offline_met": False, "offline_min_ratio": 1.25, "serving_met": False}


def test_the_docs_page_and_row_are_rendered_from_the_json(tmp_path):
    rep = _report()
    text = report.page(rep)
    assert "| float32 | 2 | 200.0 | 160.0 | **1.25x** | 100% |" in text
    assert "float32 at 2 threads: pdserve 1.54x, vLLM 1.60x" in text
    assert "| 1p1d (best) | 16 | 1.72 | 220.0 | 1,750 / 3,500 | 30.0 / 60.0 | 0 |" in text
    assert "| 16 | 1.10x | 1.17x | 0.60x | no |" in text and "1p1d / vllm (throughput" in text
    assert "| vllm (best) | 16 |" in text and "| colocated | 16 |" in text
    assert "--quick" not in text and "not met" in text
    assert "`--quick` smoke run" in report.page(_report(quick=True))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n| what | machine | command | figure | baseline in the same run | run |\n|---|---|---|---|---|---|\n"
                   "| [Engine](x.md) | a | b | c | d | e |\n\nThe pages:\n")
    report.upsert_row(doc, report.table_row(rep))
    report.upsert_row(doc, report.table_row(rep))  # replaced in place, not added twice
    lines = doc.read_text().splitlines()
    assert sum(line.startswith(report.ROW_KEY) for line in lines) == 1
    row = lines.index(next(line for line in lines if line.startswith(report.ROW_KEY)))
    assert lines[row - 1].startswith("| [Engine]") and lines[row + 1] == ""
    assert "float32 1t **1.30x**" in lines[row] and "at 16 streams: throughput 1.10x" in lines[row]


def test_the_plot_draws_offline_bars_and_serving_curves(tmp_path):
    from bench.experiments import common

    fig = report.plot(_report(), common.pyplot())
    assert len(fig.axes[0].patches) == 2 * len(OFFLINE)
    assert [len(ax.get_lines()) for ax in fig.axes[1:]] == [3, 3, 3]
    fig.savefig(tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_the_cli_names_a_bad_flag():
    with pytest.raises(SystemExit):
        experiment.parse_args(["--dtypes", "int8"])
    with pytest.raises(SystemExit):
        experiment.parse_args(["--concurrency", "0"])
    a = experiment.parse_args(["--quick", "--dtypes", "bf16,fp32"])
    assert a.dtypes == ["bfloat16", "float32"]
    load = experiment.serving_load(a)
    assert load.levels == (1, 4) and load.requests == 8
    assert experiment.serving_load(experiment.parse_args([])).levels == (1, 4, 16, 64)


def test_a_one_half_run_carries_the_other_half_from_the_last_full_run_and_says_so(tmp_path):
    previous = _report()
    previous["command"], previous["versions"]["pdserve_commit"] = "pdserve bench peers --only offline", "def5678"
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(previous))
    new = {k: v for k, v in _report().items() if k != "offline"}
    experiment.carry_other_half(new, path)
    assert new["offline"] == previous["offline"]
    assert new["carried"]["offline"]["commit"] == "def5678" and "serving" not in new["carried"]
    assert "The offline half is not from this command: it is carried from `pdserve bench peers --only offline` at pdserve def5678" \
        in report.page(new)
    again = {k: v for k, v in _report().items() if k != "offline"}  # a second serving-only run keeps the first source
    path.write_text(json.dumps(new))
    experiment.carry_other_half(again, path)
    assert again["carried"]["offline"]["commit"] == "def5678"
    fresh = _report()
    experiment.carry_other_half(fresh, tmp_path / "missing.json")
    assert "carried" not in fresh
