"""Where a prefill engine hands each finished layer of a prompt's KV: the `KVLayerSink` given to
`Engine` at construction (as vLLM gives its engine a KV connector).

Lifecycle: during the step that completes a prefill-only request's prompt, after each layer's
forward has written that layer's K/V into the pool, the engine asks the sink whether it `wants`
the request and, if so, calls `layer_ready` with a copy of the prompt's K and V for that layer
(`[num_prompt_tokens, kv_heads, head_dim]` each), so layer L travels while layer L+1 computes.
Both run on the engine thread, inside the forward: they must return at once (enqueue, never wait).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.kv_cache import KVCache


class KVLayerSink(Protocol):
    def wants(self, request_id: str) -> bool:
        """Whether the KV of this prefill-only request should be handed over layer by layer."""
        ...

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer` of the request's prompt KV is complete; `k` and `v` are the sink's to keep."""
        ...


@dataclass(frozen=True)
class SinkRequest:
    """A prompt whose KV goes to the sink during this step (plain data: broadcast to every rank)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


def layer_hook(kv_cache: KVCache, sink: KVLayerSink | None, requests: list[SinkRequest]) -> Callable[[int], None] | None:
    """What the model runner calls after each layer: hand that layer's KV of `requests` (read from
    this rank's pool) to the sink. None when there is nothing to hand over."""
    if sink is None or not requests:
        return None

    def layer_written(layer: int) -> None:
        for request in requests:
            k, v = kv_cache.read_tokens(layer, request.block_ids, request.num_tokens)
            sink.layer_ready(request.request_id, layer, k, v)

    return layer_written
