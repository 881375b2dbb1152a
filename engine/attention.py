"""Paged attention for a packed batch, plugged into transformers through `AttentionInterface`.

Per forward pass the ModelRunner builds one `AttentionMetadata` and passes it as the `paged` keyword
argument of the model call; transformers forwards it untouched to every attention layer, which calls
`paged_attention` with post-RoPE q/k/v for all scheduled tokens of all requests in one row:
  1. the new k/v land in the layer's pool tensors at `slot_mapping`,
  2. `attend` runs the step's rows through at most two of:
     decode    rows through a `paged_decode` kernel that reads K and V where they lie in the pool. On a
               CPU with the C++ kernel every request of the step but those under `prompts` is such a row: a
               decode (one query), a request verifying proposed tokens (1 + k queries) or a short prefill
               chunk after cached keys (its n tokens), the
               queries being the last positions of the row's context, causal inside the row; no gather,
               no mask, each row reads only its own blocks (engine.kernels tiles long rows). On a GPU the
               rows are the single-token decodes, padded to a fixed batch and table width
               (graph-capturable: fixed shapes, lengths read on the device). Whole prompts are
               kernel rows too where the kernel attends them clearly faster than SDPA (engine.prompt_attention
               measures it once per machine: on a Zen 4 EPYC in fp32 and bf16, not in bf16 on an AMX Xeon).
     prompts   (CPU with the C++ kernel) prefill chunks (`PromptChunk`) follow the kernel's rows, each
               in one `F.scaled_dot_product_attention` call of its own: a chunk that starts its request's
               context attends to its own k/v, causal, what transformers runs on a prompt, so the same
               sums; a chunk after cached keys attends to its context's blocks gathered from the pool
               (itself included) under a causal mask, which for the prompt's last chunk is the sum of
               transformers' one call over the whole prompt (the same key splits; in bf16 on an AMX
               Xeon the same bits) (torch's flash attention, which on a CPU with AMX packs for its
               tiles and attends a prompt 3x faster in bf16 than the C++ kernel; 1.25x in float32),
     prefill   (GPU, and CPUs without the C++ kernel) all prefill chunks at once: their blocks (earlier
               context and the chunk itself, already written to the pool) gathered with one
               `index_select`, then one SDPA whose boolean mask lets each token see its own request's
               keys up to its own position,
  3. `on_layer_written` (if set) is told the layer is complete, so a KV sender can ship it.
Everything that depends only on the batch (block tables, lengths, masks) is built once per step by the
ModelRunner from plain lists (`decode_rows`, `prefill_batch`): a few small host arrays copied to the
device once, then reused by every layer. No per-token Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import KVCache


@dataclass
class DecodeBatch:
    """The rows one `paged_decode` kernel call attends per layer (the first `num_decode_tokens` packed tokens)."""

    block_table: torch.Tensor
    """[B, W] int32 block ids per row (padding: the pool's scratch block)."""
    context_lens: torch.Tensor
    """[B] int32 keys per row, the new token included."""
    kernel: Callable
    query_starts: torch.Tensor | None = None
    """[B + 1] int32 where each row's queries start when some row has several (verifying rows and prefill
    chunks, CPU path); None: one each."""


@dataclass
class PrefillBatch:
    block_ids: torch.Tensor
    """[N] long: the blocks of every prefill chunk's request (context + chunk), chunk after chunk."""
    mask: torch.Tensor
    """[1, 1, T, N * block_size] True where a chunk token may attend to a gathered key position."""


@dataclass
class PromptChunk:
    """A prefill chunk attended by its own SDPA call (CPU path)."""

    num_tokens: int
    context_blocks: torch.Tensor | None = None
    """[N] long: for a chunk after cached keys, the blocks of its context and itself; None: the chunk
    starts its request's context and attends to its own k/v."""
    mask: torch.Tensor | None = None
    """[num_tokens, context + num_tokens] True where a chunk token may attend to a key (with `context_blocks`)."""


def prompt_chunk(block_ids: list[int], start: int, num_tokens: int, block_size: int, device: torch.device) -> PromptChunk:
    """The chunk of `num_tokens` tokens at `start` of a request whose blocks are `block_ids`."""
    if start == 0:
        return PromptChunk(num_tokens)
    keys = start + num_tokens
    blocks = torch.tensor(block_ids[: -(-keys // block_size)], dtype=torch.long, device=device)
    mask = torch.arange(keys, device=device).unsqueeze(0) <= torch.arange(start, keys, device=device).unsqueeze(1)
    return PromptChunk(num_tokens, blocks, mask)


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    on_layer_written: Callable[[int], None] | None = None
    prompts: list[PromptChunk] | None = None
    """The prefill chunks attended by SDPA one by one, in packed order after the kernel's rows (CPU
    path; None: no such chunk, or the path attends them in `prefill`)."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, layer: int, scaling: float | None) -> torch.Tensor:
    """q [T, H, D], this step's k/v [T, Hkv, D] (the kernel's rows first) -> attention output [T, H, D]."""
    kc, vc = meta.kv_cache.key_caches[layer], meta.kv_cache.value_caches[layer]
    nd = meta.num_decode_tokens
    parts = []
    if meta.decode is not None:
        d = meta.decode
        parts.append(d.kernel(q[:nd], kc, vc, d.block_table, d.context_lens, scaling, query_starts=d.query_starts))
    if meta.prefill is not None:
        parts.append(_prefill(q[nd:], kc, vc, meta.prefill, scaling))
    if meta.prompts is not None:
        parts.extend(prompts_through_sdpa(q[nd:], k[nd:], v[nd:], kc, vc, meta.prompts, scaling))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def prompts_through_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunks: list[PromptChunk],
                        scaling: float | None) -> list[torch.Tensor]:
    """Each prefill chunk's causal attention, in the layout transformers hands SDPA: over its own k/v, or
    over its context's (and its own) k/v in the pool."""
    out, first = [], 0
    for chunk in chunks:
        rows = slice(first, first + chunk.num_tokens)
        qp = _heads_first(q[rows])
        if chunk.context_blocks is None:
            attended = F.scaled_dot_product_attention(qp, _heads_first(k[rows]), _heads_first(v[rows]), is_causal=True, scale=scaling,
                                                      enable_gqa=True)
        else:
            kp, vp = (_heads_first(_gather(cache, chunk)) for cache in (kc, vc))
            attended = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scaling, enable_gqa=True)
        out.append(attended[0].transpose(0, 1))
        first += chunk.num_tokens
    return out


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] -> [1, heads, T, D] contiguous."""
    return t.transpose(0, 1).unsqueeze(0).contiguous()


def _gather(cache: torch.Tensor, chunk: PromptChunk) -> torch.Tensor:
    """The chunk's context and own keys (or values) from one layer of the pool: [keys, Hkv, D]."""
    heads, dim = cache.shape[2], cache.shape[3]
    return cache.index_select(0, chunk.context_blocks).view(-1, heads, dim)[: chunk.mask.shape[1]]


def _prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: PrefillBatch, scaling: float | None) -> torch.Tensor:
    hkv, d = kc.shape[2], kc.shape[3]
    groups = q.shape[1] // hkv
    # KV heads repeated: SDPA's fused kernels take a mask but not always GQA; the copy is small.
    k = kc.index_select(0, p.block_ids).view(-1, hkv, d).transpose(0, 1).repeat_interleave(groups, dim=0)
    v = vc.index_select(0, p.block_ids).view(-1, hkv, d).transpose(0, 1).repeat_interleave(groups, dim=0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=p.mask, scale=scaling)
    return out[0].transpose(0, 1)


