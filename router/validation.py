"""Every check of a `RouterRequest` that needs no worker, and its tokenization (once per request).

`RouterService.stream` calls `Validator.validate` before admission; it returns the prompt's token
ids, the engine's sampling parameters (max_tokens filled from the context when unset) and the stop
strings, or raises InvalidRequestError naming the field by its gRPC path (`sampling.top_p`,
`prompt.chat.messages[0].role`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import jsonschema

from common.errors import InvalidRequestError
from common.request_types import check_priority
from common.sampling import SamplingParams, StructuredOutput
from common.tokenization import encode_chat, encode_prompt
from proto.convert import DEFAULT_MAX_TOKENS
from router.request import ChatPrompt, ChatTurn, RouterRequest, TextPrompt, TokenPrompt
from router.settings import RouterSettings

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
PROMPT_CHARS_MARGIN = 2
"""A text prompt of more characters than context x (longest token in characters) x this margin cannot
fit the context whatever it tokenizes to; it is refused before the (event-loop blocking) tokenizer runs."""
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Validated:
    """A request the router can run: its prompt as token ids, engine sampling, stop strings and priority."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    priority: int = 0


class Validator:
    def __init__(self, settings: RouterSettings, tokenizer):
        self.settings, self.tokenizer = settings, tokenizer

    def validate(self, request: RouterRequest) -> Validated:
        """Errors name the gRPC field (`sampling.top_p`)."""
        max_len = self.settings.max_model_len
        if request.model and request.model != self.settings.model_name:
            raise InvalidRequestError("model", f"{request.model!r} is not served here (serving {self.settings.model_name!r})")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request.request_id)}")
        ids = self._prompt_ids(request)
        if len(ids) >= max_len:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens leave no room to generate in the context length {max_len}")
        sampling = request.sampling
        sampling.check_finite()
        # unset max_tokens: as much as fits, at most the default
        max_tokens = sampling.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, max_len - len(ids)))
        params = sampling.params(max_tokens, vocab_size=len(self.tokenizer))
        if params.structured is not None:
            check_structured(params.structured)
        stop = checked_stop(list(sampling.stop))
        if len(ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {max_len}",
            )
        return Validated(ids, params, stop, check_priority(request.priority))

    def _prompt_ids(self, request: RouterRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, TokenPrompt):
            return self._token_ids(prompt)
        if isinstance(prompt, TextPrompt):
            if not prompt.text:
                raise InvalidRequestError("prompt.text", "must not be empty")
            self._check_prompt_chars("prompt.text", len(prompt.text))
            return encode_prompt(self.tokenizer, prompt.text, raw=prompt.raw)
        if isinstance(prompt, ChatPrompt):
            return self._chat_ids(prompt)
        raise InvalidRequestError("prompt", "one of token_ids, text or chat is required")

    def _token_ids(self, prompt: TokenPrompt) -> list[int]:
        ids = list(prompt.ids)
        if not ids:
            raise InvalidRequestError("prompt.token_ids", "must not be empty")
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in ids):
            raise InvalidRequestError("prompt.token_ids", f"every id must be < {vocab}")
        return ids

    def _chat_ids(self, prompt: ChatPrompt) -> list[int]:
        messages = [_chat_message(m) for m in prompt.messages]
        if prompt.tools and "tools" not in (getattr(self.tokenizer, "chat_template", None) or ""):
            raise InvalidRequestError("prompt.chat.tools", "this model's chat template does not support tools")
        if not messages:
            raise InvalidRequestError("prompt.chat.messages", "must contain at least one message")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(f"prompt.chat.messages[{i}].role", f"must be system, user, assistant or tool, got {m['role']!r}")
        self._check_prompt_chars("prompt.chat.messages", sum(len(m["content"]) for m in messages))
        try:
            return encode_chat(self.tokenizer, messages, prompt.tools)
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


def _chat_message(turn: ChatTurn) -> dict:
    message = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    return message


def checked_stop(stop: list[str]) -> list[str]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(text)}")
    return stop


def check_structured(constraint: StructuredOutput) -> None:
    """What the router can check without xgrammar (which loads torch): a JSON schema parses and is a
    valid schema, a regex compiles. The workers compile the constraint and refuse what xgrammar cannot
    (INVALID_ARGUMENT `structured_output`), before any work."""
    field_name = "sampling.structured_output"
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(field_name, f"the JSON schema is not JSON: {exc}") from None
        except jsonschema.SchemaError as exc:
            raise InvalidRequestError(field_name, f"not a valid JSON schema: {exc.message}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(field_name, "a JSON schema is an object")
    elif constraint.kind == "regex":
        try:
            re.compile(constraint.spec)
        except re.error as exc:
            raise InvalidRequestError(field_name, f"not a valid regular expression: {exc}") from None
