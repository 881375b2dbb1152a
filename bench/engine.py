"""Engine throughput: the pdserve engine against transformers on one seeded offline workload.

Usage: `python -m bench.engine [--dtype fp32,bf16] [--num-requests 64] [--seed 0] [--threads 1] [--out PATH] [--quick]`,
or `main(argv)` (what `pdserve bench engine` calls). Default output: bench/results/engine.json and
engine.png next to it.

`--dtype` lists the dtypes to run (default: what `engine.dtype: auto` resolves to on this machine,
common/hardware.py); the whole benchmark below runs once per dtype, the model loaded in that dtype
for every phase (engine, both transformers baselines, the ceilings). The JSON holds one section per
dtype under `by_dtype`, the settings and the machine (CPU model and features) once.

One workload (default: 64 requests, prompt lengths uniform in [64, 512] random token ids, output
lengths uniform in [32, 256], greedy, EOS ignored so that every request produces exactly its output
length) runs, in one process, through:

  engine          `engine.Engine`: all requests added at once, `step()` until done
  hf_static       transformers `generate` in static batches of 8 (left padding, `max_new_tokens` =
                  the batch's longest output); only each request's own output tokens count
  hf_continuous   transformers' own continuous batching (`init_continuous_batching`, per-request
                  `max_new_tokens`); by default on the first 16 requests only (see
                  `Settings.continuous_requests`: on CPU it slows down with the batch's total KV)
  engine_decode   the engine with a batch of 64 prefilled requests, timing decode steps only, each
                  followed by a step of
  matmul_ceiling  the model's forward on a batch of 64 single decode tokens with attention replaced
                  by a function that returns its query unchanged: only the matmuls (and norms) run
  prefill_ceiling the same attention-free forward on one 2048-token prompt chunk, run after each of the
                  engine's steps that prefilled at least half a chunk (its time kept off the engine's
                  clock; a workload of fewer such steps times it in a row after engine_decode)
The ceilings run with the engine (prefill between its steps, engine_decode and matmul_ceiling step by
step in turn), the transformers baselines after them, so that what the ratios divide is measured close
together in time.

`workload_ceiling` combines the two ceilings into the best useful tokens/s any engine could reach on
this workload here (every prompt token at the prefill ceiling, every output token at the decode
ceiling), and so the largest ratio over each baseline that is physically possible; `engine_over_bound`
is the engine's fraction of it. `memory_ceiling` (one thread's read bandwidth) prices what that bound
leaves out and no engine avoids, reading each decode token's cached K and V once: the bound plus that
read is `bound_with_kv_read`, and `engine_over_bound_with_kv_read` the engine's fraction of it.

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
import copy
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench.ceilings import (
    matmul_ceiling_forward,
    prefill_ceiling_forward,
    prefill_record,
    run_memory_ceiling,
    run_prefill_ceiling,
    step_record,
    workload_ceiling,
)
from bench.engine_report import plot, summary
from bench.engine_workload import Settings, Workload, make_workload
from bench.hf_baselines import hf_copy, pad_id, run_hf_continuous, run_hf_static
from bench.history import record
from bench.measure import Clock, Machine, current_rss_bytes, machine_record, peak_rss_bytes, progress_bar, token_rate
from common.hardware import auto_dtype
from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import DTYPES, LoadedModel, load_model

log = logging.getLogger("bench.engine")

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine.json"
SCALING_OUT = DEFAULT_OUT.with_name("engine_scaling.json")
TARGETS = {  # issue #17's acceptance, per dtype
    "float32": {"engine_over_bound": 0.8, "engine_decode_b64_over_ceiling": 0.7},
    "bfloat16": {"engine_over_bound": 0.7, "engine_over_hf_static": 6.0},
}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
__all__ = ["Settings", "Workload", "make_workload", "run", "run_dtypes", "run_hf_static", "run_hf_continuous", "hf_copy", "main"]


# ---- (a) the engine ------------------------------------------------------------------------------
def engine_config(s: Settings, loaded: LoadedModel, w: Workload, block_size: int = 16) -> EngineConfig:
    """A pool that holds the whole workload at once (no preemption), so the run measures compute."""
    blocks = sum(-(-(len(p) + o + 1) // block_size) for p, o in zip(w.prompts, w.output_lens))
    decode_phase = sum(-(-(len(w.prompts[i % len(w.prompts)]) + s.decode_steps + 64) // block_size) for i in range(s.decode_batch))
    blocks = max(blocks, decode_phase)
    return EngineConfig(
        model=loaded.path,
        dtype=dtype_name(loaded.dtype),
        block_size=block_size,
        num_kv_blocks=blocks + 16,
        max_num_seqs=max(128, len(w.prompts), s.decode_batch),
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.prompt_len[1] + max(s.output_len[1], s.decode_steps + 56) + 8,
        num_threads=s.threads,
    )


class PrefillCeiling:
    """The prefill ceiling's forward, run after each engine step that prefilled at least half a chunk, so that the
    two figures the bound's prefill part divides are measured in the same minutes of a machine whose speed drifts
    (three forwards in a row after the engine measured 310 and 406 tok/s in two runs of the same code). Its time
    is kept apart from the engine's clock."""

    def __init__(self, forward: Callable[[], None], tokens: int):
        self.forward, self.tokens = forward, tokens
        self.times: list[float] = []
        self.cpu_seconds = 0.0

    def after_step(self, prompt_tokens: int) -> None:
        """After an engine step that ran `prompt_tokens` prompt tokens."""
        if prompt_tokens * 2 < self.tokens:
            return
        clock = Clock()
        self.forward()
        wall, cpu = clock.stop()
        self.times.append(wall)
        self.cpu_seconds += cpu

    def record(self) -> dict | None:
        return prefill_record(self.tokens, self.times, interleaved=True) if len(self.times) >= 2 else None


