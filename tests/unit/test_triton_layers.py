"""engine.triton_layers: the CUDA one-pass rotary embedding and RMSNorm give transformers' bits, alone and
installed in a model (engine.llama_layers: the same logits).

Each check runs in a fresh interpreter: on the GPU where there is one, else in triton's CPU interpreter
(TRITON_INTERPRET=1, which must be set before triton compiles anything). A second test compiles the kernels
for a Hopper GPU without one and checks that no product was fused into a sum (no `fma` in the PTX).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it comes with CUDA builds of torch)")


def _run(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


BITS = """
import torch
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from engine import triton_layers

dev = 'cuda' if torch.cuda.is_available() else 'cpu'
torch.manual_seed(0)
config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
rope = LlamaRotaryEmbedding(config).to(dev)
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    for tokens in (1, 5, 37):
        x = torch.randn(1, tokens, 576, device=dev)
        cos, sin = (t.to(dtype) for t in rope(x, torch.randint(0, 8000, (1, tokens), device=dev)))
        q = torch.randn(1, tokens, 9, 64, device=dev).to(dtype)
        k = torch.randn(1, tokens, 3, 64, device=dev).to(dtype)
        want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        triton_layers.rotary_embedding_(q, k, cos, sin)
        assert torch.equal(q.transpose(1, 2), want_q) and torch.equal(k.transpose(1, 2), want_k), (dtype, tokens, 'rotary')
        for scale in (1e-3, 1.0, 1e3):
            norm = LlamaRMSNorm(576, eps=1e-5).to(dev)
            norm.weight.data = torch.randn(576, device=dev)
            norm = norm.to(dtype)
            h = (torch.randn(1, tokens, 576, device=dev) * scale).to(dtype)
            variance = triton_layers.rms_squares(h).mean(-1, keepdim=True)
            got = triton_layers.rms_scale(h, variance, norm.weight, norm.variance_epsilon)
            assert torch.equal(got, norm(h)), (dtype, tokens, scale, 'rms', float((got.float() - norm(h).float()).abs().max()))
            checked += 1
try:
    triton_layers.rotary_embedding_(q, k, cos.float() if q.dtype != torch.float32 else cos.bfloat16(), sin)
except ValueError as exc:
    assert 'one dtype' in str(exc)
else:
    raise AssertionError('mixed dtypes were taken')
from transformers import LlamaForCausalLM
from engine import llama_layers
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).to(dev, dtype).eval()
    ids = torch.randint(0, 300, (1, 9), device=dev)
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert llama_layers.install(model, triton_layers) == 3 * 2 + 1  # attention and two norms per layer, the final norm
        assert torch.equal(model(input_ids=ids).logits, before), dtype
print('ok', checked)
"""


def test_rotary_and_rms_norm_give_transformers_bits():
    done = _run(BITS, interpret=not torch.cuda.is_available())
    assert done.returncode == 0 and "ok 18" in done.stdout, done.stderr[-3000:]


COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine import triton_layers as L

for dt, dtype in (('fp32', tl.float32), ('bf16', tl.bfloat16)):
    sources = (
        ASTSource(fn=L._rotary_kernel, signature={'Q': '*' + dt, 'K': '*' + dt, 'COS': '*' + dt, 'SIN': '*' + dt,
                  **{n: 'constexpr' for n in ('HQ', 'HQ_PAD', 'HK', 'HK_PAD', 'HALF', 'DTYPE')}},
                  constexprs={'HQ': 32, 'HQ_PAD': 32, 'HK': 8, 'HK_PAD': 8, 'HALF': 32, 'DTYPE': dtype}),
        ASTSource(fn=L._squares_kernel, signature={'X': '*' + dt, 'OUT': '*fp32', 'N': 'constexpr', 'BLOCK': 'constexpr'},
                  constexprs={'N': 2048, 'BLOCK': 2048}),
        ASTSource(fn=L._scale_kernel, signature={'X': '*' + dt, 'VAR': '*fp32', 'W': '*' + dt, 'OUT': '*' + dt, 'eps': 'fp32',
                  'N': 'constexpr', 'BLOCK': 'constexpr', 'DTYPE': 'constexpr'}, constexprs={'N': 576, 'BLOCK': 1024, 'DTYPE': dtype}),
    )
    for source in sources:
        built = triton.compile(source, target=GPUTarget('cuda', 90, 32), options={'enable_fp_fusion': False})
        assert built.asm['cubin'] and 'fma.rn' not in built.asm['ptx'], (dt, source.fn.__name__)
print('ok')
"""


def test_kernels_compile_for_hopper_without_fused_multiply_adds():
    done = _run(COMPILE, interpret=False)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
