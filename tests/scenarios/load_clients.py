"""Closed-loop load against a live router, shared by the overload and soak tests.

`run_load` starts `clients` asyncio tasks; each one, until the duration is up, draws a `Job`
(protocol, prompt, max_tokens, whether to hang up early) and runs it as a streaming request over
HTTP (`/v1/completions`, SSE) or gRPC (`Router/Generate`), then records an `Outcome`:
  ok        finished with finish_reason "length" and exactly max_tokens tokens (ignore_eos is set);
  refused   429 with Retry-After / RESOURCE_EXHAUSTED (the client then backs off briefly);
  cancelled the client hung up after some tokens, on purpose;
  error     anything else: a wrong token count, another status, a timeout (a lost request).
Meanwhile `RssSampler` records the resident memory of the router and of every worker each second.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

import grpc
import httpx2
import psutil

from bench.cluster import LocalCluster, write_config
from proto.pdserve.v1 import pdserve_pb2 as pb
from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

MODEL = "smollm2-135m"
MB = 1 << 20


@contextmanager
def admission_limited_cluster(directory: Path, max_queued_requests: int) -> Iterator[LocalCluster]:
    """Router + 1 prefill + 1 decode worker (tcp KV) whose router admits `max_queued_requests`."""
    config = write_config(directory / "pdserve.yaml", transport="tcp", router={"max_queued_requests": max_queued_requests})
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        yield cluster


@dataclass(frozen=True)
class Job:
    protocol: str  # "http" | "grpc"
    prompt: str
    max_tokens: int
    cancel_after: int | None = None  # hang up after this many streamed chunks


@dataclass
class Outcome:
    protocol: str
    status: str  # ok | refused | cancelled | error
    started: float
    ended: float
    tokens: int = 0
    detail: str = ""


@dataclass
class LoadResult:
    started: float
    ended: float
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, status: str, protocol: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.status == status and protocol in (None, o.protocol))

    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "error"]

    def tokens_per_s(self, start: float, end: float) -> float:
        """Tokens of completed requests that ended in [start, end) seconds after the start."""
        tokens = sum(o.tokens for o in self.outcomes
                     if o.status == "ok" and start <= o.ended - self.started < end)
        return tokens / (end - start)

    def summary(self) -> dict:
        by_protocol = {p: {s: self.count(s, p) for s in ("ok", "refused", "cancelled", "error")} for p in ("http", "grpc")}
        return {"duration_s": round(self.ended - self.started, 1), "requests": len(self.outcomes), "by_protocol": by_protocol,
                "errors": [asdict(o) for o in self.errors()[:10]]}


class RssSampler:
    """Samples the RSS (MB) of named processes every `interval_s` in a background thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0):
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = {"t": round(time.monotonic() - self.t0, 1)}
            for name, proc in self.procs.items():
                try:
                    sample[name] = round(proc.memory_info().rss / MB, 1)
                except psutil.Error:
                    sample[name] = None
            self.samples.append(sample)
            self._stop.wait(self.interval_s)

    def series(self, name: str) -> list[float]:
        return [s[name] for s in self.samples if s.get(name) is not None]

    def stats(self) -> dict:
        out = {}
        for name in self.procs:
            values = self.series(name)
            if values:
                out[name] = {"min_mb": min(values), "max_mb": max(values), "first_mb": values[0], "last_mb": values[-1]}
        return out

    def growth_second_half(self, name: str) -> float:
        """MB the process grew over the second half of the run: max(second half) - value at the middle."""
        values = self.series(name)
        middle = len(values) // 2
        return max(values[middle:]) - values[middle]


async def run_load(http_url: str, grpc_address: str, clients: int, duration_s: float, make_job: Callable[[random.Random], Job],
                   seed: int = 0, backoff_s: float = 0.2, timeout_s: float = 120.0) -> LoadResult:
    result = LoadResult(started=time.monotonic(), ended=0.0)
    end = result.started + duration_s
    limits = httpx2.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx2.AsyncClient(timeout=timeout_s, limits=limits) as http, grpc.aio.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.RouterStub(channel)

        async def client(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                job = make_job(rng)
                started = time.monotonic()
                try:
                    if job.protocol == "http":
                        status, tokens, detail = await _http(http, http_url, job)
                    else:
                        status, tokens, detail = await _grpc(stub, job, timeout_s)
                except Exception as exc:  # noqa: BLE001 - a lost request: recorded, and the load goes on
                    status, tokens, detail = "error", 0, f"{type(exc).__name__}: {exc}"
                result.outcomes.append(Outcome(job.protocol, status, started, time.monotonic(), tokens, detail))
                if status == "refused":
                    await asyncio.sleep(backoff_s * (0.5 + rng.random()))

        await asyncio.gather(*(client(i) for i in range(clients)))
    result.ended = time.monotonic()
    return result


async def _http(client: httpx2.AsyncClient, url: str, job: Job) -> tuple[str, int, str]:
    body = {"model": MODEL, "prompt": job.prompt, "max_tokens": job.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code == 429:
            retry_after = resp.headers.get("retry-after")
            return ("refused", 0, "") if retry_after and int(retry_after) >= 1 else ("error", 0, "429 without Retry-After")
        if resp.status_code != 200:
            return "error", 0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        chunks, finish, usage = 0, None, None
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return "error", 0, f"stream error: {event['error']}"
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                chunks += 1
                finish = choice.get("finish_reason") or finish
            if job.cancel_after is not None and chunks >= job.cancel_after:
                return "cancelled", 0, ""  # leaving the block closes the connection: the server must cancel
    tokens = usage["completion_tokens"] if usage else 0
    return _judge(job, finish == "length", tokens, f"finish={finish} usage={usage}")


async def _grpc(stub: pb_grpc.RouterStub, job: Job, timeout_s: float) -> tuple[str, int, str]:
    request = pb.GenerateRequest(text=job.prompt, raw=True, model=MODEL,
                                 sampling=pb.SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True))
    call = stub.Generate(request, timeout=timeout_s)
    tokens, chunks, last = 0, 0, None
    try:
        async for response in call:
            tokens += len(response.chunk.token_ids)
            chunks += 1
            last = response
            if job.cancel_after is not None and chunks >= job.cancel_after:
                call.cancel()
                return "cancelled", 0, ""
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "refused", 0, ""
        return "error", 0, f"gRPC {exc.code().name}: {exc.details()}"
    if last is None:
        return "error", 0, "empty stream"
    done = last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == tokens
    return _judge(job, done, tokens, f"finish={last.finish_reason} usage={last.usage.completion_tokens} error={last.error.message!r}")


def _judge(job: Job, finished: bool, tokens: int, detail: str) -> tuple[str, int, str]:
    """A stream that ended (before any planned hang-up) is ok only with exactly max_tokens tokens."""
    if finished and tokens == job.max_tokens:
        return "ok", tokens, ""
    return "error", tokens, f"expected {job.max_tokens} tokens: {detail}"
