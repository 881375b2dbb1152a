"""Paged attention for a packed batch, plugged into transformers through `AttentionInterface`.

Per forward pass the ModelRunner builds one `AttentionMetadata` and passes it as the `paged` keyword
argument of the model call; transformers forwards it untouched to every attention layer, which
calls `paged_attention` with post-RoPE q/k/v for all scheduled tokens of all requests in one row:
  1. the new k/v land in the layer's pool tensors at `slot_mapping`,
  2. decode tokens (one query each, packed first, and speculative verifying rows: 1 + k queries each,
     causal inside the row) attend to their context in one call of a `paged_decode` kernel that reads K and V where they lie in the pool (on CPU the C++ kernel of
     engine.kernels: no copy, each row reads only its own blocks),
  3. each prefill chunk attends causally to its prefix plus itself: a chunk with earlier context has
     its blocks gathered into a reused workspace (no fresh allocation, so no page faults) for one SDPA
     call; the gather is O(context) against the call's O(chunk x context) work,
  4. `on_layer_written` (if set) is told the layer is complete, so a KV sender can ship it.
Everything that depends only on the batch (block tables, lengths, masks) is built once per step by the
ModelRunner. No per-token Python.
That is the CPU path. When `paged` is a `BatchedMetadata` (the GPU path), step 2-3 are
engine.attention_batched's two calls for the whole batch instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine import attention_batched
from engine.attention_batched import BatchedMetadata, DecodeBatch
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
    """[blocks] ids of the blocks holding the context and the chunk."""
    mask: torch.Tensor | None = None
    """[num_tokens, context + num_tokens] causal mask when there is earlier context, else None."""


@dataclass
class Workspace:
    """Reused gather buffers (flat fp tensors) for K and V; grown on demand, never shrunk."""

    key: torch.Tensor
    value: torch.Tensor

    def views(self, rows: int, row_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key[: rows * row_numel].view(rows, row_numel), self.value[: rows * row_numel].view(rows, row_numel)


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    """[num_tokens] flat pool slot for each packed token."""
    num_decode_tokens: int
    """The first `num_decode_tokens` packed tokens go through the decode kernel: single-token decodes and
    verifying rows (a request's last token and its proposals, causal inside the row)."""
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    workspace: Workspace
    on_layer_written: Callable[[int], None] | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: AttentionMetadata | BatchedMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged is None:
        raise RuntimeError("pdserve_paged attention called without AttentionMetadata (pass paged=...)")
    layer = module.layer_idx
    # query [1, H, T, D]; key/value [1, Hkv, T, D] -> token-major [T, Hkv, D] (views, no copy)
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    _write_kv(paged.kv_cache, layer, paged.slot_mapping, new_k, new_v)

    q = query[0].transpose(0, 1)  # [T, H, D] view
    if isinstance(paged, BatchedMetadata):
        out = attention_batched.attend(q, paged, layer, scaling)
        if paged.on_layer_written is not None:
            paged.on_layer_written(layer)
        return out.unsqueeze(0), None
    out = query.new_empty(q.shape)
    if paged.decode is not None:
        d, nd = paged.decode, paged.num_decode_tokens
        out[:nd] = d.kernel(q[:nd], paged.kv_cache.key_caches[layer], paged.kv_cache.value_caches[layer], d.block_table, d.context_lens, scaling,
                            query_starts=d.query_starts)
    for chunk in paged.prefills:
        s, e = chunk.query_start, chunk.query_start + chunk.num_tokens
        out[s:e] = _prefill_attention(q[s:e], new_k[s:e], new_v[s:e], chunk, paged, layer, scaling)
    if paged.on_layer_written is not None:
        paged.on_layer_written(layer)
    return out.unsqueeze(0), None


def _write_kv(cache: KVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, dim = cache.layout.num_kv_heads, cache.layout.head_dim
    cache.key_caches[layer].view(-1, heads, dim).index_copy_(0, slots, k)
    cache.value_caches[layer].view(-1, heads, dim).index_copy_(0, slots, v)


def _gather_blocks(meta: AttentionMetadata, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy whole blocks of one layer into the workspace: K, V `[len(block_table), block_size, Hkv, D]`."""
    kc, vc = meta.kv_cache.key_caches[layer], meta.kv_cache.value_caches[layer]
    num_blocks, row = kc.shape[0], kc[0].numel()
    kbuf, vbuf = meta.workspace.views(block_table.numel(), row)
    torch.index_select(kc.view(num_blocks, row), 0, block_table, out=kbuf)
    torch.index_select(vc.view(num_blocks, row), 0, block_table, out=vbuf)
    shape = (block_table.numel(),) + tuple(kc.shape[1:])
    return kbuf.view(shape), vbuf.view(shape)


def _prefill_attention(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    chunk: PrefillChunk,
    meta: AttentionMetadata,
    layer: int,
    scaling: float | None,
) -> torch.Tensor:
    """q [n, H, D] of one request's chunk, causal over its earlier context plus the chunk."""
    n = chunk.num_tokens
    if chunk.num_context_before == 0:
        k, v, mask, causal = new_k, new_v, None, True
    else:
        total = chunk.num_context_before + n
        k, v = _gather_blocks(meta, layer, chunk.block_table)
        hkv, d = k.shape[2], k.shape[3]
        k = k.view(-1, hkv, d)[:total]
        v = v.view(-1, hkv, d)[:total]
        mask, causal = chunk.mask, False
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


def register() -> str:
    """Register the attention function. No mask function: for an implementation it has no mask function
    for, transformers skips mask preparation entirely, including its packed-sequence detection, which
    would read a device value (a host sync every step, and no CUDA graph capture)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
