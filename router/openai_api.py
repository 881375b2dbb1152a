"""OpenAI-compatible HTTP API of the router: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Life of one request:
  1. parse: the body must be JSON by its Content-Type (415 otherwise; none at all is read as JSON),
     at most MAX_BODY_BYTES (413), UTF-8, one object; it is validated strictly (wrong types are
     errors, unknown fields are ignored as OpenAI does) into a request model. The models are also
     the OpenAPI schema of the request bodies (`/openapi.json`);
  2. prepare: check what pydantic cannot (served model, n, unsupported features, context length)
     and build one `pb.GenerateRequest` (chat -> `chat`, completion -> raw `text` or `token_ids`);
  3. start: pull the first message of `RouterService.stream()`; every refusal happens before it
     (InvalidRequestError -> 400, Overloaded -> 429 + Retry-After, Unavailable -> 503), so the
     HTTP status is known before a byte of body is sent;
  4. answer: one JSON body, or SSE chunks (`data: {...}`, `data: [DONE]`) as tokens arrive;
  5. client gone (before or during the answer): the stream is closed, which cancels the decode and
     prefill calls and frees their KV blocks.
Every error body has OpenAI's shape: {"error": {"message", "type", "param", "code"}}, and the
message names the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError
from engine.sampling import MAX_LOGPROBS
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.service import (
    MAX_STOP_STRINGS,
    Overloaded,
    RouterService,
    RouterSettings,
    Unavailable,
)

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for the legacy completions endpoint; chat leaves it to the server default."""
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 16 << 20
"""Largest request body read (HTTP 413 beyond): twice what a prompt filling the context can take as text."""
JSON_MEDIA_TYPES = ("application/json",)
MIN_LOGPROB = -9999.0
"""-inf is not JSON; logprobs are clamped here."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


# ---- errors ------------------------------------------------------------------------------------
class OpenAIError(Exception):
    """An error answered in OpenAI's shape with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    """400 whose message starts with the field it is about."""
    return OpenAIError(400, f"{param}: {message}" if param else message, param, code=code)


def server_error(status: int, message: str) -> OpenAIError:
    kind = {429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}.get(status, "server_error")
    return OpenAIError(status, message, type_=kind)


_UNION_HINTS = {
    "prompt": "must be a string, a list with one string, or a list of token ids",
    "stop": "must be a string or a list of strings",
}


def from_validation_errors(errors: list[dict]) -> OpenAIError:
    """pydantic / FastAPI errors -> one 400 naming the first offending field."""
    if not errors:
        return invalid(None, "invalid request")
    error = errors[0]
    if error.get("type") == "json_invalid":  # FastAPI's own body parsing
        return invalid(None, f"request body is not valid JSON: {error.get('msg')}")
    param, tagged = loc_to_param(error.get("loc", ()))
    if tagged:  # a union field: report it as a whole
        hint = _UNION_HINTS.get(param or "", "has the wrong type")
        if param and param.endswith(".content"):
            hint = "must be a string or a list of text content parts"
        return invalid(param, f"{hint}, got {_short(error.get('input'))}")
    if error.get("type") == "missing":
        return invalid(param, "is required")
    return invalid(param, f"{error.get('msg', 'is invalid')}, got {_short(error.get('input'))}")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def loc_to_param(loc) -> tuple[str | None, bool]:
    """('messages', 0, 'content') -> 'messages[0].content'. Stops at a union member's tag
    (('stop', 'list[str]', 0) -> 'stop') and says whether it did; drops FastAPI's 'body'."""
    out = ""
    for i, item in enumerate(loc):
        if isinstance(item, int):
            out += f"[{item}]"
        elif i == 0 and item in ("body", "query", "path"):
            continue
        elif "[" in item or "-" in item or item in _TYPE_TAGS:
            return out or None, True
        else:
            out += f".{item}" if out else item
    return out or None, False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- request schemas ---------------------------------------------------------------------------
def _documented(default: Any = None, **schema: Any) -> Any:
    """A field whose accepted values `prepare` narrows further; `schema` says so in the OpenAPI
    document (so a schema-driven client or fuzzer sends what is served)."""
    return Field(default, json_schema_extra=schema)