@dataclass
class DecodeRows:
    """Host arrays of a padded decode batch: what a step copies to the device (or into a graph's inputs)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_table: np.ndarray
    context_lens: np.ndarray


def block_table(tables: list[list[int]], rows: int, width: int, scratch_block: int) -> np.ndarray:
    """[rows, width] int32: each request's first `width` block ids, the rest (and padding rows) the scratch block."""
    table = np.full((rows, width), scratch_block, dtype=np.int32)
    for i, blocks in enumerate(tables):
        used = min(len(blocks), width)
        table[i, :used] = blocks[:used]
    return table


def decode_rows(
    tables: list[list[int]], num_computed: list[int], last_tokens: list[int], rows: int, width: int, block_size: int, scratch_block: int
) -> DecodeRows:
    """`rows` >= len(tables) rows; padding rows decode token 0 at position 0 into the scratch block."""
    n = len(tables)
    table = block_table(tables, rows, width, scratch_block)
    pos = np.zeros(rows, dtype=np.int64)
    pos[:n] = num_computed
    slots = np.full(rows, scratch_block * block_size, dtype=np.int64)
    slots[:n] = table[np.arange(n), pos[:n] // block_size].astype(np.int64) * block_size + pos[:n] % block_size
    ids = np.zeros(rows, dtype=np.int64)
    ids[:n] = last_tokens
    lens = np.ones(rows, dtype=np.int32)
    lens[:n] = pos[:n] + 1
    return DecodeRows(ids, pos, slots, table, lens)


def prefill_batch(chunks: list[tuple[list[int], int, int]], block_size: int, device: torch.device) -> PrefillBatch:
    """chunks: (request's block ids, tokens before the chunk, chunk tokens), in packed order."""
    ids, q_owner, q_pos, k_owner, k_pos = [], [], [], [], []
    for owner, (blocks, ctx, n) in enumerate(chunks):
        used = -(-(ctx + n) // block_size)
        ids.extend(blocks[:used])
        q_owner.append(np.full(n, owner))
        q_pos.append(np.arange(ctx, ctx + n))
        k_owner.append(np.full(used * block_size, owner))
        k_pos.append(np.arange(used * block_size))
    qo, qp = torch.from_numpy(np.concatenate(q_owner)).to(device), torch.from_numpy(np.concatenate(q_pos)).to(device)
    ko, kp = torch.from_numpy(np.concatenate(k_owner)).to(device), torch.from_numpy(np.concatenate(k_pos)).to(device)
    mask = (qo.unsqueeze(1) == ko.unsqueeze(0)) & (kp.unsqueeze(0) <= qp.unsqueeze(1))
    return PrefillBatch(torch.tensor(ids, dtype=torch.long, device=device), mask.view(1, 1, *mask.shape))


ATTN_IMPLEMENTATION = "pdserve_paged"


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
    # query [1, H, T, D]; key/value [1, Hkv, T, D] -> token-major [T, Hkv, D] (views, no copy)
    _write_kv(paged.kv_cache, layer, paged.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), paged, layer, scaling)
    if paged.on_layer_written is not None:
        paged.on_layer_written(layer)
    return out.unsqueeze(0), None


def _write_kv(cache: KVCache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, dim = cache.layout.num_kv_heads, cache.layout.head_dim
    cache.key_caches[layer].view(-1, heads, dim).index_copy_(0, slots, k)
    cache.value_caches[layer].view(-1, heads, dim).index_copy_(0, slots, v)


def register() -> str:
    """Register the attention function. No mask function: for an implementation it has no mask function
    for, transformers skips mask preparation entirely, including its packed-sequence detection, which
    would read a device value (a host sync every step, and no CUDA graph capture)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