def run_engine(engine: Engine, w: Workload, prefill_ceiling: PrefillCeiling | None = None) -> dict:
    warm_engine(engine, w)
    steps0, pre0 = engine.stats().steps, engine.stats().num_preemptions
    produced: dict[str, int] = {}
    with progress_bar("engine", w.useful_tokens) as bar:
        clock = Clock()
        for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens)):
            engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        prompt_tokens = engine.stats().prompt_tokens
        while engine.has_work():
            for out in engine.step():
                produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
            if prefill_ceiling is not None:
                before, prompt_tokens = prompt_tokens, engine.stats().prompt_tokens
                prefill_ceiling.after_step(prompt_tokens - before)
        wall, cpu = clock.stop()
    if prefill_ceiling is not None:
        wall, cpu = wall - sum(prefill_ceiling.times), cpu - prefill_ceiling.cpu_seconds
    expected = {f"bench-{i}": n for i, n in enumerate(w.output_lens)}
    if produced != expected:
        raise RuntimeError("engine did not produce exactly each request's output length")
    stats = engine.stats()
    return {**token_rate(w.useful_tokens, wall, cpu), "steps": stats.steps - steps0, "preemptions": stats.num_preemptions - pre0}


def warm_engine(engine: Engine, w: Workload) -> None:
    """One short request through the engine (kernels loaded, first-call costs paid), the prefix cache emptied after it."""
    engine.add_request("warmup", w.prompts[0][:32], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.blocks.reset_prefix_cache()


# ---- (e) engine decode-only at a fixed batch, step by step against (f) the matmul ceiling ----------
def run_engine_decode(engine: Engine, w: Workload, batch: int, steps: int, ceiling_model: torch.nn.Module) -> tuple[dict, dict]:
    """`batch` requests prefilled first; then only decode steps are timed (every step decodes all), each one
    followed by a timed step of the matmul ceiling (the attention-free forward of `ceiling_model` on a batch of
    the same size at the same mean position), so that the two figures the decode ratio divides are measured
    in the same seconds of a machine whose speed drifts. The prompts are the workload's, so after `run_engine`
    their full blocks come from the prefix cache and the untimed prefill is short; the timed steps read exactly
    the KV a fresh prefill would write. Returns (engine_decode, matmul_ceiling)."""
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
    ceiling = matmul_ceiling_forward(ceiling_model, batch, int(context + steps / 2), ceiling_model.config.vocab_size)
    times, cpu_times, ceiling_times, ceiling_cpu, contexts = [], [], [], [], []
    with progress_bar("engine decode vs matmul ceiling", steps, unit="step") as bar:
        for _ in range(steps):
            contexts.append(context)
            context += 1
            wall, cpu = time.perf_counter(), time.process_time()
            outs = engine.step()
            times.append(time.perf_counter() - wall)
            cpu_times.append(time.process_time() - cpu)
            if sum(len(o.new_token_ids) for o in outs) != batch:
                raise RuntimeError("a timed decode step did not decode the whole batch")
            wall, cpu = time.perf_counter(), time.process_time()
            ceiling()
            ceiling_times.append(time.perf_counter() - wall)
            ceiling_cpu.append(time.process_time() - cpu)
            bar.update(1)
    for i in range(batch):
        engine.abort(f"decode-{i}")
    engine.step()
    decode = {**step_record(batch, times, cpu_times), "mean_context_tokens": round(statistics.mean(contexts), 1)}
    return decode, step_record(batch, ceiling_times, ceiling_cpu)


# ---- the run -------------------------------------------------------------------------------------
def run_dtypes(s: Settings, loaded: LoadedModel | None = None) -> dict:
    """The whole benchmark once per dtype (the model loaded in it, or `loaded` cast to it): one record."""
    if s.threads:
        torch.set_num_threads(s.threads)
    by_dtype = {}
    for dtype in s.dtypes:
        model = in_dtype(loaded, dtype) if loaded is not None else load_model(s.model, dtype=dtype)
        by_dtype[dtype] = run(s, model)
        del model
    settings = [r.pop("settings") for r in by_dtype.values()][0]
    return {"benchmark": "engine", "dtypes": list(s.dtypes), "by_dtype": by_dtype, "settings": settings, "machine": machine_record()}


def in_dtype(loaded: LoadedModel, dtype: str) -> LoadedModel:
    """A copy of an in-memory model in `dtype` (tests; real runs load the model in each dtype)."""
    model = copy.deepcopy(loaded.model).to(DTYPES[dtype])
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, path=loaded.path, dtype=DTYPES[dtype])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run(s: Settings, loaded: LoadedModel) -> dict:
    """One dtype's section: every phase on `loaded` (and a transformers copy of it in the same dtype)."""
    config = loaded.config
    special = set(getattr(loaded.tokenizer, "all_special_ids", None) or [])
    w = make_workload(s, config.vocab_size, special)
    baseline = w.subset(s.baseline_requests) if s.baseline_requests else w
    continuous = w.subset(s.continuous_requests) if s.continuous_requests else w
    decode_batch = min(s.decode_batch, max(s.num_requests, 1)) if s.quick else s.decode_batch
    machine = Machine()
    result: dict = {"dtype": dtype_name(loaded.dtype)}

    engine = Engine(engine_config(s, loaded, w), loaded=loaded)
    # The ceilings on a separate transformers copy, measured with the engine (prefill: between its prefill steps;
    # decode: step by step in turn), not after the baselines: this VM's speed drifts.
    ceiling_model = hf_copy(loaded)
    prefill_ceiling = PrefillCeiling(prefill_ceiling_forward(ceiling_model, s.max_num_batched_tokens, config.vocab_size),
                                     s.max_num_batched_tokens)
    with machine.phase("engine"):
        result["engine"] = run_engine(engine, w, prefill_ceiling)
    result["engine"]["engine_config"] = asdict(engine.config)
    rss_after_engine = peak_rss_bytes()
    with machine.phase("engine_decode"):
        result["engine_decode"], result["matmul_ceiling"] = run_engine_decode(engine, w, decode_batch, s.decode_steps, ceiling_model)
    kv_bytes, kv_blocks = engine.kv_cache.nbytes, engine.kv_cache.num_blocks
    layout = engine.kv_cache.layout
    kv_bytes_per_token = layout.bytes_per_token_per_layer * layout.num_layers
    del engine
    result["prefill_ceiling"] = prefill_ceiling.record()
    if result["prefill_ceiling"] is None:  # a workload of less than two chunks' worth of prompts (--quick)
        with machine.phase("prefill_ceiling"):
            result["prefill_ceiling"] = run_prefill_ceiling(ceiling_model, s.max_num_batched_tokens, max(2, s.ceiling_iters // 3), config.vocab_size)
    del ceiling_model

    hf = hf_copy(loaded)
    pad = pad_id(loaded)
    with machine.phase("hf_static"):
        result["hf_static"] = run_hf_static(hf, baseline, s.hf_batch_size, pad)
    with machine.phase("hf_continuous"):
        result["hf_continuous"] = run_hf_continuous(hf, continuous, s.max_num_batched_tokens, pad)
    del hf
    with machine.phase("memory_ceiling"):
        result["memory_ceiling"] = run_memory_ceiling()

    result["workload_ceiling"] = workload_ceiling(result, w, kv_bytes_per_token)
    result["ratios"] = _ratios(result)
    result["ratios_cpu_time"] = _ratios(result, "tokens_per_cpu_s")
    targets = TARGETS.get(result["dtype"], TARGETS["bfloat16"])
    result["targets"] = {k: {"target": v, "measured": result["ratios"][k], "met": result["ratios"][k] >= v} for k, v in targets.items()}
    result["memory"] = {
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_rss_after_engine_bytes": rss_after_engine,
        "rss_at_end_bytes": current_rss_bytes(),
        "kv_pool_bytes": kv_bytes,
        "kv_pool_blocks": kv_blocks,
    }
    result["settings"] = _settings_record(s, w, baseline, continuous, decode_batch)
    result["load"] = machine.record()
    return result


def _ratios(r: dict, key: str = "tokens_per_s") -> dict:
    engine = r["engine"][key]
    return {
        "engine_over_hf_static": round(engine / r["hf_static"][key], 2),
        "engine_over_hf_continuous": round(engine / r["hf_continuous"][key], 2),
        "engine_decode_b64_over_ceiling": round(r["engine_decode"][key] / r["matmul_ceiling"][key], 3),
        "engine_over_bound": round(engine / r["workload_ceiling"]["useful_tokens_per_s"], 3),
        "engine_over_bound_with_kv_read": round(engine / r["workload_ceiling"]["bound_with_kv_read_tokens_per_s"], 3),
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


# ---- CLI -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[Settings, Path]:
    s, out, _ = parse_cli(argv)
    return s, out


def parse_cli(argv: list[str] | None) -> tuple[Settings, Path, argparse.Namespace | None]:
    """The settings, the output path and, with `--scaling`, the per-thread scaling run's options (else None)."""
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
    p.add_argument("--dtype", type=_dtypes, default=(auto_dtype("cpu"),),
                   help=f"comma-separated dtypes to run the whole benchmark in, e.g. fp32,bf16 (default here: {auto_dtype('cpu')}, "
                   "what engine.dtype: auto picks on this CPU)")
    p.add_argument("--scaling", action="store_true",
                   help="instead of the whole benchmark: the engine alone at each of --scaling-threads, one process per run "
                   "(bench/engine_scaling.py; default output bench/results/engine_scaling.json)")
    p.add_argument("--scaling-threads", type=_thread_counts, default=(1, 2), help="thread counts of --scaling (default 1,2)")
    p.add_argument("--scaling-rounds", type=int, default=2, help="rounds of --scaling, thread counts interleaved (default 2)")
    p.add_argument("--baseline-rev", default=None,
                   help="--scaling: also run this git revision (a worktree of it), alternating with this checkout in every round")
    a = p.parse_args(argv)
    if a.scaling and a.out == DEFAULT_OUT:
        a.out = SCALING_OUT
    if a.quick:
        s = Settings(
            model=a.model, num_requests=a.num_requests or 8, seed=a.seed, prompt_len=(8, 24), output_len=(4, 12),
            threads=a.threads or None, hf_batch_size=4, baseline_requests=a.baseline_requests,
            continuous_requests=a.continuous_requests or None, max_num_batched_tokens=64,
            decode_batch=8, decode_steps=a.decode_steps or 3, ceiling_iters=3, quick=True, dtypes=a.dtype,
        )
    else:
        s = Settings(
            model=a.model, num_requests=a.num_requests or 64, seed=a.seed, threads=a.threads or None,
            baseline_requests=a.baseline_requests, decode_steps=a.decode_steps or Settings.decode_steps,
            continuous_requests=Settings.continuous_requests if a.continuous_requests is None else (a.continuous_requests or None),
            dtypes=a.dtype,
        )
    return s, a.out, a if a.scaling else None


def _thread_counts(text: str) -> tuple[int, ...]:
    counts = tuple(sorted({int(n) for n in text.split(",") if n.strip()}))
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("--scaling-threads: comma-separated thread counts of at least 1, e.g. 1,2")
    return counts


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(DTYPE_ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--dtype: {', '.join(bad) or 'nothing'} is not one of fp32, bf16, fp16 ({', '.join(DTYPES)})")
    return tuple(dict.fromkeys(names))


def write_result(result: dict, out: Path) -> None:
    record(out, result, "engine")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings, out, scaling = parse_cli(argv)
    command = " ".join(["pdserve bench engine", *(sys.argv[1:] if argv is None else argv)])
    if scaling is not None:
        return run_scaling_cli(settings, out, scaling, command)
    result = {"command": " ".join(["pdserve bench engine", *(sys.argv[1:] if argv is None else argv)]), **run_dtypes(settings)}
    write_result(result, out)
    print(summary(result))
    print(f"wrote {out} and {plot(result, out.with_suffix('.png'))}")
    return 0


def run_scaling_cli(settings: Settings, out: Path, a: argparse.Namespace, command: str) -> int:
    """`--scaling`: the engine alone at each thread count (bench.engine_scaling), written through bench.history."""
    from bench.engine_scaling import run_scaling
    from bench.engine_scaling import summary as scaling_summary
    from common.model_files import resolve_model_path

    report = run_scaling(settings, str(resolve_model_path(settings.model)), a.scaling_threads, a.scaling_rounds, a.baseline_rev)
    report = {"benchmark": "engine_scaling", "command": command, **report, "workload": _settings_record_brief(settings), "machine": machine_record()}
    record(out, report, "engine_scaling")
    print(scaling_summary(report))
    print(f"wrote {out}")
    return 0


def _settings_record_brief(s: Settings) -> dict:
    return {"num_requests": s.num_requests, "seed": s.seed, "prompt_len": list(s.prompt_len), "output_len": list(s.output_len),
            "max_num_batched_tokens": s.max_num_batched_tokens, "sampling": "greedy, ignore_eos"}


if __name__ == "__main__":
    sys.exit(main())
