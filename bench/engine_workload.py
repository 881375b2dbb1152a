"""The engine benchmark's settings and its seeded offline workload (prompts of random token ids,
output lengths), shared by every phase of `bench.engine` and by the transformers baselines."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.hardware import auto_dtype


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
    dtypes: tuple[str, ...] = field(default_factory=lambda: (auto_dtype("cpu"),))
    """The whole benchmark runs once per dtype (default: what `engine.dtype: auto` picks here)."""


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
