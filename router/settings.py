"""What this router serves and how it is configured, fixed at start: `RouterSettings`.

Built once by `router.main` (model name and context length found at start, the `router` config
section, API keys from the config and PDSERVE_API_KEYS); read by every other router module.
`authorized` is the API-key check both front ends apply before anything else.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field

from common.config import PdserveConfig, RouterConfig


@dataclass(frozen=True)
class RouterSettings:
    """What this router serves (found at start) and its `router` config section."""

    model_name: str
    max_model_len: int
    transport: str
    config: RouterConfig = field(default_factory=RouterConfig)
    api_keys: frozenset[str] = frozenset()
    """The configured keys plus those in PDSERVE_API_KEYS (see `from_config`)."""
    rpc_timeout_s: float = 30.0
    """Longest wait for a decode worker's admission message (not for tokens)."""
    kv_dtype: str = "float32"
    """The workers' dtype (engine.dtype): how far two correct runs' logprobs may differ (router/shadow.py)."""

    @classmethod
    def from_config(cls, config: PdserveConfig, max_model_len: int) -> RouterSettings:
        env_keys = filter(None, os.environ.get("PDSERVE_API_KEYS", "").split(","))
        return cls(model_name=config.model_name, max_model_len=max_model_len, transport=config.kv_transfer.transport,
                   config=config.router, api_keys=frozenset([*config.router.api_keys, *env_keys]), kv_dtype=config.engine.dtype)

    def authorized(self, authorization: str | None) -> bool:
        """True when no keys are configured, or `authorization` is `Bearer <a configured key>`."""
        if not self.api_keys:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(key.strip(), k) for k in self.api_keys)
