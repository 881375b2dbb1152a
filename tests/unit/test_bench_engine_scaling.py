"""`pdserve bench engine --scaling`: the options it parses and the summary it computes from runs (stub runs: the real
ones are processes that load the demo model). No speed is asserted."""

from __future__ import annotations

import pytest

from bench import engine as bench_engine
from bench.engine_scaling import summarize, summary
from bench.history import headline


def _run(revision: str, threads: int, tok_s: float, tokens: list[list[int]] | None = None) -> dict:
    return {"revision": revision, "threads": threads, "tokens_per_s": tok_s, "output_token_ids": tokens or [[1, 2]]}


def test_scaling_options_and_default_output():
    settings, out, scaling = bench_engine.parse_cli(["--scaling", "--scaling-threads", "2,1", "--baseline-rev", "abc123", "--dtype", "bf16"])
    assert scaling is not None and scaling.scaling_threads == (1, 2) and scaling.baseline_rev == "abc123"
    assert out == bench_engine.SCALING_OUT and settings.dtypes == ("bfloat16",)
    assert bench_engine.parse_cli(["--quick"])[2] is None
    with pytest.raises(SystemExit):
        bench_engine.parse_cli(["--scaling", "--scaling-threads", "0"])


def test_summary_takes_each_revisions_best_round():
    runs = [_run("current", 1, 200.0), _run("baseline", 1, 190.0), _run("current", 2, 330.0), _run("baseline", 2, 230.0),
            _run("current", 1, 210.0), _run("baseline", 1, 180.0), _run("current", 2, 300.0), _run("baseline", 2, 235.0)]
    s = summarize(runs, (1, 2), ["current", "baseline"])
    assert s["best_tokens_per_s"] == {"current": {"1": 210.0, "2": 330.0}, "baseline": {"1": 190.0, "2": 235.0}}
    assert s["scaling"] == {"current": round(330 / 210, 3), "baseline": round(235 / 190, 3)}
    assert s["speedup"] == {"1": round(210 / 190, 3), "2": round(330 / 235, 3)}
    assert s["identical_outputs"] and all("output_token_ids" not in r for r in runs)
    report = {"revisions": {"current": "new", "baseline": "old"}, "by_dtype": {"bfloat16": {"runs": runs, **s}}}
    assert "scaling 1.57x" in summary(report) and headline("engine_scaling", report)["bfloat16"]["scaling"]["current"] == 1.571


def test_summary_flags_runs_that_disagree():
    runs = [_run("current", 1, 1.0, [[1, 2]]), _run("current", 2, 1.0, [[1, 3]])]
    s = summarize(runs, (1, 2), ["current"])
    assert not s["identical_outputs"] and "speedup" not in s
