"""Sections 1-3 of the device check: greedy correctness, throughput against transformers, decode step time.

Each `section_*` returns a JSON-able dict and raises on failure (the harness records it and goes on).
`Models` builds the big model once: its engine serves the throughput and the decode sections, and a
copy made before the engine switches attention implementations serves both transformers baselines.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import contextmanager

import torch

from bench import engine as bench_engine
from bench.gpu import correctness, ipc, models
from bench.gpu.device import copy_rate_gbps, sync, time_ms
from bench.gpu.settings import CheckSettings
from engine import Engine, paged_decode
from engine.scheduler import ScheduledSeq


class Models:
    """Lazily built models shared by sections (a failed build is retried by the next section)."""

    def __init__(self, s: CheckSettings):
        self.s = s
        self._big: tuple | None = None
        self.copy_rate: dict | None = None

    def big(self) -> tuple:
        """(loaded, transformers reference copy, engine, workload) of the throughput model."""
        if self._big is None:
            s = self.s
            loaded = models.build(s.big_shape, s.big_dtype, s.device)
            reference = correctness.reference_copy(loaded)
            bs = bench_engine.Settings(
                num_requests=s.num_requests, prompt_len=s.prompt_len, output_len=s.output_len,
                max_num_batched_tokens=s.max_num_batched_tokens, decode_batch=max(s.decode_batches),
                decode_steps=s.decode_iters + s.decode_context,
            )
            special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
            workload = bench_engine.make_workload(bs, loaded.config.vocab_size, special)
            config = dataclasses.replace(bench_engine.engine_config(bs, loaded, workload), device=s.device)
            engine = Engine(config, loaded=loaded)
            self._big = (loaded, reference, engine, workload)
        return self._big

    def hbm_gbps(self) -> float:
        if self.copy_rate is None:
            self.copy_rate = copy_rate_gbps(self.s.device, self.s.copy_bytes)
        return self.copy_rate["hbm_gbps"]


# ---- (1) correctness ------------------------------------------------------------------------------
def section_correctness(s: CheckSettings) -> dict:
    result = {}
    for dtype, tokens in (("float32", s.correctness_tokens), ("bfloat16", 32)):
        loaded = models.build(s.correctness_shape, dtype, s.device)
        reference = correctness.reference_copy(loaded)
        prompts = correctness.random_prompts(loaded.tokenizer, s.correctness_prompts, (4, 200), seed=1)
        hf = correctness.hf_greedy(reference, prompts, tokens)
        engine = correctness.make_engine(loaded, s.device, max_num_seqs=64)
        got = correctness.engine_greedy(engine, prompts, tokens)
        graphs = engine.runner.graphs
        result[dtype] = {
            **correctness.compare(got, hf), "tokens": tokens,
            "decode_steps_from_cuda_graphs": graphs.steps if graphs is not None else 0, "engine_steps": engine.stats().steps,
            "decode_kernel": engine.runner.decode_kernel, "fallback_reason": engine.runner.fallback_reason,
            "one_pass_layers": _one_pass_layers(loaded.model),
        }
        del engine, reference, loaded
    result["fp32_identical"] = result["float32"]["identical"] == result["float32"]["prompts"]
    return result


# ---- (2) throughput -------------------------------------------------------------------------------
def section_engine_throughput(m: Models) -> dict:
    _, _, engine, workload = m.big()
    graphs = engine.runner.graphs
    before = graphs.steps if graphs is not None else 0
    with _step_times(engine) as steps:
        result = bench_engine.run_engine(engine, workload)
    result["decode_steps_from_cuda_graphs"] = (graphs.steps - before) if graphs is not None else 0
    result["step_seconds"] = steps
    result["num_requests"] = len(workload.prompts)
    result["decode_kernel"] = engine.runner.decode_kernel
    result["fallback_reason"] = engine.runner.fallback_reason
    return result


@contextmanager
def _step_times(engine: Engine):
    """Seconds and counts of the engine's steps, split into graph-replayed decode steps and the others."""
    totals = {"graph_steps": 0, "graph_s": 0.0, "other_steps": 0, "other_s": 0.0}
    graphs, step = engine.runner.graphs, engine.step

    def timed():
        replays, t0 = graphs.steps if graphs is not None else 0, time.perf_counter()
        out = step()
        kind = "graph" if graphs is not None and graphs.steps > replays else "other"
        totals[f"{kind}_steps"] += 1
        totals[f"{kind}_s"] += time.perf_counter() - t0
        return out

    engine.step = timed
    try:
        yield totals
    finally:
        del engine.step
        for key in ("graph_s", "other_s"):
            totals[key] = round(totals[key], 3)


def section_hf_static(m: Models) -> dict:
    loaded, reference, _, workload = m.big()
    subset = workload.subset(m.s.hf_static_requests)
    pad = loaded.tokenizer.pad_token_id or 0
    return {**bench_engine.run_hf_static(reference, subset, m.s.hf_static_batch, pad), "num_requests": len(subset.prompts)}


