"""One request inside the engine: its tokens, its blocks and its state.

Lifecycle (RequestState):
  WAITING --schedule--> RUNNING --finish--> FINISHED_*
  RUNNING --preempt (recompute)--> WAITING
  WAITING_FOR_REMOTE_KV --kv arrived--> RUNNING      (decode worker: prefill done elsewhere)
  any --abort--> FINISHED_ABORTED
A prefill-only request (prefill worker) finishes with FINISHED_PREFILLED after its first token
and keeps its blocks until the KV has been sent (`Engine.release`).

A request with `n` > 1 is a group of n Sequences sharing `group_id` (the request's id); sequence 0
runs the prompt and, once it is computed, `fork`s sequences 1..n-1 (each its own `request_id`,
`group_id/index`), which start RUNNING with the prompt's full blocks shared (see `Engine._fork`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.request_types import FinishReason, check_priority
from common.sampling import SamplingParams

__all__ = ["FinishReason", "RequestState", "Sequence", "check_priority"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_PREFILLED = "finished_prefilled"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


_FINISH_REASONS = {
    RequestState.FINISHED_STOPPED: FinishReason.STOP,
    RequestState.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestState.FINISHED_ABORTED: FinishReason.ABORT,
    RequestState.FINISHED_PREFILLED: FinishReason.PREFILLED,
}


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at admission."""
    num_preemptions: int = 0
    group_id: str = ""
    """The request this sequence belongs to (its `request_id` when n = 1 or for sequence 0)."""
    index: int = 0
    """Which of the request's n sequences this is (the OpenAI choice index)."""
    forks_pending: int = 0
    """Sequence 0 of a group: how many siblings it forks once its prompt is computed."""
    first_step_at: float | None = None
    """time.monotonic() when the first step that computed any of its tokens began (queue time ends there)."""
    priority: int = 0
    """Higher is admitted first and preempted last (engine.scheduler); FCFS within a priority."""
    reuse_cached: bool = True
    """False: the prompt is computed whole, nothing taken from the prefix cache or its tier (an independent
    recompute: the router's canary)."""

    def __post_init__(self):
        self.group_id = self.group_id or self.request_id

    @property
    def seed(self) -> int | None:
        """This sequence's sampling seed: the request's seed for sequence 0, seed + index for the others."""
        return None if self.params.seed is None else self.params.seed + self.index

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.state)

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def fork(self, index: int, num_computed_tokens: int) -> Sequence:
        """Sibling `index` of this group's sequence 0, sharing the prompt's first `num_computed_tokens`
        tokens of KV (the caller shares the blocks); it computes the rest of the prompt itself."""
        return Sequence(f"{self.group_id}/{index}", list(self.prompt_token_ids), self.params, group_id=self.group_id,
                        index=index, state=RequestState.RUNNING, num_computed_tokens=num_computed_tokens,
                        num_cached_tokens=min(self.num_cached_tokens, num_computed_tokens), priority=self.priority,
                        arrival_time=self.arrival_time)

    def reset_for_recompute(self) -> None:
        """Preempted: drop computed KV; prompt and output so far will be prefilled again."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1
        self.state = RequestState.WAITING
