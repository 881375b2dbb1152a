"""`n` > 1 over the OpenAI API with a scripted router core: the interleaved sequences of one stream
(`chunk.index`) become `choices` 0..n-1 (streaming: chunks with their index, one role delta per chat
choice), the request ends when every choice has finished, usage sums the completion tokens."""

from __future__ import annotations

from proto.pdserve.v1 import pdserve_pb2 as pb
from tests.unit.test_openai_schema import client_for, sse_events


def part(index: int, text: str, ids: list[int], finish: int = 0, **kw) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=ids, text=text, index=index), finish_reason=finish, **kw)


TWO = [part(0, "He", [1], prompt_token_ids=[7, 8]), part(1, "Yo", [4]), part(1, "!", [5], pb.FINISH_REASON_STOP,
       usage=pb.Usage(prompt_tokens=2, completion_tokens=2)), part(0, "y", [2]),
       part(0, "", [], pb.FINISH_REASON_LENGTH, usage=pb.Usage(prompt_tokens=2, completion_tokens=2))]


def test_completion_n2_lists_both_choices_and_sums_usage():
    client, _ = client_for(TWO)
    body = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 2}).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "Hey", "length"), (1, "Yo!", "stop")]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_n2_carries_each_choice_index():
    client, _ = client_for(TWO)
    resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2,
                                                     "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    assert all(e["choices"][0]["delta"]["role"] == "assistant" for e in events[:2])
    texts = {0: "", 1: ""}
    for e in events[2:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["delta"].get("content") or ""
    assert texts == {0: "Hey", 1: "Yo!"}
    assert {e["choices"][0]["index"]: e["choices"][0]["finish_reason"] for e in events[2:-1] if e["choices"][0]["finish_reason"]} == {
        0: "length", 1: "stop"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
