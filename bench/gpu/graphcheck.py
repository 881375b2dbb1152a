"""Can one engine decode step be captured as a CUDA graph, and does its replay give the eager logits?

Runs `batch` short requests through prefill, schedules one decode step, builds the runner's inputs
once, runs the model eagerly, captures the same call in a `torch.cuda.graph` (after a warm-up on a
side stream, as capture requires) and replays it. Replaying rewrites the same K/V into the same slots.
"""

from __future__ import annotations

import time

import torch

from engine import Engine, SamplingParams


def capture_decode_step(engine: Engine, batch: int) -> dict:
    for i in range(batch):
        engine.add_request(f"cap{i}", list(range(100 + i, 120 + 3 * i)), SamplingParams(max_tokens=8, ignore_eos=True))
    while any(not engine._requests[f"cap{i}"].output_token_ids for i in range(batch)):
        engine.step()
    plan = engine.scheduler.schedule()
    runner = engine.runner
    ordered = sorted(plan.scheduled, key=lambda s: s.seq.num_computed_tokens)
    if any(s.num_tokens != 1 for s in ordered):
        raise RuntimeError("the scheduled step is not a pure decode step")
    ids, positions, slots, rows = runner._pack(ordered)
    meta = runner._metadata(ordered, len(ordered), slots, None)

    def step():
        return runner.model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False, logits_to_keep=rows, paged=meta).logits

    with torch.inference_mode():
        eager = step().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        graph.replay()
        torch.cuda.synchronize()
        err = float((static_out - eager).abs().max())
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t0) / 20 * 1e3
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / 20 * 1e3
    for i in range(batch):
        engine.abort(f"cap{i}")
    if err > 1e-4:
        raise RuntimeError(f"graph replay differs from eager by {err}")
    return {"batch": batch, "max_abs_err": err, "replay_ms": round(replay_ms, 3), "eager_ms": round(eager_ms, 3)}
