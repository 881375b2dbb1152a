"""Router gRPC services: the public `Generate` and the worker `Registry`.

Life of one `Generate` call:
  1. validate; tokenize once (text, chat template, or ids as given); admission against the bounded
     queue (requests and tokens) -> RESOURCE_EXHAUSTED when full;
  2. pick a decode worker D and open `Decode`; D answers with its KV admission (endpoint + transfer
     id), or we ask D to prefill locally (short prompt, conditional disaggregation);
  3. pick a prefill worker P and call `Prefill` with D's destination; when P fails, D's request is
     cancelled (its blocks freed) and the attempt is retried on another P, up to `prefill_retries`;
  4. stream D's chunks to the client through the incremental detokenizer (stop strings end it);
  5. record per-stage TTFT, ITL, E2E and KV bytes; leaving early (client gone) cancels D and P.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from deploy.config import PdserveConfig, RouterConfig
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from engine.tokenization import encode_chat, encode_prompt
from proto.convert import DEFAULT_MAX_TOKENS, sampling_from_proto, sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics
from router.pool import NoWorkerAvailable, Worker, WorkerPool

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
PROMPT_CHARS_MARGIN = 2
"""A text prompt of more characters than context x (longest token in characters) x this margin cannot
fit the context whatever it tokenizes to; it is refused before the (event-loop blocking) tokenizer runs."""


@dataclass(frozen=True)
class RouterSettings:
    """What this router serves (found at start) and its `router` config section."""

    model_name: str
    max_model_len: int
    transport: str
    config: RouterConfig = field(default_factory=RouterConfig)
    api_keys: frozenset[str] = frozenset()
    """The configured keys plus those in PDSERVE_API_KEYS (see `with_env_api_keys`)."""
    rpc_timeout_s: float = 30.0
    """Longest wait for a decode worker's admission message (not for tokens)."""

    @classmethod
    def from_config(cls, config: PdserveConfig, max_model_len: int) -> RouterSettings:
        env_keys = filter(None, os.environ.get("PDSERVE_API_KEYS", "").split(","))
        return cls(model_name=config.model_name, max_model_len=max_model_len, transport=config.kv_transfer.transport,
                   config=config.router, api_keys=frozenset([*config.router.api_keys, *env_keys]))

    def authorized(self, authorization: str | None) -> bool:
        """True when no keys are configured, or `authorization` is `Bearer <a configured key>`."""
        if not self.api_keys:
            return True
        scheme, _, key = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and any(hmac.compare_digest(key.strip(), k) for k in self.api_keys)


class Overloaded(Exception):
    pass


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


class PrefillFailed(Exception):
    pass


class Unavailable(Exception):
    """No worker can take the request now (maps to UNAVAILABLE / HTTP 503)."""


