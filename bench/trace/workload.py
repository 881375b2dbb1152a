"""A request trace in the Mooncake format, scaled to this machine.

Lifecycle (what `bench.experiments.trace_replay` does with a trace file, in this order):
  1. `load_trace(path)`: one `TraceRequest` per JSON line (`timestamp` ms, `input_length`,
     `output_length`, `hash_ids`: one id per trace block of the prompt; equal leading ids = equal prefix).
  2. `select_window(trace, start_s, end_s, requests, seed)`: the requests in the trace-time range, then
     whole conversations (requests sharing their first two hash ids; every prompt of the Mooncake file
     starts with the same id 0, a shared system prompt) taken in a seeded order until `requests` are
     chosen, back in arrival order. A contiguous slice of a few hundred requests holds few of a
     conversation's later turns (3-16 % reuse against 36.6 % for the whole hour); sampling
     conversations over a long range keeps their turns, and so the trace's reuse.
  3. `Scale`: prompt and answer lengths in this machine's tokens (`tokens_per_block` per trace block).
  4. `BlockTokens`: the token ids of each hash id's block, a function of (seed, hash id, position), so
     equal hash ids give equal token prefixes; a prompt is its blocks' tokens cut to its scaled length
     (a partial last block = the first k tokens of its id's block).
  5. `compress_time(requests, rate)`: arrival offsets with the window's gaps scaled to a mean rate.
  6. `reuse_bound(requests, scale)`: what an unbounded prefix cache could skip, in trace blocks (the
     trace's own definition) and in prompt tokens of full engine blocks (what the replay is judged by);
     `lru_reuse(requests, scale, capacity)`: the same with one LRU cache of a given number of blocks.
Steps 1-3 and 5 live in common/mooncake.py (the simulator reads traces too) and are re-exported here.
Torch-free; the model's vocabulary comes in as an array (`vocabulary(tokenizer)` builds it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from common.mooncake import TRACE_BLOCK, Scale, TraceRequest, compress_time, conversation_key, load_trace, select_window

__all__ = ["TRACE_BLOCK", "BlockTokens", "Scale", "TraceRequest", "compress_time", "conversation_key", "load_trace", "lru_reuse",
           "reuse_bound", "select_window", "vocabulary"]


def vocabulary(tokenizer) -> np.ndarray:
    """The token ids a prompt may use: the model's whole vocabulary but its special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(len(tokenizer)) if t not in special], dtype=np.int64)


class BlockTokens:
    """Token ids per hash id: block h is `tokens_per_block` draws from `vocab` by a generator seeded with
    (seed, h), so position p of block h is the same in every prompt, run and process."""

    def __init__(self, vocab: np.ndarray, tokens_per_block: int, seed: int = 0):
        if len(vocab) < 2:
            raise ValueError("the vocabulary needs at least two token ids")
        self.vocab, self.tokens_per_block, self.seed = np.asarray(vocab), tokens_per_block, seed
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        found = self._blocks.get(hash_id)
        if found is None:
            rng = np.random.default_rng([self.seed, hash_id])
            found = self._blocks[hash_id] = self.vocab[rng.integers(0, len(self.vocab), self.tokens_per_block)].tolist()
        return found

    def prompt(self, hash_ids: Iterable[int], length: int) -> list[int]:
        ids: list[int] = []
        for h in hash_ids:
            if len(ids) >= length:
                break
            ids.extend(self.block(h))
        return ids[:length]


def reuse_bound(requests: list[TraceRequest], scale: Scale) -> dict[str, float | int]:
    """What an unbounded cache that starts empty could reuse over `requests`, in arrival order.

    blocks: the trace's own measure, the share of prompt blocks (hash ids) that are a prefix an earlier
      request already had (36.6 % over the whole Mooncake conversation file).
    tokens: the share of scaled prompt tokens an engine prefix cache can skip: the leading blocks that are
      full here and were full in an earlier prompt (an engine caches full blocks only), leaving at least
      one token per prompt to compute (the first sampled token needs its logits)."""
    seen: set[tuple[int, ...]] = set()
    seen_full: set[tuple[int, ...]] = set()
    blocks = matched_blocks = tokens = reusable = 0
    for r in requests:
        ids, length, full = r.hash_ids, scale.prompt_len(r), scale.full_blocks(r)
        k = 0
        while k < len(ids) and ids[: k + 1] in seen:
            k += 1
        f = 0
        while f < full and ids[: f + 1] in seen_full:
            f += 1
        blocks += len(ids)
        matched_blocks += k
        tokens += length
        reusable += min(f * scale.tokens_per_block, length - 1)
        seen.update(ids[: i + 1] for i in range(len(ids)))
        seen_full.update(ids[: i + 1] for i in range(full))
    return {"blocks": len(requests) and matched_blocks / blocks, "prompt_blocks": blocks, "reusable_blocks": matched_blocks,
            "tokens": len(requests) and reusable / tokens, "prompt_tokens": tokens, "reusable_tokens": reusable}


def lru_reuse(requests: list[TraceRequest], scale: Scale, capacity_blocks: int) -> dict[str, float | int]:
    """Like `reuse_bound`'s tokens, with one cache of `capacity_blocks` full blocks that evicts the least
    recently used: what one worker's pool could reuse if every request went to it (requests in flight
    pinning blocks aside)."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    tokens = reusable = 0
    for r in requests:
        ids, length, full = r.hash_ids, scale.prompt_len(r), scale.full_blocks(r)
        f = 0
        while f < full and ids[: f + 1] in cache:
            f += 1
        tokens += length
        reusable += min(f * scale.tokens_per_block, length - 1)
        for i in range(full):
            cache[ids[: i + 1]] = None
            cache.move_to_end(ids[: i + 1])
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return {"tokens": len(requests) and reusable / tokens, "prompt_tokens": tokens, "reusable_tokens": reusable,
            "capacity_blocks": capacity_blocks}
