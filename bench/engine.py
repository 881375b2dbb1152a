"""Engine throughput: the pdserve engine against transformers on one seeded offline workload.

Usage: `python -m bench.engine [--num-requests 64] [--seed 0] [--threads 1] [--out PATH] [--quick]`,
or `main(argv)` (what `pdserve bench engine` calls). Default output: bench/results/engine.json.

One workload (default: 64 requests, prompt lengths uniform in [64, 512] random token ids, output
lengths uniform in [32, 256], greedy, EOS ignored so that every request produces exactly its output
length) runs, in one process and one after the other, through:

  engine          `engine.Engine`: all requests added at once, `step()` until done
  hf_static       transformers `generate` in static batches of 8 (left padding, `max_new_tokens` =
                  the batch's longest output); only each request's own output tokens count
  hf_continuous   transformers' own continuous batching (`init_continuous_batching`, per-request
                  `max_new_tokens`); by default on the first 16 requests only (see
                  `Settings.continuous_requests`: on CPU it slows down with the batch's total KV)
  engine_decode   the engine with a batch of 64 prefilled requests, timing decode steps only
  matmul_ceiling  the model's forward on a batch of 64 single decode tokens with attention replaced
                  by a function that returns its query unchanged: only the matmuls (and norms) run
  prefill_ceiling the same attention-free forward on one 2048-token prompt chunk

`workload_ceiling` combines the two ceilings into the best useful tokens/s any engine could reach on
this workload here (every prompt token at the prefill ceiling, every output token at the decode
ceiling), and so the largest ratio over each baseline that is physically possible.

Both transformers baselines use a separately loaded copy of the model with transformers' default
attention (the Engine switches its own instance to its paged attention). Every figure is useful
output tokens per second of wall time (`ratios`, which the targets are judged on), and also per
CPU-second of this process (`ratios_cpu_time`: with `--threads 1` it barely moves when neighbours
take CPU, so it tells what a busy machine hid). The JSON holds the ratios the design targets, the peak RSS,
the KV pool size, the settings, the torch thread count and how busy the rest of the machine was
during each phase (CPU cores used by other processes, from /proc/stat), since on a small shared VM
a neighbour's burst changes every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import LoadedModel, load_model

log = logging.getLogger("bench.engine")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine.json"
NOATTN_IMPLEMENTATION = "pdserve_noattn"
TARGETS = {"engine_over_hf_static": 6.0, "engine_over_hf_continuous": 6.0, "engine_decode_b64_over_ceiling": 0.5}


# ---- settings and workload -----------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    model: str = "smollm2-135m"
    num_requests: int = 64
    seed: int = 0
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    threads: int | None = None
    hf_batch_size: int = 8
    baseline_requests: int | None = None
    """Run transformers' static batching on the first N requests only (None: all of them)."""
    continuous_requests: int | None = 16
    """Run transformers' continuous batching on the first N requests only (None: all of them). Its CPU
    path attends every packed token to the KV of the whole batch (a dense mask, KV heads repeated), so
    its cost per token grows with the batch: all 64 default requests take well over an hour here,
    and a subset flatters it, which makes the engine's ratio against it conservative."""
    max_num_batched_tokens: int = 2048
    decode_batch: int = 64
    decode_steps: int = 16
    ceiling_iters: int = 10
    quick: bool = False


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def subset(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(s: Settings, vocab_size: int, special_ids: set[int]) -> Workload:
    rng = random.Random(s.seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [[rng.choice(allowed) for _ in range(rng.randint(*s.prompt_len))] for _ in range(s.num_requests)]
    outputs = [rng.randint(*s.output_len) for _ in range(s.num_requests)]
    return Workload(prompts, outputs)


# ---- measurement helpers -------------------------------------------------------------------------
class Machine:
    """How busy the rest of the machine was while a phase ran, from /proc/stat: CPU cores used by other
    processes and cores' worth of time the hypervisor gave to other guests (steal)."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}

    @staticmethod
    def _cpu_seconds() -> tuple[float, float] | None:
        """(busy, steal) seconds summed over all CPUs since boot."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        fields += [0] * (8 - len(fields))
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        tick = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq) / tick, steal / tick

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cpu0, wall0, own0 = self._cpu_seconds(), time.perf_counter(), _own_cpu_seconds()
        load0 = os.getloadavg()[0]
        try:
            yield
        finally:
            wall = time.perf_counter() - wall0
            own = _own_cpu_seconds() - own0
            cpu1 = self._cpu_seconds()
            other = steal = None
            if cpu0 is not None and cpu1 is not None:
                other = round(max(0.0, (cpu1[0] - cpu0[0] - own) / wall), 2)
                steal = round((cpu1[1] - cpu0[1]) / wall, 2)
            self.phases[name] = {
                "wall_s": round(wall, 3),
                "own_cpu_cores": round(own / wall, 2),
                "other_processes_cpu_cores": other,
                "hypervisor_steal_cores": steal,
                "loadavg_1m_start": round(load0, 2),
                "loadavg_1m_end": round(os.getloadavg()[0], 2),
            }


def _own_cpu_seconds() -> float:
    return time.process_time()  # all threads of this process


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Clock:
    """Wall time and this process's CPU time (all threads) of a timed region."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _own_cpu_seconds()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, _own_cpu_seconds() - self.cpu


def _rate(tokens: int, wall: float, cpu: float) -> dict:
    """tokens/s of wall time (the figure) and tokens per CPU-second of this process: with one torch
    thread the latter hardly moves when other processes take CPU, so it shows what a busy machine hid."""
    return {
        "useful_tokens": tokens,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "tokens_per_cpu_s": round(tokens / max(cpu, 1e-9), 2),
    }


def _bar(desc: str, total: int, unit: str = "tok") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True)


# ---- models --------------------------------------------------------------------------------------
def hf_copy(loaded: LoadedModel) -> torch.nn.Module:
    """A second instance of the model with transformers' default attention (sdpa)."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(loaded.path):
        return AutoModelForCausalLM.from_pretrained(loaded.path, dtype=loaded.dtype, attn_implementation="sdpa").eval()
    model = loaded.model
    config = type(model.config).from_dict(model.config.to_dict())
    config._attn_implementation = "sdpa"
    clone = type(model)(config).to(loaded.dtype).eval()
    clone.load_state_dict(model.state_dict())
    clone.generation_config = model.generation_config
    return clone


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention 'disabled': hand the query back in the [batch, tokens, heads, dim] layout HF expects."""
    return query.transpose(1, 2), None


def _register_no_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NOATTN_IMPLEMENTATION, _no_attention)
    AttentionMaskInterface.register(NOATTN_IMPLEMENTATION, lambda *a, **k: None)
    return NOATTN_IMPLEMENTATION


def _pad_id(loaded: LoadedModel) -> int:
    tok = loaded.tokenizer
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


# ---- (a) the engine ------------------------------------------------------------------------------
def engine_config(s: Settings, loaded: LoadedModel, w: Workload, block_size: int = 16) -> EngineConfig:
    """A pool that holds the whole workload at once (no preemption), so the run measures compute."""
    blocks = sum(-(-(len(p) + o + 1) // block_size) for p, o in zip(w.prompts, w.output_lens))
    decode_phase = sum(-(-(len(w.prompts[i % len(w.prompts)]) + s.decode_steps + 64) // block_size) for i in range(s.decode_batch))
    blocks = max(blocks, decode_phase)
    return EngineConfig(
        model=loaded.path,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[loaded.dtype],
        block_size=block_size,
        num_kv_blocks=blocks + 16,
        max_num_seqs=max(128, len(w.prompts), s.decode_batch),
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.prompt_len[1] + max(s.output_len[1], s.decode_steps + 56) + 8,
        num_threads=s.threads,
    )


def run_engine(engine: Engine, w: Workload) -> dict:
    _warm_engine(engine, w)
    steps0, pre0 = engine.stats().steps, engine.stats().num_preemptions
    produced: dict[str, int] = {}
    with _bar("engine", w.useful_tokens) as bar:
        clock = Clock()
        for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens)):
            engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        while engine.has_work():
            for out in engine.step():
                produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
        wall, cpu = clock.stop()
    expected = {f"bench-{i}": n for i, n in enumerate(w.output_lens)}
    if produced != expected:
        raise RuntimeError("engine did not produce exactly each request's output length")
    stats = engine.stats()
    return {**_rate(w.useful_tokens, wall, cpu), "steps": stats.steps - steps0, "preemptions": stats.num_preemptions - pre0}


def _warm_engine(engine: Engine, w: Workload) -> None:
    engine.add_request("warmup", w.prompts[0][:32], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.blocks.reset_prefix_cache()


# ---- (e) engine decode-only at a fixed batch -----------------------------------------------------
def run_engine_decode(engine: Engine, w: Workload, batch: int, steps: int) -> dict:
    """`batch` requests prefilled first; then only decode steps are timed (every step decodes all).
    The prompts are the workload's, so after `run_engine` their full blocks come from the prefix cache
    and the untimed prefill is short; the timed steps read exactly the KV a fresh prefill would write."""
    prompts = [w.prompts[i % len(w.prompts)] for i in range(batch)]
    budget = engine.config.max_num_batched_tokens
    prefill_steps = -(-sum(len(p) for p in prompts) // max(budget - batch, 1)) + 2  # early finishers decode meanwhile
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{i}", prompt, SamplingParams(max_tokens=prefill_steps + steps + 4, ignore_eos=True))
    produced: dict[str, int] = {}
    while len(produced) < batch:  # prefill; each request samples its first token when its prompt is done
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
    engine.step()  # one untimed decode step
    context = sum(len(p) for p in prompts) / batch + sum(produced.values()) / batch + 1
    times, contexts = [], []
    clock = Clock()
    with _bar("engine decode", steps, unit="step") as bar:
        for _ in range(steps):
            contexts.append(context)
            context += 1
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            if sum(len(o.new_token_ids) for o in outs) != batch:
                raise RuntimeError("a timed decode step did not decode the whole batch")
            bar.update(1)
    _, cpu = clock.stop()
    for i in range(batch):
        engine.abort(f"decode-{i}")
    engine.step()
    return {
        "batch": batch,
        "steps": steps,
        "mean_context_tokens": round(statistics.mean(contexts), 1),
        "step_ms_median": round(statistics.median(times) * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_s": round(batch * steps / sum(times), 2),
        "tokens_per_s_median_step": round(batch / statistics.median(times), 2),
        "tokens_per_cpu_s": round(batch * steps / max(cpu, 1e-9), 2),
    }


# ---- (b) transformers generate, static batches ---------------------------------------------------
@torch.inference_mode()
def run_hf_static(model: torch.nn.Module, w: Workload, batch_size: int, pad_id: int) -> dict:
    _hf_generate(model, [w.prompts[0][:32]], 4, pad_id)  # warm-up
    generated = 0
    with _bar("hf static", w.useful_tokens) as bar:
        clock = Clock()
        for b in range(0, len(w.prompts), batch_size):
            prompts, outs = w.prompts[b : b + batch_size], w.output_lens[b : b + batch_size]
            new = _hf_generate(model, prompts, max(outs), pad_id)
            if new != max(outs):
                raise RuntimeError(f"generate produced {new} tokens, expected {max(outs)}")
            generated += new * len(prompts)
            bar.update(sum(outs))
        wall, cpu = clock.stop()
    return {**_rate(w.useful_tokens, wall, cpu), "batch_size": batch_size, "generated_tokens_incl_padding": generated}


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_new: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # EOS ignored: every row runs to the batch's longest output
        do_sample=False,
        pad_token_id=pad_id,
    )
    return out.shape[1] - width


# ---- (c) transformers continuous batching --------------------------------------------------------
@torch.inference_mode()
def run_hf_continuous(model: torch.nn.Module, w: Workload, max_batch_tokens: int, pad_id: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    pages = sum(-(-(len(p) + o + 1) // page) for p, o in zip(w.prompts, w.output_lens)) + 4
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_lens), eos_token_id=-1, pad_token_id=pad_id)
    page_field = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"  # < 5.20: block_size
    cb = ContinuousBatchingConfig(**{page_field: page}, num_blocks=pages, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        _cb_generate(manager, [w.prompts[0][:32]], [4], "warmup", None)
        with _bar("hf continuous", w.useful_tokens) as bar:
            clock = Clock()
            lengths = _cb_generate(manager, w.prompts, w.output_lens, "bench", bar)
            wall, cpu = clock.stop()
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    if lengths != w.output_lens:
        raise RuntimeError("transformers continuous batching did not produce each request's output length")
    return {**_rate(w.useful_tokens, wall, cpu), "page_size": page, "num_pages": pages, "max_batch_tokens": max_batch_tokens}


def _cb_generate(manager, prompts: list[list[int]], outs: list[int], prefix: str, bar: tqdm | None) -> list[int]:
    for i, (p, n) in enumerate(zip(prompts, outs)):
        manager.add_request(p, request_id=f"{prefix}-{i}", max_new_tokens=n, eos_token_id=-1)
    lengths: dict[str, int] = {}
    while len(lengths) < len(prompts):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching stopped before finishing")
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers continuous batching failed: {result.error}")
        if result.is_finished():
            lengths[result.request_id] = len(result.generated_tokens)
            if bar is not None:
                bar.update(len(result.generated_tokens))
    return [lengths[f"{prefix}-{i}"] for i in range(len(prompts))]


# ---- (d) the matmul ceiling ----------------------------------------------------------------------
@torch.inference_mode()
def run_matmul_ceiling(model: torch.nn.Module, batch: int, iters: int, position: int, vocab_size: int) -> dict:
    model.set_attn_implementation(_register_no_attention())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, 1), generator=gen)
    positions = torch.full((batch, 1), position, dtype=torch.long)
    for _ in range(2):
        model(input_ids=ids, position_ids=positions, use_cache=False)
    times = []
    clock = Clock()
    for _ in tqdm(range(iters), desc="matmul ceiling", unit="fwd", file=sys.stderr, dynamic_ncols=True):
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=positions, use_cache=False)
        times.append(time.perf_counter() - t0)
    _, cpu = clock.stop()
    median = statistics.median(times)
    return {
        "batch": batch,
        "iters": iters,
        "step_ms_median": round(median * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "tokens_per_s": round(batch / median, 2),
        "tokens_per_cpu_s": round(batch * iters / max(cpu, 1e-9), 2),
    }


@torch.inference_mode()
def run_prefill_ceiling(model: torch.nn.Module, tokens: int, iters: int, vocab_size: int) -> dict:
    """The same attention-free forward on one packed prompt chunk of `tokens` tokens (logits of the last
    only): the most prompt tokens per second any engine gets out of these matmuls."""
    model.set_attn_implementation(_register_no_attention())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=gen)
    positions = torch.arange(tokens).unsqueeze(0)
    model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    times = []
    for _ in tqdm(range(iters), desc="prefill ceiling", unit="fwd", file=sys.stderr, dynamic_ncols=True):
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"tokens": tokens, "iters": iters, "step_ms_median": round(median * 1e3, 2), "tokens_per_s": round(tokens / median, 2)}


# ---- the run -------------------------------------------------------------------------------------
def run(s: Settings, loaded: LoadedModel | None = None) -> dict:
    if s.threads:
        torch.set_num_threads(s.threads)
    loaded = loaded or load_model(s.model)
    config = loaded.config
    special = set(getattr(loaded.tokenizer, "all_special_ids", None) or [])
    w = make_workload(s, config.vocab_size, special)
    baseline = w.subset(s.baseline_requests) if s.baseline_requests else w
    continuous = w.subset(s.continuous_requests) if s.continuous_requests else w
    decode_batch = min(s.decode_batch, max(s.num_requests, 1)) if s.quick else s.decode_batch
    machine = Machine()
    result: dict = {"benchmark": "engine"}

    engine = Engine(engine_config(s, loaded, w), loaded=loaded)
    with machine.phase("engine"):
        result["engine"] = run_engine(engine, w)
    result["engine"]["engine_config"] = asdict(engine.config)
    rss_after_engine = _peak_rss_bytes()
    with machine.phase("engine_decode"):
        result["engine_decode"] = run_engine_decode(engine, w, decode_batch, s.decode_steps)
    kv_bytes, kv_blocks = engine.kv_cache.nbytes, engine.kv_cache.num_blocks
    del engine

    hf = hf_copy(loaded)
    pad = _pad_id(loaded)
    with machine.phase("hf_static"):
        result["hf_static"] = run_hf_static(hf, baseline, s.hf_batch_size, pad)
    with machine.phase("hf_continuous"):
        result["hf_continuous"] = run_hf_continuous(hf, continuous, s.max_num_batched_tokens, pad)
    mean_ctx = int(result["engine_decode"]["mean_context_tokens"])
    with machine.phase("matmul_ceiling"):
        result["matmul_ceiling"] = run_matmul_ceiling(hf, decode_batch, s.ceiling_iters, mean_ctx, config.vocab_size)
    with machine.phase("prefill_ceiling"):
        result["prefill_ceiling"] = run_prefill_ceiling(hf, s.max_num_batched_tokens, max(2, s.ceiling_iters // 3), config.vocab_size)
    del hf

    result["ratios"] = _ratios(result)
    result["ratios_cpu_time"] = _ratios(result, "tokens_per_cpu_s")
    result["workload_ceiling"] = _workload_ceiling(result, w)
    result["targets"] = {k: {"target": v, "measured": result["ratios"][k], "met": result["ratios"][k] >= v} for k, v in TARGETS.items()}
    result["memory"] = {
        "peak_rss_bytes": _peak_rss_bytes(),
        "peak_rss_after_engine_bytes": rss_after_engine,
        "rss_at_end_bytes": _current_rss_bytes(),
        "kv_pool_bytes": kv_bytes,
        "kv_pool_blocks": kv_blocks,
    }
    result["settings"] = _settings_record(s, w, baseline, continuous, decode_batch)
    result["machine"] = _machine_record(machine)
    return result


def _ratios(r: dict, key: str = "tokens_per_s") -> dict:
    engine = r["engine"][key]
    return {
        "engine_over_hf_static": round(engine / r["hf_static"][key], 2),
        "engine_over_hf_continuous": round(engine / r["hf_continuous"][key], 2),
        "engine_decode_b64_over_ceiling": round(r["engine_decode"][key] / r["matmul_ceiling"][key], 3),
    }


def _workload_ceiling(r: dict, w: Workload) -> dict:
    """What no engine gets past on this machine: every prompt token at the prefill ceiling's rate and
    every output token at the batch-64 decode ceiling's, attention free (decode at the smaller batches
    of a run's tail is slower still, so this bound is generous)."""
    prompt_tokens = sum(len(p) for p in w.prompts)
    seconds = prompt_tokens / r["prefill_ceiling"]["tokens_per_s"] + w.useful_tokens / r["matmul_ceiling"]["tokens_per_s"]
    best = w.useful_tokens / seconds
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": w.useful_tokens,
        "seconds": round(seconds, 2),
        "useful_tokens_per_s": round(best, 2),
        "engine_fraction": round(r["engine"]["tokens_per_s"] / best, 3),
        "engine_fraction_cpu_time": round(r["engine"]["tokens_per_cpu_s"] / best, 3),
        "max_possible_over_hf_static": round(best / r["hf_static"]["tokens_per_s"], 2),
        "max_possible_over_hf_continuous": round(best / r["hf_continuous"]["tokens_per_s"], 2),
    }


