"""transformers' Llama layers with their elementwise chains in one pass each, on a CPU and on a CUDA device.

Two parts of a Llama layer are chains of small tensor operations, each a pass over memory (a kernel launch on
a GPU): the rotary embedding of q and k (`apply_rotary_pos_emb`: six operations) and RMSNorm (eight, twice per
layer). Kernels run each chain in one pass with the same operations and roundings, so the bits stay
transformers': `rotary_embedding_` rotates q and k in place, `rms_squares` and `rms_scale` do RMSNorm around
torch's own mean (the one reduction, whose order torch picks per device). Two sets of kernels take the same
calls: engine.kernels (C++, CPU: over the engine benchmark's workload in bf16 the two chains were ~12 % of the
engine's time) and engine.triton_layers (CUDA: a decode step of a 1B model was ~700 kernel launches, mostly
these chains, and launches, not bytes, set its time).

Lifecycle: `install(model, ops)` runs once per loaded model (engine.model_runner.install_kernels: the
ModelRunner, and bench.ceilings, whose ceilings must run what the engine runs). Every `LlamaAttention` module
whose head size the kernels take gets transformers' forward with the rotation replaced (the same
projections, the same attention function: the engine's paged attention, the ceilings' none); every
`LlamaRMSNorm` one that calls the kernels. Other architectures keep transformers' forwards.
"""

from __future__ import annotations

import types
from functools import partial

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    LlamaAttention,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


def install(model: nn.Module, ops) -> int:
    """Give the model's eligible layers the one-pass forwards calling `ops` (engine.kernels' built module or
    engine.triton_layers); returns how many took one."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return 0
    installed = 0
    for module in model.modules():
        if type(module) is LlamaAttention and ops.rotary_supports(module.head_dim):
            module.forward = types.MethodType(partial(_attention_forward, ops=ops), module)
        elif type(module) is LlamaRMSNorm:
            module.forward = types.MethodType(partial(_rms_norm_forward, ops=ops), module)
        else:
            continue
        installed += 1
    return installed


def _attention_forward(self: LlamaAttention, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       attention_mask: torch.Tensor | None = None, cache=None, *, ops, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' LlamaAttention.forward, its rotation done in place by the kernel."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape)
    key = self.k_proj(hidden_states).view(hidden_shape)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    one_pass = cos.shape[:2] == query.shape[:2] and cos.dtype == query.dtype
    if one_pass and all(t.is_contiguous() for t in (query, key, cos, sin)):
        ops.rotary_embedding_(query, key, cos, sin)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
    else:
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    output, weights = attend(self, query, key, value, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                             scaling=self.scaling, **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _rms_norm_forward(self: LlamaRMSNorm, hidden_states: torch.Tensor, *, ops) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward: its mean by torch, the rest by the kernels."""
    if hidden_states.dtype != self.weight.dtype or not hidden_states.is_contiguous():
        return LlamaRMSNorm.forward(self, hidden_states)
    variance = ops.rms_squares(hidden_states).mean(-1, keepdim=True)
    return ops.rms_scale(hidden_states, variance, self.weight, self.variance_epsilon)
