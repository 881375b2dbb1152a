"""The KV pool's second tier (engine.kv_tier): blocks evicted from a small pool are saved, a prompt sent
again loads them back instead of computing them, and its tokens still equal HF's; a corrupted entry is
detected and recomputed; the BlockManager's side of it with a fake tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine_config import KVTierConfig
from engine import SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Sequence
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

MAX_NEW = 6
POOL_BLOCKS = 48  # a few prompts' worth: the filler prompts evict the first one


def tier_engine(demo_model, tier: KVTierConfig):
    return make_engine(demo_model, dtype="float32", max_model_len=512, num_kv_blocks=POOL_BLOCKS, kv_tier=tier)


def run(engine, request_id: str, prompt: list[int]) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=MAX_NEW))
    return run_to_completion(engine)[request_id]


def long_prompt(demo_prompt_ids, i: int) -> list[int]:
    """200 tokens (12 full blocks), no block shared with the others' (the first token differs)."""
    return [1000 + i] + (demo_prompt_ids[i % len(demo_prompt_ids)] * 20)[:199]


def evict_everything(engine, demo_prompt_ids) -> None:
    for i in range(1, 5):
        run(engine, f"filler{i}", long_prompt(demo_prompt_ids, i))


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_prompt_evicted_from_the_pool_is_loaded_from_the_tier(demo_model, demo_prompt_ids, hf_greedy, kind, tmp_path):
    engine = tier_engine(demo_model, KVTierConfig(kind=kind, budget_mb=64, directory=str(tmp_path) if kind == "disk" else None))
    prompt = long_prompt(demo_prompt_ids, 0)
    assert run(engine, "first", prompt) == hf_greedy(tuple(prompt), MAX_NEW)
    evict_everything(engine, demo_prompt_ids)
    assert not engine.blocks.match_prefix(prompt, len(prompt) - 1), "the fillers should have evicted the prompt from the pool"
    assert engine.tier.stats.stored_blocks > 0
    hits_before = engine.blocks.prefix_stats.hit_tokens
    assert run(engine, "again", prompt) == hf_greedy(tuple(prompt), MAX_NEW)
    assert engine.tier.stats.loaded_blocks == (len(prompt) - 1) // 16
    assert engine.blocks.prefix_stats.hit_tokens - hits_before == engine.tier.stats.loaded_blocks * 16
    if kind == "disk":
        assert any(Path(tmp_path).glob("*.kv"))
    assert_no_leaked_blocks(engine)
    engine.close()


def test_a_corrupted_tier_entry_is_detected_and_recomputed(demo_model, demo_prompt_ids, hf_greedy, tmp_path):
    engine = tier_engine(demo_model, KVTierConfig(kind="disk", budget_mb=64, directory=str(tmp_path)))
    prompt = long_prompt(demo_prompt_ids, 0)
    run(engine, "first", prompt)
    evict_everything(engine, demo_prompt_ids)
    names = _chain(prompt, engine.blocks)  # the names of the prompt's blocks, as the tier files them
    victim = tmp_path / f"{names[2] & (2**64 - 1):016x}.kv"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x40  # one flipped bit in the KV, the checksum left as it was
    victim.write_bytes(bytes(data))
    assert run(engine, "again", prompt) == hf_greedy(tuple(prompt), MAX_NEW)
    assert engine.tier.stats.corrupt_blocks == 1
    assert engine.tier.stats.loaded_blocks == 2  # the blocks before the corrupt one; it and the rest were computed
    assert_no_leaked_blocks(engine)
    engine.close()


def _chain(prompt: list[int], blocks: BlockManager) -> list[int]:
    from common.block_hash import chain_hashes

    return chain_hashes(prompt, blocks.block_size)


