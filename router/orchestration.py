"""Orchestration of one validated request across workers: an attempt loop with a retry budget.

Each attempt: pick a decode worker D and open `Decode`; D answers with its KV admission (endpoint +
transfer id), or we ask D to prefill locally (conditional disaggregation: few tokens for D to compute); pick a
prefill worker P and call `Prefill` with D's destination; then relay D's stream. The budget:
  - a failed prefill cancels D's request (its blocks freed) and retries on another P, up to
    `prefill_retries` times;
  - a D that fails admission (dead or hung, nothing streamed yet) or is lost mid-stream costs one
    of `max_migrations`; the next attempt continues from the tokens already streamed.
Out of budget, the stream ends with an error message (UNAVAILABLE). Leaving early (client gone)
cancels D and P.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from common.config import RouterConfig
from common.errors import InvalidRequestError
from common.tracing import annotate, context_of, outgoing_metadata, span
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.admission import Overloaded
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics
from router.pool import NoWorkerAvailable, Worker, WorkerPool
from router.progress import Progress, SequenceProgress, replayable
from router.relay import DecodeLost, DecodeRelay, DecodeStream
from router.settings import RouterSettings
from router.shadow import ShadowChecker
from router.validation import Validated

log = logging.getLogger(__name__)


class PrefillFailed(Exception):
    pass


class GiveUp(Exception):
    """The retry budget is spent (or no worker exists): the stream ends with this error."""


@dataclass
class RetryBudget:
    prefill_retries: int
    max_migrations: int
    prefill_failures: int = 0
    migrations: int = 0

    def retry_prefill(self) -> bool:
        """Counts one failed prefill; True while another attempt is allowed."""
        self.prefill_failures += 1
        return self.prefill_failures <= self.prefill_retries

    def migrate(self) -> bool:
        """Counts one move off a decode worker; True while another attempt is allowed."""
        self.migrations += 1
        return self.migrations <= self.max_migrations


@dataclass
class Attempt:
    """A request admitted on D (and prefilled, unless D prefills locally)."""

    decoder: Worker
    call: DecodeStream
    prefill: pb.PrefillResponse | None


class Orchestrator:
    def __init__(self, settings: RouterSettings, tokenizer, pool: WorkerPool, metrics: RouterMetrics):
        self.settings, self.tokenizer, self.pool, self.metrics = settings, tokenizer, pool, metrics
        self.config: RouterConfig = settings.config
        self.relay = DecodeRelay(self.config.stall_timeout_s, metrics)
        self.local_prefill_threshold = self.config.local_prefill_threshold
        """Starts at the config's; the adaptive controller (deploy/adaptive.py) moves it at run time."""
        self.shadow = ShadowChecker(self.config.shadow_check_fraction, settings.kv_dtype, pool, metrics)
        """The canary: recomputes a sample of disaggregated requests colocated and compares."""

    async def run(self, request_id: str, request: Validated, skip_detokenize: bool, arrived: float,
                  deadline: float, trace: Context | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """`trace`: the request's root span as parent (tracing); None: the attempts' spans start new traces."""
        sequences = [SequenceProgress(i, None if skip_detokenize else IncrementalDetokenizer(
            self.tokenizer, request.prompt_ids, request.stop, min_tokens=request.params.min_tokens)) for i in range(request.params.n)]
        state = Progress(request_id, request.prompt_ids, replayable(request.params), arrived, deadline, sequences, trace=trace or Context(),
                         priority=request.priority)
        budget = RetryBudget(self.config.prefill_retries, self.config.max_migrations)
        failed_prefill: set[str] = set()
        while True:
            try:
                attempt = await self._attempt(state, budget, failed_prefill)
            except GiveUp as exc:
                yield error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, str(exc))
                return
            if attempt is None:
                continue
            if attempt.prefill is not None:
                self.metrics.kv_bytes.labels(transport=self.settings.transport).inc(attempt.prefill.kv_bytes_sent)
                self.metrics.kv_blocks.labels(outcome="reused").inc(state.timings.kv_blocks_reused)
                self.metrics.kv_blocks.labels(outcome="moved").inc(state.timings.kv_blocks_moved)
            decoder = attempt.decoder
            decoder.in_flight += 1
            try:
                ended_well = False
                async for response in self.relay.relay(attempt.call, state, decoder):
                    ended_well = response.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
                    yield response
                if ended_well:
                    self.shadow.consider(state)
                return
            except DecodeLost as exc:
                if not self._migrate(decoder, state, budget, exc):
                    yield error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, f"decode worker lost {budget.migrations} times: {exc}")
                    return
            finally:
                decoder.in_flight -= 1
                attempt.call.cancel()

    def _migrate(self, decoder: Worker, state: Progress, budget: RetryBudget, exc: DecodeLost) -> bool:
        """D was lost mid-stream: take it out of rotation; True when the request may move to another D."""
        self.pool.mark_failed(decoder)
        if not budget.migrate():
            return False
        self.metrics.migrations.inc()
        log.warning("request %s: decode worker %s lost after %d tokens (%s); migrating",
                    state.request_id, decoder.worker_id, state.num_generated, exc)
        return True

    async def _attempt(self, state: Progress, budget: RetryBudget, failed_prefill: set[str]) -> Attempt | None:
        """One start on D (and P): the Attempt, None to try again, or GiveUp."""
        request_id = state.request_id
        try:
            return await self._start(state.next_attempt(), failed_prefill, state)
        except PrefillFailed as exc:
            if not budget.retry_prefill():
                raise GiveUp(f"prefill failed after {budget.prefill_failures} attempts: {exc}") from None
            self.metrics.retries.inc()
            log.warning("request %s: prefill attempt %d failed (%s); retrying", request_id, budget.prefill_failures, exc)
            return None
        except NoWorkerAvailable as exc:
            raise GiveUp(str(exc)) from None
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "no admission in time"
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(*split_field(details)) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Overloaded(details) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and budget.migrate():
                # nothing streamed yet: the (dead or hung) worker is out, try another
                log.warning("request %s: decode admission failed (%s %s); trying another worker", request_id, code.name, details)
                return None
            raise GiveUp(f"decode worker failed: {code.name} {details}") from None

    async def _start(self, request: pb.DecodeRequest, failed_prefill: set[str], state: Progress) -> Attempt:
        """Admit on D and get the prompt prefilled."""
        prompt_ids = list(request.token_ids)
        decoder = self.pool.pick("decode", prompt_ids)
        local = self._prefill_locally(prompt_ids, decoder)
        request.local_prefill = local
        state.started_attempt()
        with span("decode.admit", state.trace, SpanKind.CLIENT, worker_id=decoder.worker_id, attempt=state.attempts, local_prefill=local):
            call = DecodeStream(decoder.stub.Decode(request, timeout=state.remaining(), metadata=outgoing_metadata(state.trace)))
            try:
                # with local prefill the first message is the first token: allow the whole deadline
                wait = state.remaining() if local else min(self.settings.rpc_timeout_s, state.remaining())
                first = await asyncio.wait_for(call.read(), timeout=wait)
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                call.cancel()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.pool.mark_failed(decoder)
                raise
            if first is None:
                raise NoWorkerAvailable("decode")
        if local or first.WhichOneof("event") != "admission":
            call.push_back(first)
            return Attempt(decoder, call, None)
        state.worker_stages(pb.StageTimings(decode_admission_s=first.admission.admission_wait_s))
        state.kv_admitted(first.admission)
        prefill = await self._prefill(request, first.admission, call, failed_prefill, state)
        return Attempt(decoder, call, prefill)

    async def _prefill(self, request: pb.DecodeRequest, admission: pb.KVAdmission, call: DecodeStream,
                       failed_prefill: set[str], state: Progress) -> pb.PrefillResponse:
        """`Prefill` on a P that has not failed this request (else the same one again), into D's blocks."""
        prompt_ids = list(request.token_ids)
        exclude = failed_prefill if self.pool.candidates("prefill", failed_prefill) else set()
        prefiller = self.pool.pick("prefill", prompt_ids, exclude=exclude)
        source = self.pool.pull_source(prefiller, prompt_ids) if self.config.kv_pull else None
        work = len(prompt_ids) - self.pool.policy.usable_tokens(prefiller, self.pool.policy.prompt_hashes(prompt_ids))
        prefiller.in_flight += 1
        prefiller.pending_prefill_tokens += work
        with span("prefill", state.trace, SpanKind.CLIENT, worker_id=prefiller.worker_id, attempt=state.attempts) as current:
            try:
                response = await prefiller.stub.Prefill(
                    pb.PrefillRequest(request_id=request.request_id, token_ids=request.token_ids, sampling=request.sampling,
                                      kv_destination=admission.kv_destination, priority=request.priority, kv_source=source),
                    timeout=state.remaining(), metadata=outgoing_metadata(context_of(current)),
                )
            except asyncio.CancelledError:
                call.cancel()  # client gone while waiting for prefill: release D's reservation now
                raise
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                failed_prefill.add(prefiller.worker_id)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and "kv transfer" not in (exc.details() or ""):
                    self.pool.mark_failed(prefiller)
                raise PrefillFailed(f"{prefiller.worker_id}: {exc.code().name} {exc.details()}") from None
            finally:
                prefiller.in_flight -= 1
                prefiller.pending_prefill_tokens -= work
            annotate(current, kv_bytes=response.kv_bytes_sent, cached_prompt_tokens=response.cached_prompt_tokens)
        state.worker_stages(response.timings, prefill_done=True)
        state.cached_prompt_tokens = max(state.cached_prompt_tokens, response.cached_prompt_tokens)
        return response

    def _prefill_locally(self, prompt_ids: list[int], decoder: Worker) -> bool:
        """Conditional disaggregation: no prefill pool, or D would compute few enough of the prompt's tokens
        (the policy says how many: under kv_aware only those D's cache does not hold)."""
        if not self.pool.has_role("prefill"):
            return True
        threshold = self.local_prefill_threshold  # 0: off, and no index walk for every request
        return threshold > 0 and 0 < self.pool.policy.local_prefill_tokens(decoder, prompt_ids) <= threshold


def split_field(details: str) -> tuple[str, str]:
    """'field: message' from a worker's INVALID_ARGUMENT back into its parts."""
    field, _, message = (details or "request: invalid").partition(": ")
    return field, message or details


def error_response(request_id: str, code: int, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ERROR, error=pb.Error(code=code, message=message))
