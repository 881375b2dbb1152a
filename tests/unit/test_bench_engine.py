"""`bench.engine --quick` runs end to end on a tiny in-memory Llama and writes a complete JSON.

No speed is asserted: only that every figure the benchmark reports is there and positive.
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import engine as bench_engine
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


def test_quick_bench_writes_every_figure(tmp_path):
    out = tmp_path / "engine.json"
    settings, path = bench_engine.parse_args(["--quick", "--threads", "1", "--out", str(out)])
    threads = torch.get_num_threads()
    try:
        result = bench_engine.run(settings, loaded=_tiny_llama())
    finally:
        torch.set_num_threads(threads)  # the bench sets the process-wide count; leave other tests theirs
    bench_engine.write_result(result, path)
    data = json.loads(out.read_text())

    for section in ("engine", "hf_static", "hf_continuous", "matmul_ceiling", "engine_decode"):
        assert data[section]["tokens_per_s"] > 0 and data[section]["tokens_per_cpu_s"] > 0, section
    assert data["prefill_ceiling"]["tokens_per_s"] > 0
    assert data["engine"]["useful_tokens"] == data["settings"]["total_output_tokens"] > 0
    assert data["hf_static"]["useful_tokens"] == data["hf_continuous"]["useful_tokens"] > 0
    assert data["engine_decode"]["batch"] == data["matmul_ceiling"]["batch"] == 8
    for name in ("engine_over_hf_static", "engine_over_hf_continuous", "engine_decode_b64_over_ceiling"):
        assert data["ratios"][name] > 0 and data["ratios_cpu_time"][name] > 0
        assert data["targets"][name]["measured"] == data["ratios"][name]
        assert isinstance(data["targets"][name]["met"], bool)
    assert data["workload_ceiling"]["useful_tokens_per_s"] > 0 and data["workload_ceiling"]["engine_fraction"] > 0
    memory = data["memory"]
    assert memory["peak_rss_bytes"] > 0 and memory["kv_pool_bytes"] > 0 and memory["kv_pool_blocks"] > 0
    machine = data["machine"]
    assert machine["torch_threads"] == 1 == data["settings"]["threads"]
    assert set(machine["phases"]) == {"engine", "engine_decode", "hf_static", "hf_continuous", "matmul_ceiling", "prefill_ceiling"}
    assert machine["load_note"]
    assert data["settings"]["quick"] is True and data["settings"]["num_requests"] == 8
    assert "summary" not in data  # the summary goes to stdout only
    assert bench_engine.summary(result)
