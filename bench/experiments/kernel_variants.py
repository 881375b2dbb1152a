"""Experiment: the CPU kernels' memory choices against the alternatives, built side by side.

    python -m bench.experiments.kernel_variants [--threads 1] [--rounds 12] [--variants a,b] [--against REV] [--quick]

Three choices in engine/kernels decide how long a kernel waits on memory (the arithmetic, and so every
output bit, is the same either way):
  prefetch_line   (vector.h) the kernels request what the hardware prefetchers do not foresee into L2
                  (prefetcht1), not L1 (prefetcht0): paged_attention.cpp a row's K/V rows kKeysAhead
                  keys ahead, small_matmul.cpp the next block of weight rows;
  with_tiles      (paged_attention.cpp) a task of few queries (a decode) dots its bf16 K tiles one at
                  a time, a prompt's tile kScoreTiles at a time;
  weight_block    (small_matmul.cpp) the first pass over each tile of a block of weight rows requests
                  the same lines of the next block (`Ahead`), instead of leaving it to the hardware.
Two more variants ask how far ahead of its reads paged_attention.cpp should request a row's K/V rows
(kKeysAhead, 32 keys): 16 and 64 keys. (Before those requests were spread over the arithmetic, a whole pool
block was requested at a time, 1 block ahead; 2 and 4 blocks ahead moved no case by more than the noise on
an Intel Xeon with AMX, 1 thread: bench/results/kernel_variants_xeon_amx.json.)
`--against REV` also builds the kernels as they were at git revision REV (a variant named `at_REV`): the
A/B of a change to the kernels, run after it lands or before it is committed.
Each variant below is the current source with edits that undo one or more of them (checked to apply, so a
variant that no longer matches the source fails loudly), built into its own module (once per machine:
under the kernel cache, `variants/`). Cases: `decode_<dtype>`, attention of 64 rows of one query over 330
keys each (a decode step at batch 64 of bench.engine's workload; blocks scattered over a pool of 1,841, 9
query / 3 KV heads of 64 dims, 30 layers), fp32 and bf16; `prompt_<dtype>`, 8 whole prompts of 300 tokens
(a prefill step); `linears_float32_<r>rows`, one pass over SmolLM2-135M's fp32 linear layers in the model's
order through small_matmul (every weight from memory, as in a forward) on r rows. Every variant runs every
case in turn, interleaved round by round (the machine's speed drifts; rounds apart do not compare), the
first two rounds dropped; outputs must equal the current kernel's bit for bit. Writes
bench/results/kernel_variants.json (milliseconds per case: min and median; median over current's).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.experiments import common

Edit = tuple[str, str, str]  # (file of engine/kernels, text, its replacement)
PREFETCH_INTO_L1: Edit = ("vector.h", 'asm volatile("prefetcht1 %0"', 'asm volatile("prefetcht0 %0"')
FOUR_TILES_FOR_DECODES: Edit = ("paged_attention.cpp", "if (queries <= kFewQueries) return f(std::integral_constant<int, 1>{});", "")
NO_WEIGHTS_AHEAD: Edit = ("small_matmul.cpp", "if (Ahead && k % kLineFloats == 0)", "if (false)")
KEYS_AHEAD_16: Edit = ("paged_attention.cpp", "constexpr int64_t kKeysAhead = 32;", "constexpr int64_t kKeysAhead = 16;")
KEYS_AHEAD_64: Edit = ("paged_attention.cpp", "constexpr int64_t kKeysAhead = 32;", "constexpr int64_t kKeysAhead = 64;")
VARIANTS: dict[str, tuple[Edit, ...]] = {
    "current": (),
    "keys_ahead_16": (KEYS_AHEAD_16,),
    "keys_ahead_64": (KEYS_AHEAD_64,),
    "prefetch_into_l1": (PREFETCH_INTO_L1,),
    "four_tiles_for_decodes": (FOUR_TILES_FOR_DECODES,),
    "no_weights_ahead": (NO_WEIGHTS_AHEAD,),
    "before": (PREFETCH_INTO_L1, FOUR_TILES_FOR_DECODES, NO_WEIGHTS_AHEAD),  # the memory choices up to 2154f3f
}
HEADS, KV_HEADS, HEAD_DIM, LAYERS, POOL_BLOCKS, BLOCK_SIZE = 9, 3, 64, 30, 1841, 16


@dataclass(frozen=True)
class AttentionCase:
    name: str
    rows: int
    keys: int
    queries_per_row: int  # 1: a decode; == keys: a whole prompt


ATTENTION_CASES = (AttentionCase("decode", 64, 330, 1), AttentionCase("prompt", 8, 300, 300))
QUICK_ATTENTION_CASES = (AttentionCase("decode", 8, 40, 1), AttentionCase("prompt", 2, 24, 24))
LINEAR_ROWS, QUICK_LINEAR_ROWS = (1, 4, 8, 16), (1,)


def variant_sources(name: str) -> dict[str, str]:
    """The kernels' sources and headers with `name`'s edits applied; raises if one of them no longer matches."""
    from engine import kernels

    texts = {file: (kernels.FOLDER / file).read_text() for file in kernels.SOURCES + kernels.HEADERS}
    for file, old, new in VARIANTS[name]:
        if texts[file].count(old) != 1:
            raise ValueError(f"variant {name!r}: {old!r} is not in {file} once")
        texts[file] = texts[file].replace(old, new)
    return texts


def revision_sources(revision: str) -> dict[str, str]:
    """The kernels' sources and headers as they were at git revision `revision` (a source added since is left
    out: that revision's bindings do not name it); raises if git does not know the revision."""
    from engine import kernels

    verified = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], cwd=common.REPO, capture_output=True, text=True, timeout=30)
    if verified.returncode != 0:
        raise ValueError(f"--against {revision}: git does not know that revision")
    texts = {}
    for file in kernels.SOURCES + kernels.HEADERS:
        path = (kernels.FOLDER / file).relative_to(common.REPO).as_posix()
        shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=common.REPO, capture_output=True, text=True, timeout=30)
        if shown.returncode == 0:
            texts[file] = shown.stdout
        elif file in kernels.HEADERS or file == "bindings.cpp":
            raise ValueError(f"--against {revision}: git has no {path} there ({shown.stderr.strip()})")
    return texts


