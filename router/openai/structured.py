"""Structured output and tool calling on the OpenAI API: request fields -> a constraint, output -> tool calls.

`response_constraint` turns `response_format` (text, json_object, json_schema) or vLLM's `guided_json`,
`guided_regex`, `guided_grammar` extensions into the engine's `StructuredOutput` (the workers compile
and enforce it). `tool_plan` checks `tools` / `tool_choice` and decides, as vLLM does:
  - `none`: the tools are not rendered and the output is plain text;
  - `auto` (the default with tools): the tools are rendered through the model's chat template and the
    output is parsed for the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  - `required`: the output is constrained to a JSON array of `{"name", "parameters"}` calls (one or more);
  - a named function: the output is constrained to that function's `parameters` schema: it is the call's
    arguments.
`ToolCalls` turns the text of one choice into `message.tool_calls` (or streamed `delta.tool_calls`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from common.errors import InvalidRequestError
from common.sampling import StructuredOutput
from router.openai.errors import invalid
from router.validation import check_structured

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


def response_constraint(body) -> tuple[str, StructuredOutput | None]:
    """The output constraint a request asks for and the field it came from, checked (400 naming that field)."""
    fmt = body.response_format
    given = [name for name in ("guided_json", "guided_regex", "guided_grammar") if getattr(body, name) is not None]
    if fmt is not None and fmt.get("type", "text") != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise invalid(given[1], f"cannot be combined with {given[0]}")
    if not given:
        return "response_format", None
    name = given[0]
    if name == "response_format":
        constraint = _from_response_format(fmt)
    elif name == "guided_json":
        spec = body.guided_json
        constraint = StructuredOutput("json_schema", spec if isinstance(spec, str) else json.dumps(spec))
    else:
        constraint = StructuredOutput(name.removeprefix("guided_"), getattr(body, name))
    _checked(name, constraint)
    return name, constraint


def _from_response_format(fmt: dict) -> StructuredOutput:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise invalid("response_format", "json_schema must be an object with a name and a schema")
    schema = spec.get("schema", _ANY_OBJECT)
    if not isinstance(schema, (dict, bool)):
        raise invalid("response_format", "json_schema.schema must be a JSON schema object")
    return StructuredOutput("json_schema", json.dumps(schema))


def _checked(param: str, constraint: StructuredOutput) -> None:
    try:
        check_structured(constraint)
    except InvalidRequestError as exc:
        raise invalid(param, exc.message) from None


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its answer."""

    tools: list[dict]
    """Rendered through the chat template (empty with tool_choice none)."""
    choice: str
    """"auto" | "required" | "named"."""
    function: str = ""
    """The named function."""
    constraint: StructuredOutput | None = None


def tool_plan(body) -> ToolPlan | None:
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "needs tools")
        return None
    schemas = {_function_name(i, tool): (tool["function"].get("parameters") or _ANY_OBJECT) for i, tool in enumerate(tools)}
    if choice in (None, "auto"):
        return ToolPlan(tools, "auto")
    if choice == "none":
        return None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in schemas.items()]
        constraint = StructuredOutput("json_schema", json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}}))
        return ToolPlan(tools, "required", constraint=constraint)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in schemas:
        raise invalid("tool_choice", f"must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                     f"naming one of the tools ({', '.join(schemas)}), got {choice!r}")
    return ToolPlan(tools, "named", name, StructuredOutput("json_schema", json.dumps(schemas[name])))


def _function_name(i: int, tool) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise invalid(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {...}}")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid(f"tools[{i}].function.name", "is required")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(f"tools[{i}].function.parameters", "must be a JSON schema object")
        _checked(f"tools[{i}].function.parameters", StructuredOutput("json_schema", json.dumps(parameters)))
    return function["name"]


@dataclass
class ToolCalls:
    """One choice's tool calls, from its text. Named calls stream their arguments as they come; the
    other modes are parsed once the text is complete."""

    plan: ToolPlan
    ids: list[str] = field(default_factory=list)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the complete text."""
        plan = self.plan
        if plan.choice == "named":
            return None, [self._call(0, plan.function, text)]
        if plan.choice == "required":
            try:
                return None, [self._call(i, c["name"], json.dumps(c["parameters"])) for i, c in enumerate(json.loads(text))]
            except (json.JSONDecodeError, KeyError, TypeError):  # cut short by max_tokens
                return text, []
        calls = []
        for found in _TOOL_CALL.findall(text):
            try:
                call = json.loads(found)
                calls.append(self._call(len(calls), call["name"], json.dumps(call.get("arguments", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text stays content
        content = _TOOL_CALL.sub("", text).strip() if calls else text
        return content or None, calls

    def stream_delta(self, text: str, first: bool) -> dict:
        """A named call's argument delta (the call's id and name with the first)."""
        entry: dict = {"index": 0, "function": {"arguments": text}}
        if first:
            entry.update(id=self._id(0), type="function")
            entry["function"]["name"] = self.plan.function
        return {"tool_calls": [entry]}

    def final_delta(self, text: str) -> dict:
        """The buffered text of a required / auto choice as one delta."""
        content, calls = self.parse(text)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta

    def _call(self, index: int, name: str, arguments: str) -> dict:
        return {"id": self._id(index), "type": "function", "function": {"name": name, "arguments": arguments}}

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append("call_" + uuid.uuid4().hex[:24])
        return self.ids[index]
