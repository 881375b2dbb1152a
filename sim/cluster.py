"""A cluster shape run over a workload: `simulate(spec, profile, requests) -> SimResult`.

Lifecycle of a request (DESIGN.md's "life of a request", disaggregated):
  arrival -> the router picks a decode worker D (policy); a prompt of which D would compute at most the
  local-prefill threshold (`Router.local_prefill_tokens`: under kv_aware, what D does not hold),
  or any prompt when there is no prefill worker (colocated), is prefilled on D itself. Otherwise D
  reserves KV blocks for the prompt (on its engine thread: after the step in progress; its cached leading
  blocks taken as they are, its tier's next ones loaded) or the request waits in D's admission queue
  (backpressure: past `max_queued_requests` waiting, it is rejected, HTTP 429);
  then the router picks a prefill worker P, which computes the prompt in its step loop (chunked,
  prefix-cached) and streams the KV of the tokens D lacks over P's link (layer-wise: all but the last
  layer's share moves during the final prefill step, at the link's current share); when the bytes are
  through (plus the link's latency), D emits the first token (TTFT) and decodes the request from its
  next step; P frees its blocks. Finish frees D's blocks (the prompt's stay cached for a later turn).
Workers on a CPU host (`cores`) share its cores; GPU workers (cores None) each own a device. With `pinned`,
each worker is bound to one core (worker i, prefill workers first, to core i mod cores: bench/cluster.py's
BenchCluster placement), so co-pinned workers share that core alone while another core may idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sim.adaptive import AdaptiveSettings, Controller
from sim.core import Host, Loop, SharedLink
from sim.metrics import Metrics, per_request, summarize
from sim.profile import Profile
from sim.router import Router
from sim.worker import Job, Worker
from sim.workload import SimRequest


@dataclass(frozen=True)
class ClusterSpec:
    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    policy: str = "round_robin"
    max_num_batched_tokens: int | None = None
    """Token budget per step; None: the profile's."""
    max_num_seqs: int = 128
    kv_blocks: int | None = None
    """Blocks per worker; None: the profile's KV capacity per rank x TP / block tokens."""
    tier_blocks: int = 0
    local_prefill_threshold: int = 0
    transport: str | None = None
    layerwise: bool = True
    cores: float | None = None
    """CPU cores all workers share (one host); None: each worker has its own device."""
    pinned: bool = False
    """With `cores`: every worker bound to one core (worker i to core i mod cores, prefill workers first, as
    bench/cluster.py pins them), each core a host of its own; False: any worker runs on any core."""
    pool_order: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The router's order of the prefill and of the decode pool (positions -> worker i of that pool; a real
    router lists its workers as they registered), which round_robin rotates over; None: by index. With
    `pinned` it decides which requests' prefill and decode share a core."""
    max_queued_requests: int = 256
    block_tokens: int | None = None
    """Tokens per block (a trace block scaled); None: the profile's block size."""
    adaptive: AdaptiveSettings | None = None
    """The adaptive controller's settings (sim/adaptive.py); None: the shape stays fixed."""

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def name(self) -> str:
        if not self.prefill:
            return f"colocated {self.decode}x TP{self.decode_tp}"
        return f"{self.prefill}P TP{self.prefill_tp} + {self.decode}D TP{self.decode_tp}"


@dataclass
class SimResult:
    spec: ClusterSpec
    summary: dict[str, Any]
    requests: list[SimRequest]
    events: int
    wall_s: float
    decisions: list[dict] = field(default_factory=list)

    def per_request(self) -> list[dict[str, Any]]:
        return per_request(self.requests)


