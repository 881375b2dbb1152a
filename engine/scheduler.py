"""Iteration-level scheduler: decides, every step, which requests run and how many tokens each.

One token budget per step (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`).
Order of service: running requests first (a decode costs one token; a request in the middle of a
chunked prefill takes its next chunk), then waiting requests (chunked prefill: a long prompt is
split across steps when the budget runs out). Both queues are ordered by priority (higher first),
then arrival (FCFS within a priority). When the KV pool cannot grow a running request, the last
running request in that order (lowest priority, latest arrived) is preempted by recompute: its
blocks are freed and it goes back to the waiting queue, ahead of those of its priority that came
later. Admission asks the KV policy too (engine.kv_policy): under `guaranteed_no_evict` a request is
admitted only when its whole life fits, so the pool never runs dry and nothing is preempted. The
waiting queue's head blocks those behind it (no overtaking). The sequences a group (`n` > 1) will
fork count against `max_num_seqs` from its admission. The scheduler never touches a tensor.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.kv_policy import make_kv_policy
from engine.sequence import RequestState, Sequence
from engine.step import StepItem


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    kv_policy: str = "max_utilization"


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens

    def step_item(self) -> StepItem:
        seq, start = self.seq, self.seq.num_computed_tokens
        return StepItem(seq.token_slice(start, start + self.num_tokens), start, seq.block_ids, self.samples)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.policy = make_kv_policy(config.kv_policy, block_manager)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.incoming: list[Sequence] = []
        """Admitted on a decode worker, their prompt's KV still on its way (`reserve_remote`)."""

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.state = RequestState.WAITING
        _enqueue(self.waiting, seq)

    def reserve_remote(self, seq: Sequence) -> bool:
        """Blocks for a prompt whose KV (and first token) will arrive from a prefill worker, if the
        KV policy admits it now; False (nothing taken) otherwise. The prompt's leading blocks that the
        prefix cache holds are taken as they are (`seq.num_cached_tokens`: their KV need not move)."""
        if not self.policy.admits(seq, self.running + self.incoming):
            return False
        if self.blocks.admit(seq, seq.num_prompt_tokens) is None:
            return False
        if not self.blocks.grow(seq, seq.num_prompt_tokens + 1):
            self.blocks.free(seq)
            seq.num_cached_tokens = seq.num_computed_tokens = 0
            return False
        seq.state = RequestState.WAITING_FOR_REMOTE_KV
        self.incoming.append(seq)
        return True

    def add_running(self, seq: Sequence) -> None:
        """A request whose KV is already in the pool (received from a prefill worker, or a fork)."""
        if seq in self.incoming:
            self.incoming.remove(seq)
        seq.state = RequestState.RUNNING
        _enqueue(self.running, seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting, self.incoming):
            if seq in queue:
                queue.remove(seq)
                return

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.grow(seq, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        self.running = kept + queue  # unscheduled (budget exhausted) requests stay running
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        admitted_whole = False
        while self.waiting and budget > 0 and self._has_room_for(self.waiting[0]):
            seq = self.waiting[0]
            if not self.policy.admits(seq, self.running + self.incoming):
                break
            n = self.blocks.admit(seq, budget if chunked else seq.num_tokens)
            if n is None:
                break
            if n > budget and admitted_whole:
                # without chunking a prompt runs whole: the first one of a step may overrun the budget
                # (so no prompt starves behind running decodes), later ones wait for a step they fit in
                self.blocks.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            admitted_whole = not chunked
            self.waiting.pop(0)
            seq.state = RequestState.RUNNING
            _enqueue(self.running, seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _has_room_for(self, seq: Sequence) -> bool:
        """`max_num_seqs` counts the sequences groups will fork; a group larger than it runs alone."""
        forks = sum(s.forks_pending for s in self.running) + seq.forks_pending
        return not self.running or len(self.running) + 1 + forks <= self.config.max_num_seqs

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq)
        seq.reset_for_recompute()
        _enqueue(self.waiting, seq)
        out.preempted.append(seq)


def _enqueue(queue: list[Sequence], seq: Sequence) -> None:
    """Insert keeping the order: higher priority first, then earlier arrival; after equals."""
    bisect.insort(queue, seq, key=_order)


def _order(seq: Sequence) -> tuple[int, float]:
    return -seq.priority, seq.arrival_time
