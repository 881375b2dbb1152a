"""What a request is outside the engine's tensors: its priority's range and how it finished.

Torch-free, so that the router, the CLI and the wire conversions (proto/convert.py) share these
with the engine without loading it.
"""

from __future__ import annotations

import enum

from common.errors import InvalidRequestError

PRIORITY_RANGE = (-1000, 1000)
"""A request's `priority`: higher is more important; 0 is the default."""


def check_priority(value: object) -> int:
    """The request's priority, or InvalidRequestError naming `priority`."""
    low, high = PRIORITY_RANGE
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError("priority", f"must be an integer in [{low}, {high}] (higher runs first), got {value!r}")
    return value


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PREFILLED = "prefilled"
    ERROR = "error"
