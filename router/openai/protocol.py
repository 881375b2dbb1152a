"""The OpenAI request bodies as strict pydantic models: `CompletionRequest`, `ChatCompletionRequest`.

They type-check a parsed JSON body (wrong types are errors, unknown fields are ignored as OpenAI
does) and are also the OpenAPI schema of the request bodies (`/openapi.json`). What they cannot
check (served model, n, unsupported features, context length) is `router.openai.convert`'s job,
and the schema states it through `json_schema_extra`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from common.request_types import PRIORITY_RANGE
from common.sampling import MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_N, REPETITION_PENALTY_RANGE

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""OpenAI's chat roles -> the router's."""


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
Penalty = Annotated[float, Field(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]
LogitBias = Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int | None = _documented(minimum=1, maximum=MAX_N)
    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, LogitBias] | None = _documented(maxProperties=MAX_LOGIT_BIAS_ENTRIES,
                                                          propertyNames={"pattern": "^[0-9]{1,10}$"})
    # extensions in the style of vLLM (the OpenAI client sends them through `extra_body`)
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    response_format: dict | None = None
    """{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}"""
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    critical_path: bool | None = None
    """pdserve extension: true adds the request's critical path (per-stage seconds) to the answer."""
    priority: Annotated[int, Field(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])] | None = None
    """Scheduling priority: higher is served first (0 when unset)."""


def _one_prompt(schema: dict) -> None:
    """The schema of `prompt` states what `prepare` serves: one non-empty prompt (a string, one string in a list,
    token ids, or one list of token ids), not the batch of prompts OpenAI's type allows."""
    for option in schema["anyOf"]:
        if option["type"] == "string":
            option["minLength"] = 1
            continue
        option["minItems"] = 1
        items = option["items"]
        if items["type"] == "string":
            option["maxItems"], items["minLength"] = 1, 1
        elif items["type"] == "array":
            option["maxItems"], items["minItems"] = 1, 1


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(json_schema_extra=_one_prompt)
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = _documented(False, enum=[False, None])
    best_of: int | None = _documented(minimum=1, maximum=1)
    suffix: str | None = _documented(maxLength=0)


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
    tool_calls: list[dict] | None = None
    """An assistant turn's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


REQUEST_SCHEMAS = (CompletionRequest, ChatCompletionRequest)
