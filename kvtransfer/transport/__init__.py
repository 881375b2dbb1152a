"""Transports that move KV frames and payloads: `ucx`, `tcp` and `local` (see `base`)."""

from kvtransfer.transport.base import (
    Channel,
    ChannelClosed,
    Listener,
    Transport,
    get_transport,
)

__all__ = ["Channel", "ChannelClosed", "Listener", "Transport", "get_transport"]