def _required_in_schema(name: str):
    """json_schema_extra that lists an optional field as required and not null: what a client
    should send; the model itself stays lenient where `prepare` gives a clearer error."""

    def edit(schema: dict) -> None:
        schema["required"] = [*schema.get("required", []), name]
        prop = schema["properties"][name]
        prop["anyOf"] = [option for option in prop["anyOf"] if option.get("type") != "null"]
        prop.pop("default", None)

    return edit


class _Strict(BaseModel):
    """No type coercion ("5" is not an int, 1.0 is not an int, true is not a number); extra fields ignored.
    The field validators check only types and ranges; what `prepare` refuses beyond them (roles, n,
    non-empty lists) is stated in the OpenAPI schema through `json_schema_extra`."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]
PositiveInt = Annotated[int, Field(ge=1)]


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int | None = _documented(minimum=1, maximum=1)
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = _documented(enum=[0, None])
    frequency_penalty: float | None = _documented(enum=[0, None])
    logit_bias: dict[str, float] | None = _documented(maxProperties=0)
    # extensions in the style of vLLM (the OpenAI client sends them through `extra_body`)
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = _documented(False, enum=[False, None])
    best_of: int | None = _documented(minimum=1, maximum=1)
    suffix: str | None = None


class ContentPart(_Strict):
    model_config = ConfigDict(json_schema_extra=_required_in_schema("text"))

    type: str = Field(json_schema_extra={"enum": ["text"]})
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(json_schema_extra=_required_in_schema("content"))

    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[ContentPart] | None = None
    """The schema asks for it; only an assistant message may leave it out (a tool-call turn)."""
    name: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list | None = _documented(maxItems=0)
    response_format: dict | None = None


async def read_body(request: Request) -> bytes:
    """The body of a JSON request: 415 for another media type, 413 beyond MAX_BODY_BYTES (refused
    from Content-Length before reading when the client sends one)."""
    check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)


def check_content_type(value: str | None) -> None:
    """JSON or no Content-Type at all (curl without -H); anything else (a form, text) is 415."""
    if value is None:
        return
    media_type = value.split(";", 1)[0].strip().lower()
    if media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
        raise OpenAIError(415, f"Content-Type: must be application/json, got {value!r}", code="unsupported_media_type")


def too_large(size: int) -> OpenAIError:
    return OpenAIError(413, f"request body: {size} bytes is more than the limit of {MAX_BODY_BYTES} bytes",
                       code="request_too_large")


def parse_body(raw: bytes, schema: type[T]) -> T:
    """Bytes of a request body -> a validated request model, or a 400 OpenAIError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(None, f"request body is not valid UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise invalid(None, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid(None, f"request body must be a JSON object, got {type(data).__name__}")
    _reject_lone_surrogates(data, "")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False)) from None


