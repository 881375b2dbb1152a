"""pdserve's side of the offline comparison, one process per (dtype, threads), the mirror of vllm_offline.py:

    python -m bench.peers.pdserve_offline WORKLOAD.json RESULT.json --dtype float32 --threads 1

Lifecycle: read the exported workload, load the model in `dtype` and build `engine.Engine` with the engine
benchmark's own config for it (bench.engine.engine_config: a pool that holds the whole workload), untimed; run
the same warm-up request as the peer's runner (the first prompt's first 32 tokens, 4 output tokens), then time
adding every request and stepping until done, and write tokens/s of wall time and the output token ids.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from bench.engine import engine_config
from bench.engine_workload import Settings, Workload
from engine import Engine, SamplingParams
from engine.model_loader import load_model


def settings_of(work: dict, threads: int) -> Settings:
    s = work["settings"]
    return Settings(num_requests=s["num_requests"], seed=s["seed"], prompt_len=tuple(s["prompt_len"]),
                    output_len=tuple(s["output_len"]), max_num_batched_tokens=s["max_num_batched_tokens"], threads=threads)


def run(work: dict, dtype: str, threads: int) -> dict:
    import torch

    t_load = time.perf_counter()
    loaded = load_model(work["model_dir"], dtype=dtype)
    w = Workload(work["prompts"], work["output_lens"])
    engine = Engine(engine_config(settings_of(work, threads), loaded, w), loaded=loaded)
    load_s = time.perf_counter() - t_load
    engine.add_request("warmup", w.prompts[0][:32], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_work():
        engine.step()
    engine.blocks.reset_prefix_cache()
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(w.prompts))}
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ids = [tokens[f"r{i}"] for i in range(len(w.prompts))]
    if [len(t) for t in ids] != w.output_lens:
        raise SystemExit("pdserve did not produce exactly each request's output length")
    config = asdict(engine.config)
    return {
        "runner": "pdserve", "dtype": dtype, "threads": threads, "tokens": w.useful_tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(w.useful_tokens / wall, 2), "cpu_s": round(cpu, 3), "load_s": round(load_s, 1),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "config": {k: config[k] for k in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "num_threads") if k in config},
        "output_token_ids": ids,
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.pdserve_offline")
    p.add_argument("workload")
    p.add_argument("result")
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args()
    result = run(json.loads(open(a.workload).read()), a.dtype, a.threads)
    with open(a.result, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