class FakeTier:
    """Records what the BlockManager asks of a tier; holds the hashes it was given."""

    def __init__(self, corrupt: set[int] = frozenset()):
        self.held: dict[int, int] = {}
        self.loads: list[tuple[int, int]] = []
        self.saves: list[int] = []
        self.corrupt = corrupt
        self.pays = True

    def save(self, evicted: list[tuple[int, int]]) -> None:
        self.saves.append(len(evicted))
        for block_id, block_hash in evicted:
            self.held[block_hash] = block_id

    def loadable(self, hashes: list[int]) -> int:
        count = 0
        while self.pays and count < len(hashes) and hashes[count] in self.held:
            count += 1
        return count

    def load(self, pairs: list[tuple[int, int]]) -> int:
        self.loads.extend(pairs)
        return next((i for i, (_, h) in enumerate(pairs) if h in self.corrupt), len(pairs))


def _admit(blocks: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens, SamplingParams(max_tokens=1))
    assert blocks.admit(seq, len(tokens)) is not None
    seq.num_computed_tokens = len(tokens)
    blocks.commit_computed(seq)
    return seq


def test_block_manager_saves_evicted_blocks_and_admits_tier_hits_as_cached():
    tier = FakeTier()
    blocks = BlockManager(num_blocks=4, block_size=4, tier=tier)
    a = list(range(13))  # 3 full blocks + 1 token
    blocks.free(_admit(blocks, "a", a))
    blocks.free(_admit(blocks, "b", list(range(100, 116))))  # takes every block: a's 3 cached ones are evicted
    assert set(tier.held) == set(_chain(a, blocks)) and tier.saves == [3]  # one save for the allocation's evictions
    seq = Sequence("a2", a, SamplingParams(max_tokens=1))
    assert blocks.admit(seq, len(a)) == 1  # 12 tokens loaded, the last one computed
    assert seq.num_cached_tokens == 12 and [h for _, h in tier.loads] == _chain(a, blocks)
    assert blocks.match_prefix(a, 12) == seq.block_ids[:3]  # loaded blocks joined the prefix cache


def test_block_manager_stops_at_a_corrupt_entry_and_when_loading_does_not_pay():
    a = list(range(13))
    names = _chain(a, BlockManager(1, 4))
    tier = FakeTier(corrupt={names[1]})
    blocks = BlockManager(num_blocks=4, block_size=4, tier=tier)
    tier.held = {h: 0 for h in names}
    seq = Sequence("a", a, SamplingParams(max_tokens=1))
    assert blocks.admit(seq, len(a)) == 9  # block 0 loaded; block 1 corrupt: it and the rest are computed
    assert seq.num_cached_tokens == 4
    blocks.free(seq)
    tier.pays = False
    seq = Sequence("b", list(range(50, 63)), SamplingParams(max_tokens=1))
    assert blocks.admit(seq, 13) == 13 and seq.num_cached_tokens == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_saved_together_load_back_byte_for_byte_into_other_blocks(dtype):
    from engine.kv_cache import KVCache, KVLayout
    from engine.kv_tier import KVTier

    cache = KVCache(KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype), num_blocks=8)
    for layer in range(3):
        cache.key_caches[layer].normal_()
        cache.value_caches[layer].normal_()
    want = {b: [c[layer][b].clone() for layer in range(3) for c in (cache.key_caches, cache.value_caches)] for b in (2, 5)}
    tier = KVTier(cache, KVTierConfig(kind="memory", budget_mb=1))
    tier.save([(2, 22), (5, 55)])
    assert tier.stats.stored_blocks == 2 and 22 in tier and 55 in tier
    for layer in range(3):
        cache.key_caches[layer].zero_()
        cache.value_caches[layer].zero_()
    assert tier.load([(7, 55), (1, 22)]) == 2
    got = {b: [c[layer][b] for layer in range(3) for c in (cache.key_caches, cache.value_caches)] for b in (7, 1)}
    assert all(torch.equal(g, w) for g, w in zip(got[7], want[5])) and all(torch.equal(g, w) for g, w in zip(got[1], want[2]))
    assert not cache.key_caches[0][0].any(), "a block not named was written"
    assert tier.load([(3, 22), (4, 99), (6, 55)]) == 1  # stops at the missing entry
