"""Paged KV pool: per-layer key and value tensors carved into fixed-size blocks.

Lifecycle: created once by the engine from a memory budget (`KVCache.blocks_for_budget`),
written by the attention function through a slot mapping (slot = block_id * block_size + offset),
read through per-request block tables, and written directly by KV receivers on a decode worker.
The pool never allocates; which block belongs to whom is the BlockManager's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine_config import EngineConfig
from engine import host_memory


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model; identical on every worker that exchanges KV."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K plus V for one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * self.bytes_per_token_per_layer


class KVCache:
    """Key and value tensors `[num_blocks + 1, block_size, kv_heads, head_dim]` for every layer.

    Block `scratch_block` (= num_blocks, past the usable ones, never handed out) is where padding rows
    of a fixed-size batch (CUDA graphs) write and read, so they never touch a request's KV."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.layout = layout
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        shape = (num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.key_caches = [self._zeros(shape, layout.dtype, device) for _ in range(layout.num_layers)]
        self.value_caches = [self._zeros(shape, layout.dtype, device) for _ in range(layout.num_layers)]

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """On a CPU on huge pages (engine.host_memory): a decode step reads the live requests' blocks all over the pool."""
        if torch.device(device).type == "cpu":
            return host_memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return budget_bytes // layout.bytes_per_block

    @staticmethod
    def blocks_for_config(layout: KVLayout, config: EngineConfig) -> int:
        """`num_kv_blocks`, else on CUDA a share of the device's free memory (`kv_cache_memory_fraction`,
        measured now: call after the weights are loaded), else `kv_cache_memory_mb`."""
        if config.num_kv_blocks:
            return config.num_kv_blocks
        budget = config.kv_cache_memory_mb << 20
        if config.kv_cache_memory_fraction is not None and torch.device(config.device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(torch.device(config.device))
            budget = int(free * config.kv_cache_memory_fraction)
        return max(1, KVCache.blocks_for_budget(layout, budget))

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Flat slot indices of the first `num_tokens` token positions held by `block_ids`."""
        bs = self.layout.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long)
        flat = (blocks[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)
        return flat[:num_tokens]

    def read_tokens(self, layer: int, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy out K and V `[num_tokens, kv_heads, head_dim]` of one layer for one request."""
        slots = self.slots(block_ids, num_tokens).to(self.key_caches[layer].device)
        flat_k = self.key_caches[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim)
        flat_v = self.value_caches[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim)
        return flat_k.index_select(0, slots), flat_v.index_select(0, slots)

    def write_tokens(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor, first_head: int = 0) -> None:
        """Write K and V `[num_tokens, heads, head_dim]` of one layer into a request's blocks: all the
        pool's KV heads, or `heads` of them from `first_head` on (one piece of a tensor-parallel transfer)."""
        slots = self.slots(block_ids, k.shape[0]).to(self.key_caches[layer].device)
        heads = k.shape[1]
        flat_k = self.key_caches[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim).narrow(1, first_head, heads)
        flat_v = self.value_caches[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim).narrow(1, first_head, heads)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
