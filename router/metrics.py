"""Prometheus metrics of the router (one registry per router instance, served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STAGES = ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer", "decode_admission")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_itl_seconds", "Inter-token latency", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_stage = Histogram(
            "pdserve_ttft_stage_seconds", "TTFT breakdown by stage", ["stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode", ["transport"], registry=r)
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
        for stage in STAGES:
            self.ttft_stage.labels(stage=stage)
        for outcome in ("ok", "invalid", "overloaded", "error", "cancelled"):
            self.requests.labels(outcome=outcome)

    def observe_stages(self, timings) -> None:
        for stage in STAGES:
            value = getattr(timings, f"{stage}_s", 0.0)
            if value > 0:
                self.ttft_stage.labels(stage=stage).observe(value)

    def observe_workers(self, workers) -> None:
        """Publish the pool's view of each registered worker (router.pool.Worker objects)."""
        self.worker_healthy.clear()
        self.worker_routed.clear()
        for w in workers:
            self.worker_healthy.labels(role=w.role, worker=w.worker_id).set(1 if w.healthy and not w.draining else 0)
            self.worker_routed.labels(role=w.role, worker=w.worker_id).set(w.routed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
