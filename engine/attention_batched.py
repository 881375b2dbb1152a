"""Batched paged attention: every request of a step in one call per layer (the GPU path).

The CPU path (engine.attention) loops over decode groups and prefill chunks inside each layer, which
is right for a CPU (small gathers that stay in cache). On a GPU each Python iteration is a kernel
launch, so here a step's attention is at most two calls per layer, whatever the batch:
  decode    the single-token rows, padded to a fixed batch and table width, through a
            `paged_decode` kernel (graph-capturable: fixed shapes, lengths read on the device),
  prefill   all prefill chunks at once: their blocks (earlier context and the chunk itself, already
            written to the pool) gathered with one `index_select`, then one SDPA whose boolean mask
            lets each token see its own request's keys up to its own position.
Per step the runner builds `BatchedMetadata` from plain lists (`decode_rows`, `prefill_batch`): a
few small host arrays copied to the device once, then reused by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


@dataclass
class DecodeBatch:
    block_table: torch.Tensor
    """[B, W] int32 block ids per row (padding: the pool's scratch block)."""
    context_lens: torch.Tensor
    """[B] int32 keys per row, the new token included."""
    kernel: Callable
    query_starts: torch.Tensor | None = None
    """[B + 1] int32 where each row's queries start when some row has several (verifying rows, CPU path); None: one each."""


@dataclass
class PrefillBatch:
    block_ids: torch.Tensor
    """[N] long: the blocks of every prefill chunk's request (context + chunk), chunk after chunk."""
    mask: torch.Tensor
    """[1, 1, T, N * block_size] True where a chunk token may attend to a gathered key position."""


@dataclass
class BatchedMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    on_layer_written: Callable[[int], None] | None = None


def attend(q: torch.Tensor, meta: BatchedMetadata, layer: int, scaling: float | None) -> torch.Tensor:
    """q [T, H, D] (decodes first) -> attention output [T, H, D]."""
    kc, vc = meta.kv_cache.key_caches[layer], meta.kv_cache.value_caches[layer]
    nd = meta.num_decode_tokens
    parts = []
    if meta.decode is not None:
        d = meta.decode
        parts.append(d.kernel(q[:nd], kc, vc, d.block_table, d.context_lens, scaling))
    if meta.prefill is not None:
        parts.append(_prefill(q[nd:], kc, vc, meta.prefill, scaling))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


def decode_rows(
    tables: list[list[int]], num_computed: list[int], last_tokens: list[int], rows: int, width: int, block_size: int, scratch_block: int
) -> DecodeRows:
    """`rows` >= len(tables) rows; padding rows decode token 0 at position 0 into the scratch block."""
    n = len(tables)
    table = np.full((rows, width), scratch_block, dtype=np.int32)
    for i, blocks in enumerate(tables):
        used = min(len(blocks), width)
        table[i, :used] = blocks[:used]
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
