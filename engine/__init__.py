"""pdserve engine: the model runtime shared by the prefill and decode pools.

Names are resolved lazily so that light users (`engine.kv_cache`, `engine.errors`) do not pay for
importing transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine.engine",
    "EngineStats": "engine.engine",
    "RequestOutput": "engine.engine",
    "EngineConfig": "common.engine_config",
    "EngineError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "SamplingParams": "engine.sampling",
    "FinishReason": "engine.sequence",
    "RequestState": "engine.sequence",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
