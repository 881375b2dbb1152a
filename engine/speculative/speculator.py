"""The engine's one handle on speculative decoding: propose, size, verify, roll back, count.

Per step: `propose` (after scheduling) returns the proposal of every decoding sequence the switch
keeps, with its blocks grown to hold them; `with_proposals` turns the step's items into items that
carry them; after the forward `sample` splits the logits rows (1 + k per speculating sequence) and
returns each sampling sequence's tokens; `record_step` times the step for the cost model;
`release_unused` frees blocks past a sequence's tokens (rejected slots only). Requests with logprobs,
logits adjustments (penalties, bias, min_tokens) or structured output never speculate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.engine_config import SpeculativeConfig
from engine.block_manager import BlockManager
from engine.sampler import Sample, Sampler
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.speculative.proposer import NgramProposer, Proposal, Proposer
from engine.speculative.switch import SpeculationSwitch
from engine.speculative.verify import verify
from engine.step import StepItem


@dataclass
class SpeculativeStats:
    proposed_tokens: int = 0
    """Proposed tokens verified by the target model."""
    accepted_tokens: int = 0
    steps: int = 0
    """Steps that verified at least one proposed token."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


def may_speculate(seq: Sequence) -> bool:
    p = seq.params
    return not (seq.prefill_only or p.logprobs is not None or p.adjusts_logits or p.structured is not None)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config.ngram_min, config.ngram_max)


class Speculator:
    def __init__(self, config: SpeculativeConfig, blocks: BlockManager, max_num_batched_tokens: int):
        self.k = config.num_speculative_tokens
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = build_proposer(config)
        self.switch = SpeculationSwitch(config.adaptive)
        self.stats = SpeculativeStats()
        self._kinds: dict[str, str] = {}
        """The kind of each sequence's proposal in the step being run."""

    def propose(self, scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        """Proposals by index into `scheduled`, only for decoding sequences the switch keeps."""
        base = sum(s.num_tokens for s in scheduled)
        budget = self.max_num_batched_tokens - base
        candidates: dict[str, tuple[int, Proposal]] = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            k = min(self.k, budget, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if k <= 0 or item.num_tokens != 1 or not item.samples or not may_speculate(seq):
                continue
            proposal = self.proposer.propose(seq.request_id, seq.token_ids, k)
            if proposal is not None and proposal.tokens:
                candidates[seq.request_id] = (i, proposal)
                budget -= len(proposal.tokens)
        num_outputs = sum(1 for s in scheduled if s.samples)
        chosen = self.switch.choose(base, num_outputs, {rid: p for rid, (_, p) in candidates.items()})
        out: dict[int, list[int]] = {}
        for rid, n in chosen.items():
            i, proposal = candidates[rid]
            seq = scheduled[i].seq
            if self.blocks.grow(seq, seq.num_computed_tokens + 1 + n):
                out[i] = proposal.tokens[:n]
                self._kinds[rid] = proposal.kind
        return out

    @staticmethod
    def with_proposals(items: list[StepItem], proposals: dict[int, list[int]]) -> list[StepItem]:
        return [dataclasses.replace(item, token_ids=item.token_ids + proposals[i], num_proposed=len(proposals[i])) if i in proposals else item
                for i, item in enumerate(items)]

    def sample(self, logits: torch.Tensor, sampler: Sampler, seqs: list[Sequence], proposals: list[list[int]]) -> list[list[Sample]]:
        """Tokens to append for each sampling sequence; `logits` holds 1 + len(proposal) rows per sequence."""
        starts, row = [], 0
        for proposal in proposals:
            starts.append(row)
            row += 1 + len(proposal)
        plain = [j for j, p in enumerate(proposals) if not p]
        results: list[list[Sample]] = [[] for _ in seqs]
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[torch.tensor([starts[j] for j in plain], device=logits.device)]
            for j, sample in zip(plain, sampler.sample(rows, [seqs[j] for j in plain])):
                results[j] = [sample]
        verified = 0
        for j, proposal in enumerate(proposals):
            if proposal:
                results[j] = verify(logits[starts[j] : starts[j] + 1 + len(proposal)], seqs[j], proposal, sampler)
                accepted = len(results[j]) - 1
                self.switch.acceptance.record(self._kinds.pop(seqs[j].request_id), len(proposal), accepted)
                self.stats.proposed_tokens += len(proposal)
                self.stats.accepted_tokens += accepted
                verified += 1
        self.stats.steps += verified > 0
        return results

    def record_step(self, num_tokens: int, num_verifying: int, seconds: float) -> None:
        self.switch.cost.record(num_tokens, num_verifying, seconds)

    def release_unused(self, seq: Sequence) -> None:
        self.blocks.shrink(seq, seq.num_tokens)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._kinds.pop(request_id, None)