def section_hf_continuous(m: Models) -> dict:
    loaded, reference, _, workload = m.big()
    subset = workload.subset(m.s.hf_continuous_requests)
    pad = loaded.tokenizer.pad_token_id or 0
    result = bench_engine.run_hf_continuous(reference, subset, m.s.max_num_batched_tokens, pad)
    return {**result, "num_requests": len(subset.prompts)}


# ---- (3) decode step vs the HBM bound ------------------------------------------------------------
def section_decode_step(m: Models) -> dict:
    loaded, _, engine, _ = m.big()
    hbm = m.hbm_gbps()
    weights = _weight_bytes_read(loaded.model)
    out = {"hbm_gbps_measured": hbm, "copy": m.copy_rate, "weight_bytes_read_per_step": weights, "batches": {},
           "decode_tuning": engine.runner.decode_tuning, "one_pass_layers": _one_pass_layers(loaded.model)}
    for batch in m.s.decode_batches:
        out["batches"][str(batch)] = _decode_at(engine, batch, m.s, weights, hbm)
    if engine.runner.decode_kernel == "triton":
        out["triton_kernel_configs"] = _kernel_configs(engine, max(m.s.decode_batches), m.s, hbm)
    return out


def _one_pass_layers(model: torch.nn.Module) -> int:
    """Modules running engine.llama_layers' one-pass forwards (rotary embedding, RMSNorm) instead of transformers'."""
    return sum(1 for module in model.modules() if "forward" in vars(module))


def _kernel_configs(engine: Engine, batch: int, s: CheckSettings, hbm_gbps: float) -> dict:
    """The triton decode kernel alone on one layer's pool, at a few tile sizes and warp counts: GB/s of KV read."""
    from engine.paged_decode import decode_triton

    layout, cache = engine.layout, engine.kv_cache
    blocks = -(-s.decode_context // layout.block_size)
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, cache.num_blocks, (batch, blocks), generator=gen, dtype=torch.int32).to(s.device)
    lens = torch.full((batch,), s.decode_context, dtype=torch.int32, device=s.device)
    heads = engine.loaded.config.num_attention_heads
    q = torch.randn(batch, heads, layout.head_dim, device=s.device).to(layout.dtype)
    kc, vc = cache.key_caches[0], cache.value_caches[0]
    kv_bytes = batch * s.decode_context * layout.bytes_per_token_per_layer
    out = {"batch": batch, "context": s.decode_context, "kv_bytes_per_layer": kv_bytes}
    for tile in (16, 32, 64):
        for warps in (4, 8):
            t = time_ms(lambda: decode_triton(q, kc, vc, table, lens, None, tile, warps), s.device, s.decode_iters)  # noqa: B023
            out[f"tile{tile}_warps{warps}"] = {"us": round(t["ms_min"] * 1e3, 1), "gbps": round(kv_bytes / (t["ms_min"] / 1e3) / 1e9, 1),
                                              "fraction_of_hbm": round(kv_bytes / (t["ms_min"] / 1e3) / 1e9 / hbm_gbps, 3)}
    return out


def _weight_bytes_read(model: torch.nn.Module) -> int:
    """Every parameter is read once per step, except an untied input embedding (only B rows of it)."""
    total = models.weight_bytes(model)
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        total -= emb.numel() * emb.element_size()
    return total


def _decode_at(engine: Engine, batch: int, s: CheckSettings, weights: int, hbm_gbps: float) -> dict:
    seqs = correctness.prefilled(engine, batch, s.decode_context, s.decode_iters * 3 + 8)
    try:
        items = [ScheduledSeq(seq, 1).step_item() for seq in seqs]
        runner, dev = engine.runner, s.device
        timings = {}
        if runner.graphs is not None:
            rows = runner._decode_rows(items, runner.graphs.bucket(batch), runner.graphs.width)
            runner.graphs.run(rows)
            graph = runner.graphs._graphs[runner.graphs.bucket(batch)]
            timings["graph_replay"] = time_ms(graph.replay, dev, s.decode_iters)
            timings["runner_graph"] = time_ms(lambda: runner.execute(items), dev, s.decode_iters)
        timings.update(_eager_timings(runner, items, dev, s.decode_iters))
        kernels = None
        if dev.startswith("cuda") and batch == max(s.decode_batches):
            try:
                kernels = _kernel_times(runner, items)
            except Exception as exc:  # a measurement that explains, not one that gates
                kernels = {"error": f"{type(exc).__name__}: {exc}"}
        timings["engine_step"] = _engine_steps(engine, batch, s.decode_iters)
        kv = sum(seq.num_computed_tokens + 1 for seq in seqs) * engine.layout.bytes_per_token_per_layer * engine.layout.num_layers
        bound_ms = (weights + kv) / (hbm_gbps * 1e9) * 1e3
        fractions = {k: round(bound_ms / v["ms_median"], 3) for k, v in timings.items()}
        return {"kv_bytes_read": kv, "bound_ms": round(bound_ms, 4), "timings": timings, "fraction_of_bound": fractions,
                "tokens_per_s_engine": round(batch / timings["engine_step"]["ms_median"] * 1e3, 1), "eager_step_kernels": kernels}
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
        engine.step()


