"""One simulated worker: the engine's step loop (engine/scheduler.py) with step times from the profile.

Lifecycle of a step: `kick()` starts one when the worker is idle and has work; a step serves running
requests first (one decode token each, at most `max_num_seqs`), then prefill chunks of waiting jobs
in order (FCFS, the head blocks those behind it: no overtaking) up to the token budget; it ends with
`_end()`, which applies its tokens and starts the next. A job takes its KV blocks when its first chunk
is scheduled (the prompt's cached leading blocks pinned, tier blocks loaded, the rest allocated);
when a decode cannot grow, the latest running request is preempted by recompute (its blocks freed,
its prompt and answer so far prefilled again here, ahead of later arrivals).

The engine thread (engine/async_engine.py) also runs the front's calls, between steps: a decode worker's
reservation of blocks for a remote prompt waits for the step in progress to end (`reserve_at_boundary`;
at once when idle). Work such a call does on the engine thread (blocks loaded from or copied out to the
second tier) is a chore that the next step starts with (`Step.extra`; a step of chores alone when there
is nothing else to run); blocks a step's own scheduling moves to or from the tier add to that step.

Aggregated decoding: while a worker only decodes, one event covers the k steps until the first of its
requests finishes (or its KV runs out): step j costs d0 + slope x j (every context grows by one
token a step). Anything that would change the batch (a request joining, a prefill queued here, the
host's busy count changing) cuts the run at the end of the step in progress. A prefill worker hands a
finished prompt to `cluster.prefill_done`; a decode worker accepts KV with `accept_remote`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from sim.kvpool import Holding, KVPool
from sim.workload import SimRequest


@dataclass(slots=True)
class Job:
    """A prefill to run here: a prompt (a prefill worker's, or a local one), or a preempted request's recompute."""

    req: SimRequest
    tokens: int
    """Tokens the KV will hold when done (prompt, plus the answer so far for a recompute)."""
    local: bool
    """It decodes here afterwards."""
    held: Holding | None = None
    context: int = 0
    todo: int = 0
    load_s: float = 0.0
    queued_at: float = 0.0
    started_at: float | None = None
    """When its first chunk's step began (the end of its prefill queue)."""


@dataclass(slots=True)
class Running:
    req: SimRequest
    held: Holding
    last_token: float
    fresh: bool = True
    """No decode step yet since its first token (its first gap is recorded alone)."""


@dataclass(slots=True)
class Step:
    start: float
    decodes: list[Running]
    chunks: list[tuple[Job, int]] = field(default_factory=list)
    k: int = 1
    d0: float = 0.0
    slope: float = 0.0
    extra: float = 0.0
    """Seconds at full speed of engine-thread chores the step starts with (tier copies)."""
    factor: float = 1.0
    """How much slower than the profile it runs now (its host's cores shared)."""
    done: float = 0.0
    """Work (seconds at full speed) done by `mark`."""
    mark: float = 0.0

    def work(self, k: int) -> float:
        """Seconds at full speed of the first k steps (step j costs d0 + slope x j, after the chores)."""
        return self.extra + k * self.d0 + self.slope * k * (k - 1) / 2

    def work_done(self, now: float) -> float:
        return self.done + (now - self.mark) / self.factor

    def end(self) -> float:
        return self.mark + (self.work(self.k) - self.done) * self.factor

    def rescale(self, now: float, factor: float) -> None:
        self.done, self.mark, self.factor = self.work_done(now), now, factor


class Worker:
    def __init__(self, cluster, index: int, role: str, tp: int, num_blocks: int, host=None, tier_blocks: int = 0) -> None:
        self.cluster, self.loop, self.profile = cluster, cluster.loop, cluster.profile
        self.index, self.role, self.tp, self.host = index, role, tp, host
        self.bt, self.budget, self.max_seqs = cluster.block_tokens, cluster.budget, cluster.max_num_seqs
        self.pool = KVPool(num_blocks, tier_blocks)
        self.waiting: deque[Job] = deque()
        self.running: list[Running] = []
        self.admission: deque[SimRequest] = deque()
        """Disaggregated requests routed here that wait for KV blocks (backpressure)."""
        self.reserving: deque[SimRequest] = deque()
        """Disaggregated requests routed here whose reservation waits for the step in progress to end."""
        self.chore_s = 0.0
        """Engine-thread work (seconds at full speed) the next step starts with."""
        self.incoming = 0
        self.step: Step | None = None
        self._version = 0
        self.routed = 0
        self.in_flight = 0
        self.pending_prefill_tokens = 0
        """router/pool.py Worker.pending_prefill_tokens: prompt tokens sent here to compute, prefill not done."""
        self.busy_s = 0.0
        self.prompt_tokens = 0
        self.preemptions = 0
        self.last_step_s = 0.0
        self._ending = False

    # ---- what the router reads ------------------------------------------------------------------
    @property
    def load(self) -> float:
        """router/pool.py Worker.load: router in-flight + 0.5 x (queued + running) from the worker's stats."""
        return self.in_flight + 0.5 * (len(self.waiting) + len(self.running))

    def held_tokens(self, req: SimRequest) -> int:
        """Leading prompt tokens this pool (then its tier) holds, never the prompt's last token."""
        limit = (req.prompt_len - 1) // self.bt
        hits = self.pool.match(req.keys, limit)
        return (hits + self.pool.tier_match(req.keys, hits, limit)) * self.bt

    # ---- work coming in -------------------------------------------------------------------------
    def enqueue(self, req: SimRequest, local: bool) -> None:
        self.waiting.append(Job(req, req.prompt_len, local, queued_at=self.loop.now))
        self._cut()
        self.kick()

    def reserve(self, req: SimRequest) -> Holding | None:
        """Blocks for a prompt whose KV will arrive (engine/block_manager.py admit): its leading blocks cached
        here taken as they are, the ones its tier holds next loaded (their KV need not move either), the rest
        allocated. The tier's loads and the evictions' copies become a chore of the engine thread."""
        pool = self.pool
        limit = (req.prompt_len - 1) // self.bt
        hits = pool.match(req.keys, limit)
        tier = pool.tier_match(req.keys, hits, limit) if pool.tier_blocks else 0
        stored = pool.stored
        held = pool.acquire(req.keys, hits, _blocks(req.prompt_len + 1, self.bt) - hits)
        if held is None:
            return None
        if tier:
            pool.commit(held, req.keys[hits:hits + tier])
        self.chore_s += self.profile.tier_load_s(tier) + self.profile.tier_store_s(pool.stored - stored)
        self.incoming += 1
        return held

    def busy_at_boundary(self) -> bool:
        """A front call made now waits for the step in progress (the engine thread runs it between steps)."""
        return self.step is not None or self._ending

    def reserve_at_boundary(self, req: SimRequest) -> None:
        self.reserving.append(req)
        self._cut()

    def run_chores(self) -> float:
        """Start the chores now if the worker is idle (else the next step starts with them); seconds until
        they are done, at its host's speed now."""
        chore = self.chore_s / self.profile.speedup(self.tp)
        if self.step is None and not self._ending:
            self.kick()
        return chore * (self.host.factor() if self.host else 1.0)

    def accept_remote(self, req: SimRequest, held: Holding) -> None:
        """The prompt's KV arrived: the first token is out now, and the request decodes from the next step."""
        self.incoming -= 1
        now = self.loop.now
        self.pool.commit(held, req.keys[len(held.keys):])
        req.first_token, req.generated = now, 1
        self._joined(Running(req, held, now))

    # ---- the step loop --------------------------------------------------------------------------
    def kick(self) -> None:
        if self.step is not None or self._ending or not (self.running or self.waiting or self.chore_s):
            self._set_busy(self.step is not None or self._ending)
            return
        now = self.loop.now
        budget = self.budget
        stored = self.pool.stored
        decodes = self._grow_decodes(min(budget, self.max_seqs))
        budget -= len(decodes)
        chunks = self._chunks(budget, len(self.running))
        if not decodes and not chunks and not self.chore_s:
            self._set_busy(False)
            return
        self._set_busy(True)
        factor = self.host.factor(decoding=not chunks) if self.host else 1.0
        step = Step(now, decodes, chunks, factor=factor, mark=now)
        if decodes and not chunks:
            step.k = self._decode_run(decodes)
        extra = self.chore_s + self.profile.tier_store_s(self.pool.stored - stored)
        step.extra, self.chore_s = extra / self.profile.speedup(self.tp), 0.0
        context = sum(r.req.prompt_len + r.req.generated for r in decodes) / len(decodes) if decodes else 0.0
        if chunks:
            base = self.profile.prefill_s([(n, job.context) for job, n in chunks], len(decodes), context, self.tp)
            step.d0 = base + sum(job.load_s for job, _ in chunks)
            for job, _ in chunks:
                job.load_s = 0.0
                if job.started_at is None:
                    job.started_at = now
        elif decodes:
            step.d0 = self.profile.decode_s(len(decodes), context, self.tp)
            step.slope = self.profile.decode_slope(len(decodes), context, self.tp)
        self.step = step
        self._version += 1
        self.loop.at(step.end(), self._end, self._version)

    def _grow_decodes(self, limit: int) -> list[Running]:
        """The running requests this step decodes, each with room for one more token (preempting if not)."""
        out: list[Running] = []
        i = 0
        while i < len(self.running) and len(out) < limit:
            r = self.running[i]
            need = _blocks(r.req.prompt_len + r.req.generated, self.bt) - r.held.blocks
            if need <= 0 or self.pool.grow(r.held, need):
                out.append(r)
                i += 1
            else:
                self._preempt(self.running[-1])
        return out

    def _chunks(self, budget: int, seats_taken: int) -> list[tuple[Job, int]]:
        chunks: list[tuple[Job, int]] = []
        for job in self.waiting:
            if budget <= 0:
                break
            if job.held is None:
                if job.local and seats_taken >= self.max_seqs or not self._admit(job):
                    break
            n = min(job.todo, budget)
            chunks.append((job, n))
            budget -= n
            seats_taken += job.local
        return chunks

    def _admit(self, job: Job) -> bool:
        req, pool = job.req, self.pool
        limit = min(len(req.keys), (job.tokens - 1) // self.bt)
        hits = pool.match(req.keys, limit)
        tier = pool.tier_match(req.keys, hits, limit) if pool.tier_blocks else 0
        held = pool.acquire(req.keys, hits, _blocks(job.tokens, self.bt) - hits)
        if held is None:
            return False
        pool.touch(req.keys[:hits])
        job.held, job.context = held, (hits + tier) * self.bt
        job.todo = job.tokens - job.context
        job.load_s = self.profile.tier_load_s(tier)
        return True

    def _decode_run(self, decodes: list[Running]) -> int:
        """Steps until the first request finishes, fewer if KV for all of them would run out (blocks taken now)."""
        k_max = min(r.req.output_len - r.req.generated for r in decodes)

        def need(k: int) -> int:
            return sum(max(0, _blocks(r.req.prompt_len + r.req.generated + k - 1, self.bt) - r.held.blocks) for r in decodes)

        lo, hi = 1, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= self.pool.available:
                lo = mid
            else:
                hi = mid - 1
        for r in decodes:
            extra = _blocks(r.req.prompt_len + r.req.generated + lo - 1, self.bt) - r.held.blocks
            if extra > 0:
                self.pool.grow(r.held, extra)
        return lo

    def _end(self, version: int) -> None:
        if version != self._version:
            return
        step, now = self.step, self.loop.now
        self.step, self._ending = None, True
        self.busy_s += now - step.start
        self.last_step_s = now - step.start
        k = step.k
        if step.decodes:
            self._decoded(step, k, now)
        for job, n in step.chunks:
            job.todo -= n
            job.context += n
            job.req.prompt_computed += n
            self.prompt_tokens += n
            if job.todo == 0:
                self.waiting.remove(job)
                self._prefilled(job, now)
        while self.reserving:
            self.cluster.admit_remote(self.reserving.popleft(), self)
        self._ending = False
        self.kick()

    def _decoded(self, step: Step, k: int, now: float) -> None:
        metrics = self.cluster.metrics
        first_end = min(now, step.start + step.work(1) * step.factor)
        fresh = 0
        for r in step.decodes:
            r.req.generated += k
            if r.fresh:
                metrics.add_itl(first_end - r.last_token, 1)
                r.fresh = False
                fresh += 1
            if r.req.generated >= r.req.output_len:
                self._finish(r, now)
        gaps = len(step.decodes) * k - fresh
        if gaps:
            metrics.add_itl((now - step.start) / k, gaps)

    def _prefilled(self, job: Job, now: float) -> None:
        req = job.req
        if req.first_token is None and job.started_at is not None:
            req.stage_s.setdefault("prefill_queue_s", job.started_at - job.queued_at)
            req.stage_s.setdefault("prefill_compute_s", now - job.started_at)
        self.pool.commit(job.held, req.keys)
        if not job.local:
            self.cluster.prefill_done(self, job, now)
            return
        if req.first_token is None:
            req.first_token = now
        req.generated += 1
        self._joined(Running(req, job.held, now), kick=False)

    def _joined(self, r: Running, kick: bool = True) -> None:
        if r.req.generated >= r.req.output_len:
            self._finish(r, self.loop.now)
            return
        self.running.append(r)
        if kick:
            self._cut()
            self.kick()

    def _finish(self, r: Running, now: float) -> None:
        r.req.finish = now
        if r in self.running:
            self.running.remove(r)
        self.release(r.held)
        self.in_flight -= 1
        self.cluster.finished(r.req)

    def release(self, held: Holding) -> None:
        self.pool.release(held)
        self.cluster.blocks_freed(self)

    def _preempt(self, r: Running) -> None:
        """Recompute: free its blocks, prefill its prompt and answer so far again, ahead of later arrivals."""
        self.running.remove(r)
        self.pool.release(r.held)
        r.req.preemptions += 1
        self.preemptions += 1
        job = Job(r.req, r.req.prompt_len + r.req.generated, local=True)
        at = next((i for i, j in enumerate(self.waiting) if j.held is None and j.req.arrival > r.req.arrival), len(self.waiting))
        self.waiting.insert(at, job)

    # ---- cutting an aggregated run --------------------------------------------------------------
    def _cut(self) -> bool:
        """End the aggregated decode run at the end of the step in progress; True if it moved."""
        step = self.step
        if step is None or step.k <= 1:
            return False
        done = max(0.0, step.work_done(self.loop.now) - step.extra)
        a, b = step.slope / 2, step.d0 - step.slope / 2
        k = done / b if a <= 1e-15 else (-b + math.sqrt(b * b + 4 * a * done)) / (2 * a)
        k = min(step.k, max(1, math.ceil(k - 1e-9)))
        while k > 1 and step.work(k - 1) - step.extra >= done:
            k -= 1
        if k == step.k:
            return False
        step.k = k
        self._reschedule()
        return True

    def host_changed(self) -> None:
        """Its host's busy count changed: the step in progress goes on at the new speed."""
        step = self.step
        if step is None:
            return
        step.rescale(self.loop.now, self.host.factor(decoding=not step.chunks))
        if not self._cut():
            self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        self.loop.at(self.step.end(), self._end, self._version)

    def _set_busy(self, busy: bool) -> None:
        if self.host is not None:
            self.host.set_busy(self, busy)


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)
