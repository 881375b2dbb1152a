"""The seeded workload of one serving run: `RequestSpec`s with prompt (token ids for gRPC, random
words for HTTP), output length, arrival time, priority (a seeded `--high-priority-fraction` of the main
requests gets `--high-priority`, the rest 0), and burst requests injected at fixed times."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    priority: int = 0  # sent as the request's priority (higher first)


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
    mark_high_priority(specs, getattr(args, "high_priority_fraction", 0.0), getattr(args, "high_priority", 0), rng)
    for b, at in enumerate(args.burst_at or []):
        for _ in range(args.burst_size):
            spec = RequestSpec(len(specs), args.burst_prompt_len, args.burst_output_len, float(at), group="burst", burst=b)
            if as_text:
                spec.prompt_text = random_text(rng, spec.prompt_len)
            else:
                spec.prompt_ids = random_ids(rng, spec.prompt_len, args.vocab)
            specs.append(spec)
    return specs


def mark_high_priority(specs: list[RequestSpec], fraction: float, priority: int, rng: np.random.Generator) -> None:
    """round(fraction x n) of the requests, drawn without replacement, get `priority` (no draw at 0,
    so workloads without priorities stay what they were)."""
    count = round(fraction * len(specs))
    if count:
        for i in rng.choice(len(specs), size=count, replace=False):
            specs[int(i)].priority = priority


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
