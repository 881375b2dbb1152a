"""What the engine answers with: a step's `RequestOutput`s, its `EngineStats`, a decode worker's
`RemoteReservation` (the blocks a prompt's received KV lands in), and the cumulative `StepCounters`
behind the stats. Plain dataclasses; the engine (engine/engine.py) fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler import ScheduledSeq
from engine.sequence import FinishReason


@dataclass
class RequestOutput:
    request_id: str
    index: int = 0
    """Which of the request's n sequences produced this output."""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    first_step_at: float | None = None
    """time.monotonic() when the sequence's first step began: its queue time ends, its compute starts."""
    prompt_kv: list | None = None
    """A prefill-only request's prompt KV, [(K, V)] per layer (copies, `Engine.prompt_kv`), taken on the engine thread
    in the step that finished the prompt when no KV sink streams it layer by layer: its sender need not wait for
    the engine's next step (up to a whole prefill step on a busy worker) to read it."""


@dataclass(frozen=True)
class RemoteReservation:
    """A decode worker's blocks for a prompt whose KV a prefill worker sends."""

    block_ids: list[int]
    """Every block of the prompt (and its first token)."""
    held_tokens: int
    """Leading prompt tokens whose KV the pool already holds (whole blocks of its prefix cache): not sent."""
    num_prompt_tokens: int
    block_size: int

    @property
    def incoming_block_ids(self) -> list[int]:
        """The blocks the prompt's KV from `held_tokens` on lands in."""
        return self.block_ids[self.held_tokens // self.block_size :]

    @property
    def held_blocks(self) -> int:
        return self.held_tokens // self.block_size

    @property
    def moved_blocks(self) -> int:
        """Blocks whose KV arrives (the last one may be partial)."""
        return -(-(self.num_prompt_tokens - self.held_tokens) // self.block_size)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_waiting_for_kv: int
    num_held: int
    queued_prompt_tokens: int
    free_blocks: int
    total_blocks: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_preemptions: int
    steps: int
    step_seconds: float
    """Cumulative wall time of the steps that ran the model (mean step time = step_seconds / steps)."""
    prompt_tokens: int
    """Cumulative prompt tokens run through the model (prefix-cache hits and received KV excluded)."""
    generation_tokens: int
    """Cumulative tokens sampled (a prefill worker's first tokens included)."""
    prompt_steps: int = 0
    prompt_step_seconds: float = 0.0
    """The steps among `steps` that ran prompt tokens, and their wall time: with the others' mean (decode-only
    steps), what the prompts added to the steps they shared with decode streams (router.verdict)."""
    waiting_for_kv_blocks: int = 0
    """KV blocks reserved for requests waiting for their prompt's KV from a prefill worker (held, no stream yet)."""
    spec_proposed_tokens: int = 0
    """Speculative decoding: proposed tokens verified, those accepted, and steps that verified any."""
    spec_accepted_tokens: int = 0
    spec_steps: int = 0


@dataclass
class StepCounters:
    """The engine's cumulative counters, updated once per step."""

    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_steps: int = 0
    prompt_step_seconds: float = 0.0

    def record(self, scheduled: list[ScheduledSeq], num_sampled: int, seconds: float) -> int:
        """One model step (its prompt tokens returned); call before the sequences' computed-token counts advance."""
        self.steps += 1
        self.step_seconds += seconds
        self.generation_tokens += num_sampled
        prompt_tokens = sum(max(0, min(item.seq.num_prompt_tokens, item.seq.num_computed_tokens + item.num_tokens) - item.seq.num_computed_tokens)
                            for item in scheduled)
        self.prompt_tokens += prompt_tokens
        if prompt_tokens:
            self.prompt_steps += 1
            self.prompt_step_seconds += seconds
        return prompt_tokens
