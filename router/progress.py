"""`Progress`: what the router knows about one request across its attempts and migrations.

Created by the orchestrator when a validated request starts; each attempt asks it for the
`DecodeRequest` that continues from what was already streamed; the relay adds tokens and timings
to it; `final` turns it into the last `GenerateResponse` (usage, per-stage timings).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from engine.sampling import SamplingParams
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics


@dataclass
class Progress:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrived: float
    deadline: float
    detok: IncrementalDetokenizer | None
    generated: list[int] = field(default_factory=list)
    timings: pb.StageTimings = field(default_factory=pb.StageTimings)
    last_token_at: float | None = None
    cached_prompt_tokens: int = 0
    attempts: int = 0
    trace: Context = field(default_factory=Context)
    """The request's `generate` span as parent: each attempt's spans and worker calls hang under it."""

    def remaining(self) -> float:
        """Seconds left before the client's deadline (what every worker call may take)."""
        return max(0.05, self.deadline - time.monotonic())

    def next_attempt(self) -> pb.DecodeRequest:
        """A DecodeRequest that continues from what was already streamed (prompt + generated)."""
        done = len(self.generated)
        structured = self.params.structured
        if structured is not None and done:  # the constraint continues after what was streamed
            structured = dataclasses.replace(structured, accepted=tuple(self.generated))
        remaining = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - done,
                                        min_tokens=max(0, self.params.min_tokens - done), structured=structured)
        request_id = f"{self.request_id}.{self.attempts}"
        self.attempts += 1
        return pb.DecodeRequest(request_id=request_id, token_ids=self.prompt_ids + self.generated, sampling=sampling_to_proto(remaining))

    def final(self, chunk: pb.TokenChunk, reason: int, metrics: RouterMetrics) -> pb.GenerateResponse:
        self.timings.e2e_s = time.monotonic() - self.arrived
        metrics.e2e.observe(self.timings.e2e_s)
        usage = pb.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.generated),
                         cached_prompt_tokens=self.cached_prompt_tokens)
        return pb.GenerateResponse(request_id=self.request_id, chunk=chunk, finish_reason=reason, usage=usage, timings=self.timings)
