"""KV transfer between tensor-parallel workers: prefill TP = a ranks -> decode TP = b ranks, every
rank its own process, each prefill rank sending its KV heads straight to the decode ranks that own
them (kvtransfer.pieces). Measured next to TP = 1 -> TP = 1 in the same run: time from the first
rank's begin to the last rank's acknowledgement, and the bytes each rank moved.

The shapes are SmolLM2-135M's but with 4 KV heads (its 3 do not split over 2 ranks): 30 layers x 4
heads x 64 dims x fp32 x K+V = 61440 B/token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.kvmethods.base import reap, recv_reply, spawn

log = logging.getLogger("bench.kvtransfer")

LAYERS, HEADS, HEAD_DIM = 30, 4, 64
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))


def _layout(heads: int):
    from engine.kv_cache import KVLayout

    return KVLayout(num_layers=LAYERS, num_kv_heads=heads, head_dim=HEAD_DIM, block_size=16, dtype=torch.float32)


def _fingerprint() -> str:
    from kvtransfer import fingerprint

    return fingerprint(_layout(HEADS), json.dumps({"model_type": "bench"}))


def _decode_rank(conn: Connection, tp: int, rank: int, transport: str, max_tokens: int) -> None:
    from engine.kv_cache import KVCache
    from kvtransfer import KVReceiver
    from kvtransfer.sharding import head_range

    async def serve() -> None:
        cache = KVCache(_layout(HEADS // tp), num_blocks=max_tokens // 16 + 2)
        receiver = KVReceiver(cache, transport, heads=head_range(HEADS, tp, rank))
        conn.send(("ready", await receiver.start()))
        loop = asyncio.get_running_loop()
        while (message := await loop.run_in_executor(None, conn.recv))[0] != "stop":
            _, transfer_id, n = message
            expected = receiver.expect_pieces(transfer_id, list(range(-(-n // 16))), n, _fingerprint(), timeout=120)
            conn.send(("expecting",))
            conn.send(("done", (await expected).nbytes))
        await receiver.close()

    asyncio.run(serve())


def _prefill_rank(conn: Connection, tp: int, rank: int) -> None:
    from kvtransfer import KVSender
    from kvtransfer.pieces import PieceSend

    sender = KVSender(ack_timeout=120)
    kv: dict[int, list[torch.Tensor]] = {}
    conn.send(("ready", None))
    while (message := conn.recv())[0] != "stop":
        _, destination, n = message
        layers = kv.setdefault(n, [torch.rand(n, HEADS // tp, HEAD_DIM) for _ in range(2 * LAYERS)])
        began = time.monotonic()
        send = PieceSend(sender, destination, _layout(HEADS), n, rank, tp, ack_timeout=120)
        for layer in range(LAYERS):
            send.send_layer(layer, layers[2 * layer], layers[2 * layer + 1])
        send.finish(0)
        nbytes = asyncio.run_coroutine_threadsafe(send.wait(120), sender.loop).result()
        conn.send(("sent", (began, time.monotonic(), nbytes)))
    sender.close()


def _one_transfer(decoders: list[Connection], prefillers: list[Connection], endpoints: list, transfer_id: str, n: int) -> dict:
    from kvtransfer.pieces import Destination

    for conn in decoders:
        conn.send(("expect", transfer_id, n))
    for conn in decoders:
        recv_reply(conn, 60)
    destination = Destination(transfer_id, _fingerprint(), endpoints, HEADS)
    for conn in prefillers:
        conn.send(("send", destination, n))
    sent = [recv_reply(conn, 180)[1] for conn in prefillers]
    received = [recv_reply(conn, 180)[1] for conn in decoders]
    return {"seconds": max(end for _, end, _ in sent) - min(began for began, _, _ in sent),
            "prefill_rank_bytes": [b for _, _, b in sent], "decode_rank_bytes": received}


def bench_layout(prefill_tp: int, decode_tp: int, tokens: list[int], repeats: int, transport: str) -> dict[str, Any]:
    decoders = [spawn(_decode_rank, decode_tp, r, transport, max(tokens)) for r in range(decode_tp)]
    prefillers = [spawn(_prefill_rank, prefill_tp, r) for r in range(prefill_tp)]
    procs = [p for p, _ in decoders + prefillers]
    conns = [c for _, c in decoders + prefillers]
    try:
        endpoints = [recv_reply(c, 120)[1] for _, c in decoders]
        for _, c in prefillers:
            recv_reply(c, 120)
        runs: dict[int, list[dict]] = {n: [] for n in tokens}
        for rnd in range(repeats + 1):
            for n in tokens:
                run = _one_transfer([c for _, c in decoders], [c for _, c in prefillers], endpoints, f"tp{rnd}-{n}", n)
                if rnd:  # round 0 warms connections and buffers up
                    runs[n].append(run)
    finally:
        reap(procs, conns)
    return {str(n): _summary(n, found) for n, found in runs.items()}


def _summary(n: int, runs: list[dict]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    return {
        "bytes": n * BYTES_PER_TOKEN,
        "seconds_best": round(min(seconds), 6),
        "seconds_median": round(statistics.median(seconds), 6),
        "gbps_best": round(n * BYTES_PER_TOKEN / min(seconds) / 1e9, 3),
        "prefill_rank_bytes": runs[0]["prefill_rank_bytes"],
        "decode_rank_bytes": runs[0]["decode_rank_bytes"],
    }


def bench_tensor_parallel(tokens: list[int], repeats: int, transport: str = "ucx") -> dict[str, Any]:
    """Every layout of LAYOUTS, one after the other; time relative to 1x1 at each size."""
    results = {}
    for prefill_tp, decode_tp in LAYOUTS:
        key = f"prefill_tp{prefill_tp}_to_decode_tp{decode_tp}"
        log.info("tensor parallel: %s", key)
        results[key] = bench_layout(prefill_tp, decode_tp, tokens, repeats, transport)
    base = results["prefill_tp1_to_decode_tp1"]
    for per_size in results.values():
        for n, summary in per_size.items():
            summary["time_vs_tp1"] = round(summary["seconds_best"] / base[n]["seconds_best"], 3)
    return {"transport": transport, "kv_shape": dataclasses.asdict(_layout(HEADS)) | {"dtype": "float32"},
            "bytes_per_token": BYTES_PER_TOKEN, "results": results}
