"""KV bytes between two processes on one device: CUDA IPC (through torch.multiprocessing) and host staging.

Lifecycle of one measurement: the parent allocates a KV-shaped pool, spawns a child and hands it the
pool through a torch.multiprocessing queue (on CUDA that sends a CUDA IPC handle: the child maps the
parent's memory, no copy); the child allocates its own pool, copies the parent's blocks into it
(`contiguous`: one run of blocks; `gather`: a scattered block table, as after a busy prefill), checks
the bytes, and sends back the timings. The parent keeps its pool alive until the child answers.
`host_staged` is the fallback's cost in one process: device -> pinned host -> device.
On CPU the same code measures shared memory between processes (what the CPU test exercises).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from bench.gpu.device import time_ms


def _timed(fn, device: str, iters: int) -> tuple[float, float]:
    """(best, median) seconds of `fn()`."""
    t = time_ms(fn, device, iters, warmup=1)
    return t["ms_min"] / 1e3, t["ms_median"] / 1e3


def _copy_child(inbox, outbox, block_ids: list[int], iters: int) -> None:
    try:
        pool = inbox.get(timeout=120)  # [num_blocks, block_numel]: mapped from the parent
        device = str(pool.device)
        mine = torch.empty_like(pool)
        ids = torch.tensor(block_ids, device=pool.device)
        n = len(block_ids)
        cont_best, cont_med = _timed(lambda: mine[:n].copy_(pool[:n]), device, iters)
        gath_best, gath_med = _timed(lambda: mine.index_copy_(0, ids, pool.index_select(0, ids)), device, iters)
        ok = bool(torch.equal(mine[ids], pool[ids]))
        nbytes = n * pool[0].numel() * pool.element_size()
        outbox.put({
            "bytes": nbytes, "bytes_identical": ok, "ipc_device": device,
            "contiguous_gbps": round(nbytes / cont_best / 1e9, 3), "contiguous_gbps_median": round(nbytes / cont_med / 1e9, 3),
            "gather_gbps": round(nbytes / gath_best / 1e9, 3), "gather_gbps_median": round(nbytes / gath_med / 1e9, 3),
        })
    except Exception as exc:  # reported by the parent
        outbox.put({"error": f"{type(exc).__name__}: {exc}"})


@contextmanager
def _child(target, *args):
    """A spawned process running `target(inbox, outbox, *args)`: yields its two queues; joined on exit (killed if
    it hangs)."""
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(inbox, outbox, *args), daemon=True)
    proc.start()
    try:
        yield inbox, outbox
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


def _answer(outbox, timeout: float) -> dict:
    result = outbox.get(timeout=timeout)
    if "error" in result:
        raise RuntimeError(f"child: {result['error']}")
    return result


def ipc_copy(device: str, num_blocks: int, block_numel: int, dtype: torch.dtype, iters: int = 10, timeout: float = 120) -> dict:
    """Child process copies `num_blocks // 2` of the parent's blocks (every other block for `gather`)."""
    pool = torch.randn(num_blocks, block_numel, device=device).to(dtype)
    with _child(_copy_child, list(range(0, num_blocks, 2)), iters) as (inbox, outbox):
        inbox.put(pool)
        return _answer(outbox, timeout)


def host_staged(device: str, nbytes: int, iters: int = 10) -> dict:
    """Device -> pinned host -> device for `nbytes` (the fallback's two copies, no network in between)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    pinned = device.startswith("cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty_like(src)
    d2h, _ = _timed(lambda: host.copy_(src), device, iters)
    h2d, _ = _timed(lambda: dst.copy_(host), device, iters)
    return {
        "bytes": nbytes, "pinned": pinned, "d2h_gbps": round(nbytes / d2h / 1e9, 3), "h2d_gbps": round(nbytes / h2d / 1e9, 3),
        "staged_gbps": round(nbytes / (d2h + h2d) / 1e9, 3),
    }


def _event_child(inbox, outbox) -> None:
    try:
        pool, handle = inbox.get(timeout=120)
        event = torch.cuda.Event.from_ipc_handle(pool.device, handle)
        assert inbox.get(timeout=120) == "recorded"
        mine = torch.empty_like(pool)
        torch.cuda.current_stream(pool.device).wait_event(event)  # the parent's write, ordered on the device
        mine.copy_(pool)
        outbox.put({"bytes_after_wait_are_the_written_ones": bool((mine == 7).all())})
    except Exception as exc:  # reported by the parent
        outbox.put({"error": f"{type(exc).__name__}: {exc}"})


def ipc_event_order(device: str, numel: int = 1 << 26, sleep_cycles: int = 200_000_000, timeout: float = 120) -> dict:
    """A second process waits on the parent's interprocess CUDA event before copying a buffer that the parent
    writes after a ~0.1 s device sleep, without any host sync: the mechanism a per-layer KV hand-off between
    processes on one device needs. The copy sees the written bytes only if the wait orders it."""
    if not device.startswith("cuda"):
        raise RuntimeError("interprocess events need CUDA")
    pool = torch.zeros(numel, dtype=torch.uint8, device=device)
    event = torch.cuda.Event(interprocess=True)
    with _child(_event_child) as (inbox, outbox):
        inbox.put((pool, event.ipc_handle()))
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        pool.fill_(7)
        event.record()
        inbox.put("recorded")
        result = _answer(outbox, timeout)
        torch.cuda.synchronize()
    return {"bytes": numel, **result}
