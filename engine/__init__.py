"""pdserve engine: the model runtime shared by the prefill and decode pools.

Names are resolved lazily so that light users (`engine.kv_cache`) do not pay for importing
transformers. The request types (errors, SamplingParams, FinishReason) live in common/, below the
engine, so that the router never loads it; they are exported here too for engine users.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine.engine",
    "EngineStats": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "EngineConfig": "common.engine_config",
    "EngineError": "common.errors",
    "InvalidRequestError": "common.errors",
    "ModelLoadError": "common.errors",
    "SamplingParams": "common.sampling",
    "FinishReason": "common.request_types",
    "RequestState": "engine.sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
