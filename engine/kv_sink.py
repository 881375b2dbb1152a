"""Where a prefill engine hands each finished layer of a prompt's KV: the `KVLayerSink` given to
`Engine` at construction (as vLLM gives its engine a KV connector).

Lifecycle: during the step that completes a prefill-only request's prompt, after each layer's
forward has written that layer's K/V into the pool, the engine asks the sink from which prompt
position on it wants the request's KV (`wanted_from`: None for not at all, a whole number of blocks
when the receiver already holds the prompt's leading blocks) and calls `layer_ready` with a copy of
the prompt's K and V for that layer from there on (`[num_prompt_tokens - start, kv_heads, head_dim]`
each), so layer L travels while layer L+1 computes.
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
    def wanted_from(self, request_id: str) -> int | None:
        """The first prompt position whose KV this prefill-only request hands over layer by layer (a
        multiple of the block size), or None: not wanted."""
        ...

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer` of the request's prompt KV (from `wanted_from` on) is complete; `k` and `v` are
        the sink's to keep."""
        ...


@dataclass(frozen=True)
class SinkRequest:
    """A prompt whose KV goes to the sink during this step (plain data: broadcast to every rank)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    start: int = 0
    """The first prompt position handed over (whole blocks: the receiver holds the ones before)."""


def layer_hook(kv_cache: KVCache, sink: KVLayerSink | None, requests: list[SinkRequest]) -> Callable[[int], None] | None:
    """What the model runner calls after each layer: hand that layer's KV of `requests` (read from
    this rank's pool) to the sink. None when there is nothing to hand over."""
    if sink is None or not requests:
        return None

    def layer_written(layer: int) -> None:
        for request in requests:
            first_block = request.start // kv_cache.layout.block_size
            k, v = kv_cache.read_tokens(layer, request.block_ids[first_block:], request.num_tokens - request.start)
            sink.layer_ready(request.request_id, layer, k, v)

    return layer_written