class Cluster:
    def __init__(self, spec: ClusterSpec, profile: Profile) -> None:
        if spec.decode < 1:
            raise ValueError("decode: a cluster needs at least one decode worker")
        self.spec, self.profile = spec, profile
        self.loop, self.metrics = Loop(), Metrics()
        self.block_tokens = spec.block_tokens or profile.block_size
        self.budget = spec.max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_num_seqs = spec.max_num_seqs
        self.router = Router(spec.policy, self.block_tokens)
        hosts = self._hosts(spec, profile)
        self.prefills = [self._worker(i, "prefill", spec.prefill_tp, hosts[i % len(hosts)]) for i in range(spec.prefill)]
        self.decodes = [self._worker(spec.prefill + i, "decode", spec.decode_tp, hosts[(spec.prefill + i) % len(hosts)])
                        for i in range(spec.decode)]
        for host in filter(None, hosts):
            host.workers = [w for w in self.prefills + self.decodes if w.host is host]
        if spec.pool_order:
            prefill_order, decode_order = spec.pool_order
            if sorted(prefill_order) != list(range(spec.prefill)) or sorted(decode_order) != list(range(spec.decode)):
                raise ValueError(f"pool_order: must order {spec.prefill} prefill and {spec.decode} decode workers, got {spec.pool_order}")
            self.prefills = [self.prefills[i] for i in prefill_order]
            self.decodes = [self.decodes[i] for i in decode_order]
        link = profile.link(spec.transport)
        self.links = {w.index: SharedLink(self.loop, link.bytes_per_s * w.tp, link.latency_s) for w in self.prefills}
        self.dest: dict[int, tuple[Worker, Any, int]] = {}
        self.queued = 0
        self.threshold = spec.local_prefill_threshold
        self.controller = None

    @staticmethod
    def _hosts(spec: ClusterSpec, profile: Profile) -> list[Host | None]:
        if not spec.cores:
            return [None]
        sharing = profile.sharing()
        if not spec.pinned:
            return [Host(spec.cores, *sharing)]
        cores = [Host(1, *sharing) for _ in range(max(1, int(spec.cores)))]
        for core in cores:
            core.peers = [other for other in cores if other is not core]
        return cores

    def _worker(self, index: int, role: str, tp: int, host) -> Worker:
        blocks = self.spec.kv_blocks or self.profile.kv_capacity_tokens * tp // self.block_tokens
        return Worker(self, index, role, tp, blocks, host, self.spec.tier_blocks)

    def run(self, requests: list[SimRequest]) -> SimResult:
        started = time.perf_counter()
        for r in requests:
            self.loop.at(r.arrival, self.arrive, r)
        if self.spec.adaptive:
            self.controller = Controller(self, self.spec.adaptive, requests)
        self.loop.run()
        slos = next((r.slos_ms for r in requests if r.slos_ms), None)
        return SimResult(self.spec, summarize(requests, self.metrics, slos), requests, self.loop.events,
                         time.perf_counter() - started, self.controller.decisions if self.controller else [])

    # ---- the router -----------------------------------------------------------------------------
    def arrive(self, req: SimRequest) -> None:
        fits = min(w.pool.num_blocks for w in self.decodes) * self.block_tokens
        if req.prompt_len + req.output_len > fits:
            req.rejected = True  # longer than any pool: the router's validation refuses it
            return
        d = self.router.choose("decode", self.decodes, req)
        d.routed += 1
        d.in_flight += 1
        req.decode_worker = d.index
        if not self.prefills or (self.threshold > 0 and self.router.local_prefill_tokens(d, req) <= self.threshold):
            d.enqueue(req, local=True)
            return
        if d.busy_at_boundary():
            d.reserve_at_boundary(req)  # the reservation runs on D's engine thread, between steps
            return
        self.admit_remote(req, d)

    def admit_remote(self, req: SimRequest, d: Worker) -> None:
        """D reserves blocks for the prompt now (at a step boundary, or idle), or queues it (backpressure)."""
        held = None if d.admission else d.reserve(req)
        if held is None:
            if self.queued >= self.spec.max_queued_requests:
                req.rejected = True
                d.in_flight -= 1
                return
            d.admission.append(req)
            self.queued += 1
            return
        self._reserved(req, d, held)

    def _reserved(self, req: SimRequest, d: Worker, held) -> None:
        """The reservation returns once D's engine thread has done its tier work; then the router calls P."""
        delay = d.run_chores()
        req.stage_s["decode_admission_s"] = self.loop.now + delay - req.arrival
        if delay > 0:
            self.loop.at(self.loop.now + delay, self._to_prefill, req, d, held)
        else:
            self._to_prefill(req, d, held)

    def _to_prefill(self, req: SimRequest, d: Worker, held) -> None:
        p = self.router.choose("prefill", self.prefills, req)
        p.routed += 1
        p.in_flight += 1
        work = req.prompt_len - p.held_tokens(req)
        p.pending_prefill_tokens += work
        req.prefill_worker = p.index
        self.dest[req.index] = (d, held, work)
        p.enqueue(req, local=False)

    # ---- the KV transfer ------------------------------------------------------------------------
    def prefill_done(self, p: Worker, job: Job, now: float) -> None:
        req = job.req
        d, held, work = self.dest.pop(req.index)
        nbytes = max(0, req.prompt_len - len(held.keys) * self.block_tokens) * self.profile.kv_bytes_per_token
        req.kv_bytes = float(nbytes)
        link = self.links[p.index]
        req.stage_s["kv_transfer_s"] = -now
        remaining = nbytes
        if self.spec.layerwise:
            layers = self.profile.num_layers
            remaining = max(nbytes / layers, nbytes - link.share() * p.last_step_s * (layers - 1) / layers)
        link.send(remaining, now, lambda: self._arrived(p, job, d, held, work))

    def _arrived(self, p: Worker, job: Job, d: Worker, held, work: int) -> None:
        job.req.stage_s["kv_transfer_s"] += self.loop.now
        p.in_flight -= 1
        p.pending_prefill_tokens -= work
        p.release(job.held)
        d.accept_remote(job.req, held)

    # ---- callbacks from the workers -------------------------------------------------------------
    def finished(self, req: SimRequest) -> None:
        if self.controller:
            self.controller.finished(req)

    def blocks_freed(self, worker: Worker) -> None:
        worker.kick()
        while worker.admission:
            held = worker.reserve(worker.admission[0])
            if held is None:
                break
            req = worker.admission.popleft()
            self.queued -= 1
            self._reserved(req, worker, held)


def simulate(spec: ClusterSpec, profile: Profile, requests: list[SimRequest]) -> SimResult:
    """Run `requests` (fresh objects: a run fills them in) through a new cluster of shape `spec`."""
    return Cluster(spec, profile).run(requests)
