"""The peer's side of the offline comparison, run with the peer's own python (never pdserve's):

    <venv>/bin/python bench/peers/vllm_offline.py WORKLOAD.json RESULT.json --dtype float32 --threads 1

It imports only vLLM and the standard library. Lifecycle: read the workload (prompt token ids, output lengths),
build `vllm.LLM` on the local model directory (load, and whatever compilation vLLM does, untimed), run one
short warm-up request (the first prompt's first 32 tokens, 4 output tokens: the same warm-up as pdserve's
runner), then time one `LLM.generate` over every request (token-id prompts, greedy, exactly n output tokens,
no detokenization: pdserve's engine does not detokenize either) and write tokens/s of wall time, the output
token ids and the effective scheduler settings. The caller sets the thread binding and KV space in the
environment (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE) before starting it.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("result")
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args()
    work = json.loads(open(a.workload).read())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_load = time.perf_counter()
    llm = LLM(model=work["model_dir"], tokenizer=work["model_dir"], dtype=a.dtype, seed=work["seed"],
              max_model_len=work["max_model_len"], disable_log_stats=True)
    load_s = time.perf_counter() - t_load

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)

    prompts, lens = work["prompts"], work["output_lens"]
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:32])], [params(4)], use_tqdm=False)
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], [params(n) for n in lens], use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if [len(t) for t in tokens] != lens:
        raise SystemExit("vLLM did not produce exactly each request's output length")
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {
        "runner": "vllm", "dtype": a.dtype, "threads": a.threads, "tokens": sum(lens), "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(lens) / wall, 2), "frontend_cpu_s": round(time.process_time() - cpu0, 3), "load_s": round(load_s, 1),
        "version": vllm.__version__, "torch": __import__("torch").__version__,
        "config": {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
                   **{k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")}},
        "output_token_ids": tokens,
    }
    with open(a.result, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
