"""Paged attention for a packed batch, plugged into transformers through `AttentionInterface`.

Per forward pass the ModelRunner builds one `AttentionMetadata` and passes it as the `paged` keyword
argument of the model call; transformers forwards it untouched to every attention layer, which
calls `paged_attention` with post-RoPE q/k/v for all scheduled tokens of all requests in one row:
  1. the new k/v land in the layer's pool tensors at `slot_mapping`,
  2. decode tokens (one query each, packed first) attend to their context in one batched gather,
  3. each prefill chunk attends causally to its prefix (cached blocks) plus itself,
  4. `on_layer_written` (if set) is told the layer is complete, so a KV sender can ship it.
No per-token Python loop: a decode step is a handful of tensor ops per layer; prefill loops over
requests, not tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    """One request's prefill tokens inside the packed batch."""

    query_start: int
    """Index of the chunk's first token in the packed batch."""
    num_tokens: int
    num_context_before: int
    """Tokens of this request already in the pool before this chunk (prefix cache or earlier chunks)."""
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    """[num_tokens] flat pool slot for each packed token."""
    num_decode_tokens: int
    """The first `num_decode_tokens` packed tokens are single-token decodes."""
    decode_block_tables: torch.Tensor
    """[num_decodes, max_blocks] block ids, zero padded."""
    decode_context_lens: torch.Tensor
    """[num_decodes] context length including the new token."""
    decode_key_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_blocks * block_size] True where a key position is valid."""
    prefills: list[PrefillChunk]
    on_layer_written: Callable[[int], None] | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged is None:
        raise RuntimeError("pdserve_paged attention called without AttentionMetadata (pass paged=...)")
    layer = module.layer_idx
    # query [1, H, T, D]; key/value [1, Hkv, T, D] -> token-major [T, Hkv, D]
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    _write_kv(paged.kv_cache, layer, paged.slot_mapping, new_k, new_v)

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    nd = paged.num_decode_tokens
    if nd:
        out[:nd] = _decode_attention(q[:nd], paged, layer, scaling)
    for chunk in paged.prefills:
        s, e = chunk.query_start, chunk.query_start + chunk.num_tokens
        out[s:e] = _prefill_attention(q[s:e], new_k[s:e], new_v[s:e], chunk, paged.kv_cache, layer, scaling)
    if paged.on_layer_written is not None:
        paged.on_layer_written(layer)
    return out.unsqueeze(0), None


def _write_kv(cache: KVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, dim = cache.layout.num_kv_heads, cache.layout.head_dim
    cache.key_caches[layer].view(-1, heads, dim).index_copy_(0, slots, k)
    cache.value_caches[layer].view(-1, heads, dim).index_copy_(0, slots, v)


def _decode_attention(q: torch.Tensor, meta: AttentionMetadata, layer: int, scaling: float | None) -> torch.Tensor:
    """q [B, H, D] single-token queries against each request's paged context (GQA, no KV repeat)."""
    b, h, d = q.shape
    cache = meta.kv_cache
    hkv = cache.layout.num_kv_heads
    # gather whole blocks: [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, L, D]
    k = cache.key_caches[layer][meta.decode_block_tables].view(b, -1, hkv, d).transpose(1, 2)
    v = cache.value_caches[layer][meta.decode_block_tables].view(b, -1, hkv, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=meta.decode_key_mask, scale=scaling, enable_gqa=True
    )
    return out.view(b, h, d)


def _prefill_attention(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    chunk: PrefillChunk,
    cache: KVCache,
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """q [n, H, D] of one request's chunk, causal over its earlier context plus the chunk."""
    n = chunk.num_tokens
    if chunk.num_context_before == 0:
        k, v, mask, causal = new_k, new_v, None, True
    else:
        total = chunk.num_context_before + n
        hkv, d = cache.layout.num_kv_heads, cache.layout.head_dim
        k = cache.key_caches[layer][chunk.block_table].view(-1, hkv, d)[:total]
        v = cache.value_caches[layer][chunk.block_table].view(-1, hkv, d)[:total]
        rows = torch.arange(n).unsqueeze(1) + chunk.num_context_before
        mask = torch.arange(total).unsqueeze(0) <= rows
        mask = mask.to(q.device)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scaling,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _no_mask(*args, **kwargs) -> None:
    """The packed batch carries its own structure; transformers must not build a dense mask."""
    return None


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
