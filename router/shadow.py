"""The disaggregation canary: a sampled request that went through the disaggregated path (prefill
worker -> KV transfer -> decode worker) is computed again colocated on a decode worker (local prefill:
no KV moves), and the two outputs are compared. A difference counts in
`pdserve_disagg_divergence_total` and logs the request id; the client never sees the shadow run.

Lifecycle: `ShadowChecker.consider(state)` runs when a request's stream ended well; with probability
`router.shadow_check_fraction` and when the request qualifies (one greedy sequence with no logit
adjustments, served disaggregated on its first attempt, some tokens generated) it starts a background
check, tracked until it ends (`close` cancels the ones still running). The check's Decode call asks
for the top `TOP_LOGPROBS` logprobs of every token.

The recompute takes nothing from the decode worker's prefix cache (`DecodeRequest.recompute`): KV that
arrived wrong but passed every check would otherwise feed the check itself.

The rule, so that a correct run is never flagged: the two runs see the same prompt and the same
weights, and differ only in batch composition and in how the prompt's KV reached the decode worker.
A correct transfer moves the prefill worker's KV bit for bit, so the two outputs can differ only
where floating-point rounding of differently batched steps moves the scores, which it does by less
than `tolerance` (in logprob; per dtype, `TOLERANCE`). Greedy output can then differ from the shadow
only at a near-tie: at the first position where the tokens differ, the disaggregated token's
logprob in the shadow's distribution lies within `tolerance` of the shadow's own choice. That is
excused and the comparison stops there (the two runs continue from different tokens). A difference
anywhere else, where the shadow gave the disaggregated token a logprob lower by more than the
tolerance or did not list it among its top tokens at all, is a divergence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from dataclasses import dataclass

import grpc

from common.sampling import SamplingParams
from proto.convert import sampling_to_proto
from proto.pdserve.v1 import pdserve_pb2 as pb
from router.metrics import RouterMetrics
from router.pool import NoWorkerAvailable, WorkerPool
from router.progress import Progress

log = logging.getLogger(__name__)

TOP_LOGPROBS = 5
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
"""Logprob noise bound between two batch compositions, per dtype (see the module's rule)."""


@dataclass(frozen=True)
class Comparison:
    diverged: bool
    position: int | None = None
    """The first position where the tokens differ (None: they agree on every compared token)."""
    detail: str = ""


def compare(disaggregated: list[int], shadow: list[pb.Logprob], tolerance: float) -> Comparison:
    """The module's rule: `shadow` holds the shadow run's tokens with their top logprobs."""
    for position, (token, theirs) in enumerate(zip(disaggregated, shadow)):
        if token == theirs.token_id:
            continue
        listed = {alt.token_id: alt.logprob for alt in theirs.top}
        if token in listed and listed[token] >= theirs.logprob - tolerance:
            return Comparison(False, position, f"near-tie at token {position}: {listed[token]:.4f} vs {theirs.logprob:.4f}")
        seen = f"logprob {listed[token]:.4f}" if token in listed else f"not in its top {len(listed)}"
        return Comparison(True, position, f"token {position}: disaggregated {token}, shadow {theirs.token_id} "
                                          f"({theirs.logprob:.4f}; the disaggregated token {seen})")
    return Comparison(False)


class ShadowChecker:
    def __init__(self, fraction: float, dtype: str, pool: WorkerPool, metrics: RouterMetrics, rng: random.Random | None = None,
                 rpc_timeout_s: float = 300.0):
        self.fraction = fraction
        self.tolerance = TOLERANCE.get(dtype, TOLERANCE["bfloat16"])
        self.pool, self.metrics = pool, metrics
        self.rng = rng or random.Random()
        self.rpc_timeout_s = rpc_timeout_s
        self._running: set[asyncio.Task] = set()

    def consider(self, state: Progress) -> None:
        """After a request's stream ended well: maybe start its check in the background."""
        if self.fraction <= 0 or not qualifies(state) or self.rng.random() >= self.fraction:
            return
        task = asyncio.get_running_loop().create_task(self._check(state.request_id, list(state.prompt_ids), state.params,
                                                                  list(state.sequences[0].generated)))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _check(self, request_id: str, prompt: list[int], params: SamplingParams, generated: list[int]) -> None:
        try:
            shadow = await self._shadow(request_id, prompt, params, len(generated))
        except (grpc.aio.AioRpcError, NoWorkerAvailable, TimeoutError) as exc:
            log.info("request %s: shadow check not run (%s)", request_id, exc)
            self.metrics.shadow_checks.labels(outcome="not_run").inc()
            return
        result = compare(generated, shadow, self.tolerance)
        self.metrics.shadow_checks.labels(outcome="diverged" if result.diverged else "agreed").inc()
        if result.diverged:
            self.metrics.divergences.inc()
            log.error("request %s: the disaggregated output diverged from its colocated recompute: %s", request_id, result.detail)

    async def _shadow(self, request_id: str, prompt: list[int], params: SamplingParams, max_tokens: int) -> list[pb.Logprob]:
        """The colocated recompute on a decode worker: its tokens with their top logprobs."""
        decoder = self.pool.pick("decode", prompt)
        sampling = sampling_to_proto(dataclasses.replace(params, max_tokens=max_tokens, logprobs=TOP_LOGPROBS))
        request = pb.DecodeRequest(request_id=f"{request_id}.shadow", token_ids=prompt, sampling=sampling, local_prefill=True, recompute=True)
        tokens: list[pb.Logprob] = []
        async for response in decoder.stub.Decode(request, timeout=self.rpc_timeout_s):
            chunk = response.finished.chunk if response.HasField("finished") else response.chunk
            tokens.extend(chunk.logprobs)
        return tokens


def qualifies(state: Progress) -> bool:
    """One plain greedy sequence (logprobs are the raw distribution's: adjustments would skew the rule),
    served disaggregated on its first attempt, with tokens to compare."""
    params = state.params
    return (params.n == 1 and params.greedy and not params.adjusts_logits and params.structured is None
            and not state.timings.local_prefill and state.attempts == 1 and bool(state.sequences[0].generated))
