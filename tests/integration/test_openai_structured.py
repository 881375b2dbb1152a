"""Structured output and tool calling through the OpenAI API on real clusters (router + prefill +
decode processes; the prefill worker samples the first token under the constraint, the decode
worker the rest), driven by the official `openai` client.

- the demo model: `response_format` json_schema output parses and validates; an invalid schema is a
  400 naming `response_format`; its chat template has no tools, so `tools` is a 400 naming `tools`.
- a tiny random-weight model whose chat template renders tools (engine/testing/tool_model.py): a
  named `tool_choice` gives a call whose arguments fit the function's schema (the constraint makes
  random weights produce it), streamed as `delta.tool_calls` too; the call and a tool result go back
  for a final answer. Every cluster ends with no KV block leaked.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bench.cluster import LocalCluster, write_config
from engine.testing.tool_model import build_tool_model

ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, for some days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class _Chat:
    """`client.chat.completions.create` with the served model filled in."""

    def __init__(self, cluster: LocalCluster):
        self.client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0, timeout=180)
        self.model = self.client.models.list().data[0].id

    def create(self, **kwargs):
        return self.client.chat.completions.create(model=self.model, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.client.close()


def _cluster(tmp_path_factory, name: str, **engine):
    config = write_config(tmp_path_factory.mktemp(name) / "pdserve.yaml", transport="tcp", engine=engine)
    with LocalCluster(config, num_prefill=1, num_decode=1) as c:
        yield c


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    yield from _cluster(tmp_path_factory, "structured")


@pytest.fixture(scope="module")
def tool_cluster(tmp_path_factory):
    yield from _cluster(tmp_path_factory, "tools", model=str(build_tool_model()))


def test_json_schema_response_and_refusals(demo_cluster):
    with _Chat(demo_cluster) as client:
        for city in ("France", "Italy"):
            resp = client.create(
                messages=[{"role": "user", "content": f"Give the capital of {city} and its population as JSON."}],
                temperature=0, max_tokens=80,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
            assert resp.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(resp.choices[0].message.content), ANSWER)
        with pytest.raises(openai.BadRequestError) as err:
            client.create(messages=ASK, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "wizard"}}})
        assert err.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError) as err:
            client.create(messages=ASK, max_tokens=8, tools=[WEATHER])
        assert err.value.body["param"] == "tools" and "chat template" in err.value.body["message"]
    demo_cluster.assert_no_leaked_blocks()


def test_tool_call_round_trip(tool_cluster):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with _Chat(tool_cluster) as client:
        resp = client.create(messages=ASK, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=40)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        streamed = list(client.create(messages=ASK, tools=[WEATHER], tool_choice=named, temperature=0,
                                                       max_tokens=40, stream=True))
        deltas = [d for chunk in streamed for d in (chunk.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather" and deltas[0].id
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert streamed[-1].choices[0].finish_reason == "tool_calls"

        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny", "celsius": 21}'}]
        final = client.create(messages=history, tools=[WEATHER], temperature=0, max_tokens=8)
        assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
        assert final.usage.prompt_tokens > resp.usage.prompt_tokens + 10  # the call and its result were rendered

        required = client.create(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                                                  max_tokens=80)
        calls = required.choices[0].message.tool_calls
        assert required.choices[0].finish_reason == "tool_calls" and calls
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
        with pytest.raises(openai.BadRequestError) as err:
            client.create(messages=ASK, tools=[WEATHER], max_tokens=8,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})
        assert err.value.body["param"] == "tool_choice"
    tool_cluster.assert_no_leaked_blocks()
