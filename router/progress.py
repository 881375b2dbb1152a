"""`Progress`: what the router knows about one request across its attempts and migrations.

Created by the orchestrator when a validated request starts; each attempt asks it for the
`DecodeRequest` that continues from what was already streamed; the orchestrator and the relay add
the workers' stage timings and the tokens to it; `final` turns it into the last `GenerateResponse`
of one sequence (usage, its critical path: router.critical_path).
A request with n > 1 has one `SequenceProgress` per sequence (its tokens, detokenizer, finish).
Sequences that diverged cannot continue as one `DecodeRequest`, so a group migrates whole: the next
attempt restarts the n sequences from the prompt with the same seed (`replayable` pins one when the
client gave none) and the relay drops each sequence's re-produced tokens up to what was already
streamed (`SequenceProgress.replay`), then streams on; sequences already finished are not streamed
again. Greedy and seeded sampling reproduce the same tokens; a replay that diverges ends the request.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

from opentelemetry.context import Context

from common.sampling import SamplingParams
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.critical_path import close_path
from router.detokenizer import IncrementalDetokenizer
from router.metrics import RouterMetrics


@dataclass
class SequenceProgress:
    """One of the request's n sequences, as streamed so far."""

    index: int
    detok: IncrementalDetokenizer | None
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    last_token_at: float | None = None
    replayed: int = 0
    """Tokens of `generated` the current attempt has produced again (a restarted group)."""

    def add(self, token_ids: list[int]) -> None:
        """Tokens streamed to the client."""
        self.generated.extend(token_ids)
        self.replayed = len(self.generated)

    def replay(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` re-produce tokens already streamed (to drop); ReplayDiverged
        when the restarted sequence drew other tokens."""
        count = min(len(token_ids), len(self.generated) - self.replayed)
        if count <= 0:
            return 0
        if token_ids[:count] != self.generated[self.replayed : self.replayed + count]:
            raise ReplayDiverged(f"sequence {self.index} drew other tokens when its group restarted on another decode worker")
        self.replayed += count
        return count


class ReplayDiverged(Exception):
    """A restarted group did not reproduce the tokens already streamed."""


def replayable(params: SamplingParams) -> SamplingParams:
    """A sampled group without a seed gets one, so that a restart (migration) draws the same tokens."""
    if params.n == 1 or params.greedy or params.seed is not None:
        return params
    return dataclasses.replace(params, seed=random.randrange(2**62))


@dataclass
class Progress:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrived: float
    deadline: float
    sequences: list[SequenceProgress]
    timings: pb.StageTimings = field(default_factory=pb.StageTimings)
    last_token_at: float | None = None
    prefill_done_at: float | None = None
    """When the prefill worker's answer arrived (the first_token stage starts there)."""
    cached_prompt_tokens: int = 0
    attempts: int = 0
    trace: Context = field(default_factory=Context)
    """The request's `generate` span as parent: each attempt's spans and worker calls hang under it."""
    priority: int = 0

    def remaining(self) -> float:
        """Seconds left before the client's deadline (what every worker call may take)."""
        return max(0.05, self.deadline - time.monotonic())

    def started_attempt(self) -> None:
        """A Decode call goes out: the router_queue stage ends (at the first attempt)."""
        if not self.timings.router_queue_s:
            self.timings.router_queue_s = time.monotonic() - self.arrived

    def worker_stages(self, timings: pb.StageTimings, prefill_done: bool = False) -> None:
        """Stages a worker measured, of the attempt that produced the first token (a later attempt's are
        part of `other`); a local prefill's arrive with D's finish message, after the tokens."""
        if (self.last_token_at is not None and not timings.local_prefill) or self.timings.local_prefill:
            return
        for stage in ("decode_admission_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s"):
            if getattr(timings, stage):
                setattr(self.timings, stage, getattr(timings, stage))
        self.timings.local_prefill = self.timings.local_prefill or timings.local_prefill
        if prefill_done:
            self.prefill_done_at = time.monotonic()

    def kv_admitted(self, admission: pb.KVAdmission) -> None:
        """What the prompt's KV does on the attempt that produces the first token: blocks D already held
        (reused) and blocks the prefill worker sends (moved)."""
        if self.last_token_at is None:
            self.timings.kv_blocks_reused = admission.kv_blocks_reused
            self.timings.kv_blocks_moved = admission.kv_blocks_moved

    @property
    def num_generated(self) -> int:
        return sum(len(s.generated) for s in self.sequences)

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def next_attempt(self) -> pb.DecodeRequest:
        """A DecodeRequest that continues from what was already streamed: prompt + generated for one
        sequence; the prompt again for a group (its sequences replay what they streamed)."""
        single = len(self.sequences) == 1
        for seq in self.sequences:
            seq.replayed = len(seq.generated) if single else 0
        generated = self.sequences[0].generated if single else []
        done = len(generated)
        structured = self.params.structured
        if structured is not None and done:  # the constraint continues after what was streamed
            structured = dataclasses.replace(structured, accepted=tuple(generated))
        remaining = dataclasses.replace(self.params, max_tokens=self.params.max_tokens - done,
                                        min_tokens=max(0, self.params.min_tokens - done), structured=structured)
        request_id = f"{self.request_id}.{self.attempts}"
        self.attempts += 1
        return pb.DecodeRequest(request_id=request_id, token_ids=self.prompt_ids + generated, sampling=sampling_to_proto(remaining),
                                priority=self.priority)

    def final(self, chunk: pb.TokenChunk, reason: int, metrics: RouterMetrics, seq: SequenceProgress) -> pb.GenerateResponse:
        """The last message of `seq`, with its critical path; the request's is observed when its last sequence ends."""
        seq.finished = True
        chunk.index = seq.index
        close_path(self.timings, self.arrived, self.prefill_done_at, time.monotonic())
        if self.all_finished:
            metrics.e2e.observe(self.timings.e2e_s)
            if reason != pb.FINISH_REASON_ERROR:  # a failed request's path is no measure of the split
                metrics.observe_path(self.timings, len(seq.generated))  # decode_s is this sequence's
        usage = pb.Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(seq.generated),
                         cached_prompt_tokens=self.cached_prompt_tokens)
        return pb.GenerateResponse(request_id=self.request_id, chunk=chunk, finish_reason=reason, usage=usage, timings=self.timings)
