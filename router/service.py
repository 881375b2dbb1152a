"""`RouterService`: the transport-neutral core both front ends call with a `RouterRequest`.

Life of one request through `stream`:
  1. validate and tokenize once (`router.validation`); a bad request raises InvalidRequestError;
  2. admission against the bounded queue (`router.admission`): Overloaded when full, Unavailable
     while draining; both are raised before the first message;
  3. orchestrate across workers (`router.orchestration`: decode admission, prefill, retries,
     migrations) and relay D's tokens (`router.relay`); later failures end the stream with a
     message whose `error` is set;
  4. release the admission slot and count the outcome once (`pdserve_requests_total{outcome}`):
     `ok` when the final message was a normal finish, whatever the front end does with the stream
     afterwards; `error` when it carried an error; `cancelled` when the stream was closed before
     its final message (client gone: closing the stream cancels the work on D and P); `invalid`
     and `overloaded` for refusals (`error` too for one while draining).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from common.errors import InvalidRequestError
from common.tracing import annotate, context_of, fail, span
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.admission import Admission, Overloaded, Unavailable
from router.metrics import RouterMetrics
from router.orchestration import Orchestrator
from router.pool import WorkerPool
from router.request import RouterRequest
from router.settings import RouterSettings
from router.validation import Validator


class RouterService:
    def __init__(self, settings: RouterSettings, tokenizer, pool: WorkerPool, metrics: RouterMetrics):
        self.settings = settings
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.admission = Admission(settings.config.max_queued_requests, settings.config.max_queued_tokens, metrics)
        self.validator = Validator(settings, tokenizer)
        self.orchestrator = Orchestrator(settings, tokenizer, pool, metrics)
        self.draining = False

    async def stream(self, request: RouterRequest, timeout_s: float | None = None,
                     trace_parent: Context | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Raises InvalidRequestError, Overloaded or Unavailable before the first message; later
        failures end the stream with a message whose `error` is set. The client's deadline
        (`timeout_s`) bounds every call to the workers. The request's root span `generate` continues
        the client's trace when `trace_parent` carries one (common/tracing.py)."""
        request_id = request.request_id or uuid.uuid4().hex
        with span("generate", trace_parent or Context(), SpanKind.SERVER, request_id=request_id) as root:
            async with aclosing(self._stream(request, request_id, timeout_s, root)) as responses:  # closed with this stream
                async for response in responses:
                    yield response

    async def _stream(self, request: RouterRequest, request_id: str, timeout_s: float | None, root: Span) -> AsyncIterator[pb.GenerateResponse]:
        arrived = time.monotonic()
        limit_s = self.settings.config.request_timeout_s
        deadline = arrived + min(timeout_s or limit_s, limit_s)
        try:
            valid = self.validator.validate(request)
        except InvalidRequestError:
            self._count(root, "invalid")
            raise
        if self.draining:
            self._count(root, "error")
            raise Unavailable("router is draining")
        prompt_tokens = len(valid.prompt_ids)
        annotate(root, prompt_tokens=prompt_tokens)
        try:
            self.admission.acquire(prompt_tokens)
        except Overloaded:
            self._count(root, "overloaded")
            raise
        outcome = None  # set by the final message; None while the request is unfinished
        try:
            first = True
            async for response in self.orchestrator.run(request_id, valid, request.skip_detokenize, arrived, deadline, context_of(root)):
                if first:
                    response.prompt_token_ids.extend(valid.prompt_ids)
                    first = False
                if response.finish_reason:
                    outcome = "error" if response.finish_reason == pb.FINISH_REASON_ERROR else "ok"
                    _record_final(root, response)
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # a front end closing the stream after its final message is not a cancellation
            outcome = outcome or "cancelled"
            raise
        except InvalidRequestError:
            outcome = "invalid"
            raise
        except Overloaded:
            outcome = "overloaded"
            raise
        finally:
            self.admission.release(prompt_tokens)
            self._count(root, outcome or "error")

    def _count(self, root: Span, outcome: str) -> None:
        """The request's outcome, counted once (`pdserve_requests_total{outcome}`) and on its span."""
        self.metrics.requests.labels(outcome=outcome).inc()
        annotate(root, outcome=outcome)


def _record_final(root: Span, response: pb.GenerateResponse) -> None:
    annotate(root, finish_reason=pb.FinishReason.Name(response.finish_reason), completion_tokens=response.usage.completion_tokens)
    if response.HasField("error"):
        fail(root, response.error.message)
