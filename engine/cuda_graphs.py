"""CUDA graphs of pure decode steps, one per batch-size bucket.

Lifecycle: `DecodeGraphs(...)` allocates the static inputs once (token ids, positions, slots, a
block table as wide as `max_model_len`, context lengths) sized for the largest bucket; `capture()`
records the model's forward for every bucket, largest first, sharing one memory pool; each step,
`run(rows)` copies the step's host arrays (already padded to a bucket by the runner) into the static
inputs through pinned buffers and replays that bucket's graph. Padding rows write and read only the
pool's scratch block. The decode kernel must read lengths on the device and ignore table width
(paged_decode's triton kernel), which is why the runner only builds graphs with it.
Capture itself needs CUDA; uncaptured (CPU tests), `run` runs the same forward on the same static
inputs eagerly, so padding, buckets and the scratch block are tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, DecodeBatch, DecodeRows
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to max_batch (which is always the last)."""
    sizes = [b for b in _SMALL_BUCKETS if b < max_batch] + list(range(96, max_batch, 32))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_batch: int, width: int, kernel: Callable):
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.width = width
        self.sizes = buckets(max_batch)
        self.max_batch = self.sizes[-1]
        device = kv_cache.key_caches[0].device
        b = self.max_batch
        self._static = {
            "input_ids": torch.zeros(b, dtype=torch.long, device=device),
            "positions": torch.zeros(b, dtype=torch.long, device=device),
            "slots": torch.full((b,), kv_cache.scratch_block * kv_cache.layout.block_size, dtype=torch.long, device=device),
            "block_table": torch.full((b, width), kv_cache.scratch_block, dtype=torch.int32, device=device),
            "context_lens": torch.ones(b, dtype=torch.int32, device=device),
        }
        pin = device.type == "cuda"
        self._host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in self._static.items()}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.steps = 0
        """Steps served (replayed, or run eagerly when not captured)."""

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b] = self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs at batch sizes %s", self.sizes)

    def _forward(self, b: int) -> torch.Tensor:
        s = self._static
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=s["slots"][:b],
            num_decode_tokens=b,
            decode=DecodeBatch(s["block_table"][:b], s["context_lens"][:b], self.kernel),
            prefill=None,
        )
        out = self.model(input_ids=s["input_ids"][:b].unsqueeze(0), position_ids=s["positions"][:b].unsqueeze(0), use_cache=False, paged=meta)
        return out.logits[0]

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Logits `[bucket, vocab]` of the padded rows (a view into the graph's output: use before the next run)."""
        b = rows.input_ids.shape[0]
        for name, array in (
            ("input_ids", rows.input_ids), ("positions", rows.positions), ("slots", rows.slots),
            ("block_table", rows.block_table), ("context_lens", rows.context_lens),
        ):
            host = self._host[name][:b]
            host.numpy()[...] = array
            self._static[name][:b].copy_(host, non_blocking=True)
        self.steps += 1
        graph = self._graphs.get(b)
        if graph is None:  # not captured (CPU tests): the same static inputs, run eagerly
            return self._forward(b)
        graph.replay()
        return self._outputs[b]

