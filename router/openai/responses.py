"""OpenAI response shapes built from the router core's `GenerateResponse`s of one request.

`Choice` absorbs the messages as they arrive (text deltas, logprobs, usage, finish reason) and
shapes either one JSON body (`response_body`) or the SSE chunks of a stream (`chunk`,
`usage_chunk`, each sent with `sse`); a stream that ended in error becomes an OpenAIError
(`error_from_response`). With tools, the text becomes `tool_calls` (`router.openai.structured.ToolCalls`):
a named call streams its arguments as they come, the other modes send their calls when the text is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.openai.convert import Prepared
from router.openai.errors import OpenAIError, invalid, server_error
from router.openai.structured import ToolCalls

MIN_LOGPROB = -9999.0
"""-inf is not JSON; logprobs are clamped here."""
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


class Choice:
    """Accumulates the router's GenerateResponses of one request into OpenAI's choice/usage fields."""

    def __init__(self, prep: Prepared, tokenizer, index: int = 0):
        self.prep, self.tokenizer, self.index = prep, tokenizer, index
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self._offset = 0  # characters of generated text so far (completion logprobs' text_offset)
        self.tool_calls = ToolCalls(prep.tools) if prep.tools is not None else None
        self._streamed_call = False

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
        if self.finish_reason == "stop" and self.tool_calls is not None and self.tool_calls.parse("".join(self.text))[1]:
            self.finish_reason = "tool_calls"
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
            choice = {"index": self.index, "message": self._message()}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": "".join(self.text)}
            obj = "text_completion"
        choice["logprobs"] = self.logprobs_object(self.logprobs)
        choice["finish_reason"] = self.finish_reason
        return {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, entries: list[TokenLogprob], finish_reason: str | None, role: bool = False) -> dict:
        prep = self.prep
        if prep.kind == "chat":
            delta: dict = {"role": "assistant"} if role else {}
            if self.tool_calls is not None and not role:
                delta.update(self._tool_delta(text or "", finish_reason))
            elif text is not None:
                delta["content"] = text
            choice = {"index": self.index, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": text or ""}
            obj = "text_completion"
        choice["logprobs"] = self.logprobs_object(entries) if entries else None
        choice["finish_reason"] = finish_reason
        body = {"id": prep.id, "object": obj, "created": prep.created, "model": prep.model, "choices": [choice]}
        if prep.include_usage:
            body["usage"] = None
        return body

    def _message(self) -> dict:
        text = "".join(self.text)
        if self.tool_calls is None:
            return {"role": "assistant", "content": text}
        content, calls = self.tool_calls.parse(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message

    def _tool_delta(self, text: str, finish_reason: str | None) -> dict:
        """A named call streams its arguments; the other modes hold the text until the end."""
        if self.tool_calls.plan.choice == "named":
            first, self._streamed_call = not self._streamed_call, True
            return self.tool_calls.stream_delta(text, first) if text or first else {}
        return self.tool_calls.final_delta("".join(self.text)) if finish_reason else {}

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
