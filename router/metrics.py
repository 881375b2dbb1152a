"""Prometheus metrics of the router (one registry per router instance, served at /metrics).

Two kinds of series live in the registry: the router's own (counters and histograms it updates as
requests pass, `RouterMetrics`, which also keeps the window of recent critical paths behind
`pdserve status`: router.critical_path), and every worker's engine series, labelled `role` and `worker`
(`WorkerEngineCollector`). The latter are a snapshot of the pool that `observe_workers` replaces
every pass of the router's worker watch (heartbeats and `Stats` polls carry them as `WorkerStats`),
rendered at scrape time: a worker that leaves the pool drops its series at the next pass.
Names follow vLLM's (`vllm:num_requests_running` -> `pdserve_num_requests_running`), see
docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from router.critical_path import STAGES, CriticalPathWindow, stages_of

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "Inter-token latency", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.stages = Histogram("pdserve_request_stage_seconds", "Critical path of finished requests by stage (they add up to e2e)",
                                ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        self.critical_path = CriticalPathWindow()
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode", ["transport"], registry=r)
        self.divergences = Counter("pdserve_disagg_divergence", "Sampled disaggregated requests whose output differed from their "
                                   "colocated recompute (router/shadow.py)", registry=r)
        self.shadow_checks = Counter("pdserve_shadow_checks", "Canary recomputes by outcome: agreed, diverged, not_run", ["outcome"], registry=r)
        self.kv_blocks = Counter("pdserve_kv_prompt_blocks", "Prompt KV blocks of disaggregated requests: reused (the decode worker "
                                 "held them) or moved (sent by the prefill worker)", ["outcome"], registry=r)
        self.queue_size = Gauge("pdserve_router_queue_requests", "Requests admitted and not finished", registry=r)
        self.queued_tokens = Gauge("pdserve_router_queue_tokens", "Prompt tokens of admitted, unfinished requests", registry=r)
        self.retries = Counter("pdserve_prefill_retries", "Prefill attempts retried on another worker", registry=r)
        self.migrations = Counter("pdserve_migrations", "Requests moved to another decode worker mid-stream", registry=r)
        self.stalls = Counter("pdserve_decode_stalls", "Streams whose decode worker sent nothing for router.stall_timeout_s", registry=r)
        self.tokens = Counter("pdserve_generated_tokens", "Tokens streamed to clients", registry=r)
        self.worker_healthy = Gauge("pdserve_worker_healthy", "1 while a worker is in rotation, 0 while out of it",
                                    ["role", "worker"], registry=r)
        self.worker_routed = Gauge("pdserve_worker_routed_requests", "Requests the router has sent to a worker",
                                   ["role", "worker"], registry=r)
        self.engines = WorkerEngineCollector()
        r.register(self.engines)
        self.kv_index = KVIndexCollector()
        r.register(self.kv_index)
        for stage in STAGES:
            self.stages.labels(stage=stage)
        for outcome in ("ok", "invalid", "overloaded", "error", "cancelled"):
            self.requests.labels(outcome=outcome)

    def observe_path(self, timings, completion_tokens: int) -> None:
        """A finished request's critical path (router.critical_path): one observation per stage."""
        for stage, value in stages_of(timings).items():
            self.stages.labels(stage=stage).observe(max(0.0, value))
        self.critical_path.record(timings, completion_tokens)

    def observe_workers(self, workers, kv_index=None) -> None:
        """Publish the pool's view of each registered worker (router.pool.Worker objects) and of its KV
        index (router.kv_index.KVIndex)."""
        workers = list(workers)
        self.kv_index.index, self.kv_index.roles = kv_index, {w.worker_id: w.role for w in workers}
        self.worker_healthy.clear()
        self.worker_routed.clear()
        for w in workers:
            self.worker_healthy.labels(role=w.role, worker=w.worker_id).set(1 if w.healthy and not w.draining else 0)
            self.worker_routed.labels(role=w.role, worker=w.worker_id).set(w.routed)
        self.engines.observe([(w.role, w.worker_id, w.stats) for w in workers if w.stats is not None])
        self.critical_path.observe_workers(workers)

    def render(self) -> bytes:
        return generate_latest(self.registry)