def _settings_record(s: Settings, w: Workload, baseline: Workload, continuous: Workload, decode_batch: int) -> dict:
    rec = asdict(s)
    rec.update(
        decode_batch=decode_batch,
        total_prompt_tokens=sum(len(p) for p in w.prompts),
        total_output_tokens=w.useful_tokens,
        hf_static_num_requests=len(baseline.prompts),
        hf_continuous_num_requests=len(continuous.prompts),
        baseline_note="; ".join(
            f"{name} ran on the same {len(w.prompts)} requests as the engine"
            if len(sub.prompts) == len(w.prompts)
            else f"{name} ran on the first {len(sub.prompts)} of the {len(w.prompts)} requests (tokens/s compared)"
            for name, sub in (("hf_static", baseline), ("hf_continuous", continuous))
        ),
        sampling="greedy, ignore_eos (every request produces exactly its output length)",
        prompt_tokens="uniform random ids from the vocabulary, special tokens excluded",
    )
    return rec


def _machine_record(machine: Machine) -> dict:
    import transformers

    return {
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "phases": machine.phases,
        "load_note": _load_note(machine.phases),
    }


def _load_note(phases: dict[str, dict]) -> str:
    parts = [
        f"{name} {p['other_processes_cpu_cores']}+{p['hypervisor_steal_cores']}"
        for name, p in phases.items()
        if p["other_processes_cpu_cores"] is not None
    ]
    busiest = max(
        ((p["other_processes_cpu_cores"] or 0) + (p["hypervisor_steal_cores"] or 0) for p in phases.values()), default=0.0
    )
    verdict = "the machine was quiet" if busiest <= 0.25 else "figures of the busier phases are pessimistic (see tokens_per_cpu_s)"
    return f"CPU cores taken by other processes + hypervisor steal during each phase: {', '.join(parts) or 'unknown'}; {verdict}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---- CLI -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[Settings, Path]:
    p = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads for every phase (default 1: on a small shared VM a second OpenMP thread turns "
        "every parallel op into a wait for a descheduled core; use 2 only on a quiet machine; 0: torch's default)",
    )
    p.add_argument("--baseline-requests", type=int, default=None, help="run transformers' static batching on the first N requests only")
    p.add_argument(
        "--continuous-requests", type=int, default=None,
        help="run transformers' continuous batching on the first N requests only (default 16; 0: all)",
    )
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="small smoke run: 8 short requests, decode batch 8")
    a = p.parse_args(argv)
    if a.quick:
        s = Settings(
            model=a.model, num_requests=a.num_requests or 8, seed=a.seed, prompt_len=(8, 24), output_len=(4, 12),
            threads=a.threads or None, hf_batch_size=4, baseline_requests=a.baseline_requests,
            continuous_requests=a.continuous_requests or None, max_num_batched_tokens=64,
            decode_batch=8, decode_steps=a.decode_steps or 3, ceiling_iters=3, quick=True,
        )
    else:
        s = Settings(
            model=a.model, num_requests=a.num_requests or 64, seed=a.seed, threads=a.threads or None,
            baseline_requests=a.baseline_requests, decode_steps=a.decode_steps or Settings.decode_steps,
            continuous_requests=Settings.continuous_requests if a.continuous_requests is None else (a.continuous_requests or None),
        )
    return s, a.out


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def summary(r: dict) -> str:
    lines = [
        f"engine            {r['engine']['tokens_per_s']:9.1f} tok/s",
        f"hf static         {r['hf_static']['tokens_per_s']:9.1f} tok/s",
        f"hf continuous     {r['hf_continuous']['tokens_per_s']:9.1f} tok/s",
        f"engine decode b{r['engine_decode']['batch']:<3}{r['engine_decode']['tokens_per_s']:9.1f} tok/s",
        f"matmul ceiling    {r['matmul_ceiling']['tokens_per_s']:9.1f} tok/s (decode batch {r['matmul_ceiling']['batch']})",
        f"prefill ceiling   {r['prefill_ceiling']['tokens_per_s']:9.1f} tok/s (prompt tokens, {r['prefill_ceiling']['tokens']}-token chunk)",
    ]
    for name, t in r["targets"].items():
        lines.append(
            f"{name:32s} {t['measured']:7.3f}  (target >= {t['target']}: {'met' if t['met'] else 'NOT met'}; "
            f"per CPU-second {r['ratios_cpu_time'][name]:.3f})"
        )
    c = r["workload_ceiling"]
    lines.append(
        f"workload at the matmul ceiling   {c['useful_tokens_per_s']:7.1f} tok/s (engine reaches {c['engine_fraction']:.0%}; "
        f"at most {c['max_possible_over_hf_static']:.1f}x hf static, {c['max_possible_over_hf_continuous']:.1f}x hf continuous)"
    )
    lines.append(r["machine"]["load_note"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings, out = parse_args(argv)
    result = run(settings)
    write_result(result, out)
    print(summary(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
