"""Shared fixtures: the real demo model (loaded once), tiny random models, HF reference outputs."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from bench.prompts import DEMO_PROMPTS
from common.hardware import cpu_info
from engine import Engine, EngineConfig
from engine.model_loader import LoadedModel, load_model

T = TypeVar("T")

NAMED_ONLY = tuple(Path(__file__).parent / group for group in ("scenarios", "package", "image"))
"""Long groups of their own (`make test-scenarios`, `make test-package`, `make test-image`), left out of a bare `pytest`."""


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/scenarios/, tests/package/ and tests/image/ are collected only when a command line names them or a path inside them."""
    if collection_path not in NAMED_ONLY:
        return None
    named = (Path(arg.split("::")[0]).resolve() for arg in config.args)
    return not any(path == collection_path or collection_path in path.parents for path in named)


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll `condition` every `interval` s until it returns something true; returns that. Past `timeout` s:
    AssertionError naming `what` (the tests' one way to wait for something another process does)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(interval)
    return value


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> float:
    """`wait_for`, returning the (monotonic) time the condition was first seen to hold."""
    wait_for(condition, timeout, what, interval)
    return time.monotonic()

PROCESSES_AT_SETUP = pytest.StashKey[tuple[list, int]]()


def _started_processes() -> list:
    """bench/cluster.py's STARTED, if a test imported it (unit tests start no process)."""
    cluster = sys.modules.get("bench.cluster")
    return cluster.STARTED if cluster is not None else []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    started = _started_processes()
    item.stash[PROCESSES_AT_SETUP] = ([p for p in started if p.alive()], len(started))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the tail of the output of every process it saw: those running when it
    was set up (a worker it killed among them) and those started since (a CI run keeps no other record of them)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or PROCESSES_AT_SETUP not in item.stash:
        return
    running, count = item.stash[PROCESSES_AT_SETUP]
    for proc in running + _started_processes()[count:]:
        report.sections.append(proc.log_tail())


SUMS_AS_TORCH_BF16 = "avx512_bf16" in cpu_info().features and "amx_bf16" not in cpu_info().features
"""Whether this CPU is one where the paged kernel's bf16 sums were measured to follow torch's CPU flash
attention (AVX512-BF16 without AMX: torch takes MKL's GEMMs; with AMX it packs for oneDNN's brgemm, whose
order is not reproduced). Tests assert bit-equality with transformers' bf16 only here."""


@pytest.fixture(scope="session")
def demo_model() -> LoadedModel:
    return load_model("smollm2-135m", dtype="float32")  # the HF comparisons are token for token in float32


@pytest.fixture(scope="session")
def demo_prompt_ids(demo_model) -> list[list[int]]:
    from common.tokenization import encode_prompt

    return [encode_prompt(demo_model.tokenizer, p) for p in DEMO_PROMPTS]


@pytest.fixture(scope="session")
def hf_reference(demo_model):
    """The demo model loaded separately by transformers, with HF's default attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model.path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_reference):
    """hf_greedy(prompt_ids, max_new_tokens) -> generated ids from transformers' own `generate`
    (results cached per session)."""
    return functools.lru_cache(maxsize=None)(
        lambda ids, n: hf_generate(hf_reference, list(ids), n)
    )


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """Greedy `generate`; `generate_kwargs` add HF's own logits controls (repetition_penalty, ...)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt_ids):].tolist()


def make_engine(loaded: LoadedModel, **overrides) -> Engine:
    """An engine on `loaded`, its config's dtype that of the loaded weights (not `auto`)."""
    overrides.setdefault("model", loaded.path)
    overrides.setdefault("dtype", str(loaded.dtype).removeprefix("torch."))
    return Engine(EngineConfig(**overrides), loaded=loaded)


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def assert_no_leaked_blocks(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks, f"{stats.total_blocks - stats.free_blocks} KV blocks leaked"
    assert stats.num_running == stats.num_waiting == stats.num_held == 0
