"""Byte views of tensors and of a request's blocks inside the paged KV pool.

Lifecycle: a receiver builds one `PoolTarget` per transfer once the header is validated; for
each layer it hands the target's views to the channel, which writes payload bytes straight
into the pool (CPU pool: one view per run of consecutive blocks, no staging) or into a host
staging buffer that `commit()` copies in with `KVCache.write_tokens` (non-CPU pools, or
`zero_copy=False`). The target never allocates blocks and never frees them.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kv_cache import KVCache

K, V = 0, 1


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of `t`'s bytes (copied to contiguous host memory first if needed)."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def block_runs(block_ids: list[int], num_tokens: int, block_size: int) -> list[tuple[int, int, int]]:
    """Split a block table into runs of consecutive block ids: (first_block, num_blocks, tokens)."""
    needed = -(-num_tokens // block_size)
    if needed > len(block_ids):
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, got {len(block_ids)}")
    runs: list[tuple[int, int, int]] = []
    remaining = num_tokens
    for bid in block_ids[:needed]:
        take = min(block_size, remaining)
        remaining -= take
        if runs and runs[-1][0] + runs[-1][1] == bid:
            first, count, tokens = runs[-1]
            runs[-1] = (first, count + 1, tokens + take)
        else:
            runs.append((bid, 1, take))
    return runs


class PoolTarget:
    """Destination of one transfer: byte views per layer and part (K or V) in token order."""

    def __init__(self, cache: KVCache, block_ids: list[int], num_tokens: int, zero_copy: bool = True,
                 heads: tuple[int, int] | None = None):
        """heads: (first, count) of the pool's KV heads this transfer fills (one tensor-parallel
        piece: staged, then written into those heads); None: all of them."""
        layout = cache.layout
        if any(not 0 <= b < cache.num_blocks for b in block_ids):
            raise ValueError(f"block id out of range [0, {cache.num_blocks})")
        self.cache = cache
        self.block_ids = list(block_ids)
        self.num_tokens = num_tokens
        self.runs = block_runs(self.block_ids, num_tokens, layout.block_size)
        self.first_head, self.num_heads = heads or (0, layout.num_kv_heads)
        self.row_elems = self.num_heads * layout.head_dim
        whole_rows = self.num_heads == layout.num_kv_heads
        self.direct = zero_copy and whole_rows and cache.key_caches[0].device.type == "cpu"
        self._staging: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def for_heads(self, first: int, count: int) -> PoolTarget:
        """The same blocks, filled with `count` heads from `first` on."""
        return PoolTarget(self.cache, self.block_ids, self.num_tokens, self.direct, (first, count))

    @property
    def part_nbytes(self) -> int:
        elem = self.cache.key_caches[0].element_size()
        return self.num_tokens * self.row_elems * elem

    def views(self, layer: int, part: int) -> list[memoryview]:
        """Writable byte views that together hold this layer's K (part 0) or V (part 1)."""
        if self.direct:
            pool = (self.cache.key_caches if part == K else self.cache.value_caches)[layer]
            return [
                memoryview(tensor_bytes(pool[first : first + count].reshape(-1)[: tokens * self.row_elems]))
                for first, count, tokens in self.runs
            ]
        staged = self._staging.get(layer)
        if staged is None:
            layout = self.cache.layout
            shape = (self.num_tokens, self.num_heads, layout.head_dim)
            staged = (torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype))
            self._staging[layer] = staged
        return [memoryview(tensor_bytes(staged[part]))]

    def commit(self, layer: int) -> None:
        """Make a verified layer visible in the pool (a no-op when it was received in place)."""
        staged = self._staging.pop(layer, None)
        if staged is not None:
            k, v = staged
            device = self.cache.key_caches[layer].device
            if device.type != "cpu":
                k, v = k.to(device), v.to(device)
            self.cache.write_tokens(layer, self.block_ids, k, v, self.first_head)

    def release(self) -> None:
        """Drop staging buffers of layers that will never be committed."""
        self._staging.clear()
