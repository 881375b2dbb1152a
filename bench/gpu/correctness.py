"""Greedy tokens of the engine and of transformers' `generate` on the same random-weight model.

The reference is a deep copy of the model made before the engine switches its own instance to the
paged attention, so both run identical weights; transformers runs each prompt alone (batch 1, no
padding), the engine runs them all in one batch, as a server would.
"""

from __future__ import annotations

import copy
import random

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.model_loader import LoadedModel


def random_prompts(tokenizer, count: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Prompts of random ordinary token ids (special tokens excluded), lengths uniform in `lengths`."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    prompts = []
    for _ in range(count):
        n = rng.randint(*lengths)
        prompts.append([t for t in (rng.randrange(vocab) for _ in range(n * 2)) if t not in special][:n])
    return prompts


def reference_copy(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' own attention on the same weights (call before building an Engine on `loaded`)."""
    ref = copy.deepcopy(loaded.model)
    ref.set_attn_implementation("sdpa")
    return ref.eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def engine_greedy(engine: Engine, prompts: list[list[int]], max_new: int, prefix: str = "g", ignore_eos: bool = False) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, SamplingParams(max_tokens=max_new, ignore_eos=ignore_eos))
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens.get(f"{prefix}{i}", []) for i in range(len(prompts))]


def make_engine(loaded: LoadedModel, device: str, **overrides) -> Engine:
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[loaded.dtype]
    overrides.setdefault("kv_cache_memory_mb", 256)
    return Engine(EngineConfig(model=loaded.path, dtype=dtype, device=device, **overrides), loaded=loaded)


def compare(engine_out: list[list[int]], hf_out: list[list[int]]) -> dict:
    """Identical share, and for each differing prompt the first diverging position and both tokens."""
    diffs = []
    for i, (a, b) in enumerate(zip(engine_out, hf_out)):
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"prompt": i, "position": pos, "engine": a[pos : pos + 1], "hf": b[pos : pos + 1]})
    n = len(hf_out)
    return {"prompts": n, "identical": n - len(diffs), "identical_share": round((n - len(diffs)) / max(n, 1), 4), "diffs": diffs[:8]}


def prefilled(engine: Engine, batch: int, context: int, max_tokens: int) -> list:
    """`batch` requests of `context` random tokens, prefilled, each with the block for its next token:
    ready for timed decode steps (`ScheduledSeq(seq, 1)`); abort them when done."""
    gen = torch.Generator().manual_seed(batch)
    ids = [f"dec{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(100, engine.vocab_size - 100, (context,), generator=gen).tolist()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(not engine._requests[r].output_token_ids for r in ids):
        engine.step()
    seqs = [engine._requests[r] for r in ids]
    for seq in seqs:  # the block of the next token's slot, as the scheduler would allocate it
        if not engine.blocks.grow(seq, seq.num_computed_tokens + 1):
            raise RuntimeError("no KV block for the timed decode step")
    return seqs
