"""A cost profile (`pdserve profile` writes it, the simulator reads it): what each stage costs on one machine.

Lifecycle: `load_profile(path)` reads the JSON once and validates it (errors name the field); the
simulator then asks it, per step, `prefill_s(chunks)`, `decode_s(batch, context)`, `transfer_s(bytes)`
(latency + bytes at the link's rate) and `tier_load_s(blocks)` / `tier_store_s(blocks)`, each for a worker
of `tp` ranks.

Interpolation: bilinear on the measured grids (prefill: new tokens x cached context; decode: batch x
mean context), linear extrapolation past the last points (a step costs what its nearest two points
say per token), never below the smallest measured time. The prefill grid's context 0 is a path of its own:
the engine attends a whole prompt with its prompt kernel and a chunk after cached keys over its context
gathered from the pool (engine/model_runner.py), so a chunk with any cached context is read from the
grid's positive contexts alone (extrapolated linearly below the first), never interpolated towards 0.
A step that prefills several chunks costs the grid's time for all its new tokens at zero context plus,
per chunk, what its context added (t(n_i, c_i) - t(n_i, 0)); decodes in the same step add a row's cost each: the
decode grid's slope between its two largest batches at their mean context (`decode_row_s`). The
engine runs a step as one forward over every packed row (engine/model_runner.py), so the weights, the
launches and the step's own overhead are paid once, by the prefill part, whose grid already holds them.

Second tier: one block moved between the pool and the tier (loaded back, or copied out when the pool
evicts it) costs `tier_block_s`: the profile's measured first token of a prompt whose blocks all came
back from the tier, less the one-token step that computed its last token (the decode grid at batch 1 and
the prompt's length), per block; a profile without that measurement states `load_s_per_block` only (an
upper bound: it includes that step).

Sharing a CPU (`host_sharing`, measured on a CPU with two cores or more): a prefill step's time beside a
decoding engine on the same core (`same_core`, 2.0 would be fair sharing with nothing lost) and on
another core (`other_core`, 1.0 would be no effect), each over its time alone, and a decode step's beside a
prefilling engine (`decode_same_core`, `decode_other_core`); sim/core.py `Host` applies them. Profiles without it
get 2.0 and 1.0; without the decode ratios, the prefill step's.

Tensor parallelism: a profile measured at TP 1 says how TP scales its steps (`tp_scaling`: the
efficiency e(t) at t ranks, step time / (t x e(t))) and its KV capacity (per rank, so x t); a
profile that omits it cannot plan TP > 1. Torch-free.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.core import Sharing

PROFILE_KIND = "pdserve-profile"
SHIPPED = Path(__file__).parent / "profiles"


def _interp(xs: list[float], x: float) -> tuple[int, float]:
    """Index i and weight w so that x = xs[i] * (1 - w) + xs[i + 1] * w (w may leave [0, 1] past the ends)."""
    if len(xs) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class Grid:
    """seconds[i][j] measured at (xs[i], ys[j]); `at(x, y)` interpolates bilinearly, extrapolates linearly."""

    xs: list[float]
    ys: list[float]
    seconds: list[list[float]]

    def __post_init__(self) -> None:
        floor = min(min(row) for row in self.seconds)
        object.__setattr__(self, "_floor", floor)

    def at(self, x: float, y: float) -> float:
        i, wx = _interp(self.xs, x)
        j, wy = _interp(self.ys, y)
        s = self.seconds
        i2 = i + 1 if len(self.xs) > 1 else i
        j2 = j + 1 if len(self.ys) > 1 else j
        top = s[i][j] * (1 - wy) + s[i][j2] * wy
        bottom = s[i2][j] * (1 - wy) + s[i2][j2] * wy
        return max(self._floor, top * (1 - wx) + bottom * wx)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Link:
    """A KV transfer path: a fixed latency per transfer plus bytes at `bytes_per_s`."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    device: str
    block_size: int
    num_layers: int
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    """KV pool of one rank (one GPU, or one CPU worker at the profiled pool size), in tokens."""
    prefill: Grid
    decode: Grid
    links: dict[str, Link]
    prefill_after_cache: Grid | None = None
    """The prefill grid's positive-context columns (a chunk after cached keys); None: the grid has fewer than two."""
    tier_load_s_per_block: float | None = None
    tier_measured: dict[str, float] = field(default_factory=dict)
    """The tier section's raw measure: `loaded_s` (first token, every block from the tier), `prompt_tokens`."""
    tp_scaling: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    same_core_ratio: float = 2.0
    """A prefill step's time beside a decoding engine on the same core over its time alone (`host_sharing`;
    2.0 where not measured: fair sharing, nothing lost)."""
    other_core_ratio: float = 1.0
    """Its time beside a decoding engine on another core over its time alone (1.0 where not measured)."""
    decode_same_core_ratio: float | None = None
    """A decode step's time beside a prefilling engine on the same core over its time alone
    (`host_sharing.decode_same_core`); None where not measured: the prefill step's ratio."""
    decode_other_core_ratio: float | None = None
    """The same beside a prefilling engine on another core (`host_sharing.decode_other_core`)."""
    estimate: bool = False
    source: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None
    max_num_batched_tokens: int = 2048
    path: str = ""

    def speedup(self, tp: int) -> float:
        if tp not in self.tp_scaling:
            raise ValueError(f"tp_scaling: the profile states no efficiency for tensor_parallel_size {tp} (has {sorted(self.tp_scaling)})")
        return tp * self.tp_scaling[tp]

    def prefill_s(self, chunks: list[tuple[int, int]], decode_batch: int = 0, decode_context: float = 0.0, tp: int = 1) -> float:
        """One step that computes `chunks` [(new tokens, cached context)] and decodes `decode_batch` requests."""
        total = sum(n for n, _ in chunks)
        t = self.prefill.at(total, 0) if total else 0.0
        for n, c in chunks:
            if c:
                t += max(0.0, self.prefill_with_context(n, c) - self.prefill.at(n, 0))
        t += decode_batch * self.decode_row_s(decode_context)
        return t / self.speedup(tp)

    def prefill_with_context(self, tokens: float, context: float) -> float:
        """One step of `tokens` new tokens after `context` > 0 cached ones (the chunk-after-cached-keys path)."""
        if self.prefill_after_cache is None:
            return self.prefill.at(tokens, context)
        return max(self.prefill.at(tokens, 0), self.prefill_after_cache.at(tokens, context))

    def decode_row_s(self, context: float) -> float:
        """What one decode row adds to a step whose weights its prefill chunks already read: the decode grid's slope
        between its two largest batches at `context`. Not its smallest: up to a few rows a decode step is bound by
        reading the weights, so its slope there is no row's cost (the Zen 4 bf16 profile: 18.5 ms at batch 1, 16.6 at
        2, 23.0 at 8; 1.7 ms a row from 8 to 16 at 256 tokens of context)."""
        xs = self.decode.xs
        if len(xs) < 2:
            return 0.0
        t1, t2 = self.decode.at(xs[-2], context), self.decode.at(xs[-1], context)
        return max(0.0, (t2 - t1) / (xs[-1] - xs[-2]))

    def decode_s(self, batch: int, context: float, tp: int = 1) -> float:
        return self.decode.at(batch, context) / self.speedup(tp)

    def decode_slope(self, batch: int, context: float, tp: int = 1) -> float:
        """d(step time)/d(context) near `context`: how much longer each step gets as every context grows by one."""
        return max(0.0, (self.decode_s(batch, context + 64, tp) - self.decode_s(batch, context, tp)) / 64)

    def sharing(self) -> tuple[Sharing, Sharing]:
        """What sharing a CPU costs a prefill step and a decode step (sim/core.py `Host`)."""
        prefill = Sharing(self.same_core_ratio, self.other_core_ratio)
        decode = Sharing(self.decode_same_core_ratio or prefill.same_core, self.decode_other_core_ratio or prefill.other_core)
        return prefill, decode

    def link(self, transport: str | None = None) -> Link:
        if transport is None:
            return next(iter(self.links.values()))
        if transport not in self.links:
            raise ValueError(f"transfer: the profile measured no {transport!r} link (has {sorted(self.links)})")
        return self.links[transport]

    @property
    def tier_block_s(self) -> float:
        """One block moved between the pool and the tier (see the module docstring)."""
        measured = self.tier_measured
        loaded, tokens = measured.get("loaded_s"), measured.get("prompt_tokens")
        if loaded and tokens and tokens >= self.block_size:
            per_block = (loaded - self.decode.at(1, tokens)) / (tokens // self.block_size)
            if per_block > 0:
                return per_block
        return self.tier_load_s_per_block or 0.0

    def tier_load_s(self, blocks: int) -> float:
        return blocks * self.tier_block_s

    def tier_store_s(self, blocks: int) -> float:
        """Copying `blocks` evicted pool blocks out into the tier (engine/kv_tier.py `save`: on the engine thread)."""
        return blocks * self.tier_block_s


def load_profile(path: str | Path) -> Profile:
    """A profile file, or the name of a shipped one (sim/profiles/NAME.json)."""
    p = Path(path)
    if not p.exists() and (SHIPPED / f"{path}.json").exists():
        p = SHIPPED / f"{path}.json"
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"profile: cannot read {p}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile: {p} is not JSON: {exc}") from None
    return profile_from_dict(data, str(p))


