"""Run one scheduled step through the model: packed inputs in, logits of sampling requests out.

Lifecycle per step: `execute(batch)` orders the batch (single-token decodes first, then prefill
chunks), builds token ids, positions and the slot mapping of every packed token, builds the
`AttentionMetadata`, runs the HF model once on the whole packed row with the paged attention
function, and returns logits only for the requests whose last known token was computed.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine import attention
from engine.attention import AttentionMetadata, PrefillChunk
from engine.kv_cache import KVCache
from engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device | str = "cpu"):
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        model.set_attn_implementation(attention.register())

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSeq], on_layer_written: Callable[[int], None] | None = None
    ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Returns the batch in packed order and the logits `[num_sampling, vocab]` of its sampling members
        (in the same relative order)."""
        ordered = [s for s in batch if s.num_tokens == 1] + [s for s in batch if s.num_tokens > 1]
        input_ids, positions, slots = self._pack(ordered)
        meta = self._metadata(ordered, slots, on_layer_written)
        offsets = torch.tensor([s.num_tokens for s in ordered]).cumsum(0) - 1
        sampling_rows = offsets[torch.tensor([s.samples for s in ordered], dtype=torch.bool)]
        out = self.model(
            input_ids=input_ids.unsqueeze(0).to(self.device),
            position_ids=positions.unsqueeze(0).to(self.device),
            use_cache=False,
            logits_to_keep=sampling_rows.to(self.device),
            paged=meta,
        )
        return ordered, out.logits[0]

    def _pack(self, ordered: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = self.kv_cache.layout.block_size
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            ids.extend(seq.token_ids[start:end])
            pos = torch.arange(start, end)
            table = torch.tensor(seq.block_ids, dtype=torch.long)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
        return torch.tensor(ids, dtype=torch.long), torch.cat(pos_parts), torch.cat(slot_parts)

    def _metadata(
        self, ordered: list[ScheduledSeq], slots: torch.Tensor, on_layer_written: Callable[[int], None] | None
    ) -> AttentionMetadata:
        bs = self.kv_cache.layout.block_size
        decodes = [s for s in ordered if s.num_tokens == 1]
        prefills: list[PrefillChunk] = []
        start = len(decodes)
        for item in ordered[len(decodes):]:
            ctx = item.seq.num_computed_tokens
            table = torch.tensor(item.seq.block_ids[: -(-(ctx + item.num_tokens) // bs)], dtype=torch.long)
            prefills.append(PrefillChunk(start, item.num_tokens, ctx, table.to(self.device)))
            start += item.num_tokens
        tables, lens, mask = self._decode_tables(decodes)
        return AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots.to(self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=tables,
            decode_context_lens=lens,
            decode_key_mask=mask,
            prefills=prefills,
            on_layer_written=on_layer_written,
        )

    def _decode_tables(self, decodes: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not decodes:
            empty = torch.zeros((0, 1), dtype=torch.long, device=self.device)
            return empty, torch.zeros(0, dtype=torch.long, device=self.device), None
        bs = self.kv_cache.layout.block_size
        lens = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.long)
        width = int(-(-lens.max().item() // bs))
        tables = torch.zeros((len(decodes), width), dtype=torch.long)
        for row, item in enumerate(decodes):
            blocks = item.seq.block_ids[:width]
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        mask = (torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)).view(len(decodes), 1, 1, -1)
        return tables.to(self.device), lens.to(self.device), mask.to(self.device)