def build(name: str, texts: dict[str, str] | None = None):
    """The kernels module built from `texts` (default: `name`'s variant sources; the engine's own build for `current`)."""
    from engine import kernels

    if name == "current":
        return kernels.load()
    texts = texts if texts is not None else variant_sources(name)
    key = hashlib.sha256((kernels.build_key() + "".join(texts.values())).encode()).hexdigest()[:12]
    safe = re.sub(r"\W", "_", name)  # a module name (at_HEAD~1 is a variant's)
    directory = kernels.CACHE_ROOT / "variants" / f"{safe}_{key}"
    directory.mkdir(parents=True, exist_ok=True)
    for file, text in texts.items():
        if not (directory / file).exists() or (directory / file).read_text() != text:
            (directory / file).write_text(text)
    common.log.info("building variant %s in %s", name, directory)
    return kernels.compile_module(f"pdserve_variant_{safe}_{key}", directory, [file for file in kernels.SOURCES if file in texts])


def attention_inputs(case: AttentionCase, dtype, layers: int, seed: int = 0) -> dict[str, Any]:
    """One step's attention inputs: per layer a pool of scattered blocks, the rows' tables and queries."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (POOL_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pools = [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)) for _ in range(layers)]
    width = -(-case.keys // BLOCK_SIZE)
    table = torch.randperm(POOL_BLOCKS, generator=generator)[: case.rows * width].view(case.rows, width).to(torch.int32)
    queries = case.rows * case.queries_per_row
    starts = None if case.queries_per_row == 1 else torch.arange(0, queries + 1, case.queries_per_row, dtype=torch.int32)
    return {"pools": pools, "table": table, "lens": torch.full((case.rows,), case.keys, dtype=torch.int32),
            "q": torch.randn(queries, HEADS, HEAD_DIM, generator=generator).to(dtype), "starts": starts}


def attention_step(data: dict[str, Any]) -> Callable[[Any], list]:
    return lambda module: [module.paged_decode(data["q"], key, value, data["table"], data["lens"], HEAD_DIM**-0.5, data["starts"])
                           for key, value in data["pools"]]


def linears_pass(weights: list, rows: int) -> Callable[[Any], list]:
    import torch

    generator = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=generator) for k in {w.shape[1] for w in weights}}
    return lambda module: [module.small_matmul(inputs[w.shape[1]], w, None) for w in weights]


def measure(modules: dict[str, Any], name: str, run: Callable[[Any], list], rounds: int) -> dict[str, Any]:
    """Every module runs `run` in turn, `rounds` times; their outputs must be the current kernel's bits."""
    import torch

    with torch.inference_mode():
        reference = run(modules["current"])
        for variant, module in modules.items():
            if not all(torch.equal(a, b) for a, b in zip(run(module), reference)):
                raise RuntimeError(f"variant {variant} does not give the current kernel's bits ({name})")
        times: dict[str, list[float]] = {variant: [] for variant in modules}
        for _ in range(rounds):
            for variant, module in modules.items():
                started = time.perf_counter()
                run(module)
                times[variant].append(time.perf_counter() - started)
    kept = {variant: sorted(t[2:] if rounds > 4 else t) for variant, t in times.items()}
    medians = {variant: t[len(t) // 2] for variant, t in kept.items()}
    result = {variant: {"min_ms": round(t[0] * 1e3, 2), "median_ms": round(medians[variant] * 1e3, 2),
                        "median_over_current": round(medians[variant] / medians["current"], 3)} for variant, t in kept.items()}
    common.log.info("%s: %s", name, ", ".join(f"{v} {r['median_ms']} ms" for v, r in result.items()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "kernel_variants")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds per case (default 12; the first two are dropped)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} (current is always run)")
    parser.add_argument("--against", metavar="REV", default="", help="also build the kernels of this git revision (variant at_REV)")
    parser.add_argument("--quick", action="store_true", help="tiny run (results under bench/results/quick/)")
    args = parser.parse_args(argv)
    names = ["current", *(n for n in args.variants.split(",") if n and n != "current")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}")
    info, started = common.begin(args.quick)
    import torch

    from engine.model_loader import load_model

    torch.set_num_threads(args.threads)
    modules = {name: build(name) for name in names}
    described = {n: [list(e) for e in VARIANTS[n]] for n in names}
    if args.against:
        modules[f"at_{args.against}"] = build(f"at_{args.against}", revision_sources(args.against))
        described[f"at_{args.against}"] = f"engine/kernels as at git revision {args.against}"
    if modules["current"] is None:
        common.log.error("the C++ kernels are not built here (no compiler?)")
        return 1
    layers, rounds = (2, 3) if args.quick else (LAYERS, args.rounds)
    report: dict[str, Any] = {"command": common.command_line(), "variants": described,
                              "attention_layers": layers, "rounds": rounds, "cases": {}}
    for case in QUICK_ATTENTION_CASES if args.quick else ATTENTION_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{case.name}_{str(dtype).removeprefix('torch.')}"
            run = attention_step(attention_inputs(case, dtype, layers))
            report["cases"][name] = {"rows": case.rows, "keys": case.keys, "queries_per_row": case.queries_per_row,
                                     **measure(modules, name, run, rounds)}
    model = load_model("smollm2-135m", dtype="float32").model
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for rows in QUICK_LINEAR_ROWS if args.quick else LINEAR_ROWS:
        name = f"linears_float32_{rows}rows"
        report["cases"][name] = {"rows": rows, "layers": len(weights), **measure(modules, name, linears_pass(weights, rows), rounds)}
    report["machine"] = common.finish(info, started)
    common.save("kernel_variants", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