def _reject_lone_surrogates(value: Any, path: str) -> None:
    """JSON escapes can smuggle in strings that are not Unicode text ("\\ud800"); the tokenizer and
    protobuf refuse them later, so refuse them here, naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(path or None, "contains an unpaired UTF-16 surrogate (not valid Unicode text)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(key, path)
            _reject_lone_surrogates(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _reject_lone_surrogates(item, f"{path}[{i}]")


# ---- request -> pb.GenerateRequest -------------------------------------------------------------
@dataclass
class Prepared:
    """One validated request, ready for the router core."""

    kind: str  # "completion" | "chat"
    request: pb.GenerateRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    max_tokens_param: str = "max_tokens"
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(body: CompletionRequest | ChatCompletionRequest, settings: RouterSettings) -> Prepared:
    kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    if body.model is not None and body.model != settings.model_name:
        raise invalid("model", f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                      code="model_not_found")
    _check_unsupported(body)
    request_id = uuid.uuid4().hex
    prep = Prepared(kind=kind, request=pb.GenerateRequest(request_id=request_id, model=settings.model_name),
                    model=settings.model_name, stream=bool(body.stream),
                    include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
                    id=("chatcmpl-" if kind == "chat" else "cmpl-") + request_id)
    if kind == "chat":
        _set_chat_prompt(prep.request, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        prep.logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        _set_completion_prompt(prep.request, body)
        prep.logprobs = body.logprobs
    _set_sampling(prep, body, settings)
    return prep


def _check_unsupported(body) -> None:
    if body.n is not None and body.n != 1:
        raise invalid("n", f"only n=1 is supported, got {body.n}" if body.n > 1 else f"must be >= 1, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise invalid(name, "is not supported (only 0)")
    if body.logit_bias:
        raise invalid("logit_bias", "is not supported")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise invalid("echo", "is not supported")
        if body.best_of is not None and body.best_of != 1:
            raise invalid("best_of", f"only best_of=1 is supported, got {body.best_of}")
        if body.suffix:
            raise invalid("suffix", "is not supported")
    else:
        if body.tools:
            raise invalid("tools", "tool calling is not supported")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise invalid("response_format", "only the 'text' format is supported")


def _set_completion_prompt(request: pb.GenerateRequest, body: CompletionRequest) -> None:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("prompt", f"only one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        request.text, request.raw = prompt, True
    else:
        if not prompt:
            raise invalid("prompt", "must not be empty")
        request.token_ids.ids.extend(prompt)


def _set_chat_prompt(request: pb.GenerateRequest, body: ChatCompletionRequest) -> None:
    if not body.messages:
        raise invalid("messages", "must contain at least one message")
    chat = request.chat
    for i, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(f"messages[{i}].role", f"must be one of system, developer, user, assistant, got {message.role!r}")
        chat.messages.add(role=role, content=_message_text(i, message))


def _message_text(i: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise invalid(f"messages[{i}].content", "is required")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise invalid(f"messages[{i}].content[{j}].type", f"only 'text' content parts are supported, got {part.type!r}")
        if part.text is None:
            raise invalid(f"messages[{i}].content[{j}].text", "is required")
        texts.append(part.text)
    return "\n".join(texts)


def _set_sampling(prep: Prepared, body, settings: RouterSettings) -> None:
    sampling = prep.request.sampling
    max_tokens, name = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None and prep.kind == "completion":
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens is not None:
        if max_tokens >= settings.max_model_len:
            raise invalid(name, f"{max_tokens} leaves no room for the prompt in the model's context length {settings.max_model_len}")
        sampling.max_tokens = max_tokens
    prep.max_tokens_param = name
    sampling.temperature = 1.0 if body.temperature is None else body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:
        sampling.top_k = body.top_k
    if body.seed is not None:
        sampling.seed = body.seed
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    sampling.stop.extend(s for s in stop if s)
    sampling.stop_token_ids.extend(body.stop_token_ids or [])
    sampling.ignore_eos = bool(body.ignore_eos)
    if prep.logprobs is not None:
        sampling.logprobs = prep.logprobs


def param_from_service(field_path: str, prep: Prepared) -> str:
    """The router core names proto fields (`sampling.top_p`, `prompt.chat.messages[0].role`);
    the client knows OpenAI's names."""
    if field_path == "sampling.max_tokens":
        return prep.max_tokens_param
    if field_path.startswith("sampling."):
        return field_path.removeprefix("sampling.")
    if field_path.startswith("prompt.chat."):
        return field_path.removeprefix("prompt.chat.")
    if field_path.startswith("prompt"):
        return "messages" if prep.kind == "chat" else "prompt"
    return field_path


# ---- responses ---------------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


