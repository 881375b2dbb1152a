"""Where a prefill engine hands each finished layer of a prompt's KV: the `KVLayerSink` given to
`Engine` at construction (as vLLM gives its engine a KV connector).

Lifecycle: during the step that completes a prefill-only request's prompt, after each layer's
forward has written that layer's K/V into the pool, the engine asks the sink whether it `wants`
the request and, if so, calls `layer_ready` with a copy of the prompt's K and V for that layer
(`[num_prompt_tokens, kv_heads, head_dim]` each), so layer L travels while layer L+1 computes.
Both run on the engine thread, inside the forward: they must return at once (enqueue, never wait).
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVLayerSink(Protocol):
    def wants(self, request_id: str) -> bool:
        """Whether the KV of this prefill-only request should be handed over layer by layer."""
        ...

    def layer_ready(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer` of the request's prompt KV is complete; `k` and `v` are the sink's to keep."""
        ...
