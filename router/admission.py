"""Admission into the router: a bounded count of requests and prompt tokens in flight.

`RouterService.stream` acquires a slot after validation and releases it when the stream ends (done,
failed or cancelled); a full router refuses with `Overloaded` (RESOURCE_EXHAUSTED / HTTP 429), a
draining one or one with no worker to serve with `Unavailable` (UNAVAILABLE / HTTP 503).
"""

from __future__ import annotations

from router.metrics import RouterMetrics


class Overloaded(Exception):
    """The router's queue (or a decode worker's) is full: retry later."""


class Unavailable(Exception):
    """No worker can take the request now (maps to UNAVAILABLE / HTTP 503)."""


class Admission:
    """Bounded count of requests and prompt tokens in flight through the router."""

    def __init__(self, max_requests: int, max_tokens: int, metrics: RouterMetrics):
        self.max_requests, self.max_tokens, self.metrics = max_requests, max_tokens, metrics
        self.requests = self.tokens = 0

    def acquire(self, num_tokens: int) -> None:
        if self.requests + 1 > self.max_requests or self.tokens + num_tokens > self.max_tokens:
            raise Overloaded(f"router queue is full ({self.requests} requests, {self.tokens} tokens in flight)")
        self.requests += 1
        self.tokens += num_tokens
        self._publish()

    def release(self, num_tokens: int) -> None:
        self.requests -= 1
        self.tokens -= num_tokens
        self._publish()

    def _publish(self) -> None:
        self.metrics.queue_size.set(self.requests)
        self.metrics.queued_tokens.set(self.tokens)
