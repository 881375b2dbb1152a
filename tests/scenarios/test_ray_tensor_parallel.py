"""`pdserve serve` on a real embedded Ray with a tensor-parallel decode pool: each decode worker is
one placement group of 2 bundles (STRICT_PACK), its actor rank 0 and a Ray task rank 1. Greedy
output == HF; when rank 1 dies the worker gives itself up and the controller replaces it as a
whole, after which requests are served again == HF; SIGTERM leaves nothing behind."""

from __future__ import annotations

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.cluster import write_config
from engine.testing.tiny_models import build_tiny_model
from tests.conftest import hf_generate
from tests.integration.test_disaggregated import generate
from tests.scenarios.test_ray_deploy import (  # noqa: F401 - serve_guard is a fixture
    healthy,
    remember_tree,
    serve_guard,
    start_serve,
    status,
    stop_and_check_nothing_left,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

PROMPTS = [list(range(1, 9)), list(range(100, 150))]
MAX_NEW = 10


def rank_tasks(serve_pid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(serve_pid).children(recursive=True):
        try:
            if "tp-rank1" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_tp2_decode_pool_serves_and_is_replaced_as_a_whole_when_a_rank_dies(tmp_path, serve_guard):  # noqa: F811
    model = str(build_tiny_model(arch="qwen2"))
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    expected = [hf_generate(reference, p, MAX_NEW) for p in PROMPTS]
    config = write_config(tmp_path / "tp.yaml", transport="ucx", engine={"model": model},
                          pools={"decode": {"tensor_parallel_size": 2, "num_cpus": 0.5}, "prefill": {"num_cpus": 0.5}})
    serve = start_serve(config)
    serve_guard.append(serve)
    seen: set = set()
    address = serve.ready["grpc"]
    assert [generate(address, p, MAX_NEW)[0] for p in PROMPTS] == expected
    before = healthy(status(serve), "decode")
    assert len(before) == 1
    remember_tree(serve, seen)
    (rank1,) = wait_for(lambda: rank_tasks(serve.popen.pid), 30, "the decode worker's rank-1 task")
    rank1.kill()
    replaced = wait_for(lambda: [w for w in healthy(status(serve), "decode") if w["id"] != before[0]["id"]],
                        180, "a replacement decode worker")
    assert len(replaced) == 1
    assert any("died" in e.get("reason", "") for e in status(serve)["events"]), status(serve)["events"]
    assert [generate(address, p, MAX_NEW)[0] for p in PROMPTS] == expected
    remember_tree(serve, seen)
    stop_and_check_nothing_left(serve, seen)