def _kernel_times(runner, items: list, top: int = 20) -> dict:
    """One eager decode step under torch's profiler: device time per kernel name (where a graph replay's time
    goes, since a replay hides its kernels), the launch count and the device's busy time."""
    from torch.profiler import ProfilerActivity, profile

    saved, runner.graphs = runner.graphs, None
    try:
        runner.execute(items)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.execute(items)
            torch.cuda.synchronize()
    finally:
        runner.graphs = saved
    per_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name.setdefault(event.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    return {"launches": sum(n for n, _ in per_name.values()), "busy_us": round(sum(t for _, t in per_name.values()), 1),
            "top": [{"kernel": name, "count": n, "us": round(t, 1)} for name, (n, t) in ranked[:top]]}


def _eager_timings(runner, items: list, device: str, iters: int) -> dict:
    """The same decode step without graphs, with each decode kernel (CPU runners have one path)."""
    if not runner.batched:
        return {"runner_eager_cpu_path": time_ms(lambda: runner.execute(items), device, iters)}
    saved, kernel, fn = runner.graphs, runner.decode_kernel, runner.decode_fn
    out = {}
    try:
        runner.graphs = None
        for name in ("triton", "torch"):
            if name == "triton" and kernel != "triton":
                continue
            runner.decode_kernel, runner.decode_fn = name, fn if name == kernel else paged_decode.KERNELS[name]
            out[f"runner_eager_{name}"] = time_ms(lambda: runner.execute(items), device, iters)
    finally:
        runner.graphs, runner.decode_kernel, runner.decode_fn = saved, kernel, fn
    return out


def _engine_steps(engine: Engine, batch: int, iters: int) -> dict:
    """Full `Engine.step()` (schedule, inputs, model, sample, bookkeeping): every step must decode the batch.
    `phases_ms` splits the mean step by wall clock, no sync added: `schedule`, `execute` (the runner's host
    time: on CUDA it launches and returns), `sample` (waits for the device, then reads the tokens) and
    `rest` (the engine's bookkeeping)."""
    phases = {"schedule": 0.0, "execute": 0.0, "sample": 0.0}
    wrapped = {"schedule": (engine.scheduler, "schedule"), "execute": (engine.runner, "execute"), "sample": (engine.sampler, "sample")}

    def timing(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - t0
        return timed

    for name, (owner, attr) in wrapped.items():
        setattr(owner, attr, timing(name, getattr(owner, attr)))
    times = []
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            outs = engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
            if sum(len(o.new_token_ids) for o in outs) != batch:
                raise RuntimeError("a timed engine step did not decode the whole batch")
    finally:
        for owner, attr in wrapped.values():
            delattr(owner, attr)
    sync("cuda" if torch.cuda.is_available() else "cpu")
    mean = statistics.mean(times)
    split = {name: round(total / iters * 1e3, 4) for name, total in phases.items()}
    split["rest"] = round(mean - sum(split.values()), 4)
    return {"ms_median": round(statistics.median(times), 4), "ms_min": round(min(times), 4), "iters": iters, "phases_ms": split}


# ---- (4) KV between two processes ----------------------------------------------------------------
def section_kv_transfer(m: Models) -> dict:
    """The big model's KV blocks (all layers, K and V) copied by a second process through CUDA IPC,
    against the device's own copy rate and the host-staged fallback's two copies."""
    s = m.s
    shape = models.LLAMA_1B if s.big_shape == "llama1b" else models.TINY
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    block_numel = 16 * shape["num_key_value_heads"] * head_dim * 2 * shape["num_hidden_layers"]
    dtype = models.DTYPES[s.big_dtype]
    m.hbm_gbps()
    memcpy = m.copy_rate["copy_gbps"]
    result = ipc.ipc_copy(s.device, s.kv_blocks, block_numel, dtype)
    staged = ipc.host_staged(s.device, result["bytes"])
    ordered = ipc.ipc_event_order(s.device) if s.device.startswith("cuda") else None
    return {
        "ipc": result, "host_staged": staged, "device_memcpy_gbps": memcpy, "ipc_event_order": ordered,
        "ipc_contiguous_over_memcpy": round(result["contiguous_gbps"] / memcpy, 3),
        "ipc_gather_over_memcpy": round(result["gather_gbps"] / memcpy, 3),
        "host_staged_over_memcpy": round(staged["staged_gbps"] / memcpy, 3),
        "note": "pdserve's workers use the tcp transport here (ucxx absent), i.e. the host-staged path; "
        "ipc is what a cuda_ipc transport would move between two processes on this device",
    }