class RouterService(pb_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings, tokenizer, pool: WorkerPool, metrics: RouterMetrics):
        self.settings = settings
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = metrics
        self.admission = Admission(settings.config.max_queued_requests, settings.config.max_queued_tokens, metrics)
        self.draining = False

    # ---- public API ----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        metadata = dict(context.invocation_metadata() or ())
        if not self.settings.authorized(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or invalid API key (metadata 'authorization: Bearer KEY')")
        try:
            async for response in self.stream(request, timeout_s=context.time_remaining()):
                yield response
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception:  # a bug, not the client's fault: INTERNAL with a log line, never a bare UNKNOWN
            log.exception("request %s: Generate failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (see the router log)")

    async def GenerateBytes(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """`Generate` for a request still in wire form: one that does not parse (bad UTF-8 in a
        string field, a truncated varint) is INVALID_ARGUMENT, where grpc's own parsing says UNKNOWN."""
        try:
            request = pb.GenerateRequest.FromString(data)
        except DecodeError as exc:
            self.metrics.requests.labels(outcome="invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid pdserve.v1.GenerateRequest ({exc})")
        async for response in self.Generate(request, context):
            yield response

    async def stream(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Transport-neutral core of Generate, shared by gRPC and the OpenAI HTTP API.
        Raises InvalidRequestError, Overloaded or Unavailable before the first message; later
        failures end the stream with a message whose `error` is set. The client's deadline
        (`timeout_s`) bounds every call to the workers."""
        arrived = time.monotonic()
        deadline = arrived + min(timeout_s or self.settings.config.request_timeout_s, self.settings.config.request_timeout_s)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids, params, stop = self.validate(request)
        except InvalidRequestError:
            self.metrics.requests.labels(outcome="invalid").inc()
            raise
        if self.draining:
            raise Unavailable("router is draining")
        try:
            self.admission.acquire(len(prompt_ids))
        except Overloaded:
            self.metrics.requests.labels(outcome="overloaded").inc()
            raise
        outcome = "error"
        try:
            first = True
            async for response in self.run(request_id, prompt_ids, params, stop, request.skip_detokenize, arrived, deadline):
                if first:
                    response.prompt_token_ids.extend(prompt_ids)
                    first = False
                if response.finish_reason:
                    outcome = "ok" if response.finish_reason != pb.FINISH_REASON_ERROR else "error"
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except (InvalidRequestError, Overloaded):
            outcome = "invalid"
            raise
        finally:
            self.admission.release(len(prompt_ids))
            self.metrics.requests.labels(outcome=outcome).inc()

    def validate(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams, list[str]]:
        """Every check that needs no worker; errors name the proto field (`sampling.top_p`)."""
        if request.model and request.model != self.settings.model_name:
            raise InvalidRequestError("model", f"{request.model!r} is not served here (serving {self.settings.model_name!r})")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}")
        ids = self._prompt_ids(request)
        if len(ids) >= self.settings.max_model_len:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens leave no room to generate in the context length {self.settings.max_model_len}")
        sampling = request.sampling
        if not sampling.max_tokens:  # unset: as much as fits, at most the default
            sampling = pb.SamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.max_tokens = max(1, min(DEFAULT_MAX_TOKENS, self.settings.max_model_len - len(ids)))
        _check_finite(sampling)
        params = sampling_from_proto(sampling)
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError("sampling.stop_token_ids", f"every id must be < {vocab}")
        stop = _checked_stop(list(request.sampling.stop))
        if len(ids) + params.max_tokens > self.settings.max_model_len:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {self.settings.max_model_len}",
            )
        return ids, params, stop

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "one of token_ids, text or chat is required")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidRequestError("prompt.token_ids", "must not be empty")
            vocab = len(self.tokenizer)
            if any(t >= vocab for t in ids):
                raise InvalidRequestError("prompt.token_ids", f"every id must be < {vocab}")
            return ids
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text", "must not be empty")
            self._check_prompt_chars("prompt.text", len(request.text))
            return encode_prompt(self.tokenizer, request.text, raw=request.raw)
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise InvalidRequestError("prompt.chat.messages", "must contain at least one message")
        for i, m in enumerate(messages):
            if m["role"] not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"prompt.chat.messages[{i}].role", f"must be system, user or assistant, got {m['role']!r}")
        self._check_prompt_chars("prompt.chat.messages", sum(len(m["content"]) for m in messages))
        try:
            return encode_chat(self.tokenizer, messages)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the model's chat template refused the conversation (jinja2 TemplateError)
            if type(exc).__module__.startswith("jinja2"):
                raise InvalidRequestError("prompt.chat.messages", f"the model's chat template rejected the messages: {exc}") from None
            raise

    def _check_prompt_chars(self, field_name: str, chars: int) -> None:
        limit = self.settings.max_model_len * self._max_token_chars * PROMPT_CHARS_MARGIN
        if chars > limit:
            raise InvalidRequestError(field_name, f"{chars} characters cannot fit the context length {self.settings.max_model_len} tokens")

    @functools.cached_property
    def _max_token_chars(self) -> int:
        """Characters of the longest token of the vocabulary (an upper bound for any one token)."""
        return max(len(self.tokenizer.convert_tokens_to_string([t])) for t in self.tokenizer.get_vocab()) or 1

    # ---- orchestration -------------------------------------------------------------------------
    async def run(self, request_id, prompt_ids, params, stop, skip_detokenize, arrived, deadline) -> AsyncIterator[pb.GenerateResponse]:
        state = _Progress(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            arrived=arrived,
            deadline=deadline,
            detok=None if skip_detokenize else IncrementalDetokenizer(self.tokenizer, prompt_ids, stop),
        )
        failed_prefill: set[str] = set()
        prefill_failures = migrations = 0
        while True:
            try:
                decoder, call, prefill_resp = await self._start(state.next_attempt(), failed_prefill, state)
            except PrefillFailed as exc:
                prefill_failures += 1
                if prefill_failures > self.settings.config.prefill_retries:
                    yield _error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, f"prefill failed after {prefill_failures} attempts: {exc}")
                    return
                self.metrics.retries.inc()
                log.warning("request %s: prefill attempt %d failed (%s); retrying", request_id, prefill_failures, exc)
                continue
            except NoWorkerAvailable as exc:
                yield _error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, str(exc))
                return
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
                details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "no admission in time"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError(*_split_field(details)) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Overloaded(details) from None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and migrations < self.settings.config.max_migrations:
                    migrations += 1  # nothing streamed yet: the (dead or hung) worker is out, try another
                    log.warning("request %s: decode admission failed (%s %s); trying another worker", request_id, code.name, details)
                    continue
                yield _error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, f"decode worker failed: {code.name} {details}")
                return
            if prefill_resp is not None:
                self.metrics.kv_bytes.labels(transport=self.settings.transport).inc(prefill_resp.kv_bytes_sent)
            decoder.in_flight += 1
            try:
                async for response in self._relay(call, state, decoder):
                    yield response
                return
            except DecodeLost as exc:
                self.pool.mark_failed(decoder)
                migrations += 1
                if migrations > self.settings.config.max_migrations:
                    yield _error_response(request_id, pb.ERROR_CODE_UNAVAILABLE, f"decode worker lost {migrations} times: {exc}")
                    return
                self.metrics.migrations.inc()
                log.warning("request %s: decode worker %s lost after %d tokens (%s); migrating",
                            request_id, decoder.worker_id, len(state.generated), exc)
            finally:
                decoder.in_flight -= 1
                call.cancel()

    async def _start(self, request: pb.DecodeRequest, failed_prefill: set[str], state: _Progress):
        """Admit on D and get the prompt prefilled; returns (D, its stream, the prefill response)."""
        prompt_ids = list(request.token_ids)
        decoder = self.pool.pick("decode", prompt_ids)
        local = self._prefill_locally(prompt_ids)
        request.local_prefill = local
        timings = state.timings
        call = DecodeStream(decoder.stub.Decode(request, timeout=state.remaining()))
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
            return decoder, call, None
        admission = first.admission
        timings.decode_admission_s = admission.admission_wait_s
        # prefer a prefill worker that has not failed this request; else retry the same one
        prefiller = self.pool.pick("prefill", prompt_ids, exclude=failed_prefill if self.pool.candidates("prefill", failed_prefill) else set())
        prefiller.in_flight += 1
        try:
            response = await prefiller.stub.Prefill(
                pb.PrefillRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids,
                    sampling=request.sampling,
                    kv_destination=admission.kv_destination,
                ),
                timeout=state.remaining(),
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
        pt = response.timings
        timings.prefill_queue_s = pt.prefill_queue_s
        timings.prefill_compute_s = pt.prefill_compute_s
        timings.kv_transfer_s = pt.kv_transfer_s
        return decoder, call, response

    def _prefill_locally(self, prompt_ids: list[int]) -> bool:
        """Conditional disaggregation: no prefill pool, or a prompt short enough for D to run."""
        threshold = self.settings.config.local_prefill_threshold
        return not self.pool.has_role("prefill") or 0 < len(prompt_ids) <= threshold

    async def _relay(self, call: DecodeStream, state: _Progress, decoder: Worker) -> AsyncIterator[pb.GenerateResponse]:
        """Forward one decode worker's stream; raises DecodeLost if the worker goes away mid-stream."""
        try:
            while (message := await self._next_message(call, state, decoder)) is not None:
                event = message.WhichOneof("event")
                if event == "chunk":
                    response = self._on_chunk(state, message.chunk)
                    yield response
                    if response.finish_reason:
                        return
                elif event == "finished":
                    yield self._on_finished(state, message.finished)
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
                raise DecodeLost(f"{exc.code().name}: {exc.details()}") from None
            raise
        raise DecodeLost("decode stream ended without finishing")

    async def _next_message(self, call: DecodeStream, state: _Progress, decoder: Worker) -> pb.DecodeResponse | None:
        """D's next message. A stream silent for `stall_timeout_s` after its first token is moved off D
        (DecodeLost) if the pool took D out of rotation meanwhile (missed heartbeats: hung or paused);
        a D that still heartbeats is only slow (a preempted request waits for blocks) and is waited for.
        Near the client's deadline the call's own deadline decides."""
        stall = self.settings.config.stall_timeout_s
        if not stall or state.last_token_at is None:
            return await call.read()
        read = asyncio.ensure_future(call.read())  # never cancelled while waiting: that would cancel the call
        try:
            while not (await asyncio.wait({read}, timeout=stall))[0]:
                if not decoder.healthy:
                    read.cancel()
                    self.metrics.stalls.inc()
                    raise DecodeLost(f"no token for {stall:g} s and the worker is out of rotation (hung or paused)")
        except asyncio.CancelledError:
            read.cancel()
            raise
        return read.result()

    def _on_chunk(self, state: _Progress, worker_chunk: pb.TokenChunk) -> pb.GenerateResponse:
        now = time.monotonic()
        if state.last_token_at is None:
            state.timings.ttft_s = now - state.arrived
            self.metrics.ttft.observe(state.timings.ttft_s)
            self.metrics.observe_stages(state.timings)
        else:
            self.metrics.itl.observe(now - state.last_token_at)
        state.last_token_at = now
        chunk = pb.TokenChunk(token_ids=worker_chunk.token_ids, logprobs=worker_chunk.logprobs)
        state.generated.extend(chunk.token_ids)
        self.metrics.tokens.inc(len(chunk.token_ids))
        if state.detok is not None:
            step = state.detok.add(list(chunk.token_ids))
            chunk.text = step.text
            if step.stopped:
                return state.final(chunk, pb.FINISH_REASON_STOP, self.metrics)
        return pb.GenerateResponse(request_id=state.request_id, chunk=chunk)

    def _on_finished(self, state: _Progress, fin: pb.DecodeFinished) -> pb.GenerateResponse:
        state.cached_prompt_tokens = max(state.cached_prompt_tokens, fin.usage.cached_prompt_tokens)
        tail = pb.TokenChunk(text=state.detok.finish().text) if state.detok is not None else pb.TokenChunk()
        response = state.final(tail, fin.finish_reason or pb.FINISH_REASON_STOP, self.metrics)
        if fin.HasField("error"):
            response.error.CopyFrom(fin.error)
        return response


class DecodeLost(Exception):
    """The decode worker went away mid-stream; the request can migrate."""


@dataclass
class _Progress:
    """What the router knows about one request across attempts and migrations."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrived: float
    deadline: float
    detok: IncrementalDetokenizer | None
    generated: list[int] = field(default_factory=list)
    timings: pb.StageTimings = field(default_factory=pb.StageTimings)
    last_token_at: float | None = None
    cached_prompt_tokens: int = 0
    attempts: int = 0

    def remaining(self) -> float:
        """Seconds left before the client's deadline (what every worker call may take)."""
        return max(0.05, self.deadline - time.monotonic())

    def next_attempt(self) -> pb.DecodeRequest:
        """A DecodeRequest that continues from what was already streamed (prompt + generated)."""
        remaining = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(self.generated))
        request_id = f"{self.request_id}.{self.attempts}"
        self.attempts += 1
        return pb.DecodeRequest(request_id=request_id, token_ids=self.prompt_ids + self.generated, sampling=sampling_to_proto(remaining))

    def final(self, chunk: pb.TokenChunk, reason: int, metrics: RouterMetrics) -> pb.GenerateResponse:
        self.timings.e2e_s = time.monotonic() - self.arrived
        metrics.e2e.observe(self.timings.e2e_s)
        usage = pb.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.generated),
                         cached_prompt_tokens=self.cached_prompt_tokens)
        return pb.GenerateResponse(request_id=self.request_id, chunk=chunk, finish_reason=reason, usage=usage, timings=self.timings)


