"""Section 5 of the device check: router + prefill worker + decode worker as plain processes on one device.

Lifecycle: save a random-weight model (with the SmolLM2 tokenizer) into a temporary directory, run
the prompts through an in-process Engine for the expected greedy tokens, free it, start the three
processes with bench.cluster's launcher (python -m router / prefill_worker / decode_worker, KV over
the `tcp` transport, engine.device as the check's), send one burst of streaming greedy requests
through the router's gRPC `Generate`, stamp every streamed chunk, stop everything and delete the
directory. The KV leaves the prefill worker's device pool through host memory (kvtransfer's
`tensor_bytes` copies device tensors to the host) and lands through a host staging buffer: that is
the path measured here; the JSON says so.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu import correctness, models
from bench.gpu.harness import log
from bench.gpu.settings import CheckSettings
from engine.model_loader import load_model

KV_PATH = "tcp transport, host-staged: device -> host copy on the prefill worker, host staging -> device on the decode worker"


def section_disaggregated(s: CheckSettings) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    try:
        model_dir, tokenizer = _save_model(s, workdir / "model")
        prompts = correctness.random_prompts(tokenizer, s.disagg_requests, s.disagg_prompt_len, seed=3)
        expected = _engine_tokens(model_dir, s, prompts)
        log(f"disaggregated: expected tokens ready; starting router, prefill, decode on {s.device}")
        records = _run_cluster(workdir, model_dir, s, prompts)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _summary(records, expected)


def _save_model(s: CheckSettings, target: Path) -> tuple[Path, object]:
    loaded = models.build(s.disagg_shape, "float32", s.device)
    loaded.model.save_pretrained(target)
    loaded.tokenizer.save_pretrained(target)
    return target, loaded.tokenizer


def _engine_tokens(model_dir: Path, s: CheckSettings, prompts: list[list[int]]) -> list[list[int]]:
    loaded = load_model(str(model_dir), "float32", s.device)
    engine = correctness.make_engine(loaded, s.device, kv_cache_memory_mb=1024, max_num_seqs=64)
    tokens = correctness.engine_greedy(engine, prompts, s.disagg_tokens, ignore_eos=True)
    del engine, loaded
    gc.collect()
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return tokens


def _run_cluster(workdir: Path, model_dir: Path, s: CheckSettings, prompts: list[list[int]]) -> list[dict]:
    from bench.cluster import LocalCluster, write_config

    engine = {"model": str(model_dir), "dtype": "float32", "device": s.device, "max_num_seqs": 64}
    engine["kv_cache_memory_fraction" if s.device.startswith("cuda") else "kv_cache_memory_mb"] = 0.05 if s.device.startswith("cuda") else 256
    config = write_config(workdir / "config.yaml", transport="tcp", engine=engine)
    with LocalCluster(config, num_prefill=1, num_decode=1) as cluster:
        log("disaggregated: cluster up; sending the burst")
        records = asyncio.run(_burst(cluster.router.address, prompts, s.disagg_tokens))
        cluster.assert_no_leaked_blocks()
    return records


async def _burst(address: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    import grpc

    from proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        return await asyncio.gather(*(_one(stub, p, max_tokens) for p in prompts))


async def _one(stub, prompt: list[int], max_tokens: int) -> dict:
    from proto.pdserve.v1 import pdserve_pb2 as pb

    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), skip_detokenize=True)
    request.token_ids.ids.extend(prompt)
    start, times, tokens, error, timings = time.perf_counter(), [], [], None, {}
    async for response in stub.Generate(request, timeout=120):
        if response.chunk.token_ids:
            times.append(time.perf_counter() - start)
            tokens.extend(response.chunk.token_ids)
        if response.finish_reason:
            timings = {k: getattr(response.timings, k) for k in ("prefill_compute_s", "kv_transfer_s", "ttft_s")}
            if response.finish_reason == pb.FINISH_REASON_ERROR:
                error = f"{pb.ErrorCode.Name(response.error.code)}: {response.error.message}"
    return {"tokens": tokens, "chunk_times_s": times, "error": error, "server_timings": timings}


def _summary(records: list[dict], expected: list[list[int]]) -> dict:
    from bench.serve import summarize

    errors = [r["error"] for r in records if r["error"]]
    ttft = [r["chunk_times_s"][0] for r in records if r["chunk_times_s"]]
    itl = [b - a for r in records for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
    same = [r["tokens"] == e for r, e in zip(records, expected)]
    return {
        "requests": len(records), "errors": errors[:4], "outputs_equal_engine": sum(same), "all_equal": all(same) and not errors,
        "first_mismatch": next(({"request": i, "got": r["tokens"], "engine": e} for i, (r, e, ok) in enumerate(zip(records, expected, same)) if not ok), None),
        "ttft_ms": summarize(ttft), "itl_ms": summarize(itl), "kv_path": KV_PATH,
        "server_kv_transfer_ms_median": _median_ms([r["server_timings"].get("kv_transfer_s") for r in records]),
        "server_prefill_compute_ms_median": _median_ms([r["server_timings"].get("prefill_compute_s") for r in records]),
    }


def _median_ms(values: list) -> float | None:
    vals = sorted(v for v in values if v)
    return round(vals[len(vals) // 2] * 1e3, 3) if vals else None
