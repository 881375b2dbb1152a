"""The one-pass Llama layers (engine.llama_layers: engine.kernels' rotary_embedding_, rms_squares and rms_scale)
give transformers' bits.

The rotation against `apply_rotary_pos_emb` on the demo model's own cos/sin (positions up to 8k, GQA head
counts, a decode's one token to a prompt chunk's hundreds), RMSNorm against `LlamaRMSNorm` with the demo
model's norm weights (rows of very different scales), float32 and bf16; then the demo model with the layers
installed against the same model without them: the same logits, bit for bit, and only Llama layers take them.
"""

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine import kernels, llama_layers
from engine.model_loader import load_model

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the C++ kernels do not build on this machine")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def config():
    return load_model("smollm2-135m", dtype="float32").config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_kernel_rotates_as_transformers(config, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    query = (torch.randn(1, tokens, heads, dim, generator=gen) * 3).to(dtype)
    key = (torch.randn(1, tokens, kv_heads, dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 8192, (1, tokens), generator=gen)
    cos, sin = LlamaRotaryEmbedding(config)(query, positions)
    expected_q, expected_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    kernels.load().rotary_embedding_(query, key, cos, sin)
    assert torch.equal(query.transpose(1, 2), expected_q)
    assert torch.equal(key.transpose(1, 2), expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 300, 2048])
def test_rms_norm_as_transformers(dtype, tokens):
    from transformers import AutoModelForCausalLM

    path = load_model("smollm2-135m", dtype="float32").path
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.layers[3].post_attention_layernorm
    gen = torch.Generator().manual_seed(tokens)
    scales = torch.logspace(-3, 3, tokens).unsqueeze(-1)
    x = (torch.randn(1, tokens, weights.weight.numel(), generator=gen) * scales).to(dtype)
    norm = LlamaRMSNorm(weights.weight.numel(), eps=weights.variance_epsilon).to(dtype)
    norm.load_state_dict(weights.state_dict())
    expected = norm(x)
    kernel = kernels.load()
    variance = kernel.rms_squares(x).mean(-1, keepdim=True)
    assert torch.equal(kernel.rms_scale(x, variance, norm.weight.detach(), norm.variance_epsilon), expected)


def test_kernel_names_what_it_cannot_take():
    q, k = torch.zeros(1, 2, 9, 64), torch.zeros(1, 2, 3, 64)
    cos = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.load().rotary_embedding_(q, k, cos.bfloat16(), cos.bfloat16())
    with pytest.raises(RuntimeError, match="the same \\[B, T\\]"):
        kernels.load().rotary_embedding_(q, k, torch.zeros(1, 3, 64), torch.zeros(1, 3, 64))
    with pytest.raises(RuntimeError, match="weight"):
        kernels.load().rms_scale(q.view(1, 2, -1), torch.ones(1, 2, 1), torch.ones(5), 1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_installed_model_gives_the_same_logits(dtype, demo_prompt_ids):
    from transformers import AutoModelForCausalLM

    path = load_model("smollm2-135m", dtype=dtype).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    ids = torch.tensor([demo_prompt_ids[0]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert llama_layers.install(model, kernels.load()) == 3 * model.config.num_hidden_layers + 1  # attention, two norms per layer, the final norm
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_only_llama_layers_take_them():
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    model = Other()
    assert llama_layers.install(model, kernels.load()) == 0
    assert "forward" not in vars(model)
