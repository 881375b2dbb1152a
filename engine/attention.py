"""Paged attention for a packed batch, plugged into transformers through `AttentionInterface`.

Per forward pass the ModelRunner builds one `AttentionMetadata` and passes it as the `paged` keyword
argument of the model call; transformers forwards it untouched to every attention layer, which
calls `paged_attention` with post-RoPE q/k/v for all scheduled tokens of all requests in one row:
  1. the new k/v land in the layer's pool tensors at `slot_mapping`,
  2. decode tokens (one query each, packed first, sorted by context length) attend to their context
     group by group: a group's blocks are gathered into a reused workspace (no fresh allocation, so
     no page faults), padded only to the group's own longest context, and the group's query heads
     that share a KV head are passed to SDPA as query rows of that head (GQA with one read of K/V),
  3. each prefill chunk attends causally to its prefix (cached blocks) plus itself,
  4. `on_layer_written` (if set) is told the layer is complete, so a KV sender can ship it.
Everything that depends only on the batch (groups, block tables, masks) is built once per step by the
ModelRunner; per layer a decode group costs two `index_select`s and one SDPA call. No per-token Python.
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
from engine.attention_batched import BatchedMetadata
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
class DecodeGroup:
    """Decode tokens `start .. start+num` of the packed batch with similar context lengths."""

    start: int
    num: int
    width: int
    """Blocks per row: enough for the group's longest context."""
    block_table: torch.Tensor
    """[num * width] block ids, row-major, rows padded with block 0."""
    key_mask: torch.Tensor | None
    """[num, 1, 1, width * block_size] True where a key position is valid; None when nothing is padding."""


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
    """The first `num_decode_tokens` packed tokens are single-token decodes."""
    decode_groups: list[DecodeGroup]
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
    for group in paged.decode_groups:
        _decode_attention(q, out, group, paged, layer, scaling)
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


def _decode_attention(
    q: torch.Tensor, out: torch.Tensor, group: DecodeGroup, meta: AttentionMetadata, layer: int, scaling: float | None
) -> None:
    """Single-token queries `q[start:start+num]` against each request's paged context.

    The `H / Hkv` query heads that share a KV head go to SDPA as that head's query rows: one GEMM per
    (request, KV head) reads K and V once, and no KV head is repeated."""
    b, h, d = group.num, q.shape[1], q.shape[2]
    k, v = _gather_blocks(meta, layer, group.block_table)
    hkv = k.shape[2]
    k = k.view(b, -1, hkv, d).transpose(1, 2)  # [b, Hkv, L, D] strided view of the workspace
    v = v.view(b, -1, hkv, d).transpose(1, 2)
    s, e = group.start, group.start + b
    qg = q[s:e].reshape(b, hkv, h // hkv, d)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.key_mask, scale=scaling)
    out[s:e] = o.view(b, h, d)


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
