"""Reading an OpenAI request body: bytes off the connection, then a validated request model.

`read_body` refuses another media type (415) and a body over MAX_BODY_BYTES (413); `parse_body`
requires UTF-8, JSON, one object, no lone surrogates, and validates it against a
`router.openai.protocol` model, every failure a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError

from router.openai.errors import OpenAIError, from_validation_errors, invalid

MAX_BODY_BYTES = 16 << 20
"""Largest request body read (HTTP 413 beyond): twice what a prompt filling the context can take as text."""
JSON_MEDIA_TYPES = ("application/json",)

T = TypeVar("T")


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
