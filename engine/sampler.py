"""Turn the logits of the requests that sample this step into tokens.

First `LogitsAdjuster` applies the requests' penalties, logit_bias and min_tokens (no work when no
request of the step uses them), then `StructuredOutputs` masks the tokens that the constrained
requests' grammars do not accept (no work without such requests). Greedy rows take the argmax of the adjusted logits; the others apply
temperature, top-k and top-p and draw with the request's own generator (seeded from
`SamplingParams.seed`, else from the engine's seed sequence),
so a seeded request samples the same tokens whatever it is batched with. Logprobs come from the
unmodified model distribution (before penalties, bias, temperature, top-k/top-p), as vLLM's default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from common.sampling import SamplingParams
from engine import kernels
from engine.logits_processors import LogitsAdjuster
from engine.sequence import Sequence
from engine.structured import StructuredOutputs


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] = field(default_factory=dict)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first on ties); on a CPU through engine.kernels' argmax_rows, as torch's
    argmax over a vocabulary runs scalar there (3 ms for 64 rows of 49k logits, against 0.3)."""
    kernel = kernels.load() if logits.device.type == "cpu" else None
    return (kernel.argmax_rows(logits) if kernel is not None else torch.argmax(logits, dim=-1)).tolist()


def _argmax_only(seqs: list[Sequence]) -> bool:
    """Every row takes the argmax of its raw logits, which reads the same in the model's dtype as in float32
    (the widening is exact): no float copy of the step's logits is needed."""
    return all(s.params.greedy and s.params.logprobs is None and not s.params.adjusts_logits and s.params.structured is None for s in seqs)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Iterable[int] = (), structured: StructuredOutputs | None = None):
        self._adjuster = LogitsAdjuster(eos_token_ids)
        self.structured = structured
        self._seed_source = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._adjuster.forget(request_id)
        if self.structured is not None:
            self.structured.forget(request_id)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        if logits.dtype != torch.float32 and not _argmax_only(seqs):
            logits = logits.float()
        adjusted = self._adjuster.adjust(logits, seqs)
        if self.structured is not None:
            adjusted = self.structured.mask(adjusted, seqs, in_place=adjusted is not logits)
        token_list = greedy_tokens(adjusted)  # the step's one wait for the device
        drawn = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if drawn:  # drawn on the host with the request's own CPU generator, whatever the device
            host = adjusted[drawn].cpu()
            for j, row in enumerate(drawn):
                token_list[row] = self._draw(host[j], seqs[row])
        samples = [Sample(token_id=t) for t in token_list]
        want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want_logprobs:
            logprobs = torch.log_softmax(logits[want_logprobs], dim=-1).cpu()
            for j, row in enumerate(want_logprobs):
                samples[row].logprob = logprobs[j, token_list[row]].item()
                k = seqs[row].params.logprobs
                if k:
                    top = torch.topk(logprobs[j], k)
                    samples[row].top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
        return samples

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        return int(torch.multinomial(self.probs(row, seq.params), 1, generator=self.generator(seq)).item())

    @staticmethod
    def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The request's sampling distribution over the last dimension (temperature, top-k, top-p applied)."""
        scaled = logits / max(p.temperature, 1e-5)
        if p.top_k and p.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, p.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return probs

    def generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            seed = seq.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
            gen = self._generators[seq.request_id] = torch.Generator().manual_seed(seed)
        return gen
