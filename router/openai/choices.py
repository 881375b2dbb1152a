"""The n choices of one OpenAI request (`n` > 1): one `Choice` per sequence of the router's stream.

The router core interleaves the n sequences' `GenerateResponse`s, each naming its sequence in
`chunk.index`; `Choices.absorb` hands each to its `Choice`. The request is done when every choice
has its finish reason; the answer lists the choices by index and its usage sums their completion
tokens (the prompt counted once, as OpenAI does).
"""

from __future__ import annotations

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.openai.convert import Prepared
from router.openai.responses import Choice, TokenLogprob


class Choices:
    def __init__(self, prep: Prepared, tokenizer):
        self.prep = prep
        self.choices = [Choice(prep, tokenizer, i) for i in range(prep.request.sampling.n or 1)]

    def absorb(self, response: pb.GenerateResponse) -> tuple[Choice, str, list[TokenLogprob]]:
        """The message's choice, text delta and logprobs. A failed request raises OpenAIError."""
        choice = self.choices[min(response.chunk.index, len(self.choices) - 1)]
        text, entries = choice.absorb(response)
        return choice, text, entries

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
        return body

    def usage_chunk(self) -> dict:
        return {**self.choices[0].usage_chunk(), "usage": self.usage()}
