"""The OpenAI side of structured output and tool calling (router/openai/structured.py), without a
cluster: request fields -> constraints (errors name the field), tool_choice modes, parsing a
choice's text into tool_calls, and the constraint's trip through the proto."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.sampling import StructuredOutput
from proto.convert import sampling_from_proto, sampling_to_proto
from router.openai.errors import OpenAIError
from router.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.openai.structured import ToolCalls, response_constraint, tool_plan

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "time"}}]
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def param_of(call) -> str:
    with pytest.raises(OpenAIError) as err:
        call()
    return err.value.param


def test_response_format_and_guided_fields_become_constraints():
    assert response_constraint(chat()) == ("response_format", None)
    assert response_constraint(chat(response_format={"type": "text"})) == ("response_format", None)
    assert response_constraint(chat(response_format={"type": "json_object"})) == ("response_format", StructuredOutput("json_object"))
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    assert response_constraint(chat(response_format=fmt)) == ("response_format", StructuredOutput("json_schema", json.dumps(SCHEMA)))
    completion = CompletionRequest.model_validate({"prompt": "x", "guided_json": SCHEMA})
    assert response_constraint(completion)[1] == StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert response_constraint(chat(guided_regex="[0-9]+")) == ("guided_regex", StructuredOutput("regex", "[0-9]+"))


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "wizard"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
])
def test_a_bad_constraint_names_its_field(fields, param):
    assert param_of(lambda: response_constraint(chat(**fields))) == param


def test_tool_choice_modes():
    assert tool_plan(chat()) is None
    assert tool_plan(chat(tools=TOOLS, tool_choice="none")) is None
    auto = tool_plan(chat(tools=TOOLS))
    assert auto.choice == "auto" and auto.tools == TOOLS and auto.constraint is None
    named = tool_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}))
    assert named.choice == "named" and json.loads(named.constraint.spec) == SCHEMA
    required = tool_plan(chat(tools=TOOLS, tool_choice="required"))
    schema = json.loads(required.constraint.spec)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "parameters": {}}], schema)  # city is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "weather"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]}, "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(fields, param):
    assert param_of(lambda: tool_plan(chat(**fields))) == param


def test_auto_output_is_parsed_for_hermes_tool_calls():
    calls = ToolCalls(tool_plan(chat(tools=TOOLS)))
    text = ('Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
    content, parsed = calls.parse(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [("weather", {"city": "Oslo"}), ("time", {})]
    assert len({c["id"] for c in parsed}) == 2 and all(c["type"] == "function" for c in parsed)
    assert calls.parse("no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert calls.parse(broken) == (broken, [])
    assert calls.final_delta(text)["tool_calls"][1]["index"] == 1


def test_named_and_required_outputs():
    named = ToolCalls(tool_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})))
    first, rest = named.stream_delta('{"city"', True), named.stream_delta(': "Oslo"}', False)
    assert first["tool_calls"][0]["function"] == {"arguments": '{"city"', "name": "weather"} and first["tool_calls"][0]["id"]
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
    content, (call,) = named.parse('{"city": "Oslo"}')
    assert content is None and call["id"] == first["tool_calls"][0]["id"]  # one id, streamed or not
    required = ToolCalls(tool_plan(chat(tools=TOOLS, tool_choice="required")))
    _, calls = required.parse('[{"name": "time", "parameters": {}}]')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("time", "{}")]


@pytest.mark.parametrize("constraint", [StructuredOutput("json_object"), StructuredOutput("json_schema", json.dumps(SCHEMA)),
                                        StructuredOutput("regex", "[a-z]+"), StructuredOutput("grammar", 'root ::= "yes"')])
def test_the_constraint_travels_through_the_proto(constraint):
    from common.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, structured=constraint)
    assert sampling_from_proto(sampling_to_proto(params)).structured == constraint
    continued = SamplingParams(max_tokens=8, structured=StructuredOutput(constraint.kind, constraint.spec, (5, 6)))
    assert sampling_from_proto(sampling_to_proto(continued)).structured.accepted == (5, 6)
    assert sampling_from_proto(sampling_to_proto(SamplingParams(max_tokens=8))).structured is None