class Choice:
    """Accumulates the router's GenerateResponses of one request into OpenAI's choice/usage fields."""

    def __init__(self, prep: Prepared, tokenizer):
        self.prep, self.tokenizer = prep, tokenizer
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self._offset = 0  # characters of generated text so far (completion logprobs' text_offset)

    def absorb(self, response: pb.GenerateResponse) -> tuple[str, list[TokenLogprob]]:
        """Adds one message; returns its text delta and logprobs. A failed request raises OpenAIError."""
        if response.prompt_token_ids:
            self.prompt_tokens = len(response.prompt_token_ids)
        self.completion_tokens += len(response.chunk.token_ids)
        if response.finish_reason:
            if response.finish_reason not in FINISH_REASONS:
                raise error_from_response(response)
            self.finish_reason = FINISH_REASONS[response.finish_reason]
            usage = response.usage
            self.prompt_tokens = self.prompt_tokens or usage.prompt_tokens
            self.completion_tokens = max(self.completion_tokens, usage.completion_tokens)
            self.cached_tokens = usage.cached_prompt_tokens
        text = response.chunk.text
        self.text.append(text)
        entries = self._logprobs(response.chunk) if self.prep.logprobs is not None else []
        self.logprobs.extend(entries)
        return text, entries

    def _logprobs(self, chunk: pb.TokenChunk) -> list[TokenLogprob]:
        decode = self.tokenizer.decode
        return [
            TokenLogprob(decode([lp.token_id]), max(lp.logprob, MIN_LOGPROB),
                         [(decode([t.token_id]), max(t.logprob, MIN_LOGPROB)) for t in lp.top])
            for lp in chunk.logprobs
        ]

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    # -- OpenAI shapes
    def logprobs_object(self, entries: list[TokenLogprob]) -> dict | None:
        if self.prep.logprobs is None:
            return None
        if self.prep.kind == "chat":
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries] if self.prep.logprobs > 0 else None,
            "text_offset": offsets,
        }

    def response_body(self) -> dict:
        prep = self.prep
        if prep.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(self.text)}}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(self.text)}
            obj = "text_completion"
        choice["logprobs"] = self.logprobs_object(self.logprobs)
        choice["finish_reason"] = self.finish_reason
        return {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, entries: list[TokenLogprob], finish_reason: str | None, role: bool = False) -> dict:
        prep = self.prep
        if prep.kind == "chat":
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or ""}
            obj = "text_completion"
        choice["logprobs"] = self.logprobs_object(entries) if entries else None
        choice["finish_reason"] = finish_reason
        body = {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model, "choices": [choice]}
        if prep.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        prep = self.prep
        obj = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"
        return {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model, "choices": [],
                "usage": self.usage()}


def _chat_logprob(e: TokenLogprob) -> dict:
    return {
        "token": e.token,
        "logprob": e.logprob,
        "bytes": list(e.token.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in e.top],
    }


_ERROR_STATUS = {
    pb.ERROR_CODE_INVALID_ARGUMENT: 400,
    pb.ERROR_CODE_RESOURCE_EXHAUSTED: 429,
    pb.ERROR_CODE_DEADLINE_EXCEEDED: 504,
    pb.ERROR_CODE_UNAVAILABLE: 503,
}


def error_from_response(response: pb.GenerateResponse) -> OpenAIError:
    """A stream that ended with FINISH_REASON_ERROR/ABORT -> the error to report."""
    err = response.error
    if response.finish_reason == pb.FINISH_REASON_ABORT and not err.message:
        return server_error(503, "the request was aborted by the server")
    status = _ERROR_STATUS.get(err.code, 500)
    if status == 400:
        return invalid(err.field or None, err.message)
    return server_error(status, err.message or "generation failed")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ---- serving -----------------------------------------------------------------------------------
