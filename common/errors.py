"""Typed errors of a request's life (raised by the engine, the router and the CLI). Every validation error names the offending field."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of engine errors."""


class InvalidRequestError(EngineError, ValueError):
    """A request field is out of range or malformed; `field` names it (maps to INVALID_ARGUMENT / 400)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class ModelLoadError(EngineError):
    """The model could not be resolved or loaded; `field` names the config field that pointed at it."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")



class RankLost(EngineError):
    """A rank of the engine's tensor-parallel group exited: no step can run again; the worker is lost
    as a whole (its requests fail or migrate, the controller replaces the worker)."""
