"""An OpenAI request model -> the router core's `RouterRequest` (plus what the answer needs).

`prepare` checks what the models cannot (served model, n, unsupported features, context length),
turns chat messages or a completion prompt and the sampling fields into a `RouterRequest`, and
keeps in `Prepared` what shaping the answer needs (kind, id, stream options, logprobs).
`param_from_service` maps the core's field names (`sampling.top_p`) back to OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from common.sampling import MAX_N
from router.openai.errors import invalid
from router.openai.protocol import ROLES, ChatCompletionRequest, ChatMessage, CompletionRequest
from router.openai.structured import ToolPlan, response_constraint, tool_plan
from router.request import ChatPrompt, ChatTurn, Prompt, RouterRequest, SamplingRequest, TextPrompt, TokenPrompt
from router.settings import RouterSettings
from router.validation import MAX_STOP_STRINGS

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for the legacy completions endpoint; chat leaves it to the server default."""


@dataclass
class Prepared:
    """One converted request, ready for the router core."""

    kind: str  # "completion" | "chat"
    request: RouterRequest
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    max_tokens_param: str = "max_tokens"
    tools: ToolPlan | None = None
    structured_param: str = "response_format"
    """The field the output constraint came from (its compile errors name it)."""
    critical_path: bool = False
    """Answer with the request's critical path (the `critical_path` extension)."""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(body: CompletionRequest | ChatCompletionRequest, settings: RouterSettings) -> Prepared:
    kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    if body.model is not None and body.model != settings.model_name:
        raise invalid("model", f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                      code="model_not_found")
    _check_unsupported(body)
    request_id = uuid.uuid4().hex
    plan = tool_plan(body) if kind == "chat" else None
    if kind == "chat":
        prompt = _chat_prompt(body, plan)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        prompt = _completion_prompt(body)
        logprobs = body.logprobs
    prep = Prepared(kind=kind, request=RouterRequest(prompt, request_id=request_id, model=settings.model_name, priority=body.priority or 0),
                    model=settings.model_name, stream=bool(body.stream), logprobs=logprobs,
                    include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
                    critical_path=bool(body.critical_path),
                    id=("chatcmpl-" if kind == "chat" else "cmpl-") + request_id)
    prep.request.sampling = _sampling(prep, body, settings)
    prep.tools = plan
    prep.request.sampling.structured = _constraint(prep, body, plan)
    return prep


def _constraint(prep: Prepared, body, plan: ToolPlan | None):
    prep.structured_param, constraint = response_constraint(body)
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise invalid("response_format", f"cannot be combined with tool_choice {plan.choice}")
        constraint, prep.structured_param = plan.constraint, "tool_choice"
    return constraint
def _check_unsupported(body) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise invalid("n", f"must be an integer in [1, {MAX_N}], got {body.n}")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise invalid("echo", "is not supported")
        if body.best_of is not None and body.best_of != 1:
            raise invalid("best_of", f"only best_of=1 is supported, got {body.best_of}")
        if body.suffix:
            raise invalid("suffix", "is not supported")


def _completion_prompt(body: CompletionRequest) -> Prompt:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("prompt", f"only one prompt per request is supported, got {len(prompt)}")
        prompt = prompt[0]
    if not prompt:
        raise invalid("prompt", "must not be empty")
    return TextPrompt(prompt, raw=True) if isinstance(prompt, str) else TokenPrompt(list(prompt))


def _chat_prompt(body: ChatCompletionRequest, plan: ToolPlan | None) -> ChatPrompt:
    if not body.messages:
        raise invalid("messages", "must contain at least one message")
    turns = []
    for i, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise invalid(f"messages[{i}].role", f"must be one of system, developer, user, assistant, tool, got {message.role!r}")
        turns.append(ChatTurn(role, _message_text(i, message), _template_calls(i, message.tool_calls), message.tool_call_id))
    return ChatPrompt(turns, plan.tools if plan else None)


def _template_calls(i: int, calls: list[dict] | None) -> list[dict] | None:
    """OpenAI's calls carry JSON-text arguments; chat templates expect them as objects."""
    if not calls:
        return None
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"messages[{i}].tool_calls[{j}].function", "must be an object with a name and arguments")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments", "must be JSON") from None
        out.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


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


def _sampling(prep: Prepared, body, settings: RouterSettings) -> SamplingRequest:
    max_tokens, name = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None and prep.kind == "completion":
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens is not None and max_tokens >= settings.max_model_len:
        raise invalid(name, f"{max_tokens} leaves no room for the prompt in the model's context length {settings.max_model_len}")
    prep.max_tokens_param = name
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return SamplingRequest(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k if body.top_k is not None and body.top_k > 0 else None,
        seed=body.seed,
        stop=[s for s in stop if s],
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=bool(body.ignore_eos),
        logprobs=prep.logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias or {}),
        min_tokens=body.min_tokens or 0,
        n=body.n,
    )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as the JSON object's keys ("50256": -100)."""
    for key in bias:
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid("logit_bias", f"keys must be token ids (non-negative integers as strings), got {key!r}")
    return {int(key): value for key, value in bias.items()}


def param_from_service(field_path: str, prep: Prepared) -> str:
    """The router core names proto fields (`sampling.top_p`, `prompt.chat.messages[0].role`);
    the client knows OpenAI's names."""
    if field_path == "sampling.max_tokens":
        return prep.max_tokens_param
    if field_path in ("sampling.structured_output", "structured_output"):
        return prep.structured_param
    if field_path.startswith("sampling."):
        return field_path.removeprefix("sampling.")
    if field_path.startswith("prompt.chat."):
        return field_path.removeprefix("prompt.chat.")
    if field_path.startswith("prompt"):
        return "messages" if prep.kind == "chat" else "prompt"
    return field_path