def _ratio(value: Any) -> float | None:
    return None if value is None else float(value)


def _grid(data: dict, name: str, xkey: str, ykey: str) -> Grid:
    section = data.get(name)
    if not isinstance(section, dict):
        raise ValueError(f"profile.{name}: missing")
    xs, ys, seconds = section.get(xkey), section.get(ykey), section.get("seconds")
    for key, value in ((xkey, xs), (ykey, ys)):
        if not isinstance(value, list) or not value or value != sorted(set(value)):
            raise ValueError(f"profile.{name}.{key}: must be a non-empty increasing list")
    if (not isinstance(seconds, list) or len(seconds) != len(xs)
            or any(not isinstance(r, list) or len(r) != len(ys) or any(not (v > 0) for v in r) for r in seconds)):
        raise ValueError(f"profile.{name}.seconds: must be {len(xs)} rows of {len(ys)} times > 0")
    return Grid([float(x) for x in xs], [float(y) for y in ys], [[float(v) for v in r] for r in seconds])


def profile_from_dict(data: dict, path: str = "") -> Profile:
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ValueError(f"profile.kind: must be {PROFILE_KIND!r}")
    links = {}
    for name, link in (data.get("transfer") or {}).items():
        if not isinstance(link, dict) or not link.get("bytes_per_s", 0) > 0 or link.get("latency_s", -1) < 0:
            raise ValueError(f"profile.transfer.{name}: needs bytes_per_s > 0 and latency_s >= 0")
        links[name] = Link(float(link["latency_s"]), float(link["bytes_per_s"]))
    if not links:
        raise ValueError("profile.transfer: at least one link is needed")
    for key in ("block_size", "num_layers", "kv_bytes_per_token", "kv_capacity_tokens"):
        if not isinstance(data.get(key), int) or data[key] <= 0:
            raise ValueError(f"profile.{key}: must be an integer > 0")
    tier = data.get("tier") or {}
    sharing = data.get("host_sharing") or {}
    for key in ("same_core", "other_core", "decode_same_core", "decode_other_core"):
        if key in sharing and not (isinstance(sharing[key], (int, float)) and sharing[key] >= 1.0):
            raise ValueError(f"profile.host_sharing.{key}: must be a ratio >= 1")
    scaling = {int(k): float(v) for k, v in (data.get("tp_scaling") or {"1": 1.0}).items()}
    prefill = _grid(data, "prefill", "tokens", "context")
    cached = [j for j, c in enumerate(prefill.ys) if c > 0]
    after_cache = (Grid(prefill.xs, [prefill.ys[j] for j in cached], [[row[j] for j in cached] for row in prefill.seconds])
                   if len(cached) >= 2 and prefill.ys[0] == 0 else None)
    return Profile(model=str(data.get("model", "")), dtype=str(data.get("dtype", "")), device=str(data.get("device", "cpu")),
                   block_size=data["block_size"], num_layers=data["num_layers"], kv_bytes_per_token=data["kv_bytes_per_token"],
                   kv_capacity_tokens=data["kv_capacity_tokens"], prefill=prefill, prefill_after_cache=after_cache,
                   decode=_grid(data, "decode", "batch", "context"),
                   links=links, tier_load_s_per_block=tier.get("load_s_per_block"),
                   tier_measured={"loaded_s": float((tier.get("measured") or {}).get("loaded_s") or 0.0),
                                  "prompt_tokens": float(tier.get("prompt_tokens") or 0)} if tier.get("measured") else {},
                   tp_scaling=scaling, same_core_ratio=float(sharing.get("same_core", 2.0)),
                   other_core_ratio=float(sharing.get("other_core", 1.0)),
                   decode_same_core_ratio=_ratio(sharing.get("decode_same_core")),
                   decode_other_core_ratio=_ratio(sharing.get("decode_other_core")),
                   estimate=bool(data.get("estimate", False)), source=str(data.get("source", "")), machine=data.get("machine") or {},
                   threads=data.get("threads"), max_num_batched_tokens=int(data.get("max_num_batched_tokens", 2048)), path=path)


