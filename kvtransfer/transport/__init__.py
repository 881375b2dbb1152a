"""Transports that move KV frames and payloads: `ucx`, `tcp` and `local` (see `base`), registered by
name in common/plugins.py KV_TRANSPORTS and built by `get_transport(name)`."""

from kvtransfer.transport.base import (
    Channel,
    ChannelClosed,
    Listener,
    Transport,
    get_transport,
)

__all__ = ["Channel", "ChannelClosed", "Listener", "Transport", "get_transport"]
