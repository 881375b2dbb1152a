"""The engine's answers as `pdserve.v1` messages: a step's new tokens (with logprobs), the engine's stats
(a worker's `Stats` answer and heartbeat) and a prefill's stage timings. The workers' protocol glue
shared by both roles; the request side (sampling, finish reasons) is proto/convert.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from proto.pdserve.v1 import pdserve_pb2 as pb

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.outputs import RequestOutput


def chunk_from_output(out: RequestOutput, skip: int = 0) -> pb.TokenChunk:
    """The output's new tokens (after the first `skip`, already streamed) with their logprobs."""
    tokens = out.new_token_ids[skip:]
    chunk = pb.TokenChunk(token_ids=tokens, index=out.index)
    for token, lp, top in zip(tokens, out.logprobs, out.top_logprobs):
        chunk.logprobs.append(
            pb.Logprob(token_id=token, logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top.items()])
        )
    return chunk


async def worker_stats(engine: AsyncEngine, worker_id: str, role: int, draining: bool, request: pb.StatsRequest | None = None,
                       **extra) -> pb.WorkerStats:
    """A worker's `Stats` answer (and heartbeat payload) from its engine's stats (with its cached block
    hashes when `request` asks for them)."""
    s = await engine.stats()
    if request is not None and request.include_block_hashes:
        extra["cached_block_hashes"] = await engine.cached_block_hashes()
    return pb.WorkerStats(
        worker_id=worker_id,
        role=role,
        queued_requests=s.num_waiting + s.num_waiting_for_kv,
        queued_prompt_tokens=s.queued_prompt_tokens,
        running_requests=s.num_running,
        free_kv_blocks=s.free_blocks,
        total_kv_blocks=s.total_blocks,
        prefix_cache_hit_tokens=s.prefix_hit_tokens,
        prefix_cache_queried_tokens=s.prefix_query_tokens,
        preemptions=s.num_preemptions,
        prompt_tokens=s.prompt_tokens,
        generation_tokens=s.generation_tokens,
        steps=s.steps,
        step_seconds=s.step_seconds,
        prompt_steps=s.prompt_steps,
        prompt_step_seconds=s.prompt_step_seconds,
        spec_proposed_tokens=s.spec_proposed_tokens,
        spec_accepted_tokens=s.spec_accepted_tokens,
        spec_steps=s.spec_steps,
        draining=draining,
        timestamp_s=time.time(),
        **extra,
    )


def prefill_timings(received: float, first_out: RequestOutput, computed: float, kv_transfer_s: float = 0.0) -> pb.StageTimings:
    """Queue (call received -> the prompt's first engine step) and compute (-> first token sampled),
    measured on this process's clock; with the KV transfer they add up to the call's time here."""
    started = first_out.first_step_at or received
    return pb.StageTimings(prefill_queue_s=max(0.0, started - received), prefill_compute_s=computed - max(started, received),
                           kv_transfer_s=kv_transfer_s)