class DecodeStream:
    """One `Decode` call read message by message (gRPC forbids mixing `read()` and `async for`
    on one call); a message read ahead can be pushed back."""

    def __init__(self, call):
        self._call = call
        self._pushed: list = []

    async def read(self):
        if self._pushed:
            return self._pushed.pop()
        message = await self._call.read()
        return None if message is grpc.aio.EOF else message

    def push_back(self, message) -> None:
        self._pushed.append(message)

    def cancel(self) -> None:
        self._call.cancel()

    async def __aiter__(self):
        while (message := await self.read()) is not None:
            yield message


def _check_finite(sampling: pb.SamplingParams) -> None:
    """NaN passes every range check (all comparisons are false) and would poison the sampler."""
    for name in ("temperature", "top_p"):
        if sampling.HasField(name) and not math.isfinite(getattr(sampling, name)):
            raise InvalidRequestError(f"sampling.{name}", f"must be a finite number, got {getattr(sampling, name)}")


def _checked_stop(stop: list[str]) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(text)}")
    return stop


def add_router_to_server(service: RouterService, server: grpc.aio.Server) -> None:
    """Serves `pdserve.v1.Router` with requests parsed by `service.GenerateBytes` (see there)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.GenerateBytes, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Router", handlers),))
    server.add_registered_method_handlers("pdserve.v1.Router", handlers)


def _split_field(details: str) -> tuple[str, str]:
    """'field: message' from a worker's INVALID_ARGUMENT back into its parts."""
    field, _, message = (details or "request: invalid").partition(": ")
    return field, message or details


def _error_response(request_id: str, code: int, message: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ERROR, error=pb.Error(code=code, message=message))


class RegistryService(pb_grpc.RegistryServicer):
    def __init__(self, pool: WorkerPool, heartbeat_interval_s: float = 1.0):
        self.pool = pool
        self.heartbeat_interval_s = heartbeat_interval_s

    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        w = request.worker
        role = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}.get(w.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker.role: must be ROLE_PREFILL or ROLE_DECODE")
        if not w.worker_id or not w.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker.worker_id and worker.address are required")
        self.pool.add(w.worker_id, role, w.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.pool.heartbeat_timeout_s)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        known = self.pool.heartbeat(request.worker_id, request.stats if request.HasField("stats") else None)
        return pb.HeartbeatResponse(known=known)

    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        self.pool.remove(request.worker_id)
        return pb.DeregisterResponse()
