"""The one request type the router core consumes, whichever front end received it.

The gRPC API (`router.grpc_api`) converts a `pdserve.v1.GenerateRequest` into a `RouterRequest`;
the OpenAI HTTP API (`router.openai.convert`) builds one from a JSON body. Nothing here is checked
yet: `router.validation` does that, naming fields by their public gRPC path (`sampling.top_p`,
`prompt.chat.messages[0].role`) so each front end can map them back to its own names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from common.errors import InvalidRequestError
from common.sampling import SamplingParams, StructuredOutput

DEFAULTS = SamplingParams(temperature=1.0)
"""What an unset sampling field means (max_tokens aside: the router fills it from the context)."""
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "n")


@dataclass(frozen=True)
class TokenPrompt:
    ids: list[int]


@dataclass(frozen=True)
class TextPrompt:
    text: str
    raw: bool = False
    """True: tokenize the text as is; False: render it as one user turn of the chat template."""


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str
    tool_calls: list[dict] | None = None
    """An assistant turn's calls, in the chat template's shape ({"name", "arguments": {...}} under "function")."""
    tool_call_id: str | None = None


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[ChatTurn]
    tools: list[dict] | None = None
    """OpenAI-style function tools, rendered by the chat template (`apply_chat_template(tools=...)`)."""


Prompt = TokenPrompt | TextPrompt | ChatPrompt


@dataclass
class SamplingRequest:
    """Sampling as the client asked for it; None = not given (the default applies)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    n: int | None = None
    """Sequences to generate (None: 1)."""

    def check_finite(self) -> None:
        """NaN passes every range check (all comparisons are false) and would poison the sampler."""
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidRequestError(f"sampling.{name}", f"must be a finite number, got {value}")

    def params(self, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """Validated engine parameters (token ids checked against `vocab_size`); errors name `sampling.<field>`."""
        given = {name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None}
        params = dataclasses.replace(DEFAULTS, **given, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                     stop_token_ids=tuple(self.stop_token_ids), logit_bias=dict(self.logit_bias),
                                     min_tokens=self.min_tokens, structured=self.structured)
        try:
            params.validate(vocab_size)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"sampling.{exc.field}", exc.message) from None
        return params


@dataclass
class RouterRequest:
    """One generation request, as both front ends hand it to `RouterService.stream`."""

    prompt: Prompt | None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    request_id: str = ""
    """Empty: the router assigns one."""
    model: str = ""
    """Empty: whatever is served."""
    skip_detokenize: bool = False
    priority: int = 0
    """Scheduling priority, higher first (engine.sequence.PRIORITY_RANGE)."""
