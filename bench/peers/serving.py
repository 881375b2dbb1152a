"""The serving half of the peer comparison: one load, sent by pdserve's own load generator (bench.servebench,
OpenAI backend, streaming `/v1/completions` with token-id prompts) to each target in turn.

A target is a server started for the run and stopped after it: `VllmServer` (vLLM's OpenAI server from the peer
venv, `python -m vllm.entrypoints.openai.api_server`) or `PdserveCluster` (bench.cluster.BenchCluster: colocated
= one decode worker that prefills locally with every thread, unpinned; 1P+1D = one prefill and one decode worker,
a core and a thread each). `run_target` starts it, sends two short warm-up requests, then at each concurrency
level the same `Load.requests` requests (seeded per level, so no level hits another's prefix cache; the same
prompts for every target), all sent at once with at most `level` in flight, and stops it. pdserve's answers carry
the router's critical path (the `critical_path` extension): per level, its stages' medians and p99s tell where
TTFT goes (admission, queueing, prefill, the KV hop). Each pdserve target ends with the no-leaked-block check.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import BenchCluster, bench_config
from bench.peers.install import PeerEnv
from bench.servebench.clients import OpenAIBackend
from bench.servebench.loadgen import run_load
from bench.servebench.metrics import compute_metrics
from bench.servebench.workload import DEFAULT_VOCAB, RequestSpec, random_ids

log = logging.getLogger("bench.peers")
LEVELS = (1, 4, 16, 64)
MODEL_NAME = "smollm2-135m"
KV_SPACE_GIB = 2
"""KV cache for every target: vLLM's VLLM_CPU_KVCACHE_SPACE and pdserve's kv_cache_memory_mb (64 x 384 tokens fit)."""
CRITICAL_STAGES = ("router_queue_s", "decode_admission_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "first_token_s", "ttft_s")


@dataclass(frozen=True)
class Load:
    requests: int = 64
    prompt_len: int = 256
    output_len: int = 128
    levels: tuple[int, ...] = LEVELS
    seed: int = 0
    dtype: str = "float32"
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)


def level_specs(load: Load, level_index: int, count: int | None = None, output_len: int | None = None) -> list[RequestSpec]:
    """The requests of one level (the same for every target): random token ids, all arriving at once."""
    rng = np.random.default_rng(load.seed + level_index)
    n = load.requests if count is None else count
    return [RequestSpec(i, load.prompt_len, output_len or load.output_len, 0.0, prompt_ids=random_ids(rng, load.prompt_len, DEFAULT_VOCAB))
            for i in range(n)]


def client_args(pdserve: bool) -> argparse.Namespace:
    """What OpenAIBackend reads: greedy, exactly max_tokens, and (pdserve) the critical-path extension."""
    return argparse.Namespace(temperature=0.0, ignore_eos=True, request_timeout=900.0, endpoint="completions", seed=0,
                              extra_body={"critical_path": True} if pdserve else {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vLLM's OpenAI server from the peer venv on 127.0.0.1. `bind="auto"` is vLLM's own default: on x86 it keeps
    one core for its scheduler and API processes and binds OpenMP threads to the rest (1 of 2 cores here);
    `bind="all"` binds them to every core (0..threads-1), what the offline runs at all threads use."""

    def __init__(self, peer: PeerEnv, model_dir: str, load: Load, log_dir: Path, bind: str = "auto"):
        self.peer, self.model_dir, self.load, self.log_dir, self.bind = peer, model_dir, load, log_dir, bind
        self.name, self.port = "vllm" if bind == "auto" else "vllm_all_cores", free_port()
        self.argv = [str(peer.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", MODEL_NAME,
                     "--dtype", load.dtype, "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "1024", "--seed", "0"]

    def env(self) -> dict[str, str]:
        return {**os.environ, **vllm_env(self.peer, self.load.threads if self.bind == "all" else None)}

    @contextmanager
    def serve(self) -> Iterator[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_dir / "vllm_server.log", "w")
        proc = subprocess.Popen(self.argv, env=self.env(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{self.port}/health", proc, timeout=900.0)
            yield f"http://127.0.0.1:{self.port}/v1"
        finally:
            stop(proc)
            log_file.close()

    def describe(self) -> dict[str, Any]:
        return {"server": "vllm.entrypoints.openai.api_server", "argv": self.argv[1:],
                "env": {k: v for k, v in self.env().items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}}


def vllm_env(peer: PeerEnv, threads: int | None) -> dict[str, str]:
    """vLLM's CPU settings (its docs' environment variables): OpenMP threads bound to cores 0..threads-1 (None:
    vLLM's automatic binding), a fixed KV space, tcmalloc and Intel OpenMP preloaded, no hub access."""
    bind = "auto" if threads is None else "0" if threads == 1 else f"0-{threads - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB),
            "LD_PRELOAD": peer.preload(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class PdserveCluster:
    """One of pdserve's configurations for this machine, through its router's OpenAI HTTP server."""

    def __init__(self, name: str, num_prefill: int, load: Load, log_dir: Path):
        self.name, self.num_prefill, self.load, self.log_dir = name, num_prefill, load, log_dir
        threads = 1 if num_prefill else load.threads
        self.config = bench_config("tcp", engine={"dtype": load.dtype, "num_threads": threads, "kv_cache_memory_mb": KV_SPACE_GIB * 1024})
        self.leak_check: str | None = None
        self.cluster: BenchCluster | None = None

    @contextmanager
    def serve(self) -> Iterator[str]:
        pin = None if self.num_prefill else False  # colocated: one worker using every core
        with BenchCluster(self.config, num_prefill=self.num_prefill, num_decode=1, pin=pin, log_dir=self.log_dir, name=self.name) as cluster:
            self.cluster = cluster
            yield cluster.http_url + "/v1"
            try:
                cluster.assert_no_leaked_blocks()
                self.leak_check = "no KV block leaked"
            except AssertionError as exc:
                self.leak_check = str(exc)

    def describe(self) -> dict[str, Any]:
        described = self.cluster.describe() if self.cluster is not None else {}
        return {**{k: v for k, v in described.items() if k != "config"}, "engine": self.config["engine"], "leak_check": self.leak_check}


async def _send(url: str, specs: list[RequestSpec], concurrency: int | None, pdserve: bool) -> tuple[list[dict], float]:
    backend = OpenAIBackend(url, MODEL_NAME, client_args(pdserve))
    await backend.open()
    try:
        records, duration = await run_load(backend, specs, concurrency, progress=False)
    finally:
        await backend.close()
    return [asdict(r) for r in records], duration


def run_target(target: VllmServer | PdserveCluster, load: Load) -> dict[str, Any]:
    """Every level against one freshly started target; its summary per level."""
    pdserve = isinstance(target, PdserveCluster)
    started = time.time()
    levels = []
    with target.serve() as url:
        asyncio.run(_send(url, level_specs(load, 10_000, count=2, output_len=8), None, pdserve))
        for i, level in enumerate(load.levels):
            records, duration = asyncio.run(_send(url, level_specs(load, i), level, pdserve))
            levels.append(level_summary(level, records, duration))
            log.info("%s c=%d: %.2f req/s, TTFT p99 %.0f ms", target.name, level, levels[-1]["request_throughput"], levels[-1]["ttft_ms"]["p99"] or math.nan)
    return {"target": target.name, "kind": "pdserve" if pdserve else "vllm", "describe": target.describe(), "levels": levels,
            "seconds": round(time.time() - started, 1)}


def level_summary(level: int, records: list[dict], duration: float) -> dict[str, Any]:
    m = compute_metrics(records, duration)
    keep = ("median", "p90", "p99", "mean")
    out = {"concurrency": level, "completed": m["completed"], "failed": m["failed"], "duration_s": round(duration, 3),
           "request_throughput": m["request_throughput"], "output_throughput": m["output_throughput"],
           **{k: {q: m[k][q] for q in keep} for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")}}
    errors = sorted({r["error"] for r in records if r.get("error")})
    if errors:
        out["errors"] = errors[:5]
    paths = [r["server_timings"] for r in records if r.get("server_timings")]
    if paths:
        out["critical_path_ms"] = {s.removesuffix("_s"): {"median": 1000 * float(np.median([p[s] for p in paths])),
                                                          "p99": 1000 * float(np.percentile([p[s] for p in paths], 99))}
                                   for s in CRITICAL_STAGES if all(s in p for p in paths)}
        out["local_prefill_fraction"] = sum(bool(p.get("local_prefill")) for p in paths) / len(paths)
    return out