class ClientGone(Exception):
    """The HTTP client disconnected before the answer was complete."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it unwind; its outcome is moot
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _next(stream: AsyncIterator[T]) -> T:
    return await stream.__anext__()


class OpenAIRoutes:
    """The OpenAI endpoints bound to one RouterService."""

    def __init__(self, service: RouterService):
        self.service = service
        self.created = int(time.time())

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, ChatCompletionRequest)

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.service.settings.model_name:
            raise OpenAIError(404, f"model: the model {model_id!r} does not exist", "model", code="model_not_found")
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        settings = self.service.settings
        return {"id": settings.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": settings.max_model_len}

    async def serve(self, request: Request, schema: type) -> Response:
        try:
            prep = prepare(parse_body(await read_body(request), schema), self.service.settings)
        except OpenAIError:
            self.service.metrics.requests.labels(outcome="invalid").inc()
            raise
        stream = self.service.stream(prep.request)
        try:
            first = await unless_disconnected(request, _next(stream))
        except ClientGone:
            log.info("request %s: client disconnected before the first token", prep.id)
            return Response(status_code=499)
        except StopAsyncIteration:
            raise server_error(500, "generation ended without output") from None
        except InvalidRequestError as exc:
            param = param_from_service(exc.field, prep)
            raise invalid(param, exc.message) from None
        except Overloaded as exc:
            raise OpenAIError(429, f"server overloaded, retry later: {exc}", type_="rate_limit_error",
                              code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Unavailable as exc:
            raise server_error(503, f"no capacity to serve the request: {exc}") from None
        except Exception as exc:
            if _is_template_error(exc):  # the chat template refused the conversation
                raise invalid("messages", f"the model's chat template rejected the messages: {exc}") from None
            raise
        choice = Choice(prep, self.service.tokenizer)
        headers = {"X-Request-Id": prep.request.request_id}
        if prep.stream:
            events = self._events(stream, first, choice)
            return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers},
                                     background=BackgroundTask(_close_all, events, stream))
        try:
            body = await unless_disconnected(request, self._collect(stream, first, choice))
        except ClientGone:
            log.info("request %s: client disconnected", prep.id)
            return Response(status_code=499)
        finally:
            await stream.aclose()
        return JSONResponse(body, headers=headers)

    async def _collect(self, stream: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse, choice: Choice) -> dict:
        response: pb.GenerateResponse | None = first
        while response is not None:
            choice.absorb(response)
            if response.finish_reason:
                return choice.response_body()
            response = await anext(stream, None)
        raise server_error(500, "generation ended without a finish reason")

    async def _events(self, stream: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse,
                      choice: Choice) -> AsyncIterator[str]:
        """SSE body. Closing this generator (client gone) closes `stream`, which cancels the work."""
        try:
            if choice.prep.kind == "chat":
                yield sse(choice.chunk("", [], None, role=True))
            response: pb.GenerateResponse | None = first
            while response is not None:
                try:
                    text, entries = choice.absorb(response)
                except OpenAIError as exc:
                    yield sse(exc.body())
                    break
                if text or entries or response.finish_reason:
                    yield sse(choice.chunk(text if text or choice.prep.kind != "chat" else None, entries, choice.finish_reason))
                if response.finish_reason:
                    if choice.prep.include_usage:
                        yield sse(choice.usage_chunk())
                    break
                response = await anext(stream, None)
            else:
                yield sse(server_error(500, "generation ended without a finish reason").body())
            yield sse("[DONE]")
        except Exception:  # not CancelledError: that means the client is gone
            log.exception("request %s: streaming failed", choice.prep.id)
            yield sse(server_error(500, "internal error while streaming").body())
            yield sse("[DONE]")
        finally:
            await stream.aclose()


async def _close_all(*generators) -> None:
    """Runs after a streaming response ends (complete or client gone): closes what is left open."""
    for gen in generators:
        await gen.aclose()


def _is_template_error(exc: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers brings jinja2
        return False
    return isinstance(exc, TemplateError)


# ---- mounting ----------------------------------------------------------------------------------
async def _openai_error_handler(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_errors(list(exc.errors())).response()


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    if exc.status_code == 404:
        message = f"invalid URL ({request.method} {request.url.path})"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return OpenAIError(exc.status_code, message, type_=kind, headers=dict(exc.headers or {})).response()


REQUEST_SCHEMAS = (CompletionRequest, ChatCompletionRequest)


def _request_body(model: type[BaseModel]) -> dict:
    """OpenAPI `requestBody` of a route that parses its body itself (see `parse_body`)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _with_request_schemas(generate):
    """Wraps FastAPI's `app.openapi` to add the request models (and what they reference) to
    `components.schemas`, where the routes' `requestBody` refers to them."""

    def openapi() -> dict:
        document = generate()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in REQUEST_SCHEMAS:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        return document

    return openapi


def mount(app: FastAPI, service: RouterService) -> None:
    """Adds the OpenAI routes and error handlers (OpenAI's error shape for every failure) to `app`."""
    routes = OpenAIRoutes(service)
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], openapi_extra=_request_body(CompletionRequest))
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"],
                      openapi_extra=_request_body(ChatCompletionRequest))
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.openapi = _with_request_schemas(app.openapi)
