"""`bench.engine --quick --dtype fp32,bf16` runs end to end on a tiny in-memory Llama, once per dtype,
and writes a complete JSON (one section per dtype) and its plot.

No speed is asserted: only that every figure the benchmark reports is there and positive.
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import engine as bench_engine
from bench.engine_report import plot
from engine.model_loader import LoadedModel


def _tiny_llama() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LoadedModel(model=LlamaForCausalLM(config).eval(), tokenizer=None, path="<in-memory>", dtype=torch.float32)


def test_quick_bench_writes_every_figure_per_dtype(tmp_path):
    out = tmp_path / "engine.json"
    settings, path = bench_engine.parse_args(["--quick", "--threads", "1", "--dtype", "fp32,bf16", "--out", str(out)])
    assert settings.dtypes == ("float32", "bfloat16")
    threads = torch.get_num_threads()
    try:
        result = bench_engine.run_dtypes(settings, loaded=_tiny_llama())
    finally:
        torch.set_num_threads(threads)  # the bench sets the process-wide count; leave other tests theirs
    bench_engine.write_result(result, path)
    data = json.loads(out.read_text())

    assert data["dtypes"] == list(data["by_dtype"]) == ["float32", "bfloat16"]
    for dtype, run in data["by_dtype"].items():
        _check_dtype_section(run, data["settings"])
        assert run["dtype"] == run["engine"]["engine_config"]["dtype"] == dtype
        assert set(run["targets"]) == set(bench_engine.TARGETS[dtype])
    machine = data["machine"]
    assert machine["torch_threads"] == 1 == data["settings"]["threads"]
    assert machine["cpu"] and machine["cpu_auto_dtype"] in ("float32", "bfloat16") and isinstance(machine["cpu_features"], list)
    assert data["settings"]["quick"] is True and data["settings"]["num_requests"] == 8
    assert "summary" not in data  # the summary goes to stdout only
    text = bench_engine.summary(result)
    assert "== float32" in text and "== bfloat16" in text and "engine_over_bound" in text
    png = plot(result, tmp_path / "engine.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_dtype_section(data: dict, settings: dict) -> None:
    for section in ("engine", "hf_static", "hf_continuous", "matmul_ceiling", "engine_decode"):
        assert data[section]["tokens_per_s"] > 0 and data[section]["tokens_per_cpu_s"] > 0, section
    assert data["prefill_ceiling"]["tokens_per_s"] > 0
    assert data["engine"]["useful_tokens"] == settings["total_output_tokens"] > 0
    assert data["hf_static"]["useful_tokens"] == data["hf_continuous"]["useful_tokens"] > 0
    assert data["engine_decode"]["batch"] == data["matmul_ceiling"]["batch"] == 8
    for name in ("engine_over_hf_static", "engine_over_hf_continuous", "engine_decode_b64_over_ceiling", "engine_over_bound"):
        assert data["ratios"][name] > 0 and data["ratios_cpu_time"][name] > 0
    for name, target in data["targets"].items():
        assert target["measured"] == data["ratios"][name] and isinstance(target["met"], bool)
    bound = data["workload_ceiling"]
    assert bound["useful_tokens_per_s"] > 0
    assert data["ratios"]["engine_over_bound"] == round(data["engine"]["tokens_per_s"] / bound["useful_tokens_per_s"], 3)
    memory = data["memory"]
    assert memory["peak_rss_bytes"] > 0 and memory["kv_pool_bytes"] > 0 and memory["kv_pool_blocks"] > 0
    # the matmul ceiling's steps alternate with the engine's decode steps, inside one phase
    assert data["engine_decode"]["steps"] == data["matmul_ceiling"]["steps"] == settings["decode_steps"]
    # the prefill ceiling's forwards run between the engine's prefill steps, inside its phase
    assert data["prefill_ceiling"]["interleaved_with_engine"] and data["prefill_ceiling"]["iters"] >= 2
    assert set(data["load"]["phases"]) == {"engine", "engine_decode", "hf_static", "hf_continuous", "memory_ceiling"}
    # reading the decode steps' KV costs time the attention-free bound leaves out
    assert data["memory_ceiling"]["gb_per_s"] > 0 and bound["decode_kv_bytes"] > 0
    assert 0 < bound["bound_with_kv_read_tokens_per_s"] < bound["useful_tokens_per_s"]
    assert data["ratios"]["engine_over_bound_with_kv_read"] >= data["ratios"]["engine_over_bound"]
    assert data["load"]["load_note"]


def test_prefill_ceiling_runs_only_after_steps_of_half_a_chunk():
    calls = []
    ceiling = bench_engine.PrefillCeiling(lambda: calls.append(1), tokens=2048)
    ceiling.after_step(1023)  # a decode-heavy step: no forward
    assert calls == [] and ceiling.record() is None
    ceiling.after_step(1024)
    assert calls == [1] and ceiling.record() is None  # one sample is no median
    ceiling.after_step(2048)
    record = ceiling.record()
    assert calls == [1, 1] and record["iters"] == 2 and record["tokens"] == 2048 and record["interleaved_with_engine"]
    assert record["tokens_per_s"] > 0 and ceiling.cpu_seconds >= 0
