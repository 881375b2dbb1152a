"""The n choices of one OpenAI request (`n` > 1): one `Choice` per sequence of the router's stream.

The router core interleaves the n sequences' `GenerateResponse`s, each naming its sequence in
`chunk.index`; `Choices.absorb` hands each to its `Choice`. The request is done when every choice
has its finish reason; the answer lists the choices by index and its usage sums their completion
tokens (the prompt counted once, as OpenAI does). With the `critical_path` extension the answer (or a
stream's last chunk) carries the request's critical path (router.critical_path).
"""

from __future__ import annotations

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.critical_path import critical_path_json
from router.openai.convert import Prepared
from router.openai.responses import Choice, TokenLogprob


class Choices:
    def __init__(self, prep: Prepared, tokenizer):
        self.prep = prep
        self.choices = [Choice(prep, tokenizer, i) for i in range(prep.request.sampling.n or 1)]
        self.timings: pb.StageTimings | None = None
        """The critical path of the last sequence to finish (the request's)."""

    def absorb(self, response: pb.GenerateResponse) -> tuple[Choice, str, list[TokenLogprob]]:
        """The message's choice, text delta and logprobs. A failed request raises OpenAIError."""
        choice = self.choices[min(response.chunk.index, len(self.choices) - 1)]
        text, entries = choice.absorb(response)
        if response.finish_reason:
            self.timings = response.timings
        return choice, text, entries

    def with_critical_path(self, body: dict) -> dict:
        """`body` with the request's critical path when the client asked for it and the request has finished."""
        if self.prep.critical_path and self.finished and self.timings is not None:
            body["critical_path"] = critical_path_json(self.timings)
        return body

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict:
        prompt = max(c.prompt_tokens for c in self.choices)
        completion = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max(c.cached_tokens for c in self.choices)}}

    def response_body(self) -> dict:
        bodies = [c.response_body() for c in self.choices]  # once each: completion logprobs advance their text offsets
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = self.usage()
        return self.with_critical_path(body)

    def usage_chunk(self) -> dict:
        return {**self.choices[0].usage_chunk(), "usage": self.usage()}
