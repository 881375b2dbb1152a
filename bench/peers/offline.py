"""The offline half of the peer comparison: `pdserve bench engine`'s seeded workload through pdserve's `Engine`
and through `vllm.LLM.generate`, each in its own process, per dtype and thread count.

`export_workload` writes the workload (bench.engine_workload, seed 0: 64 requests of random prompt token ids and
output lengths) with the model's local directory to one JSON file both runners read. `run_offline` then, for
each dtype and each thread count, runs pdserve's runner (bench/peers/pdserve_offline.py, pdserve's python) and
the peer's (bench/peers/vllm_offline.py, the peer venv's python) one after the other, so that the two figures a
ratio divides are measured minutes apart. Both exclude model load, compilation and one identical warm-up
request, and time the whole batch: output tokens / wall seconds. pdserve's thread count is its engine's
`num_threads` (torch intra-op threads); vLLM's is its OpenMP binding (VLLM_CPU_OMP_THREADS_BIND, cores
0..n-1). Both are greedy in the same dtype, so their output tokens are compared too (`agreement`): a sanity
check that the two computed the same thing, not a correctness test (bf16 rounding may diverge late).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.engine_workload import Settings, make_workload
from bench.peers.install import REPO, PeerEnv
from bench.peers.serving import vllm_env

log = logging.getLogger("bench.peers")


def export_workload(s: Settings, model_dir: str, path: Path) -> dict[str, Any]:
    """The engine benchmark's workload for `s` (the model's vocabulary, special ids excluded) as JSON at `path`."""
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    w = make_workload(s, config.vocab_size, set(tokenizer.all_special_ids or []))
    work = {
        "model_dir": model_dir, "seed": s.seed, "max_model_len": s.prompt_len[1] + s.output_len[1] + 64,
        "settings": {"num_requests": s.num_requests, "seed": s.seed, "prompt_len": list(s.prompt_len), "output_len": list(s.output_len),
                     "max_num_batched_tokens": s.max_num_batched_tokens},
        "prompts": w.prompts, "output_lens": w.output_lens,
    }
    path.write_text(json.dumps(work))
    return work


def workload_record(work: dict[str, Any]) -> dict[str, Any]:
    return {**work["settings"], "total_prompt_tokens": sum(len(p) for p in work["prompts"]), "total_output_tokens": sum(work["output_lens"]),
            "sampling": "greedy, ignore_eos: every request produces exactly its output length"}


def runner_argv(runner: str, peer: PeerEnv, workload: Path, result: Path, dtype: str, threads: int) -> list[str]:
    tail = [str(workload), str(result), "--dtype", dtype, "--threads", str(threads)]
    if runner == "vllm":
        return [str(peer.python), str(REPO / "bench" / "peers" / "vllm_offline.py"), *tail]
    return [sys.executable, "-m", "bench.peers.pdserve_offline", *tail]


def run_runner(runner: str, peer: PeerEnv, workload: Path, workdir: Path, dtype: str, threads: int) -> dict[str, Any]:
    """One runner process; its result JSON (the runner's log kept beside it)."""
    result = workdir / f"{runner}_{dtype}_{threads}t.json"
    log_path = result.with_suffix(".log")
    env = {**os.environ, **(vllm_env(peer, threads) if runner == "vllm" else {"HF_HUB_OFFLINE": "1"})}
    started = time.time()
    with open(log_path, "w") as out:
        done = subprocess.run(runner_argv(runner, peer, workload, result, dtype, threads), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_path.read_text().splitlines()[-15:]
        raise RuntimeError(f"{runner} {dtype} {threads} thread(s) failed ({done.returncode}); {log_path}:\n" + "\n".join(tail))
    record = json.loads(result.read_text())
    record["process_s"] = round(time.time() - started, 1)
    log.info("offline %s %s %dt: %.1f tok/s", runner, dtype, threads, record["tokens_per_s"])
    return record


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two runs' greedy outputs agree: requests identical, and the mean share of each output before the first
    differing token."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return {"identical_requests": same / max(len(a), 1), "mean_common_prefix": sum(prefix) / max(len(prefix), 1)}


def run_offline(peer: PeerEnv, workload: Path, workdir: Path, dtypes: list[str], threads: list[int]) -> list[dict[str, Any]]:
    """One row per (dtype, threads): both runners' figures and pdserve / vLLM."""
    rows = []
    for dtype in dtypes:
        for n in threads:
            ours = run_runner("pdserve", peer, workload, workdir, dtype, n)
            peer_run = run_runner("vllm", peer, workload, workdir, dtype, n)
            rows.append(offline_row(dtype, n, ours, peer_run))
    return rows


def offline_row(dtype: str, threads: int, ours: dict[str, Any], peer_run: dict[str, Any]) -> dict[str, Any]:
    match = agreement(ours.pop("output_token_ids"), peer_run.pop("output_token_ids"))
    return {"dtype": dtype, "threads": threads, "pdserve": ours, "vllm": peer_run,
            "pdserve_over_vllm": round(ours["tokens_per_s"] / peer_run["tokens_per_s"], 3), "agreement": match}