WORKER_LABELS = ["role", "worker"]
GAUGES = (  # name, help, value from a WorkerStats
    ("pdserve_kv_cache_usage_ratio", "KV-cache usage of the worker's engine (1 = every block in use)",
     lambda s: 1 - s.free_kv_blocks / s.total_kv_blocks if s.total_kv_blocks else 0.0),
    ("pdserve_num_requests_running", "Requests in the engine's running batch", lambda s: s.running_requests),
    ("pdserve_num_requests_waiting", "Requests waiting to run (for a batch slot, KV blocks or remote KV)",
     lambda s: s.queued_requests),
    ("pdserve_num_waiting_prompt_tokens", "Prompt tokens not yet computed of the waiting requests",
     lambda s: s.queued_prompt_tokens),
)
COUNTERS = (  # name (without _total), help, value from a WorkerStats
    ("pdserve_num_preemptions", "Running requests preempted (recompute) for lack of KV blocks", lambda s: s.preemptions),
    ("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lambda s: s.prefix_cache_queried_tokens),
    ("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hit_tokens),
    ("pdserve_prompt_tokens", "Prompt tokens run through the model (cache hits and received KV excluded)",
     lambda s: s.prompt_tokens),
    ("pdserve_generation_tokens", "Tokens sampled by the engine", lambda s: s.generation_tokens),
    ("pdserve_worker_kv_sent_bytes", "KV bytes this worker sent (prefill workers; any holder's prefixes pulled from it)",
     lambda s: s.kv_bytes_sent),
    ("pdserve_worker_kv_received_bytes", "KV bytes this worker received (decode workers; a prefill worker's pulls)",
     lambda s: s.kv_bytes_received),
    ("pdserve_kv_pulls", "Prefixes pulled from another worker instead of computed (router.kv_pull)", lambda s: s.kv_pulls),
    ("pdserve_kv_pulled_tokens", "Prompt tokens whose KV was pulled from another worker", lambda s: s.kv_pulled_tokens),
    ("pdserve_kv_pull_failures", "Pulls that failed: the prefix was computed instead", lambda s: s.kv_pull_failures),
    ("pdserve_kv_pulls_declined", "Pulls not tried: computing measured cheaper, no room, or the prefix held already",
     lambda s: s.kv_pulls_declined),
    ("pdserve_kv_pull_seconds", "Wall time of the pulls tried", lambda s: s.kv_pull_seconds),
    ("pdserve_spec_proposed_tokens", "Speculative decoding: proposed tokens verified", lambda s: s.spec_proposed_tokens),
    ("pdserve_spec_accepted_tokens", "Speculative decoding: proposed tokens accepted (rate = accepted / proposed)",
     lambda s: s.spec_accepted_tokens),
    ("pdserve_spec_steps", "Speculative decoding: engine steps that verified proposals", lambda s: s.spec_steps),
)
STEP_SUMMARY = "pdserve_engine_step_seconds"
PROMPT_STEP_SUMMARY = "pdserve_engine_prompt_step_seconds"


class WorkerEngineCollector:
    """Every worker's engine series from the pool's last view of its `WorkerStats`."""

    def __init__(self) -> None:
        self._snapshot: list[tuple[str, str, object]] = []

    def observe(self, workers: Iterable[tuple[str, str, object]]) -> None:
        """Replace the snapshot: (role, worker id, WorkerStats) of each worker in the pool."""
        self._snapshot = list(workers)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        for name, help_text, value in GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=WORKER_LABELS)
            for role, worker, stats in snapshot:
                family.add_metric([role, worker], value(stats))
            yield family
        for name, help_text, value in COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=WORKER_LABELS)
            for role, worker, stats in snapshot:
                family.add_metric([role, worker], value(stats))
            yield family
        steps = SummaryMetricFamily(STEP_SUMMARY, "Wall time of the engine's model steps", labels=WORKER_LABELS)
        prompt_steps = SummaryMetricFamily(PROMPT_STEP_SUMMARY, "Of those, the steps that ran prompt tokens", labels=WORKER_LABELS)
        for role, worker, stats in snapshot:
            steps.add_metric([role, worker], count_value=stats.steps, sum_value=stats.step_seconds)
            prompt_steps.add_metric([role, worker], count_value=stats.prompt_steps, sum_value=stats.prompt_step_seconds)
        yield steps
        yield prompt_steps


class KVIndexCollector:
    """The router's KV index (router/kv_index.py) per worker, read at scrape time: blocks held per tier,
    whether the entry is exact, seconds since its last applied batch, batches known missing."""

    def __init__(self) -> None:
        self.index = None
        self.roles: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        entries = self.index.entries() if self.index is not None else []
        blocks = GaugeMetricFamily("pdserve_kv_index_blocks", "KV blocks the router's index holds for a worker, by tier",
                                   labels=[*WORKER_LABELS, "tier"])
        exact = GaugeMetricFamily("pdserve_kv_index_exact", "1 while the worker's index entry is exact (snapshot applied, no gap)",
                                  labels=WORKER_LABELS)
        lag = GaugeMetricFamily("pdserve_kv_index_lag_seconds", "Seconds since the worker's last KV event batch was applied",
                                labels=WORKER_LABELS)
        missing = GaugeMetricFamily("pdserve_kv_index_missing_batches", "KV event batches known lost (a gap) until a snapshot",
                                    labels=WORKER_LABELS)
        for e in entries:
            labels = [self.roles.get(e.worker_id, ""), e.worker_id]
            for tier in e.tiers or {"pool": set()}:
                blocks.add_metric([*labels, tier], len(e.blocks(tier)))
            exact.add_metric(labels, 1.0 if e.exact else 0.0)
            missing.add_metric(labels, e.missing_batches)
            if (seconds := self.index.lag_s(e)) is not None:
                lag.add_metric(labels, seconds)
        distinct = GaugeMetricFamily("pdserve_kv_index_distinct_blocks", "Distinct KV block hashes in the index (pool tier, all workers)")
        distinct.add_metric([], self.index.distinct_blocks() if self.index is not None else 0)
        yield from (blocks, exact, lag, missing, distinct)

