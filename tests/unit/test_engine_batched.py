"""The GPU path of the engine (batched attention, padded decode rows, CUDA-graph buckets), run on CPU.

Greedy outputs through the batched path equal transformers' `generate` token for token, with the
torch decode kernel, with decode steps served through the graph runner's static inputs (uncaptured
on CPU), and with the triton kernel under TRITON_INTERPRET=1 when triton is installed. Only the
capture itself needs CUDA; that test runs wherever CUDA is present.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.validation import ConfigError
from engine import EngineConfig, SamplingParams
from engine.attention import decode_rows
from engine.cuda_graphs import DecodeGraphs, buckets
from engine.model_loader import LoadedModel
from engine.paged_decode import KERNELS, decode_torch
from tests.conftest import assert_no_leaked_blocks, hf_generate, make_engine, run_to_completion

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=None, path="tiny-llama", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(tiny) -> torch.nn.Module:
    """transformers' own attention on the same weights (engines switch `tiny.model` to theirs)."""
    return copy.deepcopy(tiny.model).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 70, 9, 33]
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def expected(reference, prompts) -> list[list[int]]:
    return [hf_generate(reference, p, 20) for p in prompts]


def _batched_engine(tiny, kernel: str = "torch", graphs: int = 0, **overrides):
    engine = make_engine(tiny, **overrides)
    engine.runner.batched = True
    engine.runner.set_decode_kernel(kernel)
    if graphs:
        runner = engine.runner
        runner.graphs = DecodeGraphs(runner.model, engine.kv_cache, graphs, runner.max_blocks_per_seq, KERNELS[kernel])
    return engine