def linear_profile(prefill_fixed_s: float = 0.01, prefill_token_s: float = 1e-4, decode_fixed_s: float = 0.01, decode_seq_s: float = 1e-4,
                   attention_token_s: float = 1e-8, link_bytes_per_s: float = 50e9, link_latency_s: float = 1e-4, block_size: int = 16,
                   num_layers: int = 32, kv_bytes_per_token: int = 131072, kv_capacity_tokens: int = 1 << 21,
                   max_num_batched_tokens: int = 8192, tp_scaling: dict[int, float] | None = None) -> Profile:
    """A closed-form profile (tests, what-ifs): prefill n new tokens over context c costs
    fixed + n x token_s + n x c x attention_token_s; a decode step of b requests at context c costs
    fixed + b x seq_s + b x c x attention_token_s. Exact under the grid interpolation (linear in each axis)."""
    tokens, context, batch = [1, 512, 2048, 8192, 32768], [0, 4096, 32768, 131072], [1, 8, 32, 128, 512]
    return profile_from_dict({
        "kind": PROFILE_KIND, "source": "linear_profile (closed form, not measured)", "estimate": True,
        "block_size": block_size, "num_layers": num_layers, "kv_bytes_per_token": kv_bytes_per_token,
        "kv_capacity_tokens": kv_capacity_tokens, "max_num_batched_tokens": max_num_batched_tokens,
        "prefill": {"tokens": tokens, "context": context,
                    "seconds": [[prefill_fixed_s + n * prefill_token_s + n * c * attention_token_s for c in context] for n in tokens]},
        "decode": {"batch": batch, "context": context,
                   "seconds": [[decode_fixed_s + b * decode_seq_s + b * c * attention_token_s for c in context] for b in batch]},
        "transfer": {"link": {"latency_s": link_latency_s, "bytes_per_s": link_bytes_per_s}},
        "tp_scaling": {str(k): v for k, v in (tp_scaling or {1: 1.0, 2: 0.9, 4: 0.8, 8: 0.7}).items()},
    })
