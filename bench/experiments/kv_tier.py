"""Experiment: from which prompt length loading evicted KV from the second tier beats computing it.

    python -m bench.experiments.kv_tier [--lengths 16 32 64 128 256 512 1024 2048] [--repeats 3] [--threads 1]

One engine (the demo model, float32, --threads torch threads) per tier kind, in this process. For each
prompt length L (a fresh random prompt per repeat, plus one token so L tokens are whole blocks): the
time to the first token (a) with nothing cached (every token computed: the baseline, same engine, same
run), then, after filler prompts pushed the prompt's blocks out of the pool, (b) with the blocks in the
tier (memory, disk): L tokens loaded, 1 computed. The loads are forced (`LoadRates` pinned to "load"), so
both sides are measured at every length. Reported: medians, the ratio computed/loaded per length and
kind, and the shortest length from which loading is faster. The engine's own choice follows the same
comparison at run time from the rates it measures (engine/kv_tier.py). Writes
bench/results/kv_tier.json and kv_tier.png.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.experiments import common

DEFAULT_LENGTHS = [16, 32, 64, 128, 256, 512, 1024, 2048]
BLOCK = 16


def first_token_s(engine, request_id: str, prompt: list[int]) -> float:
    from common.sampling import SamplingParams

    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    while engine.has_work():
        if any(out.new_token_ids for out in engine.step()):
            break
    seconds = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    return seconds


def measure(kind: str, lengths: list[int], repeats: int, threads: int, rng: np.random.Generator, dtype: str = "float32") -> dict[str, Any]:
    from common.engine_config import EngineConfig, KVTierConfig
    from engine import Engine

    longest = max(lengths) + 1
    pool_blocks = longest // BLOCK + 3  # one prompt's worth: two fillers evict the measured one
    tier = KVTierConfig(kind=kind, budget_mb=4096) if kind != "off" else KVTierConfig()
    engine = Engine(EngineConfig(model="smollm2-135m", dtype=dtype, num_threads=threads, num_kv_blocks=pool_blocks,
                                 max_model_len=longest + 8, max_num_batched_tokens=4096, kv_tier=tier))
    vocab = engine.vocab_size
    rows = {}
    try:
        first_token_s(engine, "warm", [int(t) for t in rng.integers(100, vocab, 64)])
        for length in lengths:
            computed, loaded = [], []
            for r in range(repeats):
                prompt = [int(t) for t in rng.integers(100, vocab, length + 1)]
                computed.append(first_token_s(engine, f"c{length}-{r}", prompt))
                if engine.tier is None:
                    continue
                for f in range(2):  # push the prompt's blocks out of the pool, into the tier
                    first_token_s(engine, f"f{length}-{r}-{f}", [int(t) for t in rng.integers(100, vocab, longest)])
                engine.tier.rates.load_s_per_block = None  # measure the load at every length
                before = engine.tier.stats.loaded_blocks
                loaded.append(first_token_s(engine, f"l{length}-{r}", prompt))
                assert engine.tier.stats.loaded_blocks - before == length // BLOCK, "the prompt should come back from the tier"
            rows[str(length)] = {"computed_s": statistics.median(computed), **({"loaded_s": statistics.median(loaded)} if loaded else {})}
    finally:
        engine.close()
    return rows


def crossover(rows: dict[str, dict[str, float]]) -> int | None:
    """The shortest length from which loading was faster at every longer length too."""
    faster = [int(n) for n, row in rows.items() if row["loaded_s"] < row["computed_s"]]
    lengths = sorted(int(n) for n in rows)
    for n in lengths:
        if all(m in faster for m in lengths if m >= n):
            return n
    return None


def plot(results: dict[str, Any]) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, rows in results.items():
        lengths = [int(n) for n in rows]
        ax.plot(lengths, [rows[str(n)]["loaded_s"] * 1000 for n in lengths], marker="o", label=f"loaded from {kind} tier")
        ax.plot(lengths, [rows[str(n)]["computed_s"] * 1000 for n in lengths], marker="x", linestyle="--", label=f"computed ({kind} run)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    common.style_axes([ax], "prompt tokens", "time to first token (ms)")
    ax.set_title("Evicted prefix: load from the second tier vs compute")
    return common.save_figure(fig, "kv_tier.png")


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "kv_tier")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", default=["memory", "disk"])
    parser.add_argument("--quick", action="store_true", help="two short lengths, one repeat, into bench/results/quick/")
    args = parser.parse_args(argv)
    if any(n % BLOCK for n in args.lengths):
        parser.error(f"--lengths: whole blocks of {BLOCK} tokens")
    if args.quick:
        args.lengths, args.repeats = [16, 64], 1
    info, started = common.begin(args.quick)
    rng = np.random.default_rng(0)
    results = {kind: measure(kind, args.lengths, args.repeats, args.threads, rng) for kind in args.kinds}
    report = {
        "experiment": "kv_tier", "command": common.command_line(), "machine": common.finish(info, started),
        "lengths": args.lengths, "repeats": args.repeats, "threads": args.threads, "dtype": "float32",
        "results": {kind: {n: {**row, "computed_over_loaded": row["computed_s"] / row["loaded_s"]} for n, row in rows.items()}
                    for kind, rows in results.items()},
        "loading_wins_from_tokens": {kind: crossover(rows) for kind, rows in results.items()},
    }
    report["plot"] = plot(results)
    common.save("kv_tier", report)
    print(report["loading_wins_from_tokens"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
