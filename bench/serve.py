"""Serving benchmark: an open- or closed-loop load generator against a running server.

Usage (what `pdserve bench serve ARGS` runs; `python -m bench.serve ARGS` works too):

    pdserve bench serve --grpc 127.0.0.1:50051 --num-prompts 64 --request-rate 4 \
        --input-len 64:256 --output-len 32:128 --goodput ttft:500 tpot:100 --out bench/results/serve.json
    pdserve bench serve --url http://127.0.0.1:8000/v1 --max-concurrency 8 --dataset chat

Lifecycle of one run:
  1. build the workload (seeded; run i of several rates uses seed + i): prompts as token ids (gRPC)
     or random words (HTTP), output lengths, plus burst requests injected at `--burst-at` seconds;
     `--dataset random|chat|prefix|file` (file: replay a JSON list of prompts and output lengths);
  2. draw arrival times: Poisson (`--burstiness 1`) or gamma gaps at `--request-rate`, or all at
     t=0 (`inf`); `--max-concurrency` caps requests in flight (bursts are not capped);
  3. stream every request, stamping each streamed chunk on arrival (`time.perf_counter`);
  4. compute vLLM's serving metrics from those raw stamps (`compute_metrics`), the ITL inside and
     outside burst windows (`burst_itl`), and write the JSON (raw stamps included, so every figure
     can be recomputed) and PNG plots.

Metric definitions (as vLLM's benchmark_serving):
  TTFT  first streamed token - request sent
  E2E   last byte of the stream - request sent
  TPOT  (E2E - TTFT) / (output tokens - 1), over requests with more than one output token
  ITL   every gap between consecutive streamed chunks of a request (one token per chunk here)
  throughput  completed requests / duration, output tokens / duration, (input+output) / duration
  goodput     requests / duration that meet every SLO given (`--goodput ttft:MS tpot:MS e2el:MS`;
              a one-token request counts TPOT as 0)
Duration: from the first request sent to the last response finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("bench.serve")

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}
DEFAULT_VOCAB = (1000, 30000)
"""Token ids drawn for random prompts: clear of the special tokens at the bottom of BPE vocabularies."""

# ~1 BPE token each (with the leading space) in common English vocabularies.
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but one first new their its also after two they who her been can more other time all she into "
    "up year would some there about most city when over only three world between people state may "
    "during many these states like part school under later known used then under four high since "
    "such team both where well season war back best second while work found made where each him "
    "through film same name game life government day music line any group family three water party "
    "own long small large home number old before great west house place field university right power"
).split()

# A chat-like length mix: (weight, prompt tokens range, output tokens range). Many short turns,
# fewer long documents; about ShareGPT's shape, shrunk to what a 2-core CPU serves in minutes.
CHAT_MIX = (
    (0.50, (8, 64), (8, 64)),
    (0.35, (64, 256), (32, 128)),
    (0.15, (256, 1024), (64, 256)),
)


# ---- workload ------------------------------------------------------------------------------------
@dataclass
class RequestSpec:
    index: int
    prompt_len: int
    output_len: int
    arrival_s: float
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    group: str = "main"  # "main" or "burst"
    burst: int | None = None  # index into the burst list


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256)."""
    lo, _, hi = str(text).partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise argparse.ArgumentTypeError(f"length range must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo_i, hi_i


def draw(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = bounds
    return rng.integers(lo, hi + 1, size=n)


def random_ids(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    return rng.integers(vocab[0], vocab[1], size=n).tolist()


def random_text(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival offsets (s), the first at 0. Gaps are gamma(shape=burstiness, mean=1/rate):
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. rate inf: all at 0."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_workload(args: argparse.Namespace, rate: float, as_text: bool) -> list[RequestSpec]:
    """The seeded request list of one run: `num_prompts` main requests plus the bursts."""
    rng = np.random.default_rng(args.seed)
    if args.dataset == "file":
        return _file_workload(args, rate, rng)
    n = args.num_prompts
    if args.dataset == "chat":
        weights = np.array([w for w, _, _ in CHAT_MIX])
        kinds = rng.choice(len(CHAT_MIX), size=n, p=weights / weights.sum())
        scale = args.chat_scale
        in_lens = np.array([max(1, int(rng.integers(*CHAT_MIX[k][1]) * scale)) for k in kinds])
        out_lens = np.array([max(1, int(rng.integers(*CHAT_MIX[k][2]) * scale)) for k in kinds])
    else:
        in_lens, out_lens = draw(rng, args.input_len, n), draw(rng, args.output_len, n)
    prefixes: list = []
    if args.dataset == "prefix":
        prefixes = [random_text(rng, args.prefix_len) if as_text else random_ids(rng, args.prefix_len, args.vocab)
                    for _ in range(args.num_prefixes)]
    arrivals = arrival_times(n, rate, args.burstiness, rng)
    specs: list[RequestSpec] = []
    for i in range(n):
        spec = RequestSpec(i, int(in_lens[i]), int(out_lens[i]), float(arrivals[i]))
        prefix = prefixes[i % len(prefixes)] if prefixes else None
        if as_text:
            body = random_text(rng, spec.prompt_len)
            spec.prompt_text = f"{prefix} {body}" if prefix else body
        else:
            spec.prompt_ids = (list(prefix) if prefix else []) + random_ids(rng, spec.prompt_len, args.vocab)
        if prefix:
            spec.prompt_len += args.prefix_len
        specs.append(spec)
    for b, at in enumerate(args.burst_at or []):
        for _ in range(args.burst_size):
            spec = RequestSpec(len(specs), args.burst_prompt_len, args.burst_output_len, float(at), group="burst", burst=b)
            if as_text:
                spec.prompt_text = random_text(rng, spec.prompt_len)
            else:
                spec.prompt_ids = random_ids(rng, spec.prompt_len, args.vocab)
            specs.append(spec)
    return specs


def _file_workload(args: argparse.Namespace, rate: float, rng: np.random.Generator) -> list[RequestSpec]:
    """--dataset file: a JSON list of {"prompt_ids": [...] or "prompt": "...", "output_len": N}, sent
    in order (the first --num-prompts of them, or all when --num-prompts is 0)."""
    items = json.loads(Path(args.dataset_path).read_text())
    if args.num_prompts:
        items = items[: args.num_prompts]
    arrivals = arrival_times(len(items), rate, args.burstiness, rng)
    specs = []
    for i, item in enumerate(items):
        ids, text = item.get("prompt_ids"), item.get("prompt")
        if ids is None and text is None:
            raise ValueError(f"{args.dataset_path}[{i}]: needs prompt_ids or prompt")
        specs.append(RequestSpec(i, len(ids) if ids is not None else len(text.split()), int(item["output_len"]),
                                 float(arrivals[i]), prompt_ids=list(ids) if ids is not None else None, prompt_text=text))
    return specs


# ---- raw results ---------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as observed by the client. Times are seconds since the run's start."""

    index: int
    group: str
    burst: int | None
    scheduled_s: float
    prompt_len: int
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None
    finish_reason: str | None = None
    server_timings: dict[str, float] | None = None
    sent: bool = False


CANCELLED = "cancelled"
"""finish_reason of a main request the benchmark itself cancelled (--stop-after-bursts): its chunks
count for ITL, but it is neither completed nor failed."""


def streamed(rec: dict) -> bool:
    """Completed, or cancelled by the benchmark: its chunk timestamps are real ITL samples."""
    return bool(rec["ok"] or rec.get("finish_reason") == CANCELLED)


def token_stats(rec: dict) -> dict[str, Any] | None:
    """TTFT, E2E, TPOT (s; None for a one-token answer) and ITL gaps of one successful record."""
    if not rec["ok"] or not rec["chunk_times_s"]:
        return None
    times = rec["chunk_times_s"]
    ttft = times[0] - rec["start_s"]
    e2e = rec["end_s"] - rec["start_s"]
    n_out = rec["output_tokens"]
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": itl}


# ---- clients -------------------------------------------------------------------------------------
class GrpcBackend:
    """pdserve's `Router/Generate` (token ids in, token chunks out)."""

    name = "grpc"

    def __init__(self, address: str, model: str | None, args: argparse.Namespace):
        import grpc

        from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

        self.args, self.model = args, model
        self.channel = grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.RouterStub(self.channel)

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock) -> None:
        import grpc

        from proto.pdserve.v1 import pdserve_pb2 as pb

        args = self.args
        sampling = pb.SamplingParams(max_tokens=spec.output_len, temperature=args.temperature, ignore_eos=args.ignore_eos)
        if args.temperature > 0:
            sampling.seed = args.seed + spec.index
        request = pb.GenerateRequest(sampling=sampling, model=self.model or "", skip_detokenize=args.skip_detokenize)
        if spec.prompt_ids is not None:
            request.token_ids.ids.extend(spec.prompt_ids)
        else:
            request.text, request.raw = spec.prompt_text, True
        rec.start_s, rec.sent = clock(), True
        call = self.stub.Generate(request, timeout=args.request_timeout)
        try:
            async for response in call:
                now = clock()
                if response.prompt_token_ids:
                    rec.prompt_tokens = len(response.prompt_token_ids)
                if response.chunk.token_ids:
                    rec.chunk_times_s.append(now)
                    rec.chunk_tokens.append(len(response.chunk.token_ids))
                if response.finish_reason:
                    rec.finish_reason = pb.FinishReason.Name(response.finish_reason)
                    rec.output_tokens = response.usage.completion_tokens or sum(rec.chunk_tokens)
                    t = response.timings
                    rec.server_timings = {k: getattr(t, k) for k in (
                        "router_queue_s", "prefill_queue_s", "prefill_compute_s", "kv_transfer_s", "decode_admission_s", "ttft_s", "e2e_s")}
                    if response.finish_reason == pb.FINISH_REASON_ERROR:
                        rec.error = f"{pb.ErrorCode.Name(response.error.code)}: {response.error.message}"
            rec.end_s = clock()
            rec.ok = rec.error is None and rec.finish_reason is not None
            if rec.finish_reason is None:
                rec.error = "stream ended without a finish reason"
        except grpc.aio.AioRpcError as exc:
            rec.end_s = clock()
            rec.error = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def close(self) -> None:
        await self.channel.close()


class OpenAIBackend:
    """Any OpenAI-compatible server: streaming `/completions` or `/chat/completions` over SSE."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None, args: argparse.Namespace):
        self.base_url, self.model, self.args = base_url.rstrip("/"), model, args
        self.session = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.args.request_timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        if not self.model:
            async with self.session.get(f"{self.base_url}/models") as resp:
                resp.raise_for_status()
                self.model = (await resp.json())["data"][0]["id"]

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock) -> None:
        import aiohttp

        args = self.args
        prompt: Any = spec.prompt_text if spec.prompt_text is not None else spec.prompt_ids
        body: dict[str, Any] = {
            "model": self.model, "max_tokens": spec.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        if args.temperature > 0:
            body["seed"] = args.seed + spec.index
        if args.endpoint == "chat":
            url = f"{self.base_url}/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else " ".join(map(str, prompt))}]
        else:
            url = f"{self.base_url}/completions"
            body["prompt"] = prompt
        rec.start_s, rec.sent = clock(), True
        try:
            async with self.session.post(url, json=body) as resp:
                if resp.status != 200:
                    rec.end_s = clock()
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                done = False
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    now = clock()
                    self._absorb(json.loads(data), rec, now)
                rec.end_s = clock()
                if rec.error is None and not done:
                    rec.error = "stream ended without [DONE]"
        except (TimeoutError, aiohttp.ClientError) as exc:
            rec.end_s = clock()
            rec.error = f"{type(exc).__name__}: {exc}"
            return
        if rec.output_tokens == 0:
            rec.output_tokens = sum(rec.chunk_tokens)
        rec.ok = rec.error is None

    def _absorb(self, event: dict, rec: RequestRecord, now: float) -> None:
        if "error" in event:
            rec.error = str(event["error"].get("message", event["error"]))
            return
        usage = event.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens") or 0
        for choice in event.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                logprobs = choice.get("logprobs") or {}
                rec.chunk_times_s.append(now)
                rec.chunk_tokens.append(len(logprobs.get("tokens") or logprobs.get("content") or [0]))
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


# ---- one run -------------------------------------------------------------------------------------
async def run_load(backend, specs: list[RequestSpec], max_concurrency: int | None, progress: bool = True,
                   stop_after_bursts: float | None = None) -> tuple[list[RequestRecord], float]:
    """Send `specs` at their arrival times (main requests capped at `max_concurrency` in flight);
    returns the records of the requests sent and the duration (first send to last finish).

    `stop_after_bursts`: that many seconds after the last burst request finished, main requests
    still streaming are cancelled (finish_reason "cancelled") and those not sent yet are dropped."""
    from tqdm import tqdm

    bar = tqdm(total=len(specs), file=sys.stderr, disable=not progress, desc="requests", leave=False)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(spec: RequestSpec) -> RequestRecord:
        rec = RequestRecord(spec.index, spec.group, spec.burst, spec.arrival_s, spec.prompt_len, spec.output_len)
        try:
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is not None and spec.group == "main":
                async with limit:
                    await backend.send(spec, rec, clock)
            else:
                await backend.send(spec, rec, clock)
        except asyncio.CancelledError:  # only run_load cancels (stop_after_bursts)
            rec.ok, rec.error, rec.finish_reason, rec.end_s = False, "cancelled by the benchmark", CANCELLED, clock()
        except Exception as exc:  # a client-side failure is one failed request, not a failed run
            log.exception("request %d failed in the client", spec.index)
            rec.ok, rec.error, rec.end_s = False, f"client: {type(exc).__name__}: {exc}", clock()
        bar.update(1)
        return rec

    tasks = [asyncio.ensure_future(one(s)) for s in specs]
    bursts = [t for t, s in zip(tasks, specs) if s.group == "burst"]
    if stop_after_bursts is not None and bursts:
        await asyncio.wait(bursts)
        await asyncio.sleep(stop_after_bursts)
        for task, spec in zip(tasks, specs):
            if spec.group == "main" and not task.done():
                task.cancel()
    records = [r for r in await asyncio.gather(*tasks) if r.sent]
    bar.close()
    started = min((r.start_s for r in records), default=0.0)
    finished = max((r.end_s for r in records), default=0.0)
    return sorted(records, key=lambda r: r.index), finished - started


# ---- metrics -------------------------------------------------------------------------------------
def summarize(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float | int | None]:
    """mean/median/std/min/max and percentiles, in milliseconds (None when there is no value)."""
    out: dict[str, float | int | None] = {"count": len(values_s)}
    keys = ["mean", "median", "std", "min", "max"] + [f"p{p:g}" for p in percentiles]
    if not values_s:
        return {**out, **{k: None for k in keys}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out.update(mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()), min=float(ms.min()), max=float(ms.max()))
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(ms, p))
    return out


def compute_metrics(records: list[dict], duration_s: float, slos_ms: dict[str, float] | None = None,
                    percentiles=DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's serving metrics over `records` (dicts as saved in the JSON)."""
    ttfts, tpots, itls, e2es, good = [], [], [], [], 0
    completed = input_tokens = output_tokens = 0
    for rec in records:
        s = token_stats(rec)
        if s is None:
            continue
        completed += 1
        input_tokens += rec["prompt_tokens"] if rec["prompt_tokens"] is not None else rec["prompt_len"]
        output_tokens += rec["output_tokens"]
        ttfts.append(s["ttft"])
        e2es.append(s["e2e"])
        itls.extend(s["itl"])
        if s["tpot"] is not None:
            tpots.append(s["tpot"])
        if slos_ms:
            measured = {"ttft": s["ttft"], "tpot": s["tpot"] or 0.0, "e2el": s["e2e"]}
            good += all(measured[k] * 1000.0 <= v for k, v in slos_ms.items())
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    cancelled = sum(1 for r in records if r.get("finish_reason") == CANCELLED)
    return {
        "completed": completed,
        "failed": len(records) - completed - cancelled,
        "cancelled": cancelled,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(completed),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "goodput": per_s(good) if slos_ms else None,
        "good_requests": good if slos_ms else None,
        "slos_ms": slos_ms or None,
        "ttft_ms": summarize(ttfts, percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize(itls, percentiles),
        "e2el_ms": summarize(e2es, percentiles),
    }


def burst_windows(records: list[dict]) -> list[dict[str, float]]:
    """Per burst: from its requests' first send to the last of their first tokens (the prefill
    work the burst brings); a burst request that failed ends the window at its end."""
    windows: dict[int, list[float]] = {}
    for rec in records:
        if rec["group"] != "burst":
            continue
        end = rec["chunk_times_s"][0] if rec["chunk_times_s"] else rec["end_s"]
        w = windows.setdefault(rec["burst"], [rec["start_s"], end])
        w[0], w[1] = min(w[0], rec["start_s"]), max(w[1], end)
    return [{"burst": b, "start_s": s, "end_s": e} for b, (s, e) in sorted(windows.items())]


def burst_itl(records: list[dict], windows: list[dict[str, float]], percentiles=DEFAULT_PERCENTILES) -> dict[str, Any]:
    """ITL of the main (non-burst) requests, split by burst window.

    inside:  gaps that overlap a burst window (a < end and b > start);
    outside: the other gaps, from `steady_from_s` on = when every main request sent before the
             first burst had its first token (so start-up prefills don't count as steady state);
             also split into `before` (ending before the first window) and `after` (starting after
             the last window), since a burst can leave the server slower than it found it."""
    if not windows:
        return {}
    first_burst = min(w["start_s"] for w in windows)
    last_burst = max(w["end_s"] for w in windows)
    steady_from = max((r["chunk_times_s"][0] for r in records
                       if r["group"] == "main" and streamed(r) and r["chunk_times_s"] and r["start_s"] < first_burst), default=0.0)
    inside, outside, before, after = [], [], [], []
    for rec in records:
        if rec["group"] != "main" or not streamed(rec):
            continue
        times = rec["chunk_times_s"]
        for a, b in zip(times, times[1:]):
            if any(a < w["end_s"] and b > w["start_s"] for w in windows):
                inside.append(b - a)
            elif a >= steady_from:
                outside.append(b - a)
                if b <= first_burst:
                    before.append(b - a)
                elif a >= last_burst:
                    after.append(b - a)
    out = {"steady_from_s": steady_from, "windows": windows,
           "inside_ms": summarize(inside, percentiles), "outside_ms": summarize(outside, percentiles),
           "before_ms": summarize(before, percentiles), "after_ms": summarize(after, percentiles)}
    top = f"p{max(percentiles):g}"
    if out["inside_ms"][top] is not None and out["outside_ms"][top]:
        out[f"{top}_ratio"] = out["inside_ms"][top] / out["outside_ms"][top]
    if out["inside_ms"][top] is not None and out["before_ms"][top]:
        out[f"{top}_ratio_vs_before"] = out["inside_ms"][top] / out["before_ms"][top]
    return out


def parse_slos(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise argparse.ArgumentTypeError(f"--goodput takes KEY:MS with KEY in ttft, tpot, e2el; got {item!r}")
        slos[SLO_KEYS[key]] = float(value)
    return slos


# ---- plots ---------------------------------------------------------------------------------------
def plot_report(report: dict[str, Any], stem: Path) -> list[str]:
    """Latency CDFs, an ITL timeline per run (bursts shaded), goodput against rate. Returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    runs = report["runs"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, title in zip(axes.flat, ("ttft", "tpot", "itl", "e2e"), ("TTFT", "TPOT", "ITL", "E2E latency")):
        for run in runs:
            values = []
            for rec in run["requests"]:
                s = token_stats(rec)
                if s is None:
                    continue
                if key == "itl":
                    values.extend(s["itl"])
                elif s[key] is not None:
                    values.append(s[key])
            if values:
                xs = np.sort(np.asarray(values) * 1000.0)
                ys = np.arange(1, len(xs) + 1) / len(xs)
                ax.step(np.r_[xs[0], xs], np.r_[0.0, ys], where="post", label=run["label"])
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if key in ("itl", "e2e"):
            ax.set_xscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, stem.with_name(stem.name + "_cdf.png")))

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        plot_itl_timeline(ax, run["requests"], run.get("burst_itl", {}).get("windows", []))
        ax.set_title(f"ITL timeline: {run['label']}", fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, stem.with_name(stem.name + "_itl_timeline.png")))

    if len(runs) > 1 and report.get("slos_ms"):
        rated = [r for r in runs if r["request_rate"] is not None and not math.isinf(r["request_rate"])]
        if len(rated) > 1:
            fig, ax = plt.subplots(figsize=(6, 4))
            xs = [r["request_rate"] for r in rated]
            ax.plot(xs, [r["metrics"]["goodput"] for r in rated], "o-", label="goodput")
            ax.plot(xs, [r["metrics"]["request_throughput"] for r in rated], "s--", label="throughput")
            ax.plot(xs, xs, ":", color="gray", label="offered")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("req/s")
            ax.set_title("goodput " + " ".join(f"{k}<={v:g}ms" for k, v in report["slos_ms"].items()), fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            paths.append(_save(fig, stem.with_name(stem.name + "_goodput.png")))
    plt.close("all")
    return paths


def plot_itl_timeline(ax, records: list[dict], windows: list[dict]) -> None:
    """Every ITL gap of main requests at its end time; burst windows shaded."""
    xs, ys = [], []
    for rec in records:
        if rec["group"] != "main" or not streamed(rec):
            continue
        times = rec["chunk_times_s"]
        xs.extend(times[1:])
        ys.extend((b - a) * 1000.0 for a, b in zip(times, times[1:]))
    ax.scatter(xs, ys, s=3, alpha=0.5)
    for w in windows:
        ax.axvspan(w["start_s"], w["end_s"], color="tab:red", alpha=0.15, label="burst" if w is windows[0] else None)
    if windows:
        ax.legend(fontsize=8, loc="upper right")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("ITL (ms)")
    if ys and max(ys) > 20 * max(min(ys), 1e-3):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)


# ---- driver --------------------------------------------------------------------------------------
def host_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="pdserve router gRPC address")
    target.add_argument("--url", metavar="URL", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name sent with each request (HTTP default: first of /models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions", help="HTTP endpoint")
    p.add_argument("--dataset", choices=["random", "chat", "prefix", "file"], default="random")
    p.add_argument("--dataset-path", default=None, help="--dataset file: JSON list of {prompt_ids|prompt, output_len}")
    p.add_argument("--num-prompts", type=int, default=32, help="main requests per run (file: 0 = all)")
    p.add_argument("--input-len", type=parse_range, default=(128, 128), metavar="N|MIN:MAX")
    p.add_argument("--output-len", type=parse_range, default=(64, 64), metavar="N|MIN:MAX")
    p.add_argument("--chat-scale", type=float, default=1.0, help="scales the chat mix's lengths")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset: distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: tokens (words) per shared prefix")
    p.add_argument("--vocab", type=parse_range, default=DEFAULT_VOCAB, metavar="LO:HI", help="random token id range (gRPC)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s (one run per value; inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on main requests in flight")
    p.add_argument("--burst-at", type=float, action="append", metavar="S", help="inject a burst S seconds in (repeatable)")
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-prompt-len", type=int, default=1024)
    p.add_argument("--burst-output-len", type=int, default=4)
    p.add_argument("--stop-after-bursts", type=float, default=None, metavar="S",
                   help="S seconds after the last burst request finished, cancel the main requests still streaming "
                        "(their chunks still count for ITL) and drop those not sent")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (where the server supports it)")
    p.add_argument("--skip-detokenize", action="store_true", help="gRPC: ask the router for token ids only")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and discarded) before each run")
    p.add_argument("--label", default=None, help="name of this setup in the JSON and plots")
    p.add_argument("--out", type=Path, default=None, help="JSON path (PNG plots next to it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


async def _run_all(args: argparse.Namespace, slos: dict[str, float], percentiles: tuple[float, ...]) -> list[dict]:
    if args.grpc:
        backend = GrpcBackend(args.grpc, args.model, args)
    else:
        backend = OpenAIBackend(args.url, args.model, args)
        await backend.open()
    runs = []
    try:
        for i, rate in enumerate(args.request_rate):
            if args.warmup:
                short = (min(args.output_len[0], 16), min(args.output_len[1], 16))  # warm the path, don't run a benchmark
                warm = build_workload(argparse.Namespace(**{**vars(args), "dataset": "random" if args.dataset == "file" else args.dataset,
                                                            "num_prompts": args.warmup, "burst_at": None, "output_len": short,
                                                            "seed": args.seed + 10_000 + i}), math.inf, args.url is not None)
                await run_load(backend, warm, None, progress=False)
            # run i draws its prompts from seed + i: no prefix-cache hits on an earlier run's prompts
            specs = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), rate, as_text=args.url is not None)
            load_before = os.getloadavg()
            records, duration = await run_load(backend, specs, args.max_concurrency, progress=not args.no_progress,
                                               stop_after_bursts=args.stop_after_bursts)
            raw = [asdict(r) for r in records]
            run: dict[str, Any] = {
                "seed": args.seed + i,
                "label": f"{args.label + ' ' if args.label else ''}rate={rate:g}" + (f" conc={args.max_concurrency}" if args.max_concurrency else ""),
                "request_rate": None if math.isinf(rate) else rate,
                "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency,
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "metrics": compute_metrics(raw, duration, slos, percentiles),
            }
            if any(r["group"] == "burst" for r in raw):
                run["metrics_by_group"] = {
                    g: compute_metrics([r for r in raw if r["group"] == g], duration, slos, percentiles) for g in ("main", "burst")}
                run["burst_itl"] = burst_itl(raw, burst_windows(raw), percentiles)
            run["requests"] = raw
            runs.append(run)
            _print_run(run)
    finally:
        await backend.close()
    return runs


def _print_run(run: dict) -> None:
    m = run["metrics"]
    lines = [f"== {run['label']}: {m['completed']} ok, {m['failed']} failed, {m['cancelled']} cancelled in {m['duration_s']:.2f} s",
             f"   throughput {m['request_throughput']:.3f} req/s, {m['output_throughput']:.1f} out tok/s, "
             f"{m['total_token_throughput']:.1f} tok/s" + (f", goodput {m['goodput']:.3f} req/s" if m["goodput"] is not None else "")]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = m[key]
        if s["count"]:
            lines.append(f"   {key[:-3]:5s} mean {s['mean']:8.1f}  median {s['median']:8.1f}  p90 {s.get('p90') or 0:8.1f}  p99 {s.get('p99') or 0:8.1f} ms")
    b = run.get("burst_itl")
    if b:
        lines.append(f"   ITL outside bursts p50 {b['outside_ms']['median'] or 0:.1f} p99 {b['outside_ms'].get('p99') or 0:.1f} ms; "
                     f"inside p50 {b['inside_ms']['median'] or 0:.1f} p99 {b['inside_ms'].get('p99') or 0:.1f} ms")
    print("\n".join(lines), file=sys.stderr)


def run(argv: list[str]) -> dict[str, Any]:
    """Runs the benchmark described by `argv` (the CLI's flags) and returns the report (JSON-ready)."""
    args = build_parser().parse_args(argv)
    slos = parse_slos(args.goodput)
    percentiles = tuple(float(x) for x in args.percentiles.split(",") if x)
    started = time.time()
    host = host_info()
    runs = asyncio.run(_run_all(args, slos, percentiles))
    host["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "bench": "serve",
        "created_unix": int(started),
        "backend": "grpc" if args.grpc else f"openai-{args.endpoint}",
        "target": args.grpc or args.url,
        "host": host,
        "args": {k: (list(v) if isinstance(v, tuple) else (str(v) if isinstance(v, Path) else v)) for k, v in vars(args).items()},
        "slos_ms": slos or None,
        "percentiles": list(percentiles),
        "definitions": DEFINITIONS,
        "runs": runs,
    }
    report["args"]["request_rate"] = [None if math.isinf(r) else r for r in args.request_rate]
    return report


DEFINITIONS = {
    "ttft": "first streamed token - request sent",
    "e2el": "end of stream - request sent",
    "tpot": "(e2el - ttft) / (output_tokens - 1), requests with > 1 output token",
    "itl": "gaps between consecutive streamed chunks (chunk_times_s) of each request",
    "goodput": "requests meeting every SLO / duration (TPOT of a 1-token request counts as 0)",
    "times": "requests[].start_s, end_s, chunk_times_s are seconds since the run started (perf_counter)",
}


def write_report(report: dict[str, Any], out: Path, plots: bool = True) -> list[str]:
    """Writes the JSON to `out` and, with `plots`, PNGs next to it; returns the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    paths = [str(out)]
    if plots:
        paths += plot_report(report, out.with_suffix(""))
    return paths


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    report = run(argv)
    args = report["args"]
    if args["out"]:
        for path in write_report(report, Path(args["out"]), plots=not args["no_plots"]):
            log.info("wrote %s", path)
    return 0 if all(r["metrics"]["completed"] for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
