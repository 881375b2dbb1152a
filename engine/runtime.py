"""One rank's model runtime: the loaded model (its shard, under tensor parallelism), its paged KV
pool and the model runner over both. The engine builds one for rank 0; each follower rank of a
tensor-parallel group builds its own (engine.parallel.follower)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.engine_config import EngineConfig
from engine.kv_cache import KVCache, KVLayout
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner


@dataclass
class Runtime:
    loaded: LoadedModel
    layout: KVLayout
    kv_cache: KVCache
    runner: ModelRunner
    max_model_len: int


def kv_layout(loaded: LoadedModel, config: EngineConfig) -> KVLayout:
    """The KV layout of one rank: its share of the model's KV heads."""
    mc = loaded.config
    return KVLayout(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads // config.tensor_parallel_size,
        head_dim=getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads,
        block_size=config.block_size,
        dtype=loaded.dtype,
    )


def build_runtime(config: EngineConfig, loaded: LoadedModel | None = None) -> Runtime:
    loaded = loaded or load_model(config.model, config.dtype, config.device, config.tensor_parallel_size)
    layout = kv_layout(loaded, config)
    num_blocks = _agreed_block_count(KVCache.blocks_for_config(layout, config), config)
    kv_cache = KVCache(layout, num_blocks, config.device)
    max_model_len = config.max_model_len or loaded.config.max_position_embeddings
    graphs = min(config.cuda_graph_max_batch, config.max_num_seqs) if config.tensor_parallel_size == 1 else 0
    runner = ModelRunner(loaded.model, kv_cache, config.device, max_model_len=max_model_len, cuda_graph_max_batch=graphs)
    return Runtime(loaded, layout, kv_cache, runner, max_model_len)


def _agreed_block_count(mine: int, config: EngineConfig) -> int:
    """Every rank of a group must have the same blocks (rank 0's block tables address them all): the
    smallest count any rank can afford (they differ only when sized from free GPU memory)."""
    if config.tensor_parallel_size == 1:
        return mine
    count = torch.tensor([mine], dtype=torch.long, device=config.device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())
