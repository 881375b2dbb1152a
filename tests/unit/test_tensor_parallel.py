"""Tensor parallelism in the engine: N rank processes (gloo), the model split by transformers'
TP plan, the scheduler on rank 0 broadcasting each step. Greedy output == HF `generate` on the
same unsplit model; a TP size that does not divide the heads is refused before any rank starts; a
lost rank fails the step with RankLost."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from bench.cluster import REPO
from common.config import config_from_dict
from common.engine_config import EngineConfig
from common.errors import ModelLoadError, RankLost
from common.validation import ConfigError
from engine import Engine, SamplingParams
from engine.testing.tiny_models import build_tiny_model
from tests.conftest import assert_no_leaked_blocks, hf_generate, run_to_completion

pytestmark = pytest.mark.timeout(300)

PROMPTS = [list(range(1, 9)), list(range(100, 170)), list(range(500, 523)), [7] * 40]
MAX_NEW = 20


def tp_engine(model: str, size: int, **overrides) -> Engine:
    overrides.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model=model, dtype="float32", tensor_parallel_size=size, num_threads=1, **overrides))


def generate_all(engine: Engine, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_new))
    out = run_to_completion(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


def hf_reference(path: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_generate(model, ids, max_new) for ids in prompts]


@pytest.fixture(scope="module")
def qwen2() -> str:
    return str(build_tiny_model(arch="qwen2"))


@pytest.fixture(scope="module")
def llama() -> str:
    return str(build_tiny_model(arch="llama", seed=1))


def test_tp2_qwen2_with_biases_matches_hf_through_chunking_and_preemption(qwen2):
    engine = tp_engine(qwen2, 2, max_num_batched_tokens=32, num_kv_blocks=12)
    try:
        assert engine.layout.num_kv_heads == 2  # 4 KV heads over 2 ranks
        assert generate_all(engine, PROMPTS) == hf_reference(qwen2, PROMPTS)
        stats = engine.stats()
        assert stats.num_preemptions > 0, "12 blocks for 4 prompts must preempt"
        assert stats.steps > sum(len(p) for p in PROMPTS) // 32, "prompts were not chunked"
        assert_no_leaked_blocks(engine)
    finally:
        engine.close()
    assert not multiprocessing.active_children(), "close() leaves no rank process behind"


def test_tp4_llama_matches_hf(llama):
    engine = tp_engine(llama, 4)
    try:
        assert engine.layout.num_kv_heads == 1
        assert generate_all(engine, PROMPTS[:2]) == hf_reference(llama, PROMPTS[:2])
        assert_no_leaked_blocks(engine)
    finally:
        engine.close()


def test_tp3_demo_model_matches_hf(demo_model, demo_prompt_ids, hf_greedy):
    engine = tp_engine("smollm2-135m", 3)
    try:
        prompts = demo_prompt_ids[:3]
        got = generate_all(engine, prompts, 16)
        assert got == [hf_greedy(tuple(p), 16) for p in prompts]
        assert_no_leaked_blocks(engine)
    finally:
        engine.close()


def test_tp_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts():
    with pytest.raises(ModelLoadError) as err:
        tp_engine("smollm2-135m", 2)
    assert err.value.field == "tensor_parallel_size"
    assert "9 attention heads and 3 KV heads" in str(err.value) and "[1, 3]" in str(err.value)
    assert not multiprocessing.active_children()


def test_a_lost_rank_fails_the_step_with_rank_lost(qwen2):
    engine = tp_engine(qwen2, 2)
    try:
        follower = engine.parallel._processes[0]
        follower.kill()
        follower.join(10)
        engine.add_request("after-kill", PROMPTS[0], SamplingParams(max_tokens=4))
        with pytest.raises(RankLost, match=r"rank\(s\) \[1\]"):
            engine.step()
    finally:
        engine.close()


def test_tensor_parallel_size_is_set_per_pool():
    config = config_from_dict({"pools": {"prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 3}}})
    assert config.engine_for("prefill").tensor_parallel_size == 2
    assert config.engine_for("decode").tensor_parallel_size == 3
    with pytest.raises(ConfigError, match=r"pools\.decode\.tensor_parallel_size"):
        config_from_dict({"pools": {"decode": {"tensor_parallel_size": 0}}})
    with pytest.raises(ConfigError, match=r"engine\.tensor_parallel_size: is set per pool"):
        config_from_dict({"engine": {"tensor_parallel_size": 2}})


def test_generate_local_with_a_tp2_config_matches_hf(qwen2, tmp_path):
    config = tmp_path / "tp.yaml"
    config.write_text(yaml.safe_dump({"engine": {"model": qwen2, "dtype": "float32", "num_kv_blocks": 64},
                                      "pools": {"decode": {"tensor_parallel_size": 2, "num_threads": 1}}}))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--local", "-c", str(config), "--raw", "--json",
         "--max-tokens", "12", "The capital of France is"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == hf_reference(qwen2, [result["prompt_token_ids"]], 12)[0]
    assert time.monotonic() - started < 240
