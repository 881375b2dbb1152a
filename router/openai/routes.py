"""The OpenAI endpoints (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) and `mount`.

Life of one request (`OpenAIRoutes.serve`):
  1. read and parse the body (`router.openai.body`), convert it into a `RouterRequest`
     (`router.openai.convert`);
  2. pull the first message of `RouterService.stream()`; every refusal happens before it
     (InvalidRequestError -> 400, Overloaded -> 429 + Retry-After, Unavailable -> 503), so the
     HTTP status is known before a byte of body is sent;
  3. answer: one JSON body, or SSE chunks (`data: {...}`, `data: [DONE]`) as tokens arrive
     (`router.openai.responses`);
  4. client gone (before or during the answer): the stream is closed, which cancels the decode and
     prefill calls and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from starlette.background import BackgroundTask

from common.errors import InvalidRequestError
from common.tracing import http_context
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.admission import Overloaded, Unavailable
from router.openai.body import parse_body, read_body
from router.openai.choices import Choices
from router.openai.convert import param_from_service, prepare
from router.openai.errors import OpenAIError, install_handlers, invalid, server_error
from router.openai.protocol import REQUEST_SCHEMAS, ChatCompletionRequest, CompletionRequest
from router.openai.responses import sse
from router.service import RouterService

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


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
        stream = self.service.stream(prep.request, trace_parent=http_context(request.headers))
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
            if isinstance(exc, TemplateError):  # the chat template refused the conversation
                raise invalid("messages", f"the model's chat template rejected the messages: {exc}") from None
            raise
        choice = Choices(prep, self.service.tokenizer)
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

    async def _collect(self, stream: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse, choices: Choices) -> dict:
        response: pb.GenerateResponse | None = first
        while response is not None:
            choices.absorb(response)
            if choices.finished:
                return choices.response_body()
            response = await anext(stream, None)
        raise server_error(500, "generation ended without a finish reason")

    async def _events(self, stream: AsyncIterator[pb.GenerateResponse], first: pb.GenerateResponse,
                      choices: Choices) -> AsyncIterator[str]:
        """SSE body (the n choices' chunks interleaved, each with its index). Closing this generator
        (client gone) closes `stream`, which cancels the work."""
        prep = choices.prep
        try:
            if prep.kind == "chat":
                for choice in choices.choices:
                    yield sse(choice.chunk("", [], None, role=True))
            response: pb.GenerateResponse | None = first
            while response is not None:
                try:
                    choice, text, entries = choices.absorb(response)
                except OpenAIError as exc:
                    yield sse(exc.body())
                    break
                if text or entries or response.finish_reason:
                    yield sse(choices.with_critical_path(choice.chunk(text if text or prep.kind != "chat" else None, entries, choice.finish_reason)))
                if choices.finished:
                    if prep.include_usage:
                        yield sse(choices.usage_chunk())
                    break
                response = await anext(stream, None)
            else:
                yield sse(server_error(500, "generation ended without a finish reason").body())
            yield sse("[DONE]")
        except Exception:  # not CancelledError: that means the client is gone
            log.exception("request %s: streaming failed", prep.id)
            yield sse(server_error(500, "internal error while streaming").body())
            yield sse("[DONE]")
        finally:
            await stream.aclose()


async def _close_all(*generators) -> None:
    """Runs after a streaming response ends (complete or client gone): closes what is left open."""
    for gen in generators:
        await gen.aclose()


# ---- mounting ----------------------------------------------------------------------------------
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
    install_handlers(app)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], openapi_extra=_request_body(CompletionRequest))
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"],
                      openapi_extra=_request_body(ChatCompletionRequest))
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET"])
    app.openapi = _with_request_schemas(app.openapi)
