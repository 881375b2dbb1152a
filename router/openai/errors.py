"""OpenAI's error shape, and how every failure of the HTTP API becomes one.

Each error is an `OpenAIError` raised anywhere in `router.openai`: a field-naming 400 (`invalid`),
a refusal of the router core (429 / 503 / 504: `server_error`), a pydantic validation error
(`from_validation_errors`, naming the first offending field), or Starlette's own 404 / 405. The
handlers `install_handlers` adds answer each with the body
{"error": {"message", "type", "param", "code"}} and its status.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


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


def install_handlers(app: FastAPI) -> None:
    """OpenAI's error shape for every failure of `app`."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