def _run(engine, prompts, max_tokens=20) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens))
    out = run_to_completion(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("budget", [2048, 24])
def test_batched_path_matches_hf(tiny, prompts, expected, budget):
    engine = _batched_engine(tiny, max_num_batched_tokens=budget)
    assert _run(engine, prompts) == expected
    assert_no_leaked_blocks(engine)


def test_a_cpu_without_the_cpp_kernel_takes_the_batched_path(tiny, prompts, expected, monkeypatch):
    """Only the C++ kernel attends prefill chunks as rows: where it is not built (no compiler, an odd head
    size), the CPU engine decodes with the torch kernel and prefills through SDPA, chunked or not."""
    monkeypatch.setattr("engine.paged_decode.default_kernel", lambda device, head_dim: "torch")
    engine = make_engine(tiny, max_num_batched_tokens=24)
    assert engine.runner.decode_kernel == "torch" and engine.runner.batched
    assert _run(engine, prompts) == expected
    assert_no_leaked_blocks(engine)


def test_batched_path_with_preemption_and_prefix_hits_matches_hf(tiny, reference, prompts, expected):
    engine = _batched_engine(tiny, num_kv_blocks=12)
    shared = prompts[3][:48]
    assert _run(engine, prompts) == expected
    assert engine.stats().num_preemptions > 0, "the KV budget did not force a preemption"
    assert _run(engine, [shared + [5, 6], shared + [7]], 8) == [hf_generate(reference, shared + [5, 6], 8), hf_generate(reference, shared + [7], 8)]
    assert engine.stats().prefix_hit_tokens >= 32
    assert_no_leaked_blocks(engine)


def test_decode_steps_through_graph_inputs_match_hf(tiny, prompts, expected):
    engine = _batched_engine(tiny, graphs=8)  # 6 decodes padded to the bucket of 8
    assert _run(engine, prompts) == expected
    assert engine.runner.graphs.steps > 10, "no decode step went through the graph runner"
    assert_no_leaked_blocks(engine)


def test_padding_rows_use_only_the_scratch_block():
    rows = decode_rows([[4, 7], [2]], [20, 3], [11, 12], rows=4, width=3, block_size=16, scratch_block=9)
    assert rows.block_table.tolist() == [[4, 7, 9], [2, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert rows.slots.tolist() == [7 * 16 + 4, 2 * 16 + 3, 9 * 16, 9 * 16]
    assert rows.context_lens.tolist() == [21, 4, 1, 1]
    assert rows.positions.tolist() == [20, 3, 0, 0] and rows.input_ids.tolist() == [11, 12, 0, 0]


def test_buckets_cover_every_batch_up_to_the_largest():
    sizes = buckets(256)
    assert sizes[0] == 1 and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert buckets(5) == [1, 2, 4, 5]


def test_new_config_fields_are_validated_by_name():
    with pytest.raises(ConfigError, match="engine.kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)
    with pytest.raises(ConfigError, match="engine.cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=-1)
    with pytest.raises(ConfigError, match="engine.device"):
        EngineConfig(device="tpu")


def _triton_interpreted(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: on the GPU where there is one, else in triton's CPU interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.mark.skipif(not HAS_TRITON and not torch.cuda.is_available(), reason="triton is not installed (CPU host)")
def test_triton_kernel_equals_torch_kernel():
    code = """
import torch
from engine.paged_decode import decode_torch, decode_triton, interpreter_loop_fix
if not torch.cuda.is_available():
    interpreter_loop_fix()
torch.manual_seed(0)
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    kc, vc = torch.randn(2, 20, 16, 3, 64, device=dev).to(dtype)
    q = torch.randn(3, 9, 64, device=dev).to(dtype)
    table = torch.randint(0, 20, (3, 5), dtype=torch.int32, device=dev)
    lens = torch.tensor([1, 37, 80], dtype=torch.int32, device=dev)
    err = (decode_torch(q, kc, vc, table, lens, None).float() - decode_triton(q, kc, vc, table, lens, None).float()).abs().max()
    assert err < tol, (dtype, float(err))
print('ok')
"""
    done = _triton_interpreted(code)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_compiles_for_hopper_without_a_gpu():
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.paged_decode import _paged_decode_kernel
ints = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_btb", "stride_ob", "stride_oh"]
for dt, precision in (("fp32", "ieee"), ("bf16", "tf32")):
    sig = {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "BT": "*i32", "LENS": "*i32", "O": "*" + dt, "scale": "fp32",
           **{n: "i32" for n in ints}, **{n: "constexpr" for n in ("G", "G_PAD", "D", "BS", "TILE", "PRECISION")}}
    const = {"G": 4, "G_PAD": 16, "D": 64, "BS": 16, "TILE": 32, "PRECISION": precision}
    out = triton.compile(ASTSource(fn=_paged_decode_kernel, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
    assert out.asm["cubin"], dt
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")
def test_captured_graphs_match_hf_on_cuda(prompts):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).cuda().eval()
    reference = [hf_generate(model, p, 20) for p in prompts]  # before the engine switches its attention
    loaded = LoadedModel(model=model, tokenizer=None, path="tiny-llama", dtype=torch.float32)
    engine = make_engine(loaded, device="cuda", cuda_graph_max_batch=8)
    assert engine.runner.graphs is not None, "no CUDA graphs on a CUDA device"
    assert "tile" in engine.runner.decode_tuning, engine.runner.decode_tuning  # the triton kernel was timed, not defaulted
    assert sum("forward" in vars(m) for m in model.modules()) == 3 * 2 + 1  # triton rotary + RMSNorm forwards installed
    assert _run(engine, prompts) == reference
    assert engine.runner.graphs.steps > 10
    assert_no_leaked_blocks(engine)


def test_torch_kernel_ignores_padding_beyond_each_length():
    torch.manual_seed(0)
    kc, vc = torch.randn(2, 6, 16, 2, 8)
    q = torch.randn(2, 4, 8)
    table = torch.tensor([[1, 2, 5], [3, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    out = decode_torch(q, kc, vc, table, lens, None)
    garbage = kc.clone()
    garbage[5] = 1e4  # beyond row 0's 20 keys
    garbage[0] = 1e4  # row 1 padding
    assert torch.allclose(out, decode_torch(q, garbage, vc, table, lens, None))


def test_no_device_value_is_read_inside_the_forward(tiny, prompts, expected, monkeypatch):
    """transformers' packed-sequence detection reads a device value (a host sync); the engine must skip it."""
    from transformers import masking_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("mask preparation ran (find_packed_sequence_indices syncs with the device)")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", forbidden)
    for batched in (False, True):
        engine = make_engine(tiny)
        engine.runner.batched = batched
        assert _run(engine, prompts) == expected
