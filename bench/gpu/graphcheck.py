"""Do the engine's decode CUDA graphs give the eager logits, and how much faster are they?

Prefills `batch` requests, then runs the same decode step (rewriting the same K/V slots) through the
runner with its captured graphs and again with the graphs set aside (eager, same decode kernel).
"""

from __future__ import annotations

from bench.gpu.correctness import prefilled
from bench.gpu.device import time_ms
from engine import Engine
from engine.scheduler import ScheduledSeq


def capture_decode_step(engine: Engine, batch: int, iters: int = 20) -> dict:
    runner = engine.runner
    if runner.graphs is None:
        raise RuntimeError(f"the engine captured no CUDA graphs (decode kernel {runner.decode_kernel!r}): {runner.fallback_reason}")
    seqs = prefilled(engine, batch, 40, 8)
    try:
        items = [ScheduledSeq(seq, 1).step_item() for seq in seqs]
        device = str(runner.device)
        graph_logits = runner.execute(items)[1].float().clone()
        graph_ms = time_ms(lambda: runner.execute(items), device, iters)
        saved, runner.graphs = runner.graphs, None
        try:
            eager_logits = runner.execute(items)[1].float()
            eager_ms = time_ms(lambda: runner.execute(items), device, iters)
        finally:
            runner.graphs = saved
        err = float((graph_logits - eager_logits).abs().max())
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
        engine.step()
    if err > 1e-3:
        raise RuntimeError(f"graph replay differs from eager by {err}")
    return {"batch": batch, "buckets": runner.graphs.sizes, "max_abs_err": err, "graph_ms": graph_ms, "eager_ms": eager_ms,
            "decode_kernel": runner.decode_kernel}
