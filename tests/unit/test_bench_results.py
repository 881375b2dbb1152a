"""bench/results holds one current result per experiment and a history every run appends to (bench.history);
docs/benchmarks.md and its pages link only to files and headings that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import history
from bench.experiments import common

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DOCS = [REPO / "README.md", REPO / "docs" / "benchmarks.md", *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]
FIELDS = {"experiment", "commit", "date", "machine", "command", "headline"}
NOT_RUNS = re.compile(r"(adaptive_trace|sim_validation_adaptive|goodput|prefill_interference)_.+|.+_requests|static_vs_continuous_served|all|faults|overload|soak|gpu_probe_h200")
"""Result files that are no run of their own: a run's raw parts beside its summary, and tests' outputs."""


def test_record_writes_the_result_and_appends_one_history_line(tmp_path):
    report = {"command": "python -m bench.experiments.first_request", "machine": {"cpu": "AMD EPYC", "cpus": 2, "cpu_features": ["avx2", "avx512f"],
              "git_commit": "abc1234", "started_unix": 1796000000},
              "results": [{"transport": "ucx", "cold_extra_s": 0.0191, "later_wall_median_s": 0.19}]}
    history.record(tmp_path / "first_request.json", report)
    history.record(tmp_path / "first_request.json", report | {"results": []})
    assert json.loads((tmp_path / "first_request.json").read_text())["results"] == []
    lines = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert lines[0] == {"experiment": "first_request", "commit": "abc1234", "date": "2026-11-30T00:53Z", "machine": "AMD EPYC, 2 cores, avx512f",
                        "command": report["command"], "headline": {"ucx": [{"cold_extra_ms": 19.1, "later_median_ms": 190.0}]},
                        "file": "first_request.json"}


def test_a_headline_that_cannot_be_read_is_an_error_not_a_lost_run(tmp_path):
    history.record(tmp_path / "goodput.json", {"results": [{"setup": "colocated"}]})
    line = json.loads((tmp_path / "history.jsonl").read_text())
    assert line["headline"]["error"].startswith("KeyError")
    assert line["commit"]  # the checkout's own commit when the report names none


def test_experiments_save_through_the_history(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    common.save("priority", {"priority_ttft_ms": {"10": {"median": 28146.8, "p99": 1.0, "completed": 12}}})
    common.save("adaptive_trace_colocated", {"raw": True}, history=False)
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["headline"] for line in lines] == [{"priority_10": {"ttft_p50_ms": 28147, "completed": 12}}]
    assert (tmp_path / "adaptive_trace_colocated.json").exists()


def test_history_lines_are_complete_and_name_their_file():
    lines = [json.loads(line) for line in (RESULTS / "history.jsonl").read_text().splitlines()]
    assert lines
    for line in lines:
        assert FIELDS <= set(line), line
        assert "error" not in line["headline"], line
        if "file" in line:  # the file the run wrote; the last line naming a file is the run it holds now
            assert (RESULTS / line["file"]).exists(), line
        else:  # a run seeded from a file that is gone: git keeps it
            assert re.fullmatch(r"[0-9a-f]{7,}:bench/results/\S+", line["git"]), line


@pytest.mark.parametrize("path", sorted(p.name for p in RESULTS.glob("*.json")))
def test_every_current_result_is_in_the_history(path):
    """A result file of an experiment with headlines has its run in the history; none is a per-commit copy."""
    assert not re.search(r"_[0-9a-f]{7}(_|$)", Path(path).stem), f"{path}: one file per experiment, git keeps older runs"
    if NOT_RUNS.fullmatch(Path(path).stem):
        return
    files = [json.loads(line).get("file") for line in (RESULTS / "history.jsonl").read_text().splitlines()]
    assert path in files


def _links(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m)]


def _anchors(doc: Path) -> set[str]:
    heads = re.findall(r"^#+\s+(.*)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_benchmark_docs_link_to_what_exists(doc):
    for link in _links(doc):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {link} does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.name}: {link}: no such heading in {path.name}"


def test_the_benchmarks_page_opens_with_the_headline_table_and_links_every_page():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    first_table = text.index("\n|")
    assert first_table < text.index("\n## "), "the table of current numbers comes before any section"
    header = text[first_table:].splitlines()[1].lower()
    for column in ("machine", "command", "baseline"):
        assert column in header
    for page in (REPO / "docs" / "benchmarks").glob("*.md"):
        assert f"benchmarks/{page.name}" in text, f"docs/benchmarks.md does not link {page.name}"


@pytest.mark.parametrize("doc", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_links_into_the_benchmark_pages_resolve(doc):
    for link in (x for x in _links(doc) if "benchmarks" in x and "bench/results" not in x):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve()
        assert path.exists(), f"{doc.name}: {link} does not exist"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: {link}: no such heading in {path.name}"
