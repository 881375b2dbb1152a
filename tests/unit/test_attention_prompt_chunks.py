"""Prefill chunks attended by SDPA one by one (engine.attention `prompts`, the CPU path).

A chunk after cached keys attends to its context gathered from the pool under a causal mask. For a
prompt's last chunk that is the sum of transformers' one causal SDPA call over the whole prompt: torch's
flash attention splits the keys by their count, the same in both calls. The rows agree to rounding (in
bfloat16 on an AMX Xeon they were the same bits; in float32 the GEMMs group the query rows differently,
a 1e-7 difference). The pool's blocks are scattered on purpose.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PromptChunk, attend, prompt_chunk
from engine.kv_cache import KVCache, KVLayout

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _pool(dtype: torch.dtype, num_blocks: int) -> KVCache:
    return KVCache(KVLayout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK, dtype=dtype), num_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("context", "chunk"), [(37, 200), (300, 213), (600, 430)])
def test_a_prompts_last_chunk_after_cached_keys_is_the_whole_prompts_attention(dtype, context, chunk):
    torch.manual_seed(context)
    length = context + chunk
    q = torch.randn(length, HEADS, DIM).to(dtype)
    k = torch.randn(length, KV_HEADS, DIM).to(dtype)
    v = torch.randn(length, KV_HEADS, DIM).to(dtype)
    pool = _pool(dtype, 96)
    blocks = torch.randperm(96)[: -(-length // BLOCK)].tolist()
    pool.write_tokens(0, blocks, k, v)  # the context from earlier steps and this chunk's own keys

    meta = AttentionMetadata(kv_cache=pool, slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=0, decode=None,
                             prefill=None, prompts=[prompt_chunk(blocks, context, chunk, BLOCK, torch.device("cpu"))])
    ours = attend(q[context:], k[context:], v[context:], meta, layer=0, scaling=None)

    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    whole = F.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(ours, whole[context:])  # the dtype's tolerance: a key seen or missed would be far off


def test_chunks_that_start_their_context_attend_to_their_own_keys_only():
    torch.manual_seed(0)
    lengths = [5, 40, 17]
    q = torch.randn(sum(lengths), HEADS, DIM)
    k = torch.randn(sum(lengths), KV_HEADS, DIM)
    v = torch.randn(sum(lengths), KV_HEADS, DIM)
    pool = _pool(torch.float32, 8)  # never read: the chunks have no context
    meta = AttentionMetadata(kv_cache=pool, slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=0, decode=None,
                             prefill=None, prompts=[PromptChunk(n) for n in lengths])
    ours = attend(q, k, v, meta, layer=0, scaling=None)
    first = 0
    for n in lengths:
        rows = slice(first, first + n)
        alone = F.scaled_dot_product_attention(*(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=True)[0].transpose(0, 1)
        assert torch.equal(ours[rows], alone)
        first += n


def test_a_chunk_after_context_masks_each_token_to_its_own_position():
    chunk = prompt_chunk(list(range(10)), start=20, num_tokens=5, block_size=BLOCK, device=torch.device("cpu"))
    assert chunk.context_blocks.tolist() == [0, 1]  # 25 keys: two blocks
    assert chunk.mask.shape == (5, 25)
    assert chunk.mask.sum(dim=1).tolist() == [21, 22, 23, 24, 25]
    assert prompt_chunk([3], start=0, num_tokens=7, block_size=BLOCK, device=torch.device("cpu")) == PromptChunk(7)
