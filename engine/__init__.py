"""pdserve engine: the model runtime shared by the prefill and decode pools."""

from engine.config import EngineConfig
from engine.engine import Engine, EngineStats, RequestOutput
from engine.errors import EngineError, InvalidRequestError, ModelLoadError
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, RequestState

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "RequestState",
    "SamplingParams",
]
