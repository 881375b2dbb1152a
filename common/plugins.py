"""The registries of pluggable parts the config names: KV transports and routing policies.

One table per kind maps each name the config may use to "module:attribute" of its implementation.
The config validates names against these tables (it sits low, in common/, and must not import
kvtransfer or router); the layer that uses a part resolves it by name, importing only the chosen
module (`ucx` pulls in ucxx, which `tcp` and `local` never need). Adding a transport or a policy
is one line here plus its class.
"""

from __future__ import annotations

import importlib
from typing import Any

KV_TRANSPORTS: dict[str, str] = {
    "ucx": "kvtransfer.transport.ucx:UcxTransport",
    "tcp": "kvtransfer.transport.tcp:TcpTransport",
    "local": "kvtransfer.transport.local:LocalTransport",
}
ROUTING_POLICIES: dict[str, str] = {
    "round_robin": "router.policy:RoundRobin",
    "least_loaded": "router.policy:LeastLoaded",
    "prefix_aware": "router.policy:PrefixAware",
    "kv_aware": "router.policy:KVAware",
}


def resolve(table: dict[str, str], name: str, kind: str) -> Any:
    """The implementation registered under `name` in `table`; ValueError names the known ones."""
    target = table.get(name)
    if target is None:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {', '.join(table)}")
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
